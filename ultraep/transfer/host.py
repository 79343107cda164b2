"""NumPy executor of a transfer schedule: the CPU backend and the reference for the GPU.

It follows the kernels' protocol step for step -- chunks copied in task order, each
chunk a relay forwards flagged ``(epoch << 16) | writer`` after a memory fence, relays waiting
(with a timeout) on their chunk flags -- only with NumPy stores into the MPI
shared-memory heap instead of CUDA stores into IPC-mapped peers.
"""

from __future__ import annotations

import time

import numpy as np

from ultraep.errors import TransferTimeout
from ultraep.transfer.schedule import FLAG_WRITER_BITS, Schedule


def run_weight_tasks(schedule: Schedule, heap, sources: list, slot_offsets, epoch: int, timeout_s: float) -> None:
    """``sources[src_ref + tensor]``: flat uint8 view of a master tensor or a local replica-slot
    tensor; ``slot_offsets[tensor]``: where that tensor starts inside a replica slot."""
    tiles = schedule.tiles.tolist()
    for src_ref, chunk, tile_begin, tile_end, begin, end, wait_slot, publish in schedule.weight_tasks.tolist():
        if wait_slot >= 0:
            wait_for_chunk(heap, wait_slot, epoch, timeout_s)
        targets = schedule.dests[begin:end].tolist()
        for tensor, offset, nbytes in tiles[tile_begin:tile_end]:
            tile = sources[src_ref + tensor][offset:offset + nbytes]
            for dst_rank, slot_offset, _ in targets:
                heap.view(dst_rank, slot_offset + slot_offsets[tensor] + offset, (nbytes,), np.dtype(np.uint8))[...] = tile
        if not publish:  # no destination forwards this chunk: the caller's heap barrier orders it
            continue
        heap.fence()
        for dst_rank, _, flag_slot in targets:
            flag = heap.view(dst_rank, (flag_slot + chunk) * 8, (1,), np.dtype(np.uint64))
            flag[0] = (epoch << FLAG_WRITER_BITS) | schedule.rank


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
            f"expected epoch >= {epoch}, saw epoch {seen >> FLAG_WRITER_BITS} from rank {seen & ((1 << FLAG_WRITER_BITS) - 1)}")


def run_grad_tasks(schedule: Schedule, heap, master_grads: list, grad_dtype: np.dtype) -> None:
    """``master_grads[dst_ref]``: flat view (grad dtype) of a master gradient tensor.

    Each tile: fp32 accumulator = master, then + each replica in replica order, rounded
    once to the gradient dtype -- the order the GPU kernel uses, so results are bitwise equal.
    """
    itemsize = grad_dtype.itemsize
    for dst_ref, byte_offset, nbytes, begin, end in schedule.grad_tasks.tolist():
        target = master_grads[dst_ref][byte_offset // itemsize:(byte_offset + nbytes) // itemsize]
        acc = target.astype(np.float32)
        for src_rank, heap_offset in schedule.grad_srcs[begin:end].tolist():
            acc += heap.view(src_rank, heap_offset, (nbytes // itemsize,), grad_dtype).astype(np.float32)
        target[...] = acc.astype(grad_dtype)


def reference_reduce(master: np.ndarray, replicas: list[np.ndarray]) -> np.ndarray:
    """What a master gradient must become: fp32 master + replicas in replica order, rounded once."""
    acc = master.astype(np.float32)
    for grad in replicas:
        acc = acc + grad.astype(np.float32)
    return acc.astype(master.dtype)
