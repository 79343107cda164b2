"""The replica cost model on synthetic profiles: an expert compute that is flat while it
reads the weights and linear once compute-bound (a roofline), whose threshold has a
closed form; decode- and prefill-sized loads on an H200-like profile; and bad input."""

import math

import numpy as np
import pytest

from ultraep.errors import ProfileError
from ultraep.transfer import ExpertSpec
from ultraep.tune import NEVER, ComputeCurve, MachineProfile, min_replica_tokens_for
from tests.tune.synthetic import fused_like
from ultraep.tune.replicas import expert_weight_elements

# The profile's quantities the replica threshold does not read.
UNUSED_BY_REPLICAS = dict(kernel_s=1e-6, copy_warp_bytes_per_s=1e10, flag_s=1e-6, fused=fused_like(132))


def roofline_profile(*, floor_s: float, per_row_s: float, peer_bytes_per_s: float, k: int = 1024, n: int = 1024,
                     experts: int = 4, rows=(8, 32, 128, 512, 2048, 8192)) -> MachineProfile:
    """Per expert ``max(floor_s, per_row_s * rows)`` for ``k x n`` weights, measured at ``rows``."""
    seconds = tuple(experts * max(floor_s, per_row_s * m) for m in rows)
    curve = ComputeCurve(kernel="synthetic", dtype="bfloat16", experts=experts, k=k, n=n,
                         rows_per_expert=tuple(rows), seconds=seconds)
    return MachineProfile(backend="device", device="synthetic GPU", sm_count=132, sm_share=100,
                          copy_bytes_per_s=2 * peer_bytes_per_s, copy_method="synthetic",
                          peer_bytes_per_s=peer_bytes_per_s, peer_method="synthetic", launch_s=3e-6, compute=curve,
                          **UNUSED_BY_REPLICAS)


KNEE = 128  # a measured size: the model interpolates between sizes, so a kink elsewhere is rounded off


def h200_like(peer_bytes_per_s: float = 1.5e12) -> MachineProfile:
    """About what a bf16 grouped GEMM and a peer copy reach on one H200: 2048 x 2048 weights
    (8 MiB), ~400 TFLOPS once compute-bound, weight-bound below 128 rows (~3 TB/s of weight
    reads), 1.5 TB/s copies."""
    k = n = 2048
    per_row = 2 * k * n / 400e12
    return roofline_profile(floor_s=KNEE * per_row, per_row_s=per_row, peer_bytes_per_s=peer_bytes_per_s, k=k, n=n)


def closed_form(profile: MachineProfile, spec_bytes: int, elements: int, passes: float = 1.0) -> int:
    """The smallest d with passes * (per_row * d - floor) > copy, all scaled to ``elements``."""
    curve = profile.compute
    scale = elements / (curve.k * curve.n)
    per_expert = np.asarray(curve.seconds) / curve.experts
    floor = per_expert[0] * scale
    per_row = (per_expert[-1] - per_expert[-2]) / (curve.rows_per_expert[-1] - curve.rows_per_expert[-2]) * scale
    copy = spec_bytes / profile.peer_bytes_per_s
    return math.floor((copy / passes + floor) / per_row) + 1


def test_expert_seconds_is_flat_below_linear_between_and_extended_above():
    curve = ComputeCurve(kernel="k", dtype="bfloat16", experts=2, k=4, n=8, rows_per_expert=(10, 20, 40),
                         seconds=(2.0, 4.0, 8.0))
    assert curve.expert_seconds(1) == pytest.approx(1.0) and curve.expert_seconds(10) == pytest.approx(1.0)
    assert curve.expert_seconds(15) == pytest.approx(1.5)
    assert curve.expert_seconds(80) == pytest.approx(4.0 + 0.1 * 40)
    assert curve.expert_seconds(80, weight_elements=64) == pytest.approx(2 * (4.0 + 0.1 * 40))
    noisy = ComputeCurve(kernel="k", dtype="bfloat16", experts=1, k=4, n=8, rows_per_expert=(10, 20, 40),
                         seconds=(3.0, 2.0, 5.0))
    assert noisy.expert_seconds(20) == pytest.approx(3.0)  # never cheaper for more rows
    assert np.all(np.diff(noisy.expert_seconds(np.arange(1, 100))) >= 0)


@pytest.mark.parametrize("spec_bytes", [1 << 20, 8 << 20, 64 << 20])
@pytest.mark.parametrize("passes", [1.0, 3.0])
def test_threshold_of_a_roofline_is_its_closed_form(spec_bytes, passes):
    profile = h200_like()
    elements = spec_bytes // 2
    got = min_replica_tokens_for(spec_bytes, profile, compute_passes=passes)
    assert got == closed_form(profile, spec_bytes, elements, passes)
    # the smallest: one token fewer does not pay off
    curve = profile.compute
    saving = passes * (curve.expert_seconds(got - 1, elements) - curve.expert_seconds(0, elements))
    assert saving <= spec_bytes / profile.peer_bytes_per_s


def test_decode_gets_no_replica_and_prefill_gets_replicas():
    """hidden 2048, ffn 1024, bf16 (8 MiB an expert): at 64 tokens x top-8 per rank and 8
    experts per rank an expert averages 64 rows -- the threshold is above even three times
    that; at 8192 tokens per rank (8192 rows an expert) it is a small part of a hot
    expert's excess."""
    spec = ExpertSpec([("w_in", (2048, 1024), "bfloat16"), ("w_out", (1024, 2048), "bfloat16")])
    threshold = min_replica_tokens_for(spec.weight_slot_bytes, h200_like(),
                                       weight_elements=expert_weight_elements(spec))
    assert 3 * 64 < threshold < 0.25 * 8192
    assert threshold > KNEE  # the rows where the expert stops being weight-bound, and more


def test_scaling_laws():
    profile = h200_like()
    base = min_replica_tokens_for(8 << 20, profile)
    # an expert twice as large costs twice the copy and saves twice per row: the same threshold
    assert abs(min_replica_tokens_for(16 << 20, profile) - base) <= 1
    # more bytes for the same compute (e.g. restore and gradients in training): a larger threshold
    assert min_replica_tokens_for(16 << 20, profile, weight_elements=4 << 20) > base
    # a faster link: a smaller threshold, never below the knee
    assert KNEE < min_replica_tokens_for(8 << 20, h200_like(peer_bytes_per_s=15e12)) < base
    # more GEMM passes per copy (training): a smaller threshold
    assert min_replica_tokens_for(8 << 20, profile, compute_passes=3) < base


def test_a_flat_compute_never_pays_off():
    flat = roofline_profile(floor_s=1e-3, per_row_s=0.0, peer_bytes_per_s=1e12)
    assert min_replica_tokens_for(8 << 20, flat) == NEVER
    assert NEVER == np.iinfo(np.int32).max  # the planner's loads are int32


def test_a_free_copy_needs_only_the_knee():
    profile = roofline_profile(floor_s=1e-5, per_row_s=1e-7, peer_bytes_per_s=1e30, rows=(8, 32, 100, 400))
    assert min_replica_tokens_for(8, profile, weight_elements=1024 * 1024) == 101  # 100 rows are flat


@pytest.mark.parametrize("kwargs, match", [
    (dict(spec_bytes=0), "spec_bytes"),
    (dict(spec_bytes=-5), "spec_bytes"),
    (dict(spec_bytes=1.5), "spec_bytes"),
    (dict(spec_bytes=True), "spec_bytes"),
    (dict(spec_bytes=8, weight_elements=0), "weight_elements"),
    (dict(spec_bytes=8, compute_passes=0), "compute_passes"),
    (dict(spec_bytes=8, compute_passes=float("nan")), "compute_passes"),
    (dict(spec_bytes=8, profile={"device": "x"}), "MachineProfile"),
])
def test_bad_input_is_refused(kwargs, match):
    arguments = dict(profile=h200_like()) | kwargs
    with pytest.raises(ProfileError, match=match):
        min_replica_tokens_for(arguments.pop("spec_bytes"), arguments.pop("profile"), **arguments)


@pytest.mark.parametrize("seed", range(5))
def test_threshold_is_the_first_size_that_pays_off_on_any_measured_curve(seed):
    """Noisy, non-convex measurements: the bisection finds what a scan of every size finds."""
    rng = np.random.default_rng(seed)
    rows = tuple(int(v) for v in np.cumsum(rng.integers(1, 400, 6)))
    seconds = tuple(float(v) for v in rng.uniform(1e-5, 1e-3, 6))
    curve = ComputeCurve(kernel="k", dtype="bfloat16", experts=2, k=64, n=64, rows_per_expert=rows, seconds=seconds)
    profile = MachineProfile(backend="host", device="d", sm_count=2, sm_share=100, copy_bytes_per_s=1e9,
                             copy_method="m", peer_bytes_per_s=float(rng.uniform(1e9, 1e11)), peer_method="m",
                             launch_s=1e-6, compute=curve, **UNUSED_BY_REPLICAS)
    got = min_replica_tokens_for(1 << 20, profile)
    sizes = np.arange(1, 200_000)
    saving = curve.expert_seconds(sizes, (1 << 20) // 2) - curve.expert_seconds(0, (1 << 20) // 2)
    paying = np.nonzero(saving > (1 << 20) / profile.peer_bytes_per_s)[0]
    assert got == (int(sizes[paying[0]]) if paying.size else NEVER) or (not paying.size and got > sizes[-1])
