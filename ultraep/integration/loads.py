"""This rank's expert-load row: counting top-k ids per logical expert, and publishing the
row into every peer's gathered load matrix.

:func:`count_loads` is the NumPy semantics (and the CPU backend);
:class:`DeviceLoadCounter` runs ``raw_kernels/balancer.cu`` on the caller's stream with
buffers allocated once, and must give bitwise the same row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COUNT_THREADS = 256
MAX_COUNT_BLOCKS = 1024
NO_BAD_INDEX = np.iinfo(np.uint64).max
MAX_HISTOGRAM_BYTES = 48 * 1024  # dynamic shared memory without opting in


@dataclass(frozen=True)
class BadIds:
    """Ids outside ``[0, E)``: how many, and the first one (flat index, value)."""

    count: int
    first_index: int
    first_value: int

    def message(self, rank: int, num_experts: int, shape) -> str:
        position = tuple(int(i) for i in np.unravel_index(self.first_index, shape)) if shape else ()
        return (f"rank {rank}: {self.count} top-k id(s) outside [0, {num_experts}); the first is "
                f"{self.first_value} at index {position}")


def count_loads(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, BadIds | None]:
    """``(int32[E] tokens per logical expert, bad ids or None)``; bad ids are not counted."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    good = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[good], minlength=num_experts).astype(np.int32)
    if good.all():
        return counts, None
    first = int(np.argmin(good))
    return counts, BadIds(int((~good).sum()), first, int(flat[first]))


class DeviceLoadCounter:
    """GPU load row: ``count`` into a device ``int32[E]`` and ``publish`` it to every peer."""

    def __init__(self, heap, num_experts: int):
        import cupy

        from ultraep.runtime.kernels import get_function

        self.heap, self.num_experts = heap, int(num_experts)
        if 4 * self.num_experts > MAX_HISTOGRAM_BYTES:
            raise ValueError(f"the GPU load counter keeps one int per expert in shared memory: {num_experts} experts "
                             f"need {4 * self.num_experts} bytes (at most {MAX_HISTOGRAM_BYTES})")
        self.counts = cupy.zeros(self.num_experts, dtype=np.int32)
        self.bad = cupy.zeros(2, dtype=np.uint64)
        self._reset_bad = np.array([0, NO_BAD_INDEX], dtype=np.uint64)
        self.bad.set(self._reset_bad)
        self._kernels = {np.dtype(np.int32): get_function("balancer.cu", "count_expert_loads<int>", group=heap.group),
                         np.dtype(np.int64): get_function("balancer.cu", "count_expert_loads<long long>",
                                                          group=heap.group)}
        self._publish = get_function("balancer.cu", "publish_load_row", group=heap.group)

    def supports(self, dtype) -> bool:
        return np.dtype(dtype) in self._kernels

    def count(self, ids) -> None:
        """``self.counts`` = the load row of ``ids`` (contiguous int32/int64 CuPy array)."""
        n = int(ids.size)
        self.counts.fill(0)
        if n == 0:
            return
        blocks = min(MAX_COUNT_BLOCKS, -(-n // COUNT_THREADS))
        self._kernels[np.dtype(ids.dtype)]((blocks,), (COUNT_THREADS,),
                                           (ids, np.int64(n), np.int32(self.num_experts), self.counts, self.bad),
                                           shared_mem=4 * self.num_experts)

    def read_bad(self, ids) -> BadIds | None:
        """Host read (synchronises) of the bad ids counted since the last read; resets them."""
        count, first = (int(v) for v in self.bad.get())
        if count == 0:
            return None
        self.bad.set(self._reset_bad)
        value = int(ids.reshape(-1)[first]) if ids is not None and first < ids.size else -1
        return BadIds(count, first, value)

    def publish(self, matrix_offset: int) -> None:
        """On every rank, the gathered ``int32[R, E]`` matrix at heap byte offset ``matrix_offset``
        gets this rank's counts in row ``heap.rank``."""
        heap = self.heap
        self._publish((heap.size,), (COUNT_THREADS,),
                      (self.counts, np.int32(self.num_experts), heap.peer_bases, np.uint64(matrix_offset),
                       np.int32(heap.rank)))
