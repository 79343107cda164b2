"""Dispatcher across ranks against the sequential reference, bit for bit (CPU backend in CI,
CUDA IPC on a GPU); identical bits across repeated runs and across rank counts; bad input
raising on every rank."""

import re

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks



def run_exact(backend: str, ranks: int, dtype: str, repeats: int, digests_file) -> str:
    """The digests of the combined outputs, read from the file rank 0 writes: the merged
    stdout of several ranks can splice another rank's line into the middle of one."""
    out = run_ranks(ranks, "token/mpi/dispatch_check.py", backend, "exact", dtype, str(repeats), timeout=300,
                    env={"ULTRAEP_DIGESTS_FILE": str(digests_file)})
    assert_all_ranks_ok(out, ranks, "exact")
    assert re.search(r"non-bitwise-equal elements 0 \(all ranks 0\)", out), out
    return digests_file.read_text()


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_across_rank_counts(backend, tmp_path):
    """Ranks 1, 2, 4 each bitwise equal to the reference; the combined outputs of all global
    tokens identical across rank counts (bf16 data, fp32 gates)."""
    repeats = 10 if backend == "device" else 2
    digests = {ranks: run_exact(backend, ranks, "bfloat16", repeats, tmp_path / f"digests-{ranks}")
               for ranks in (1, 2, 4)}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_data(backend, tmp_path):
    run_exact(backend, 2, "float32", 2, tmp_path / "digests")


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


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatcher_and_weight_transfer_share_one_heap(backend):
    """One heap sized from Dispatcher.heap_requirements + WeightTransfer.heap_requirements
    holds both, exactly; the dispatcher takes the heap's backend and leaves it open."""
    out = run_ranks(2, "token/mpi/dispatch_check.py", backend, "shared-heap", "bfloat16", timeout=300)
    assert_all_ranks_ok(out, 2, "shared-heap")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_push_dispatch_is_the_two_pass_one(backend, ranks):
    """Dispatcher(expert_input=True): each pair written straight into its row of the heap's
    receive buffer gives the two-pass dispatch's rows, gates, counts, offsets and handle,
    and the same combine, pull combine and backward results, bit for bit."""
    out = run_ranks(ranks, "token/mpi/dispatch_check.py", backend, "push", "bfloat16", timeout=300)
    assert_all_ranks_ok(out, ranks, "push")
    assert re.search(r"push non-bitwise-equal elements 0 \(all ranks 0\)", out), out
