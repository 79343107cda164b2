"""``python -m ultraep.bench moe-layer``: forward + backward of a stack of MoE layers with
skewed routing under three policies in one run, as tokens/s and the ratio to the ideal
(the paper: 94.6 % of force-balanced throughput in training).

* ``none``: tokens go to the master experts (skewed routing, no balancing);
* ``ultraep``: the same routing through ``Balancer.update`` -> ``weight_sync`` ->
  ``reroute`` and a ``Dispatcher`` over the layout's physical slots; the experts run on
  master and replica buffers; backward ``restore`` (layers whose replicas were since
  overwritten), replica gradients, ``reduce_grads``;
* ``ultraep@N``: with several ``--min-replica-tokens`` values (e.g. ``0 1024 auto``), an
  ``ultraep`` row per value; ``min_replica`` is the value it planned with (``auto``
  resolved by the cost model on the machine profile, ``ultraep.tune``);
* ``ideal``: force-balanced routing -- every source sends ``tokens x top_k / experts``
  pairs to every expert, so each rank receives exactly the mean -- with no balancing.

Every rank holds ``experts_per_rank`` masters per layer (two-matrix ReLU MLPs, one matmul
pair per local slot over its contiguous rows; NumPy on the CPU backend, CuPy on a GPU).
Skewed routing: Zipf top-k ids tuned to the initial rank imbalance ``--initial-imbalance``
(``ultraep.analysis.traces.zipf_topk``), another draw per layer (the first of up to
32 seeded rankings that reaches the target). A step is the forward of
every layer then the backward in reverse (gradients of inputs and expert weights; no
optimizer); its time is the whole group's window per step, and tokens/s counts every
rank's tokens. Before timing, one step of ``ultraep`` is checked against ``none`` (same
routing, weights and inputs): outputs and master gradients agree within the dtype's
rounding (balancing only splits an expert's rows between its instances).

Ranks that share a GPU run time-sliced (the title then says "not a figure of merit", as
on the host backend) unless ``--emulate-ep`` runs them under MPS with an SM share each,
so that each behaves like a small GPU of its own. Started with one process, it relaunches
itself on ``--ranks`` ranks under ``mpiexec``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ultraep.bench.timing import group_window_ms
from ultraep.runtime.launch import add_emulation_option, multi_rank_main

POLICIES = ("ideal", "none", "ultraep")  # in this order: each row's vs_ideal and diffs are known when it is printed
ROUTING_DRAWS = 32  # Zipf rankings tried per layer: whether a target is reachable depends on which experts share a rank
COLUMNS = ["policy", "step_ms", "tokens_per_s", "vs_ideal", "rows_max_mean", "replicas", "min_replica", "out_diff",
           "grad_diff"]
# Largest relative difference of ultraep's outputs and master gradients from none's: another
# summation order moves fp16 by about 1e-3; a replica gradient dropped or added twice, by
# several percent.
TOLERANCE = {"float16": 1e-2, "float32": 1e-4}


def replica_threshold(text: str):
    """A ``--min-replica-tokens`` value: ``auto`` or an int >= 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {text!r}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench moe-layer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks to launch when started without mpiexec")
    add_emulation_option(parser)
    parser.add_argument("--backend", default="auto", choices=["auto", "device", "host"],
                        help="device: CuPy on the GPU; host: NumPy on the CPU; auto: the GPU when there is one")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers in the stack")
    parser.add_argument("--experts-per-rank", type=int, default=8, help="master experts per rank and layer")
    parser.add_argument("--slots", type=int, default=2, help="redundant slots per rank")
    parser.add_argument("--tokens", type=int, default=8192,
                        help="tokens per rank (tokens x top_k divisible by experts)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--hidden", type=int, default=2048, help="model width (rows of w_in)")
    parser.add_argument("--ffn", type=int, default=1024, help="expert FFN width (columns of w_in)")
    parser.add_argument("--dtype", default="float16", choices=sorted(TOLERANCE), help="expert weights and tokens")
    parser.add_argument("--initial-imbalance", type=float, default=1.5,
                        help="rank max/mean of the skewed routing before balancing")
    parser.add_argument("--min-replica-tokens", type=replica_threshold, nargs="+", default=[512], metavar="N|auto",
                        help="fewest tokens a replica may serve (the planner's min_replica_tokens), or auto (the "
                             "cost model on the machine profile, ultraep.tune); several values: an ultraep row each")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per policy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing, weights and inputs")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "moe-layer"])


def routing(policy: str, ranks: int, experts: int, layer: int, args) -> np.ndarray:
    """Logical top-k ids ``int32[R, T, K]`` of every rank for one layer."""
    from ultraep.analysis.traces import topk_from_loads, zipf_topk

    seed = args.seed * 1000 + layer
    if policy != "ideal":
        for draw in range(ROUTING_DRAWS):
            try:
                return zipf_topk(ranks, experts, args.top_k, args.tokens, args.initial_imbalance,
                                 seed + 100_000 * draw)
            except ValueError as exc:
                error = exc
        raise ValueError(f"layer {layer}: no Zipf ranking of {ROUTING_DRAWS} reaches the target: {error}")
    pairs = args.tokens * args.top_k
    if pairs % experts:
        raise ValueError(f"force-balanced routing needs tokens x top_k ({pairs}) divisible by the experts ({experts})")
    return topk_from_loads(np.full((ranks, experts), pairs // experts, np.int32), args.top_k, seed)


def received_rows(ids: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """Rows each rank receives without balancing: ``int64[R]`` from every source's ids ``[R, T, K]``."""
    ranks = ids.shape[0]
    return np.bincount((ids // experts_per_rank).ravel(), minlength=ranks).astype(np.int64)


class MoEStack:
    """The layers of one policy on this rank: routing, masters and their gradients, one
    Dispatcher per layer and, for ``ultraep``, the Balancer."""

    def __init__(self, group, policy: str, masters, ids, gates, xp, backend: str, args, min_replica_tokens=None):
        from ultraep.integration import Balancer
        from ultraep.planner import ExpertLayout
        from ultraep.token import Dispatcher
        from ultraep.transfer import ExpertSpec

        R, K, T, H = group.size, args.top_k, args.tokens, args.hidden
        self.group, self.policy, self.xp, self.args = group, policy, xp, args
        self.masters, self.gates = masters, gates
        self.ids = [xp.asarray(layer_ids[group.rank]) for layer_ids in ids]
        self.M = args.experts_per_rank
        self.grads = [[[xp.zeros(w.shape, np.float32) for w in expert] for expert in layer] for layer in masters]
        # Receive bound: the busiest rank without balancing, or 1.25x the mean, whichever is more.
        bound = max(int(max(received_rows(i, self.M).max() for i in ids)), int(1.25 * T * K)) + 1024
        common = dict(hidden=H, dtype=args.dtype, top_k=K, max_tokens=T, max_recv_rows=bound, backend=backend,
                      sync_checks=False)
        self.balancer = None
        if policy == "ultraep":
            layout = ExpertLayout(R, R * self.M, args.slots)
            spec = ExpertSpec([("w_in", (H, args.ffn), args.dtype), ("w_out", (args.ffn, H), args.dtype)],
                              grad_dtype="float32")
            self.balancer = Balancer(group, layout, spec, num_layers=len(masters), backend=backend, sync_checks=False,
                                     min_replica_tokens=min_replica_tokens)
            for layer, (weights, grads) in enumerate(zip(masters, self.grads)):
                self.balancer.register_layer(layer, weights, grads)
            self.dispatchers = [Dispatcher.for_layout(group, layout, **common) for _ in masters]
        else:
            self.dispatchers = [Dispatcher(group, num_experts=R * self.M, **common) for _ in masters]
        self.rows = [[] for _ in masters]  # received rows per call, per layer

    def zero_grads(self) -> None:
        for layer in self.grads:
            for expert in layer:
                for grad in expert:
                    grad[...] = 0

    def step(self, x, grad_out):
        """Forward through every layer, backward in reverse; returns (output, input gradient)."""
        saved = []
        for layer in range(len(self.masters)):
            x, state = self.forward(layer, x)
            saved.append(state)
        out = x
        for layer in reversed(range(len(self.masters))):
            grad_out = self.backward(layer, grad_out, saved.pop(), last=layer == len(self.masters) - 1)
        return out, grad_out

    def _slot_weights(self, layer, handle):
        return self.masters[layer] + (self.balancer.replica_weights(handle) if handle is not None else [])

    def forward(self, layer, x):
        xp, ids, handle = self.xp, self.ids[layer], None
        if self.balancer is not None:
            handle = self.balancer.update(layer, ids)
            self.balancer.weight_sync(handle)
            ids = self.balancer.reroute(handle, ids)
        received = self.dispatchers[layer].dispatch(x, ids, self.gates[layer])
        offsets = [int(v) for v in received.offsets.tolist()]
        self.rows[layer].append(offsets[-1])
        y, caches = xp.zeros_like(received.x), {}
        for slot, (w_in, w_out) in enumerate(self._slot_weights(layer, handle)):
            begin, end = offsets[slot], offsets[slot + 1]
            if end > begin:
                rows = received.x[begin:end]
                pre = rows @ w_in
                act = xp.maximum(pre, 0)
                y[begin:end] = act @ w_out
                caches[slot] = (rows, pre, act)
        return self.dispatchers[layer].combine(y, received.handle), (handle, received, y, caches, offsets)

    def backward(self, layer, grad_out, state, last: bool):
        xp, M = self.xp, self.M
        handle, received, y, caches, offsets = state
        dispatcher = self.dispatchers[layer]
        replica_grads = []
        if handle is not None:
            if not last:  # later layers' forwards have since overwritten the shared replica slots
                self.balancer.restore(handle)
            replica_grads = self.balancer.replica_grads(handle)
        grad_y, _ = dispatcher.combine_backward(grad_out, y, received.handle)
        grad_recv = xp.zeros_like(grad_y)
        for slot, (w_in, w_out) in enumerate(self._slot_weights(layer, handle)):
            if slot not in caches:
                for grad in (replica_grads[slot - M] if slot >= M else []):
                    grad[...] = 0  # reduce_grads adds every replica slot of the plan
                continue
            begin, end = offsets[slot], offsets[slot + 1]
            rows, pre, act = caches[slot]
            grad_rows = grad_y[begin:end]
            grad_pre = (grad_rows @ w_out.T) * (pre > 0)
            grad_recv[begin:end] = grad_pre @ w_in.T
            weight_grads = (rows.T @ grad_pre, act.T @ grad_rows)
            if slot < M:
                for grad, part in zip(self.grads[layer][slot], weight_grads):
                    grad += part
            else:
                for grad, part in zip(replica_grads[slot - M], weight_grads):
                    grad[...] = part
        if handle is not None:
            self.balancer.reduce_grads(handle)
        return dispatcher.dispatch_backward(grad_recv, received.handle)

    def rows_max_mean(self) -> float:
        """Worst over layers (first call of each) of the busiest rank's received rows over the mean."""
        worst = 0.0
        for per_call in self.rows:
            rows = np.array(self.group.allgather(per_call[0]), dtype=np.float64)
            worst = max(worst, float(rows.max() / rows.mean()))
        return worst

    def close(self) -> None:
        for dispatcher in self.dispatchers:
            dispatcher.close()
        if self.balancer is not None:
            self.balancer.close()


def relative_difference(got, want) -> float:
    return max(float(np.max(np.abs(g.astype(np.float64) - w))) / max(float(np.max(np.abs(w))), 1e-30)
               for g, w in zip(got, want))


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.runtime.mps import sharing_label
    from ultraep.bench.report import Progress, RowStream, write_json
    from ultraep.analysis.traces import rank_imbalance
    from ultraep.runtime.group import EPGroup

    group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
    R, me, T, H, L = group.size, group.rank, args.tokens, args.hidden, args.layers
    gpu = group.has_gpu and args.backend != "host"
    if args.backend == "device" and not gpu:
        raise SystemExit("--backend device: no GPU here")
    if gpu:
        import cupy as xp
        synchronize, to_host = xp.cuda.get_current_stream().synchronize, xp.asnumpy
    else:
        xp, synchronize, to_host = np, (lambda: None), np.asarray
    backend = "device" if gpu else "host"
    M, E = args.experts_per_rank, R * args.experts_per_rank
    rng = np.random.default_rng((args.seed, me))
    masters = [[[xp.asarray((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(args.dtype))
                 for shape in ((H, args.ffn), (args.ffn, H))] for _ in range(M)] for _ in range(L)]
    gates = [rng.random((T, args.top_k)).astype(np.float32) for _ in range(L)]
    gates = [xp.asarray(g / g.sum(axis=1, keepdims=True)) for g in gates]
    x = xp.asarray(rng.standard_normal((T, H)).astype(args.dtype))
    grad_out = xp.asarray((rng.standard_normal((T, H)) / np.sqrt(T)).astype(args.dtype))
    skewed = [routing("none", R, E, layer, args) for layer in range(L)]
    ideal = [routing("ideal", R, E, layer, args) for layer in range(L)]
    initial = max(float(rank_imbalance(np.stack([np.bincount(ids[r].ravel(), minlength=E) for r in range(R)])))
                  for ids in skewed)

    caveat = sharing_label(group)
    title = (f"MoE layers forward+backward: {R} ranks ({caveat}), {L} layers, {E} experts, "
             f"{args.slots} slots/rank, top-{args.top_k}, {T} tokens/rank, hidden {H}, ffn {args.ffn}, "
             f"{args.dtype}; initial rank imbalance {initial:.3f} (target {args.initial_imbalance}); "
             "vs_ideal = ideal step time / policy's")
    progress = Progress("moe-layer", enabled=me == 0 and not args.quiet)
    table = RowStream(COLUMNS, title, enabled=me == 0)
    rows, checked = [], {}
    thresholds = args.min_replica_tokens
    runs = [(policy, threshold) for policy in POLICIES for threshold in (thresholds if policy == "ultraep" else [None])]
    for policy, threshold in runs:
        name = f"ultraep@{threshold}" if policy == "ultraep" and len(thresholds) > 1 else policy
        progress(f"{name}: setting up, one checked step, then {args.repeats} timed steps")
        stack = MoEStack(group, policy, masters, ideal if policy == "ideal" else skewed, gates, xp, backend, args,
                         min_replica_tokens=threshold)
        try:
            stack.zero_grads()
            out, _ = stack.step(x, grad_out)  # warm-up (kernels, schedules) and the checked step
            synchronize()
            checked[name] = [to_host(out)] + [to_host(g) for layer in stack.grads for e in layer for g in e]
            step_ms = group_window_ms(group, lambda: stack.step(x, grad_out), args.repeats, synchronize)
            for dispatcher in stack.dispatchers:
                dispatcher.check()
            replicas, min_replica = None, None
            if stack.balancer is not None:
                stack.balancer.check()
                replicas = stack.balancer.stats().summary()["replicas_mean"]
                min_replica = stack.balancer.min_replica_tokens  # "auto" resolved
            row = {"policy": name, "step_ms": step_ms, "tokens_per_s": R * T / step_ms * 1e3,
                   "rows_max_mean": stack.rows_max_mean(), "replicas": replicas, "min_replica": min_replica}
        finally:
            stack.close()
        row["vs_ideal"] = rows[0]["step_ms"] / step_ms if rows else 1.0  # ideal is measured first
        if policy == "ultraep":
            diffs = group.allgather((relative_difference(checked[name][:1], checked["none"][:1]),
                                     relative_difference(checked[name][1:], checked["none"][1:])))
            row["out_diff"], row["grad_diff"] = (max(d[i] for d in diffs) for i in range(2))
        rows.append(row)
        table.add(row)
    table.close()
    for row in rows:
        out_diff, grad_diff = row.get("out_diff", 0.0), row.get("grad_diff", 0.0)
        if out_diff > TOLERANCE[args.dtype] or grad_diff > TOLERANCE[args.dtype]:
            raise SystemExit(f"{row['policy']}'s outputs / master gradients differ from no balancing by "
                             f"{out_diff:.2e} / {grad_diff:.2e} relative (tolerance {TOLERANCE[args.dtype]:g} "
                             f"for {args.dtype})")

    if me == 0:
        if args.json:
            write_json(args.json, {"benchmark": "moe-layer", "ranks": R, "caveat": caveat, "initial_imbalance": initial,
                                   "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
