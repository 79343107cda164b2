"""Whole replica slots copied (or zeroed) only where a plan fills them.

A replica slot the plan leaves empty holds nothing anyone reads, so moving its bytes is
pure cost -- at decode-sized batches most slots are empty and such copies were most of
what balancing added to a layer. :class:`FilledSlotCopy` takes fixed (source, destination)
pairs of byte arrays with a leading slot axis and, per call, the plan's entries for those
slots (``phys_to_log`` of this rank's replica slots: ``-1`` empty): on the device one
launch of ``copy_filled_slots`` (``raw_kernels/transfer.cu``) reads them there, so the
host needs neither the plan nor a synchronisation; on the host :func:`copy_filled_slots`
does the same in NumPy (the kernel's reference).
"""

from __future__ import annotations

import numpy as np

from ultraep.runtime.kernels import kernel_constant

KERNEL = "transfer.cu"
SLOT_COPY_FIELDS = kernel_constant(KERNEL, "SLOT_COPY_FIELDS")
SLOT_COPY_THREADS = kernel_constant(KERNEL, "SLOT_COPY_THREADS")
WORDS_PER_THREAD = 8  # 16-byte words each thread moves per slot and pair at the largest pair


def copy_filled_slots(filled, pairs) -> None:
    """For every slot ``s`` with ``filled[s] >= 0`` and every ``(source, destination)`` of
    ``pairs``: ``destination[s] = source[s]`` byte for byte, zeros where ``source`` is None.
    NumPy arrays; the other slots are not touched."""
    for s in np.flatnonzero(np.asarray(filled) >= 0):
        for source, destination in pairs:
            destination[s] = 0 if source is None else source[s]


def _check_pairs(pairs, slots: int) -> None:
    for source, destination in pairs:
        for what, array in (("destination", destination), ("source", source)):
            if array is None:
                continue
            if array.dtype != np.uint8 or array.ndim != 2 or array.shape[0] < slots or array.strides[1] != 1:
                raise ValueError(f"slot copy {what}: expected uint8 [slots >= {slots}, bytes] with contiguous rows, "
                                 f"got {array.dtype} {tuple(array.shape)} strides {array.strides}")
        if source is not None and source.shape[1] != destination.shape[1]:
            raise ValueError(f"slot copy: a source slot has {source.shape[1]} bytes, its destination "
                             f"{destination.shape[1]}")


class FilledSlotCopy:
    """The copies of ``pairs`` (``[(source or None, destination)]``, uint8 ``[slots, bytes]``
    arrays with contiguous rows, kept alive here) for the first ``slots`` slots, run per call
    for the slots a plan fills: :meth:`__call__` takes ``filled`` (int32 ``[slots]``, the
    plan's ``phys_to_log`` entries of those slots) and enqueues the copies on the current
    stream (device) or runs them (host)."""

    def __init__(self, pairs, slots: int, *, device: int | None):
        _check_pairs(pairs, slots)
        self.pairs, self.slots, self.device = list(pairs), int(slots), device
        if device is None or not self.pairs or not self.slots:
            self._rows = None
            return
        import cupy

        from ultraep.runtime.kernels import get_function

        rows = [(0 if src is None else src.data.ptr, 0 if src is None else src.strides[0], dst.data.ptr,
                 dst.strides[0], dst.shape[1]) for src, dst in self.pairs]
        self._rows = cupy.asarray(np.array(rows, dtype=np.int64).reshape(len(rows), SLOT_COPY_FIELDS))
        largest = max(dst.shape[1] for _, dst in self.pairs)
        self._grid = (max(1, -(-largest // (16 * SLOT_COPY_THREADS * WORDS_PER_THREAD))), self.slots, len(rows))
        self._kernel = get_function(KERNEL, "copy_filled_slots")
        self._staged = cupy.empty(self.slots, np.int32)  # a NumPy plan's entries

    def __call__(self, filled) -> None:
        if not self.pairs or not self.slots:
            return
        if self._rows is None:
            copy_filled_slots(np.asarray(filled)[:self.slots], self.pairs)
            return
        if isinstance(filled, np.ndarray):  # not the hot path: device plans keep their entries on the device
            self._staged.set(np.ascontiguousarray(filled[:self.slots], dtype=np.int32))
            filled = self._staged
        elif filled.dtype != np.int32 or filled.size < self.slots or not filled.flags.c_contiguous:
            raise ValueError(f"filled: expected contiguous int32 [{self.slots}], got {filled.dtype} {filled.shape}")
        self._kernel(self._grid, (SLOT_COPY_THREADS,), (filled, self._rows))
