"""FilledSlotCopy: only the slots a plan fills are copied or zeroed -- the NumPy reference
on its own, and the ``copy_filled_slots`` kernel against it byte for byte on poisoned
destinations (16-byte aligned pairs, a pair with a byte tail, a misaligned source, a
zeroing pair; empty, partly and fully filled plans)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.transfer.slot_copy import FilledSlotCopy, copy_filled_slots

POISON = 0xA5
SLOTS = 3


def arrays(rng, xp=np):
    """Pairs over strided views: each source and destination slot is a row of a wider buffer."""
    def buffer(slots, nbytes, pad, offset=0):
        whole = rng.integers(0, 256, size=(slots, nbytes + pad + offset), dtype=np.uint8)
        return xp.asarray(whole)[:, offset:offset + nbytes]

    pairs = [(buffer(SLOTS, 4096, 256), buffer(SLOTS + 1, 4096, 512)),  # aligned, 16-byte words
             (buffer(SLOTS, 1000 + 3, 13), buffer(SLOTS, 1003, 0)),      # a byte tail
             (buffer(SLOTS, 2048, 64, offset=4), buffer(SLOTS, 2048, 0)),  # a misaligned source
             (None, buffer(SLOTS, 777, 5))]                               # zeroed
    return pairs


@pytest.mark.parametrize("filled", [[-1, -1, -1], [5, -1, 2], [0, 1, 2]])
def test_reference_touches_only_filled_slots(filled):
    pairs = arrays(np.random.default_rng(1))
    before = [dst.copy() for _, dst in pairs]
    FilledSlotCopy(pairs, SLOTS, device=None)(np.array(filled + [7], np.int32))  # entries past the slots: ignored
    for (src, dst), old in zip(pairs, before):
        for s in range(dst.shape[0]):
            want = old[s] if s >= SLOTS or filled[s] < 0 else (0 if src is None else src[s])
            assert np.array_equal(dst[s], np.broadcast_to(want, dst[s].shape)), f"slot {s}"


def test_pairs_are_checked():
    ok = np.zeros((SLOTS, 16), np.uint8)
    with pytest.raises(ValueError, match="uint8"):
        FilledSlotCopy([(ok, np.zeros((SLOTS, 4), np.int32))], SLOTS, device=None)
    with pytest.raises(ValueError, match="slots >= 3"):
        FilledSlotCopy([(ok, np.zeros((2, 16), np.uint8))], SLOTS, device=None)
    with pytest.raises(ValueError, match="bytes, its destination"):
        FilledSlotCopy([(ok, np.zeros((SLOTS, 8), np.uint8))], SLOTS, device=None)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("filled", [[-1, -1, -1], [5, -1, 2], [0, 1, 2]])
@pytest.mark.parametrize("plan_on", ["device", "host"])
def test_kernel_is_the_reference_byte_for_byte(filled, plan_on):
    import cupy

    rng = np.random.default_rng(7)
    pairs = arrays(rng, cupy)
    for _, dst in pairs:
        dst[...] = POISON
    want = [(None if src is None else cupy.asnumpy(src), cupy.asnumpy(dst)) for src, dst in pairs]
    entries = np.array(filled, np.int32)
    copy_filled_slots(entries, want)
    FilledSlotCopy(pairs, SLOTS, device=cupy.cuda.Device().id)(cupy.asarray(entries) if plan_on == "device"
                                                                  else entries)
    cupy.cuda.Device().synchronize()
    for (_, got), (_, expected) in zip(pairs, want):
        assert np.array_equal(cupy.asnumpy(got), expected)
