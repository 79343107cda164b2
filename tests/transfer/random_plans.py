"""Random plans that keep every layout invariant, for the schedule compiler tests.

Fan-outs are skewed (a few experts with many replicas, so relay trees form) and
``fill`` sets the share of redundant slots used; ``fill=1`` packs every slot it can,
which drives the schedules towards their capacity.
"""

from __future__ import annotations

import numpy as np

from ultraep.planner import ExpertLayout, Plan


def random_plan(layout: ExpertLayout, rng: np.random.Generator, fill: float = 0.7) -> Plan:
    R, E, K, D = layout.num_ranks, layout.num_experts, layout.max_instances, layout.domain_size
    M, P = layout.experts_per_rank, layout.slots_per_rank
    log_to_phys = np.full((E, K), -1, np.int32)
    log_to_phys[:, 0] = [layout.master_slot(e) for e in range(E)]
    free = {r: list(rng.permutation(np.arange(M, P))) for r in range(R)}
    budget = int(fill * R * layout.redundant_slots)
    for e in rng.permutation(E).tolist():
        if budget <= 0:
            break
        master = layout.master_rank(e)
        domain = range(master // D * D, master // D * D + D)
        candidates = [r for r in rng.permutation(list(domain)).tolist() if r != master and free[r]]
        fanout = min(len(candidates), K - 1, budget, int(rng.zipf(1.6)) if fill < 1 else K - 1)
        for i, r in enumerate(candidates[:fanout]):
            log_to_phys[e, i + 1] = r * P + int(free[r].pop())
        budget -= fanout
    loads = rng.integers(0, 50, size=(R, E)).astype(np.int32)
    count = (log_to_phys >= 0).sum(axis=1)
    split = np.zeros((R, E, K), np.int64)
    for e in range(E):
        split[:, e, : count[e]] = loads[:, e, None] // count[e]
        split[:, e, 0] += loads[:, e] - split[:, e, : count[e]].sum(axis=1)
    return Plan.from_split(layout, loads, log_to_phys, split)
