"""EP group: rank, size, local rank, sub-groups, agreement checks."""

import pytest

from tests.conftest import assert_all_ranks_ok, run_ranks
from ultraep.runtime.group import EPGroup, GroupMismatchError


class ListComm:
    """A framework's own group: allgather of Python objects plus rank/size attributes."""

    def __init__(self, rank, peers):
        self.rank, self.size, self.peers = rank, len(peers), peers

    def allgather(self, obj):
        return [obj if r == self.rank else peer for r, peer in enumerate(self.peers)]


def test_group_over_a_framework_allgather_object():
    group = EPGroup(ListComm(1, ["a", "b", "c"]), use_gpu=False)
    assert (group.rank, group.size, group.device) == (1, 3, None)
    assert group.allgather("x") == ["a", "x", "c"]
    with pytest.raises(GroupMismatchError, match="ranks disagree on shape"):
        group.agree("x", "shape")
    with pytest.raises(TypeError, match="no Split"):
        group.split(0)


def test_group_rejects_objects_without_allgather():
    with pytest.raises(TypeError, match="allgather"):
        EPGroup(object(), use_gpu=False)


@pytest.mark.mpi
def test_group_four_ranks():
    out = run_ranks(4, "runtime/mpi/group_check.py")
    assert_all_ranks_ok(out, 4, "group")
    assert_all_ranks_ok(out, 4, "group-timeouts")
