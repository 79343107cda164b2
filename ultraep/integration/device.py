"""The device backend of the :class:`~ultraep.integration.Balancer`: CuPy and
``raw_kernels/balancer.cu`` on the device heap (CUDA IPC), everything on the caller's
stream with buffers allocated once.

:class:`DeviceLoadGather` counts this rank's load row (bitwise
:func:`ultraep.integration.host.count_loads`), publishes it into every peer's gathered
matrix and waits for theirs, in one launch and with no heap barrier: each row is
followed by a flag of the update's epoch, which the kernel numbers itself
(``gather_loads`` in ``balancer.cu``). :class:`DeviceBalancer` plans from it into each
ring slot's own plan buffers and copies what a record needs to pinned host memory on a
side stream, so the host waits for the device only where it reads results, and the
caller's stream only for its own work. An update from top-k ids also reroutes them: the
gather writes each chunk's counts as it counts (reroute's count kernel, for free), and
reroute's assign kernel runs after the plan into the slot's routed output, which
``Balancer.reroute(handle)`` returns with no device work of its own.

Host time: a ring slot's launches take the same pointers every time once their inputs
are copied into buffers of the slot's or the gather's own (:class:`Staging`, one
device-to-device copy), so :class:`LaunchGraphs` replays them as CUDA graphs -- update's
gather, plan (and assign, and the weight sync an update starts) as one graph launch, the
record's four copies as one, reroute's two kernels as one -- captured the second time in
a row a slot sees the same shapes and recaptured when they change. A graph replays the
launches the eager path makes, so both give the same bits.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import cupy
import cupyx
import numpy as np

from ultraep.errors import BalancerError, BarrierTimeout
from ultraep.integration.host import BadIds
from ultraep.integration.stats import DeviceClock
from ultraep.planner import DevicePlanner, Plan
from ultraep.planner.device import (REROUTE_CHUNK, reroute_assign_counted, reroute_assign_shared_bytes,
                                    reroute_workspace_size)
from ultraep.runtime.dlpack import caller_stream, external_stream
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.runtime.sm_partition import new_stream

GATHER_THREADS = kernel_constant("balancer.cu", "GATHER_THREADS")
NO_BAD_INDEX = np.iinfo(np.uint64).max
MAX_HISTOGRAM_BYTES = 48 * 1024  # dynamic shared memory without opting in
CUDA_MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyKind
CUDA_MEMCPY_DEVICE_TO_DEVICE = 3
STATUS_WORDS = 4  # gather_loads' status: timed out, peer, expected epoch, flag seen


class LaunchGraphs:
    """Launch sequences replayed as CUDA graphs (when ``enabled``; otherwise every call runs
    its launches). An owner names each of its sequences and passes, per call, a key of
    everything the launches take that can change (pointers, shapes, dtypes): the first
    time a key comes the launches run as they are (loading any kernel they need); the
    second time in a row they are captured and the graph is launched, as it is from then
    on; another key runs eagerly again and drops the graph. Captures run on a private
    stream, run no work and allocate nothing (every buffer a launch takes is its owner's);
    event records and waits stay outside the graphs. ``captures`` and ``replays`` count
    them per sequence name."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self._capture_stream = new_stream() if self.enabled else None
        self.captures, self.replays = Counter(), Counter()

    def run(self, graphs: dict, name: str, key, launches, stream=None) -> None:
        """``launches()`` (which enqueue on the current stream) on ``stream`` (None: the
        current one), or the graph of them that ``graphs`` (the owner's, name -> (key,
        graph or None)) holds for ``key``."""
        if self.enabled:
            held_key, graph = graphs.get(name, (None, None))
            if held_key == key:
                if graph is None:
                    graph = self._capture(launches)
                    graphs[name] = (key, graph)
                    self.captures[name] += 1
                graph.launch(stream)
                self.replays[name] += 1
                return
            graphs[name] = (key, None)
        with contextlib.nullcontext() if stream is None else stream:
            launches()

    def _capture(self, launches):
        stream = self._capture_stream
        with stream:
            stream.begin_capture()
            try:
                launches()
            except BaseException:
                with contextlib.suppress(cupy.cuda.runtime.CUDARuntimeError):  # the capture is void anyway
                    stream.end_capture()
                raise
            return stream.end_capture()


class Staging:
    """A device buffer of its owner's that inputs are copied into, in stream order, so the
    launches that read the copy take the same pointer every call (what a graph replays).
    It grows to the largest input; the view of the last shape and dtype is kept."""

    def __init__(self):
        self._buffer = self._view = None

    def copy(self, source):
        """The copy of contiguous ``source`` (enqueued on the current stream)."""
        view = self._view
        if view is None or view.dtype != source.dtype or view.shape != source.shape:
            if self._buffer is None or self._buffer.nbytes < source.nbytes:
                self._buffer = cupy.empty(max(source.nbytes, 1), np.uint8)
            view = self._view = self._buffer[:source.nbytes].view(source.dtype).reshape(source.shape)
        if source.nbytes:
            cupy.cuda.runtime.memcpyAsync(view.data.ptr, source.data.ptr, source.nbytes, CUDA_MEMCPY_DEVICE_TO_DEVICE,
                                          cupy.cuda.get_current_stream().ptr)
        return view


class DeviceLoadGather:
    """This rank's load row, counted and exchanged by ``gather_loads`` (:meth:`launch`):
    counted alone (the row stays staged), a staged row published, or both in one launch."""

    def __init__(self, heap, num_experts: int, gathered, flags, timeout_s: float):
        self.heap, self.num_experts, self.timeout_s = heap, int(num_experts), timeout_s
        if 4 * self.num_experts > MAX_HISTOGRAM_BYTES:
            raise ValueError(f"the GPU load counter keeps one int per expert in shared memory: {num_experts} experts "
                             f"need {4 * self.num_experts} bytes (at most {MAX_HISTOGRAM_BYTES})")
        self._matrix_offset, self._buffers = gathered.offset, gathered.shape[0]
        self._matrix_bytes = gathered.nbytes // self._buffers
        self._flag_slot = flags.first_slot
        self.counts = cupy.zeros(self.num_experts, dtype=np.int32)  # the staged row; zeroed by each publication
        self._arrived = cupy.zeros(1, dtype=np.uint32)
        self.gathers = cupy.zeros(1, dtype=np.int64)  # gathers the device completed: the last epoch
        self.staging = Staging()  # what a graphed update counts
        self.status = cupy.zeros(STATUS_WORDS, dtype=np.uint64)
        self.bad = cupy.zeros(2, dtype=np.uint64)
        self._reset_bad = np.array([0, NO_BAD_INDEX], dtype=np.uint64)
        self.bad.set(self._reset_bad)
        self._kernels = {np.dtype(np.int32): get_function("balancer.cu", "gather_loads<int>", group=heap.group),
                         np.dtype(np.int64): get_function("balancer.cu", "gather_loads<long long>",
                                                          group=heap.group)}

    def supports(self, dtype) -> bool:
        return np.dtype(dtype) in self._kernels

    def launch(self, source, *, from_ids: bool, publish: bool, out=None, chunk_counts=None) -> None:
        """Stage ``source`` (contiguous ids, or an ``int32[E]`` row; None: nothing more) and,
        with ``publish``, exchange the staged row for the next update (the kernel numbers
        it, and picks the gathered matrix by it) into ``out`` (``int32[R, E]``). Counting
        ids, the kernel also writes their per-chunk counts into ``chunk_counts`` (int32, at
        least ``reroute_workspace_size`` entries) when given: one block per chunk."""
        ids = source if from_ids and source is not None else None
        loads = source if not from_ids and source is not None else None
        n = 0 if ids is None else int(ids.size)
        blocks = max(1, -(-n // REROUTE_CHUNK))
        kernel = self._kernels[np.dtype(ids.dtype if ids is not None else np.int32)]
        null = np.uintp(0)
        kernel((blocks,), (GATHER_THREADS,),
               (null if ids is None else ids, np.int64(n), null if loads is None else loads,
                np.int32(self.num_experts), self.counts, null if chunk_counts is None else chunk_counts, self.bad,
                self._arrived, np.int32(publish),
                self.heap.peer_bases, np.uint64(self._matrix_offset), np.uint64(self._matrix_bytes),
                np.int32(self._buffers), np.int64(self._flag_slot), np.int32(self.heap.rank), np.int32(self.heap.size),
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
    reroute buffers grown to the largest batch it has seen (the update's routed output and
    ``reroute``'s own), and its launch graphs."""

    def __init__(self, layout, buffers: Plan, gathers):
        R, E = layout.num_ranks, layout.num_experts
        self.clock = DeviceClock()
        self.buffers = buffers
        self.mirror = {"loads": cupyx.empty_pinned((R, E), np.int32),
                       "phys_to_log": cupyx.empty_pinned(layout.num_physical, np.int32),
                       "rank_load": cupyx.empty_pinned(R, np.int64),
                       "liveness": cupyx.empty_pinned(1, np.int64)}
        # (host, device, bytes) of each mirror copy; liveness: the gathers the device had completed
        sources = {"loads": buffers.loads, "phys_to_log": buffers.phys_to_log, "rank_load": buffers.rank_load,
                   "liveness": gathers}
        self.record_copies = [(host.ctypes.data, sources[name].data.ptr, host.nbytes)
                              for name, host in self.mirror.items()]
        self.planned: Mark | None = None  # where the plan is complete: the update's clock stop
        self.mirrored = cupy.cuda.Event(disable_timing=True)
        self.routed = self.routed_shaped = None  # the buffer of the update's reroute of its ids, its last view
        self.routed_view = None  # the slot's update's reroute, shaped like its ids (None: it got a load row)
        self.reroute_out = self.reroute_workspace = self.reroute_view = None
        self.reroute_ids = Staging()  # what a graphed reroute reads
        self.graphs: dict = {}  # LaunchGraphs of this slot: "update", "record", "reroute"


class Mark:
    """A point on one stream (an event recorded there) that work on another stream may
    wait for; waiting on its own stream costs nothing."""

    __slots__ = ("event", "stream")

    def __init__(self, event, stream: int):
        self.event, self.stream = event, stream


class DeviceBalancer:
    """The Balancer's per-backend work on the device; the interface is
    :class:`~ultraep.integration.host.HostBalancer`'s (``Backends`` in
    :mod:`ultraep.integration.balancer`). ``cuda_graphs``: replay each ring slot's launch
    sequences as CUDA graphs (:class:`LaunchGraphs`)."""

    def __init__(self, heap, layout, gathered, flags, *, min_replica_tokens: int, timeout_s: float,
                 sync_checks: bool, cuda_graphs: bool):
        self.heap, self.layout, self.gathered = heap, layout, gathered
        self.timeout_s, self.sync_checks = timeout_s, sync_checks
        self.planner = DevicePlanner(layout, min_replica_tokens=min_replica_tokens)
        self.device = heap.device
        self.loads = DeviceLoadGather(heap, layout.num_experts, gathered, flags, timeout_s)
        self.graphs = LaunchGraphs(cuda_graphs)
        self._mirror_stream = new_stream(self.device)
        self._events: dict = {}  # (what, stream) -> the event a Mark of it re-records
        self.host_waits, self.host_wait_s = 0, 0.0  # the per-micro-batch calls' host waits for the device
        try:  # an update reroutes its ids only if reroute's assign kernel can take E
            reroute_assign_shared_bytes(layout.num_experts)
            self._unroutable = None
        except ValueError as exc:
            self._unroutable = str(exc)
        self._chunk_counts = None  # the per-chunk counts of the ids an update routes, grown to the largest batch
        self._counted = None  # the ids count() counted, for the update to route

    def _waited(self, since: float) -> None:
        self.host_waits += 1
        self.host_wait_s += time.perf_counter() - since

    def new_slot(self) -> DeviceSlot:
        return DeviceSlot(self.layout, self.planner.empty_plan(), self.loads.gathers)

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
        read, the row discarded), otherwise :meth:`check` reports them. Ids are counted from
        the gather's staging copy (graphs) with their per-chunk counts, for :meth:`update`
        to route."""
        row = self._row(source, from_ids)
        self._counted = self._routable(row) if from_ids else None
        if self._counted is not None:
            row = self._counted
        self.loads.launch(row, from_ids=from_ids, publish=False,
                          chunk_counts=None if self._counted is None else self._chunk_counts)
        if from_ids and self.sync_checks:
            reading = time.perf_counter()
            bad = self.loads.read_bad(source)
            self._waited(reading)
            if bad is not None:
                self.loads.discard()
                raise BalancerError(bad.message(self.heap.rank, self.layout.num_experts, source.shape))

    def discard(self) -> None:
        self.loads.discard()
        self._counted = None

    def _routable(self, ids):
        """``ids`` as the update's launches read them (the gather's staging copy when graphed),
        the per-chunk count table grown for them; None where E is too large to route."""
        if self._unroutable is not None:
            return None
        size = reroute_workspace_size(self.layout, int(ids.size))
        if self._chunk_counts is None or self._chunk_counts.size < size:
            self._chunk_counts = cupy.empty(size, np.int32)
        return self.loads.staging.copy(ids) if self.graphs.enabled else ids

    def update(self, slot: DeviceSlot, source, *, from_ids: bool, then=None) -> Plan:
        """Count ``source`` (None: publish the row :meth:`count` staged; bad ids are then
        reported by :meth:`check`), publish the row, wait for every peer's into the slot's
        plan loads and plan, then reroute the counted ids (if any) into the slot's routed
        output, then launch the sync ``then(plan buffers)`` prepares, if given (a
        ``PreparedSync``): one graph launch once the slot has seen these shapes (and that
        sync's key) twice in a row; a sync without a key is launched behind the graph. The
        update's clock stop marks the plan complete; a record's arrays are copied to pinned
        memory on the mirror stream from there, off the caller's."""
        stream = self.current()
        stream.wait_event(slot.mirrored)  # the plan buffers are about to be rewritten: its last record's copies first
        if source is None:
            routed, self._counted = self._counted, None
            key = ("staged row",)
        else:
            source = self._row(source, from_ids)
            routed = self._routable(source) if from_ids else None
            if routed is not None:
                source = routed
            elif self.graphs.enabled:
                source = self.loads.staging.copy(source)
            key = (from_ids, source.dtype.char, source.shape, source.data.ptr)
        slot.routed_view = None if routed is None else self._routed_output(slot, routed)
        if routed is not None:  # the routed ids are in the key already when this launch counts them
            key += (routed.dtype.char, routed.shape, routed.data.ptr, slot.routed.data.ptr,
                    self._chunk_counts.data.ptr)
        sync = None if then is None else then(slot.buffers)
        captured = sync if sync is not None and sync.key is not None else None
        if captured is not None:
            key += ("weight_sync",) + captured.key
        self.graphs.run(slot.graphs, "update", key,
                        lambda: self._gather_and_plan(slot, source, from_ids, routed, captured))
        if sync is not None and captured is None:
            sync.launch()
        slot.planned = Mark(slot.clock.stop("update"), stream.ptr)
        mirror = self._mirror_stream
        mirror.wait_event(slot.planned.event)
        self.graphs.run(slot.graphs, "record", "record", lambda: self._copy_record(slot), stream=mirror)
        slot.mirrored.record(mirror)
        return slot.buffers  # the transfers compile from the buffers' contents in stream order: no staleness

    def _gather_and_plan(self, slot: DeviceSlot, source, from_ids: bool, routed, sync) -> None:
        out = slot.buffers
        chunk_counts = None if routed is None else self._chunk_counts
        self.loads.launch(source, from_ids=from_ids, publish=True, out=out.loads, chunk_counts=chunk_counts)
        self.planner.plan(out.loads, out=out)
        if routed is not None:
            reroute_assign_counted(routed, out, self.heap.rank, chunk_counts=chunk_counts, out=slot.routed_view)
        if sync is not None:
            sync.launch()

    @staticmethod
    def _routed_output(slot: DeviceSlot, ids):
        """The view of the slot's routed buffer shaped like ``ids``, the buffer grown first if
        ``ids`` holds more entries than any batch before it in this slot."""
        n = int(ids.size)
        if slot.routed is None or slot.routed.size < n:
            slot.routed = cupy.empty(max(n, 1), np.int32)
            slot.routed_shaped = None
        if slot.routed_shaped is None or slot.routed_shaped.shape != ids.shape:  # a view costs host time
            slot.routed_shaped = slot.routed[:n].reshape(ids.shape)
        return slot.routed_shaped

    @staticmethod
    def _copy_record(slot: DeviceSlot) -> None:
        stream = cupy.cuda.get_current_stream().ptr
        for host, device, nbytes in slot.record_copies:
            cupy.cuda.runtime.memcpyAsync(host, device, nbytes, CUDA_MEMCPY_DEVICE_TO_HOST, stream)

    def planned(self, slot: DeviceSlot) -> Mark | None:
        """Where the slot's plan is complete (marked by :meth:`update`)."""
        return slot.planned

    def routed(self, slot: DeviceSlot):
        """The reroute of the ids the slot's update counted, written by that update."""
        if self._unroutable is not None:
            raise ValueError(self._unroutable)
        return slot.routed_view

    def reroute(self, slot: DeviceSlot, ids, plan: Plan, out):
        """Into the slot's buffers (unless ``out``), reallocated only when ``ids`` holds more
        entries than any batch before it in this slot; ``-1`` for ids the plan has no room
        for. One graph launch once the slot has seen these shapes and buffers twice in a row."""
        if out is not None and not isinstance(out, cupy.ndarray):
            raise ValueError(f"out must be a CuPy int32 array shaped like topk_ids, got {type(out).__name__}")
        n = int(ids.size)
        if slot.reroute_out is None or slot.reroute_out.size < n:
            slot.reroute_out = cupy.empty(max(n, 1), np.int32)
            slot.reroute_workspace = cupy.empty(reroute_workspace_size(self.layout, n), np.int32)
            slot.reroute_view = None
        if out is None:
            if slot.reroute_view is None or slot.reroute_view.shape != ids.shape:
                slot.reroute_view = slot.reroute_out[:n].reshape(ids.shape)
            out = slot.reroute_view
        workspace, rank = slot.reroute_workspace, self.heap.rank
        if n == 0:  # nothing to launch
            return self.planner.reroute(ids, plan, rank, out=out, workspace=workspace)
        if self.graphs.enabled:
            ids = slot.reroute_ids.copy(ids)
        key = (ids.dtype.char, ids.shape, ids.data.ptr, out.dtype.char, out.shape, out.data.ptr, workspace.data.ptr)
        self.graphs.run(slot.graphs, "reroute", key,
                        lambda: self.planner.reroute(ids, plan, rank, out=out, workspace=workspace))
        return out

    def host_arrays(self, slot: DeviceSlot, plan: Plan) -> dict:
        """The pinned mirrors, once landed: blocks only when the device is a ring behind
        (counted in ``host_waits``; the query is the one API call when it is not)."""
        if not slot.mirrored.done:
            blocked = time.perf_counter()
            slot.mirrored.synchronize()
            self._waited(blocked)
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
