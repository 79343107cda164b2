"""The quota planner: its options (``Planner``, shared by both implementations) and the
NumPy reference algorithm that ``HostPlanner`` runs and ``raw_kernels/planner.cu`` matches
bit for bit.

Each NVLink domain is solved on its own (replicas never leave it):

1. **Threshold search.** Find the smallest rank-load threshold ``tau`` that the greedy
   oracle can reach. The search runs in rounds of ``PROBES_PER_ROUND`` probes inside
   the open interval ``(lo, hi)`` (``probe_points``; ``lo`` = ceil(mean)-1 is infeasible,
   ``hi`` = the initial max is feasible with no moves). With ``target_imbalance`` the
   search starts at ``cap`` = floor(target x mean) instead (``lo`` = cap - 1): a plan
   that only has to reach the cap needs fewer replicas (less weight traffic) than the
   tightest one, and the first probe is the cap itself. The lowest feasible probe
   becomes ``hi`` and the probe below it ``lo``. Rounds stop at ``hi - lo <=
   tau_tolerance + 1``. The default tolerance is ``lo >> NEAR_SHIFT`` tokens (the
   spacing of the near probes), so ``tau`` is within that spacing of the oracle's exact
   threshold, which ``tau_tolerance=0`` finds. The GPU evaluates one probe per warp;
   this reference evaluates the same probes in the same order, so both pick the same
   ``tau`` even where the oracle is not monotone.
2. **Greedy oracle** for one ``tau``: overloaded ranks in descending load, their
   masters in descending load; while the rank is above ``tau``, move
   ``need = min(max(excess, q_min), expert's remaining master quota)`` of the expert to
   an eligible rank (free redundant slot, not hosting the expert, slack >= ``q_min``,
   the expert below ``K`` instances), creating a replica. Changes to the paper's
   oracle (most slack, move as much as fits), each for fewer replicas or lower
   thresholds: the target is the *best fit* (least slack that still takes ``need``,
   else most slack); a target that could take no further replica afterwards -- its
   leftover slack would fall below ``q_min``, or this is its last free slot -- is
   filled completely, which moves that otherwise stranded slack onto the source rank
   (whose slots are free); and the ranks go in two passes. Pass 1 gives every
   overloaded rank whose whole excess one replica of its hottest expert can take that
   one replica, on the best-fitting rank, and skips the others; pass 2 runs the full
   greedy on the ranks still overloaded. Otherwise the ranks that need several replicas
   come first and spill into the largest rooms, which a rank with one replica's worth
   of excess would have filled exactly. Pass 1 is on by default only with a cap: in the
   tightest search it saves replicas too but sometimes stops at a higher threshold
   (``fit_first``). Moving at least ``q_min`` even when the excess is smaller lets a
   slightly overloaded rank shed load at all. Ties go to the lowest index; integer
   arithmetic.
3. **Locality-first split** (``locality_split``).

Requires the total load below 2**31 (checked), so every sum fits in int32 on the GPU.
The search's constants are the kernel's ``#define``s, read from its source.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan
from ultraep.runtime.dtypes import is_bool, is_int
from ultraep.runtime.kernels import kernel_constants

_KERNEL = kernel_constants("planner.cu")
PROBES_PER_ROUND = _KERNEL["PROBES"]  # one warp per probe, spread over a cluster of blocks
NEAR_PROBES = _KERNEL["NEAR_PROBES"]  # probes spaced from lo by the near step (probe_points)
NEAR_SHIFT = _KERNEL["NEAR_SHIFT"]  # near step = lo >> NEAR_SHIFT ...
NEAR_GAP_SHIFT = _KERNEL["NEAR_GAP_SHIFT"]  # ... and at most gap >> NEAR_GAP_SHIFT


class Planner(ABC):
    """A quota planner for one layout: ``HostPlanner`` (NumPy) or ``DevicePlanner`` (CUDA).

    ``min_replica_tokens``: the fewest tokens a replica may serve (it must be worth its
    weight transfer). ``tau_tolerance`` (tokens): how close the threshold search gets to
    the oracle's exact threshold; ``None`` = ``auto_tolerance`` of each domain.
    ``target_imbalance`` (>= 1, e.g. 1.005): settle for a max rank load up to that
    multiple of the domain's mean where the oracle reaches it, with fewer replicas than
    the tightest plan (``None``: the tightest). ``fit_first``: run the oracle's pass 1
    (module docstring): fewer replicas (less weight traffic) at the same threshold, for a
    longer planning kernel; ``None`` = only with ``target_imbalance`` (in the tightest
    search it sometimes ends a little higher). The options are checked here, once.
    """

    def __init__(self, layout: ExpertLayout, *, min_replica_tokens: int = 1024, tau_tolerance: int | None = None,
                 target_imbalance: float | None = None, fit_first: bool | None = None):
        if not isinstance(layout, ExpertLayout):
            raise ValueError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
        self.layout = layout
        if isinstance(min_replica_tokens, str) and min_replica_tokens == "auto":
            raise ValueError("min_replica_tokens='auto' needs the expert's size and the machine profile: the "
                             "Balancer resolves it; for the planner alone pass "
                             "ultraep.tune.min_replica_tokens_for(...)")
        self.min_replica_tokens = _non_negative_int("min_replica_tokens", min_replica_tokens)
        self.tau_tolerance = None if tau_tolerance is None else _non_negative_int("tau_tolerance", tau_tolerance)
        self.cap_ppm = target_ppm(target_imbalance)
        if fit_first is None:
            fit_first = target_imbalance is not None
        elif not is_bool(fit_first):
            raise ValueError(f"fit_first must be True, False or None, got {fit_first!r}")
        self.fit_first = bool(fit_first)

    @abstractmethod
    def plan(self, loads, out: Plan | None = None) -> Plan:
        """The plan of load matrix ``loads[R, E]``; written into ``out`` (from
        ``empty_plan``) when given, e.g. for CUDA graph capture."""

    @abstractmethod
    def reroute(self, topk_ids, plan: Plan, rank: int, out=None, workspace=None):
        """Physical slot ids (int32, shaped like ``topk_ids``) of rank ``rank``'s tokens
        under ``plan`` (``ultraep.planner.reroute``)."""

    @abstractmethod
    def empty_plan(self) -> Plan:
        """Buffers for ``plan(..., out=)``."""


def _non_negative_int(name, value) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def target_ppm(target_imbalance: float | None) -> int:
    """``target_imbalance`` in parts per million (0 for None): the integer both backends
    derive the cap from, floor(total * ppm / (domain ranks * 10**6))."""
    if target_imbalance is None:
        return 0
    if (isinstance(target_imbalance, bool) or not isinstance(target_imbalance, (int, float, np.integer, np.floating))
            or not 1.0 <= float(target_imbalance) <= 100.0):
        raise ValueError("target_imbalance must be a number in [1, 100] (max/mean rank load), "
                         f"got {target_imbalance!r}")
    return round(float(target_imbalance) * 10**6)


def search_floor(total: int, ranks: int, cap_ppm: int) -> int:
    """The search's infeasible lower end ``lo``: ceil(mean) - 1, or cap - 1 when the cap
    of ``cap_ppm`` is higher."""
    lo = -(-total // ranks) - 1
    return max(lo, total * cap_ppm // (ranks * 10**6) - 1) if cap_ppm else lo


def probe_points(lo: int, hi: int) -> list[int]:
    """Thresholds probed in one round, ascending, strictly inside ``(lo, hi)``.

    The oracle's threshold usually sits just above the mean (``lo`` + 1 in the first
    round), so ``NEAR_PROBES`` probes step by ``lo >> NEAR_SHIFT`` (at most
    ``gap >> NEAR_GAP_SHIFT``) from ``lo + 1`` (a cap is probed first) and the rest go
    evenly over the remainder of the gap: the first round brackets the threshold closely
    and the second usually ends the search.
    """
    gap = hi - lo
    if gap - 1 <= PROBES_PER_ROUND:
        return list(range(lo + 1, hi))
    step = max(1, min(lo >> NEAR_SHIFT, gap >> NEAR_GAP_SHIFT))
    start, far = lo + NEAR_PROBES * step, PROBES_PER_ROUND - NEAR_PROBES
    return ([lo + 1 + i * step for i in range(NEAR_PROBES)]
            + [start + (i + 1) * (hi - start) // (far + 1) for i in range(far)])


def auto_tolerance(lo: int) -> int:
    """Default search tolerance of a domain whose lower bound is ``lo``: the near-probe
    spacing ``lo >> NEAR_SHIFT``."""
    return max(0, lo >> NEAR_SHIFT)


class DomainOracle:
    """The greedy feasibility oracle of one domain (local rank ids ``0..D-1``)."""

    def __init__(self, expert_load, layout: ExpertLayout, min_replica_tokens: int, fit_first: bool = True):
        D, M = layout.domain_size, layout.experts_per_rank
        self.expert_load = [int(v) for v in expert_load]  # D*M experts of the domain
        self.rank_load = [sum(self.expert_load[r * M:(r + 1) * M]) for r in range(D)]
        self.rank_order = sorted(range(D), key=lambda r: (-self.rank_load[r], r))
        self.expert_order = [sorted(range(r * M, (r + 1) * M), key=lambda e: (-self.expert_load[e], e))
                             for r in range(D)]
        self.slots = layout.redundant_slots
        self.max_replicas = layout.max_instances - 1
        self.step = max(min_replica_tokens, 1)  # a replica must serve at least this much
        self.passes = (True, False) if fit_first else (False,)  # is the pass the single-replica one

    def run(self, tau: int):
        """``(feasible, moves)``; ``moves`` lists ``(local expert, local rank, tokens)``
        in creation order."""
        load = list(self.rank_load)
        free = [self.slots] * len(load)
        moves = []
        for single in self.passes:
            for r in self.rank_order:
                if self.rank_load[r] <= tau:
                    break  # ranks come in descending initial load; overloaded ranks never receive
                if load[r] <= tau:
                    continue  # relieved in pass 1
                for e in self.expert_order[r][:1] if single else self.expert_order[r]:
                    if load[r] <= tau:
                        break
                    remaining = self.expert_load[e]
                    if single and min(max(load[r] - tau, self.step), remaining) < load[r] - tau:
                        break  # one replica of the hottest expert cannot take the whole excess
                    hosts = [r]
                    while load[r] > tau and len(hosts) <= self.max_replicas and remaining >= self.step:
                        need = min(max(load[r] - tau, self.step), remaining)
                        target = self.pick_target(tau, need, load, free, hosts, spill=not single)
                        if target < 0:
                            break
                        slack = tau - load[target]
                        # A target that could take no further replica (leftover below q_min, or
                        # its last slot) is filled instead: the slack gathers on the source
                        # rank, where it stays usable.
                        amount = need if slack - need >= self.step and free[target] > 1 else min(slack, remaining)
                        load[r] -= amount
                        load[target] += amount
                        free[target] -= 1
                        remaining -= amount
                        hosts.append(target)
                        moves.append((e, target, amount))
                if not single and load[r] > tau:
                    return False, moves
        return True, moves

    def pick_target(self, tau, need, load, free, hosts, spill=True) -> int:
        """Best fit: the eligible rank with the least slack that still takes ``need``,
        else (with ``spill``) the one with the most slack; ties to the lowest index;
        ``-1`` if none."""
        fit, fit_slack, most, most_slack = -1, None, -1, self.step - 1
        for t, t_load in enumerate(load):
            slack = tau - t_load
            if not free[t] or slack < self.step or t in hosts:
                continue
            if slack >= need and (fit < 0 or slack < fit_slack):
                fit, fit_slack = t, slack
            if slack > most_slack:
                most, most_slack = t, slack
        return fit if fit >= 0 or not spill else most

    def search(self, tau_tolerance: int | None, cap_ppm: int = 0) -> int:
        """The threshold the search settles on (see the module docstring)."""
        lo = search_floor(sum(self.rank_load), len(self.rank_load), cap_ppm)
        hi = max(self.rank_load)
        tolerance = auto_tolerance(lo) if tau_tolerance is None else tau_tolerance
        while hi - lo > tolerance + 1:
            probes = probe_points(lo, hi)
            below = lo
            for tau in probes:
                if self.run(tau)[0]:
                    hi = tau
                    break
                below = tau
            lo = below
        return hi


def place_replicas(loads, layout: ExpertLayout, min_replica_tokens: int, tau_tolerance: int | None = None,
                   cap_ppm: int = 0, fit_first: bool = True):
    """``(log_to_phys int32[E, K], quota int32[E, K])`` from the per-domain greedy plan."""
    E, K, D, M = layout.num_experts, layout.max_instances, layout.domain_size, layout.experts_per_rank
    expert_load = loads.sum(axis=0, dtype=np.int64)
    log_to_phys = np.full((E, K), -1, dtype=np.int32)
    quota = np.zeros((E, K), dtype=np.int32)
    for e in range(E):
        log_to_phys[e, 0] = layout.master_slot(e)
    quota[:, 0] = expert_load
    count = np.ones(E, dtype=np.int64)
    for domain in range(layout.num_domains):
        first_rank, first_expert = domain * D, domain * D * M
        oracle = DomainOracle(expert_load[first_expert:first_expert + D * M], layout, min_replica_tokens, fit_first)
        _, moves = oracle.run(oracle.search(tau_tolerance, cap_ppm))
        used = [0] * D
        for local_expert, local_rank, amount in moves:
            e = first_expert + local_expert
            log_to_phys[e, count[e]] = layout.physical_slot(first_rank + local_rank, M + used[local_rank])
            quota[e, count[e]] = amount
            quota[e, 0] -= amount
            used[local_rank] += 1
            count[e] += 1
    return log_to_phys, quota


def locality_split(loads, layout: ExpertLayout, log_to_phys, quota):
    """``split[R, E, K]``: the tokens each source sends to each instance.

    Per expert: an instance first serves its own host rank's tokens (up to its quota).
    The remaining demand ``d[s]`` goes over the remaining quota ``c[i]`` proportionally,
    ``floor(d[s] * c[i] / T)``; the few tokens this rounds away (under one per instance
    per source) are matched in source order against the instances' shortfalls in
    instance order (north-west corner), which keeps every row and column sum exact.
    """
    R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
    split = np.zeros((R, E, K), dtype=np.int64)
    split[:, :, 0] = loads
    count = (log_to_phys >= 0).sum(axis=1)
    for e in np.flatnonzero(count > 1):
        n = int(count[e])
        hosts = log_to_phys[e, :n] // layout.slots_per_rank
        q = quota[e, :n].astype(np.int64)
        demand = loads[:, e].astype(np.int64)
        local = np.minimum(demand[hosts], q)
        demand[hosts] -= local
        capacity = q - local
        total = int(capacity.sum())
        share = np.zeros((R, n), dtype=np.int64)
        if total:
            share = demand[:, None] * capacity[None, :] // total
        share += _north_west(demand - share.sum(axis=1), capacity - share.sum(axis=0))
        share[hosts, np.arange(n)] += local
        split[:, e, :n] = share
    return split


def _north_west(rows, cols):
    """Transport plan of integer row sums ``rows`` and column sums ``cols`` (equal totals)
    laid out in index order: entry = overlap of the row's and the column's intervals."""
    row_end, col_end = np.cumsum(rows), np.cumsum(cols)
    row_start, col_start = row_end - rows, col_end - cols
    overlap = np.minimum(row_end[:, None], col_end[None, :]) - np.maximum(row_start[:, None], col_start[None, :])
    return np.maximum(overlap, 0)
