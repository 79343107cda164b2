"""MoELayer: placement invariance and bad input across 2 and 4 ranks (CPU backend in CI,
CUDA IPC on a GPU; ``mpi/moe_layer_check.py``), and the SwiGLU between its grouped GEMMs
(NumPy reference against FP64; the CUDA kernel against the reference, bit for bit)."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.integration.moe_layer import expert_spec, swiglu, swiglu_backward
from ultraep.runtime.dtypes import BFLOAT16

BF16_ROUNDOFF = 2.0**-8  # round to nearest BF16 (8 significant bits): relative error at most 2^-8
FP32_TINY = 2.0**-126  # below this the FP32 sigmoid loses its relative precision (exp(-a) overflows at a < -88.7)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_balanced_layer_is_bitwise_the_unbalanced_one(backend, ranks):
    out = run_ranks(ranks, "integration/mpi/moe_layer_check.py", backend, "invariance", timeout=300)
    assert_all_ranks_ok(out, ranks, "invariance")


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


def sample(rows=300, ffn=40, seed=0):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((rows, 2 * ffn)) * 4).astype(np.float32)
    h[0, :4] = [0.0, -0.0, 90.0, -90.0]  # exp over- and underflow in FP32, not in FP64
    d_act = rng.standard_normal((rows, ffn)).astype(np.float32).astype(BFLOAT16)
    return h, d_act


def fp64_swiglu(h, d_act):
    ffn = h.shape[1] // 2
    a, b = h[:, :ffn].astype(np.float64), h[:, ffn:].astype(np.float64)
    s = 1 / (1 + np.exp(-a))
    g = d_act.astype(np.float64)
    return a * s * b, np.concatenate([g * b * s * (1 + a * (1 - s)), g * a * s], axis=1)


def test_swiglu_reference_is_fp64_rounded_once_to_bf16_within_its_fp32_steps():
    """Each result is at most 6 FP32 roundings (2^-24 each) from exact, then one BF16
    rounding: within 2^-8 + 8 x 2^-24 of its magnitude, plus FP32_TINY times the magnitude
    of its terms where the sigmoid underflows. The slope 1 + a(1 - s) of d_gate can
    cancel, so its FP32 part is measured against the magnitudes of its terms."""
    h, d_act = sample()
    rows = 250
    act, dh = swiglu(h, rows), swiglu_backward(h, d_act, rows)
    want_act, want_dh = fp64_swiglu(h, d_act)
    ffn = h.shape[1] // 2
    a, b = np.abs(h[:rows, :ffn].astype(np.float64)), np.abs(h[:rows, ffn:].astype(np.float64))
    g = np.abs(d_act[:rows].astype(np.float64))
    fp32 = 8 * 2.0**-24
    for got, want, terms in ((act[:rows], want_act[:rows], a * b), (dh[:rows, ffn:], want_dh[:rows, ffn:], g * a),
                             (dh[:rows, :ffn], want_dh[:rows, :ffn], g * b * (1 + a))):
        error = np.abs(got.astype(np.float64) - want)
        bound = BF16_ROUNDOFF * np.abs(want) + (fp32 + FP32_TINY) * terms
        assert np.all(error <= bound), f"worst excess {np.max(error - bound):.3g}"
    assert not act[rows:].astype(np.float32).any() and not dh[rows:].astype(np.float32).any()
    assert np.all(np.isfinite(act.astype(np.float32))) and np.all(np.isfinite(dh.astype(np.float32)))


@pytest.mark.gpu
@requires_gpu
def test_swiglu_kernel_is_the_reference_bit_for_bit():
    """Poisoned outputs; offsets end before the buffer's last rows, which stay poisoned.
    Bit for bit but for an exponential rounding differently near an FP32 midpoint (about one
    input in 2^28, raw_kernels/swiglu.cu): for these 1.6e6 results a chance of about 1 in 170."""
    import cupy

    from ultraep.integration.moe_layer import _DeviceSwiGLU

    h, d_act = sample(rows=4099, ffn=136, seed=3)
    rows = 4000
    offsets = cupy.asarray([0, 1000, 1000, 2500, rows], dtype=np.int32)
    kernels = _DeviceSwiGLU(cupy.cuda.Device().id)
    poison = np.int16(0x7FC1)  # a NaN pattern
    act = cupy.full((h.shape[0], h.shape[1] // 2), poison, dtype=np.int16)
    dh = cupy.full(h.shape, poison, dtype=np.int16)
    h_dev, d_act_dev = cupy.asarray(h), cupy.asarray(d_act.view(np.int16))
    kernels.forward(h_dev, offsets, act)
    kernels.backward(h_dev, d_act_dev, offsets, dh)
    got_act, got_dh = cupy.asnumpy(act), cupy.asnumpy(dh)
    want_act, want_dh = swiglu(h, rows).view(np.int16), swiglu_backward(h, d_act, rows).view(np.int16)
    assert np.count_nonzero(got_act[:rows] != want_act[:rows]) == 0
    assert np.count_nonzero(got_dh[:rows] != want_dh[:rows]) == 0
    assert (got_act[rows:] == poison).all() and (got_dh[rows:] == poison).all()


def test_layers_of_one_shape_share_their_weight_gradient_buffers():
    """One [M + S] set per (device, shape), held by the layers that use it."""
    from types import SimpleNamespace

    from ultraep.integration.moe_layer import _WgradScratch

    def layer(hidden):
        return SimpleNamespace(device=None, experts_per_rank=2, slots=1, hidden=hidden, ffn=3, xp=np)

    first, second, other = (_WgradScratch.of(layer(h)) for h in (4, 4, 8))
    assert first is second and other is not first
    assert first.up.shape == (3, 4, 6) and first.down.shape == (3, 3, 4) and first.up.dtype == np.float32
