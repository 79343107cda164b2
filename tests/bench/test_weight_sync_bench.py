"""The weight-sync bench's task-free reference copy (``fanout_copy``, raw_kernels/bench_copy.cu,
launched by ``ultraep.bench.weight_sync.launch_fanout_copy``): random bytes to every
destination of poisoned buffers, for sizes of whole 2 KiB pieces, with a short last piece and
a byte tail, an empty copy, a source that is not 16-byte aligned (the byte path), fan-outs
past the unrolled store paths and past a warp's lanes, and grids whose warps take one piece
or many. Each destination must equal the source byte for byte (the NumPy reference of a copy
is the source itself) with its guard bytes untouched; bad launches raise (needs a GPU). And
the launcher's constants against the kernel's."""

import numpy as np
import pytest

from tests.conftest import kernel_defines, requires_gpu
from ultraep.bench import weight_sync

GUARD = 256   # poisoned bytes on each side of a destination
POISON = 0x5A


def test_launcher_constants_match_the_kernel():
    defined = kernel_defines("bench_copy.cu")
    assert weight_sync.FANOUT_COPY_THREADS == 32 * int(defined["COPY_WARPS"])
    assert weight_sync.FANOUT_COPY_MAX_DESTS == int(defined["COPY_MAX_DESTS"])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("source_offset", [0, 4])
@pytest.mark.parametrize("nbytes", [0, 2048 * 37, 5 * 1024 + 7, 100_052])
def test_fanout_copy_matches_source(nbytes, source_offset):
    import cupy

    rng = np.random.default_rng(nbytes + source_offset)
    backing = cupy.asarray(rng.integers(0, 256, nbytes + 16, dtype=np.uint8))
    source = backing[source_offset:source_offset + nbytes]
    want = source.get()
    for fanout, blocks in [(1, 1), (2, 3), (3, 37), (8, 2), (9, 5), (33, 1)]:
        buffers = [cupy.full(nbytes + 2 * GUARD, POISON, np.uint8) for _ in range(fanout)]
        dest_ptrs = cupy.asarray(np.array([b.data.ptr + GUARD for b in buffers], np.uint64))
        weight_sync.launch_fanout_copy(source, dest_ptrs, blocks)
        cupy.cuda.get_current_stream().synchronize()
        for d, buffer in enumerate(buffers):
            got = buffer.get()
            assert (got[GUARD:GUARD + nbytes] == want).all(), f"fan-out {fanout}, destination {d}: copy differs"
            assert (got[:GUARD] == POISON).all() and (got[GUARD + nbytes:] == POISON).all(), \
                f"fan-out {fanout}, destination {d}: wrote outside its bytes"


@pytest.mark.gpu
@requires_gpu
def test_fanout_copy_rejects_bad_launches():
    import cupy

    source = cupy.arange(64, dtype=np.uint8)
    target = cupy.zeros(64 + 16, np.uint8)
    aligned = cupy.asarray(np.array([target.data.ptr], np.uint64))
    with pytest.raises(ValueError, match="16-byte aligned"):
        weight_sync.launch_fanout_copy(source, aligned + 8, 1)
    with pytest.raises(ValueError, match="at most 128 destinations"):
        weight_sync.launch_fanout_copy(source, cupy.tile(aligned, 129), 1)
    with pytest.raises(ValueError, match="blocks must be at least 1"):
        weight_sync.launch_fanout_copy(source, aligned, 0)
    assert not target.any()  # nothing launched
