"""The Balancer across 4 ranks: the whole flow checked against the NumPy planner and the
data-plane reference, a 2-stage 1F1B pipeline with micro-batches in flight, and bad input
raised on every rank -- CPU backend in CI, CUDA IPC on a GPU -- and, on a GPU, the hot
path without allocations or host waits."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, requires_gpu, run_ranks

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["flow", "pipeline", "bad-input"])
def test_balancer_across_ranks(backend, check, tmp_path):
    out = run_ranks(RANKS, "integration/mpi/balancer_check.py", backend, check, str(tmp_path), timeout=240)
    assert_all_ranks_ok(out, RANKS, check)
    if check == "flow":
        assert (tmp_path / "balancer_trace.npz").is_file() and (tmp_path / "rank_loads.png").stat().st_size > 0


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
def test_balancer_hot_path_neither_allocates_nor_waits(tmp_path):
    """update/weight_sync/reroute/restore/reduce_grads enqueued behind a closed gate kernel
    with zero CuPy pool allocations (see ``hot_path`` in the script)."""
    out = run_ranks(RANKS, "integration/mpi/balancer_check.py", "device", "hot-path", str(tmp_path), timeout=240)
    assert_all_ranks_ok(out, RANKS, "hot-path")
    assert "0 pool allocations" in out
