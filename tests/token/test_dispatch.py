"""Dispatcher across ranks against the sequential reference, bit for bit (CPU backend in CI,
CUDA IPC on a GPU); identical bits across repeated runs and across rank counts; bad input
raising on every rank."""

import re

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks



def run_exact(backend: str, ranks: int, dtype: str, repeats: int) -> str:
    out = run_ranks(ranks, "token/mpi/dispatch_check.py", backend, "exact", dtype, str(repeats), timeout=300)
    assert_all_ranks_ok(out, ranks, "exact")
    assert re.search(r"non-bitwise-equal elements 0 \(all ranks 0\)", out), out
    return re.search(r"digests (.*)", out).group(1)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_across_rank_counts(backend):
    """Ranks 1, 2, 4 each bitwise equal to the reference; the combined outputs of all global
    tokens identical across rank counts (bf16 data, fp32 gates)."""
    repeats = 10 if backend == "cuda" else 2
    digests = {ranks: run_exact(backend, ranks, "bfloat16", repeats) for ranks in (1, 2, 4)}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_data(backend):
    run_exact(backend, 2, "float32", 2)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend):
    out = run_ranks(4, "token/mpi/dispatch_check.py", backend, "bad-input", "float32", timeout=300)
    assert_all_ranks_ok(out, 4, "bad-input")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_rank_times_out_instead_of_hanging(backend):
    out = run_ranks(4, "token/mpi/dispatch_check.py", backend, "timeout", "float32", timeout=120)
    assert_all_ranks_ok(out, 4, "timeout")
    assert out.count("waiting for rank 3") == 3, out


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_balanced_layer_is_bitwise_the_plain_one(backend):
    """The planner's physical slot ids through Dispatcher.for_layout: even receive load, and
    a combined output bitwise equal to the unbalanced dispatcher's."""
    out = run_ranks(4, "token/mpi/dispatch_check.py", backend, "balanced", "bfloat16", timeout=300)
    assert_all_ranks_ok(out, 4, "balanced")
    assert "balanced [96, 96, 96, 96]" in out, out
