"""Plan one micro-batch of a skewed load on 64 ranks and reroute every rank's tokens (one
process, no MPI needed).

    .venv/bin/python examples/planner_step.py

The code below this docstring is the README's "Control plane" snippet, character for character.
"""
import numpy as np
from ultraep import ExpertLayout, plan_placement, reroute

R, E, T, K = 64, 256, 1024, 8                       # ranks, experts, tokens per rank, top-k
layout = ExpertLayout(num_ranks=R, num_experts=E, redundant_slots=2)   # domain_size defaults to all ranks
rng = np.random.default_rng(0)
popularity = np.log(1.0 / np.arange(1, E + 1))      # expert 0 is the hottest: rank 0 is overloaded
topk_ids = [np.argsort(rng.gumbel(size=(T, E)) + popularity, axis=1)[:, -K:] for _ in range(R)]  # one per rank
loads = np.stack([np.bincount(ids.ravel(), minlength=E) for ids in topk_ids]).astype(np.int32)  # int32[R, E]
plan = plan_placement(loads, layout, min_replica_tokens=1024)   # CuPy loads: one kernel launch on the GPU
print(f"busiest rank / mean: {plan.imbalance_before:.3f} -> {plan.imbalance_after:.3f}, "
      f"{int((plan.replica_count - 1).sum())} replicas")
# also: plan.phys_to_log, plan.log_to_phys, plan.quota, plan.split_prefix, plan.rank_load
physical_ids = [reroute(ids, plan, rank) for rank, ids in enumerate(topk_ids)]  # logical -> physical slot ids
rows = np.bincount(np.concatenate(physical_ids).ravel(), minlength=layout.num_physical)
assert np.array_equal(rows.reshape(R, -1).sum(axis=1), plan.rank_load)        # each rank gets its planned load
