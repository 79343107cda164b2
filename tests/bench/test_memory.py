"""SweepMemory: a row whose scaled estimate exceeds the free memory is skipped on every rank."""

from ultraep.bench.memory import GIB, SweepMemory, skip_row
from ultraep.bench.report import RowStream


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
    """A SweepMemory reading ``free_bytes`` in turn (GiB)."""
    memory = SweepMemory(group)
    readings = iter(free_bytes)
    memory._free_bytes = lambda: next(readings) * GIB
    return memory


def test_a_row_takes_its_peak_reading():
    memory = sweep(TwoRanks(), [80, 40, 55, 50])  # before; two parts of the row, the second smaller; its end
    assert memory.fits(8192) is None  # nothing to scale from
    memory.begin(8192)
    memory.sample()
    memory.sample()
    assert memory.end() == 40 * GIB
    assert memory.last == (8192, 40 * GIB)


def test_a_row_scaled_past_the_free_memory_is_skipped():
    memory = sweep(TwoRanks(), [80, 50, 79, 62])
    memory.begin(8192)
    memory.end()
    assert memory.fits(16384) is None  # 60 GiB against 95 % of 79: fits
    reason = memory.fits(16384)  # 60 GiB against 95 % of 62
    assert reason is not None and "needs about 60.0 GiB" in reason and "62.0 GiB free" in reason and "2.00" in reason


def test_a_smaller_row_is_estimated_at_the_last_rows_use_not_below():
    memory = sweep(TwoRanks(), [80, 20, 20])
    memory.begin(8192)
    memory.end()  # 60 GiB
    assert "needs about 60.0 GiB" in memory.fits(1024)  # weights do not shrink with the tokens


def test_another_ranks_refusal_skips_the_row_here():
    memory = sweep(TwoRanks(other="skipped: elsewhere"), [80, 79, 79])
    memory.begin(1)
    memory.end()
    assert memory.fits(1) == "skipped: elsewhere"


def test_a_reading_that_shows_nothing_taken_leaves_no_estimate():
    memory = sweep(TwoRanks(), [50, 60])  # memory freed by something else during the row
    memory.begin(1)
    assert memory.end() is None and memory.last is None
    assert memory.fits(10**9) is None


def test_inactive_without_a_gpu():
    group = TwoRanks()
    group.has_gpu = False
    memory = SweepMemory(group)
    memory.begin(1)
    memory.sample()
    assert memory.end() is None and memory.fits(10**9) is None and group.barriers == []


def test_a_skipped_row_is_said_in_the_table_the_progress_and_the_json(capsys):
    lines, skipped = [], []
    table = RowStream(["tokens", "ms"], "title")
    table.add({"tokens": 4096, "ms": 1.5})
    skip_row({"tokens": 8192, "hidden": 4096}, "skipped: needs about 9 GiB", lines.append, table, skipped)
    table.close()
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "tokens 8192, hidden 4096: skipped: needs about 9 GiB"  # in the row's place, before the rule
    assert lines == ["tokens 8192, hidden 4096: skipped: needs about 9 GiB"]
    assert skipped == [{"tokens": 8192, "hidden": 4096, "reason": "skipped: needs about 9 GiB"}]
