"""The symmetric heap: the same buffer, at the same offsets, on every rank of a group.

Each rank owns one allocation (a raw ``cudaMalloc`` on the GPU, an MPI shared-memory
window on the CPU) whose size is rounded to 2 MiB. It starts with a signal pad of
``uint64`` flags (the first ``size`` slots serve :meth:`SymmetricHeap.barrier`), then the
data region. Sub-allocation is collective and deterministic: every rank asks for the same
named tensors in the same order, gets the same offsets, and the requests are compared
across ranks, so a rank that asks for something else gets an error on every rank.

Components declare what they will allocate as :class:`HeapRequirements`; the sum sizes one
heap per process (:func:`ultraep.runtime.open_heap`, which picks the transport: the host
heap on MPI shared memory, ``mpi_shm``, or the device heap mapped through CUDA IPC,
``cuda_ipc``), so the Balancer, the Dispatcher and any later component share it. Use it as
a context manager or call :meth:`close`; teardown is collective (synchronise, unmap peers,
barrier, free).

After :meth:`~SymmetricHeap.close` every accessor (``.local``, ``.peer()``, :meth:`~SymmetricHeap.view`,
allocation, barriers) raises :class:`~ultraep.errors.ClosedError`. Arrays taken before stay
readable: if any rank still holds a view of the heap at close, every rank leaves the memory
allocated until the process exits (freeing it is collective, so all ranks decide together)
and warns with a ``ResourceWarning``; copy what you keep and drop the views to free it.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Iterable, TypeVar

import numpy as np

from ultraep.errors import (BarrierTimeout, ClosedError, CollectiveError, GroupMismatchError, HeapError, HeapFullError,
                            RankFailedError, everywhere)
from ultraep.runtime.dtypes import is_int, resolve_dtype
from ultraep.runtime.group import EPGroup, timeout_error  # noqa: F401 (timeout_error: callers import it here)
from ultraep.runtime.kernels import kernel_constants

HEAP_GRANULE = 2 << 20          # CUDA IPC maps whole allocations; keep them 2 MiB-granular
ALLOC_ALIGN = 256               # every sub-allocation starts 256-byte aligned (16-byte vector access and more)
SIGNAL_PAD_BYTES = 64 << 10     # 8192 uint64 flags
SIGNAL_SLOTS = SIGNAL_PAD_BYTES // 8
DEFAULT_BARRIER_TIMEOUT_S = 30.0
FAILING_CLOSE_TIMEOUT_S = 5.0


# Why a rank refused a heap barrier: the cause code its refusal flag carries to the peers.
REFUSED_BAD_TIMEOUT = 1
_REFUSAL_CAUSES = {REFUSED_BAD_TIMEOUT: "timeout_s must be a positive, finite number of seconds"}

_abandoned: list = []  # allocations left unfreed by a close that peers never joined


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flag_constant(name: str) -> int:
    """A constant of the heap barrier's flag word (epoch bits, refusal cause fields, wait
    status codes), defined once for both backends in ``raw_kernels/sync.cuh``."""
    return kernel_constants("heap.cu")[name]


def flag_epoch(flag: int) -> int:
    """The epoch a barrier flag word carries."""
    return int(flag) & flag_constant("BARRIER_EPOCH_MASK")


def refusal_cause(flag: int, epoch: int) -> int:
    """Why the peer whose flag is ``flag`` refused barrier ``epoch`` (0: it did not): its
    flag of that epoch says so, or the previous-epoch field of its next one."""
    arrived = flag_epoch(flag)
    if arrived == epoch:
        shift = flag_constant("BARRIER_CAUSE_SHIFT")
    elif arrived == epoch + 1:
        shift = flag_constant("BARRIER_PREV_CAUSE_SHIFT")
    else:
        return 0
    return (int(flag) >> shift) & flag_constant("BARRIER_CAUSE_MASK")


def positive_shape(shape, what: str) -> tuple[int, ...]:
    """``shape`` (a tuple or list of dimensions, or one dimension) as ints; ValueError unless
    every dimension is a positive int (int() would truncate 8.7 to 8 or read True as 1)."""
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    if not dims or not all(is_int(d) and d > 0 for d in dims):
        raise ValueError(f"{what}: every dimension must be a positive int, got shape {shape!r}")
    return tuple(int(d) for d in dims)


def _requirement_shape(name: str, shape) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"heap requirement {name!r}: the shape must be a tuple of ints >= 0, got {shape!r}")
    return tuple(int(d) for d in shape)


def _requirement_count(name: str, count) -> int:
    if not (is_int(count) and count >= 0):
        raise ValueError(f"heap requirement {name!r}: the signal count must be an int >= 0, got {count!r}")
    return int(count)


def close_refused(cause: Exception, left: str) -> HeapError:
    """The HeapError of a close whose barrier failed (``left``: what stays allocated); marked
    as every rank's where the cause was: ranks that entered different calls all raise it."""
    error = HeapError(f"heap close: {cause}; {left}")
    return everywhere(error) if getattr(cause, "on_every_rank", False) else error


def _instance_name(name: str, instance: int) -> str:
    return name if instance == 0 else f"{name}#{instance}"


_Backed = TypeVar("_Backed", bound="HeapBacked")


class HeapBacked:
    """The close and ``with`` of a collective object whose buffers live in a symmetric heap:
    one it opened (``_owns_heap``: closed with it) or the caller's (left open, its
    allocations in place). A subclass sets ``group``, ``heap``, ``_owns_heap`` and
    ``_closed`` and defines :meth:`_close_parts`."""

    group: EPGroup
    heap: SymmetricHeap
    _owns_heap: bool
    _closed: bool

    def _close_parts(self) -> None:
        """Release what the object holds besides the heap, waiting for no peer."""
        raise NotImplementedError

    def close(self) -> None:
        """Collective: release what the object holds, then the heap if it opened it; any
        later call raises :class:`~ultraep.errors.ClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._close_parts()
        if self._owns_heap:
            self.heap.close()

    def __enter__(self: _Backed) -> _Backed:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        self._closed = True
        self._close_parts()
        self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        """On the way out of ``exc`` (a with-block, or a constructor failing after the heap was
        opened or allocated in): a lone failure is published so the peers stop waiting for
        this rank, and nothing here waits for them (the heap decides, see
        SymmetricHeap.close_failing)."""
        if self._owns_heap:
            self.heap.close_failing(exc)
        else:
            self.group.notify_failure(exc)


@dataclass(frozen=True)
class HeapRequirements:
    """What a component will allocate in a heap: named tensors ``(name, shape, dtype)``
    and signal blocks ``(name, count)``, in allocation order. Requirements add up, so one
    heap can be sized for several components."""

    tensors: tuple = ()
    signals: tuple = ()

    @classmethod
    def of(cls, tensors: Iterable = (), signals: Iterable = ()) -> "HeapRequirements":
        """From ``(name, shape, dtype)`` and ``(name, count)`` entries; ValueError naming the
        entry unless every dimension and count is an int >= 0 (int() would truncate 2.5 to
        2 or read True as 1, and the heap would be sized for less than is allocated)."""
        return cls(tuple((name, _requirement_shape(name, shape), resolve_dtype(dtype, what=f"tensor {name!r} dtype"))
                         for name, shape, dtype in tensors),
                   tuple((name, _requirement_count(name, count)) for name, count in signals))

    def __add__(self, other: "HeapRequirements") -> "HeapRequirements":
        return HeapRequirements(self.tensors + other.tensors, self.signals + other.signals)

    @property
    def data_bytes(self) -> int:
        """Data bytes the tensors take, each starting ``ALLOC_ALIGN``-aligned."""
        return sum(round_up(math.prod(shape) * dtype.itemsize, ALLOC_ALIGN) for _, shape, dtype in self.tensors)

    @property
    def signal_slots(self) -> int:
        return sum(count for _, count in self.signals)


@dataclass(frozen=True)
class SymmetricTensor:
    """One named sub-allocation: the same offset in every rank's heap."""

    heap: "SymmetricHeap"
    name: str
    offset: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @property
    def local(self):
        """This rank's copy (CuPy array on the GPU backend, NumPy on the CPU backend)."""
        self.heap._check_open(f"tensor {self.name!r}")
        return self.heap.view(self.heap.rank, self.offset, self.shape, self.dtype)

    def peer(self, rank: int):
        """The copy in ``rank``'s heap, writable from here."""
        self.heap._check_open(f"tensor {self.name!r}")
        return self.heap.view(rank, self.offset, self.shape, self.dtype)

    def __dlpack__(self, **kwargs):
        return self.local.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.local.__dlpack_device__()


@dataclass(frozen=True)
class SignalBlock:
    """A run of ``count`` uint64 flags in the signal pad, the same slots on every rank."""

    heap: "SymmetricHeap"
    name: str
    first_slot: int
    count: int

    @property
    def offset(self) -> int:
        return self.first_slot * 8

    @property
    def local(self):
        self.heap._check_open(f"signal block {self.name!r}")
        return self.heap.view(self.heap.rank, self.offset, (self.count,), np.dtype(np.uint64))

    def peer(self, rank: int):
        self.heap._check_open(f"signal block {self.name!r}")
        return self.heap.view(rank, self.offset, (self.count,), np.dtype(np.uint64))


class SymmetricHeap:
    """Transport-neutral part of the heap; subclasses map memory and run the barrier."""

    backend = "abstract"  # "host" or "device" in the transports

    def __init__(self, group: EPGroup, nbytes: int):
        self.group = group
        self.rank, self.size = group.rank, group.size
        error = None
        if not is_int(nbytes):
            error = f"heap size must be an int, got {type(nbytes).__name__}"
        elif nbytes <= 0:
            error = f"heap size must be positive, got {nbytes}"
        group.raise_if_any(error, "symmetric heap creation")
        group.agree(int(nbytes), "symmetric heap size")
        self.serial = group.next_serial("symmetric heap")  # the same on every rank: heaps open collectively
        group.track_heap(self)
        self.data_bytes = int(nbytes)
        self.total_bytes = round_up(SIGNAL_PAD_BYTES + self.data_bytes, HEAP_GRANULE)
        self._next_offset = SIGNAL_PAD_BYTES
        self._next_signal = self.size  # slots [0, size) belong to the barrier
        self._epoch = 0
        self._refused_cause = 0  # why this rank refused the last barrier (0: it did not); its next flag says so too
        self._broken: str | None = None
        self._closed = False
        self._mapped = False  # the transport's set-up sets it once the memory is mapped
        self.allocations: dict[str, SymmetricTensor | SignalBlock] = {}

    # -- transport hooks ---------------------------------------------------------------
    def view(self, rank: int, offset: int, shape: tuple, dtype: np.dtype):
        """``shape``/``dtype`` at byte ``offset`` of ``rank``'s heap (ClosedError once closed)."""
        raise NotImplementedError

    def _check_rank(self, rank) -> None:
        """IndexError unless ``rank`` is a rank of the group (an int, not a float or a bool)."""
        if not is_int(rank) or not 0 <= rank < self.size:
            raise IndexError(f"rank must be an int in [0, {self.size}) (the group's ranks), got {rank!r}")

    def _device_barrier(self, flag: int, timeout_s: float, wait: bool) -> None:
        """Publish ``flag`` (its epoch and refusal causes) to every peer, then wait for every
        peer's arrival at that epoch; raise :class:`BarrierTimeout` if one does not come in
        time, else :class:`~ultraep.errors.RankFailedError` if one refused the barrier."""
        raise NotImplementedError

    def check_barriers(self) -> None:
        """Raise :class:`BarrierTimeout` if a barrier launched with ``wait=False`` timed out."""

    def _release(self, timeout_s: float) -> None:
        """Unmap peers, wait (at most ``timeout_s``) for every rank, then free; on a timeout
        leave the local allocation in place (peers may still map it) and raise HeapError."""
        raise NotImplementedError

    # -- collective sub-allocation -----------------------------------------------------
    def alloc(self, name: str, shape, dtype) -> SymmetricTensor:
        """Collective: reserve ``shape``/``dtype`` at the same offset on every rank."""
        self._check_allocatable(f"heap allocation {name!r}")
        error, request, full = None, None, False
        try:
            if not isinstance(name, str):
                raise TypeError(f"a heap tensor's name must be a str, got {type(name).__name__} {name!r}")
            shape = positive_shape(shape, f"tensor {name!r}")
            dtype = resolve_dtype(dtype, what=f"tensor {name!r} dtype")
            if name in self.allocations:
                raise ValueError(f"tensor {name!r} is already allocated in this heap")
            request = (name, shape, dtype.str if dtype.kind != "V" else dtype.name)
            nbytes = int(math.prod(shape)) * dtype.itemsize
            offset = round_up(self._next_offset, ALLOC_ALIGN)
            end = SIGNAL_PAD_BYTES + self.data_bytes
            full = offset + nbytes > end  # the same on every rank: their allocations match
            if full:
                raise ValueError(f"heap out of space: {name!r} needs {nbytes} bytes at offset {offset}, data region "
                                 f"ends at {end} (heap created with {self.data_bytes} bytes; allocations are never "
                                 f"freed before the heap closes)")
        except (ValueError, TypeError) as exc:
            error = exc
        self._refuse_if_any(error, f"heap allocation {name!r}", full)
        self.group.agree(request, "heap allocation request (name, shape, dtype)")
        self._next_offset = offset + nbytes
        tensor = SymmetricTensor(self, name, offset, shape, dtype)
        self.allocations[name] = tensor
        return tensor

    def alloc_signals(self, name: str, count: int) -> SignalBlock:
        """Collective: ``count`` zeroed uint64 flags at the same slots on every rank."""
        self._check_allocatable(f"signal allocation {name!r}")
        full = False
        if not (isinstance(count, (int, np.integer)) and count > 0):
            error = f"signal count must be a positive int, got {count!r}"
        elif name in self.allocations:
            error = f"signal block {name!r} is already allocated in this heap"
        elif full := self._next_signal + count > SIGNAL_SLOTS:  # the same on every rank, as the allocations
            error = f"signal pad full: {name!r} needs {count} flags, {SIGNAL_SLOTS - self._next_signal} left"
        else:
            error = None
        self._refuse_if_any(error, f"signal allocation {name!r}", full)
        self.group.agree((name, int(count)), "signal allocation request (name, count)")
        block = SignalBlock(self, name, self._next_signal, int(count))
        self._next_signal += int(count)
        self.allocations[name] = block
        return block

    def _refuse_if_any(self, error, what: str, full: bool) -> None:
        """An allocation's collective check; HeapFullError where the heap has no room (every rank alike)."""
        try:
            self.group.raise_if_any(error, what)
        except GroupMismatchError:
            raise
        except CollectiveError as refused:
            if full:
                raise HeapFullError(str(refused)) from None
            raise

    def allocate(self, requirements: HeapRequirements) -> dict:
        """Collective: every tensor and signal block of ``requirements``, keyed by its declared
        name, so a component allocates exactly what it declared. Where a name is taken (a
        second Dispatcher, Balancer or layer on one heap) the whole set goes in under the next
        free instance suffix (``name#1``, ...): the same on every rank, whose allocations match."""
        names = [name for name, _, _ in requirements.tensors] + [name for name, _ in requirements.signals]
        instance = 0
        while any(_instance_name(name, instance) in self.allocations for name in names):
            instance += 1
        allocated: dict = {name: self.alloc(_instance_name(name, instance), shape, dtype)
                           for name, shape, dtype in requirements.tensors}
        allocated.update({name: self.alloc_signals(_instance_name(name, instance), count)
                          for name, count in requirements.signals})
        return allocated

    # -- synchronisation ----------------------------------------------------------------
    def barrier(self, timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S, *, wait: bool = True) -> None:
        """Every rank signals every peer, then waits for all peers' signals of this epoch.

        Orders this rank's earlier writes into peers' heaps before peers' later reads.
        Raises :class:`BarrierTimeout` naming the rank, flag and expected value if a peer
        does not arrive in ``timeout_s``; the heap is unusable afterwards (close it).
        A bad ``timeout_s`` raises ValueError here and :class:`~ultraep.errors.RankFailedError`
        naming this rank and the cause on every peer (the refusal travels in this rank's flag,
        which still arrives); the heap stays usable.
        On the GPU, ``wait=False`` only enqueues the barrier on the current stream (no
        host synchronisation); :meth:`check_barriers` reports its outcome later.
        """
        self._check_usable()
        bad_timeout = timeout_error(timeout_s)
        cause = 0 if bad_timeout is None else REFUSED_BAD_TIMEOUT
        self._epoch += 1
        flag = (self._epoch | cause << flag_constant("BARRIER_CAUSE_SHIFT")
                | self._refused_cause << flag_constant("BARRIER_PREV_CAUSE_SHIFT"))
        self._refused_cause = cause
        if bad_timeout is not None:
            # A refusal still arrives (on the group's timeout), keeping every rank in step and
            # telling the peers why, so they raise that instead of waiting out their timeout.
            try:
                self._device_barrier(flag, self.group.timeout_s, wait=True)
            except RankFailedError:
                pass  # other ranks refused too: each raises its own cause
            except BarrierTimeout as exc:
                self._broken = str(exc)
            raise ValueError(f"rank {self.rank}: heap barrier: {bad_timeout}")
        try:
            self._device_barrier(flag, float(timeout_s), wait)
        except BarrierTimeout as exc:
            self._broken = str(exc)
            raise

    def _timeout_message(self, waited_rank: int, expected: int, seen: int, timeout_s: float) -> str:
        return (f"rank {self.rank}: {self.backend} heap barrier timed out after {timeout_s:g} s waiting for "
                f"rank {waited_rank}: barrier flag in signal-pad slot {waited_rank} expected >= {expected}, "
                f"saw {flag_epoch(seen)}")

    def _refusal_message(self, refused_rank: int, epoch: int, seen: int) -> str:
        cause = refusal_cause(seen, epoch)
        why = _REFUSAL_CAUSES.get(cause, f"unknown refusal cause {cause}")
        return f"rank {self.rank}: {self.backend} heap barrier {epoch}: rank {refused_rank} refused it: {why}"

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}: {what}: the {self.backend} symmetric heap is closed "
                              "(use its tensors inside the heap's with-block, or copy them out first)")

    def _check_allocatable(self, what: str) -> None:
        """An allocation (``what``, the name of its collective check) from a closed heap is
        refused on every rank of the call (EPGroup.refuse_closed), so a constructor on a
        caller's closed heap fails alike everywhere, not as one rank's failure."""
        if self._closed:
            self.group.refuse_closed(ClosedError(f"rank {self.rank}: {what}: the {self.backend} symmetric heap is "
                                                 "closed"), what)
        self._check_usable()

    def _check_usable(self) -> None:
        self._check_open("symmetric heap")
        if self._broken is not None:
            raise HeapError(f"symmetric heap is unusable after an earlier barrier timeout ({self._broken}); close it")

    # -- teardown -----------------------------------------------------------------------
    def _keep_for_views(self, live: bool) -> bool:
        """Collective, once every rank passed the close barrier: whether any rank still holds
        a view of the heap (``live`` here), in which case every rank keeps the memory."""
        holders = [r for r, held in enumerate(self.group.allgather(bool(live))) if held]
        if holders:
            owners = ", ".join(sorted({f"{name.split('.')[0]}.*" for name in self.allocations})) or "nothing allocated"
            warnings.warn(f"rank {self.rank}: symmetric heap #{self.serial} ({owners}) closed while rank(s) {holders} "
                          "still hold views of it (a replica weight, a received batch, a tensor's .local); its memory "
                          "stays allocated until the process exits so those views remain readable",
                          ResourceWarning, stacklevel=2)
        return bool(holders)

    def _abandon(self) -> None:
        """Drop this rank's access without any collective, leaving the memory allocated."""
        raise NotImplementedError

    @property
    def is_open(self) -> bool:
        """Whether the heap is mapped and not closed (what :meth:`EPGroup.close` closes)."""
        return self._mapped and not self._closed

    def _close_step(self, step: str = "") -> str:
        """A close barrier's call name: it names this heap, so ranks closing different heaps
        raise GroupMismatchError instead of passing the barrier into a collective free that hangs."""
        return f"symmetric heap #{self.serial} close{step}"

    def close(self, timeout_s: float | None = None) -> None:
        """Collective: unmap peers, wait (at most ``timeout_s``, by default the group's) for
        every rank, then free the local allocation."""
        if self._closed:
            return
        self._closed = True
        self._release(self.group.timeout_s if timeout_s is None else timeout_s)

    def close_failing(self, error: BaseException) -> None:
        """Teardown on the way out of ``error``: collective (and quick) when every rank raised
        it; else the failure is published to the peers and this rank leaves at once, its memory
        left allocated (nobody waits for a rank that failed alone)."""
        if self._closed:
            return
        if self.group.notify_failure(error):
            self._closed = True
            self._abandon()
            return
        try:
            self.close(timeout_s=FAILING_CLOSE_TIMEOUT_S)
        except (HeapError, ClosedError) as close_error:  # the original exception goes on; this one is told
            print(f"ultraep: {close_error}", file=sys.stderr, flush=True)

    def __del__(self):
        if getattr(self, "_closed", True) or not getattr(self, "_mapped", False):
            return
        warnings.warn(f"rank {self.rank}: symmetric heap #{self.serial} was never closed (nor the object that "
                      f"opened it): its memory stays mapped until the process exits; close it (collective) or "
                      f"use it as a context manager", ResourceWarning, stacklevel=2, source=self)

    def __enter__(self):
        self._check_open("with-block")
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # the original exception propagates (under ``python -m mpi4py`` it aborts the job)
            self.close_failing(exc)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, total_bytes={self.total_bytes}, "
                f"used={self._next_offset - SIGNAL_PAD_BYTES}/{self.data_bytes})")
