"""``python -m ultraep.bench moe-layer``: forward + backward of a stack of MoE layers with
skewed routing under three policies in one run, as tokens/s and the ratio to the ideal
(the paper: 94.6 % of force-balanced throughput in training).

* ``none``: tokens go to the master experts (skewed routing, no balancing);
* ``ultraep``: the same routing, each layer an :class:`~ultraep.MoELayer` with the shared
  ``Balancer`` (``update`` -> ``weight_sync`` -> ``reroute``, the experts on masters and
  replica slots; backward on each layer's own copy of its replicas, replica gradients,
  ``reduce_grads``);
* ``ultraep@N``: with several ``--min-replica-tokens`` values (e.g. ``0 1024 auto``), an
  ``ultraep`` row per value; ``min_replica`` is the value it planned with (``auto``
  resolved by the cost model on the machine profile, ``ultraep.tune``). Where no plan
  could make a replica (``MoELayer.balancing``; e.g. decode under ``auto``) the layers run
  unbalanced: ``replicas_mean`` 0 and a note under the table; with both ``--sync-stream side
  update``, a row per value again (``/side``: the weight sync beside the layer's kernels,
  ``MoELayer(sync_beside=True)``, ``/update``: in series on the layer's stream, started by
  the update, ``False``; the default ``auto`` is the layer's own choice, ``sync_stream``
  names it);
* ``ideal``: force-balanced routing -- every source sends ``tokens x top_k / experts``
  pairs to every expert, so each rank receives exactly the mean -- with no balancing.

Every rank holds ``experts_per_rank`` masters per layer: BF16 SwiGLU experts run by the
library's grouped GEMM over the expert-major receive buffer (``MoELayer``; the NumPy
reference on the CPU backend). Skewed routing: Zipf top-k ids tuned to the initial rank
imbalance ``--initial-imbalance`` (``ultraep.analysis.traces.zipf_topk``), another draw
per layer (the first of up to 32 seeded rankings that reaches the target). A step is the
forward of every layer then the backward in reverse (gradients of inputs, gates and
expert weights; no optimizer); forward and backward are timed as separate group windows
(first rank's start to last rank's end, barriers between), ``step_ms`` is their sum, and
tokens/s counts every rank's tokens. Every policy's layers are set up at once and their
timed steps interleaved (each repeat steps every policy in turn, starting one policy later
than the repeat before), so that a slow stretch of a shared GPU, or a step slowed by the one
before it, costs all policies alike. Checked steps (one before timing, one after, the
gradients zeroed before each): ``ultraep``'s outputs and input gradients must have 0
elements differing from ``none``'s (same routing, weights and inputs: balancing moves no
bit), its master weight gradients differ from ``none``'s only by FP32 reassociation, and
each policy's two checked steps must be bitwise identical.

``--phases`` also prints where each policy's steps go: every layer records its phases
during the timed steps (:meth:`~ultraep.MoELayer.record_phases`: each step's time on the
rank's stream, waits included); per policy, direction and step, the ms of a timed step
(summed over layers, the median over repeats) on the mean and on the slowest rank, and
``over_ideal``, the slowest rank's ms over ideal's for the same step (the rows balancing
adds have none).

Ranks that share a GPU run time-sliced (the title then says "not a figure of merit", as
on the host backend) unless ``--emulate-ep`` runs them under MPS with an SM share each,
so that each behaves like a small GPU of its own. Started with one process, it relaunches
itself on ``--ranks`` ranks under ``mpiexec``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ultraep.bench.balancer import SYNC_STREAMS, resolved_sync_streams
from ultraep.bench.timing import array_backend, window_ms
from ultraep.runtime.launch import (CPU_OR_GPU, DefaultsHelpFormatter, add_launch_options, bounded_type,
                                   imbalance_target, job_ranks, multi_rank_main, non_negative_int, positive_int,
                                   row_width)

# MoELayer's placements of the sync: in series, its update starts it (no "layer" of its own)
MOE_LAYER_SYNC_STREAMS = [stream for stream in SYNC_STREAMS if stream != "layer"]
POLICIES = ("ideal", "none", "ultraep")  # in this order: each row's vs_ideal and diffs are known when it is printed
ROUTING_DRAWS = 32  # Zipf rankings tried per layer: whether a target is reachable depends on which experts share a rank
COLUMNS = ["policy", "fwd_ms", "bwd_ms", "step_ms", "tokens_per_s", "vs_ideal", "rows_max_mean", "replicas_mean",
           "min_replica", "sync_stream", "out_diff", "dx_diff", "wgrad_rel", "rerun_diff"]
PHASE_COLUMNS = ["policy", "direction", "step", "mean_rank_ms", "max_rank_ms", "over_ideal_ms"]
# Largest relative difference of ultraep's master weight gradients from none's: the same FP32
# terms summed per instance move about 1e-6; a replica gradient dropped or added twice, by
# several percent.
WGRAD_TOLERANCE = 1e-4


# A --min-replica-tokens value: auto or an int >= 0.
replica_threshold = bounded_type(lambda text: text if text == "auto" else int(text),
                                 lambda value: value == "auto" or value >= 0, "an int >= 0 or 'auto'")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench moe-layer", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_launch_options(parser, backend_help=CPU_OR_GPU)
    parser.add_argument("--layers", type=positive_int, default=2, help="MoE layers in the stack")
    parser.add_argument("--experts-per-rank", type=positive_int, default=8, help="master experts per rank and layer")
    parser.add_argument("--slots", type=non_negative_int, default=2, help="redundant slots per rank")
    parser.add_argument("--tokens", type=positive_int, default=8192,
                        help="tokens per rank (tokens x top_k divisible by experts)")
    parser.add_argument("--top-k", type=positive_int, default=8, help="experts per token")
    parser.add_argument("--hidden", type=row_width, default=2048, help="model width (rows of w_up)")
    parser.add_argument("--ffn", type=row_width, default=1024,
                        help="expert FFN width (w_up is [hidden, 2 x ffn], SwiGLU)")
    parser.add_argument("--initial-imbalance", type=imbalance_target, default=1.5,
                        help="rank max/mean of the skewed routing before balancing")
    parser.add_argument("--min-replica-tokens", type=replica_threshold, nargs="+", default=[512], metavar="N|auto",
                        help="fewest tokens a replica may serve (the planner's min_replica_tokens), or auto (the "
                             "cost model on the machine profile, ultraep.tune); several values: an ultraep row each")
    parser.add_argument("--sync-stream", choices=MOE_LAYER_SYNC_STREAMS, nargs="+", default=["auto"],
                        help="where ultraep's layers run the weight sync: a stream of their own, beside their "
                             "kernels, in series on the layer's stream, started by the update, or auto (MoELayer's "
                             "default: side where each rank has a GPU of its own, else update); an ultraep row per "
                             "placement")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps per policy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the routing, weights and inputs")
    parser.add_argument("--phases", action="store_true",
                        help="also print each policy's steps (update, dispatch, GEMMs, ...) per direction, in ms")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    ranks = job_ranks(args)  # checked here, not on every rank after the launch
    if args.top_k > args.experts_per_rank * ranks:
        parser.error(f"--top-k {args.top_k} exceeds the experts (--experts-per-rank {args.experts_per_rank} x "
                     f"{ranks} ranks)")
    experts = args.experts_per_rank * ranks
    if args.tokens * args.top_k % experts:
        parser.error(f"ideal's force-balanced routing needs --tokens x --top-k ({args.tokens * args.top_k}) divisible "
                     f"by the experts ({experts})")
    for layer in range(args.layers):  # the skewed routing each layer draws, refused before the launch
        try:
            zipf_draw(ranks, experts, layer, args)
        except ValueError as exc:
            parser.error(f"--initial-imbalance {args.initial_imbalance}: {exc}")
    return args


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "moe-layer"])


def zipf_draw(ranks: int, experts: int, layer: int, args) -> tuple[int, np.ndarray]:
    """The seed and loads of the first of ROUTING_DRAWS Zipf rankings whose loads reach the
    skewed routing's target for ``layer``; ValueError saying why none does."""
    from ultraep.analysis.traces import zipf_loads

    seed = args.seed * 1000 + layer
    for draw in range(ROUTING_DRAWS):
        try:
            return seed + 100_000 * draw, zipf_loads(ranks, experts, args.top_k, args.tokens, args.initial_imbalance,
                                                     seed + 100_000 * draw)
        except ValueError as exc:
            error = exc
    raise ValueError(f"layer {layer}: no Zipf ranking of {ROUTING_DRAWS} reaches the target: {error}")


def routing(policy: str, ranks: int, experts: int, layer: int, args) -> np.ndarray:
    """Logical top-k ids ``int32[R, T, K]`` of every rank for one layer."""
    from ultraep.analysis.traces import topk_from_loads

    if policy != "ideal":  # zipf_topk's ids, its loads drawn once
        seed, loads = zipf_draw(ranks, experts, layer, args)
        return topk_from_loads(loads, args.top_k, seed)
    pairs = args.tokens * args.top_k
    return topk_from_loads(np.full((ranks, experts), pairs // experts, np.int32), args.top_k, args.seed * 1000 + layer)


def received_rows(ids: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """Rows each rank receives without balancing: ``int64[R]`` from every source's ids ``[R, T, K]``."""
    ranks = ids.shape[0]
    return np.bincount((ids // experts_per_rank).ravel(), minlength=ranks).astype(np.int64)


class MoEStack:
    """The layers of one policy on this rank: routing, one :class:`~ultraep.MoELayer` per
    layer with its masters and, for ``ultraep``, the Balancer they share."""

    def __init__(self, group, policy: str, masters, ids, gates, xp, backend: str, args, min_replica_tokens=None,
                 sync_beside: bool | str = "auto"):
        from ultraep.integration import Balancer
        from ultraep.integration.moe_layer import MoELayer, expert_spec
        from ultraep.planner import ExpertLayout

        R, K, T, H = group.size, args.top_k, args.tokens, args.hidden
        self.group, self.policy, self.xp = group, policy, xp
        self.gates = gates
        self.ids = [xp.asarray(layer_ids[group.rank]) for layer_ids in ids]
        M = args.experts_per_rank
        # Receive bound: the busiest rank without balancing, or 1.25x the mean, whichever is more.
        bound = max(int(max(received_rows(i, M).max() for i in ids)), int(1.25 * T * K)) + 1024
        self.balancer = None
        if policy == "ultraep":
            self.balancer = Balancer(group, ExpertLayout(R, R * M, args.slots), expert_spec(H, args.ffn),
                                     num_layers=len(masters), backend=backend, sync_checks=False,
                                     min_replica_tokens=min_replica_tokens)
        self.layers = []
        try:
            for layer, (w_up, w_down) in enumerate(masters):
                moe = MoELayer(group, hidden=H, ffn=args.ffn, num_experts=R * M, top_k=K, max_tokens=T,
                               balancer=self.balancer, layer=layer, max_recv_rows=bound, backend=backend,
                               sync_checks=False, sync_beside=sync_beside)
                self.layers.append(moe)
                moe.load_weights(w_up, w_down)
        except BaseException:
            self.close()
            raise
        self.rows = [[] for _ in masters]  # received rows per forward, per layer

    def zero_grads(self) -> None:
        for moe in self.layers:
            moe.zero_grads()

    def forward(self, x):
        """Every layer in order; returns (output, contexts)."""
        contexts = []
        for layer, moe in enumerate(self.layers):
            x, ctx = moe.forward(x, self.ids[layer], self.gates[layer])
            contexts.append(ctx)
        return x, contexts

    def backward(self, contexts, grad_out):
        """Every layer in reverse; returns the input gradient (weight gradients += in the layers)."""
        for moe, ctx in zip(reversed(self.layers), reversed(contexts)):
            grad_out, _ = moe.backward(ctx, grad_out)
        return grad_out

    def record_phases(self, enable: bool) -> None:
        for moe in self.layers:
            moe.record_phases(enable)

    def phases(self) -> dict:
        """direction -> step -> the median over the recorded steps of its ms summed over the
        layers (each layer's calls since recording began, one per layer and step)."""
        out = {}
        for direction in ("forward", "backward"):
            repeats = list(zip(*(moe.phases(direction) for moe in self.layers)))  # a step: every layer's call
            steps = dict.fromkeys(step for calls in repeats for call in calls for step in call)
            out[direction] = {step: float(np.median([sum(call.get(step, 0.0) for call in calls) for calls in repeats]))
                              for step in steps}
        return out

    def record_rows(self, contexts) -> None:
        for layer, ctx in enumerate(contexts):
            self.rows[layer].append(ctx.received.num_rows)

    def rows_max_mean(self) -> float:
        """Worst over layers (first call of each) of the busiest rank's received rows over the mean."""
        worst = 0.0
        for per_call in self.rows:
            rows = np.array(self.group.allgather(per_call[0]), dtype=np.float64)
            worst = max(worst, float(rows.max() / rows.mean()))
        return worst

    def check(self) -> None:
        for moe in self.layers:
            moe.check()

    def close(self) -> None:
        for moe in self.layers:
            moe.close()
        if self.balancer is not None:
            self.balancer.close()


def phase_windows_ms(group, phases, repeats: int, synchronize, alternate=(), rotate: int = 0) -> list[float]:
    """ms per repeat of each phase as the whole group's window (first rank's start to the
    last rank's end; a barrier before each phase). ``phases``: callables run in order, each
    given the previous one's result (the first None). ``alternate``: pairs of phases that
    swap places every other repeat (in the list's order: pairs sharing a phase rotate), so
    that of two runs (a phase each, or a block of consecutive phases paired in order, the
    first of each reading no input) neither always runs second; a phase after a swapped one
    is given whichever ran before it. ``rotate``: the phases are blocks of that many (the
    first of each reading no input), and repeat r starts at block r (modulo their number),
    so that every block follows every other in turn."""
    if rotate and len(phases) % rotate:
        raise ValueError(f"rotate={rotate}: {len(phases)} phases are not whole blocks of {rotate}")
    blocks = len(phases) // rotate if rotate else 1
    spans = [[] for _ in phases]
    for repeat in range(repeats):
        result = None
        shift = repeat % blocks * rotate
        order = list(range(shift, len(phases))) + list(range(shift))
        for first, second in alternate if repeat % 2 else ():
            order[first], order[second] = order[second], order[first]
        for phase in order:
            fn = phases[phase]
            synchronize()
            group.barrier()
            start = time.monotonic()
            result = fn(result)
            synchronize()
            spans[phase].append((start, time.monotonic()))
    gathered = group.allgather(spans)
    return [sum(window_ms([rank[phase][i] for rank in gathered]) for i in range(repeats)) / repeats
            for phase in range(len(phases))]


def step_rows(group, stacks: dict) -> list[dict]:
    """The ``--phases`` rows of every policy's recorded steps (collective): per direction and
    step, the mean and the slowest rank's ms, and the slowest rank's over ideal's."""
    everyone = group.allgather({name: stack.phases() for name, stack in stacks.items()})
    rows, ideal = [], {}
    for name in stacks:
        for direction in ("forward", "backward"):
            steps = dict.fromkeys(step for rank in everyone for step in rank[name][direction])
            for step in steps:
                ms = [rank[name][direction][step] for rank in everyone if step in rank[name][direction]]
                row = {"policy": name, "direction": direction, "step": step, "mean_rank_ms": float(np.mean(ms)),
                       "max_rank_ms": float(max(ms))}
                if name == "ideal":
                    ideal[direction, step] = row["max_rank_ms"]
                elif (direction, step) in ideal:
                    row["over_ideal_ms"] = row["max_rank_ms"] - ideal[direction, step]
                rows.append(row)
    return rows


def bit_patterns(array: np.ndarray) -> np.ndarray:
    return array.view({2: np.int16, 4: np.int32}[array.dtype.itemsize])


def differing(got, want) -> int:
    """Elements whose bits differ, summed over a list of arrays."""
    return sum(int(np.count_nonzero(bit_patterns(g) != bit_patterns(w))) for g, w in zip(got, want))


def relative_difference(got, want) -> float:
    return max(float(np.max(np.abs(g.astype(np.float64) - w))) / max(float(np.max(np.abs(w))), 1e-30)
               for g, w in zip(got, want))


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.runtime.mps import sharing_label
    from ultraep.bench.report import Progress, RowStream, host_size_note, print_table, write_json
    from ultraep.analysis.traces import rank_imbalance
    from ultraep.runtime.dtypes import BFLOAT16
    from ultraep.runtime.group import EPGroup

    group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
    R, me, T, H, F, L = group.size, group.rank, args.tokens, args.hidden, args.ffn, args.layers
    backend, xp, synchronize, to_host = array_backend(group, args.backend)
    M, E = args.experts_per_rank, R * args.experts_per_rank
    rng = np.random.default_rng((args.seed, me))

    def bf16(values):  # crosses to the GPU as its bits
        return xp.asarray(values.astype(np.float32).astype(BFLOAT16).view(np.int16)).view(BFLOAT16)

    masters = [tuple(bf16(rng.standard_normal((M, *shape)) / np.sqrt(shape[0])) for shape in ((H, 2 * F), (F, H)))
               for _ in range(L)]
    gates = [rng.random((T, args.top_k)).astype(np.float32) for _ in range(L)]
    gates = [xp.asarray(g / g.sum(axis=1, keepdims=True)) for g in gates]
    x = bf16(rng.standard_normal((T, H)))
    grad_out = bf16(rng.standard_normal((T, H)) / np.sqrt(T))
    skewed = [routing("none", R, E, layer, args) for layer in range(L)]
    ideal = [routing("ideal", R, E, layer, args) for layer in range(L)]
    initial = max(float(rank_imbalance(np.stack([np.bincount(ids[r].ravel(), minlength=E) for r in range(R)])))
                  for ids in skewed)

    caveat = sharing_label(group)
    title = (f"MoE layers forward+backward: {R} ranks ({caveat}), {L} layers, {E} experts, "
             f"{args.slots} slots/rank, top-{args.top_k}, {T} tokens/rank, hidden {H}, ffn {F}, BF16 SwiGLU "
             f"experts on the grouped GEMM; initial rank imbalance {initial:.3f} (target {args.initial_imbalance}); "
             "vs_ideal = ideal step time / policy's; out_diff / dx_diff: elements differing from none's; "
             "rerun_diff: elements of the outputs and all gradients differing between two checked steps")
    progress = Progress("moe-layer", enabled=me == 0, quiet=args.quiet)
    host_size_note(progress, not group.has_gpu, T)
    table = RowStream(COLUMNS, title, enabled=me == 0)
    rows, phase_rows = [], []
    thresholds = args.min_replica_tokens
    streams = resolved_sync_streams(group, args.sync_stream)
    runs = [(policy, threshold, stream) for policy in POLICIES
            for threshold in (thresholds if policy == "ultraep" else [None])
            for stream in (streams if policy == "ultraep" else [None])]

    def checked_step(stack):
        stack.zero_grads()
        out, contexts = stack.forward(x)
        stack.record_rows(contexts)
        dx = stack.backward(contexts, grad_out)
        synchronize()
        return ([to_host(out)], [to_host(dx)],
                [to_host(g).copy() for moe in stack.layers for g in (moe.grad_up, moe.grad_down)])

    # Every policy's layers at once, their timed steps interleaved repeat by repeat, each repeat
    # starting one policy later: a slow stretch of a shared GPU (one MPS share overlapping another),
    # or a phase slowed by the one before it, then costs every policy alike.
    stacks, first = {}, {}
    try:
        for policy, threshold, stream in runs:
            name = f"ultraep@{threshold}" if policy == "ultraep" and len(thresholds) > 1 else policy
            name += f"/{stream}" if policy == "ultraep" and len(streams) > 1 else ""
            progress(f"{name}: setting up and a checked step")
            stacks[name] = (policy, MoEStack(group, policy, masters, ideal if policy == "ideal" else skewed, gates,
                                             xp, backend, args, min_replica_tokens=threshold,
                                             sync_beside=stream == "side"), stream)
            first[name] = checked_step(stacks[name][1])  # also the warm-up (kernels, schedules)
        progress(f"{args.repeats} timed steps of each policy, interleaved, then a checked step each")
        phases = []
        for _, stack, _ in stacks.values():
            phases += [lambda _, stack=stack: stack.forward(x)[1],
                       lambda contexts, stack=stack: stack.backward(contexts, grad_out)]
        for _, stack, _ in stacks.values():
            stack.record_phases(args.phases)
        windows = phase_windows_ms(group, phases, args.repeats, synchronize, rotate=2)
        if args.phases:
            phase_rows = step_rows(group, {name: stack for name, (_, stack, _) in stacks.items()})
            for _, stack, _ in stacks.values():
                stack.record_phases(False)  # the checked steps below are not timed steps
        for index, (name, (policy, stack, stream)) in enumerate(stacks.items()):
            again = checked_step(stack)
            stack.check()
            replicas, min_replica, balancing = None, None, None
            if stack.balancer is not None:
                balancing = sum(moe.balancing for moe in stack.layers)  # no plan of the others could replicate
                replicas = stack.balancer.stats().summary()["replicas_mean"] if balancing else 0.0
                min_replica = stack.balancer.min_replica_tokens  # "auto" resolved
            fwd_ms, bwd_ms = windows[2 * index:2 * index + 2]
            rerun = differing(sum(first[name], []), sum(again, []))
            row = {"policy": name, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "step_ms": fwd_ms + bwd_ms,
                   "tokens_per_s": R * T / (fwd_ms + bwd_ms) * 1e3, "rows_max_mean": stack.rows_max_mean(),
                   "replicas_mean": replicas, "min_replica": min_replica, "sync_stream": stream,
                   "balancing_layers": balancing, "rerun_diff": sum(group.allgather(rerun))}
            row["vs_ideal"] = rows[0]["step_ms"] / row["step_ms"] if rows else 1.0  # ideal is measured first
            if policy == "ultraep":
                (out, dx, grads), (out_none, dx_none, grads_none) = first[name], first["none"]
                mine = (differing(out, out_none), differing(dx, dx_none), relative_difference(grads, grads_none))
                everyone = group.allgather(mine)
                row["out_diff"], row["dx_diff"] = (sum(d[i] for d in everyone) for i in range(2))
                row["wgrad_rel"] = max(d[2] for d in everyone)
            rows.append(row)
            table.add(row)
    finally:
        for _, stack, _ in stacks.values():
            stack.close()
    table.close()
    balanced = [row for row in rows if row["policy"].startswith("ultraep")]
    if me == 0:
        for row in balanced:
            if not row["balancing_layers"]:
                print(f"{row['policy']}: no layer balanced (MoELayer.balancing False: no plan could make a replica "
                      f"with min_replica {row['min_replica']}, at most {R} x {T} tokens per expert and call, "
                      f"{args.slots} slots/rank); its layers ran as none's")
    problems = [f"{row['policy']}: {key} = {row[key]} (must be 0)"
                for row in balanced for key in ("out_diff", "dx_diff") if row[key]]
    problems += [f"{row['policy']}: rerun_diff = {row['rerun_diff']} (must be 0)" for row in rows if row["rerun_diff"]]
    problems += [f"{row['policy']}: wgrad_rel = {row['wgrad_rel']:.2e} (at most {WGRAD_TOLERANCE:g})"
                 for row in balanced if row["wgrad_rel"] > WGRAD_TOLERANCE]
    if problems:
        raise SystemExit("balancing changed the layer's results: " + "; ".join(problems))

    if me == 0:
        if phase_rows:
            print_table(phase_rows, PHASE_COLUMNS, "Where the timed steps went (MoELayer.record_phases; ms a step, the "
                                                   "layers summed, median over repeats; over_ideal: the slowest rank's "
                                                   "over ideal's same step)")
        if args.json:
            write_json(args.json, {"benchmark": "moe-layer", "ranks": R, "caveat": caveat, "initial_imbalance": initial,
                                   "args": vars(args), "rows": rows, "phases": phase_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
