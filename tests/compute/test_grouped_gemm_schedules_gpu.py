"""The grouped GEMM's kernel schedules (``ultraep.compute.device.SCHEDULES``) give the same
bits as the plain module's, and so do the per-operation defaults, on problems of several
tiles per block: every block then takes output tiles through the store warps while its MMAs
go on, stages wrap around the ring many times, and (wgrad) tiles with no reduction, stored
without staging, fall between staged ones.
"""

import numpy as np
import pytest

from tests.compute.reference import bf16, nan_bits, offsets_of
from tests.conftest import requires_gpu
from ultraep.compute.checks import check_problem
from ultraep.compute.device import PLAIN_SCHEDULE, SCHEDULES, DeviceGroupedGemm
from ultraep.runtime.dtypes import BFLOAT16

pytestmark = [pytest.mark.gpu, requires_gpu]

OTHERS = [s for s in SCHEDULES if s != PLAIN_SCHEDULE]

# (experts, K, N, rows of each expert): hundreds of tiles (a few per SM), expert ends and
# K, N off every tile and box size, empty experts (all-zero wgrad tiles between others),
# a reduction of 112 k-steps; K and N whole 64-column blocks off the tile sizes (wgrad's
# 3-D maps).
PROBLEMS = [(8, 1032, 1032, [1500, 0, 1333, 2047, 1, 900, 0, 1711]),
            (24, 520, 1032, [0, 300, 0, 257, 129, 0, 640, 0, 77, 0, 512, 0] * 2),
            (4, 7168, 528, [700, 1100, 0, 960]),
            (6, 1088, 960, [900, 0, 1333, 641, 1, 1200])]


def operands(rng, op, k, n, counts, spare_rows=3):
    rows = sum(counts) + spare_rows
    if op == "forward":
        return bf16(rng, (rows, k)), bf16(rng, (len(counts), k, n), 0.05)
    if op == "dgrad":
        return bf16(rng, (rows, n)), bf16(rng, (len(counts), k, n), 0.05)
    return bf16(rng, (rows, k)), bf16(rng, (rows, n))


def up(cp, array: np.ndarray):
    """To the GPU; bf16 travels as its bits (the kernels take either)."""
    return cp.asarray(array.view(np.int16) if array.dtype == BFLOAT16 else array)


def run(cp, device, op, a, b, offsets, out_dtype):
    """``op`` by ``device`` into a NaN-poisoned output; its bits on the host."""
    ga, gb, go = up(cp, a), up(cp, b), cp.asarray(offsets)
    out = up(cp, nan_bits(check_problem(op, ga, gb, go, None).out_shape, out_dtype))
    device.run(check_problem(op, ga, gb, go, out), ga, gb, go, out)
    device.check()
    host = out.get()
    return host.view(np.uint16 if host.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("schedule", OTHERS)
@pytest.mark.parametrize("out_dtype", [BFLOAT16, np.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize("problem", range(len(PROBLEMS)))
def test_same_bits_as_the_default(schedule, out_dtype, op, problem):
    import cupy as cp

    experts, k, n, counts = PROBLEMS[problem]
    rng = np.random.default_rng(300 + problem)
    a, b = operands(rng, op, k, n, counts)
    offsets = offsets_of(counts)
    gpu = cp.cuda.runtime.getDevice()
    expected = run(cp, DeviceGroupedGemm(gpu, PLAIN_SCHEDULE), op, a, b, offsets, out_dtype)
    got = run(cp, DeviceGroupedGemm(gpu, schedule), op, a, b, offsets, out_dtype)
    differ = int((got != expected).sum())
    assert differ == 0, f"schedule {schedule!r}, {op}: {differ} of {got.size} elements differ from {PLAIN_SCHEDULE!r}"
    defaults = run(cp, DeviceGroupedGemm(gpu), op, a, b, offsets, out_dtype)
    assert int((defaults != expected).sum()) == 0, f"the default schedules, {op}: bits differ from {PLAIN_SCHEDULE!r}"
