"""Data plane across 4 ranks: weight sync (with and without relay), gradient reduction,
empty plans, repeatability, bad input and a relay whose master never sends -- CPU backend
in CI, CUDA IPC on a GPU; and the engine's launch constants against the kernel's."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, kernel_defines, run_ranks
from ultraep.transfer import engine

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


def test_engine_constants_match_the_kernel():
    """The host sizes grids, slot counts and limits by these: a kernel edit that changes
    one (a block's warps, its register budget, the piece size) must change the engine."""
    defined = kernel_defines("transfer.cu") | kernel_defines("piece_copy.cuh")
    assert defined["SYNC_THREADS"] == "(32 * SYNC_WARPS)"
    assert engine.SYNC_THREADS == 32 * int(defined["SYNC_WARPS"])
    assert engine.SYNC_BLOCKS_PER_SM == int(defined["SYNC_MIN_BLOCKS"])
    assert defined["PIECE_BYTES"] == "(32 * 16 * PIECE_VECS)"
    assert engine.PIECE_BYTES == 32 * 16 * int(defined["PIECE_VECS"])
    assert engine.MAX_TENSORS_PER_EXPERT == int(defined["MAX_TENSORS"])
    assert engine.MAX_REPLICAS_PER_EXPERT == int(defined["MAX_DESTS"])
