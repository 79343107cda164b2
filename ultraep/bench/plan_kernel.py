"""``python -m ultraep.bench plan-kernel``: the GPU planner and reroute kernels on the
anchor cases (EP64, NVLink domain 64, top-8, 8192 tokens per rank, S=2, min 1024 tokens
per replica, Zipf loads tuned to an initial rank imbalance), side by side with the public
UltraEP v1.0.0 numbers measured on one H200 (``ANCHOR`` below, its ``anchor_*`` columns).

Kernel times (``plan_ms``, ``reroute_ms``) are medians over ``--repeats`` replays of a
captured CUDA graph after a warm-up, timed on the device alone
(:func:`~ultraep.bench.timing.held_event_ms`); ``*_launch_ms`` time the same calls
launched from Python (host launch gaps included). The planner is one kernel
(``plan_domains``: placement, quotas and split); ``exact_plan_ms`` times it searching to
the oracle's exact threshold (``tau_tolerance=0``) instead of the default tolerance.
``cap_*`` columns plan with ``target_imbalance=--cap`` (default 1.005): the search starts
at that max/mean and settles there when the oracle reaches it, with fewer replicas than
the tightest plan (UltraEP's plans sit at 1.010). With ``--replica-bound`` the CPU also
proves the fewest replicas any plan needs to reach the capped plan's max rank load
(``min_replicas_bound``, a MILP per domain: seconds per row): ``cap_slots_bound``.
The oracle's pass 1 (``fit_first``, fewer replicas for a longer kernel) is on by default
with a cap only: ``fit_first_*`` plan the tightest search with it, ``cap_one_pass_*``
plan at the cap without it.
The NumPy planner time is the wall-clock median of a few runs. Without a GPU only the
NumPy columns are filled.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from ultraep.bench.report import RowStream, write_json
from ultraep.bench.timing import graph_ms, median_event_ms
from ultraep.runtime.group import gpu_count
from ultraep.runtime.launch import DefaultsHelpFormatter, imbalance_target, non_negative_int, positive_int
from ultraep.planner import ExpertLayout, plan_placement, reroute
from ultraep.analysis.bound import min_replicas_bound
from ultraep.analysis.traces import zipf_loads, zipf_topk

RANKS, TOP_K, TOKENS_PER_RANK, SLOTS, MIN_REPLICA_TOKENS = 64, 8, 8192, 2, 1024

# Public UltraEP v1.0.0 on one H200, per (experts, initial imbalance): after, planning ms,
# reroute ms, slots used of 128, max replicas of one expert.
ANCHOR = {
    (128, 1.5): (1.010, 0.053, 0.021, 41, 4),
    (128, 2.0): (1.010, 0.056, 0.021, 45, 5),
    (128, 3.0): (1.010, 0.058, 0.021, 48, 6),
    (256, 1.5): (1.010, 0.054, 0.037, 39, 4),
    (256, 2.0): (1.010, 0.059, 0.037, 45, 5),
    (256, 3.0): (1.010, 0.063, 0.037, 51, 6),
}

COLUMNS = ["experts", "initial", "seed", "before", "after", "plan_ms", "reroute_ms", "plan_launch_ms",
           "reroute_launch_ms", "exact_plan_ms", "slots", "max_replicas", "cap_after", "cap_plan_ms", "cap_slots",
           "cap_max_replicas", "cap_slots_bound", "fit_first_plan_ms", "fit_first_slots", "cap_one_pass_plan_ms",
           "cap_one_pass_slots", "remote_pct", "numpy_ms", "anchor_after", "anchor_plan_ms", "anchor_reroute_ms",
           "anchor_slots", "anchor_max_replicas"]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench plan-kernel",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--experts", type=positive_int, nargs="+", default=[128, 256],
                        help="logical experts, one row each")
    parser.add_argument("--initial-imbalance", type=imbalance_target, nargs="+", default=[1.5, 2.0, 3.0],
                        help="rank max/mean of the Zipf loads before balancing, one row each")
    parser.add_argument("--seeds", type=non_negative_int, nargs="+", default=[0], help="one row per seed")
    parser.add_argument("--repeats", type=positive_int, default=200, help="timed kernel runs (median reported)")
    parser.add_argument("--cap", type=float, default=1.005, help="target_imbalance of the cap_* columns")
    parser.add_argument("--replica-bound", action="store_true",
                        help="prove the fewest replicas that reach the capped plan's max rank load (CPU MILP)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return parser.parse_args(argv)


def gpu_times(loads, topk, layout, repeats, cap):
    """Plan and reroute (rank 0's tokens) times: graph replay and plain launches, ms."""
    import cupy
    from ultraep.planner.device import empty_plan

    plan = empty_plan(layout)
    plan.loads[...] = cupy.asarray(loads)

    def plan_once(**options):
        plan_placement(plan.loads, layout, min_replica_tokens=MIN_REPLICA_TOKENS, backend="device", out=plan, **options)

    ids = cupy.asarray(topk[0])
    slots = cupy.empty(ids.shape, np.int32)

    def reroute_once():
        reroute(ids, plan, 0, out=slots)

    return dict(plan_ms=graph_ms(plan_once, repeats), plan_launch_ms=median_event_ms(plan_once, repeats),
                exact_plan_ms=graph_ms(lambda: plan_once(tau_tolerance=0), repeats),
                cap_plan_ms=graph_ms(lambda: plan_once(target_imbalance=cap), repeats),
                fit_first_plan_ms=graph_ms(lambda: plan_once(fit_first=True), repeats),
                cap_one_pass_plan_ms=graph_ms(lambda: plan_once(target_imbalance=cap, fit_first=False), repeats),
                reroute_ms=graph_ms(reroute_once, repeats), reroute_launch_ms=median_event_ms(reroute_once, repeats))


def run_case(experts, initial, seed, repeats, use_gpu, cap, replica_bound):
    layout = ExpertLayout(RANKS, experts, SLOTS)
    loads = zipf_loads(RANKS, experts, TOP_K, TOKENS_PER_RANK, initial, seed)
    numpy_times = []
    for _ in range(3):
        started = time.perf_counter()
        plan = plan_placement(loads, layout, min_replica_tokens=MIN_REPLICA_TOKENS)
        numpy_times.append((time.perf_counter() - started) * 1e3)
    row = dict(experts=experts, initial=initial, seed=seed, before=plan.imbalance_before, after=plan.imbalance_after,
               slots=plan.slots_used, max_replicas=plan.max_fanout, remote_pct=100.0 * plan.remote_fraction(),
               numpy_ms=statistics.median(numpy_times))
    capped = plan_placement(loads, layout, min_replica_tokens=MIN_REPLICA_TOKENS, target_imbalance=cap)
    row.update(cap_after=capped.imbalance_after, cap_slots=capped.slots_used, cap_max_replicas=capped.max_fanout)
    for prefix, options in (("fit_first_", {"fit_first": True}), ("cap_one_pass_", {"target_imbalance": cap,
                                                                                     "fit_first": False})):
        row[prefix + "slots"] = plan_placement(loads, layout, min_replica_tokens=MIN_REPLICA_TOKENS,
                                               **options).slots_used
    if replica_bound:
        bound = min_replicas_bound(loads, layout, int(capped.rank_load.max()), min_replica_tokens=MIN_REPLICA_TOKENS)
        row["cap_slots_bound"] = bound.value if bound.status == "optimal" else f"{bound.value} ({bound.status})"
    if use_gpu:
        topk = zipf_topk(RANKS, experts, TOP_K, TOKENS_PER_RANK, initial, seed)
        row.update(gpu_times(loads, topk, layout, repeats, cap))
    anchor = ANCHOR.get((experts, initial))
    if anchor:
        keys = ("anchor_after", "anchor_plan_ms", "anchor_reroute_ms", "anchor_slots", "anchor_max_replicas")
        row.update(zip(keys, anchor))
    return row


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    use_gpu = gpu_count() > 0
    title = (f"Planner kernels: EP{RANKS}, top-{TOP_K}, {TOKENS_PER_RANK} tokens/rank, S={SLOTS}, "
             f"min {MIN_REPLICA_TOKENS} tokens/replica" + ("" if use_gpu else " (no GPU: NumPy only)"))
    rows = []
    with RowStream(COLUMNS, title) as table:
        for e in args.experts:
            for initial in args.initial_imbalance:
                for seed in args.seeds:
                    rows.append(run_case(e, initial, seed, args.repeats, use_gpu, args.cap, args.replica_bound))
                    table.add(rows[-1])
    if args.json:
        write_json(args.json, {"benchmark": "plan-kernel", "rows": rows})
    return 0
