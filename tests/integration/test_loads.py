"""The load row: NumPy semantics against naive loops, and the CUDA gather bitwise
against it (int32 and int64 ids, ids out of range, a caller's row, publication into the
heap and the gathered matrix)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.integration.host import count_loads


def naive_counts(ids, num_experts):
    counts, bad = [0] * num_experts, []
    for i, e in enumerate(np.asarray(ids).reshape(-1).tolist()):
        if 0 <= e < num_experts:
            counts[e] += 1
        else:
            bad.append((i, e))
    return counts, bad


@pytest.mark.parametrize("seed", range(4))
def test_count_loads_matches_loops(seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 40))
    ids = rng.integers(-2, E + 2, size=(int(rng.integers(0, 50)), int(rng.integers(1, 5))))
    counts, bad = count_loads(ids, E)
    want, want_bad = naive_counts(ids, E)
    assert counts.dtype == np.int32 and counts.tolist() == want
    if not want_bad:
        assert bad is None
    else:
        assert (bad.count, bad.first_index, bad.first_value) == (len(want_bad), *want_bad[0])
        message = bad.message(3, E, ids.shape)
        assert ("rank 3" in message
                and str(tuple(int(i) for i in np.unravel_index(want_bad[0][0], ids.shape))) in message)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_device_gather_is_bitwise_the_reference(dtype):
    """One rank: counting alone (the row staged, bad ids named), publishing the staged row,
    counting and publishing in one launch, and a caller's row -- each gathered matrix
    bitwise the NumPy count, the staged row zeroed after each publication."""
    import cupy
    from mpi4py import MPI

    from ultraep.integration.device import DeviceLoadGather
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime import open_heap

    group = EPGroup(MPI.COMM_SELF)
    rng = np.random.default_rng(5)
    with open_heap(group, 1 << 20, backend="device") as heap:
        for E, n, with_bad in ((64, 300_000, False), (257, 4099, True), (8, 0, False)):
            matrix = heap.alloc(f"matrix{E}", (2, 1, E), np.int32)
            gather = DeviceLoadGather(heap, E, matrix, heap.alloc_signals(f"flags{E}", 1), timeout_s=10.0)
            ids = rng.integers(0, E, size=(n, 1)).astype(dtype)
            if with_bad:
                ids[[17, 900, 4000], 0] = [E, -1, E + 5]
            device_ids = cupy.asarray(ids)
            want, bad = count_loads(ids, E)
            out = cupy.full((1, E), -7, np.int32)
            gather.launch(device_ids, from_ids=True, publish=False)
            assert np.array_equal(gather.counts.get(), want)
            assert gather.read_bad(device_ids) == bad
            gather.launch(None, from_ids=False, publish=True, out=out)  # epoch 1: gathered matrix 0
            assert np.array_equal(out.get()[0], want) and np.array_equal(matrix.local.get()[0, 0], want)
            assert not gather.counts.any() and int(gather.gathers.get()[0]) == 1
            for epoch, (source, from_ids) in enumerate(((device_ids, True), (cupy.asarray(want), False)), start=2):
                out.fill(-7)
                gather.launch(source, from_ids=from_ids, publish=True, out=out)  # the kernel numbers the epoch
                assert np.array_equal(out.get()[0], want), (epoch, from_ids)
                assert np.array_equal(matrix.local.get()[(epoch - 1) % 2, 0], want), (epoch, from_ids)
                assert not gather.counts.any() and int(gather.gathers.get()[0]) == epoch
            gather.read_bad(device_ids)
            gather.check()  # no wait timed out
