"""GPU memory of a benchmark's size sweep: a row that would not fit is skipped with the
reason, on every rank, before it allocates -- not an out-of-memory error on some ranks
halfway through a collective, which leaves the others waiting out their timeouts.

The estimate is the device-wide memory the last row that ran took (free memory before it
against free memory at its end, with every rank of the device at the same point: ranks of an
emulated EP group share one GPU), scaled by the size ratio. A row's memory is a fixed part
(weights) plus parts that grow with its size, so the linear scaling overestimates, never
underestimates: a row it skips may have fitted, a row it runs does fit up to fragmentation
(the margin). The first row runs: there is nothing to scale from.
"""

from __future__ import annotations

GIB = 1 << 30
MARGIN = 0.95  # of the free memory a row may be estimated to take: the pool's blocks fragment


class SweepMemory:
    """``fits(size)`` before a row (collective: None, or why the row is skipped -- the same on
    every rank), ``begin(size)`` as it starts, ``end()`` once its buffers all exist (collective).
    Inactive (every row fits) where the group has no GPU."""

    def __init__(self, group, *, enabled: bool = True):
        self.group = group
        self.enabled = enabled and group.has_gpu
        self._size = None  # the row running, from begin()
        self._free_before = 0
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
        need, free = used * size / measured_size, self._free_bytes()
        mine = None
        if need > MARGIN * free:
            mine = (f"skipped: needs about {need / GIB:.1f} GiB of GPU memory on the ranks' device (the last row's "
                    f"{used / GIB:.1f} GiB times {size / measured_size:.2f}, the ratio of the sizes), "
                    f"{free / GIB:.1f} GiB free")
        reasons = [reason for reason in self.group.allgather(mine, what="sweep memory: does the row fit") if reason]
        return reasons[0] if reasons else None

    def begin(self, size: float) -> None:
        if self.enabled:
            self._size = size
            self.group.barrier(what="sweep memory: every rank before the row")
            self._free_before = self._free_bytes()

    def end(self) -> int | None:
        """The device bytes the row took, once every rank of the device holds its buffers."""
        if not self.enabled or self._size is None:
            return None
        self.group.barrier(what="sweep memory: every rank at the row's end")
        used = max(self._free_before - self._free_bytes(), 1)
        self.last, self._size = (self._size, used), None
        return used
