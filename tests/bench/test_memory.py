"""SweepMemory: a row whose scaled estimate exceeds the free memory is skipped on every rank."""

from ultraep.bench.memory import GIB, SweepMemory


class TwoRanks:
    """One rank's view of a two-rank group; ``other`` is what the other rank contributes."""

    has_gpu = True

    def __init__(self, other=None):
        self.other, self.barriers = other, []

    def barrier(self, what):
        self.barriers.append(what)

    def allgather(self, obj, what):
        return [obj, self.other]


def sweep(group, free_bytes):
    memory = SweepMemory(group)
    readings = iter(free_bytes)
    memory._free_bytes = lambda: next(readings)
    return memory


def test_first_row_runs_and_its_use_is_measured():
    memory = sweep(TwoRanks(), [80 * GIB, 50 * GIB])
    assert memory.fits(8192) is None  # nothing to scale from
    memory.begin(8192)
    assert memory.end() == 30 * GIB
    assert memory.last == (8192, 30 * GIB)


def test_a_row_scaled_past_the_free_memory_is_skipped():
    memory = sweep(TwoRanks(), [80 * GIB, 50 * GIB, 79 * GIB])
    memory.begin(8192)
    memory.end()
    reason = memory.fits(16384)  # 60 GiB against 79 free: fits
    assert reason is None
    memory._free_bytes = lambda: 60 * GIB
    reason = memory.fits(16384)
    assert reason is not None and "60.0 GiB" in reason and "2.00" in reason


def test_another_ranks_refusal_skips_the_row_here():
    memory = sweep(TwoRanks(other="skipped: elsewhere"), [80 * GIB, 79 * GIB, 79 * GIB])
    memory.begin(1)
    memory.end()
    assert memory.fits(1) == "skipped: elsewhere"


def test_inactive_without_a_gpu():
    group = TwoRanks()
    group.has_gpu = False
    memory = SweepMemory(group)
    memory.begin(1)
    assert memory.end() is None and memory.fits(10**9) is None and group.barriers == []
