"""The Dispatcher's ``grid`` (blocks of the device's copy kernels): refused on every rank
unless a positive int, at most what the GPU holds resident; the host backend checks it and
runs as without it."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.errors import CollectiveError
from ultraep.token import Dispatcher
from ultraep.token.device import THREADS, grid_error

SET_UP = dict(hidden=64, dtype="float32", top_k=2, num_experts=4, max_tokens=8, backend="host")


@pytest.fixture
def group():
    from mpi4py import MPI

    from ultraep.runtime.group import EPGroup

    return EPGroup(MPI.COMM_SELF, use_gpu=False)


@pytest.mark.parametrize("grid", [0, -3, 2.0, True, "64", np.float32(8)])
def test_a_grid_that_is_not_a_positive_int_is_refused(group, grid):
    with pytest.raises(CollectiveError, match=r"Dispatcher set-up failed on 1 of 1 rank.*grid must be None or a "
                                              r"positive int \(blocks of the copy kernels\), got"):
        Dispatcher(group, **SET_UP, grid=grid)


@pytest.mark.parametrize("grid", [None, 1, np.int64(300)])
def test_the_host_backend_takes_a_valid_grid_and_runs_as_without_it(group, grid):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64), dtype=np.float32)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(8)]).astype(np.int32)
    gates = rng.random((8, 2), dtype=np.float32)
    with Dispatcher(group, **SET_UP, grid=grid) as disp:
        assert disp.grid is None and disp.max_grid is None  # no copy kernels on the host
        result = disp.dispatch(x, ids, gates)
        combined = disp.combine(result.x, result.handle)
    expected = np.einsum("tk,th->th", gates, x)  # identity experts: each token's gates times itself
    np.testing.assert_allclose(combined, expected, rtol=1e-6)


def test_the_device_bound_is_the_resident_blocks():
    assert grid_error(None, 264) is None
    assert grid_error(264, 264) is None
    message = grid_error(265, 264)
    assert message == f"grid must be at most the 264 blocks of {THREADS} threads resident at once on this GPU, got 265"


@pytest.mark.gpu
@requires_gpu
def test_the_device_refuses_a_grid_beyond_the_resident_blocks_and_any_other_grid_gives_the_same_bits():
    import cupy

    from mpi4py import MPI

    from ultraep.runtime.group import EPGroup

    group = EPGroup(MPI.COMM_SELF)
    set_up = dict(SET_UP, backend="device", hidden=256, dtype="bfloat16", max_tokens=512)
    rng = np.random.default_rng(1)
    x = cupy.asarray(rng.integers(0x3F00, 0x4000, size=(512, 256), dtype=np.int32).astype(np.uint16)).view(np.int16)
    ids = cupy.asarray(np.stack([rng.permutation(4)[:2] for _ in range(512)]).astype(np.int32))
    gates = cupy.asarray(rng.random((512, 2), dtype=np.float32))
    outputs = []
    with Dispatcher(group, **set_up) as disp:
        default, bound = disp.grid, disp.max_grid
        assert 1 <= default <= bound
    for grid in (None, 1, 3, bound):
        with Dispatcher(group, **set_up, grid=grid) as disp:
            assert disp.grid == (default if grid is None else grid)
            result = disp.dispatch(x, ids, gates)
            out = cupy.full((512, 256), -1, dtype=np.int16)  # poisoned: a row left out shows
            disp.combine(result.x, result.handle, out=out)
            disp.check()
            rows = int(result.offsets[-1])
            outputs.append((cupy.asnumpy(result.x[:rows].view(np.uint16)), cupy.asnumpy(out.view(np.uint16))))
    for received, combined in outputs[1:]:
        np.testing.assert_array_equal(received, outputs[0][0])
        np.testing.assert_array_equal(combined, outputs[0][1])
    with pytest.raises(CollectiveError, match=f"grid must be at most the {bound} blocks"):
        Dispatcher(group, **set_up, grid=bound + 1)
