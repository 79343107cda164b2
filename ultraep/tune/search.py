"""The search: every configuration of the knobs' cartesian product evaluated by the model
(:mod:`ultraep.tune.model`) at once, the best returned, memoised per token bucket.

The space (:func:`knob_values`): weight sync's grid, the Dispatcher's grid, and the fused
kernels' CTAs, send and reduce task sizes -- over a hundred thousand configurations on a
GPU of 132 SMs. A phase's time depends on its own knobs only, so each phase is evaluated
on the axes of its knobs and the layer's time of every configuration is their sum,
broadcast over the product (one array of the product's size); the best configuration of
the sum is then each phase's best at once.

:class:`Tuner` memoises per problem shape and bucket of :data:`BUCKET_TOKENS` tokens per
rank: the first problem that falls into a bucket is searched, the rest reuse its answer
(the model is queried only when the load crosses a bucket's boundary).
:func:`fused_schedule` is a fused layer's choice for every bucket up to its ``max_tokens``,
made once at set-up (:func:`agreed_fused_schedule`: from rank 0's profile, so every rank
holds the same schedule and loads the same kernel variants).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from ultraep.errors import ProfileError
from ultraep.compute.fused.config import BUCKET_TOKENS, FusedConfig, FusedSchedule, bucket
from ultraep.tune.model import PHASES, SYNC_MIN_BLOCKS, Problem, SyncProblem, fused_down_s, fused_up_s, predict
from ultraep.tune.profile import MachineProfile

TASK_TOKENS = (4, 8, 16, 32, 64, 128)   # send and reduce task sizes tried
CTA_STEPS = 16                          # CTA counts tried: this many, evenly up to the usable SMs
SYNC_GRIDS = 32                         # weight-sync grids tried, evenly up to its resident bound
DISPATCH_BLOCKS_PER_SM = tuple(range(1, 9))
KNOBS = ("sync_blocks", "dispatch_grid", "ctas", "send_tokens", "reduce_tokens")
FUSED_PHASES = ("fused_up", "fused_down")
# The fused model's error on held-out sweeps (2.4-3.8 %, docs/tuning.md): a configuration
# predicted faster than the kernel source's constants by less is no measurable gain, and the
# constants (every SM, the source's task sizes) stay.
FUSED_MODEL_ERROR = 0.03


@dataclass(frozen=True)
class TunedConfig:
    """The knobs of one layer call: weight sync's grid, the Dispatcher's grid (its
    persistent copy kernels'), and the fused kernels' :class:`FusedConfig`."""

    sync_blocks: int
    dispatch_grid: int
    fused: FusedConfig


@dataclass(frozen=True)
class SearchResult:
    """The best configuration, each phase's modelled seconds under it, how many
    configurations were evaluated and how long the search took."""

    config: TunedConfig
    predicted: dict
    evaluated: int
    seconds: float


def _spread(low: int, high: int, count: int) -> np.ndarray:
    """Up to ``count`` distinct integers evenly from ``low`` to ``high`` (both included)."""
    return np.unique(np.linspace(low, high, count).round().astype(np.int64))


def knob_values(profile: MachineProfile) -> dict[str, np.ndarray]:
    """Each knob's candidate values on ``profile``'s machine."""
    usable = profile.usable_sms
    tokens = np.asarray(TASK_TOKENS, np.int64)
    return {
        "sync_blocks": _spread(1, SYNC_MIN_BLOCKS * profile.sm_count, SYNC_GRIDS),
        "dispatch_grid": np.asarray(DISPATCH_BLOCKS_PER_SM, np.int64) * profile.sm_count,
        "ctas": _spread(max(1, usable // CTA_STEPS), usable, CTA_STEPS),
        "send_tokens": tokens,
        "reduce_tokens": tokens.copy(),
    }


def product_axes(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The knobs' values shaped to broadcast into their cartesian product (one axis each)."""
    axes = {}
    for i, name in enumerate(KNOBS):
        shape = [1] * len(KNOBS)
        shape[i] = len(values[name])
        axes[name] = np.asarray(values[name]).reshape(shape)
    return axes


def search(profile: MachineProfile, problem: Problem, sync: SyncProblem | None = None, *,
           values: dict[str, np.ndarray] | None = None) -> SearchResult:
    """The configuration of least modelled layer time (weight sync, dispatch and combine,
    the fused kernels) among the product of ``values`` (default :func:`knob_values`); the
    fused kernels keep the source's constants on every usable SM unless the best is predicted
    faster by more than :data:`FUSED_MODEL_ERROR`."""
    begin = time.perf_counter()
    values = knob_values(profile) if values is None else values
    if any(len(values.get(name, ())) == 0 for name in KNOBS):
        raise ProfileError(f"search: every knob needs candidate values ({', '.join(KNOBS)})")
    axes = product_axes(values)
    phases = predict(profile, problem, sync, axes)
    total = sum(phases.values())
    total = np.broadcast_to(total, tuple(len(values[name]) for name in KNOBS))
    best = np.unravel_index(int(np.argmin(total)), total.shape)
    chosen = {name: int(values[name][i]) for name, i in zip(KNOBS, best)}
    predicted = {phase: float(np.broadcast_to(phases[phase], total.shape)[best]) for phase in PHASES}
    fused = FusedConfig(chosen["ctas"], chosen["send_tokens"], chosen["reduce_tokens"])
    constants = FusedConfig(profile.usable_sms)
    if fused != constants:
        at_constants = fused_phases(profile, problem, constants)
        if sum(predicted[p] for p in FUSED_PHASES) > (1.0 - FUSED_MODEL_ERROR) * sum(at_constants.values()):
            fused = constants
            predicted.update(at_constants)
    config = TunedConfig(chosen["sync_blocks"], chosen["dispatch_grid"], fused)
    return SearchResult(config, predicted, int(total.size), time.perf_counter() - begin)


def fused_phases(profile: MachineProfile, problem: Problem, config: FusedConfig) -> dict:
    """The fused kernels' modelled seconds (FUSED_PHASES) under one configuration."""
    return {"fused_up": float(fused_up_s(profile, problem, config.ctas, config.send_tokens)),
            "fused_down": float(fused_down_s(profile, problem, config.ctas, config.reduce_tokens))}


class Tuner:
    """:func:`search` memoised per problem shape, token bucket and weight-sync problem."""

    def __init__(self, profile: MachineProfile):
        if not isinstance(profile, MachineProfile):
            raise ProfileError(f"profile must be a MachineProfile, got {type(profile).__name__}")
        self.profile = profile
        self._memo: dict = {}

    def choose(self, problem: Problem, sync: SyncProblem | None = None) -> SearchResult:
        key = (bucket(problem.tokens), problem.hidden, problem.ffn, problem.top_k, problem.experts, problem.ranks,
               problem.ranks_per_gpu, problem.element_bytes, problem.keeps_h, sync)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = search(self.profile, problem, sync)
        return found

    def __len__(self) -> int:
        return len(self._memo)


def fused_schedule(tuner: Tuner, problem: Problem) -> FusedSchedule:
    """The fused kernels' best configuration for each token bucket up to ``problem.tokens``
    (each searched at its bucket's largest count, the last at ``problem.tokens``)."""
    return FusedSchedule(tuple(
        tuner.choose(dataclasses.replace(problem, tokens=min(b * BUCKET_TOKENS, problem.tokens))).config.fused
        for b in range(1, bucket(problem.tokens) + 1)))


def agreed_fused_schedule(group, backend: str, *, max_tokens: int, hidden: int, ffn: int, top_k: int, experts: int,
                          element_bytes: int = 2) -> FusedSchedule:
    """Collective: :func:`fused_schedule` for a fused layer of this group from rank 0's
    machine profile (measured once and cached; every rank gets the same schedule), the
    ranks sharing a GPU as the profile found them."""
    from ultraep.tune.replicas import group_profile

    profile = group_profile(group, backend, what="fused_config='tuned'", shared=True)[0]
    problem = Problem(int(max_tokens), int(hidden), int(ffn), int(top_k), int(experts), group.size,
                      ranks_per_gpu=profile.shared_by, element_bytes=element_bytes)
    return fused_schedule(Tuner(profile), problem)
