"""A heap barrier refused by one rank: the refusal travels in its flag, so every peer raises
the cause at once (not a timeout) and the heap stays usable. CPU backend in CI, CUDA IPC
on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_refused_barrier(backend, ranks):
    out = run_ranks(ranks, "runtime/mpi/heap_refusal_check.py", backend, timeout=180)
    assert_all_ranks_ok(out, ranks, "refusal")


def test_refusal_cause_decoding():
    """A refusal is read from the peer's flag of that epoch or, once overwritten, from the
    previous-epoch field of its next flag; never from an older or unrelated flag."""
    from ultraep.runtime.heap import REFUSED_BAD_TIMEOUT, flag_constant, flag_epoch, refusal_cause

    this, prev = flag_constant("BARRIER_CAUSE_SHIFT"), flag_constant("BARRIER_PREV_CAUSE_SHIFT")
    refusal = 7 | REFUSED_BAD_TIMEOUT << this
    assert flag_epoch(refusal) == 7
    assert refusal_cause(refusal, 7) == REFUSED_BAD_TIMEOUT
    assert refusal_cause(refusal, 8) == 0, "a refusal of epoch 7 must not refuse epoch 8"
    assert refusal_cause(8 | REFUSED_BAD_TIMEOUT << prev, 7) == REFUSED_BAD_TIMEOUT
    assert refusal_cause(8 | REFUSED_BAD_TIMEOUT << prev, 8) == 0, "epoch 8 itself was not refused"
    assert refusal_cause(9 | REFUSED_BAD_TIMEOUT << prev, 7) == 0
    assert refusal_cause(7, 7) == refusal_cause(8, 7) == 0
