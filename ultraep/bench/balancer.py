"""``python -m ultraep.bench balancer``: the exposed cost of balancing one MoE layer, as a
framework would run it, beside the layer itself, in one run.

Every rank routes ``tokens`` fp16 tokens top-k with Zipf-skewed experts tuned to each
initial rank imbalance (``--initial-imbalance``, ``ultraep.analysis.traces.zipf_topk``).
Experts are two fp16 matrices ``[hidden, ffn]`` and ``[ffn, hidden]``; gradients fp32.
Two layers are timed, alternately, as group windows (first rank's start to the last
rank's end, host and device, per call; medians over ``--rounds`` rounds of
``--repeats`` calls):

* ``balanced_ms``: the whole balanced layer -- ``Balancer.update`` (a new plan every
  call), ``weight_sync`` on a side stream (its tasks compiled on the device on the GPU),
  ``reroute``, dispatch beside the sync, the masters' compute, then each replica slot's
  compute after ``wait_replica`` for that slot alone, combine;
* ``layer_ms``: the same layer with the plan and the replicas already in place
  (dispatch, compute, combine).

``exposed_ms`` = balanced - in place (median of the rounds' differences): what balancing
adds to the layer. ``share_pct`` = exposed / layer. The ``*_dev_ms`` columns are the
Balancer's own CUDA-event (CPU: wall) stage times in the balanced layer, medians over
its calls: the parts, not additive (the sync runs beside dispatch).
Several ranks on one GPU run time-sliced, so both times include the other ranks' work,
unless ``--emulate-ep`` runs them under MPS with an SM share each; the title says which.
The receive buffer holds 1.25x the mean rows (balanced routing stays near the mean).
Started with one process, it relaunches itself on ``--ranks`` ranks under ``mpiexec``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from ultraep.bench.timing import group_window_ms
from ultraep.runtime.launch import CPU_OR_GPU, add_launch_options, multi_rank_main

LAYERS = 4  # cycled, so a layer's ring slot is reused only after the other layers' updates, as in training
COLUMNS = ["imbalance", "imb_after", "replicas", "exposed_ms", "layer_ms", "balanced_ms", "share_pct",
           "update_dev_ms", "weight_sync_dev_ms", "reroute_dev_ms"]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench balancer", description=__doc__.split("\n\n")[0])
    add_launch_options(parser, backend_help=CPU_OR_GPU)
    parser.add_argument("--experts", type=int, default=64, help="logical experts in all (divisible by the ranks)")
    parser.add_argument("--slots", type=int, default=2, help="redundant slots per rank")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--hidden", type=int, default=2048, help="model width (rows of w_in)")
    parser.add_argument("--ffn", type=int, default=1024, help="expert FFN width (columns of w_in)")
    parser.add_argument("--initial-imbalance", type=float, nargs="+", default=[1.25, 1.5],
                        help="rank max/mean of the generated routing before balancing, one row each (with 4 "
                             "ranks and top-8 over 64 experts at most 1.5 is reachable)")
    parser.add_argument("--min-replica-tokens", type=int, default=1024,
                        help="fewest tokens a replica may serve (the planner's min_replica_tokens)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per window (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="windows of each layer, alternating balanced and in place (medians reported)")
    parser.add_argument("--sync-blocks", type=int, default=None,
                        help="grid of the weight sync beside dispatch (default: the engine's, all resident blocks)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing and the weights")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="draw each rank's load per micro-batch, unbalanced and balanced, at the last "
                             "--initial-imbalance (ultraep.analysis.plots.plot_rank_loads)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "balancer"])


def measure(group, target: float, args, progress):
    """The row of one initial imbalance, and the Balancer's per-micro-batch records."""
    from ultraep.integration import Balancer
    from ultraep.planner import ExpertLayout
    from ultraep.analysis.traces import zipf_topk
    from ultraep.token import Dispatcher
    from ultraep.transfer import ExpertSpec

    R, me, K, T, H = group.size, group.rank, args.top_k, args.tokens, args.hidden
    gpu = args.backend == "device" or (args.backend == "auto" and group.has_gpu)
    backend = "device" if gpu else "host"
    if gpu:
        import cupy as xp
        synchronize = xp.cuda.runtime.deviceSynchronize  # the weight sync's side stream too
    else:
        xp, synchronize = np, (lambda: None)
    layout = ExpertLayout(R, args.experts, args.slots)
    M = layout.experts_per_rank
    spec = ExpertSpec([("w_in", (H, args.ffn), "float16"), ("w_out", (args.ffn, H), "float16")], grad_dtype="float32")
    rng = np.random.default_rng((args.seed, me))
    ids = xp.asarray(zipf_topk(R, args.experts, K, T, target, args.seed)[me])
    x = xp.asarray(rng.standard_normal((T, H)).astype(np.float16))
    gates = xp.asarray(rng.random((T, K)).astype(np.float32))
    masters = [[xp.asarray((rng.standard_normal(t.shape) / np.sqrt(t.shape[0])).astype(np.float16))
                for t in spec.weights] for _ in range(M)]
    grads = [[xp.zeros(t.shape, np.float32) for t in spec.grads] for _ in range(M)]
    with Balancer(group, layout, spec, num_layers=LAYERS, min_replica_tokens=args.min_replica_tokens,
                  backend=backend, sync_checks=False) as balancer, \
            Dispatcher.for_layout(group, layout, hidden=H, dtype="float16", top_k=K, max_tokens=T, backend=backend,
                                  max_recv_rows=int(1.25 * T * K) + 1024, sync_checks=False) as dispatcher:
        for layer in range(LAYERS):
            balancer.register_layer(layer, masters, grads)
        side = xp.cuda.Stream(non_blocking=True) if gpu else None  # the weight sync's own stream
        state = {"calls": 0}

        def experts(received, handle, wait):
            """Masters first, then each replica slot once ``wait(slot)`` lets its stream at it."""
            y = xp.zeros_like(received.x)
            weights = masters + balancer.replica_weights(handle, wait=False)
            for slot in range(M + args.slots):
                begin, end = offsets[slot], offsets[slot + 1]
                if end > begin:
                    if slot >= M:
                        wait(slot - M)
                    w_in, w_out = weights[slot]
                    y[begin:end] = xp.maximum(received.x[begin:end] @ w_in, 0) @ w_out
            return y

        def balanced():
            layer = state["calls"] % LAYERS
            state["calls"] += 1
            state["handle"] = handle = balancer.update(layer, ids)
            sync = balancer.weight_sync(handle, stream=side, blocks=args.sync_blocks)
            state["slots"] = balancer.reroute(handle, ids)
            received = dispatcher.dispatch(x, state["slots"], gates)
            dispatcher.combine(experts(received, handle, sync.wait), received.handle)

        def in_place():
            received = dispatcher.dispatch(x, state["slots"], gates)
            dispatcher.combine(experts(received, state["handle"], lambda slot: None), received.handle)

        progress(f"initial imbalance {target}: layers registered, timing the balanced MoE layer and the same layer "
                 f"with its plan in place ({args.rounds} x {args.repeats} calls each)")
        handle = state["handle"] = balancer.update(0, ids)
        balancer.weight_sync(handle).wait()
        state["slots"] = balancer.reroute(handle, ids)
        state["calls"] = 1
        offsets = [int(v) for v in (dispatcher.dispatch(x, state["slots"], gates).offsets.tolist())]
        windows = {"balanced": [], "in_place": []}
        for _ in range(args.rounds):
            windows["balanced"].append(group_window_ms(group, balanced, args.repeats, synchronize))
            windows["in_place"].append(group_window_ms(group, in_place, args.repeats, synchronize))
        dispatcher.check()
        balancer.check()
        stats = balancer.stats()
        summary = stats.summary()
    layer_ms, balanced_ms = (statistics.median(windows[k]) for k in ("in_place", "balanced"))
    exposed_ms = statistics.median(b - p for b, p in zip(windows["balanced"], windows["in_place"]))
    row = {"imbalance": float(stats.records[-1].imbalance_before), "imb_after": summary["imbalance_after_max"],
           "replicas": summary["replicas_mean"], "exposed_ms": exposed_ms, "layer_ms": layer_ms,
           "balanced_ms": balanced_ms, "share_pct": 100.0 * exposed_ms / layer_ms,
           **{f"{stage}_dev_ms": summary.get(f"{stage}_ms_median") for stage in ("update", "weight_sync", "reroute")}}
    return row, stats.records


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.bench.report import Progress, RowStream, write_json
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label

    group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
    sharing = sharing_label(group)
    printing = group.rank == 0
    progress = Progress("balancer", enabled=printing and not args.quiet)
    title = (f"balancer exposed cost per MoE layer: {group.size} ranks ({sharing}), {args.experts} experts, "
             f"{args.slots} slots/rank, top-{args.top_k}, {args.tokens} tokens/rank, hidden {args.hidden}, "
             f"ffn {args.ffn}, fp16 experts; exposed = balanced layer (update, weight_sync on a side stream beside "
             "dispatch, reroute, per-slot waits) - the same layer with its plan and replicas in place, group windows")
    rows = []
    with RowStream(COLUMNS, title, enabled=printing) as table:
        for target in args.initial_imbalance:
            row, records = measure(group, target, args, progress)
            rows.append(row)
            table.add(row)
    if printing:
        if args.plot:
            from ultraep.analysis.plots import plot_rank_loads

            plot_rank_loads(records, args.plot, title=f"balancer bench, initial imbalance {args.initial_imbalance[-1]}")
            print(f"wrote {args.plot}")
        if args.json:
            write_json(args.json, {"benchmark": "balancer", "ranks": group.size, "sharing": sharing, "args": vars(args),
                                   "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
