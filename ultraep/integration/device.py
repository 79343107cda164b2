"""The device backend of the :class:`~ultraep.integration.Balancer`: CuPy and
``raw_kernels/balancer.cu`` on the device heap (CUDA IPC), everything on the caller's
stream with buffers allocated once.

:class:`DeviceLoadGather` counts this rank's load row (bitwise
:func:`ultraep.integration.host.count_loads`), publishes it into every peer's gathered
matrix and waits for theirs, in one launch and with no heap barrier: each row is
followed by a flag of the update's epoch (``gather_loads`` in ``balancer.cu``).
:class:`DeviceBalancer` plans from it into each ring slot's own plan buffers and copies
what a record needs to pinned host memory on a side stream, so the host waits for the
device only where it reads results, and the caller's stream only for its own work.
"""

from __future__ import annotations

import contextlib

import cupy
import cupyx
import numpy as np

from ultraep.errors import BalancerError, BarrierTimeout
from ultraep.integration.host import BadIds
from ultraep.integration.stats import DeviceClock
from ultraep.planner import DevicePlanner, Plan
from ultraep.planner.device import reroute_workspace_size
from ultraep.runtime.dlpack import caller_stream, external_stream
from ultraep.runtime.kernels import get_function, kernel_constant

GATHER_THREADS = kernel_constant("balancer.cu", "GATHER_THREADS")
MAX_COUNT_BLOCKS = 1024
NO_BAD_INDEX = np.iinfo(np.uint64).max
MAX_HISTOGRAM_BYTES = 48 * 1024  # dynamic shared memory without opting in
CUDA_MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyKind
STATUS_WORDS = 4  # gather_loads' status: timed out, peer, expected epoch, flag seen


class DeviceLoadGather:
    """This rank's load row, counted and exchanged by ``gather_loads``: :meth:`count` alone
    (the row stays staged), :meth:`publish` of a staged row, or both in one launch."""

    def __init__(self, heap, num_experts: int, gathered, flags, timeout_s: float):
        self.heap, self.num_experts, self.timeout_s = heap, int(num_experts), timeout_s
        if 4 * self.num_experts > MAX_HISTOGRAM_BYTES:
            raise ValueError(f"the GPU load counter keeps one int per expert in shared memory: {num_experts} experts "
                             f"need {4 * self.num_experts} bytes (at most {MAX_HISTOGRAM_BYTES})")
        self._matrix_offset, self._matrix_bytes = gathered.offset, gathered.nbytes // gathered.shape[0]
        self._flag_slot = flags.first_slot
        self.counts = cupy.zeros(self.num_experts, dtype=np.int32)  # the staged row; zeroed by each publication
        self._arrived = cupy.zeros(1, dtype=np.uint32)
        self.gathers = cupy.zeros(1, dtype=np.int64)  # gathers the device completed
        self.status = cupy.zeros(STATUS_WORDS, dtype=np.uint64)
        self.bad = cupy.zeros(2, dtype=np.uint64)
        self._reset_bad = np.array([0, NO_BAD_INDEX], dtype=np.uint64)
        self.bad.set(self._reset_bad)
        self._kernels = {np.dtype(np.int32): get_function("balancer.cu", "gather_loads<int>", group=heap.group),
                         np.dtype(np.int64): get_function("balancer.cu", "gather_loads<long long>",
                                                          group=heap.group)}

    def supports(self, dtype) -> bool:
        return np.dtype(dtype) in self._kernels

    def launch(self, source, *, from_ids: bool, publish: bool, buffer: int = 0, epoch: int = 0, out=None) -> None:
        """Stage ``source`` (contiguous ids, or an ``int32[E]`` row; None: nothing more) and,
        with ``publish``, exchange the staged row for update ``epoch`` through gathered
        matrix ``buffer`` into ``out`` (``int32[R, E]``)."""
        ids = source if from_ids and source is not None else None
        loads = source if not from_ids and source is not None else None
        n = 0 if ids is None else int(ids.size)
        blocks = max(1, min(MAX_COUNT_BLOCKS, -(-n // GATHER_THREADS)))
        kernel = self._kernels[np.dtype(ids.dtype if ids is not None else np.int32)]
        null = np.uintp(0)
        kernel((blocks,), (GATHER_THREADS,),
               (null if ids is None else ids, np.int64(n), null if loads is None else loads,
                np.int32(self.num_experts), self.counts, self.bad, self._arrived, np.int32(publish),
                self.heap.peer_bases, np.uint64(self._matrix_offset + buffer * self._matrix_bytes),
                np.int64(self._flag_slot), np.int32(self.heap.rank), np.int32(self.heap.size), np.uint64(epoch),
                np.uint64(int(self.timeout_s * 1e9)), null if out is None else out, self.gathers, self.status),
               shared_mem=4 * self.num_experts if ids is not None else 0)

    def discard(self) -> None:
        """Drop a staged row that will not be published (a refused update)."""
        self.counts.fill(0)

    def read_bad(self, ids) -> BadIds | None:
        """Host read (synchronises) of the bad ids counted since the last read; resets them."""
        count, first = (int(v) for v in self.bad.get())
        if count == 0:
            return None
        self.bad.set(self._reset_bad)
        value = int(ids.reshape(-1)[first]) if ids is not None and first < ids.size else -1
        return BadIds(count, first, value)

    def check(self) -> None:
        """Raise a timed-out wait for a peer's row (after a synchronisation)."""
        failed, peer, expected, seen = (int(v) for v in self.status.get())
        if failed:
            self.status.fill(0)
            raise BarrierTimeout(f"rank {self.heap.rank}: update's load gather waited {self.timeout_s:g} s for rank "
                                 f"{peer}'s row: its flag expected update {expected}, saw {seen}")


class DeviceSlot:
    """A ring slot's device state: its plan buffers, pinned host mirrors of what a record
    needs (copied on the mirror stream; ``mirrored`` follows the copies), its event clock,
    and reroute buffers grown to the largest batch it has seen."""

    def __init__(self, layout, buffers: Plan):
        R, E = layout.num_ranks, layout.num_experts
        self.clock = DeviceClock()
        self.buffers = buffers
        self.mirror = {"loads": cupyx.empty_pinned((R, E), np.int32),
                       "phys_to_log": cupyx.empty_pinned(layout.num_physical, np.int32),
                       "rank_load": cupyx.empty_pinned(R, np.int64),
                       "liveness": cupyx.empty_pinned(1, np.int64)}
        self.planned = cupy.cuda.Event(disable_timing=True)
        self.mirrored = cupy.cuda.Event(disable_timing=True)
        self.planned_on = 0  # the stream the plan was made on
        self.reroute_out = self.reroute_workspace = None


class Mark:
    """A point on one stream (an event recorded there) that work on another stream may
    wait for; waiting on its own stream costs nothing."""

    __slots__ = ("event", "stream")

    def __init__(self, event, stream: int):
        self.event, self.stream = event, stream


class DeviceBalancer:
    """The Balancer's per-backend work on the device; the interface is
    :class:`~ultraep.integration.host.HostBalancer`'s (``Backends`` in
    :mod:`ultraep.integration.balancer`)."""

    def __init__(self, heap, layout, gathered, flags, *, min_replica_tokens: int, timeout_s: float,
                 sync_checks: bool):
        self.heap, self.layout, self.gathered = heap, layout, gathered
        self.timeout_s, self.sync_checks = timeout_s, sync_checks
        self.planner = DevicePlanner(layout, min_replica_tokens=min_replica_tokens)
        self.device = heap.device
        self.loads = DeviceLoadGather(heap, layout.num_experts, gathered, flags, timeout_s)
        self._mirror_stream = cupy.cuda.Stream(non_blocking=True)
        self._events: dict = {}  # (what, stream) -> the event a Mark of it re-records

    def new_slot(self) -> DeviceSlot:
        return DeviceSlot(self.layout, self.planner.empty_plan())

    def stream(self, stream, tensor=None):
        """Context making the caller's stream CuPy's current one: ``stream`` (CuPy, a raw
        ``cudaStream_t`` or a framework's stream), else ``tensor``'s framework's stream."""
        if stream is None:
            return caller_stream(tensor) if tensor is not None else contextlib.nullcontext()
        if type(stream).__module__.startswith("cupy"):
            return stream
        if isinstance(stream, int):
            return cupy.cuda.ExternalStream(stream, self.device)
        return external_stream(cupy, stream, self.device)  # e.g. torch.cuda.current_stream()

    # -- ordering between streams ----------------------------------------------------------
    def current(self):
        """The current stream (what :meth:`mark_on` takes)."""
        return cupy.cuda.get_current_stream()

    def mark(self, what) -> Mark:
        """A mark at the end of the work enqueued so far on the current stream; ``what``
        names it, and marking the same ``what`` on the same stream again moves it."""
        return self.mark_on(self.current(), what)

    def mark_on(self, stream, what) -> Mark:
        key = (what, stream.ptr)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return Mark(event, stream.ptr)

    def follow(self, *marks) -> None:
        """The current stream's later work waits for each mark made on another stream."""
        stream = self.current()
        for mark in marks:
            if mark is not None and mark.stream != stream.ptr:
                stream.wait_event(mark.event)

    # -- the update --------------------------------------------------------------------------
    def check_ids(self, ids) -> None:
        if not self.loads.supports(ids.dtype):
            raise BalancerError(f"topk_ids: the GPU load counter takes int32 or int64 ids, got {ids.dtype}")

    def check_loads(self, loads) -> None:
        """Values are not checked: looking would wait for the device."""

    @staticmethod
    def _row(source, from_ids: bool):
        return source if from_ids or source.dtype == np.int32 else source.astype(np.int32)

    def count(self, source, *, from_ids: bool) -> None:
        """Stage this rank's load row; with ``sync_checks`` bad ids raise here (one device
        read, the row discarded), otherwise :meth:`check` reports them."""
        self.loads.launch(self._row(source, from_ids), from_ids=from_ids, publish=False)
        if from_ids and self.sync_checks:
            bad = self.loads.read_bad(source)
            if bad is not None:
                self.loads.discard()
                raise BalancerError(bad.message(self.heap.rank, self.layout.num_experts, source.shape))

    def discard(self) -> None:
        self.loads.discard()

    def _before_gather(self, slot: DeviceSlot) -> None:
        # the slot's plan buffers are about to be rewritten: its last record's copies first
        self.current().wait_event(slot.mirrored)

    def gather(self, slot: DeviceSlot, buffer: int, epoch: int) -> None:
        """Publish the staged row and wait for every peer's into the slot's plan loads."""
        self._before_gather(slot)
        self.loads.launch(None, from_ids=False, publish=True, buffer=buffer, epoch=epoch, out=slot.buffers.loads)

    def count_and_gather(self, slot: DeviceSlot, source, *, from_ids: bool, buffer: int, epoch: int) -> None:
        """:meth:`count` and :meth:`gather` in one launch (bad ids are reported by :meth:`check`)."""
        self._before_gather(slot)
        self.loads.launch(self._row(source, from_ids), from_ids=from_ids, publish=True, buffer=buffer, epoch=epoch,
                          out=slot.buffers.loads)

    def plan(self, slot: DeviceSlot) -> Plan:
        """Plan from the slot's gathered loads; a record's arrays are copied to pinned memory
        on the mirror stream, off the caller's."""
        out = slot.buffers
        self.planner.plan(out.loads, out=out)
        slot.planned.record()
        slot.planned_on = self.current().ptr
        mirror = self._mirror_stream
        mirror.wait_event(slot.planned)
        for name, device_array in (("loads", out.loads), ("phys_to_log", out.phys_to_log),
                                   ("rank_load", out.rank_load), ("liveness", self.loads.gathers)):
            host = slot.mirror[name]
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device_array.data.ptr, host.nbytes,
                                          CUDA_MEMCPY_DEVICE_TO_HOST, mirror.ptr)
        slot.mirrored.record(mirror)
        return out  # the transfers compile from the buffers' contents in stream order: no staleness

    def planned(self, slot: DeviceSlot) -> Mark:
        """Where the slot's plan is complete (recorded by :meth:`plan`)."""
        return Mark(slot.planned, slot.planned_on)

    def reroute(self, slot: DeviceSlot, ids, plan: Plan, out):
        """Into the slot's buffers (unless ``out``), reallocated only when ``ids`` holds more
        entries than any batch before it in this slot; ``-1`` for ids the plan has no room for."""
        n = int(ids.size)
        if slot.reroute_out is None or slot.reroute_out.size < n:
            slot.reroute_out = cupy.empty(max(n, 1), np.int32)
            slot.reroute_workspace = cupy.empty(reroute_workspace_size(self.layout, n), np.int32)
        out = slot.reroute_out[:n].reshape(ids.shape) if out is None else out
        return self.planner.reroute(ids, plan, self.heap.rank, out=out, workspace=slot.reroute_workspace)

    def host_arrays(self, slot: DeviceSlot, plan: Plan) -> dict:
        """The pinned mirrors, once landed: blocks only when the device is a ring behind."""
        slot.mirrored.synchronize()
        mirror = slot.mirror
        return {"loads": mirror["loads"], "phys_to_log": mirror["phys_to_log"], "rank_load": mirror["rank_load"],
                "liveness": int(mirror["liveness"][0])}

    def synchronize(self) -> int:
        """Wait for every stream the caller used; plans the device completed."""
        cupy.cuda.runtime.deviceSynchronize()
        return int(self.loads.gathers.get()[0])

    def check(self) -> None:
        """Raise deferred device errors: ids out of range, timed-out gathers and heap barriers."""
        cupy.cuda.runtime.deviceSynchronize()
        bad = self.loads.read_bad(None)
        if bad is not None:
            raise BalancerError(f"rank {self.heap.rank}: {bad.count} top-k id(s) outside [0, "
                                f"{self.layout.num_experts}) since the last check (first at flat index "
                                f"{bad.first_index}); they were not counted and reroute gave them slot -1")
        self.loads.check()
        self.heap.check_barriers()
