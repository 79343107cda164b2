"""The grouped GEMM's TMA tensor maps as ``ultraep.compute.device`` shapes them, checked on the
host against the kernel's constants (the driver's encoder is replaced by a recorder)."""

import ctypes
import math
from collections import OrderedDict

import numpy as np
import pytest

from ultraep.compute.checks import KERNELS, Problem
from ultraep.compute.device import DeviceGroupedGemm
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


def recording_tensor_maps():
    """A _TensorMaps whose driver encoder records its calls and writes the pointer into the map."""
    from ultraep.compute.device import _TensorMaps

    maps = object.__new__(_TensorMaps)  # no driver: the encoder below stands in
    maps.size = kernel_constant(KERNELS, "GH_TENSOR_MAP_BYTES")
    maps.dtype = np.dtype((np.void, maps.size))
    maps.cache = OrderedDict()
    encoded = []

    def encode(out, dtype, rank, pointer, dims, strides, box, element_strides, *modes):
        encoded.append((pointer, tuple(dims), tuple(box)))
        np.frombuffer((ctypes.c_uint8 * maps.size).from_address(out), dtype=np.uint8)[:8] = np.frombuffer(
            np.uint64(pointer).tobytes(), dtype=np.uint8)
        return 0

    maps.encode = encode
    return maps, encoded


def test_a_map_asked_for_again_is_the_cached_one_and_the_oldest_goes_first():
    """The same pointer, dims and box: no second encode and the same bytes; any argument
    that differs encodes afresh; past MAP_CACHE_ENTRIES the least recently used is dropped."""
    from ultraep.compute.device import MAP_CACHE_ENTRIES

    maps, encoded = recording_tensor_maps()
    first = maps.tiled(1 << 20, (BOX, 500), (BOX, 128))
    assert maps.tiled(1 << 20, (BOX, 500), (BOX, 128)).tobytes() == first.tobytes()
    assert len(encoded) == 1
    maps.tiled(1 << 20, (BOX, 501), (BOX, 128))
    maps.tiled(1 << 20, (BOX, 500), (BOX, 64))
    maps.tiled(2 << 20, (BOX, 500), (BOX, 128))
    maps.tiled(1 << 20, (BOX, 500, 2), (BOX, 128, 1), strides=(4096, 1 << 16))
    assert len(encoded) == 5
    for i in range(MAP_CACHE_ENTRIES):  # the first map stays in use; the others age out
        maps.tiled(1 << 20, (BOX, 500), (BOX, 128))
        maps.tiled((3 << 20) + 4096 * i, (BOX, 500), (BOX, 128))
    assert len(maps.cache) == MAP_CACHE_ENTRIES and len(encoded) == 5 + MAP_CACHE_ENTRIES
    assert int(np.frombuffer(maps.tiled(1 << 20, (BOX, 500), (BOX, 128)).tobytes()[:8], np.uint64)[0]) == 1 << 20
    assert len(encoded) == 5 + MAP_CACHE_ENTRIES
    maps.tiled(2 << 20, (BOX, 500), (BOX, 128))  # aged out: encoded again
    assert len(encoded) == 6 + MAP_CACHE_ENTRIES
