"""EP group: rank, size, local rank, sub-groups, agreement checks."""

import pytest

from tests.conftest import assert_all_ranks_ok, run_ranks
from ultraep.errors import ClosedError
from ultraep.runtime.group import EPGroup, GroupMismatchError, failure_detail


class ListComm:
    """A framework's own group: allgather of Python objects plus rank/size attributes. The
    peers enter the caller's collective (its name) with their values, or with ``(name,
    value)`` where ``entered`` names the call each is in."""

    def __init__(self, rank, peers, entered=None):
        self.rank, self.size, self.peers, self.entered = rank, len(peers), peers, entered

    def allgather(self, obj):
        what = obj[0]  # the group sends (its call's name, value)
        return [obj if r == self.rank else (self.entered[r] if self.entered else what, peer)
                for r, peer in enumerate(self.peers)]


def test_group_over_a_framework_allgather_object():
    group = EPGroup(ListComm(1, ["a", "b", "c"]), use_gpu=False)
    assert (group.rank, group.size, group.device) == (1, 3, None)
    assert group.allgather("x") == ["a", "x", "c"]
    with pytest.raises(GroupMismatchError, match="ranks disagree on shape"):
        group.agree("x", "shape")
    with pytest.raises(TypeError, match="no Split"):
        group.split(0)
    group.close()
    with pytest.raises(ClosedError, match="layer id: the EP group is closed"):  # was gathered after close
        group.agree("x", "layer id")


def test_a_rank_in_another_collective_is_a_mismatch_naming_each_call():
    group = EPGroup(ListComm(1, ["a", "b", "c"]), use_gpu=False)
    group.comm.entered = ["close", None, "layer id"]
    with pytest.raises(GroupMismatchError, match=r"rank\(s\) \[0\] in 'close'; rank\(s\) \[1, 2\] in 'layer id'"):
        group.agree("b", "layer id")


def test_group_rejects_objects_without_allgather():
    with pytest.raises(TypeError, match="allgather"):
        EPGroup(object(), use_gpu=False)


@pytest.mark.mpi
def test_group_four_ranks():
    out = run_ranks(4, "runtime/mpi/group_check.py")
    assert_all_ranks_ok(out, 4, "group")
    assert_all_ranks_ok(out, 4, "group-timeouts")


@pytest.mark.mpi
def test_ranks_leave_an_aligned_barrier_together():
    out = run_ranks(2, "runtime/mpi/aligned_barrier_check.py")
    assert_all_ranks_ok(out, 2, "aligned-barrier")


def test_a_collective_failure_says_each_reason_once():
    """Reasons every rank gave alike are said once; others after the ranks that gave them
    (their own ``rank N:`` prefix not repeated)."""
    same = "hidden (7) must be a multiple of 8"
    assert failure_detail([(0, same), (1, f"rank 1: {same}")], 2) == same
    assert failure_detail([(0, same), (2, same)], 4) == f"ranks [0, 2]: {same}"
    assert failure_detail([(1, "rank 1: bad ids")], 1) == "rank 1: bad ids"
    assert failure_detail([(0, "a"), (1, "b"), (2, "a")], 3) == "ranks [0, 2]: a; rank 1: b"
