"""``Dispatcher``: deterministic expert-parallel dispatch and combine over the symmetric heap.

Set up once per EP group (hidden size, dtype, top-k, number of experts, bound on tokens
per rank). Then, per micro-batch:

* :meth:`Dispatcher.dispatch` ``(x[T, H], expert_ids[T, K], weights[T, K])`` moves every
  (token, slot) pair to its expert's rank. The receive buffer is expert-major: local
  expert, then source rank, then the source's token-then-slot order -- ready for a grouped
  GEMM without padding. Each token crosses to a rank once, however many of its experts
  live there; the receiver copies it into each expert's rows.
* :meth:`Dispatcher.combine` ``(y, handle)`` returns, per source token, the gate-weighted
  sum of its K expert outputs in slot order with fp32 accumulation.
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ultraep.errors import DispatchError
from ultraep.runtime.backend import choose_backend
from ultraep.runtime.dtypes import resolve_dtype
from ultraep.runtime.group import EPGroup

DEFAULT_TIMEOUT_S = 30.0
# Error record codes (shared by the NumPy and CUDA executors).
BAD_EXPERT_ID, NAN_GATE = 1, 2


def bad_input_message(rank: int, code: int, token: int, slot: int, value, num_experts: int) -> str:
    if code == BAD_EXPERT_ID:
        return f"rank {rank}: expert id {value} at token {token}, slot {slot} is outside [0, {num_experts})"
    return f"rank {rank}: gate weight at token {token}, slot {slot} is NaN"


def first_bad_item(expert_ids: np.ndarray, weights: np.ndarray, num_experts: int):
    """(code, token, slot, value) of the first bad (token, slot) in token-then-slot order, or None."""
    ids = np.asarray(expert_ids)
    bad_id = (ids < 0) | (ids >= num_experts)
    bad = bad_id | np.isnan(np.asarray(weights, dtype=np.float32))
    if not bad.any():
        return None
    t, k = np.unravel_index(int(np.argmax(bad.ravel())), bad.shape)
    code = BAD_EXPERT_ID if bad_id[t, k] else NAN_GATE
    return code, int(t), int(k), int(ids[t, k])


def table_columns(num_experts: int, num_ranks: int) -> int:
    return num_experts + num_ranks + 4


@dataclass
class TokenBuffers:
    """The dispatcher's symmetric tensors (see :meth:`Dispatcher.heap_layout`)."""

    heap: Any
    count_table: Any
    landing: Any
    row_weight: Any
    row_landing: Any
    row_origin: Any
    slot_rows: Any
    slot_grad_w: Any


@dataclass(frozen=True)
class Traffic:
    """Rows one dispatch sent from this rank: a row per (token, slot) pair would be
    ``pairs``; one send per (token, destination rank) moves ``sends``. ``*_remote``
    leaves out this rank itself."""

    pairs: int
    pairs_remote: int
    sends: int
    sends_remote: int
    row_bytes: int

    @property
    def bytes_saved(self) -> int:
        return (self.pairs - self.sends) * self.row_bytes

    @property
    def bytes_saved_remote(self) -> int:
        return (self.pairs_remote - self.sends_remote) * self.row_bytes


@dataclass
class DispatchHandle:
    """What combine and the backward pair need from one dispatch (backend arrays inside)."""

    dispatcher_id: int
    tokens: int
    weights: Any                 # float32[T, K], this rank's gates
    expert_ids: Any              # int64[T, K]
    state: dict = field(default_factory=dict)  # executor-specific token map


@dataclass
class DispatchResult:
    """Received tokens: ``x[max_recv_rows, H]`` (rows ``[0, offsets[-1])`` in use),
    ``weights[max_recv_rows]`` the received gates, per local expert ``counts`` and
    ``offsets`` (one more entry, the total), and the ``handle`` for combine."""

    x: Any
    weights: Any
    counts: Any
    offsets: Any
    handle: DispatchHandle

    @property
    def num_rows(self) -> int:
        """Rows received (reads one integer from the device on the GPU backend)."""
        return int(self.offsets[-1])


class Dispatcher:
    """Deterministic dispatch/combine for one EP group; see the module docstring.

    Collective: every rank constructs it with the same arguments. ``backend`` is
    ``"device"``, ``"host"`` or ``"auto"`` (the device where the group has a GPU). Use as a context
    manager or call :meth:`close` (collective).

    ``sync_checks=True``: every call checks its input shapes collectively and, on the GPU,
    waits for the device's verdict (bad expert ids, NaN gates, receive-bound overflow, a
    timed-out wait), raising the same error on every rank. ``False``: shapes are checked
    on this rank only and device errors surface at :meth:`check` -- nothing waits for the
    host, for pipelines and benchmarks. Either way a refused routing writes nothing.
    A rank that never makes a call: with ``sync_checks`` the others wait in the host
    collective (MPI has no timeout); without, their device/heap waits give up after
    ``timeout_s`` and the error names the missing rank.
    """

    _next_id = 0

    def __init__(self, group: EPGroup, *, hidden: int, dtype, top_k: int, num_experts: int, max_tokens: int,
                 experts_per_rank: int | None = None, max_recv_rows: int | None = None, backend: str = "auto",
                 timeout_s: float = DEFAULT_TIMEOUT_S, sync_checks: bool = True):
        self.group = group
        self.rank, self.size = group.rank, group.size
        error = None
        try:
            self.dtype = resolve_dtype(dtype, what="dispatcher dtype")
            if self.dtype.kind not in "fV":
                raise ValueError(f"dispatcher dtype must be a float type, got {self.dtype}")
            for name, value in (("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts),
                                ("max_tokens", max_tokens)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                    raise ValueError(f"{name} must be a positive int, got {value!r}")
            if experts_per_rank is None:
                if num_experts % self.size:
                    raise ValueError(f"num_experts ({num_experts}) is not divisible by the group size ({self.size}); "
                                     "pass experts_per_rank")
                experts_per_rank = num_experts // self.size
            if experts_per_rank * self.size != num_experts:
                raise ValueError(f"experts_per_rank ({experts_per_rank}) x ranks ({self.size}) != num_experts ({num_experts})")
            if top_k > 32:
                raise ValueError(f"top_k must be <= 32 (a warp's lanes hold a token's slots), got {top_k}")
            if hidden * self.dtype.itemsize % 16:
                raise ValueError(f"a row of hidden={hidden} {self.dtype} is {hidden * self.dtype.itemsize} bytes; "
                                 "rows must be a multiple of 16 bytes (16-byte vector copies)")
            worst = self.size * max_tokens * top_k
            max_recv_rows = worst if max_recv_rows is None else max_recv_rows
            if isinstance(max_recv_rows, bool) or not isinstance(max_recv_rows, (int, np.integer)) or max_recv_rows < 1:
                raise ValueError(f"max_recv_rows must be a positive int, got {max_recv_rows!r}")
            if worst >= 2**31:
                raise ValueError(f"ranks x max_tokens x top_k = {worst} must fit in int32")
        except ValueError as exc:
            error = exc
        group.raise_if_any(error, "Dispatcher set-up")
        self.hidden, self.top_k, self.num_experts = int(hidden), int(top_k), int(num_experts)
        self.max_tokens, self.experts_per_rank = int(max_tokens), int(experts_per_rank)
        self.max_recv_rows = int(min(max_recv_rows, self.size * max_tokens * top_k))
        self.timeout_s = float(timeout_s)
        self.sync_checks = bool(sync_checks)
        group.agree((self.hidden, self.dtype.str, self.top_k, self.num_experts, self.max_tokens,
                     self.experts_per_rank, self.max_recv_rows), "Dispatcher set-up (hidden, dtype, top_k, "
                    "num_experts, max_tokens, experts_per_rank, max_recv_rows)")
        self.backend = backend = choose_backend(group, backend, "Dispatcher backend")
        self.id = Dispatcher._next_id
        Dispatcher._next_id += 1
        if backend == "device":
            from ultraep.token.device import GpuExecutor
            self._executor = GpuExecutor(self)
        else:
            from ultraep.token.host import CpuExecutor
            self._executor = CpuExecutor(self)

    @classmethod
    def for_layout(cls, group: EPGroup, layout, **kwargs) -> "Dispatcher":
        """A dispatcher over a planner layout's physical slots (``Plan`` reroute output)."""
        if layout.num_ranks != group.size:
            raise ValueError(f"layout has {layout.num_ranks} ranks, the group {group.size}")
        return cls(group, num_experts=layout.num_physical, experts_per_rank=layout.slots_per_rank, **kwargs)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    def heap_layout(self) -> list[tuple[str, tuple, Any]]:
        """The symmetric tensors every rank allocates, in order: (name, shape, dtype)."""
        R, T, K, E, rows = self.size, self.max_tokens, self.top_k, self.num_experts, self.max_recv_rows
        return [
            # Row s: source s's pair count per expert, its token count per destination
            # rank (the single sends), then its first bad input (code, token, slot, value).
            ("count_table", (R, table_columns(E, R)), np.int32),
            ("landing", (R * T, self.hidden), self.dtype),      # row s*T+u: source s's u-th token sent here
            ("row_weight", (rows,), np.float32),                 # per received row: its gate,
            ("row_landing", (rows,), np.int32),                  # the landing row holding its token,
            ("row_origin", (rows,), np.int32),                   # and its origin s*T*K + t*K + k
            ("slot_rows", (T * K, self.hidden), self.dtype),     # combine: slot (t, k)'s expert output, at the source
            ("slot_grad_w", (T * K,), np.float32),               # combine backward: slot (t, k)'s gate gradient
        ]

    def heap_bytes(self) -> int:
        """Symmetric heap data bytes this dispatcher needs per rank."""
        sizes = (math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in self.heap_layout())
        return sum(math.ceil(n / 256) * 256 for n in sizes) + 4096

    def open_buffers(self, backend: str) -> "TokenBuffers":
        """Collective: the dispatcher's symmetric heap and its tensors."""
        from ultraep.runtime import open_heap

        heap = open_heap(self.group, self.heap_bytes(), backend=backend)
        tensors = {name: heap.alloc(f"token.{name}", shape, dtype) for name, shape, dtype in self.heap_layout()}
        return TokenBuffers(heap=heap, **tensors)

    # -- checks ---------------------------------------------------------------------------
    def raise_if_any(self, error: Exception | None, what: str) -> None:
        """Collective raise (every rank, when ``sync_checks``), else a local one."""
        if self.sync_checks:
            self.group.raise_if_any(error, what)
        elif error is not None:
            raise error

    def check_tokens(self, x, expert_ids, weights) -> None:
        """Shape/dtype checks of dispatch input (values are checked by the executor)."""
        error = None
        try:
            if x.ndim != 2 or x.shape[1] != self.hidden:
                raise DispatchError(f"x: expected shape [tokens, {self.hidden}], got {tuple(x.shape)}")
            if not self._same_dtype(x):
                raise DispatchError(f"x: expected dtype {self.dtype}, got {x.dtype}")
            if x.shape[0] > self.max_tokens:
                raise DispatchError(f"x: {x.shape[0]} tokens exceed the set-up bound max_tokens={self.max_tokens}")
            want = (x.shape[0], self.top_k)
            if tuple(expert_ids.shape) != want or np.dtype(expert_ids.dtype).kind not in "iu":
                raise DispatchError(f"expert_ids: expected integer shape {list(want)}, got {expert_ids.dtype} "
                                    f"{list(expert_ids.shape)}")
            if tuple(weights.shape) != want or np.dtype(weights.dtype).kind not in "fV":
                raise DispatchError(f"weights: expected float shape {list(want)}, got {weights.dtype} {list(weights.shape)}")
        except DispatchError as exc:
            error = exc
        self.raise_if_any(error, "dispatch input check")

    def check_rows(self, arrays: dict, handle: DispatchHandle | None) -> None:
        """Checks of row arrays ``{name: (array or None, rows)}``: shape ``[rows, H]``, the set-up dtype."""
        error = None
        try:
            if handle is not None and handle.dispatcher_id != self.id:
                raise DispatchError("the handle comes from another Dispatcher")
            for name, (rows, first) in arrays.items():
                if rows is None:
                    continue
                if rows.ndim != 2 or rows.shape[1] != self.hidden or rows.shape[0] != first:
                    raise DispatchError(f"{name}: expected shape [{first}, {self.hidden}], got {tuple(rows.shape)}")
                if not self._same_dtype(rows):
                    raise DispatchError(f"{name}: expected dtype {self.dtype}, got {rows.dtype}")
        except DispatchError as exc:
            error = exc
        self.raise_if_any(error, "token path input check")

    def _same_dtype(self, array) -> bool:
        got = np.dtype(array.dtype)
        return got == self.dtype or (self.dtype.kind == "V" and got == np.int16)  # bf16 may arrive as its bits

    # -- the token path -------------------------------------------------------------------
    # ``out`` (optional, every call): a preallocated, writable result buffer of the
    # documented shape; only its valid rows are written.
    def dispatch(self, x, expert_ids, weights, *, out=None) -> DispatchResult:
        """Send every (token, slot) to its expert; see the module docstring."""
        return self._executor.dispatch(x, expert_ids, weights, out)

    def combine(self, y, handle: DispatchHandle, *, out=None):
        """Per source token ``[T, H]``: gate-weighted sum of its expert outputs ``y[max_recv_rows, H]``,
        slot order, fp32 accumulation, cast to the set-up dtype."""
        return self._executor.combine(y, handle, True, out)

    def dispatch_backward(self, grad_recv, handle: DispatchHandle, *, out=None):
        """Gradient of dispatch w.r.t. ``x``: per token, the unweighted slot-order sum of its rows' gradients."""
        return self._executor.combine(grad_recv, handle, False, out)

    def combine_backward(self, grad_out, y, handle: DispatchHandle, *, out=None):
        """Gradients of combine: ``(grad_y[max_recv_rows, H], grad_weights[T, K] float32)``.

        ``grad_y[row] = gate * grad_out[token]`` (fp32 product, cast); ``grad_weights[t, k]``
        is the fp32 dot product of ``grad_out[t]`` and slot k's expert output in a fixed
        order (:func:`ultraep.token.reference.lane_dot`)."""
        return self._executor.combine_backward(grad_out, y, handle, out)

    def traffic(self, handle: DispatchHandle) -> Traffic:
        """What the dispatch of ``handle`` sent from this rank (reads E + R integers from the device)."""
        totals = handle.state["totals"]
        totals = np.asarray(totals.get() if hasattr(totals, "get") else totals, dtype=np.int64)
        pairs_per_rank = totals[:self.num_experts].reshape(self.size, self.experts_per_rank).sum(axis=1)
        sends_per_rank = totals[self.num_experts:]
        return Traffic(pairs=int(pairs_per_rank.sum()), pairs_remote=int(pairs_per_rank.sum() - pairs_per_rank[self.rank]),
                       sends=int(sends_per_rank.sum()), sends_remote=int(sends_per_rank.sum() - sends_per_rank[self.rank]),
                       row_bytes=self.row_bytes)

    def check(self) -> None:
        """Wait for queued work and raise any deferred device-side error (GPU backend)."""
        self._executor.check()

    def close(self) -> None:
        """Collective: release the symmetric heap."""
        self._executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
