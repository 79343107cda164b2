"""The grouped GEMM kernels on the GPU (raw_kernels/grouped_gemm.cu).

Device against FP64: within the derived tensor-core bound of tests/compute/reference.py,
not bitwise against the host (the tensor cores add inside an MMA step in their own order;
the host sums strictly left to right). Everything else here is bitwise: BF16 output is
the FP32 output rounded once, ten runs give the same bits, a row's forward output and
input gradient do not depend on its neighbours or on where its expert starts (the
master/replica property), a wgrad does not depend on where its expert's rows start, and
its two ways of copying the operands (3-D maps where K and N are whole 64-column blocks,
2-D ones otherwise) give the same bits.

Every test runs on each kernel schedule (``ultraep.compute.device.SCHEDULES``: ``-k ring``
runs only that one); test_grouped_gemm_schedules_gpu.py compares their bits directly.
"""

import re

import numpy as np
import pytest

from tests.compute.reference import (assert_within_bound, bf16, exact, nan_bits, offsets_of, random_problem)
from tests.conftest import requires_gpu
from ultraep.compute import check_errors, grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
from ultraep.compute import grouped_gemm as api
from ultraep.compute.device import SCHEDULES, DeviceGroupedGemm
from ultraep.compute.host import add_flushing_subnormals
from ultraep.errors import GroupedGemmError
from ultraep.runtime.dtypes import BFLOAT16

pytestmark = [pytest.mark.gpu, requires_gpu]

OPS = {"forward": grouped_mm, "dgrad": grouped_mm_dgrad, "wgrad": grouped_mm_wgrad}


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture(autouse=True, params=list(SCHEDULES))
def schedule(request, monkeypatch, cp):
    """The API's device implementation, on every GPU, is this schedule's for the test."""
    devices = {gpu: DeviceGroupedGemm(gpu, request.param) for gpu in range(cp.cuda.runtime.getDeviceCount())}
    monkeypatch.setattr(api, "_devices", devices)
    return request.param


def up(cp, array: np.ndarray):
    """To the GPU; bf16 travels as its bits (the kernels take either)."""
    return cp.asarray(array.view(np.int16) if array.dtype == BFLOAT16 else array)


def down(array) -> np.ndarray:
    host = array.get()
    return host.view(BFLOAT16) if host.dtype == np.int16 else host


def bits(array) -> np.ndarray:
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    return host.view(np.uint16 if host.dtype.itemsize == 2 else np.uint32)


def out_shape(op, a, b, offsets):
    if op == "forward":
        return (a.shape[0], b.shape[2])
    if op == "dgrad":
        return (a.shape[0], b.shape[1])
    return (len(offsets) - 1, a.shape[1], b.shape[1])


def run(cp, op, a, b, offsets, out_dtype=BFLOAT16, poison=True):
    """``op`` on device copies of host arrays into a NaN-poisoned output; the output on the GPU."""
    out = up(cp, nan_bits(out_shape(op, a, b, offsets), out_dtype)) if poison else None
    result = OPS[op](up(cp, a), up(cp, b), up(cp, np.asarray(offsets)), out=out)
    check_errors()
    return result


# (experts, K, N, mean rows): tails in every dimension, one long K, many small experts;
# output columns one W box (64) past a whole tile (256) and reductions one chunk past it;
# K and N whole 64-column blocks off the tile sizes (wgrad's 3-D maps).
SHAPES = [(5, 136, 200, 33), (2, 40, 24, 400), (8, 256, 520, 300), (33, 64, 72, 20), (3, 7168, 136, 150),
          (4, 584, 328, 260), (6, 320, 1032, 130), (4, 320, 576, 230)]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("out_dtype", [BFLOAT16, np.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_within_derived_bound_of_fp64(cp, op, out_dtype, seed, shape):
    rng = np.random.default_rng(100 + seed)
    experts, k, n, mean_rows = shape
    a, b, offsets = random_problem(rng, op, experts, k, n, mean_rows, spare_rows=5)
    y = down(run(cp, op, a, b, offsets, out_dtype))
    r, s, terms = exact(op, a, b, offsets)
    assert_within_bound(y if op == "wgrad" else y[:int(offsets[-1])], r, s, terms, out_dtype, device=True,
                        what=f"device {op}")


@pytest.mark.parametrize("op", list(OPS))
def test_bf16_output_is_the_fp32_output_rounded_once(cp, op):
    rng = np.random.default_rng(1)
    a, b, offsets = random_problem(rng, op, 6, 200, 136, 90)
    y32 = down(run(cp, op, a, b, offsets, np.float32))
    y16 = down(run(cp, op, a, b, offsets, BFLOAT16))
    end = None if op == "wgrad" else int(offsets[-1])
    assert np.array_equal(y16[:end].view(np.uint16), y32[:end].astype(BFLOAT16).view(np.uint16))


@pytest.mark.parametrize("op", list(OPS))
def test_every_element_written_and_rows_past_the_end_untouched(cp, op):
    rng = np.random.default_rng(2)
    counts = [0, 1, 127, 0, 129, 1, 0, 300]
    offsets = offsets_of(counts)
    rows, k, n = int(offsets[-1]) + 7, 72, 136
    a = bf16(rng, (rows, n if op == "dgrad" else k))
    b = bf16(rng, (rows, n)) if op == "wgrad" else bf16(rng, (len(counts), k, n))
    poison = nan_bits(out_shape(op, a, b, offsets), BFLOAT16)
    y = down(run(cp, op, a, b, offsets))
    if op == "wgrad":
        assert not np.isnan(y.astype(np.float32)).any(), "some dW element was not written"
        for e, count in enumerate(counts):
            if count == 0:
                assert not y[e].astype(np.float32).any(), f"expert {e} has no rows: dW must be zero"
    else:
        end = int(offsets[-1])
        assert not np.isnan(y[:end].astype(np.float32)).any(), "some row of an expert was not written"
        assert np.array_equal(y[end:].view(np.uint16), poison[end:].view(np.uint16)), "rows past offsets[E] written"


def test_fresh_output_is_bf16_and_zero_past_the_end(cp):
    rng = np.random.default_rng(3)
    x, w = bf16(rng, (50, 64)), bf16(rng, (2, 64, 32))
    y = grouped_mm(up(cp, x), up(cp, w), cp.asarray(np.array([0, 20, 41], np.int32)))
    assert isinstance(y, cp.ndarray) and y.shape == (50, 32) and np.dtype(y.dtype) == BFLOAT16
    assert not down(y)[41:].astype(np.float32).any()


@pytest.mark.parametrize("op", list(OPS))
def test_ten_runs_give_identical_bits(cp, op):
    rng = np.random.default_rng(4)
    a, b, offsets = random_problem(rng, op, 8, 512, 264, 200)
    ga, gb, go = up(cp, a), up(cp, b), up(cp, offsets)
    first = bits(OPS[op](ga, gb, go))
    for _ in range(9):
        assert np.array_equal(bits(OPS[op](ga, gb, go)), first)
    check_errors()


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("out_dtype", [BFLOAT16, np.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("blocks", ["one", "past the resident"])
def test_any_grid_claims_every_tile_once_and_leaves_the_counter_at_zero(cp, op, out_dtype, blocks):
    """Blocks claim tiles from a counter: one block takes them all (many times the tile
    queue's slots); a grid of three blocks an SM (two of them start only once others have
    ended, finding every tile claimed) gives the full grid's bits; after each launch the
    stream's counter is back at zero."""
    rng = np.random.default_rng(11)
    a, b, offsets = random_problem(rng, op, 6, 264, 520, 170)
    want = bits(run(cp, op, a, b, offsets, out_dtype))
    implementation = api._device(cp.cuda.Device().id)
    full = implementation.grid
    implementation.grid = 1 if blocks == "one" else 3 * full
    try:
        for _ in range(2):
            assert np.array_equal(bits(run(cp, op, a, b, offsets, out_dtype)), want)
            claims = implementation._claims[cp.cuda.get_current_stream().ptr]
            assert claims.get().tolist() == [0, 0]
    finally:
        implementation.grid = full


def test_launches_on_two_streams_at_once_each_claim_from_their_own_counter(cp):
    """Two streams, each with a long queue of GEMMs, launched alternately (so that they may
    run at once): every result is its single launch's bits."""
    rng = np.random.default_rng(12)
    problems = [random_problem(rng, "forward", 8, 512, 1032, 300) for _ in range(2)]
    want = [bits(run(cp, "forward", *problem)) for problem in problems]
    device = [tuple(up(cp, array) for array in problem) for problem in problems]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in problems]
    outs = [[up(cp, nan_bits(out_shape("forward", *problem), BFLOAT16)) for _ in range(6)] for problem in problems]
    for i in range(6):
        for which, stream in enumerate(streams):
            with stream:
                grouped_mm(*device[which], out=outs[which][i])
    for stream in streams:
        stream.synchronize()
    check_errors()
    for which in range(2):
        for out in outs[which]:
            assert np.array_equal(bits(out), want[which])


def test_a_counter_first_made_in_a_graph_capture_is_zeroed_before_a_launch_outside_it(cp):
    """A stream's first launch is captured in a CUDA graph (its counter's zeros with it);
    with the counter's memory then holding -1s, a launch outside the capture before the
    graph ever ran still claims from zero, and the graph then gives the same bits."""
    rng = np.random.default_rng(13)
    problem = random_problem(rng, "forward", 5, 296, 264, 136)
    want = bits(run(cp, "forward", *problem))
    a, b, offsets = (up(cp, array) for array in problem)
    outs = [up(cp, nan_bits(out_shape("forward", *problem), BFLOAT16)) for _ in range(2)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        grouped_mm(a, b, offsets, out=outs[0])
        graph = stream.end_capture()
        api._device(cp.cuda.Device().id)._claims[stream.ptr].fill(-1)  # what uninitialised memory may hold
        grouped_mm(a, b, offsets, out=outs[1])
        check_errors()
        assert np.array_equal(bits(outs[1]), want)
        graph.launch(stream)
        check_errors()
    assert np.array_equal(bits(outs[0]), want)


def _layouts(rng, target_rows: np.ndarray):
    """The same rows of expert 2 placed four ways: alone at row 0; after other experts and
    5 other rows of their own expert; followed by other rows; split between two slots
    with equal weights (a master and its replica). Yields (rows, offsets, where the target
    rows are, the weight each slot uses)."""
    count = len(target_rows)
    others = lambda m: bf16(rng, (m, target_rows.shape[1]))  # noqa: E731
    yield target_rows, offsets_of([0, 0, count, 0]), slice(0, count), [0, 1, 2, 3]
    rows = np.concatenate([others(37), others(90), others(5), target_rows])
    yield rows, offsets_of([37, 90, count + 5, 0]), slice(132, 132 + count), [0, 1, 2, 3]
    rows = np.concatenate([others(3), target_rows, others(60), others(11)])
    yield rows, offsets_of([3, 0, count + 60, 11]), slice(3, 3 + count), [0, 1, 2, 3]
    split = 70
    yield target_rows, offsets_of([0, split, count - split, 0]), slice(0, count), [0, 2, 2, 3]


@pytest.mark.parametrize("op", ["forward", "dgrad"])
@pytest.mark.parametrize("k,n,count", [(200, 136, 150), (520, 328, 300)])
def test_a_rows_result_does_not_depend_on_where_it_runs(cp, op, k, n, count):
    rng = np.random.default_rng(5)
    w = bf16(rng, (4, k, n))
    target = bf16(rng, (count, k if op == "forward" else n))
    reference = None
    for rows, offsets, where, weight_of_slot in _layouts(rng, target):
        y = bits(run(cp, op, rows, w[weight_of_slot], offsets))[where]
        if reference is None:
            reference = y
        else:
            assert np.array_equal(y, reference), f"{op}: rows moved to {where} with offsets {offsets} changed bits"


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("seed", range(4))
def test_random_sizes_with_empty_and_one_row_experts(cp, op, seed):
    """Random K, N (multiples of 8) and expert sizes, some experts empty or of one row, no
    size a multiple of a tile, rows past offsets[E]: within the bound, nothing past the end
    written, the same bits on a second run."""
    rng = np.random.default_rng(200 + seed)
    experts = int(rng.integers(2, 12))
    k, n = (8 * int(v) for v in rng.integers(1, 90, size=2))
    counts = [int(v) for v in rng.integers(2, 300, size=experts)]
    for e in rng.permutation(experts)[:2]:
        counts[e] = 0
    counts[int(rng.integers(experts))] = 1
    offsets = offsets_of(counts)
    rows = int(offsets[-1]) + int(rng.integers(0, 9))
    a = bf16(rng, (rows, n if op == "dgrad" else k))
    b = bf16(rng, (rows, n)) if op == "wgrad" else bf16(rng, (experts, k, n))
    poison = nan_bits(out_shape(op, a, b, offsets), BFLOAT16)
    y = run(cp, op, a, b, offsets)
    again = run(cp, op, a, b, offsets)
    assert np.array_equal(bits(y), bits(again)), f"{op}: two runs differ"
    y = down(y)
    r, s, terms = exact(op, a, b, offsets)
    end = None if op == "wgrad" else int(offsets[-1])
    assert_within_bound(y[:end], r, s, terms, BFLOAT16, device=True, what=f"device {op} K={k} N={n} {counts}")
    if op != "wgrad":
        assert np.array_equal(y[end:].view(np.uint16), poison[end:].view(np.uint16)), "rows past offsets[E] written"


def test_wgrad_does_not_depend_on_where_the_experts_rows_start(cp):
    rng = np.random.default_rng(6)
    x, dy = bf16(rng, (230, 72)), bf16(rng, (230, 136))
    alone = bits(run(cp, "wgrad", x, dy, offsets_of([0, 230])))[1]
    before_x, before_dy = bf16(rng, (77, 72)), bf16(rng, (77, 136))
    moved = bits(run(cp, "wgrad", np.concatenate([before_x, x]), np.concatenate([before_dy, dy]),
                     offsets_of([77, 230])))[1]
    assert np.array_equal(moved, alone)


@pytest.mark.parametrize("k,n", [(136, 264), (128, 320)], ids=["2d-maps", "3d-maps"])
def test_wgrad_keeps_the_next_experts_rows_out_wherever_an_expert_ends(cp, k, n):
    """An expert's last chunk runs only its k16 steps holding the expert's rows, the last of
    them cleared past its end. Experts ending on and off a k16 step in each of a chunk's four,
    each followed by an expert of NaN rows: theirs are within the bound (no NaN reaches them)."""
    rng = np.random.default_rng(9)
    ends = [1, 15, 16, 17, 32, 47, 48, 49, 63, 64, 65, 80, 127, 128]
    offsets = offsets_of([count for end in ends for count in (end, 40)])
    x, dy = bf16(rng, (int(offsets[-1]), k)), bf16(rng, (int(offsets[-1]), n))
    nan_rows = np.zeros(len(x), bool)
    for e in range(1, len(offsets) - 1, 2):
        nan_rows[offsets[e]:offsets[e + 1]] = True
    nan_x, nan_dy = (np.where(nan_rows[:, None], np.nan, m).astype(BFLOAT16) for m in (x, dy))
    y = down(run(cp, "wgrad", nan_x, nan_dy, offsets, np.float32))
    r, s, terms = exact("wgrad", x, dy, offsets)
    ours = slice(0, None, 2)
    assert_within_bound(y[ours], r[ours], s[ours], terms[ours], np.float32, device=True,
                        what=f"wgrad of experts ending at {ends} before NaN rows")


@pytest.mark.parametrize("out_dtype", [BFLOAT16, np.float32], ids=["bf16", "fp32"])
def test_wgrad_one_copy_per_operand_gives_the_bits_of_a_copy_per_box(cp, out_dtype):
    """K and N multiples of 64 take wgrad's 3-D maps (one copy per operand and k-step, blocks
    past K or N as zeros); 8 more columns of x and dy, the 2-D maps (a copy per 64-column
    box). The output elements both have must have the same bits."""
    rng = np.random.default_rng(8)
    offsets = offsets_of([300, 0, 129, 64, 1, 77])
    rows = int(offsets[-1]) + 3
    x, dy = bf16(rng, (rows, 328)), bf16(rng, (rows, 584))
    blocks = bits(run(cp, "wgrad", np.ascontiguousarray(x[:, :320]), np.ascontiguousarray(dy[:, :576]), offsets,
                      out_dtype))
    boxes = bits(run(cp, "wgrad", x, dy, offsets, out_dtype))
    assert np.array_equal(blocks, boxes[:, :320, :576])


@pytest.mark.parametrize("added", [0, 3, 6])
@pytest.mark.parametrize("k, n", [(320, 576), (328, 584)], ids=["3-D maps", "2-D maps"])
def test_wgrad_add_to_is_the_stored_wgrad_added_as_memory_adds(cp, added, k, n):
    """``add_to[e] += dW_e`` for the first A experts with the bits of the FP32 wgrad stored
    and then added as the L2 adds (host.add_flushing_subnormals), an empty expert included;
    the other experts in ``out`` with the stored ones' bits; an added element that was
    NaN stays NaN (read, not skipped). Subnormals: expert 4's single row gives its first
    8 x 8 sums of 2^-132 (added to zeros), and ``before`` holds one beside the empty expert's
    zeros; its next 8 x 8 are 2^-126, normal, added to -1.5 * 2^-126: a subnormal result."""
    rng = np.random.default_rng(9)
    offsets = offsets_of([300, 0, 129, 64, 1, 77])
    rows = int(offsets[-1]) + 3
    x, dy = bf16(rng, (rows, k)), bf16(rng, (rows, n))
    x[int(offsets[4]), :8] = dy[int(offsets[4]), :8] = 2.0 ** -66
    x[int(offsets[4]), 8:16], dy[int(offsets[4]), 8:16] = 2.0 ** -60, 2.0 ** -66
    x, dy = up(cp, x), up(cp, dy)
    stored = down(run(cp, "wgrad", down(x), down(dy), offsets, np.float32))
    before = rng.standard_normal((added, k, n)).astype(np.float32)
    if added:
        before[0, 5, 7] = np.nan
        before[1, 2, 3] = 2.0 ** -140  # expert 1 has no rows: its dW is zero
    if added > 4:
        before[4, :8, :8] = 0.0  # a subnormal dW added to zero
        before[4, 8:16, 8:16] = -1.5 * 2.0 ** -126  # a normal dW whose sum is subnormal
    expected = before.copy()
    for e in range(added):
        add_flushing_subnormals(expected[e], stored[e])
    add_to = cp.asarray(before)
    out = up(cp, nan_bits((6 - added, k, n), np.float32))
    assert grouped_mm_wgrad(x, dy, up(cp, offsets), out=out, add_to=add_to) is out
    check_errors()
    got = add_to.get()
    # NaN stays NaN (the memory's add gives the canonical NaN, not the poison's payload)
    assert np.array_equal(np.isnan(expected), np.isnan(got))
    differ = np.argwhere(~np.isnan(got) & (bits(expected) != bits(got)))
    assert not differ.size, [(tuple(i), expected[tuple(i)], got[tuple(i)], stored[tuple(i)]) for i in differ[:8]]
    assert np.array_equal(bits(stored[added:]), bits(out))
    if added == 6:  # the flushes were exercised, not skipped
        assert 0 < stored[4, 0, 0] < np.finfo(np.float32).tiny and expected[4, 0, 0] == 0 == expected[1, 2, 3]
        assert stored[4, 8, 8] == 2.0 ** -126 and bits(expected[4, 8, 8]) == bits(np.float32(-0.0))


def test_device_offsets_are_checked_on_the_device_and_nothing_is_written(cp):
    rng = np.random.default_rng(7)
    x, w = up(cp, bf16(rng, (40, 16))), up(cp, bf16(rng, (3, 16, 24)))
    out = up(cp, nan_bits((40, 24), BFLOAT16))
    before = bits(out)
    for bad, words in (([0, 10, 5, 30], "must not decrease"), ([1, 10, 20, 30], "offsets[0] is 1"),
                       ([0, 10, 20, 41], "past the 40 rows")):
        grouped_mm(x, w, cp.asarray(np.array(bad, np.int64)), out=out)
        with pytest.raises(GroupedGemmError, match=re.escape(words)):
            check_errors()
        assert np.array_equal(bits(out), before), f"offsets {bad} were refused but out was written"
    grouped_mm(x, w, cp.asarray(np.array([0, 10, 20, 30], np.int32)), out=out)
    check_errors()  # the record was cleared; a good call leaves none


def test_host_offsets_with_device_data_are_checked_before_the_launch(cp):
    rng = np.random.default_rng(8)
    x, w = up(cp, bf16(rng, (40, 16))), up(cp, bf16(rng, (3, 16, 24)))
    with pytest.raises(GroupedGemmError, match="past the 40 rows"):
        grouped_mm(x, w, np.array([0, 10, 20, 41]))
    y = grouped_mm(x, w, [0, 10, 20, 40])
    assert np.array_equal(bits(y), bits(grouped_mm(x, w, cp.asarray(np.array([0, 10, 20, 40])))))


def test_misaligned_and_non_contiguous_views_are_refused(cp):
    rng = np.random.default_rng(9)
    w = up(cp, bf16(rng, (2, 16, 24)))
    flat = up(cp, bf16(rng, (20 * 16 + 1,)))
    with pytest.raises(GroupedGemmError, match="aligned"):
        grouped_mm(flat[1:].reshape(20, 16), w, [0, 10, 20])
    with pytest.raises(GroupedGemmError, match="contiguous"):
        grouped_mm(up(cp, bf16(rng, (20, 32)))[:, ::2], w, [0, 10, 20])


def test_torch_tensors_on_a_side_stream(cp):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    a, b, offsets = random_problem(rng, "forward", 4, 128, 64, 70)
    expected = bits(run(cp, "forward", a, b, offsets))

    def to_torch(array):
        return torch.from_numpy(array.view(np.int16)).cuda().view(torch.bfloat16)

    x, w = to_torch(a), to_torch(b)
    out = torch.full((a.shape[0], 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert grouped_mm(x, w, torch.from_numpy(offsets).cuda(), out=out) is out
        wgrad = torch.zeros((4, 128, 64), dtype=torch.float32, device="cuda")
        grouped_mm_wgrad(x, out, torch.from_numpy(offsets.astype(np.int32)).cuda(), out=wgrad)
    side.synchronize()
    end = int(offsets[-1])
    assert np.array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16)[:end], expected[:end])
    expected_wgrad = bits(run(cp, "wgrad", a, expected.view(BFLOAT16), offsets, np.float32))
    assert np.array_equal(wgrad.cpu().numpy().view(np.uint32), expected_wgrad)


def test_jax_inputs(cp):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    rng = np.random.default_rng(11)
    a, b, offsets = random_problem(rng, "dgrad", 3, 64, 48, 40)
    expected = bits(run(cp, "dgrad", a, b, offsets, poison=False))
    gpu = next(d for d in jax.devices() if d.platform == "gpu")
    ja, jb = (jax.device_put(jax.numpy.asarray(v), gpu) for v in (a, b))
    y = grouped_mm_dgrad(ja, jb, jax.device_put(jax.numpy.asarray(offsets.astype(np.int32)), gpu))
    check_errors()
    assert np.array_equal(bits(y), expected)
