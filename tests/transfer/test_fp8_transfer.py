"""FP8 expert weights with float32 block scales across 4 ranks: replicas byte-identical
to their masters after weight sync and restore, gradients reduced beside them -- host
backend in CI, CUDA IPC on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["sync", "grads"])
def test_fp8_transfer_across_ranks(backend, check):
    out = run_ranks(RANKS, "transfer/mpi/fp8_check.py", backend, check, timeout=240)
    assert_all_ranks_ok(out, RANKS, check)
