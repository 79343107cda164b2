"""What the ``Dispatcher`` and its two implementations share, below both of them.

* :class:`TokenConfig` -- the agreed set-up, frozen: all an implementation knows of its
  dispatcher;
* :class:`TokenBuffers` -- the symmetric tensors and the signal block it works in;
* :class:`TokenBackend` -- the interface :class:`~ultraep.token.host.HostDispatcher` and
  :class:`~ultraep.token.device.DeviceDispatcher` implement;
* the handle and result types, and the input checks both run before touching the heap.

The count table's bad-input record and its codes are ``raw_kernels/dispatch.cu``'s: read
from there, so the host and the kernels cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ultraep.errors import DispatchError
from ultraep.runtime import dtypes
from ultraep.runtime.group import EPGroup
from ultraep.runtime.kernels import kernel_constant

KERNELS = "dispatch.cu"
BAD_EXPERT_ID = kernel_constant(KERNELS, "BAD_EXPERT_ID")
NAN_GATE = kernel_constant(KERNELS, "NAN_GATE")
BAD_RECORD_FIELDS = kernel_constant(KERNELS, "BAD_RECORD_FIELDS")


@dataclass(frozen=True)
class TokenConfig:
    """A dispatcher's set-up, validated and agreed by every rank."""

    hidden: int
    dtype: np.dtype
    top_k: int
    num_experts: int
    experts_per_rank: int
    max_tokens: int
    max_recv_rows: int
    rank: int
    size: int
    timeout_s: float
    sync_checks: bool
    dispatcher_id: int    # handles carry it, so a handle from another dispatcher is refused
    serial: int = 0       # the group's count of Dispatchers before it: named in its checks (EPGroup.next_serial)
    expert_output: bool = False  # the heap holds expert_out: combine reads rows where they lie
    expert_input: bool = False   # the heap holds expert_in: dispatch writes each pair into its row there
    grid: int | None = None      # blocks of the device's persistent copy kernels (None: its default)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def slots_per_rank(self) -> int:
        """(token, slot) pairs a source can send: ``max_tokens * top_k``."""
        return self.max_tokens * self.top_k

    def same_dtype(self, array) -> bool:
        got = np.dtype(array.dtype)
        return got == self.dtype or (self.dtype == dtypes.BFLOAT16 and got == np.int16)  # bf16 may arrive as its bits


def table_columns(num_experts: int, num_ranks: int) -> int:
    """Count table row: pairs per expert, sends per destination rank, the bad-input record."""
    return num_experts + num_ranks + BAD_RECORD_FIELDS


@dataclass(frozen=True)
class TokenBuffers:
    """The dispatcher's allocations (see :meth:`ultraep.token.Dispatcher.heap_requirements`)."""

    heap: Any
    count_table: Any
    landing: Any
    row_weight: Any
    row_landing: Any
    row_origin: Any
    slot_rows: Any
    slot_grad_w: Any
    sync: Any             # signal block of the device's barriers
    expert_out: Any = None  # with expert_output: the experts' output rows, read by the sources
    expert_in: Any = None   # with expert_input: the receive buffer, written by the sources

    @classmethod
    def of(cls, heap, allocated: dict, prefix: str) -> "TokenBuffers":
        """From :meth:`SymmetricHeap.allocate`'s result, names without ``prefix``."""
        return cls(heap=heap, **{name.removeprefix(prefix): value for name, value in allocated.items()})


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
    """What combine and the backward pair need from one dispatch (backend arrays inside).
    ``serial`` counts the dispatcher's dispatches (the same on every rank: dispatch is
    collective), so the ranks' calls with one handle agree they pass the same micro-batch's."""

    dispatcher_id: int
    tokens: int
    weights: Any                 # float32[T, K], this rank's gates
    expert_ids: Any              # int64[T, K]
    state: dict = field(default_factory=dict)  # the implementation's token map
    serial: int = 0

    @property
    def micro_batch(self) -> str:
        """What the ranks agree on: which of the dispatcher's dispatches this handle is."""
        return f"the handle of dispatch #{self.serial}"


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
        """Rows received (reads one integer from the device on the device backend)."""
        return int(self.offsets[-1])


class TokenBackend(Protocol):
    """One implementation of the token path. ``weighted=False`` makes combine the
    unweighted sum of dispatch's backward; ``out`` is an optional result buffer.
    ``expert_output()`` is this rank's view of the heap's ``expert_out`` (with
    ``TokenConfig.expert_output``); a combine whose rows are that buffer reads them there.
    ``expert_input()`` is this rank's view of the heap's ``expert_in`` (with
    ``TokenConfig.expert_input``), the receive buffer dispatch then writes and returns."""

    def dispatch(self, x, expert_ids, weights, out) -> DispatchResult: ...

    def expert_output(self): ...

    def expert_input(self): ...

    def combine(self, y, handle: DispatchHandle, weighted: bool, out): ...

    def combine_backward(self, grad_out, y, handle: DispatchHandle, out): ...

    def check(self) -> None: ...

    def close(self) -> None: ...


# -- bad input ------------------------------------------------------------------------------

def bad_input_message(rank: int, code: int, token: int, slot: int, value, num_experts: int) -> str:
    if code == BAD_EXPERT_ID:
        return f"rank {rank}: expert id {value} at token {token}, slot {slot} is outside [0, {num_experts})"
    return (f"rank {rank}: gate weight at token {token}, slot {slot} is not finite in float32 "
            "(NaN, infinite, or too large for float32)")


def too_many_rows_message(table: np.ndarray, experts_per_rank: int, receiver: int, rows: int, bound: int) -> str:
    """Why a dispatch was refused: ``receiver`` would get ``rows`` > ``bound`` rows, and how
    many each source sends it (``table``: the gathered pair counts ``[sources, experts]``),
    so the message names the ranks whose routing caused it."""
    mine = np.asarray(table)[:, receiver * experts_per_rank:(receiver + 1) * experts_per_rank].sum(axis=1)
    sources = ", ".join(f"rank {s}: {int(n)}" for s, n in enumerate(mine) if n)
    return (f"rank {receiver} would receive {rows} rows, more than the set-up bound max_recv_rows={bound} "
            f"(rows from {sources}): route fewer tokens to its experts or raise max_recv_rows")


def first_bad_item(expert_ids: np.ndarray, weights: np.ndarray, num_experts: int):
    """(code, token, slot, value) of the first bad (token, slot) in token-then-slot order, or None."""
    ids = np.asarray(expert_ids)
    bad_id = (ids < 0) | (ids >= num_experts)
    with np.errstate(over="ignore"):  # a float64 gate past float32's range is refused here, not warned about
        gates = np.asarray(weights, dtype=np.float32)
    bad = bad_id | ~np.isfinite(gates)
    if not bad.any():
        return None
    t, k = np.unravel_index(int(np.argmax(bad.ravel())), bad.shape)
    code = BAD_EXPERT_ID if bad_id[t, k] else NAN_GATE
    return code, int(t), int(k), int(ids[t, k])


_NO_HANDLE = object()


def raise_if_any(group: EPGroup, config: TokenConfig, error: Exception | None, what: str,
                 handle: Any = _NO_HANDLE) -> None:
    """Collective raise (every rank, when ``sync_checks``), else a local one. Given the
    call's ``handle`` (a call site passes one on every rank, valid or not), the same
    collective checks every rank passed the same dispatch's: a GroupMismatchError names
    each rank's otherwise (one rank with another micro-batch's handle would move its rows
    to rows its peers do not expect)."""
    what = f"{what} of Dispatcher #{config.serial}"  # ranks calling different Dispatchers mismatch at once
    if not config.sync_checks:
        if error is not None:
            raise error
    elif handle is _NO_HANDLE:
        group.raise_if_any(error, what)
    else:  # an error anywhere is raised before the agreement
        valid = error is None and isinstance(handle, DispatchHandle)
        group.raise_if_any(error, what, agree=handle.micro_batch if valid else None)


def import_inputs(importer, arrays: dict, handle: Any = None, *, dispatcher_id: int | None = None) -> tuple[list, Any]:
    """Each ``name: (array, writable)`` through ``importer(array, name, writable)``, and the
    first failure (an input that is None, not a tensor, not contiguous, read-only) or, given
    ``dispatcher_id``, a ``handle`` that is not one of that dispatcher's (:func:`check_handle`),
    as a DispatchError: kept, not raised, for the call's collective input check to raise on
    every rank (a rank raising alone leaves its peers waiting in that check). A writable
    array is an optional result buffer: None there means the call allocates one."""
    imported, error = [], None
    if dispatcher_id is not None:
        try:
            check_handle(handle, dispatcher_id)
        except DispatchError as exc:
            error = exc
    for name, (array, writable) in arrays.items():
        if error is None and array is None and not writable:
            error = DispatchError(f"{name}: expected an array, got None")
        if error is None:
            try:
                array = importer(array, name, writable)
            except ValueError as exc:
                error = DispatchError(str(exc))
        imported.append(array)
    return imported, error


def check_handle(handle, dispatcher_id: int) -> None:
    """DispatchError unless ``handle`` is the DispatchHandle of a dispatch of dispatcher ``dispatcher_id``."""
    if not isinstance(handle, DispatchHandle):
        raise DispatchError(f"handle: expected the DispatchHandle of a dispatch, got {type(handle).__name__}")
    if handle.dispatcher_id != dispatcher_id:
        raise DispatchError("the handle comes from another Dispatcher")


def check_tokens(group: EPGroup, config: TokenConfig, x, expert_ids, weights, failed: Exception | None = None) -> None:
    """Shape/dtype checks of dispatch input (values are checked by the implementation);
    ``failed``: an import failure (:func:`import_inputs`) to raise instead."""
    error = failed
    try:
        if failed is not None:
            raise failed
        if x.ndim != 2 or x.shape[1] != config.hidden:
            raise DispatchError(f"x: expected shape [tokens, {config.hidden}], got {tuple(x.shape)}")
        if not config.same_dtype(x):
            raise DispatchError(f"x: expected dtype {config.dtype}, got {x.dtype}")
        if x.shape[0] > config.max_tokens:
            raise DispatchError(f"x: {x.shape[0]} tokens exceed the set-up bound max_tokens={config.max_tokens}")
        want = (x.shape[0], config.top_k)
        if tuple(expert_ids.shape) != want or np.dtype(expert_ids.dtype).kind not in "iu":
            raise DispatchError(f"expert_ids: expected integer shape {list(want)}, got {expert_ids.dtype} "
                                f"{list(expert_ids.shape)}")
        if tuple(weights.shape) != want or np.dtype(weights.dtype).kind not in "fV":
            raise DispatchError(f"weights: expected float shape {list(want)}, got {weights.dtype} "
                                f"{list(weights.shape)}")
    except DispatchError as exc:
        error = exc
    raise_if_any(group, config, error, "dispatch input check")


def is_buffer(rows, buffer) -> bool:
    """Whether ``rows`` is ``buffer`` itself (same memory, same shape), whichever array type views it."""
    def address(a):
        return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    return tuple(rows.shape) == tuple(buffer.shape) and address(rows) == address(buffer)


def check_rows(group: EPGroup, config: TokenConfig, arrays: dict, expert_out=None, failed: Exception | None = None,
               expert_in=None, handle: Any = _NO_HANDLE) -> None:
    """Checks of row arrays ``{name: (array or None, rows)}``: shape ``[rows, H]``, the set-up dtype.
    ``handle``: the handle the call uses (combine and the backward pair), agreed by every
    rank (:func:`raise_if_any`).
    ``expert_out``: ``(name, buffer)``, set up with ``expert_output``: that array must be the buffer.
    ``expert_in``: ``(name, buffer)``, set up with ``expert_input``: that array, if given, must be the buffer.
    ``failed``: an import failure (:func:`import_inputs`) to raise instead."""
    error = failed
    try:
        if failed is not None:
            raise failed
        for name, (rows, first) in arrays.items():
            if rows is None:
                continue
            if rows.ndim != 2 or rows.shape[1] != config.hidden or rows.shape[0] != first:
                raise DispatchError(f"{name}: expected shape [{first}, {config.hidden}], got {tuple(rows.shape)}")
            if not config.same_dtype(rows):
                raise DispatchError(f"{name}: expected dtype {config.dtype}, got {rows.dtype}")
        if expert_out is not None and not is_buffer(arrays[expert_out[0]][0], expert_out[1]):
            raise DispatchError(f"{expert_out[0]}: this Dispatcher was set up with expert_output=True, so combine "
                                "and dispatch_backward read the rows where the experts wrote them: pass "
                                "Dispatcher.expert_output() (after writing the rows into it)")
        if expert_in is not None and arrays[expert_in[0]][0] is not None \
                and not is_buffer(arrays[expert_in[0]][0], expert_in[1]):
            raise DispatchError(f"{expert_in[0]}: this Dispatcher was set up with expert_input=True, so dispatch "
                                "writes the rows into the heap's receive buffer: pass no out, or "
                                "Dispatcher.expert_input()")
    except DispatchError as exc:
        error = exc
    raise_if_any(group, config, error, "token path input check", handle)
