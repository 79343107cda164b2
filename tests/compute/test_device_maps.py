"""The grouped GEMM's TMA tensor maps as ``ultraep.compute.device`` shapes them (and the fused
kernels' weight maps, ``ultraep.integration.fused_device``), checked on the host against the
kernel's constants (the driver's encoder is replaced by a recorder)."""

import math

import numpy as np
import pytest

from ultraep.compute.checks import KERNELS, Problem
from ultraep.compute.device import DeviceGroupedGemm, weight_blocks
from ultraep.errors import GroupedGemmError
from ultraep.integration.fused_device import weight_maps
from ultraep.runtime.kernels import kernel_constant

BOX = kernel_constant(KERNELS, "GH_BOX")
BF16_BYTES = 2


class RecordedMaps:
    """Stands in for the driver's encoder: a map is what it was asked for."""

    def tiled(self, pointer, dims, box, strides=None):
        return tuple(dims), tuple(box), None if strides is None else tuple(strides)


class DeviceArray:
    """What the map encoding reads of a CuPy array."""

    def __init__(self, size: int):
        self.size = size
        self.data = type("Pointer", (), {"ptr": 1 << 20})


def wgrad_maps(k: int, n: int, rows: int = 500, experts: int = 4):
    gemm = object.__new__(DeviceGroupedGemm)  # no CUDA: only what _operand_maps reads
    gemm._maps, gemm._placeholder = RecordedMaps(), DeviceArray(16)
    problem = Problem("wgrad", experts, rows, k, n, (experts, k, n), np.dtype(np.float32))
    return gemm._operand_maps(problem, DeviceArray(rows * k), DeviceArray(rows * n))


@pytest.mark.parametrize("k,n", [(320, 576), (7168, 4096), (BOX, BOX)])
def test_wgrad_with_whole_column_blocks_copies_a_k_step_of_each_operand_as_one_box(k, n):
    """x as (64, rows, K / 64) and dy as (64, rows, N / 64), 64-column blocks 128 bytes apart;
    one box is the tile's A (B) for one k-step, so the two fill the stage the kernel expects."""
    (a_dims, a_box, a_strides), (b_dims, b_box, b_strides) = wgrad_maps(k, n)
    assert a_dims == (BOX, 500, k // BOX) and a_strides == (BF16_BYTES * k, BF16_BYTES * BOX)
    assert b_dims == (BOX, 500, n // BOX) and b_strides == (BF16_BYTES * n, BF16_BYTES * BOX)
    assert a_box[:2] == b_box[:2] == (BOX, kernel_constant(KERNELS, "GH_BK"))
    assert BF16_BYTES * math.prod(a_box) == kernel_constant(KERNELS, "GH_A_BYTES")
    assert BF16_BYTES * math.prod(b_box) == kernel_constant(KERNELS, "GH_B_BYTES")


@pytest.mark.parametrize("k,n", [(328, 576), (320, 584), (40, 24)])
def test_wgrad_with_a_partial_column_block_keeps_a_box_per_64_columns(k, n):
    """A 3-D box over a partial last block would read past the array's end: 2-D row-major maps."""
    (a_dims, a_box, a_strides), (b_dims, b_box, b_strides) = wgrad_maps(k, n)
    assert (a_dims, b_dims) == ((k, 500), (n, 500))
    assert a_box == b_box == (BOX, kernel_constant(KERNELS, "GH_BK"))
    assert a_strides is b_strides is None


def forward_maps(k: int, n: int, rows: int = 500, experts: int = 4):
    gemm = object.__new__(DeviceGroupedGemm)
    gemm._maps, gemm._placeholder = RecordedMaps(), DeviceArray(16)
    problem = Problem("forward", experts, rows, k, n, (rows, n), np.dtype(np.float32))
    return gemm._operand_maps(problem, DeviceArray(rows * k), DeviceArray(experts * k * n))


@pytest.mark.parametrize("k,n", [(328, 576), (7168, 4096), (40, BOX)])
def test_forward_with_whole_column_blocks_copies_a_k_step_of_w_as_one_box(k, n):
    """w [E, K, N] as (64, K, N / 64, 1, E), 64-column blocks 128 bytes apart: one box is the
    tile's B for one k-step (K need not be whole blocks: the reduction's tail reads zeros)."""
    (a_dims, a_box, a_strides), (b_dims, b_box, b_strides) = forward_maps(k, n)
    a_box_wanted = (kernel_constant(KERNELS, "GH_BK"), kernel_constant(KERNELS, "GH_BM"))
    assert (a_dims, a_box, a_strides) == ((k, 500), a_box_wanted, None)
    assert b_dims == (BOX, k, n // BOX, 1, 4)
    assert b_strides == (BF16_BYTES * n, BF16_BYTES * BOX, BF16_BYTES * n, BF16_BYTES * n * k)
    assert b_box == (BOX, kernel_constant(KERNELS, "GH_BK"), kernel_constant(KERNELS, "GH_BN") // BOX, 1, 1)
    assert BF16_BYTES * math.prod(b_box) == kernel_constant(KERNELS, "GH_B_BYTES")


@pytest.mark.parametrize("k,n", [(328, 584), (64, 24)])
def test_forward_with_a_partial_column_block_keeps_a_box_per_64_columns(k, n):
    (_, _, _), (b_dims, b_box, b_strides) = forward_maps(k, n)
    assert (b_dims, b_box, b_strides) == ((n, k, 4), (BOX, kernel_constant(KERNELS, "GH_BK"), 1), None)


def test_weight_halves_are_the_gate_and_up_columns_of_the_boxes_they_replace():
    """Halves 2 (the fused up-projection, w_up [E, H, 2F]): box j = (half, block) in that
    order; element (c, r, b, h, e) of the map is w[e, r, h * F + 64 b + c]."""
    hidden, ffn, experts = 96, 192, 3
    dims, box, strides = weight_blocks(hidden, 2 * ffn, experts, halves=2)
    assert dims == (BOX, hidden, ffn // BOX, 2, experts)
    assert box == (BOX, kernel_constant(KERNELS, "GH_BK"), 2, 2, 1)
    assert BF16_BYTES * math.prod(box) == kernel_constant(KERNELS, "GH_B_BYTES")
    w = np.arange(experts * hidden * 2 * ffn).reshape(experts, hidden, 2 * ffn)
    c, r, b, h, e = 5, 7, 2, 1, 2
    flat = (c * BF16_BYTES + r * strides[0] + b * strides[1] + h * strides[2] + e * strides[3]) // BF16_BYTES
    assert w.ravel()[flat] == w[e, r, h * ffn + BOX * b + c]


def test_a_weight_of_partial_blocks_has_no_blocks_map():
    with pytest.raises(GroupedGemmError, match="whole 64-column blocks"):
        weight_blocks(64, 2 * 200, 2, halves=2)


@pytest.mark.parametrize("hidden,ffn,up_blocks,down_blocks", [
    (256, 128, True, True), (512, 72, False, True), (328, 192, True, False), (272, 200, False, False)])
def test_fused_weights_take_the_blocks_maps_where_their_output_columns_are_whole_blocks(hidden, ffn, up_blocks,
                                                                                       down_blocks):
    """The up tiles' columns are F (gate and up halves), the down tiles' H: fused_moe.cu makes
    the same choice (ffn % GH_BOX, hidden % GH_BOX)."""
    up, down = weight_maps(hidden, ffn, 3, BOX)
    assert up == (weight_blocks(hidden, 2 * ffn, 3, halves=2) if up_blocks else
                  ((2 * ffn, hidden, 3), (BOX, BOX, 1), None))
    assert down == (weight_blocks(ffn, hidden, 3) if down_blocks else ((hidden, ffn, 3), (BOX, BOX, 1), None))
