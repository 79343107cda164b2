"""``Balancer(min_replica_tokens="auto")`` on 2 ranks: the ranks agree on the largest of
their own values and plan with it, a missing profile is measured and cached, bad values
are refused on every rank -- CPU backend in CI, CUDA IPC on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

RANKS = 2


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["agree", "measure", "bad-input"])
def test_balancer_auto_across_ranks(backend, check, tmp_path):
    out = run_ranks(RANKS, "tune/mpi/balancer_auto.py", backend, check, str(tmp_path), timeout=600)
    assert_all_ranks_ok(out, RANKS, check)
