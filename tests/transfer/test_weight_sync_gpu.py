"""The weight-sync kernel (raw_kernels/transfer.cu) alone, in one process, on hand-built
task tables: two sources (experts A and B) with their own destination ranges, replica
slots and flag slots, so warps switch between destination ranges; every fan-out from 1
to 10 (each unrolled store path up to 8 and the run-time loop) and 33 (more destinations
than lanes); 32 KiB tiles and 5 KiB ones (each ends in a piece shorter than 2 KiB); grids
whose warps step within a task and across several; destination rows and ranks within and
past the kernel's shared-memory copies of those tables; a tensor's short last piece with
a byte tail; a source that is not 16-byte aligned (the byte path); a task table with more
rows than the device-written count; with and without published chunk flags (a relay's
tasks, or every chunk when the kernel is told to flag all: readers wait per slot). The
destinations are poisoned; afterwards each replica equals its source byte for byte, the
gaps stay poisoned, and the flags and counters are as the schedule says (needs a GPU;
a refused plan's sync is test_one_launch_sync_gpu's)."""

from contextlib import nullcontext

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.runtime.kernels import kernel_constant
from ultraep.transfer.schedule import DEST_FIELDS, FLAG_WRITER_BITS, WEIGHT_TASK_FIELDS

pytestmark = [pytest.mark.gpu, requires_gpu]

TENSOR_BYTES = [100_052, 16_404]  # neither a multiple of 16: each tensor ends in a byte tail
SLOT_OFFSETS = [0, 100_096]       # each tensor on a 256-byte boundary of the replica slot
SLOT_BYTES = 116_736
CHUNK_TILES = 2
FLAG_BYTES = 256                  # chunk flags before each destination's two slots
FLAG_BASE_B = 16                  # expert B's chunk flags start at this flag slot
POISON = 0xA5


def tables(tile_bytes, fanout, publish, row_base, rank_base):
    """Task, tensor and destination tables: expert A (source entries 0, 1) to destinations
    0 .. fanout-1 in slot 0, then expert B (entries 2, 3) to the first max(1, fanout // 2)
    of them in slot 1. Their destination rows start at `row_base` and their ranks at
    `rank_base` (junk rows and ranks before them), so rows or ranks past the kernel's
    shared-memory copies of the tables (its first 256) are read from global memory."""
    tiles = [-(-n // tile_bytes) for n in TENSOR_BYTES]
    chunks = -(-sum(tiles) // CHUNK_TILES)
    assert chunks <= FLAG_BASE_B
    fanout_b = max(1, fanout // 2)
    tasks = [(2 * e, c, c * CHUNK_TILES, min(c * CHUNK_TILES + CHUNK_TILES, sum(tiles)),
              row_base + begin, row_base + end, -1, publish)
             for e, (begin, end) in enumerate([(0, fanout), (fanout, fanout + fanout_b)]) for c in range(chunks)]
    tasks += [(-9, -9, -9, -9, -9, -9, -9, -9)] * 2  # rows past the count are never read
    tensor_table = np.array([(0, TENSOR_BYTES[0], SLOT_OFFSETS[0]), (tiles[0], TENSOR_BYTES[1], SLOT_OFFSETS[1])],
                            np.int64)
    dests = ([(-7, -7, -7)] * row_base + [(rank_base + d, FLAG_BYTES, 0) for d in range(fanout)]
             + [(rank_base + d, FLAG_BYTES + SLOT_BYTES, FLAG_BASE_B) for d in range(fanout_b)])
    tasks, dests = np.array(tasks, np.int64), np.array(dests, np.int64)
    assert tasks.shape[1] == WEIGHT_TASK_FIELDS and dests.shape[1] == DEST_FIELDS
    return tasks, 2 * chunks, tensor_table, dests, fanout_b


@pytest.mark.parametrize("publish, every_chunk", [(0, 0), (1, 0), (0, 1)])
@pytest.mark.parametrize("source_offset", [0, 4])
@pytest.mark.parametrize("tile_bytes", [32 << 10, 5 << 10])
def test_weight_sync_fanouts(tile_bytes, source_offset, publish, every_chunk):
    import cupy

    from ultraep.runtime.kernels import get_function

    kernel = get_function("transfer.cu", "weight_sync")
    rng = np.random.default_rng(tile_bytes + source_offset + publish + 2 * every_chunk)
    expert_bytes = sum(TENSOR_BYTES)
    source = cupy.asarray(rng.integers(0, 256, 2 * expert_bytes + 64, dtype=np.uint8))  # A, then B
    starts = [source_offset, source_offset + TENSOR_BYTES[0]]
    src_ptrs = cupy.asarray(np.array([source.data.ptr + e * expert_bytes + s for e in range(2) for s in starts],
                                     np.uint64))
    want = []
    for e in range(2):
        slot = cupy.full(SLOT_BYTES, POISON, np.uint8)
        for n, o, s in zip(TENSOR_BYTES, SLOT_OFFSETS, starts):
            slot[o:o + n] = source[e * expert_bytes + s:e * expert_bytes + s + n]
        want.append(slot)
    poison_slot = cupy.full(SLOT_BYTES, POISON, np.uint8)
    poison_flag = np.uint64(int.from_bytes(bytes([POISON]) * 8, "little"))
    epoch, rank = 7, 3
    flag = np.uint64(epoch << FLAG_WRITER_BITS | rank) if publish or every_chunk else poison_flag
    # (fan-out, blocks, first destination row, first rank): rows and ranks within and past 256
    configs = [(f, 1 + f % 3, 0, 0) for f in range(1, 11)] + [(33, 2, 0, 0), (4, 37, 0, 0), (33, 3, 240, 240),
                                                              (5, 2, 300, 0), (6, 2, 0, 300), (7, 3, 300, 300)]
    # one piece counter for every launch: each must leave it at zero for the next to copy every piece
    claims = cupy.zeros(kernel_constant("transfer.cu", "CLAIM_WORDS"), np.uint64)
    for fanout, blocks, row_base, rank_base in configs:
        tasks, count, tensor_table, dests, fanout_b = tables(tile_bytes, fanout, publish, row_base, rank_base)
        chunks = count // 2
        buffers = [cupy.full(FLAG_BYTES + 2 * SLOT_BYTES, POISON, np.uint8) for _ in range(fanout)]
        done = cupy.zeros(count, np.int32)
        status = cupy.zeros(kernel_constant("transfer.cu", "STATUS_WORDS"), np.uint64)
        kernel((blocks,), (kernel_constant("transfer.cu", "SYNC_THREADS"),),
               (cupy.asarray(tasks), cupy.asarray(np.array([count], np.int32)),
                np.int32(len(tasks)), np.int32(CHUNK_TILES), cupy.asarray(tensor_table), np.int32(2),
                np.int64(tile_bytes), cupy.asarray(dests), np.int32(len(dests)), src_ptrs, np.int32(4),
                cupy.asarray(np.array([0xDEAD0000] * rank_base + [b.data.ptr for b in buffers],
                                      np.uint64)),
                np.int32(rank_base + fanout),
                np.int32(rank), cupy.asarray(np.array([epoch], np.uint64)), np.int32(every_chunk), done,
                np.uint64(10**9), status, claims))
        cupy.cuda.get_current_stream().synchronize()
        assert not status.any(), f"fan-out {fanout}: status {status.get()}"
        assert not claims.any(), f"fan-out {fanout}: piece counter not reset: {claims.get()}"
        assert not done.any(), f"fan-out {fanout}: chunk counters not reset: {done.get()}"
        for d, buffer in enumerate(buffers):
            has_b = d < fanout_b
            slots = buffer[FLAG_BYTES:].reshape(2, SLOT_BYTES)
            assert bool(cupy.array_equal(slots[0], want[0])), f"fan-out {fanout}: destination {d}, expert A slot wrong"
            assert bool(cupy.array_equal(slots[1], want[1] if has_b else poison_slot)), \
                f"fan-out {fanout}: destination {d}, expert B slot wrong"
            flags = buffer[:FLAG_BYTES].view(np.uint64).get()
            expected = np.full(FLAG_BYTES // 8, poison_flag, np.uint64)
            expected[:chunks] = flag
            if has_b:
                expected[FLAG_BASE_B:FLAG_BASE_B + chunks] = flag
            assert (flags == expected).all(), f"fan-out {fanout}: destination {d} chunk flags {flags}"


def test_wait_replica_slots():
    """The per-slot wait: a slot whose chunk flags carry the epoch (or a later one) passes, a
    slot the plan leaves empty passes without flags, a slot still missing one chunk's
    flag times out with (layer, slot, chunk, expected, seen) recorded, and a wait
    enqueued before the flags land finishes once another stream writes them."""
    import cupy

    from ultraep.runtime.kernels import get_function

    kernel = get_function("transfer.cu", "wait_replica_slots")
    words = kernel_constant("transfer.cu", "WAIT_STATUS_WORDS")
    threads = kernel_constant("transfer.cu", "WAIT_THREADS")
    chunks, base, epoch, rank, layer, masters = 300, 5, 9, 2, 6, 3  # more chunks than threads
    assert chunks > threads
    pad = cupy.zeros(base + 3 * chunks, np.uint64)
    flags = pad[base:].reshape(3, chunks)
    phys_to_log = cupy.asarray(np.array([0] * (rank * 6) + [10, 11, 12, 40, -1, 41], np.int32))  # M + S = 6 slots

    def wait(first, count, timeout_ns=10**9, stream=None):
        with stream if stream is not None else nullcontext():
            status = cupy.zeros(words, np.uint64)
            kernel((count,), (threads,), (np.uint64(pad.data.ptr), np.int64(base), np.int32(chunks), np.int32(first),
                                          np.uint64(epoch), phys_to_log, np.int32(rank * 6 + masters),
                                          np.int32(rank), np.int32(layer), np.uint64(timeout_ns), status))
        return status

    flags[0] = (epoch << FLAG_WRITER_BITS) | 1
    flags[2, ::2] = ((epoch + 1) << FLAG_WRITER_BITS) | 3  # a later sync's flags count as well
    flags[2, 1::2] = (epoch << FLAG_WRITER_BITS) | 3
    status = wait(0, 3)  # slot 1 is empty in the plan: its unset flags are not waited for
    cupy.cuda.Device().synchronize()
    assert not status.any(), status.get()

    flags[2, chunks - 1] = ((epoch - 1) << FLAG_WRITER_BITS) | 3  # the last chunk still holds the last sync's
    status = wait(2, 1, timeout_ns=20_000_000)
    cupy.cuda.Device().synchronize()
    assert status.get().tolist() == [1, layer, 2, chunks - 1, epoch, ((epoch - 1) << FLAG_WRITER_BITS) | 3]

    waiting, writer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the flags written so far, before the streams below read them
    status = wait(2, 1, stream=waiting)
    done = cupy.cuda.Event()
    done.record(waiting)
    assert not done.done, "the wait finished before its last flag landed"
    with writer:
        flags[2, chunks - 1] = (epoch << FLAG_WRITER_BITS) | 3
    done.synchronize()
    assert not status.any(), status.get()
