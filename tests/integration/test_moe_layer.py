"""MoELayer: placement invariance and bad input across 2 and 4 ranks (CPU backend in CI,
CUDA IPC on a GPU; ``mpi/moe_layer_check.py``), and the SwiGLU between its grouped GEMMs
(NumPy reference against FP64; the CUDA kernels against the reference, bit for bit)."""

import re
from fractions import Fraction

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, requires_gpu, run_ranks
from tests.support.scripts import load_script
from ultraep.integration.moe_layer import exp_rn, expert_spec, fma32, swiglu, swiglu_backward
from ultraep.runtime.dtypes import BFLOAT16

BF16_ROUNDOFF = 2.0**-8  # round to nearest BF16 (8 significant bits): relative error at most 2^-8
FP32_TINY = 2.0**-126  # below this the FP32 sigmoid loses its relative precision (exp(-a) overflows at a < -88.7)
# Rounding a result below the normal range errs by up to half BF16's subnormal spacing, 2^-134,
# absolutely; FP32's underflows (2^-150 each, times factors below 2^10 here) add less than 2^-134.
BF16_UNDERFLOW = 2.0**-133


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_balanced_layer_is_bitwise_the_unbalanced_one(backend, ranks):
    out = run_ranks(ranks, "integration/mpi/moe_layer_check.py", backend, "invariance", timeout=300)
    assert_all_ranks_ok(out, ranks, "invariance")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_layer_whose_balancer_cannot_replicate_runs_unbalanced(backend, ranks):
    out = run_ranks(ranks, "integration/mpi/moe_layer_check.py", backend, "no-replica", timeout=300)
    assert_all_ranks_ok(out, ranks, "no-replica")


def hot_pair_loads(ranks: int, tokens: int) -> np.ndarray:
    """Every rank's tokens all pick experts 0 and 1 (both on rank 0): expert 0's load is the
    most one expert can get, ``ranks * tokens``."""
    loads = np.zeros((ranks, 2 * ranks), np.int32)
    loads[:, :2] = tokens
    return loads


def planned_replicas(loads, layout, min_replica_tokens: int, backend: str) -> int:
    from ultraep.planner import plan_placement

    if backend == "device":
        import cupy
        loads = cupy.asarray(loads)
    plan = plan_placement(loads, layout, backend=backend, min_replica_tokens=min_replica_tokens).to_numpy()
    return int((np.asarray(plan.replica_count) - 1).sum())


def check_replica_bound(backend: str) -> None:
    """``can_replicate``'s bound is the planners' exact one: at ``min_replica_tokens`` =
    ``R * T`` (a replica taking the whole load of an expert every token picks) the plan
    makes a replica, one token more and none; a layout without room never replicates (the
    host planner's plan; the device planner is not asked for layouts without a slot)."""
    from types import SimpleNamespace

    from ultraep.integration.moe_layer import can_replicate
    from ultraep.planner import ExpertLayout

    for ranks, tokens in ((2, 8), (4, 48)):
        layout, loads = ExpertLayout(ranks, 2 * ranks, 1), hot_pair_loads(ranks, tokens)
        for min_replica_tokens in (0, ranks * tokens, ranks * tokens + 1):
            balancer = SimpleNamespace(layout=layout, min_replica_tokens=min_replica_tokens)
            possible = can_replicate(balancer, ranks * tokens)
            assert possible == (min_replica_tokens <= ranks * tokens)
            assert (planned_replicas(loads, layout, min_replica_tokens, backend) > 0) == possible, min_replica_tokens
    for layout in (ExpertLayout(2, 4, 0), ExpertLayout(2, 4, 1, max_instances=1)):
        assert not can_replicate(SimpleNamespace(layout=layout, min_replica_tokens=0), 16)
        if backend == "host":
            assert planned_replicas(hot_pair_loads(2, 8), layout, 0, backend) == 0


def test_replica_bound_is_the_host_planners():
    check_replica_bound("host")


@pytest.mark.gpu
@requires_gpu
def test_replica_bound_is_the_device_planners():
    check_replica_bound("device")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_on_every_rank(backend):
    out = run_ranks(2, "integration/mpi/moe_layer_check.py", backend, "bad-input", timeout=240)
    assert_all_ranks_ok(out, 2, "bad-input")


def test_expert_spec_is_the_stacked_weights_slices():
    spec = expert_spec(64, 24)
    assert [(t.name, t.shape, t.dtype.name) for t in spec.weights] == [("w_up", (64, 48), "bfloat16"),
                                                                       ("w_down", (24, 64), "bfloat16")]
    assert spec.grad_dtype == np.float32


FP32_MAX = float(np.finfo(np.float32).max)
# exp_rn's error bound: 1.014 ulp at most over every FP32 input from -86 to 88.75, 37.77864 the worst
# (scripts/exp_rn_ulps.py runs them all against FP64's exp: minutes)
EXP_ULPS = 1.02


def sample(rows=300, ffn=40, seed=0):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((rows, 2 * ffn)) * 4).astype(np.float32)
    # exp(-a) in FP32: exact 1, flushed to 0 (a > 86), subnormal sigmoid (a < -87.3), overflow (a < -88.7)
    h[0, :16] = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 86.0, 86.5, -86.5, 87.5, -87.5, 88.7, -88.7, 90.0, -90.0,
                 1e3]
    d_act = rng.standard_normal((rows, ffn)).astype(np.float32).astype(BFLOAT16)
    return h, d_act


def exp_inputs():
    """Every 251st FP32 bit pattern (17 million), special values (exp_rn's worst inputs
    among them) and both sides of exp_rn's clamps and of FP32's overflow."""
    sweep = np.arange(0, 2**32, 251, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, FP32_MAX, -FP32_MAX, 2.0**-126, -2.0**-126,
                        2.0**-149, -2.0**-149, 2.0**-25, -2.0**-25, 1e30, -1e30, 1.0, -1.0,
                        37.77864074707031, -16.288606643676758], dtype=np.float32)  # exp_rn's worst two
    edges = np.array([-86.0, 88.72283935546875, 88.75, 0.0], dtype=np.float32)
    steps = np.arange(-300, 301, dtype=np.int32)
    around = (edges.view(np.int32)[:, None] + steps).ravel().view(np.float32)
    return np.concatenate([sweep, special, around, -around])


fp32_ulps = load_script("exp_rn_ulps").fp32_ulps  # the offline check's measure, the sweep's too


def nearest_fp32(exact: Fraction) -> np.float32:
    """The FP32 value nearest ``exact`` (ties to the even significand), by comparing the
    neighbours of a close candidate exactly."""
    candidate = np.float32(float(exact))
    below, above = (np.nextafter(candidate, np.float32(side)) for side in (-np.inf, np.inf))
    options = sorted((abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1, v)
                     for v in (below, candidate, above))
    return options[0][2]


def test_fma32_rounds_a_times_b_plus_c_once():
    """fma32 against the exact a * b + c rounded once: where FP64's own rounding of the sum
    lands on an FP32 tie (just below and just above one, either parity), on cancellation,
    and on random operands of mixed scales."""
    one, ulp = np.float32(1), np.float32(2.0**-23)
    below_half_ulp = np.float32(2.0**-24) * (one - ulp)  # (1 - 2^-23)(1 + 2^-23) 2^-24 = 2^-24 - 2^-70
    cases = [(one + ulp, one - ulp, one),  # 1 - 2^-46 + 1: exact in FP64
             (np.float32(2.0**-24), one - ulp, one + ulp),  # an odd c plus just under half its ulp
             (np.float32(2.0**-24), one + ulp, one),  # an even c plus just over half its ulp
             (np.float32(2.0**-24) * (one + ulp), one - ulp, one + ulp),
             (one + ulp, one + ulp, -(one + 2 * ulp)),  # cancellation: 2^-46 exactly
             (below_half_ulp, one + ulp, one + ulp)]
    rng = np.random.default_rng(5)
    scale = lambda n: rng.choice([1.0, 2.0**-20, 2.0**20], n)  # noqa: E731
    a, b, c = (np.concatenate([[case[i] for case in cases],
                               (rng.standard_normal(3000) * scale(3000)).astype(np.float32)]) for i in range(3))
    got = fma32(a, b, c)
    assert got.dtype == np.float32
    for x, y, z, g in zip(a, b, c, got):
        want = nearest_fp32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert g.view(np.uint32) == want.view(np.uint32), f"fma32({x!r}, {y!r}, {z!r}) = {g!r}, not {want!r}"


def test_exp_constants_are_the_kernels():
    """moe_layer's exp_rn and swiglu.cuh's use the same FP32 constants."""
    from ultraep.integration import moe_layer
    from ultraep.runtime.kernels import kernel_source

    header = kernel_source("swiglu.cuh").read_text()
    device = {name: np.float32(value) for name, value in re.findall(r"\b(EXP_\w+) = (-?[0-9.e+-]+)f\b", header)}
    host = {name: getattr(moe_layer, name) for name in device if hasattr(moe_layer, name)}
    host.update({f"EXP_P{i}": c for i, c in enumerate(moe_layer.EXP_P)})
    assert sorted(device) == sorted(host), f"swiglu.cuh has {sorted(device)}, moe_layer {sorted(host)}"
    for name, value in device.items():
        assert host[name].dtype == np.float32 and host[name].view(np.uint32) == value.view(np.uint32), name


def test_exp_is_within_its_ulp_bound_of_exp():
    """Within EXP_ULPS of FP64's exp wherever it is not flushed to 0 (below -86, where exp
    < 2^-124: the sigmoid is 1 already below 2^-25); exactly 1 for |x| <= 2^-25 (subnormals
    included), NaN for NaN, inf past FP32's range."""
    x = exp_inputs()
    with np.errstate(invalid="ignore"):  # signalling NaNs among the bit patterns
        got = exp_rn(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any()
    x, got = x[~nan], got[~nan]
    flushed = x < np.float32(-86)
    assert (got[flushed] == 0).all() and not np.signbit(got[flushed]).any()
    assert (got[np.abs(x) <= 2.0**-25] == 1).all()
    with np.errstate(over="ignore"):
        exact = np.exp(x[~flushed].astype(np.float64))
    error = fp32_ulps(got[~flushed], exact)
    worst = np.argmax(error)
    assert error[worst] <= EXP_ULPS, f"exp_rn({x[~flushed][worst]!r}) = {got[~flushed][worst]!r}: {error[worst]} ulps"
    assert (got[~flushed][exact >= 2.0**128] == np.inf).all()


def test_reference_flushes_subnormals_as_the_device_does():
    """CuPy compiles with -ftz=true (measured on the H200: a subnormal operand or result of
    __fmul_rn / __fdiv_rn is a zero of its sign): the reference's sigmoid, SwiGLU and its
    backward flush alike, and keep zeros' signs, infinities, NaN and normals."""
    from ultraep.integration.moe_layer import _sigmoid, flush_subnormals

    tiny = np.finfo(np.float32).tiny
    x = np.array([tiny / 2, -tiny / 4, tiny, -tiny, 0.0, -0.0, np.inf, np.nan, 1.5], np.float32)
    got = flush_subnormals(x)
    assert got.dtype == np.float32
    assert got[:2].tolist() == [0, 0] and not np.signbit(got[0]) and np.signbit(got[1])
    assert np.array_equal(got[2:], x[2:], equal_nan=True) and np.signbit(got[5])
    assert _sigmoid(np.array([-87.5, -87.0], np.float32)).tolist()[0] == 0  # 1 / (1 + e^87.5) is subnormal
    assert _sigmoid(np.array([-87.0], np.float32))[0] >= tiny
    h = np.array([[-87.5, tiny / 2, 2.0, 3.0, 1.0, tiny / 2]], np.float32)  # gates | ups
    act = swiglu(h, 1).astype(np.float32)
    assert act[0, 0] == 0 and np.signbit(act[0, 0]) and act[0, 1] == 0 and act[0, 2] == 0
    d_act = np.array([[1.0, 1.0, tiny / 2]], np.float32).astype(BFLOAT16)  # a subnormal BF16 gradient too
    dh = swiglu_backward(h, d_act, 1).astype(np.float32)
    assert dh[0, 1] == 0.5 and dh[0, 4] == 0  # a flushed gate is 0: slope 1/2, a * s = 0
    assert dh[0, 2] == 0 and dh[0, 5] == 0  # a flushed g


def test_sigmoid_is_within_4u_of_sigmoid():
    """1 / (1 + exp_rn(-a)) with exp_rn within 2.03u (u = 2^-24, one rounding; 1.014 ulp) of
    exp: 1 + e within 3.03u, s within 4.03u (plus one for second-order terms and the 0.03);
    absolutely within FP32_TINY where s is subnormal or 0."""
    from ultraep.integration.moe_layer import _sigmoid

    a = exp_inputs()
    a = a[~np.isnan(a)]
    with np.errstate(invalid="ignore"):  # signalling NaNs among the bit patterns
        got = _sigmoid(a)
    assert got.dtype == np.float32
    with np.errstate(over="ignore"):
        want = 1 / (1 + np.exp(-a.astype(np.float64)))
    bound = 5 * 2.0**-24 * want + np.where(want < FP32_TINY, FP32_TINY, 0)
    error = np.abs(got - want)
    worst = np.argmax(error - bound)
    assert error[worst] <= bound[worst], f"sigmoid({a[worst]!r}) = {got[worst]!r}, want {want[worst]!r}"


def test_exp_takes_float32_only():
    with pytest.raises(TypeError, match="float32"):
        exp_rn(np.zeros(3))


def fp64_swiglu(h, d_act):
    ffn = h.shape[1] // 2
    a, b = h[:, :ffn].astype(np.float64), h[:, ffn:].astype(np.float64)
    s = 1 / (1 + np.exp(-a))
    g = d_act.astype(np.float64)
    return a * s * b, np.concatenate([g * b * s * (1 + a * (1 - s)), g * a * s], axis=1)


def gate_sweep(seed=0):
    """Gates from a dense sweep of FP32 over [-100, 100] (every 1024th bit pattern: 2.2
    million, 8192 a binade), random up halves and d_act."""
    rng = np.random.default_rng(seed)
    top = np.float32(100).view(np.uint32)
    half = np.arange(0, top, 1024, dtype=np.uint32).view(np.float32)
    a = np.concatenate([half, -half])
    ffn = 1024
    a = a[: len(a) // ffn * ffn].reshape(-1, ffn)
    b = (rng.standard_normal(a.shape) * 4).astype(np.float32)
    d_act = rng.standard_normal(a.shape).astype(np.float32).astype(BFLOAT16)
    return np.concatenate([a, b], axis=1), d_act


@pytest.mark.parametrize("data", ["sample", "gate sweep"])
def test_swiglu_reference_is_fp64_within_its_fp32_steps_then_bf16(data):
    """With u = 2^-24 (one FP32 rounding) and exp_rn within 2.03u of exp (1.014 ulp), s = 1 /
    (1 + e) is within 4.03u of sigmoid; act = (a s) b and d_up = g (a s) within 6.03u. d_gate's
    slope s (1 + a (1 - s)) can cancel, so it is measured against its terms: 1 - s within
    4.03u (absolute), a (1 - s) within 5.03u |a|, 1 + a (1 - s) within 6.03u (1 + |a|), the
    slope within 11.06u (1 + |a|), d_gate within 13.06u |g b| (1 + |a|). Then one BF16
    rounding, 2^-8 of the magnitude; FP32_TINY times the terms where the sigmoid underflows
    (s subnormal or 0), FP32_TINY times the other factors where a flushed subnormal is taken
    for 0, and BF16_UNDERFLOW where a result underflows. Each bound gets one u more for the
    second-order terms and exp_rn's 0.03 or 0.06."""
    h, d_act = sample() if data == "sample" else gate_sweep()
    rows = h.shape[0] - 50 if data == "sample" else h.shape[0]
    act, dh = swiglu(h, rows), swiglu_backward(h, d_act, rows)
    want_act, want_dh = fp64_swiglu(h, d_act)
    ffn = h.shape[1] // 2
    a, b = np.abs(h[:rows, :ffn].astype(np.float64)), np.abs(h[:rows, ffn:].astype(np.float64))
    g = np.abs(d_act[:rows].astype(np.float64))
    u = 2.0**-24
    # Flushing (flush_subnormals) moves an operand or result below FP32_TINY to 0: times the
    # other factors' magnitudes, at most (the slope is below 1.1) these sums of FP32_TINY.
    for got, want, terms, fp32, flushed in ((act[:rows], want_act[:rows], a * b, 7 * u, 2 + 2 * b + a),
                                            (dh[:rows, ffn:], want_dh[:rows, ffn:], g * a, 7 * u, 2 + 2 * g + a),
                                            (dh[:rows, :ffn], want_dh[:rows, :ffn], g * b * (1 + a), 14 * u,
                                             2 + 2.2 * (g + b))):
        error = np.abs(got.astype(np.float64) - want)
        bound = BF16_ROUNDOFF * np.abs(want) + (fp32 + FP32_TINY) * terms + BF16_UNDERFLOW + FP32_TINY * flushed
        assert np.all(error <= bound), f"worst excess {np.max(error - bound):.3g}"
    assert not act[rows:].astype(np.float32).any() and not dh[rows:].astype(np.float32).any()
    assert np.all(np.isfinite(act.astype(np.float32))) and np.all(np.isfinite(dh.astype(np.float32)))


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, but any NaN equals any NaN (NumPy keeps an input NaN's payload and sign,
    the GPU writes its canonical one)."""
    width = {2: np.int16, 4: np.int32}[got.dtype.itemsize]
    magnitude = {2: 0x7FFF, 4: 0x7FFFFFFF}[got.dtype.itemsize]
    inf_bits = {2: 0x7F80, 4: 0x7F800000}[got.dtype.itemsize]
    got, want = got.view(width), want.view(width)
    got_nan, want_nan = (got & magnitude) > inf_bits, (want & magnitude) > inf_bits
    differ = np.flatnonzero((got != want) & ~(got_nan & want_nan))
    assert differ.size == 0, f"{what}: {differ.size} of {got.size} differ, first at {differ[0]}"


def random_fp32(rng, count):
    """Half uniform bit patterns (every exponent, inf and NaN), half uniform over [-100, 100]."""
    patterns = rng.integers(0, 2**32, count // 2, dtype=np.uint32).view(np.float32)
    return np.concatenate([patterns, rng.uniform(-100, 100, count - count // 2).astype(np.float32)])


EXP_TEST_KERNEL = r"""
extern "C" __global__ void exp_and_sigmoid(const float* x, long long n, float* exp_out, float* sigmoid_out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        exp_out[i] = sigmoid_exp_rn(x[i]);
        sigmoid_out[i] = sigmoid_rn(x[i]);
    }
}
"""


@pytest.mark.gpu
@requires_gpu
def test_exp_and_sigmoid_kernels_are_the_reference_bit_for_bit():
    """swiglu.cuh's sigmoid_exp_rn against moe_layer's exp_rn on x clamped into [-86, 88],
    and sigmoid_rn against moe_layer's, on exp_inputs() and 10^7 random FP32 values: every x
    but NaN, where the device's sigmoid is a number (SwiGLU's results are NaN through a)."""
    import cupy

    from ultraep.integration.moe_layer import _sigmoid
    from ultraep.runtime.kernels import COMPILE_OPTIONS, inline_local_includes, kernel_source

    x = np.concatenate([exp_inputs(), random_fp32(np.random.default_rng(7), 10**7)])
    code = inline_local_includes(kernel_source("swiglu.cuh")) + EXP_TEST_KERNEL
    kernel = cupy.RawModule(code=code, options=COMPILE_OPTIONS).get_function("exp_and_sigmoid")
    x_dev = cupy.asarray(x)
    exp_dev, sigmoid_dev = cupy.empty_like(x_dev), cupy.empty_like(x_dev)
    kernel((1024,), (256,), (x_dev, np.int64(x.size), exp_dev, sigmoid_dev))
    number = ~np.isnan(x)
    with np.errstate(invalid="ignore"):  # signalling NaNs among the random bit patterns
        want_exp = exp_rn(np.minimum(np.maximum(x[number], np.float32(-86)), np.float32(88)))
        want_sigmoid = _sigmoid(x[number])
    assert_same_bits(cupy.asnumpy(exp_dev)[number], want_exp, "sigmoid_exp_rn")
    assert_same_bits(cupy.asnumpy(sigmoid_dev)[number], want_sigmoid, "sigmoid_rn")
    assert np.isfinite(cupy.asnumpy(sigmoid_dev)[~number]).all()


SIGMOID_OF_EXP_TEST_KERNEL = r"""
// sigmoid_of_exp_rn(e) for e's bits first + i, i < n: against IEEE division (__fdiv_rn), NaN
// equal to NaN (counts and the first e that differs), and every 2^shift-th into out (shift >= 0).
extern "C" __global__ void sigmoid_of_exp(unsigned first, long long n, float* out, int shift,
                                          unsigned long long* differ, unsigned* first_differ) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned bits = first + (unsigned)i;
        const float got = sigmoid_of_exp_rn(__uint_as_float(bits));
        const float want = __fdiv_rn(1.0f, __fadd_rn(1.0f, __uint_as_float(bits)));
        if (shift >= 0 && (i & ((1ll << shift) - 1)) == 0) out[i >> shift] = got;
        if (__float_as_uint(got) != __float_as_uint(want) && !(got != got && want != want)) {
            atomicAdd(differ, 1ull);
            atomicMin(first_differ, bits);
        }
    }
}
"""


@pytest.mark.gpu
@requires_gpu
def test_sigmoid_of_its_exponential_is_a_division_for_every_exponential():
    """swiglu.cuh's sigmoid_of_exp_rn (a reciprocal without a division's slow-path branch)
    against the device's IEEE division for every finite e from +0 up (sigmoid_exp_rn's
    results are among them), and against moe_layer's NumPy division on every 128th."""
    import cupy

    from ultraep.runtime.dtypes import flush_subnormals
    from ultraep.runtime.kernels import COMPILE_OPTIONS, inline_local_includes, kernel_source

    code = inline_local_includes(kernel_source("swiglu.cuh")) + SIGMOID_OF_EXP_TEST_KERNEL
    kernel = cupy.RawModule(code=code, options=COMPILE_OPTIONS).get_function("sigmoid_of_exp")
    end, shift = 0x7F800000, 7  # +inf's bits: every finite e below them
    got = cupy.full((end + (1 << shift) - 1) >> shift, np.nan, np.float32)
    differ, first_differ = cupy.zeros(1, cupy.uint64), cupy.full(1, 0xFFFFFFFF, cupy.uint32)
    kernel((4096,), (256,), (np.uint32(0), np.int64(end), got, np.int32(shift), differ, first_differ))
    assert int(differ[0]) == 0, f"{int(differ[0])} differ from a division, first at e bits 0x{int(first_differ[0]):08x}"
    e = np.arange(0, end, 1 << shift, dtype=np.uint32).view(np.float32)
    assert_same_bits(cupy.asnumpy(got), flush_subnormals(np.float32(1) / (np.float32(1) + e)), "sigmoid_of_exp_rn")


def run_swiglu_kernels(h, d_act, offsets, rows):
    """swiglu.cu's forward and backward over poisoned outputs: (act, dh) as int16 bits."""
    import cupy

    from ultraep.integration.moe_layer import _DeviceSwiGLU

    kernels = _DeviceSwiGLU(cupy.cuda.Device().id)
    poison = np.int16(0x7FC1)  # a NaN pattern
    act = cupy.full((h.shape[0], h.shape[1] // 2), poison, dtype=np.int16)
    dh = cupy.full(h.shape, poison, dtype=np.int16)
    h_dev, d_act_dev = cupy.asarray(h), cupy.asarray(d_act.view(np.int16))
    offsets = cupy.asarray(offsets, dtype=np.int32)
    kernels.forward(h_dev, offsets, act)
    kernels.backward(h_dev, d_act_dev, offsets, dh)
    got_act, got_dh = cupy.asnumpy(act), cupy.asnumpy(dh)
    assert (got_act[rows:] == poison).all() and (got_dh[rows:] == poison).all()
    return got_act[:rows], got_dh[:rows]


@pytest.mark.gpu
@requires_gpu
def test_swiglu_kernel_is_the_reference_bit_for_bit():
    """Poisoned outputs; offsets end before the buffer's last rows, which stay poisoned."""
    h, d_act = sample(rows=4099, ffn=136, seed=3)
    rows = 4000
    got_act, got_dh = run_swiglu_kernels(h, d_act, [0, 1000, 1000, 2500, rows], rows)
    assert_same_bits(got_act, swiglu(h, rows)[:rows], "act")
    assert_same_bits(got_dh, swiglu_backward(h, d_act, rows)[:rows], "dh")


@pytest.mark.gpu
@requires_gpu
def test_swiglu_kernel_is_the_reference_bit_for_bit_on_any_input():
    """Gates, up halves and d_act from random bits and the dense gate sweep (10^7 gates
    and as many up values; inf and NaN included, NaN compared as NaN)."""
    rng = np.random.default_rng(11)
    ffn = 1024
    sweep_h, sweep_d_act = gate_sweep(seed=5)
    random_h = rng.permutation(random_fp32(rng, 2 * ffn * (10**7 // ffn))).reshape(-1, 2 * ffn)
    random_d_act = rng.integers(0, 2**16, (random_h.shape[0], ffn), dtype=np.uint16).view(BFLOAT16)
    h = np.concatenate([sweep_h, random_h])
    d_act = np.concatenate([sweep_d_act, random_d_act])
    rows = h.shape[0]
    got_act, got_dh = run_swiglu_kernels(h, d_act, [0, rows // 3, rows], rows)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, inf - inf, sums past FP32's range
        want_act, want_dh = swiglu(h, rows), swiglu_backward(h, d_act, rows)
    assert_same_bits(got_act, want_act, "act")
    assert_same_bits(got_dh, want_dh, "dh")


def test_layers_of_one_shape_share_their_weight_gradient_buffers():
    """One [S] set (the replica slots': the masters' gradients are added in place) per
    (device, shape), held by the layers that use it."""
    from types import SimpleNamespace

    from ultraep.integration.moe_layer import _WgradScratch

    def layer(hidden):
        return SimpleNamespace(device=None, experts_per_rank=2, slots=1, hidden=hidden, ffn=3, xp=np)

    first, second, other = (_WgradScratch.of(layer(h)) for h in (4, 4, 8))
    assert first is second and other is not first
    assert first.up.shape == (1, 4, 6) and first.down.shape == (1, 3, 4) and first.up.dtype == np.float32
