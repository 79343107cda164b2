"""The device backend of the :class:`~ultraep.integration.Balancer`: CuPy and
``raw_kernels/balancer.cu`` on the device heap (CUDA IPC), everything on the caller's
stream with buffers allocated once.

:class:`DeviceLoadCounter` counts this rank's load row (bitwise
:func:`ultraep.integration.host.count_loads`) and publishes it into every peer's gathered
matrix. :class:`DeviceBalancer` plans into each ring slot's own plan buffers after a
device-side heap barrier, and copies what a record needs to pinned host memory
asynchronously, so the host waits for the device only where it reads results.
"""

from __future__ import annotations

import contextlib

import cupy
import cupyx
import numpy as np

from ultraep.errors import BalancerError
from ultraep.integration.host import BadIds
from ultraep.integration.stats import DeviceClock
from ultraep.planner import DevicePlanner, Plan
from ultraep.planner.device import reroute_workspace_size
from ultraep.runtime.dlpack import caller_stream, external_stream
from ultraep.runtime.kernels import get_function

COUNT_THREADS = 256
MAX_COUNT_BLOCKS = 1024
NO_BAD_INDEX = np.iinfo(np.uint64).max
MAX_HISTOGRAM_BYTES = 48 * 1024  # dynamic shared memory without opting in
CUDA_MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyKind


class DeviceLoadCounter:
    """Device load row: ``count`` into a device ``int32[E]`` and ``publish`` it to every peer."""

    def __init__(self, heap, num_experts: int):
        self.heap, self.num_experts = heap, int(num_experts)
        if 4 * self.num_experts > MAX_HISTOGRAM_BYTES:
            raise ValueError(f"the GPU load counter keeps one int per expert in shared memory: {num_experts} experts "
                             f"need {4 * self.num_experts} bytes (at most {MAX_HISTOGRAM_BYTES})")
        self.counts = cupy.zeros(self.num_experts, dtype=np.int32)
        self.bad = cupy.zeros(2, dtype=np.uint64)
        self._reset_bad = np.array([0, NO_BAD_INDEX], dtype=np.uint64)
        self.bad.set(self._reset_bad)
        self._kernels = {np.dtype(np.int32): get_function("balancer.cu", "count_expert_loads<int>", group=heap.group),
                         np.dtype(np.int64): get_function("balancer.cu", "count_expert_loads<long long>",
                                                          group=heap.group)}
        self._publish = get_function("balancer.cu", "publish_load_row", group=heap.group)

    def supports(self, dtype) -> bool:
        return np.dtype(dtype) in self._kernels

    def count(self, ids) -> None:
        """``self.counts`` = the load row of ``ids`` (contiguous int32/int64 CuPy array)."""
        n = int(ids.size)
        self.counts.fill(0)
        if n == 0:
            return
        blocks = min(MAX_COUNT_BLOCKS, -(-n // COUNT_THREADS))
        self._kernels[np.dtype(ids.dtype)]((blocks,), (COUNT_THREADS,),
                                           (ids, np.int64(n), np.int32(self.num_experts), self.counts, self.bad),
                                           shared_mem=4 * self.num_experts)

    def read_bad(self, ids) -> BadIds | None:
        """Host read (synchronises) of the bad ids counted since the last read; resets them."""
        count, first = (int(v) for v in self.bad.get())
        if count == 0:
            return None
        self.bad.set(self._reset_bad)
        value = int(ids.reshape(-1)[first]) if ids is not None and first < ids.size else -1
        return BadIds(count, first, value)

    def publish(self, row, matrix_offset: int) -> None:
        """On every rank, the gathered ``int32[R, E]`` matrix at heap byte offset ``matrix_offset``
        gets ``row`` (a device ``int32[E]``) in row ``heap.rank``."""
        heap = self.heap
        self._publish((heap.size,), (COUNT_THREADS,),
                      (row, np.int32(self.num_experts), heap.peer_bases, np.uint64(matrix_offset),
                       np.int32(heap.rank)))


class DeviceSlot:
    """A ring slot's device state: its plan buffers, pinned host mirrors of what a record
    needs, its event clock, and reroute buffers grown to the largest batch it has seen."""

    def __init__(self, layout, buffers: Plan):
        R, E = layout.num_ranks, layout.num_experts
        self.clock = DeviceClock()
        self.buffers = buffers
        self.mirror = {"loads": cupyx.empty_pinned((R, E), np.int32),
                       "phys_to_log": cupyx.empty_pinned(layout.num_physical, np.int32),
                       "rank_load": cupyx.empty_pinned(R, np.int64),
                       "liveness": cupyx.empty_pinned(1, np.int64)}
        self.reroute_out = self.reroute_workspace = None


class DeviceBalancer:
    """The Balancer's per-backend work on the device; the interface is
    :class:`~ultraep.integration.host.HostBalancer`'s (``Backends`` in
    :mod:`ultraep.integration.balancer`)."""

    def __init__(self, heap, layout, gathered, *, min_replica_tokens: int, timeout_s: float, sync_checks: bool):
        self.heap, self.layout, self.gathered = heap, layout, gathered
        self.timeout_s, self.sync_checks = timeout_s, sync_checks
        self.planner = DevicePlanner(layout, min_replica_tokens=min_replica_tokens)
        self.device = heap.device
        self._matrix_bytes = gathered.nbytes // gathered.shape[0]  # one of the gathered load matrices
        self.counter = DeviceLoadCounter(heap, layout.num_experts)
        self.liveness = cupy.zeros(1, dtype=np.int64)  # plans completed, counted on the device

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

    def check_ids(self, ids) -> None:
        if not self.counter.supports(ids.dtype):
            raise BalancerError(f"topk_ids: the GPU load counter takes int32 or int64 ids, got {ids.dtype}")

    def check_loads(self, loads) -> None:
        """Values are not checked: looking would wait for the device."""

    def count(self, source, *, from_ids: bool):
        """This rank's load row, left in the counter; with ``sync_checks`` bad ids raise
        here (one device read), otherwise :meth:`check` reports them."""
        if not from_ids:
            self.counter.counts[...] = source
            return self.counter.counts
        self.counter.count(source)
        if self.sync_checks:
            bad = self.counter.read_bad(source)
            if bad is not None:
                raise BalancerError(bad.message(self.heap.rank, self.layout.num_experts, source.shape))
        return self.counter.counts

    def publish(self, row, buffer: int) -> None:
        self.counter.publish(row, self.gathered.offset + buffer * self._matrix_bytes)

    def barrier(self) -> None:
        self.heap.barrier(self.timeout_s, wait=False)  # enqueued; check() reports a timeout

    def plan(self, slot: DeviceSlot, buffer: int) -> Plan:
        out = slot.buffers
        self.planner.plan(self.gathered.local[buffer], out=out)
        self.liveness += 1
        stream = cupy.cuda.get_current_stream().ptr
        for name, device_array in (("loads", out.loads), ("phys_to_log", out.phys_to_log),
                                   ("rank_load", out.rank_load), ("liveness", self.liveness)):
            host = slot.mirror[name]
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device_array.data.ptr, host.nbytes,
                                          CUDA_MEMCPY_DEVICE_TO_HOST, stream)
        return out  # the transfers compile from the buffers' contents in stream order: no staleness

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
        """The pinned mirrors, once landed: blocks only when the device is a ring behind.
        The update stage's stop event, recorded after :meth:`plan`, follows their copies."""
        slot.clock.events["update"][1].synchronize()
        mirror = slot.mirror
        return {"loads": mirror["loads"], "phys_to_log": mirror["phys_to_log"], "rank_load": mirror["rank_load"],
                "liveness": int(mirror["liveness"][0])}

    def synchronize(self) -> int:
        """Wait for every stream the caller used; plans the device completed."""
        cupy.cuda.runtime.deviceSynchronize()
        return int(self.liveness.get()[0])

    def check(self) -> None:
        """Raise deferred device errors: ids out of range, timed-out heap barriers."""
        bad = self.counter.read_bad(None)
        if bad is not None:
            raise BalancerError(f"rank {self.heap.rank}: {bad.count} top-k id(s) outside [0, "
                                f"{self.layout.num_experts}) since the last check (first at flat index "
                                f"{bad.first_index}); they were not counted and reroute gave them slot -1")
        self.heap.check_barriers()
