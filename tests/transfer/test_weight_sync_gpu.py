"""The weight-sync kernel (raw_kernels/transfer.cu) alone, in one process, on hand-built
task tables: every fan-out from 1 to 10 (each unrolled store path up to 8 and the run-time
loop above), whole pieces, a tensor's short last piece with a byte tail, and a source that
is not 16-byte aligned (the byte path), with and without published chunk flags. The
destinations are poisoned; afterwards each replica equals its source byte for byte, the
gaps between tensors stay poisoned, and the flags and counters are as the schedule says
(needs a GPU)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.transfer.schedule import DEST_FIELDS, FLAG_WRITER_BITS, WEIGHT_TASK_FIELDS

pytestmark = [pytest.mark.gpu, requires_gpu]

TENSOR_BYTES = [100_052, 16_404]  # neither a multiple of 16: each tensor ends in a byte tail
SLOT_OFFSETS = [0, 100_096]       # each tensor on a 256-byte boundary of the replica slot
SLOT_BYTES = 116_736
TILE_BYTES, CHUNK_TILES = 32 << 10, 2
FLAG_BYTES = 256                  # chunk flags before each destination's slot
POISON = 0xA5


def tables(fanout, publish):
    """Task, tensor and destination tables for one expert to `fanout` destinations."""
    tiles = [-(-n // TILE_BYTES) for n in TENSOR_BYTES]
    first_tiles = [0, tiles[0]]
    chunks = -(-sum(tiles) // CHUNK_TILES)
    tasks = np.array([(0, c, c * CHUNK_TILES, min(c * CHUNK_TILES + CHUNK_TILES, sum(tiles)), 0, fanout, -1, publish)
                      for c in range(chunks)], np.int64)
    tensor_table = np.array([(f, n, o) for f, n, o in zip(first_tiles, TENSOR_BYTES, SLOT_OFFSETS)], np.int64)
    dests = np.array([(d, FLAG_BYTES, 0) for d in range(fanout)], np.int64)
    assert tasks.shape[1] == WEIGHT_TASK_FIELDS and dests.shape[1] == DEST_FIELDS
    return tasks, tensor_table, dests


@pytest.mark.parametrize("publish", [0, 1])
@pytest.mark.parametrize("source_offset", [0, 4])
@pytest.mark.parametrize("blocks", [1, 3])
def test_weight_sync_fanouts(blocks, source_offset, publish):
    import cupy

    from ultraep.runtime.kernels import get_function

    kernel = get_function("transfer.cu", "weight_sync")
    rng = np.random.default_rng(blocks * 10 + source_offset + publish)
    source = cupy.asarray(rng.integers(0, 256, sum(TENSOR_BYTES) + 64, dtype=np.uint8))
    src_ptrs = cupy.asarray(np.array([source.data.ptr + source_offset,
                                      source.data.ptr + source_offset + TENSOR_BYTES[0]], np.uint64))
    want = cupy.full(SLOT_BYTES, POISON, np.uint8)
    for t, (n, o) in enumerate(zip(TENSOR_BYTES, SLOT_OFFSETS)):
        start = source_offset + sum(TENSOR_BYTES[:t])
        want[o:o + n] = source[start:start + n]
    epoch, rank = 7, 3
    for fanout in range(1, 11):
        tasks, tensor_table, dests = (cupy.asarray(a) for a in tables(fanout, publish))
        buffers = [cupy.full(FLAG_BYTES + SLOT_BYTES, POISON, np.uint8) for _ in range(fanout)]
        peer_bases = cupy.asarray(np.array([b.data.ptr for b in buffers], np.uint64))
        done = cupy.zeros(len(tasks), np.int32)
        status = cupy.zeros(4, np.uint64)
        kernel((blocks,), (256,), (tasks, cupy.asarray(np.array([len(tasks)], np.int32)), np.int32(len(tasks)),
                                   np.int32(CHUNK_TILES), tensor_table, np.int32(2), np.int64(TILE_BYTES), dests,
                                   np.int32(fanout), src_ptrs, np.int32(2), peer_bases, np.int32(fanout),
                                   np.int32(rank), np.uint64(epoch), done,
                                   np.uint64(10**9), status))
        cupy.cuda.get_current_stream().synchronize()
        assert not status.any(), f"fan-out {fanout}: status {status.get()}"
        assert not done.any(), f"fan-out {fanout}: chunk counters not reset: {done.get()}"
        flag = np.uint64(epoch << FLAG_WRITER_BITS | rank) if publish else np.uint64(int.from_bytes(bytes([POISON]) * 8, "little"))
        for d, buffer in enumerate(buffers):
            assert bool(cupy.array_equal(buffer[FLAG_BYTES:], want)), f"fan-out {fanout}: destination {d} differs"
            flags = buffer[:8 * len(tasks)].view(np.uint64).get()
            assert (flags == flag).all(), f"fan-out {fanout}: destination {d} chunk flags {flags}"
