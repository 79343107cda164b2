"""Baseline balancing policies, run in the same harness as the quota planner.

* ``no_balancing`` -- every expert served by its master only.
* ``ideal_rank_load`` -- the force-balanced ideal: a router that spreads tokens evenly
  over the ranks (not a plan under our constraints; the upper limit a balancer chases).
* ``EPLB`` -- DeepSeek's Expert-Parallel Load Balancer, re-implemented from its
  published description: replicas are chosen from a window of *past* loads, and the
  current micro-batch's tokens are split evenly over an expert's replicas (round-robin,
  the "EPLB+" of the UltraEP paper).

Adaptation of EPLB to our fixed-master layout. EPLB's hierarchical algorithm packs
expert groups onto nodes, then (within a node) hands redundant experts one by one to
the expert with the largest load per replica, then packs all physical experts onto
GPUs with a balanced bin-packing (heaviest first, onto the least-loaded GPU with a free
slot). Here masters never move and each rank has only its ``S`` redundant slots, so:

1. the NVLink domain plays the node: an expert's replicas stay in its master's domain;
2. replica counts: each of the domain's ``D * S`` redundant slots goes, in turn, to the
   domain expert with the largest historical load per instance (``h_e / c_e``), up to
   ``K`` instances (ties: lowest expert id; experts without history load get none);
3. packing: masters are pre-placed (each contributes ``h_e / c_e`` to its rank); the
   replicas, heaviest per-instance load first, go to the least-loaded rank of the
   domain that has a free redundant slot and does not already host that expert. We
   enforce that anti-affinity (original EPLB may put two replicas of one expert on one
   GPU) because our layout cannot express it; a replica with no eligible rank left is
   dropped.

EPLB fills every redundant slot it can and knows nothing of ``min_replica_tokens``, so
its replicas may serve fewer tokens than the quota planner's minimum (see
``replicas_below``); its plans obey every layout constraint.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan, check_loads


def master_only_placement(layout: ExpertLayout) -> np.ndarray:
    """``log_to_phys[E, K]`` with only the masters (column 0)."""
    log_to_phys = np.full((layout.num_experts, layout.max_instances), -1, dtype=np.int32)
    log_to_phys[:, 0] = [layout.master_slot(e) for e in range(layout.num_experts)]
    return log_to_phys


def no_balancing(loads, layout: ExpertLayout) -> Plan:
    """Every token goes to its expert's master."""
    loads = check_loads(loads, layout)
    split = np.zeros((layout.num_ranks, layout.num_experts, layout.max_instances), dtype=np.int32)
    split[:, :, 0] = loads
    return Plan.from_split(layout, loads, master_only_placement(layout), split)


def ideal_rank_load(loads, layout: ExpertLayout) -> np.ndarray:
    """Force-balanced ideal ``int64[R]``: the total spread as evenly as integers allow.

    Models a router that sends tokens uniformly over experts; such a router also makes
    a ``(R - 1) / R`` share of the tokens remote (``ideal_remote_fraction``).
    """
    loads = check_loads(loads, layout)
    total, ranks = int(loads.sum(dtype=np.int64)), layout.num_ranks
    return total // ranks + (np.arange(ranks) < total % ranks).astype(np.int64)


def ideal_remote_fraction(layout: ExpertLayout) -> float:
    return (layout.num_ranks - 1) / layout.num_ranks


def replicas_below(plan: Plan, min_replica_tokens: int) -> int:
    """Number of replicas (master excluded) serving fewer than ``min_replica_tokens`` tokens."""
    plan = plan.to_numpy()
    column = np.arange(plan.layout.max_instances)[None, :]
    is_replica = (column >= 1) & (column < plan.replica_count[:, None])
    return int((plan.quota[is_replica] < min_replica_tokens).sum())


def even_split(loads, layout: ExpertLayout, log_to_phys) -> np.ndarray:
    """``split[R, E, K]``: each expert's tokens dealt round-robin over its instances.

    The ``g``-th token of expert ``e`` (sources in rank order, then token order) goes to
    instance ``g mod c_e``, so instance quotas differ by at most one token.
    """
    loads = np.asarray(loads, dtype=np.int64)
    count = (np.asarray(log_to_phys) >= 0).sum(axis=1).astype(np.int64)  # [E]
    ends = np.cumsum(loads, axis=0)  # [R, E]
    starts = ends - loads
    instance = np.arange(layout.max_instances, dtype=np.int64)[None, None, :]
    c = count[None, :, None]

    def dealt_before(x):  # how many of the ordinals 0 .. x-1 are congruent to each instance
        return np.maximum(0, (x[:, :, None] - instance + c - 1) // c)

    split = np.where(instance < c, dealt_before(ends) - dealt_before(starts), 0)
    return split.astype(np.int32)


def eplb_placement(history_load, layout: ExpertLayout) -> np.ndarray:
    """EPLB replica placement ``log_to_phys[E, K]`` from per-expert historical loads ``[E]``."""
    history = np.asarray(history_load, dtype=np.int64)
    if history.shape != (layout.num_experts,):
        raise ValueError(f"history_load must have shape ({layout.num_experts},), got {history.shape}")
    M, S, D, K = layout.experts_per_rank, layout.redundant_slots, layout.domain_size, layout.max_instances
    log_to_phys = master_only_placement(layout)
    if S == 0 or K == 1:
        return log_to_phys
    experts_per_domain = D * M
    for domain in range(layout.num_domains):
        first = domain * experts_per_domain
        h = history[first : first + experts_per_domain]
        count = np.ones(experts_per_domain, dtype=np.int64)
        for _ in range(D * S):
            per_instance = np.where((count < K) & (h > 0), h / count, -1.0)
            best = int(np.argmax(per_instance))  # ties: lowest expert id
            if per_instance[best] < 0:
                break
            count[best] += 1
        per_instance = h / count
        ranks = np.arange(domain * D, (domain + 1) * D)
        expected = per_instance.reshape(D, M).sum(axis=1)  # masters pre-placed
        free = np.full(D, S, dtype=np.int64)
        hosts = [{i // M} for i in range(experts_per_domain)]  # local rank indices
        filled = np.ones(experts_per_domain, dtype=np.int64)
        replicas = [i for i in range(experts_per_domain) for _ in range(count[i] - 1)]
        replicas.sort(key=lambda i: (-per_instance[i], i))
        for i in replicas:
            eligible = [j for j in range(D) if free[j] > 0 and j not in hosts[i]]
            if not eligible:
                continue
            target = min(eligible, key=lambda j: (expected[j], j))
            slot = layout.physical_slot(int(ranks[target]), M + S - int(free[target]))
            log_to_phys[first + i, filled[i]] = slot
            filled[i] += 1
            free[target] -= 1
            hosts[i].add(target)
            expected[target] += per_instance[i]
    return log_to_phys


class EPLB:
    """History-based EPLB policy for one MoE layer.

    ``plan(loads)`` places replicas from the sum of the last ``window`` observed load
    matrices (re-placing every ``rebalance_every`` calls, on the history available
    then), splits ``loads`` evenly over them, then records ``loads`` in the history. The
    first call has no history and so no replicas.
    """

    def __init__(self, layout: ExpertLayout, *, window: int = 10, rebalance_every: int = 1):
        if window < 1 or rebalance_every < 1:
            raise ValueError(f"window and rebalance_every must be >= 1, got {window}, {rebalance_every}")
        self.layout = layout
        self.window = window
        self.rebalance_every = rebalance_every
        self._history: deque[np.ndarray] = deque(maxlen=window)
        self._calls = 0
        self._placement = master_only_placement(layout)

    @property
    def placement(self) -> np.ndarray:
        return self._placement

    def plan(self, loads, *, observe: bool = True) -> Plan:
        loads = check_loads(loads, self.layout)
        if self._calls % self.rebalance_every == 0 and self._history:
            self._placement = eplb_placement(np.sum(self._history, axis=0), self.layout)
        self._calls += 1
        plan = Plan.from_split(self.layout, loads, self._placement,
                               even_split(loads, self.layout, self._placement))
        if observe:
            self.observe(loads)
        return plan

    def observe(self, loads) -> None:
        self._history.append(np.asarray(loads, dtype=np.int64).sum(axis=0))


__all__ = ["no_balancing", "ideal_rank_load", "ideal_remote_fraction", "replicas_below", "even_split",
           "eplb_placement", "master_only_placement", "EPLB"]
