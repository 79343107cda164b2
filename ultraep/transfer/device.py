"""The device implementation of :class:`~ultraep.transfer.WeightTransfer`: the kernels of
``raw_kernels/transfer.cu`` on CuPy's current stream (the caller's; see
``runtime.dlpack.caller_stream``).

Each transfer first compiles its plan's task tables on the device
(:class:`~ultraep.transfer.device_schedule.DeviceSchedule`) into tables allocated once,
so with a plan already on the device (the planner's device backend) no call allocates or
waits for the device. A weight sync whose plan is agreed on the device runs the agreement,
the compile and the copy in one launch (``agree_compile_and_sync_weights``). The compile
numbers the syncs on the device, so that launch takes the same arguments every time for
the same plan buffers, and the Balancer captures it in its update's CUDA graph right
behind the plan (:meth:`DeviceTransfer.prepare_sync`). Where ranks share a GPU the
agreement is a one-block launch of its own just before it, so that no full grid waits for
peers. Those tables and the kernels' counters are shared by every call of one engine, as
the replica slots are: its transfers must be ordered on one stream (or by events), never
run concurrently on two. :meth:`DeviceTransfer.synchronize` waits and reports device-side
timeouts and refused plans.
"""

from __future__ import annotations

import cupy
import numpy as np

from ultraep.errors import TransferTimeout
from ultraep.runtime.group import ranks_per_gpu
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.runtime.sm_partition import usable_sms
from ultraep.transfer.agreement import AgreementBesideCompile
from ultraep.transfer.device_schedule import DEFAULT_SHARED_BYTES, DeviceSchedule
from ultraep.transfer.schedule import FLAG_WRITER_BITS
from ultraep.transfer.host import chunk_timeout_message
from ultraep.transfer.prepared import PreparedSync

KERNEL = "transfer.cu"
SYNC_THREADS = kernel_constant(KERNEL, "SYNC_THREADS")
SYNC_MIN_BLOCKS = kernel_constant(KERNEL, "SYNC_MIN_BLOCKS")  # resident per SM: the grid's bound
PIECE_BYTES = kernel_constant(KERNEL, "PIECE_BYTES")
STATUS_WORDS = kernel_constant(KERNEL, "STATUS_WORDS")
GATE_WORDS = kernel_constant(KERNEL, "GATE_WORDS")
CLAIM_WORDS = kernel_constant(KERNEL, "CLAIM_WORDS")
GATE_SLOT = kernel_constant(KERNEL, "GATE_SLOT")  # status[1] of a one-launch sync's wait for its roles
WAIT_STATUS_WORDS = kernel_constant(KERNEL, "WAIT_STATUS_WORDS")
WAIT_THREADS = kernel_constant(KERNEL, "WAIT_THREADS")
REDUCE_THREADS = kernel_constant(KERNEL, "REDUCE_THREADS")


def launch_key(arguments: tuple) -> tuple:
    """Kernel arguments as a graph's key: each device array by its pointer, scalars as they are."""
    return tuple(int(a.data.ptr) if isinstance(a, cupy.ndarray) else a for a in arguments)


def replica_timeout_message(rank: int, layer: int, slot: int, chunk: int, epoch: int, seen: int,
                            timeout_s: float) -> str:
    return (f"rank {rank}: waited {timeout_s:g} s for replica slot {slot} of layer {layer}: chunk {chunk}'s flag "
            f"expected epoch >= {epoch}, saw epoch {seen >> FLAG_WRITER_BITS}")


class DeviceTransfer:
    """Launches of ``weight_sync`` and ``reduce_grads`` on this rank's tables, the grid bound
    they need, and the status word a relay's timed-out wait leaves for :meth:`synchronize`."""

    def __init__(self, heap, layout, spec, geometry, placement, replica_weights, *, relay_threshold: int,
                 relay_count: int, blocks: int | None, timeout_s: float):
        group = heap.group
        self.heap, self.spec, self.geometry, self.timeout_s = heap, spec, geometry, timeout_s
        self.device = heap.device
        self._sync_kernel = get_function(KERNEL, "weight_sync", group=group)
        self._one_launch_sync_kernel = get_function(KERNEL, "agree_compile_and_sync_weights", group=group)
        grad_type = "__nv_bfloat16" if spec.grad_dtype.name == "bfloat16" else "float"
        self._reduce_kernel = get_function(KERNEL, f"reduce_grads<{grad_type}>", group=group)
        self._wait_kernel = get_function(KERNEL, "wait_replica_slots", group=group)
        self._status = cupy.zeros(STATUS_WORDS, dtype=np.uint64)
        self._wait_status = cupy.zeros(WAIT_STATUS_WORDS, dtype=np.uint64)
        self._gate = cupy.zeros(GATE_WORDS, dtype=np.uint64)  # one-launch sync: tickets, roles, pieces; zero between
        self._claims = cupy.zeros(CLAIM_WORDS, dtype=np.uint64)  # a weight_sync launch's pieces claimed; zero between
        self.rank, self.placement, self.slots_per_rank = heap.rank, placement, layout.slots_per_rank
        self.masters_per_rank = layout.experts_per_rank
        self._own_pad = heap.base_pointer(heap.rank)  # the signal pad opens the heap
        self._tensor_table = cupy.asarray(geometry.weight_tensor_table())
        sms = usable_sms(heap.device)
        # the same bound on every rank (the smallest GPU's), so a grid is refused by all or none
        self.max_sync_blocks = min(group.allgather(SYNC_MIN_BLOCKS * sms))
        group.raise_if_any(self.sync_grid_error(blocks), "WeightTransfer set-up")
        self.blocks = blocks or self.max_sync_blocks  # the grid of a call that names none
        # Relays forward from their replica slots: those tensors follow the masters in every source table.
        self._slot_ptrs = [int(replica_weights.local[s].data.ptr) + off
                           for s in range(layout.redundant_slots) for off in spec.weight_offsets]
        self.tables = DeviceSchedule(layout, spec, geometry, placement, heap.rank, relay_threshold=relay_threshold,
                                     relay_count=relay_count, group=group)
        tasks = len(self.tables.weight_tasks)
        chunk_bytes = geometry.chunk_tiles * geometry.tile_bytes
        pieces = tasks * geometry.chunk_tiles * -(-geometry.tile_bytes // PIECE_BYTES)
        # the kernel's int32 chunk byte counts and piece grid (tasks x tiles x pieces) indices
        group.raise_if_any(None if chunk_bytes < 2**31 and pieces < 2**30 else
                           f"{tasks} weight tasks x {geometry.chunk_tiles} tiles of {geometry.tile_bytes} bytes per "
                           "chunk overflow the kernel's int32 chunk byte count or piece slot index; use fewer "
                           "or smaller tiles per chunk", "WeightTransfer set-up")
        # bytes of each task's chunk stored so far: zero between launches (the chunk's
        # finishing warp resets it; after a timeout, synchronize() does)
        self._sync_done = cupy.zeros(tasks, dtype=np.int32)
        self.syncs = 0  # weight syncs prepared: the last one's epoch (the device counts them too)
        # One launch needs the grid resident with the compile's shared memory too (its blocks wait for the roles);
        # the same answer on every rank, so all agree in the launch or all beside it.
        shared = self.tables.weight_shared_bytes
        if shared > DEFAULT_SHARED_BYTES:
            self._one_launch_sync_kernel.max_dynamic_shared_size_bytes = shared
        with cupy.cuda.Device(heap.device):
            resident = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self._one_launch_sync_kernel.kernel.ptr, SYNC_THREADS, shared)
        self.agrees_in_sync = min(group.allgather(resident)) >= SYNC_MIN_BLOCKS
        # Where ranks share a GPU (MPS), a sync grid waiting in the agreement holds SMs that a
        # peer still planning needs: its planner, a cluster of whole SMs, then starts only once
        # the wait has timed out. There the agreement waits in a block of its own, launched first.
        self.agrees_before_sync = ranks_per_gpu(group) > 1

    @staticmethod
    def setup_error(spec) -> str | None:
        if spec.grad_dtype.name not in ("bfloat16", "float32"):
            return f"the GPU gradient reduction supports float32 and bfloat16 gradients, not {spec.grad_dtype}"
        return None

    def sync_grid_error(self, blocks: int | None) -> str | None:
        """No more blocks than are resident at once: a block past those would start only once
        another has ended, when its warps (claiming pieces as they go) find little or nothing
        left to copy."""
        if blocks is None or blocks <= self.max_sync_blocks:
            return None
        return (f"blocks must be at most {self.max_sync_blocks} for weight_sync on this GPU ({SYNC_MIN_BLOCKS} "
                f"resident per SM), got {blocks}")

    def import_layer(self, weights: list, grads: list) -> dict:
        """Device tables of pointers: ``sources`` the master tensors, then this rank's
        replica-slot tensors; ``grads`` the master gradients. ``keep`` holds the arrays
        the pointers point into."""
        sources = cupy.asarray(np.array([int(w.data.ptr) for w in weights] + self._slot_ptrs, dtype=np.uint64))
        targets = cupy.asarray(np.array([int(g.data.ptr) for g in grads], dtype=np.uint64))
        return {"sources": sources, "grads": targets, "keep": (weights, grads)}

    def prepare_sync(self, entry: dict, plan, blocks: int | None, flag_every_chunk: bool) -> PreparedSync:
        """Count the sync (its epoch, what :meth:`wait_slots` waits for, is then :attr:`syncs`:
        the device's schedule compile keeps the same count) and return its launches.
        ``plan``: an :class:`AgreementBesideCompile` (only where :attr:`agrees_in_sync`): the
        agreement, the compile and the copy run in one launch (the agreement in a launch just
        before where :attr:`agrees_before_sync`), the copy writing nothing if the ranks refuse
        the plan, with the same arguments every call for the same plan buffers (``key``: it
        can be captured in a CUDA graph); else an agreed placement,
        whose agreement is launched first, then the compile, then the copy (not captured)."""
        self.syncs += 1
        grid, tables = blocks or self.blocks, self.tables
        if isinstance(plan, AgreementBesideCompile):
            agree_before = self.agrees_before_sync
            arguments = plan.arguments + (np.int32(agree_before),) + tables.weight_compile_arguments(plan) + (
                np.int32(len(tables.weight_tasks)), self._tensor_table, np.int64(self.geometry.tile_bytes),
                np.int32(len(tables.dests)), entry["sources"], np.int32(len(entry["sources"])), self.heap.peer_bases,
                np.int32(self.heap.size), np.int32(flag_every_chunk), self._sync_done, self._status, self._gate)

            def launch() -> None:
                if agree_before:
                    plan.launch_before()
                self._one_launch_sync_kernel((grid,), (SYNC_THREADS,), arguments,
                                             shared_mem=tables.weight_shared_bytes)
            return PreparedSync(launch, ("one launch", grid) + launch_key(arguments))

        def agree_compile_copy() -> None:
            plan.launch()
            tables.compile_weights(plan)
            self.run_weight_tasks(entry, tables, blocks, flag_every_chunk)
        return PreparedSync(agree_compile_copy, None)

    def wait_slots(self, plan, first_slot: int, count: int, epoch: int, layer: int) -> None:
        """Enqueue on the current stream a wait until the sync of ``epoch`` (run with
        ``flag_every_chunk``) has landed every chunk of replica slots ``[first_slot,
        first_slot + count)`` that ``plan`` fills; :meth:`synchronize` reports a timeout."""
        self._wait_kernel((count,), (WAIT_THREADS,), (
            np.uint64(self._own_pad),
            np.int64(self.placement.flag_base_slot), np.int32(self.geometry.num_chunks), np.int32(first_slot),
            np.uint64(epoch), plan.phys_to_log, np.int32(self.rank * self.slots_per_rank + self.masters_per_rank),
            np.int32(self.rank), np.int32(layer), np.uint64(int(self.timeout_s * 1e9)), self._wait_status))

    def run_weight_tasks(self, entry: dict, tables: DeviceSchedule, blocks: int | None,
                         flag_every_chunk: bool = False) -> None:
        """Launch the weight sync of the tasks ``tables`` hold (compiled on the stream before);
        ``flag_every_chunk``: publish every chunk's flag at its destination, not only those
        a relay forwards."""
        self._sync_kernel((blocks or self.blocks,), (SYNC_THREADS,), (
            tables.weight_tasks, tables.weight_task_count, np.int32(len(tables.weight_tasks)),
            np.int32(self.geometry.chunk_tiles), self._tensor_table, np.int32(len(self.spec.weights)),
            np.int64(self.geometry.tile_bytes), tables.dests, np.int32(len(tables.dests)),
            entry["sources"], np.int32(len(entry["sources"])), self.heap.peer_bases, np.int32(self.heap.size),
            np.int32(self.heap.rank), tables.weight_syncs, np.int32(flag_every_chunk), self._sync_done,
            np.uint64(int(self.timeout_s * 1e9)), self._status, self._claims))

    def reduce_grads(self, entry: dict, plan, blocks: int | None) -> None:
        plan.launch()  # the agreement that writes the placement compiled here
        self.tables.compile_grads(plan)
        self.run_grad_tasks(entry, self.tables, blocks)

    def run_grad_tasks(self, entry: dict, tables: DeviceSchedule, blocks: int | None) -> None:
        """Launch the gradient reduction of the tasks ``tables`` hold (compiled on the stream before)."""
        self._reduce_kernel((blocks or self.blocks,), (REDUCE_THREADS,), (
            tables.grad_tasks, tables.grad_task_count, tables.grad_srcs, entry["grads"], self.heap.peer_bases))

    def barrier(self) -> None:
        """Enqueued on the stream; :meth:`synchronize` reports a timeout."""
        self.heap.barrier(self.timeout_s, wait=False)

    def synchronize(self) -> None:
        """Wait for the stream; raise if a barrier or a relay's wait timed out, or a plan was
        refused (its transfers were skipped). After a timeout, weight syncs do nothing on
        this rank (transfer.cu) until this call has reported it and zeroed the counts."""
        self.heap.check_barriers()
        failed, slot, expected, seen = (int(v) for v in self._status.get())
        if failed:
            self._sync_done.fill(0)
            self._status.fill(0)
            if slot == GATE_SLOT % 2**64:
                raise TransferTimeout(f"rank {self.rank}: a weight sync's copy waited {2 * self.timeout_s:g} s for its "
                                      f"launch's plan agreement and compile: {seen} of {expected} done")
            raise TransferTimeout(chunk_timeout_message(self.heap.rank, slot, expected, seen, self.timeout_s))
        failed, layer, slot, chunk, expected, seen = (int(v) for v in self._wait_status.get())
        if failed:
            self._wait_status.fill(0)
            raise TransferTimeout(replica_timeout_message(self.rank, layer, slot, chunk, expected, seen,
                                                          self.timeout_s))
        refused = self.tables.take_error()
        if refused is not None:
            raise ValueError(refused)
