"""``python -m ultraep.bench plan``: replay a load trace through every balancing policy.

Policies, each on every (step, layer) of the trace:

* ``none``    -- no balancing (every token to its master);
* ``ultraep`` -- the quota planner (``plan_placement``, NumPy or CuPy backend);
* ``eplb``    -- EPLB from a window of past loads of the same layer, even split;
* ``ideal``   -- the force-balanced ideal (a router that spreads tokens evenly).

For each cell a proven lower bound of the optimal max rank load (``analysis.bound``) is
computed once and every policy's max rank load is reported as a gap to it. The bound is
the cell's ``exact`` optimum where that is cheap to prove, else the MILP's or the LP
relaxation's bound, or the ``trivial`` one (perfect balance, the heaviest expert over its
most instances): by default (``--bound auto``) the MILP runs with ``--bound-time-limit``
seconds per cell until the run has spent ``--bound-budget`` seconds on bounds, then the
LP (milliseconds a cell) takes over; ``--bound trivial`` costs nothing. Each cell's kind is
printed as it is measured, counted under the tables and named in the figure. The
summary table gives, per policy, the max/mean rank imbalance after balancing (mean and
max over cells), redundant slots used, largest replica fan-out, the share of tokens
served off their source rank, the gap to the bound and the solve time (wall clock of
the policy's call, plan construction and checks included).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ultraep.analysis.baselines import EPLB, ideal_rank_load, ideal_remote_fraction, no_balancing, replicas_below
from ultraep.analysis.bound import DEFAULT_MAX_BINARIES, lower_bound
from ultraep.analysis.plots import plot_replay
from ultraep.analysis.traces import GENERATORS
from ultraep.bench.report import RowStream, print_table, write_json
from ultraep.integration.traces import load_trace
from ultraep.planner import ExpertLayout, plan_placement
from ultraep.planner.plan import imbalance
from ultraep.runtime.launch import DefaultsHelpFormatter, bounded_type, non_negative_int, positive_int, refused

POLICIES = ("none", "ultraep", "eplb", "ideal")
BOUNDED = ("none", "ultraep", "eplb")  # policies that obey the planner's constraints
TIMED = ("ultraep", "eplb")
BOUND_KINDS = ("exact", "milp", "lp", "trivial")
# One NVLink domain of 16 ranks, as in the paper's solver test (EP64 in one domain), scaled
# down so that the whole demo, bounds included, takes seconds on two cores.
DEMO = dict(generate="demo", ranks=16, experts=64, slots=2, domain=16, top_k=8, tokens_per_rank=2048,
            steps=12, layers=3, seed=0, min_replica_tokens=512, bound_budget=6.0)


seconds = bounded_type(float, lambda value: 0.0 <= value < float("inf"), "seconds >= 0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ultraep.bench plan", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", help="replay this .npz trace (see ultraep.integration.traces)")
    source.add_argument("--generate", choices=sorted(GENERATORS), help="generate a synthetic trace")
    source.add_argument("--demo", action="store_true",
                        help="built-in non-stationary trace on the CPU, sized to run in seconds")
    p.add_argument("--ranks", type=positive_int, default=16, help="EP ranks R (generated traces)")
    p.add_argument("--experts", type=positive_int, default=64, help="logical experts E (generated traces)")
    p.add_argument("--slots", type=non_negative_int, default=2, help="redundant slots per rank S")
    p.add_argument("--domain", type=positive_int, default=None, help="NVLink domain size D (default: all ranks)")
    p.add_argument("--top-k", type=positive_int, default=8, help="experts per token (generated traces)")
    p.add_argument("--tokens-per-rank", type=positive_int, default=2048,
                   help="tokens per rank and micro-batch (generated)")
    p.add_argument("--steps", type=positive_int, default=16, help="micro-batches (generated traces)")
    p.add_argument("--layers", type=positive_int, default=2, help="MoE layers (generated traces)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the generated trace")
    p.add_argument("--initial-imbalance", type=float, default=2.0,
                   help="--generate zipf: rank max/mean of every cell before balancing")
    p.add_argument("--min-replica-tokens", type=non_negative_int, default=1024,
                   help="fewest tokens a replica may serve (the planner's min_replica_tokens)")
    p.add_argument("--backend", choices=("host", "device"), default="host", help="backend of the ultraep policy")
    p.add_argument("--eplb-window", type=positive_int, default=10, help="past micro-batches EPLB places from")
    p.add_argument("--eplb-interval", type=positive_int, default=1, help="micro-batches between EPLB re-placements")
    p.add_argument("--bound", choices=("auto", "milp", "lp", "trivial"), default="auto",
                   help="lower bound each gap is measured to. auto: the MILP (exact where cheap) until "
                        "--bound-budget is spent, then the LP; milp / lp: that solver on every cell; trivial: "
                        "perfect balance or the heaviest expert over its most instances, no solver, no cost")
    p.add_argument("--bound-time-limit", type=seconds, default=2.0, help="seconds per cell for the MILP or LP")
    p.add_argument("--bound-budget", type=seconds, default=10.0,
                   help="--bound auto: seconds of MILP in the whole run; later cells get the LP bound")
    p.add_argument("--bound-max-binaries", type=non_negative_int, default=DEFAULT_MAX_BINARIES,
                   help="largest MILP (replica variables) that --bound auto still tries; larger layouts get the LP")
    p.add_argument("--json", metavar="FILE", help="write the results to this JSON file")
    p.add_argument("--plot", metavar="PNG", help="draw per-rank loads before/after and imbalance over steps")
    p.add_argument("--quiet", action="store_true", help="no per-cell lines on stderr")
    return p


def make_trace(args):
    if args.trace:
        return load_trace(args.trace)
    kwargs = dict(steps=args.steps, layers=args.layers, num_ranks=args.ranks, num_experts=args.experts,
                  top_k=args.top_k, tokens_per_rank=args.tokens_per_rank, seed=args.seed)
    if args.generate == "zipf":
        kwargs["initial_imbalance"] = args.initial_imbalance
    return GENERATORS[args.generate or "demo"](**kwargs)


def _synchronize(backend: str) -> None:
    if backend == "device":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


CELL_COLUMNS = ["cell", "step", "layer", "before", "none", "ultraep", "eplb", "ultraep gap", "bound", "bound ms",
                "elapsed s"]


def bound_kind(bound) -> str:
    """How a cell's bound was obtained: ``exact`` (a feasible plan reaches it), else its method."""
    return "exact" if bound.exact else bound.method


def replay(loads: np.ndarray, layout: ExpertLayout, *, min_replica_tokens: int, backend: str = "host",
           eplb_window: int = 10, eplb_interval: int = 1, bound_method: str = "auto",
           bound_time_limit: float = 2.0, bound_budget: float = 10.0,
           bound_max_binaries: int = DEFAULT_MAX_BINARIES, quiet: bool = True) -> dict:
    """Run every policy on ``loads[steps, layers, R, E]``; per-cell arrays keyed by metric and policy.

    Unless ``quiet``, each cell is printed to stderr as a table row when it is done.
    ``bound_method="auto"`` spends at most about ``bound_budget`` seconds on MILP bounds in
    all (each cell's solve capped at ``bound_time_limit``), then uses the LP bound.
    """
    steps, layers = loads.shape[:2]
    shape = (steps, layers)
    cell = {metric: {p: np.zeros(shape) for p in POLICIES}
            for metric in ("imbalance", "max_load", "slots", "fanout", "remote", "time_s", "gap")}
    rank_load = {p: np.zeros((steps, layers, layout.num_ranks), dtype=np.int64) for p in POLICIES}
    before = np.zeros(shape)
    bound_value = np.zeros(shape, dtype=np.int64)
    bound_methods = np.empty(shape, dtype=object)
    bound_kinds = np.empty(shape, dtype=object)
    bound_exact = np.zeros(shape, dtype=bool)
    bound_time = np.zeros(shape)
    eplb_below_min = np.zeros(shape, dtype=np.int64)
    invalid_ultraep = []
    eplb = [EPLB(layout, window=eplb_window, rebalance_every=eplb_interval) for _ in range(layers)]
    if backend == "device":  # compile and load the kernel outside the timed region
        plan_placement(loads[0, 0], layout, min_replica_tokens=min_replica_tokens, backend=backend)
        _synchronize(backend)
    start = time.perf_counter()
    cells = RowStream(CELL_COLUMNS, "cells as they are replayed (imbalance: rank max/mean; bound: how the "
                      "lower bound was obtained)", file=sys.stderr, enabled=not quiet)
    for s in range(steps):
        for l in range(layers):
            current = loads[s, l]
            plans, times = {"none": no_balancing(current, layout)}, {"none": np.nan}
            t0 = time.perf_counter()
            plan = plan_placement(current, layout, min_replica_tokens=min_replica_tokens, backend=backend)
            _synchronize(backend)
            times["ultraep"] = time.perf_counter() - t0
            plans["ultraep"] = plan.to_numpy()
            t0 = time.perf_counter()
            plans["eplb"] = eplb[l].plan(current, observe=False)
            times["eplb"] = time.perf_counter() - t0
            eplb[l].observe(current)
            eplb_below_min[s, l] = replicas_below(plans["eplb"], min_replica_tokens)
            try:
                plans["ultraep"].validate(min_replica_tokens)
                feasible = int(plans["ultraep"].rank_load.max())
            except AssertionError as exc:  # reported, never trusted for the bound's exactness
                invalid_ultraep.append({"step": s, "layer": l, "error": str(exc)})
                feasible = None
            method = bound_method
            if method == "auto" and bound_time[bound_methods == "milp"].sum() >= bound_budget:
                method = "lp"
            bound = lower_bound(current, layout, min_replica_tokens=min_replica_tokens, method=method,
                                time_limit=bound_time_limit, max_binaries=bound_max_binaries,
                                feasible_max=feasible)
            bound_value[s, l], bound_methods[s, l], bound_kinds[s, l] = bound.value, bound.method, bound_kind(bound)
            bound_exact[s, l], bound_time[s, l] = bound.exact, bound.solve_time_s
            before[s, l] = plans["none"].imbalance_after
            for name, plan in plans.items():
                rank_load[name][s, l] = plan.rank_load
                cell["imbalance"][name][s, l] = plan.imbalance_after
                cell["max_load"][name][s, l] = int(plan.rank_load.max())
                cell["slots"][name][s, l] = plan.slots_used
                cell["fanout"][name][s, l] = plan.max_fanout
                cell["remote"][name][s, l] = plan.remote_fraction()
                cell["time_s"][name][s, l] = times[name]
                cell["gap"][name][s, l] = bound.gap(int(plan.rank_load.max()))
            ideal = ideal_rank_load(current, layout)
            rank_load["ideal"][s, l] = ideal
            cell["imbalance"]["ideal"][s, l] = imbalance(ideal)
            cell["max_load"]["ideal"][s, l] = int(ideal.max())
            cell["remote"]["ideal"][s, l] = ideal_remote_fraction(layout)
            cell["time_s"]["ideal"][s, l] = np.nan
            cell["gap"]["ideal"][s, l] = np.nan
            cells.add({"cell": f"{s * layers + l + 1}/{steps * layers}", "step": s, "layer": l,
                       "before": before[s, l], **{p: cell["imbalance"][p][s, l] for p in ("none", "ultraep", "eplb")},
                       "ultraep gap": cell["gap"]["ultraep"][s, l], "bound": bound_kinds[s, l],
                       "bound ms": 1e3 * bound_time[s, l], "elapsed s": time.perf_counter() - start})
    cells.close()
    return dict(cell=cell, rank_load=rank_load, before=before, bound_value=bound_value,
                bound_method=bound_methods, bound_kind=bound_kinds, bound_exact=bound_exact, bound_time=bound_time,
                eplb_below_min=eplb_below_min, invalid_ultraep=invalid_ultraep)


def summarize(result: dict) -> list[dict]:
    cell = result["cell"]
    rows = []
    for name in POLICIES:
        bounded = name in BOUNDED
        row = {
            "policy": name,
            "imb mean": float(cell["imbalance"][name].mean()),
            "imb max": float(cell["imbalance"][name].max()),
            "slots mean": float(cell["slots"][name].mean()) if bounded else None,
            "slots max": int(cell["slots"][name].max()) if bounded else None,
            "fanout max": int(cell["fanout"][name].max()) if bounded else None,
            "remote": float(cell["remote"][name].mean()),
            "gap mean": float(cell["gap"][name].mean()) if bounded else None,
            "gap max": float(cell["gap"][name].max()) if bounded else None,
            "ms mean": float(cell["time_s"][name].mean() * 1e3) if name in TIMED else None,
            "ms max": float(cell["time_s"][name].max() * 1e3) if name in TIMED else None,
        }
        rows.append(row)
    return rows


SUMMARY_COLUMNS = ["policy", "imb mean", "imb max", "slots mean", "slots max", "fanout max", "remote",
                   "gap mean", "gap max", "ms mean", "ms max"]


def per_layer_rows(result: dict) -> list[dict]:
    cell, layers = result["cell"], result["before"].shape[1]
    rows = []
    for l in range(layers):
        row = {"layer": l, "before mean": float(result["before"][:, l].mean()),
               "before max": float(result["before"][:, l].max())}
        for name in ("ultraep", "eplb"):
            row[f"{name} mean"] = float(cell["imbalance"][name][:, l].mean())
            row[f"{name} max"] = float(cell["imbalance"][name][:, l].max())
        rows.append(row)
    return rows


def bound_summary(result: dict) -> dict:
    methods = result["bound_method"].ravel().tolist()
    kinds = result["bound_kind"].ravel().tolist()
    exact = result["bound_exact"]
    return {
        "cells": len(methods),
        "exact": int(exact.sum()),
        "kinds": {k: kinds.count(k) for k in BOUND_KINDS},
        "methods": {m: methods.count(m) for m in ("milp", "lp", "trivial")},
        "exact_by_method": {m: int(sum(e for e, mm in zip(exact.ravel(), methods) if mm == m))
                            for m in ("milp", "lp", "trivial")},
        "time_s_total": float(result["bound_time"].sum()),
        "time_s_mean": float(result["bound_time"].mean()),
        "time_s_max": float(result["bound_time"].max()),
    }


def bound_counts(bounds: dict) -> str:
    """``"3 exact, 29 lp"``: the cells of each bound kind."""
    return ", ".join(f"{n} {kind}" for kind, n in bounds["kinds"].items() if n)


GENERATED = ("ranks", "experts", "top_k", "tokens_per_rank", "steps", "layers", "seed")  # a generated trace's


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if refused(args, "ultraep.bench plan"):
        return 2
    if args.trace:  # a trace brings its own sizes: the generators' options would be ignored without a word
        ignored = [f"--{key.replace('_', '-')}" for key in GENERATED if getattr(args, key) != parser.get_default(key)]
        if ignored:
            parser.error(f"--trace replays its own sizes; drop {', '.join(ignored)}")
    if args.demo:
        overridden = [f"--{key.replace('_', '-')}" for key in DEMO
                      if key != "generate" and getattr(args, key) != parser.get_default(key)]
        if overridden:  # the demo's sizes would replace them without a word
            parser.error(f"--demo sets its own sizes; drop {', '.join(overridden)} or use --generate demo")
        for key, value in DEMO.items():
            setattr(args, key, value)
    try:
        trace = make_trace(args)
        ranks, experts = trace.num_ranks, trace.num_experts
        layout = ExpertLayout(ranks, experts, args.slots, args.domain)
    except ValueError as exc:
        print(f"ultraep.bench plan: {exc}", file=sys.stderr)
        return 2
    source = args.trace or f"generated '{args.generate or 'demo'}' (seed {args.seed})"
    print(f"trace: {source}: {trace.num_steps} steps x {trace.num_layers} layers, {ranks} ranks, {experts} experts; "
          f"layout: {layout.redundant_slots} replica slots a rank, domains of {layout.domain_size} ranks, at most "
          f"{layout.max_instances} instances an expert; "
          f"min_replica_tokens={args.min_replica_tokens}, ultraep backend={args.backend}, "
          f"EPLB window={args.eplb_window} interval={args.eplb_interval}")
    start = time.perf_counter()
    result = replay(trace.loads, layout, min_replica_tokens=args.min_replica_tokens, backend=args.backend,
                    eplb_window=args.eplb_window, eplb_interval=args.eplb_interval, bound_method=args.bound,
                    bound_time_limit=args.bound_time_limit, bound_budget=args.bound_budget,
                    bound_max_binaries=args.bound_max_binaries, quiet=args.quiet)
    elapsed = time.perf_counter() - start
    rows = summarize(result)
    print()
    print_table(rows, SUMMARY_COLUMNS, "policies (imb: rank max/mean after balancing over all cells; "
                "remote: token share served off its source rank; gap: max load over the lower bound - 1)")
    if trace.num_layers > 1:
        print()
        print_table(per_layer_rows(result), ["layer", "before mean", "before max", "ultraep mean", "ultraep max",
                                             "eplb mean", "eplb max"], "imbalance per layer (over steps)")
    bounds = bound_summary(result)
    print()
    print(f"lower bound: exact on {bounds['exact']}/{bounds['cells']} cells ({bound_counts(bounds)}; --bound "
          f"{args.bound}), {bounds['time_s_total']:.1f} s in all, {bounds['time_s_mean'] * 1e3:.1f} ms mean per "
          f"cell. Where not exact, the gaps are upper estimates of the true distance to optimal; "
          f"--bound trivial costs nothing, --bound-budget buys more exact cells.")
    below = int(result["eplb_below_min"].sum())
    if below:
        print(f"EPLB left {below} replicas below min_replica_tokens={args.min_replica_tokens} "
              f"(it does not know that constraint; its gaps may then undercut the bound's model).")
    if result["invalid_ultraep"]:
        first = result["invalid_ultraep"][0]
        print(f"WARNING: {len(result['invalid_ultraep'])} ultraep plans broke an invariant, first at step "
              f"{first['step']} layer {first['layer']}: {first['error']}", file=sys.stderr)
    print(f"replayed {trace.num_steps * trace.num_layers} cells in {elapsed:.1f} s")
    if args.json:
        config = {k: getattr(args, k) for k in ("trace", "generate", "demo", "slots", "domain", "min_replica_tokens",
                                                "backend", "eplb_window", "eplb_interval", "bound",
                                                "bound_time_limit", "bound_budget", "seed")}
        config.update(num_ranks=ranks, num_experts=experts, max_instances=layout.max_instances,
                      steps=trace.num_steps, layers=trace.num_layers)
        per_cell = {metric: {name: values[name] for name in POLICIES} for metric, values in result["cell"].items()}
        write_json(args.json, {
            "benchmark": "plan",
            "config": config,
            "trace_metadata": trace.metadata,
            "policies": rows,
            "per_layer": per_layer_rows(result),
            "lower_bound": dict(bounds, value=result["bound_value"], method=result["bound_method"].tolist(),
                                kind=result["bound_kind"].tolist(), exact=result["bound_exact"]),
            "imbalance_before": result["before"],
            "per_cell": per_cell,
            "eplb_replicas_below_min": result["eplb_below_min"],
            "invalid_ultraep_plans": result["invalid_ultraep"],
            "elapsed_s": elapsed,
        })
        print(f"wrote {args.json}")
    if args.plot:
        plot_replay(result, args.plot, f"ultraep bench plan: {source}, R={ranks} E={experts} "
                                       f"S={layout.redundant_slots} D={layout.domain_size}")
        print(f"wrote {args.plot}")
    return 1 if result["invalid_ultraep"] else 0
