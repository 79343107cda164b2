"""The host implementation of :class:`~ultraep.transfer.WeightTransfer`: the NumPy executor
of a transfer schedule over the host heap -- the CPU backend and the reference for the GPU.

It follows the kernels' protocol step for step -- chunks copied in task order, each
chunk a relay forwards flagged ``(epoch << FLAG_WRITER_BITS) | writer`` after a memory
fence, relays waiting (with a timeout) on their chunk flags -- only with NumPy stores into
the MPI shared-memory heap instead of CUDA stores into IPC-mapped peers.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from ultraep.errors import TransferTimeout
from ultraep.transfer.prepared import PreparedSync
from ultraep.transfer.schedule import FLAG_WRITER_BITS, Schedule, compile_schedule, host_plan, placement_error


class HostTransfer:
    """Each transfer compiles this rank's schedule for its plan with the NumPy reference,
    once every rank found the plan's placement sound (the same error on every rank
    otherwise; nothing is written), and runs it before returning. Heap barriers wait on
    the host, so there is nothing left to synchronise. There is no grid: ``blocks`` is
    checked by the engine and ignored here."""

    device = None  # masters are imported as NumPy arrays
    agrees_in_sync = False  # the engine agrees with a host collective before any transfer

    def __init__(self, heap, layout, spec, geometry, placement, replica_weights, *, relay_threshold: int,
                 relay_count: int, blocks: int | None, timeout_s: float):
        self.heap, self.layout, self.spec, self.timeout_s = heap, layout, spec, timeout_s
        self._compile = functools.partial(compile_schedule, spec=spec, geometry=geometry, placement=placement,
                                          rank=heap.rank, relay_threshold=relay_threshold, relay_count=relay_count)
        self._replica_weights = replica_weights
        self.syncs = 0  # the last sync's epoch

    def _slot_sources(self) -> list:
        """Relays forward from their replica slots: those tensors follow the masters in every
        source list. Taken per call, so no view of the heap outlives a transfer."""
        slots = self._replica_weights.local
        return [slots[s][offset:offset + w.nbytes] for s in range(self.layout.redundant_slots)
                for w, offset in zip(self.spec.weights, self.spec.weight_offsets)]

    @staticmethod
    def setup_error(spec) -> str | None:
        return None

    def sync_grid_error(self, blocks: int | None) -> str | None:
        return None

    def import_layer(self, weights: list, grads: list) -> dict:
        """``masters``: flat uint8 views of the master tensors; ``grads``: flat views of the
        master gradients."""
        return {"masters": [w.reshape(-1).view(np.uint8) for w in weights], "grads": [g.reshape(-1) for g in grads]}

    def prepare_sync(self, entry: dict, plan, blocks: int | None, flag_every_chunk: bool) -> PreparedSync:
        """The sync runs in ``launch`` (collective: the placement is checked on every rank
        first), flagging only the chunks relays forward."""
        self.syncs += 1
        return PreparedSync(lambda: self.run_weight_tasks(entry, self._schedule(plan, "weight_sync"), blocks), None)

    def run_weight_tasks(self, entry: dict, schedule: Schedule, blocks: int | None) -> None:
        """This rank's weight tasks of ``schedule`` in order: each chunk copied to every
        destination, a relay's chunk after its flag, flags published where a relay waits."""
        heap, sources, slot_offsets = self.heap, entry["masters"] + self._slot_sources(), self.spec.weight_offsets
        tiles = schedule.tiles.tolist()
        for src_ref, chunk, tile_begin, tile_end, begin, end, wait_slot, publish in schedule.weight_tasks.tolist():
            if wait_slot >= 0:
                wait_for_chunk(heap, wait_slot, self.syncs, self.timeout_s)
            targets = schedule.dests[begin:end].tolist()
            for tensor, offset, nbytes in tiles[tile_begin:tile_end]:
                tile = sources[src_ref + tensor][offset:offset + nbytes]
                for dst_rank, slot_offset, _ in targets:
                    heap.view(dst_rank, slot_offset + slot_offsets[tensor] + offset, (nbytes,),
                              np.dtype(np.uint8))[...] = tile
            if not publish:  # no destination forwards this chunk: the caller's heap barrier orders it
                continue
            heap.fence()
            for dst_rank, _, flag_slot in targets:
                flag = heap.view(dst_rank, (flag_slot + chunk) * 8, (1,), np.dtype(np.uint64))
                flag[0] = (self.syncs << FLAG_WRITER_BITS) | schedule.rank

    def reduce_grads(self, entry: dict, plan, blocks: int | None) -> None:
        self.run_grad_tasks(entry, self._schedule(plan, "reduce_grads"), blocks)

    def run_grad_tasks(self, entry: dict, schedule: Schedule, blocks: int | None) -> None:
        """Each tile: fp32 accumulator = master, then + each replica in replica order, rounded
        once to the gradient dtype -- the order the GPU kernel uses, so results are bitwise equal."""
        grad_dtype = self.spec.grad_dtype
        itemsize = grad_dtype.itemsize
        for dst_ref, byte_offset, nbytes, begin, end in schedule.grad_tasks.tolist():
            target = entry["grads"][dst_ref][byte_offset // itemsize:(byte_offset + nbytes) // itemsize]
            acc = target.astype(np.float32)
            for src_rank, heap_offset in schedule.grad_srcs[begin:end].tolist():
                acc += self.heap.view(src_rank, heap_offset, (nbytes // itemsize,), grad_dtype).astype(np.float32)
            target[...] = acc.astype(grad_dtype)

    def barrier(self) -> None:
        self.heap.barrier(self.timeout_s)

    def synchronize(self) -> None:
        """Nothing to wait for: every call has finished when it returns."""

    def _schedule(self, plan, what: str) -> Schedule:
        plan = host_plan(plan)
        self.heap.group.raise_if_any(placement_error(self.layout, plan.log_to_phys, plan.replica_count), what)
        return self._compile(plan)


def wait_for_chunk(heap, slot: int, epoch: int, timeout_s: float) -> None:
    flag = heap.view(heap.rank, slot * 8, (1,), np.dtype(np.uint64))
    deadline = time.monotonic() + timeout_s
    while int(flag[0]) >> FLAG_WRITER_BITS < epoch:
        if time.monotonic() > deadline:
            raise TransferTimeout(chunk_timeout_message(heap.rank, slot, epoch, int(flag[0]), timeout_s))
        time.sleep(20e-6)
        heap.fence()
    heap.fence()


def chunk_timeout_message(rank: int, slot: int, epoch: int, seen: int, timeout_s: float) -> str:
    return (f"rank {rank}: relay waited {timeout_s:g} s for a weight chunk: flag in signal-pad slot {slot} "
            f"expected epoch >= {epoch}, saw epoch {seen >> FLAG_WRITER_BITS} "
            f"from rank {seen & ((1 << FLAG_WRITER_BITS) - 1)}")


def reference_reduce(master: np.ndarray, replicas: list[np.ndarray]) -> np.ndarray:
    """What a master gradient must become: fp32 master + replicas in replica order, rounded once."""
    acc = master.astype(np.float32)
    for grad in replicas:
        acc = acc + grad.astype(np.float32)
    return acc.astype(master.dtype)
