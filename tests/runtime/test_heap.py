"""Symmetric heap across ranks: every rank writes every peer, every byte checked; the
barrier's timeout; bad input raising on every rank. CPU backend in CI, CUDA IPC on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["exchange", "timeout", "bad-input"])
def test_heap_across_ranks(backend, check):
    out = run_ranks(RANKS, "runtime/mpi/heap_check.py", backend, check, timeout=180)
    assert_all_ranks_ok(out, RANKS, check)
    if check == "timeout":
        assert out.count("waiting for rank 3") == RANKS - 1, out
