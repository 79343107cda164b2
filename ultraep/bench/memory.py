"""GPU memory of a benchmark's size sweep: a row that would not fit is skipped with the
reason, on every rank, before it allocates -- not an out-of-memory error on some ranks
halfway through a collective, which leaves the others waiting out their timeouts.

The estimate is the device-wide memory the last row that ran took (free memory before it
against the least free memory read while it ran, every rank of the device at the same
barrier each time: ranks of an emulated EP group share one GPU), scaled up by the size ratio
and never down. A row's memory is a fixed part (weights) plus parts that grow with its size,
so the estimate is at least what a larger row takes (up to fragmentation: the margin) and,
for a smaller one, the last row's own use: a row it skips may have fitted; one it runs fits.
The first row runs: there is nothing to scale from.
"""

from __future__ import annotations

GIB = 1 << 30
MARGIN = 0.95  # of the free memory a row may be estimated to take: the pool's blocks fragment


class SweepMemory:
    """Collective, on every rank of the group: ``fits(size)`` before a row (None, or why it is
    skipped -- the same everywhere), ``begin(size)`` as it starts, ``sample()`` wherever its
    buffers peak (before a part of it closes), ``end()`` at its end. Inactive (every row
    fits) where the group has no GPU."""

    def __init__(self, group):
        self.group = group
        self.enabled = group.has_gpu
        self._size = None  # the row running, from begin()
        self._free_before = self._least_free = 0
        self.last: tuple[float, int] | None = None  # (size, device bytes) of the last row measured

    @staticmethod
    def _free_bytes() -> int:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])

    def fits(self, size: float) -> str | None:
        if not self.enabled or self.last is None:
            return None
        self.group.barrier(what="sweep memory: the last row's buffers freed on every rank")
        measured_size, used = self.last
        ratio = max(size / measured_size, 1.0)
        need, free = used * ratio, self._free_bytes()
        mine = None
        if need > MARGIN * free:
            mine = (f"skipped: needs about {need / GIB:.1f} GiB of GPU memory on the ranks' device (the last row's "
                    f"{used / GIB:.1f} GiB times {ratio:.2f}, the ratio of the sizes), {free / GIB:.1f} GiB free")
        reasons = [reason for reason in self.group.allgather(mine, what="sweep memory: does the row fit") if reason]
        return reasons[0] if reasons else None

    def begin(self, size: float) -> None:
        if self.enabled:
            self._size = size
            self.group.barrier(what="sweep memory: every rank before the row")
            self._free_before = self._least_free = self._free_bytes()
            self.group.barrier(what="sweep memory: every rank has read the free memory")  # before any allocates

    def sample(self) -> None:
        """A reading while the row's buffers are all allocated on every rank."""
        if self.enabled and self._size is not None:
            self.group.barrier(what="sweep memory: every rank holds the row's buffers")
            self._least_free = min(self._least_free, self._free_bytes())

    def end(self) -> int | None:
        """The device bytes the row took at its peak reading; None where no reading showed
        memory taken (then the next row has no estimate and runs)."""
        if not self.enabled or self._size is None:
            return None
        self.sample()
        used = self._free_before - self._least_free
        self.last = (self._size, used) if used > 0 else None
        self._size = None
        return used if used > 0 else None


def skip_row(row: dict, reason: str, progress, table, skipped: list) -> None:
    """A row not measured (``row``: its size, e.g. tokens and hidden): said on the progress
    line, in the table in the row's place, and kept for the JSON's ``skipped``."""
    label = ", ".join(f"{key} {value}" for key, value in row.items())
    progress(f"{label}: {reason}")
    table.note(f"{label}: {reason}")
    skipped.append({**row, "reason": reason})
