"""The weight-sync bench's task-free reference copy (``fanout_copy``, raw_kernels/bench_copy.cu,
launched by ``ultraep.bench.weight_sync.FanoutCopy``): random bytes to every
destination of poisoned buffers, for sizes of whole 2 KiB pieces, with a short last piece and
a byte tail, an empty copy, a source that is not 16-byte aligned (the byte path), fan-outs
past the unrolled store paths and past a warp's lanes, and grids whose warps take one piece
or many. Each destination must equal the source byte for byte (the NumPy reference of a copy
is the source itself) with its guard bytes untouched; bad launches raise (needs a GPU). And
the launcher's constants against the kernel's."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.bench import weight_sync
from ultraep.runtime.kernels import kernel_constants

GUARD = 256   # poisoned bytes on each side of a destination
POISON = 0x5A


def test_launcher_constants_are_the_kernels():
    defined = kernel_constants("bench_copy.cu")
    assert weight_sync.FANOUT_COPY_THREADS == defined["COPY_THREADS"] == 32 * defined["COPY_WARPS"]
    assert weight_sync.FANOUT_COPY_MAX_DESTS == defined["COPY_MAX_DESTS"]


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
        weight_sync.FanoutCopy(source, [b.data.ptr + GUARD for b in buffers]).launch(blocks)
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
    with pytest.raises(ValueError, match="16-byte aligned"):
        weight_sync.FanoutCopy(source, [target.data.ptr + 8])
    with pytest.raises(ValueError, match="at most 128 destinations"):
        weight_sync.FanoutCopy(source, [target.data.ptr] * 129)
    with pytest.raises(ValueError, match="blocks must be at least 1"):
        weight_sync.FanoutCopy(source, [target.data.ptr]).launch(0)
    assert not target.any()  # nothing launched


@pytest.mark.gpu
@requires_gpu
def test_fanout_copy_launch_is_captured_in_a_graph():
    """The bench times it as CUDA-graph replays: nothing in launch() may leave the stream."""
    import cupy

    source = cupy.asarray(np.random.default_rng(1).integers(0, 256, 3 * 2048 + 5, dtype=np.uint8))
    buffers = [cupy.full(source.nbytes, POISON, np.uint8) for _ in range(3)]
    copy = weight_sync.FanoutCopy(source, [b.data.ptr for b in buffers])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        copy.launch(2)
        graph = stream.end_capture()
    assert all((b == POISON).all() for b in buffers)  # captured, not run
    graph.launch(stream)
    stream.synchronize()
    assert all(bool(cupy.array_equal(b, source)) for b in buffers)
