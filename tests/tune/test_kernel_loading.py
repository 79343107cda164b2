"""Kernel loading with a group stays collective when one rank loaded kernels alone before.

``tune validate --emulate-ep`` with a fresh cache: rank 0 measures the machine profile
alone (loading ``heap.cu`` and ``timing.cu`` without a group), the others read it from
the cache; then every rank opens a heap, whose ``get_function(..., group=)`` passed a
barrier only on the ranks that had not loaded ``heap.cu`` yet. Rank 0 went on to the
heap's next collective and its peers' barrier received its message (MPI_ERR_TRUNCATE on
the H200). Here each rank's process is simulated in turn (its own module caches) and the
collectives each posts are recorded: they must be the same on every rank."""

import pytest

from ultraep.runtime import kernels


class FakeModule:
    def get_function(self, name):
        return ("kernel", name)


class RecordingGroup:
    """A rank of a one-host group that records the collectives it posts."""

    def __init__(self, rank):
        self.rank = self.local_rank = rank
        self.posted = []

    def barrier(self, timeout_s=None, *, what="barrier"):
        self.posted.append("barrier")


@pytest.fixture
def fresh_process(monkeypatch):
    """Starts a new simulated process: empty module caches, compiling counted."""
    compiled = []

    def start():
        monkeypatch.setattr(kernels, "_modules", {})
        monkeypatch.setattr(kernels, "_functions", {})
        compiled.clear()
    monkeypatch.setattr(kernels, "_compile",
                        lambda filename, defines=(): compiled.append(filename + kernels._define_text(defines))
                        or FakeModule())
    start.compiled = compiled
    return start


def _rank_program(rank, fresh_process, *, measures_profile):
    fresh_process()
    if measures_profile:  # the machine profile's probes, on this rank alone
        kernels.get_function("heap.cu", "copy_bytes")
        kernels.get_function("heap.cu", "symmetric_barrier")
        kernels.get_function("timing.cu", "hold_stream")
    group = RecordingGroup(rank)
    kernels.get_function("heap.cu", "symmetric_barrier", group=group)  # open_heap
    kernels.get_function("heap.cu", "copy_bytes", group=group)          # a second kernel of the module
    kernels.get_function("transfer.cu", "weight_sync", group=group)     # the engine
    kernels.get_function("heap.cu", "symmetric_barrier", group=group)  # cached for this group: no collective
    group.posted.append("allgather")  # the set-up's next collective
    return group.posted, list(fresh_process.compiled)


def test_every_rank_posts_the_same_collectives_after_a_profile_measured_on_rank_0_alone(fresh_process):
    posted = {rank: _rank_program(rank, fresh_process, measures_profile=rank == 0) for rank in range(4)}
    assert all(p == posted[0][0] for p, _ in posted.values()), posted
    assert posted[0][0] == ["barrier", "barrier", "allgather"]  # one per module, on the group's first load
    assert posted[0][1] == ["heap.cu", "timing.cu", "transfer.cu"]  # rank 0 compiled heap.cu once, alone
    assert posted[1][1] == ["heap.cu", "transfer.cu"]


def test_a_new_group_loads_through_its_own_barrier(fresh_process):
    fresh_process()
    first, second = RecordingGroup(0), RecordingGroup(0)
    kernels.get_function("heap.cu", "copy_bytes", group=first)
    kernels.get_function("heap.cu", "copy_bytes", group=second)
    kernels.get_function("heap.cu", "copy_bytes", group=second)
    assert first.posted == ["barrier"] and second.posted == ["barrier"]
    assert fresh_process.compiled == ["heap.cu"]


def test_each_set_of_defines_is_a_module_of_its_own_loaded_collectively_once(fresh_process):
    fresh_process()
    group = RecordingGroup(1)
    small = (("FM_SEND_TOKENS", 8), ("FM_REDUCE_TOKENS", 32))
    kernels.get_function("fused_moe.cu", "fused_plan", group=group)
    kernels.get_function("fused_moe.cu", "fused_plan", group=group, defines=small)
    kernels.get_function("fused_moe.cu", "fused_down_combine", group=group, defines=small)
    kernels.get_function("fused_moe.cu", "fused_plan", group=group, defines=[("FM_SEND_TOKENS", 8),
                                                                              ("FM_REDUCE_TOKENS", 32)])
    assert group.posted == ["barrier", "barrier"]  # one per variant, on the group's first load of it
    assert fresh_process.compiled == ["fused_moe.cu", "fused_moe.cu -DFM_SEND_TOKENS=8 -DFM_REDUCE_TOKENS=32"]
    with pytest.raises(ValueError, match="not a macro name"):
        kernels.get_function("fused_moe.cu", "fused_plan", defines=(("-O0 x", 1),))
