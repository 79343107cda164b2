"""``Dispatcher``: deterministic expert-parallel dispatch and combine over the symmetric heap.

Set up once per EP group (hidden size, dtype, top-k, number of experts, bound on tokens
per rank). Then, per micro-batch:

* :meth:`Dispatcher.dispatch` ``(x[T, H], expert_ids[T, K], weights[T, K])`` moves every
  (token, slot) pair to its expert's rank. The receive buffer is expert-major: local
  expert, then source rank, then the source's token-then-slot order -- ready for a grouped
  GEMM without padding. Each token crosses to a rank once, however many of its experts
  live there; the receiver copies it into each expert's rows. Or, set up with
  ``expert_input=True``, the receive buffer lives in the heap and each source writes each
  pair's row straight into its final row there (one pass instead of a send and a copy, the
  same rows and bits; it moves a row per pair, not per rank, across the links).
* :meth:`Dispatcher.combine` ``(y, handle)`` returns, per source token, the gate-weighted
  sum of its K expert outputs in slot order with fp32 accumulation. Each expert output row
  is sent back to its source, which sums; or, set up with ``expert_output=True`` and the
  experts writing into :meth:`Dispatcher.expert_output`, each source reads its rows where
  they lie (one pass over the rows instead of a send and a sum, the same bits).
* Backward: :meth:`dispatch_backward` sums the K row gradients of a token (a combine
  without gates); :meth:`combine_backward` sends the output gradient to the experts scaled
  by the gates (a dispatch) and returns the gate gradients.

Every result is bitwise equal to :mod:`ultraep.token.reference` regardless of rank count
or timing: row addresses come from stable key positions and prefix sums of a gathered
count table (no atomics decide an address) and every sum runs in a fixed order.

Expert ids are global in ``[0, num_experts)`` and live on rank ``id // experts_per_rank``
(default ``num_experts // R``). For a balanced layer pass the planner's physical slot ids
with :meth:`Dispatcher.for_layout` (``experts_per_rank = layout.slots_per_rank``).

Output sizes: the receive buffer has ``max_recv_rows`` rows (set-up bound, default the
worst case ``R * max_tokens * top_k``); the rows in use are ``offsets[-1]``. On the GPU the
whole map is computed on the device and nothing waits for the host; a routing that would
exceed the bound is refused on every rank before anything is written.

The work is done by one of two implementations, chosen once at set-up (the library's
backend pattern, :mod:`ultraep.runtime.backend`): :class:`~ultraep.token.host.HostDispatcher`
(NumPy over MPI shared memory) or :class:`~ultraep.token.device.DeviceDispatcher` (the
``raw_kernels/dispatch.cu`` kernels over CUDA IPC). They see only a frozen
:class:`~ultraep.token.base.TokenConfig` and their heap buffers, never this class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ultraep.errors import ClosedError, DispatchError
from ultraep.planner.layout import ExpertLayout
from ultraep.runtime import open_heap
from ultraep.runtime.backend import choose_backend
from ultraep.runtime.dtypes import is_bool, is_int, resolve_dtype
from ultraep.runtime.group import EPGroup
from ultraep.runtime.heap import HeapBacked, HeapRequirements, SymmetricHeap, timeout_error
from ultraep.runtime.kernels import kernel_constant
from ultraep.token.base import (KERNELS, DispatchHandle, DispatchResult, TokenBackend, TokenBuffers, TokenConfig,
                                Traffic, check_handle, table_columns)


DEFAULT_TIMEOUT_S = 30.0
HEAP_PREFIX = "token."
MAX_TOP_K = kernel_constant(KERNELS, "WARP")
MAX_RANKS = kernel_constant(KERNELS, "MAX_RANKS")
VECTOR_BYTES = kernel_constant(KERNELS, "VECTOR_BYTES")


def _is_positive_int(value) -> bool:
    return is_int(value) and value >= 1


def _set_up(num_ranks: int, hidden, dtype, top_k, num_experts, max_tokens, experts_per_rank, max_recv_rows) -> dict:
    """The set-up arguments checked and completed (defaults filled in); DispatchError if bad."""
    try:
        dtype = resolve_dtype(dtype, what="dispatcher dtype")
    except ValueError as exc:
        raise DispatchError(str(exc)) from None
    if dtype.kind not in "fV":
        raise DispatchError(f"dispatcher dtype must be a float type, got {dtype}")
    for name, value in (("num_ranks", num_ranks), ("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts),
                        ("max_tokens", max_tokens)):
        if not _is_positive_int(value):
            raise DispatchError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("experts_per_rank", experts_per_rank), ("max_recv_rows", max_recv_rows)):
        if not (value is None or _is_positive_int(value)):
            raise DispatchError(f"{name} must be a positive int (or None for the default), got {value!r}")
    if num_ranks > MAX_RANKS:
        raise DispatchError(f"the token path serves at most {MAX_RANKS} ranks, the group has {num_ranks}")
    if experts_per_rank is None:
        if num_experts % num_ranks:
            raise DispatchError(f"num_experts ({num_experts}) is not divisible by the group size ({num_ranks}); "
                                "pass experts_per_rank")
        experts_per_rank = num_experts // num_ranks
    if experts_per_rank * num_ranks != num_experts:
        raise DispatchError(f"experts_per_rank ({experts_per_rank}) x ranks ({num_ranks}) != num_experts "
                            f"({num_experts})")
    if top_k > MAX_TOP_K:
        raise DispatchError(f"top_k must be <= {MAX_TOP_K} (a warp's lanes hold a token's slots), got {top_k}")
    if hidden * dtype.itemsize % VECTOR_BYTES:
        raise DispatchError(f"a row of hidden={hidden} {dtype} is {hidden * dtype.itemsize} bytes; "
                            f"rows must be a multiple of {VECTOR_BYTES} bytes ({VECTOR_BYTES}-byte vector copies)")
    worst = num_ranks * max_tokens * top_k
    max_recv_rows = worst if max_recv_rows is None else max_recv_rows
    if worst >= 2**31:
        raise DispatchError(f"ranks x max_tokens x top_k = {worst} must fit in int32")
    return dict(hidden=int(hidden), dtype=dtype, top_k=int(top_k), num_experts=int(num_experts),
                experts_per_rank=int(experts_per_rank), max_tokens=int(max_tokens),
                max_recv_rows=int(min(max_recv_rows, worst)))


def _flags(**flags) -> dict:
    """Each on/off set-up argument as a Python bool; DispatchError for anything but True or False
    (NumPy's too): a truthy string or an array would otherwise be read as True, or not at all."""
    for name, value in flags.items():
        if not is_bool(value):
            raise DispatchError(f"{name} must be True or False, got {value!r}")
    return {name: bool(value) for name, value in flags.items()}


class Dispatcher(HeapBacked):
    """Deterministic dispatch/combine for one EP group; see the module docstring.

    Collective: every rank constructs it with the same arguments. ``backend`` is
    ``"device"``, ``"host"`` or ``"auto"`` (the device where the group has a GPU). Use as a context
    manager or call :meth:`close` (collective: queued work finished first). Results already
    returned are the caller's own arrays, not views of the heap: they stay valid after it.

    ``heap``: a symmetric heap the caller opened for several components (size it with
    :meth:`heap_requirements` added to theirs); the dispatcher allocates in it, takes its
    backend (a contradicting ``backend`` is an error) and leaves it open at :meth:`close`.
    Without one, the dispatcher opens a heap of its own and closes it.

    ``sync_checks=True``: every call checks its input shapes collectively and, on the GPU,
    waits for the device's verdict (bad expert ids, non-finite gates, receive-bound overflow, a
    timed-out wait), raising the same error on every rank. ``False``: shapes are checked
    on this rank only and device errors surface at :meth:`check` -- nothing waits for the
    host, for pipelines and benchmarks. Either way a refused routing writes nothing.
    A rank that never makes a call: with ``sync_checks`` the others wait in the host
    collective (MPI has no timeout); without, their device/heap waits give up after
    ``timeout_s`` and the error names the missing rank.

    ``expert_input=True``: the receive buffer (``DispatchResult.x``) is this rank's rows in
    the heap (:meth:`expert_input`), which every source writes each (token, slot) pair
    into directly: no landing rows, no expansion pass, the same rows, bits and handle. The
    buffer is valid until this rank's next dispatch (peers write into it only after that
    dispatch's count exchange): copy what a later step needs past that (a backward's
    weight gradient, say). Each pair crosses the links on its own, where the default sends
    a token to a rank once: the default saves link bytes on real multi-GPU nodes; this
    option saves HBM passes where ranks share a GPU or memory bandwidth is what binds.

    ``grid``: blocks of the device's persistent copy kernels (the sends, the expansion,
    the combine's sends, sums and pulls), at most as many as the GPU holds resident at
    once (:attr:`max_grid`); None: two blocks per SM. The same on every rank; the host
    backend checks it and has no use for it (``ultraep.tune`` chooses it per problem).
    """

    _next_id = 0

    def __init__(self, group: EPGroup, *, hidden: int, dtype: Any, top_k: int, num_experts: int, max_tokens: int,
                 experts_per_rank: int | None = None, max_recv_rows: int | None = None, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, sync_checks: bool = True, heap: SymmetricHeap | None = None,
                 expert_output: bool = False, expert_input: bool = False, grid: int | None = None):
        if not isinstance(group, EPGroup):  # no group to tell the other ranks through: every rank passed it
            raise TypeError(f"Dispatcher needs an ultraep EPGroup, got {type(group).__name__} (wrap a communicator "
                            "in EPGroup(comm))")
        error, settings, flags = None, None, None
        try:
            settings = _set_up(group.size, hidden, dtype, top_k, num_experts, max_tokens, experts_per_rank,
                               max_recv_rows)
            flags = _flags(sync_checks=sync_checks, expert_output=expert_output, expert_input=expert_input)
            if (bad_timeout := timeout_error(timeout_s)) is not None:
                raise DispatchError(bad_timeout)
            if not (grid is None or _is_positive_int(grid)):
                raise DispatchError(f"grid must be None or a positive int (blocks of the copy kernels), got {grid!r}")
        except DispatchError as exc:
            error = exc
        group.raise_if_any(error, "Dispatcher set-up")
        sync_checks, expert_output, expert_input = flags["sync_checks"], flags["expert_output"], flags["expert_input"]
        grid = None if grid is None else int(grid)
        group.agree(tuple(v.str if isinstance(v, np.dtype) else v for v in settings.values())
                    + (float(timeout_s), sync_checks, expert_output, expert_input, grid),
                    f"Dispatcher set-up ({', '.join(settings)}, timeout_s, sync_checks, expert_output, expert_input, "
                    "grid)")
        self.group = group
        self.id = Dispatcher._next_id
        Dispatcher._next_id += 1
        self.config = TokenConfig(**settings, rank=group.rank, size=group.size, timeout_s=float(timeout_s),
                                  sync_checks=sync_checks, dispatcher_id=self.id, expert_output=expert_output,
                                  expert_input=expert_input, grid=grid, serial=group.next_serial("Dispatcher"))
        c = self.config
        self.rank, self.size, self.hidden, self.dtype, self.top_k = c.rank, c.size, c.hidden, c.dtype, c.top_k
        self.num_experts, self.experts_per_rank, self.max_tokens = c.num_experts, c.experts_per_rank, c.max_tokens
        self.max_recv_rows, self.timeout_s, self.sync_checks = c.max_recv_rows, c.timeout_s, c.sync_checks
        self.backend = self._backend_of(group, backend, heap)
        requirements = self.heap_requirements(group.size, **settings, expert_output=expert_output,
                                              expert_input=expert_input)
        self._owns_heap = heap is None
        if heap is None:
            heap = open_heap(group, requirements, backend=self.backend)
        self.heap = heap
        self._closed = False
        try:
            buffers = TokenBuffers.of(heap, heap.allocate(requirements), HEAP_PREFIX)
            if self.backend == "device":
                from ultraep.token.device import DeviceDispatcher
                self._impl: TokenBackend = DeviceDispatcher(group, self.config, buffers)
            else:
                from ultraep.token.host import HostDispatcher
                self._impl = HostDispatcher(group, self.config, buffers)
        except BaseException as exc:
            self._give_up(exc)  # a lone failure is published to the peers, not waited out
            raise

    @staticmethod
    def _backend_of(group: EPGroup, requested: str, heap: SymmetricHeap | None) -> str:
        """Collective: the backend, chosen once; a given heap's decides it."""
        if heap is None:
            return choose_backend(group, requested, "Dispatcher backend")
        error = None
        if not isinstance(heap, SymmetricHeap):
            error = f"heap must be an ultraep SymmetricHeap (open_heap) or None, got {type(heap).__name__}"
        elif heap.size != group.size or heap.rank != group.rank:
            error = f"the heap is rank {heap.rank} of {heap.size}, the group's rank {group.rank} of {group.size}"
        elif requested not in ("auto", heap.backend):
            error = f"backend={requested!r} contradicts the given heap, a {heap.backend!r} heap"
        group.raise_if_any(error, "Dispatcher backend")
        return group.agree(heap.backend, "Dispatcher backend (the given heap's)")

    @staticmethod
    def heap_requirements(num_ranks: int, *, hidden: int, dtype: Any, top_k: int, num_experts: int, max_tokens: int,
                          experts_per_rank: int | None = None, max_recv_rows: int | None = None,
                          expert_output: bool = False, expert_input: bool = False) -> HeapRequirements:
        """What a dispatcher of these set-up arguments allocates in its heap, on either
        backend: its symmetric tensors and the signal block of the device's barriers."""
        c = _set_up(num_ranks, hidden, dtype, top_k, num_experts, max_tokens, experts_per_rank, max_recv_rows)
        expert_output, expert_input = _flags(expert_output=expert_output, expert_input=expert_input).values()
        R, T, K, H, rows, data = num_ranks, c["max_tokens"], c["top_k"], c["hidden"], c["max_recv_rows"], c["dtype"]
        tensors = [
            # Row s: source s's pair count per expert, its token count per destination
            # rank (the single sends), then its first bad input (code, token, slot, value).
            ("count_table", (R, table_columns(c["num_experts"], R)), np.int32),
            ("landing", (R * T, H), data),          # row s*T+u: source s's u-th token sent here
            ("row_weight", (rows,), np.float32),    # per received row: its gate,
            ("row_landing", (rows,), np.int32),     # the landing row holding its token,
            ("row_origin", (rows,), np.int32),      # and its origin s*T*K + t*K + k
            ("slot_rows", (T * K, H), data),        # combine: slot (t, k)'s expert output, at the source
            ("slot_grad_w", (T * K,), np.float32),  # combine backward: slot (t, k)'s gate gradient
        ]
        if expert_output:
            tensors.append(("expert_out", (rows, H), data))  # the experts' output rows, read by their sources
        if expert_input:
            tensors.append(("expert_in", (rows, H), data))   # the receive buffer, written by the sources
        return HeapRequirements.of(tensors=[(HEAP_PREFIX + name, shape, dt) for name, shape, dt in tensors],
                                   signals=[(HEAP_PREFIX + "sync", R)])

    @classmethod
    def for_layout(cls, group: EPGroup, layout: ExpertLayout, **kwargs: Any) -> "Dispatcher":
        """A dispatcher over a planner layout's physical slots (``Plan`` reroute output)."""
        error = (f"layout must be an ExpertLayout, got {type(layout).__name__}" if not isinstance(layout, ExpertLayout)
                 else f"layout has {layout.num_ranks} ranks, the group {group.size}"
                 if layout.num_ranks != group.size else None)
        group.raise_if_any(error, "Dispatcher.for_layout")  # a rank refusing alone would leave its peers waiting
        return cls(group, num_experts=layout.num_physical, experts_per_rank=layout.slots_per_rank, **kwargs)

    @property
    def grid(self) -> int | None:
        """Blocks of the device's copy kernels in use (None on the host backend)."""
        return getattr(self._impl, "grid", None)

    @property
    def max_grid(self) -> int | None:
        """The most blocks ``grid`` may be on this group's GPUs (None on the host backend)."""
        return getattr(self._impl, "max_grid", None)

    @property
    def row_bytes(self) -> int:
        return self.config.row_bytes

    # -- the token path -------------------------------------------------------------------
    # ``out`` (optional, every call): a preallocated, writable result buffer of the
    # documented shape; only its valid rows are written.
    def _check_open(self, collective: str | None = None) -> None:
        """ClosedError once closed; in a ``collective`` call with ``sync_checks`` after entering
        one collective, so that peers in the call's input check raise GroupMismatchError at
        once (a Dispatcher on a caller's heap closes without any collective of its own)."""
        if not self._closed:
            return
        error = ClosedError(f"rank {self.rank}: the Dispatcher is closed")
        if collective is not None and self.sync_checks:
            self.group.refuse_closed(error, f"Dispatcher.{collective} on a closed Dispatcher")
        raise error

    def dispatch(self, x: Any, expert_ids: Any, weights: Any, *, out: Any = None) -> DispatchResult:
        """Send every (token, slot) to its expert; see the module docstring. Set up with
        ``expert_input=True``, ``out`` must be None or :meth:`expert_input` and the result's
        ``x`` is that heap buffer."""
        self._check_open("dispatch")
        return self._impl.dispatch(x, expert_ids, weights, out)

    def expert_output(self) -> Any:
        """This rank's ``[max_recv_rows, H]`` rows in the heap for the expert outputs (set up with
        ``expert_output=True``): write ``y`` here (e.g. a grouped GEMM's ``out``) and pass this
        buffer to :meth:`combine` or :meth:`dispatch_backward`, and the sources read their rows
        from it directly. It is rewritten by the next micro-batch's experts, and a combine
        from it returns only when every rank has read what it needs."""
        self._check_open()
        if not self.config.expert_output:
            raise DispatchError("expert_output(): this Dispatcher was set up without expert_output=True")
        return self._impl.expert_output()

    def expert_input(self) -> Any:
        """This rank's ``[max_recv_rows, H]`` receive buffer in the heap (set up with
        ``expert_input=True``): every dispatch writes its rows here and returns it as
        ``DispatchResult.x``; valid until this rank's next dispatch."""
        self._check_open()
        if not self.config.expert_input:
            raise DispatchError("expert_input(): this Dispatcher was set up without expert_input=True")
        return self._impl.expert_input()

    def combine(self, y: Any, handle: DispatchHandle, *, out: Any = None) -> Any:
        """Per source token ``[T, H]``: gate-weighted sum of its expert outputs ``y[max_recv_rows, H]``,
        slot order, fp32 accumulation, cast to the set-up dtype. With ``y`` the
        :meth:`expert_output` buffer (on every rank), the rows are read where they lie."""
        self._check_open("combine")
        return self._impl.combine(y, handle, True, out)

    def dispatch_backward(self, grad_recv: Any, handle: DispatchHandle, *, out: Any = None) -> Any:
        """Gradient of dispatch w.r.t. ``x``: per token, the unweighted slot-order sum of its rows' gradients."""
        self._check_open("dispatch_backward")
        return self._impl.combine(grad_recv, handle, False, out)

    def combine_backward(self, grad_out: Any, y: Any, handle: DispatchHandle, *, out: Any = None) -> Any:
        """Gradients of combine: ``(grad_y[max_recv_rows, H], grad_weights[T, K] float32)``.

        ``grad_y[row] = gate * grad_out[token]`` (fp32 product, cast); ``grad_weights[t, k]``
        is the fp32 dot product of ``grad_out[t]`` and slot k's expert output in a fixed
        order (:func:`ultraep.token.reference.lane_dot`)."""
        self._check_open("combine_backward")
        return self._impl.combine_backward(grad_out, y, handle, out)

    def traffic(self, handle: DispatchHandle) -> Traffic:
        """What the dispatch of ``handle`` sent from this rank (reads E + R integers from the device):
        ``sends`` rows with the two-pass dispatch, ``pairs`` with ``expert_input`` (a row per pair)."""
        self._check_open()
        check_handle(handle, self.id)
        totals = handle.state["totals"]
        totals = np.asarray(totals.get() if hasattr(totals, "get") else totals, dtype=np.int64)
        pairs_per_rank = totals[:self.num_experts].reshape(self.size, self.experts_per_rank).sum(axis=1)
        sends_per_rank = totals[self.num_experts:]
        pairs, sends = int(pairs_per_rank.sum()), int(sends_per_rank.sum())
        return Traffic(pairs=pairs, pairs_remote=pairs - int(pairs_per_rank[self.rank]),
                       sends=sends, sends_remote=sends - int(sends_per_rank[self.rank]), row_bytes=self.row_bytes)

    def check(self) -> None:
        """Wait for queued work and raise any deferred device-side error (device backend)."""
        self._check_open()
        self._impl.check()

    def _close_parts(self) -> None:  # HeapBacked.close: queued work finished, then an own heap
        self._impl.close()
