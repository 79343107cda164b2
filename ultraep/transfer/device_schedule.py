"""The transfer schedule compiled on the device, by ``raw_kernels/schedule.cu``.

For a plan whose arrays are on the device, the kernels write this rank's weight and
gradient task tables -- row for row what :func:`~ultraep.transfer.schedule.compile_schedule`
(the NumPy reference) produces, relay trees included -- into tables allocated once at
the largest size the layout allows (:class:`ScheduleCapacity`), and the tables' lengths
into device memory, where the transfer kernels read them. A weight sync or a gradient
reduction therefore compiles its plan with one small kernel on the caller's stream: no
host round trip, no allocation, and no cache that could go stale when a plan's buffers
are rewritten in place (every call compiles what the plan holds at that point of the
stream).

A plan whose placement breaks the layout (the checks of
:func:`~ultraep.transfer.schedule.placement_error`) is refused on the device by every
rank alike, since each checks the whole plan: its transfers do nothing, and
:meth:`DeviceSchedule.take_error` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ultraep.planner.plan import array_module
from ultraep.runtime.kernels import kernel_constant, kernel_macro
from ultraep.runtime.sm_partition import usable_sms
from ultraep.transfer.schedule import (DEST_FIELDS, GRAD_SRC_FIELDS, GRAD_TASK_FIELDS, WEIGHT_TASK_FIELDS,
                                       HeapPlacement, TileGeometry)
from ultraep.transfer.spec import ExpertSpec

KERNEL = "schedule.cu"
COMPILE_THREADS = kernel_constant(KERNEL, "COMPILE_THREADS")
DEFAULT_SHARED_BYTES = 48 * 1024  # dynamic shared memory without opting in
MAX_SHARED_BYTES = 227 * 1024     # per block on sm_90
# The tables, in the order of their lengths in counts[] (COUNT_INDEX); the weight and
# gradient compiles' error codes follow (ERROR_SLOTS).
COUNT_FIELDS = ("weight_tasks", "dests", "grad_tasks", "grad_srcs")
COUNT_INDEX = {name: kernel_constant(KERNEL, f"COUNT_{name.upper()}") for name in COUNT_FIELDS}
COUNT_SLOTS = kernel_constant(KERNEL, "COUNT_SLOTS")
ERROR_SLOTS = (kernel_constant(KERNEL, "COUNT_WEIGHT_ERROR"), kernel_constant(KERNEL, "COUNT_GRAD_ERROR"))
TABLES_OVERFLOW = kernel_constant(KERNEL, "TABLES_OVERFLOW")  # error code: a plan would outgrow the tables
FAULT_KINDS = kernel_constant(KERNEL, "FAULT_KINDS")  # other codes: 1 + kind + FAULT_KINDS * expert
FAULTS = {"FAULT_COUNT": "has an instance count outside [1, {K}]",  # what each kind of placement_code says
          "FAULT_SLOT": "has a replica outside the redundant slots",
          "FAULT_HOST": "has a replica on its master's rank or outside its domain",
          "FAULT_SHARED_RANK": "has two instances on one rank",
          "FAULT_SHARED_SLOT": "has a replica in a slot that a lower expert's replica holds"}
_FAULT_BY_KIND = {kernel_constant(KERNEL, name): text for name, text in FAULTS.items()}
_INT32_ROWS = 2**31 - 1


@dataclass(frozen=True)
class ScheduleCapacity:
    """The most rows any rank's schedule can have, for plans that keep the layout's
    invariants (at most one instance of an expert per rank, replicas in its domain)."""

    weight_tasks: int
    dests: int
    grad_tasks: int
    grad_srcs: int

    @classmethod
    def of(cls, layout, geometry: TileGeometry) -> "ScheduleCapacity":
        M, S, K, D = layout.experts_per_rank, layout.redundant_slots, layout.max_instances, layout.domain_size
        direct = min(M * (K - 1), (D - 1) * S)  # replicas of this rank's masters: on the domain's other ranks
        replicated = min(M, direct)             # masters with at least one replica
        leaves = S * max(K - 2, 0)              # a relay hosted here forwards to at most K - 2 leaves
        tiles = len(geometry.grad_tiles)
        return cls(weight_tasks=(replicated + S) * geometry.num_chunks, dests=direct + leaves,
                   grad_tasks=replicated * tiles, grad_srcs=direct * tiles)


class DeviceSchedule:
    """This rank's task tables on the device; see the module docstring.

    ``weight_tasks``, ``dests``, ``grad_tasks``, ``grad_srcs``: the tables (valid rows
    first); ``counts``: ``int32[COUNT_SLOTS]``, their lengths then the two error codes;
    ``weight_task_count`` / ``grad_task_count``: one-element views the transfer kernels read;
    ``weight_syncs``: ``uint64[1]``, the weight compiles so far (each counts itself), the
    epoch the copy behind a compile flags its chunks with.
    """

    def __init__(self, layout, spec: ExpertSpec, geometry: TileGeometry, placement: HeapPlacement, rank: int, *,
                 relay_threshold: int, relay_count: int, group=None):
        import cupy

        from ultraep.runtime.kernels import get_function

        R, E, S, K, M, D = (layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.max_instances,
                            layout.experts_per_rank, layout.domain_size)
        self.layout, self.rank = layout, int(rank)
        self.capacity = capacity = ScheduleCapacity.of(layout, geometry)
        if max(capacity.weight_tasks, capacity.dests, capacity.grad_tasks, capacity.grad_srcs) > _INT32_ROWS:
            raise ValueError(f"schedule tables of {capacity} rows do not fit int32 counts; use larger tiles")
        self.weight_tasks = cupy.empty((max(capacity.weight_tasks, 1), WEIGHT_TASK_FIELDS), np.int64)
        self.dests = cupy.empty((max(capacity.dests, 1), DEST_FIELDS), np.int64)
        self.grad_tasks = cupy.empty((max(capacity.grad_tasks, 1), GRAD_TASK_FIELDS), np.int64)
        self.grad_srcs = cupy.empty((max(capacity.grad_srcs, 1), GRAD_SRC_FIELDS), np.int64)
        self.counts = cupy.zeros(COUNT_SLOTS, np.int32)
        # weight compiles so far: each counts itself, and the copy behind it flags its chunks with that epoch
        self.weight_syncs = cupy.zeros(1, np.uint64)
        self.weight_task_count, self.grad_task_count = (self.counts[COUNT_INDEX[name]:COUNT_INDEX[name] + 1]
                                                        for name in ("weight_tasks", "grad_tasks"))
        self._staged = (cupy.empty((E, K), np.int32), cupy.empty(E, np.int32))  # a NumPy plan's arrays
        self._weight_kernel = get_function("schedule.cu", "compile_weight_tasks", group=group)
        self._grad_kernel = get_function("schedule.cu", "compile_grad_tasks", group=group)
        # the weight compile's dynamic shared memory, also what a one-launch sync (transfer.cu) launches with
        self.weight_shared_bytes = kernel_macro(KERNEL, "WEIGHT_COMPILE_SHARED_BYTES", R=R, E=E, M=M, S=S, K=K)
        self._grad_shared = kernel_macro(KERNEL, "GRAD_COMPILE_SHARED_BYTES", R=R, E=E, M=M, S=S, K=K)
        for kernel, nbytes in ((self._weight_kernel, self.weight_shared_bytes),
                               (self._grad_kernel, self._grad_shared)):
            if nbytes > MAX_SHARED_BYTES:
                raise ValueError(f"the device schedule compiler needs {nbytes} bytes of shared memory for {layout} "
                                 f"(at most {MAX_SHARED_BYTES})")
            if nbytes > DEFAULT_SHARED_BYTES and kernel.max_dynamic_shared_size_bytes < nbytes:
                kernel.max_dynamic_shared_size_bytes = nbytes
        self._grad_tensors = cupy.asarray(geometry.grad_tensor_table())
        sms = usable_sms(cupy.cuda.Device().id)
        self._grad_blocks = max(1, min(2 * sms, -(-capacity.grad_tasks // COMPILE_THREADS)))
        layout_args = (np.int32(R), np.int32(E), np.int32(S), np.int32(K), np.int32(D), np.int32(rank),
                       np.int32(len(spec.weights)))
        self._weight_args = layout_args + (
            np.int64(spec.weight_slot_bytes), np.int32(relay_threshold), np.int32(max(1, relay_count)),
            np.int32(geometry.num_chunks), np.int32(geometry.chunk_tiles), np.int32(len(geometry.tiles)),
            np.int64(placement.weight_base), np.int64(placement.flag_base_slot), np.int32(capacity.weight_tasks),
            np.int32(capacity.dests), cupy.empty(2 * E * K, np.int32), self.weight_tasks, self.dests, self.counts,
            self.weight_syncs)
        self._grad_args = layout_args + (
            self._grad_tensors, np.int32(len(geometry.grad_tiles)), np.int64(geometry.tile_bytes),
            np.int64(placement.grad_base), np.int64(spec.grad_slot_bytes), np.int32(capacity.grad_tasks),
            np.int32(capacity.grad_srcs), self.grad_tasks, self.grad_srcs, self.counts)

    def compile_weights(self, plan) -> None:
        """Weight tasks and destinations of ``plan``, on the current stream."""
        self._weight_kernel((1,), (COMPILE_THREADS,), self.weight_compile_arguments(plan),
                            shared_mem=self.weight_shared_bytes)

    def weight_compile_arguments(self, plan) -> tuple:
        """The weight compile's kernel arguments for ``plan`` (schedule.cuh's
        COMPILE_WEIGHT_PARAMETERS), which a one-launch sync passes on too."""
        return self._plan_arrays(plan) + self._weight_args

    def compile_grads(self, plan) -> None:
        """Gradient tasks and sources of ``plan``, on the current stream."""
        self._grad_kernel((self._grad_blocks,), (COMPILE_THREADS,), self._plan_arrays(plan) + self._grad_args,
                          shared_mem=self._grad_shared)

    def _plan_arrays(self, plan) -> tuple:
        """``(log_to_phys, replica_count)`` on the device. A NumPy plan is copied into
        buffers kept for it, in stream order (a copy from pageable memory may wait for
        the stream: device plans are the hot path)."""
        import cupy

        E, K = self.layout.num_experts, self.layout.max_instances
        log_to_phys, replica_count = plan.log_to_phys, plan.replica_count
        if array_module(replica_count) is np:
            stream = cupy.cuda.get_current_stream()
            for staged, host in zip(self._staged, (log_to_phys, replica_count)):
                staged.set(np.ascontiguousarray(host, dtype=np.int32), stream=stream)
            return self._staged
        for name, array, shape in (("log_to_phys", log_to_phys, (E, K)), ("replica_count", replica_count, (E,))):
            if array.dtype != np.int32 or array.shape != shape or not array.flags.c_contiguous:
                raise ValueError(f"plan.{name}: expected a contiguous int32 array of shape {shape}, "
                                 f"got {array.dtype} {array.shape}")
        return log_to_phys, replica_count

    def to_host(self) -> dict:
        """The tables trimmed to their lengths, as NumPy arrays (synchronises)."""
        counts = self.counts.get()
        return {name: getattr(self, name)[:int(counts[index])].get() for name, index in COUNT_INDEX.items()}

    def take_error(self) -> str | None:
        """What the compiles since the last call refused, if anything (synchronises); clears it."""
        counts = self.counts.get()
        code = next((int(counts[slot]) for slot in ERROR_SLOTS if counts[slot]), 0)
        if not code:
            return None
        for slot in ERROR_SLOTS:
            self.counts[slot] = 0
        if code == TABLES_OVERFLOW:
            return (f"rank {self.rank}: a plan would outgrow this rank's transfer tables {self.capacity}; "
                    "its transfers were skipped")
        expert, kind = divmod(code - 1, FAULT_KINDS)
        return (f"rank {self.rank}: the plan's placement breaks {self.layout}: expert {expert} "
                f"{_FAULT_BY_KIND[kind].format(K=self.layout.max_instances)}; its transfers were skipped")
