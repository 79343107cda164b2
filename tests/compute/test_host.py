"""The host grouped GEMM (CPU backend and reference) and the input contract both backends share."""

import re

import numpy as np
import pytest

from tests.compute.reference import (assert_within_bound, bf16, exact, nan_bits, offsets_of, random_counts,
                                     random_problem)
from ultraep.compute import grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
from ultraep.compute.checks import offsets_error
from ultraep.compute.host import add_flushing_subnormals
from ultraep.errors import GroupedGemmError
from ultraep.runtime.dtypes import BFLOAT16

OPS = {"forward": grouped_mm, "dgrad": grouped_mm_dgrad, "wgrad": grouped_mm_wgrad}


def out_shape(op, a, b, offsets):
    experts = len(offsets) - 1
    if op == "forward":
        return (a.shape[0], b.shape[2])
    if op == "dgrad":
        return (a.shape[0], b.shape[1])
    return (experts, a.shape[1], b.shape[1])


# K and N: multiples of 8 but of no tile size (16, 32, 128).
SHAPES = [(1, 8, 8, 3), (3, 40, 24, 5), (5, 72, 56, 17), (4, 136, 200, 33), (7, 24, 264, 9)]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("out_dtype", [BFLOAT16, np.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_within_bound_of_fp64(op, out_dtype, seed, shape):
    rng = np.random.default_rng(seed)
    experts, k, n, mean_rows = shape
    a, b, offsets = random_problem(rng, op, experts, k, n, mean_rows, spare_rows=2)
    out = nan_bits(out_shape(op, a, b, offsets), out_dtype)
    result = OPS[op](a, b, offsets, out=out)
    assert result is out
    r, s, terms = exact(op, a, b, offsets)
    y = out if op == "wgrad" else out[:int(offsets[-1])]
    assert_within_bound(y, r, s, terms, out_dtype, device=False, what=f"host {op}")


def test_sums_in_ascending_order_with_one_rounding():
    """The documented order, element by element: FP32 out is the sequential FP32 sum of the
    products (np.add.accumulate adds left to right); BF16 out is that value rounded once."""
    rng = np.random.default_rng(7)
    x, w = bf16(rng, (9, 48)), bf16(rng, (2, 48, 16))
    offsets = np.array([0, 4, 9])
    y32 = grouped_mm(x, w, offsets, out=np.zeros((9, 16), np.float32))
    y16 = grouped_mm(x, w, offsets)
    for e in range(2):
        for row in range(offsets[e], offsets[e + 1]):
            products = x[row].astype(np.float32)[:, None] * w[e].astype(np.float32)
            expected = np.add.accumulate(products, axis=0, dtype=np.float32)[-1]
            assert np.array_equal(y32[row].view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(y16.view(np.uint16), y32.astype(BFLOAT16).view(np.uint16))


@pytest.mark.parametrize("op", list(OPS))
def test_empty_and_one_row_experts_and_rows_past_the_end(op):
    rng = np.random.default_rng(3)
    counts = [0, 1, 0, 130, 1, 0]
    offsets = offsets_of(counts)
    spare = 3
    rows = int(offsets[-1]) + spare
    k, n = 16, 24
    a = bf16(rng, (rows, k if op != "dgrad" else n))
    b = bf16(rng, (len(counts), k, n)) if op != "wgrad" else bf16(rng, (rows, n))
    out = nan_bits(out_shape(op, a, b, offsets), BFLOAT16)
    poison = out.copy()
    OPS[op](a, b, offsets, out=out)
    if op == "wgrad":
        assert not np.isnan(out.astype(np.float32)).any()
        for e, count in enumerate(counts):
            if count == 0:
                assert not out[e].astype(np.float32).any(), f"expert {e} has no rows: dW must be zero"
    else:
        end = int(offsets[-1])
        assert not np.isnan(out[:end].astype(np.float32)).any()
        assert np.array_equal(out[end:].view(np.uint16), poison[end:].view(np.uint16)), "rows past offsets[E] written"


def test_fresh_output_is_zero_past_the_end_and_int32_offsets_and_lists():
    rng = np.random.default_rng(4)
    x, w = bf16(rng, (12, 16)), bf16(rng, (2, 16, 8))
    y = grouped_mm(x, w, np.array([0, 3, 10], np.int32))
    assert y.dtype == BFLOAT16 and y.shape == (12, 8)
    assert not y[10:].astype(np.float32).any()
    assert np.array_equal(grouped_mm(x, w, [0, 3, 10]).view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("added", [0, 2, 5])
def test_wgrad_adds_its_first_experts_into_add_to(added):
    """``add_to[e] += dW_e`` bit for bit (one FP32 add after the sum, as the GPU's memory
    adds) for e < A, the rest in ``out [E - A, K, N]``, as the call without ``add_to``
    computes them; nothing else moves."""
    rng = np.random.default_rng(11)
    x, dy, offsets = random_problem(rng, "wgrad", 5, 24, 40, 9)
    separate = grouped_mm_wgrad(x, dy, offsets, out=nan_bits((5, 24, 40), np.float32))
    before = rng.standard_normal((added, 24, 40)).astype(np.float32)
    add_to = before.copy()
    out = nan_bits((5 - added, 24, 40), np.float32)
    assert grouped_mm_wgrad(x, dy, offsets, out=out, add_to=add_to) is out
    expected = before.copy()
    for e in range(added):
        add_flushing_subnormals(expected[e], separate[e])
    assert np.array_equal(expected.view(np.uint32), add_to.view(np.uint32))
    assert np.array_equal(separate[added:].view(np.uint32), out.view(np.uint32))
    fresh = grouped_mm_wgrad(x, dy, offsets, add_to=before.copy())
    assert fresh.dtype == np.float32 and fresh.shape == (5 - added, 24, 40)


def test_memory_add_flushes_subnormal_inputs_and_results_to_signed_zeros():
    """The reference of the L2's FP32 add: normal sums as NumPy's (nearest even), a subnormal
    addend or total read as zero, a subnormal sum written as a zero of its sign; NaN stays."""
    tiny, sub = np.finfo(np.float32).tiny, np.float32(2.0 ** -140)
    total = np.array([1.0, sub, -sub, 0.0, 1.5 * tiny, -1.5 * tiny, np.nan, 3.0], np.float32)
    addend = np.array([2.0 ** -24, 1.0, 0.0, sub, -tiny, tiny, 1.0, -sub], np.float32)
    add_flushing_subnormals(total, addend)
    expected = np.array([1.0, 1.0, 0.0, 0.0, 0.0, -0.0, np.nan, 3.0], np.float32)  # -0 + 0 = +0
    assert np.array_equal(total.view(np.uint32), expected.view(np.uint32))


def test_no_experts_and_no_rows():
    x = np.zeros((0, 8), BFLOAT16)
    assert grouped_mm(x, np.zeros((2, 8, 16), BFLOAT16), np.zeros(3, np.int64)).shape == (0, 16)
    assert grouped_mm_wgrad(x, np.zeros((0, 16), BFLOAT16), np.zeros(3, np.int64)).shape == (2, 8, 16)
    assert grouped_mm(np.zeros((4, 8), BFLOAT16), np.zeros((0, 8, 16), BFLOAT16),
                      np.zeros(1, np.int64)).shape == (4, 16)


def _bad_calls():
    rng = np.random.default_rng(5)
    x, w, dy = bf16(rng, (10, 16)), bf16(rng, (3, 16, 24)), bf16(rng, (10, 24))
    good = np.array([0, 4, 4, 9])
    y = nan_bits((10, 24), BFLOAT16)
    yield "decreasing offsets", "must not decrease", lambda: grouped_mm(x, w, np.array([0, 5, 4, 9]), out=y), y
    yield "offsets not from 0", "offsets[0] is 2", lambda: grouped_mm(x, w, np.array([2, 4, 4, 9]), out=y), y
    yield "offsets past the rows", "past the 10 rows", lambda: grouped_mm(x, w, np.array([0, 4, 4, 11]), out=y), y
    yield "offsets wrong length", "E + 1 = 4", lambda: grouped_mm(x, w, np.array([0, 4, 9]), out=y), y
    yield "float offsets", "int32 or int64", lambda: grouped_mm(x, w, good.astype(np.float32), out=y), y
    yield "2-D offsets", "1 dimensions", lambda: grouped_mm(x, w, good[None], out=y), y
    yield "float32 x", "x must be bfloat16", lambda: grouped_mm(x.astype(np.float32), w, good, out=y), y
    yield "K mismatch", "needs 16 columns", lambda: grouped_mm(bf16(rng, (10, 8)), w, good, out=y), y
    yield ("dgrad N mismatch", "needs 24 columns",
           lambda: grouped_mm_dgrad(x, w, good, out=nan_bits((10, 16), BFLOAT16)), y)
    yield ("wgrad rows mismatch", "dy has 9",
           lambda: grouped_mm_wgrad(x, dy[:9], good, out=nan_bits((3, 16, 24), BFLOAT16)), y)
    yield "out shape", "shape (10, 24)", lambda: grouped_mm(x, w, good, out=nan_bits((10, 16), BFLOAT16)), y
    yield "out dtype", "bfloat16 or float32", lambda: grouped_mm(x, w, good, out=np.zeros((10, 24), np.float16)), y
    yield "non-contiguous x", "C-contiguous", lambda: grouped_mm(bf16(rng, (10, 32))[:, ::2], w, good, out=y), y
    odd = bf16(rng, (3, 12, 24))
    yield "K not a multiple of 8", "multiples of 8", lambda: grouped_mm(bf16(rng, (10, 12)), odd, good, out=y), y
    yield "read-only out", "read-only", lambda: grouped_mm(x, w, good, out=_read_only(y)), y
    sums = nan_bits((2, 16, 24), np.float32)
    yield ("add_to bf16", "add_to must be float32",
           lambda: grouped_mm_wgrad(x, dy, good, add_to=nan_bits((2, 16, 24), BFLOAT16)), sums)
    yield ("add_to more experts", "A <= 3 experts",
           lambda: grouped_mm_wgrad(x, dy, good, add_to=nan_bits((4, 16, 24), np.float32)), sums)
    yield ("add_to wrong K", "[A, 16, 24]",
           lambda: grouped_mm_wgrad(x, dy, good, add_to=nan_bits((2, 8, 24), np.float32)), sums)
    yield ("add_to with bf16 out", "out must be float32",
           lambda: grouped_mm_wgrad(x, dy, good, out=nan_bits((1, 16, 24), BFLOAT16), add_to=sums), sums)
    yield ("out beside add_to of the wrong length", "shape (1, 16, 24)",
           lambda: grouped_mm_wgrad(x, dy, good, out=nan_bits((3, 16, 24), np.float32), add_to=sums), sums)
    shared = nan_bits((3, 16, 24), np.float32)
    yield ("add_to inside out", "add_to shares memory with out",
           lambda: grouped_mm_wgrad(x, dy, good, out=shared[1:2], add_to=shared[:2]), shared)
    yield ("read-only add_to", "read-only",
           lambda: grouped_mm_wgrad(x, dy, good, add_to=_read_only(sums)), sums)
    yield "not a tensor", "not a tensor", lambda: grouped_mm("x", w, good), y


def _read_only(array):
    view = array.view()
    view.flags.writeable = False
    return view


@pytest.mark.parametrize("case", list(_bad_calls()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_anything_is_written(case):
    _, words, call, out = case
    before = out.copy()
    with pytest.raises(GroupedGemmError, match=re.escape(words)):
        call()
    assert np.array_equal(out.view(np.uint16), before.view(np.uint16)), "a refused call wrote into out"


def test_offsets_are_judged_in_the_kernels_scan_order():
    """First bad entry wins, and at one index a decrease is named before an overrun, as in
    raw_kernels/grouped_gemm_common.cuh's report_offsets."""
    assert "offsets[2] = 3" in offsets_error(np.array([0, 5, 3, 100]), 10)
    assert "offsets[1] = 100 is past" in offsets_error(np.array([0, 100, 3]), 10)
    assert "offsets[2] = 3 is below" in offsets_error(np.array([0, 12, 3]), 20)
    assert offsets_error(np.array([0, 0, 10]), 10) is None


def test_torch_cpu_tensors_match_numpy_bits():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    counts = random_counts(rng, 4, 9)
    offsets = offsets_of(counts)
    x, w = bf16(rng, (int(offsets[-1]), 32)), bf16(rng, (4, 32, 16))
    expected = grouped_mm(x, w, offsets)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    tw = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    out = torch.zeros((x.shape[0], 16), dtype=torch.bfloat16)
    assert grouped_mm(tx, tw, torch.from_numpy(offsets), out=out) is out
    assert np.array_equal(out.view(torch.int16).numpy(), expected.view(np.int16))
