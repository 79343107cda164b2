"""Seeded synthetic load traces (the format is :mod:`ultraep.integration.traces`).

Generators (all deterministic for a given seed):

* ``zipf_loads`` -- the UltraEP solver-test distribution: Zipf expert popularity whose
  exponent is tuned until the initial rank max/mean hits a target; ``zipf_topk`` gives
  top-k ids consistent with it.
* ``lognormal_trace``, ``drift_trace``, ``domain_switch_trace``, ``per_layer_trace``,
  ``zipf_trace`` and the mixed ``demo_trace`` -- multi-step, multi-layer traces with
  stationary skew, a drifting hotspot, abrupt domain switches, or different skew per
  layer.

Every generated token picks ``top_k`` distinct experts, so each source row sums to
``tokens_per_rank * top_k`` and no entry exceeds ``tokens_per_rank``.
"""

from __future__ import annotations

import numpy as np

from ultraep.integration.traces import Trace


def _check_sizes(num_ranks, num_experts, top_k, tokens_per_rank) -> None:
    for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts),
                        ("top_k", top_k), ("tokens_per_rank", tokens_per_rank)):
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) cannot exceed num_experts ({num_experts})")
    if tokens_per_rank * top_k >= 2**31:
        raise ValueError("tokens_per_rank * top_k must fit in int32")


def _cap_shares(weights: np.ndarray, top_k: int) -> np.ndarray:
    """Normalise each row to sum 1 with no share above 1/top_k (water-filling).

    A token picks top_k distinct experts, so one expert receives at most a 1/top_k share
    of a source's (token, expert) pairs.
    """
    weights = np.asarray(weights, dtype=np.float64)
    weights = np.maximum(weights, 1e-300)
    shares = weights / weights.sum(axis=-1, keepdims=True)
    cap = 1.0 / top_k
    for _ in range(weights.shape[-1]):
        capped = shares >= cap * (1 - 1e-12)
        free = np.where(capped, 0.0, weights)
        room = 1.0 - capped.sum(axis=-1, keepdims=True) * cap
        new = np.where(capped, cap, free * room / np.maximum(free.sum(axis=-1, keepdims=True), 1e-300))
        if np.allclose(new, shares, rtol=0, atol=1e-15):
            break
        shares = new
    return shares


def _enforce_token_cap(counts: np.ndarray, shares: np.ndarray, tokens_per_rank: int) -> np.ndarray:
    """Move sampling noise above ``tokens_per_rank`` to the most popular experts with room."""
    counts = counts.astype(np.int64)
    for row in np.nonzero((counts > tokens_per_rank).any(axis=1))[0]:
        excess = int(np.maximum(counts[row] - tokens_per_rank, 0).sum())
        counts[row] = np.minimum(counts[row], tokens_per_rank)
        for e in np.argsort(-shares[row], kind="stable"):
            if excess == 0:
                break
            take = min(excess, tokens_per_rank - int(counts[row, e]))
            counts[row, e] += take
            excess -= take
    return counts.astype(np.int32)


def sample_loads(weights, tokens_per_rank: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``int32[R, E]`` loads from per-source expert popularity ``weights[R, E]`` (any positive scale)."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 2:
        raise ValueError(f"weights must have shape [ranks, experts], got {weights.shape}")
    shares = _cap_shares(weights, top_k)
    counts = rng.multinomial(tokens_per_rank * top_k, shares)
    return _enforce_token_cap(counts, shares, tokens_per_rank)


def rank_imbalance(loads) -> float:
    """Initial (no balancing) rank max/mean of ``loads`` ``[..., R, E]``: master rank of e is e // M."""
    loads = np.asarray(loads)
    ranks, experts = loads.shape[-2:]
    per_rank = loads.sum(axis=-2, dtype=np.int64).reshape(*loads.shape[:-2], ranks, experts // ranks).sum(-1)
    mean = per_rank.mean(axis=-1)
    return per_rank.max(axis=-1) / np.where(mean > 0, mean, 1)


# ----------------------------------------------------------------------------- Zipf


def zipf_loads(num_ranks: int, num_experts: int, top_k: int, tokens_per_rank: int,
               initial_imbalance: float, seed: int, *, tolerance: float = 0.01) -> np.ndarray:
    """Zipf loads ``int32[R, E]`` whose initial rank max/mean is ``initial_imbalance``.

    Expert popularity is ``(i + 1) ** -s`` over a seeded random ranking ``i`` of the
    experts (the same for every source); the counts are drawn with one fixed set of
    uniforms per source, and the exponent ``s`` is bisected on the realised imbalance
    until it is within ``tolerance`` (relative) of the target. Raises ``ValueError`` when
    the target cannot be met at this size (too low for the sampling noise, or above
    what ``top_k`` distinct experts per token allow).
    """
    _check_sizes(num_ranks, num_experts, top_k, tokens_per_rank)
    if not np.isfinite(initial_imbalance) or initial_imbalance < 1.0:
        raise ValueError(f"initial_imbalance must be a finite number >= 1, got {initial_imbalance!r}")
    rng = np.random.default_rng(seed)
    ranking = rng.permutation(num_experts)
    pairs = tokens_per_rank * top_k
    # Source r's uniforms live in [r, r + 1) so one searchsorted serves every row.
    uniforms = (np.sort(rng.random((num_ranks, pairs)), axis=1)
                + np.arange(num_ranks)[:, None]).ravel()
    row_offsets = np.arange(num_ranks)[:, None]

    def draw(exponent: float) -> np.ndarray:
        popularity = np.empty(num_experts)
        popularity[ranking] = (np.arange(num_experts) + 1.0) ** -exponent
        shares = _cap_shares(popularity[None, :], top_k)
        cdf = np.cumsum(shares[0])
        cdf[-1] = 1.0
        ends = np.searchsorted(uniforms, cdf[None, :] + row_offsets, side="left")
        counts = np.diff(ends, axis=1, prepend=(row_offsets * pairs))
        return _enforce_token_cap(counts, np.broadcast_to(shares, counts.shape), tokens_per_rank)

    def error(loads):
        return float(rank_imbalance(loads)) - initial_imbalance

    low, high = 0.0, 1.0
    best = draw(low)
    if error(best) >= 0:
        if abs(error(best)) <= tolerance * initial_imbalance:
            return best
        raise ValueError(
            f"zipf_loads: initial imbalance {initial_imbalance} is below the sampling noise at this "
            f"size (uniform popularity already gives {rank_imbalance(best):.4f})")
    # Not monotone in the exponent (a hot expert's capped share spills onto another rank):
    # the message names the most any tried exponent reached.
    reached = float(rank_imbalance(best))
    while error(loads := draw(high)) < 0:
        reached = max(reached, float(rank_imbalance(loads)))
        low, high = high, high * 2
        if high > 256:
            raise ValueError(
                f"zipf_loads: initial imbalance {initial_imbalance} is unreachable with {num_ranks} ranks, "
                f"{num_experts} experts and top_k={top_k} (the most reached: {reached:.4f})")
    for _ in range(60):
        mid = 0.5 * (low + high)
        loads = draw(mid)
        if abs(error(loads)) < abs(error(best)):
            best = loads
        if error(loads) < 0:
            low = mid
        else:
            high = mid
        if abs(error(best)) <= 1e-4 * initial_imbalance or high - low < 1e-9:
            break
    for candidate in (draw(low), draw(high)):
        if abs(error(candidate)) < abs(error(best)):
            best = candidate
    if abs(error(best)) > tolerance * initial_imbalance:
        raise ValueError(
            f"zipf_loads: reached imbalance {rank_imbalance(best):.4f}, not within {tolerance:.1%} "
            f"of the initial imbalance {initial_imbalance} (too few tokens for this precision?)")
    return best


def topk_from_loads(loads, top_k: int, seed: int) -> np.ndarray:
    """Logical top-k ids ``int32[R, T, top_k]`` whose per-source counts are exactly ``loads``.

    Needs every row of ``loads`` to sum to ``T * top_k`` with no entry above ``T``. Each
    expert's ``c`` pairs are laid out as a run of length ``c <= T`` in a ``top_k x T``
    grid filled row-major, so a token (a column) never meets one expert twice; tokens and
    their k slots are then shuffled with ``seed``.
    """
    loads = np.asarray(loads)
    if loads.ndim != 2 or not np.issubdtype(loads.dtype, np.integer) or loads.min() < 0:
        raise ValueError("loads must be a non-negative integer matrix [ranks, experts]")
    row_sums = loads.sum(axis=1)
    if row_sums[0] % top_k or not np.all(row_sums == row_sums[0]):
        raise ValueError(f"every source row must sum to tokens_per_rank * top_k; got row sums {row_sums}")
    tokens = int(row_sums[0]) // top_k
    if loads.max() > tokens:
        raise ValueError(f"an entry ({int(loads.max())}) exceeds tokens_per_rank ({tokens}): "
                         f"a token cannot pick one expert twice")
    rng = np.random.default_rng(seed)
    ranks, experts = loads.shape
    ids = np.empty((ranks, tokens, top_k), dtype=np.int32)
    for r in range(ranks):
        grid = np.repeat(np.arange(experts, dtype=np.int32), loads[r]).reshape(top_k, tokens).T
        grid = grid[rng.permutation(tokens)]
        ids[r] = np.take_along_axis(grid, np.argsort(rng.random(grid.shape), axis=1), axis=1)
    return ids


def zipf_topk(num_ranks: int, num_experts: int, top_k: int, tokens_per_rank: int,
              initial_imbalance: float, seed: int, *, tolerance: float = 0.01) -> np.ndarray:
    """Top-k ids ``int32[R, T, top_k]`` whose counts equal ``zipf_loads`` with the same arguments."""
    loads = zipf_loads(num_ranks, num_experts, top_k, tokens_per_rank, initial_imbalance, seed,
                       tolerance=tolerance)
    return topk_from_loads(loads, top_k, seed)


# -------------------------------------------------------------------------- traces


def synthetic_trace(*, steps: int, layers: int, num_ranks: int, num_experts: int, top_k: int,
                    tokens_per_rank: int, seed: int, sigma=1.0, domains: int = 1,
                    switch_every: int | None = None, hotspot_gain: float = 0.0,
                    hotspot_width: float | None = None, hotspot_speed: float = 0.0,
                    step_jitter: float = 0.15, source_jitter: float = 0.25,
                    name: str = "synthetic") -> Trace:
    """The general non-stationary generator that the named ones configure.

    Popularity of expert ``e`` at (step, layer), seen by source ``r``::

        exp(sigma[layer] * z[domain(step), layer, e])          log-normal base skew
        * (1 + hotspot_gain * bump(e - centre(step, layer)))   drifting hotspot
        * exp(step_jitter * n[step, layer, e])                 batch-to-batch noise
        * exp(source_jitter * m[step, layer, r, e])            per-source variation

    ``domain(step) = (step // switch_every) % domains`` switches abruptly; the hotspot is
    a circular Gaussian bump over expert ids (so over adjacent master ranks) whose
    centre moves ``hotspot_speed`` experts per step, from a random start per layer.
    """
    _check_sizes(num_ranks, num_experts, top_k, tokens_per_rank)
    if steps <= 0 or layers <= 0:
        raise ValueError(f"steps and layers must be positive, got {steps}, {layers}")
    if domains <= 0:
        raise ValueError(f"domains must be positive, got {domains}")
    sigmas = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (layers,))
    switch_every = switch_every or steps
    width = hotspot_width or max(1.0, num_experts / 16)
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((domains, layers, num_experts))
    start = rng.uniform(0, num_experts, size=layers)
    loads = np.empty((steps, layers, num_ranks, num_experts), dtype=np.int32)
    expert_ids = np.arange(num_experts)
    for s in range(steps):
        domain = (s // switch_every) % domains
        for l in range(layers):
            log_pop = sigmas[l] * base[domain, l]
            log_pop = log_pop + step_jitter * rng.standard_normal(num_experts)
            if hotspot_gain:
                centre = (start[l] + hotspot_speed * s) % num_experts
                dist = np.abs(expert_ids - centre)
                dist = np.minimum(dist, num_experts - dist)
                log_pop = log_pop + np.log1p(hotspot_gain * np.exp(-0.5 * (dist / width) ** 2))
            per_source = log_pop[None, :] + source_jitter * rng.standard_normal((num_ranks, num_experts))
            loads[s, l] = sample_loads(np.exp(per_source - per_source.max()), tokens_per_rank, top_k, rng)
    metadata = dict(generator=name, seed=seed, top_k=top_k, tokens_per_rank=tokens_per_rank,
                    sigma=sigmas.tolist(), domains=domains, switch_every=switch_every,
                    hotspot_gain=hotspot_gain, hotspot_width=width, hotspot_speed=hotspot_speed,
                    step_jitter=step_jitter, source_jitter=source_jitter)
    return Trace(loads, None, metadata)


def lognormal_trace(*, steps, layers, num_ranks, num_experts, top_k, tokens_per_rank, seed,
                    sigma: float = 1.0) -> Trace:
    """Stationary log-normal expert popularity (per layer), with batch-to-batch noise."""
    return synthetic_trace(steps=steps, layers=layers, num_ranks=num_ranks, num_experts=num_experts,
                           top_k=top_k, tokens_per_rank=tokens_per_rank, seed=seed, sigma=sigma,
                           name="lognormal")


def drift_trace(*, steps, layers, num_ranks, num_experts, top_k, tokens_per_rank, seed,
                sigma: float = 0.5, hotspot_gain: float = 8.0, hotspot_speed: float | None = None) -> Trace:
    """A hotspot that drifts across the experts (and so across ranks): one lap over the trace by default."""
    speed = num_experts / steps if hotspot_speed is None else hotspot_speed
    return synthetic_trace(steps=steps, layers=layers, num_ranks=num_ranks, num_experts=num_experts,
                           top_k=top_k, tokens_per_rank=tokens_per_rank, seed=seed, sigma=sigma,
                           hotspot_gain=hotspot_gain, hotspot_speed=speed, name="drift")


def domain_switch_trace(*, steps, layers, num_ranks, num_experts, top_k, tokens_per_rank, seed,
                        sigma: float = 1.2, domains: int = 3, switch_every: int | None = None) -> Trace:
    """Abrupt switches between ``domains`` unrelated popularity patterns (e.g. code/math/chat traffic)."""
    every = switch_every or max(1, steps // (2 * domains))
    return synthetic_trace(steps=steps, layers=layers, num_ranks=num_ranks, num_experts=num_experts,
                           top_k=top_k, tokens_per_rank=tokens_per_rank, seed=seed, sigma=sigma,
                           domains=domains, switch_every=every, name="domain-switch")


def per_layer_trace(*, steps, layers, num_ranks, num_experts, top_k, tokens_per_rank, seed,
                    sigma_range: tuple[float, float] = (0.3, 1.6)) -> Trace:
    """Different skew per layer: log-normal sigma rising linearly from the first layer to the last."""
    sigmas = np.linspace(*sigma_range, num=layers)
    return synthetic_trace(steps=steps, layers=layers, num_ranks=num_ranks, num_experts=num_experts,
                           top_k=top_k, tokens_per_rank=tokens_per_rank, seed=seed, sigma=sigmas,
                           name="per-layer")


def zipf_trace(*, steps, layers, num_ranks, num_experts, top_k, tokens_per_rank, seed,
               initial_imbalance: float = 2.0) -> Trace:
    """Independent ``zipf_loads`` draws per (step, layer): the solver-test distribution, with the
    hot experts re-ranked every micro-batch (the worst case for a history-based balancer)."""
    loads = np.empty((steps, layers, num_ranks, num_experts), dtype=np.int32)
    for s in range(steps):
        for l in range(layers):
            cell_seed = int(np.random.SeedSequence([seed, s, l]).generate_state(1)[0])
            loads[s, l] = zipf_loads(num_ranks, num_experts, top_k, tokens_per_rank,
                                     initial_imbalance, cell_seed, tolerance=0.05)
    return Trace(loads, None, dict(generator="zipf", seed=seed, top_k=top_k,
                                   tokens_per_rank=tokens_per_rank, initial_imbalance=initial_imbalance))


def demo_trace(*, steps: int = 24, layers: int = 4, num_ranks: int = 16, num_experts: int = 64,
               top_k: int = 8, tokens_per_rank: int = 2048, seed: int = 0) -> Trace:
    """The built-in non-stationary demo: per-layer skew, a drifting hotspot and two traffic domains
    switching every quarter of the trace."""
    return synthetic_trace(steps=steps, layers=layers, num_ranks=num_ranks, num_experts=num_experts,
                           top_k=top_k, tokens_per_rank=tokens_per_rank, seed=seed,
                           sigma=np.linspace(0.4, 1.0, num=layers), domains=2,
                           switch_every=max(1, steps // 4), hotspot_gain=2.0,
                           hotspot_speed=num_experts / steps, name="demo")


GENERATORS = {
    "zipf": zipf_trace,
    "lognormal": lognormal_trace,
    "drift": drift_trace,
    "domain-switch": domain_switch_trace,
    "per-layer": per_layer_trace,
    "demo": demo_trace,
}
