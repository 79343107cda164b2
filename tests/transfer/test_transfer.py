"""Data plane across 4 ranks: weight sync (with and without relay), gradient reduction,
empty plans, repeatability, bad input and a relay whose master never sends -- CPU backend
in CI, CUDA IPC on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check, grad_dtype", [("sync", "float32"), ("relay", "float32"), ("relay-grids", "float32"),
                                               ("pipeline", "float32"),
                                               ("grads", "float32"),
                                               ("grads", "bfloat16"), ("empty", "float32"), ("repeat", "float32"),
                                               ("bad-input", "float32"), ("relay-timeout", "float32")])
def test_transfer_across_ranks(backend, check, grad_dtype):
    out = run_ranks(RANKS, "transfer/mpi/transfer_check.py", backend, check, grad_dtype, timeout=240)
    assert_all_ranks_ok(out, RANKS, check)
    if check == "relay":
        assert "until their relay" in out
