"""The library's main job on the CPU: one MoE layer on 4 ranks, balanced micro-batch by
micro-batch, forward and backward, beside the same layer without balancing.

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py examples/balanced_layer.py [--out out/demo_layer.png]

Per micro-batch the router sends most tokens to a few hot experts, and the hot spot moves
between micro-batches. The balanced layer runs Balancer.update -> weight_sync -> reroute ->
Dispatcher.dispatch -> grouped GEMM on masters and replica slots -> combine, then the
backward: combine_backward -> dgrad and wgrad -> replica_grads -> reduce_grads ->
dispatch_backward. The unbalanced layer sends every token to its expert's master.

Prints each rank's rows (token, expert pairs it computes) without and with balancing, and
checks: every rank computes exactly the rows its plan gave it; the outputs and input
gradients are bitwise those of the unbalanced layer; master weight gradients match within
fp32 reassociation (a replica's rows are summed apart, then added in). Rank 0 draws the rows
per rank and micro-batch to ``--out``.
"""

from pathlib import Path

import numpy as np
from ml_dtypes import bfloat16
from mpi4py import MPI

import ultraep
from ultraep.compute import grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
from ultraep.runtime.launch import JobArgumentParser, positive_int

parser = JobArgumentParser()
parser.add_argument("--micro-batches", type=positive_int, default=4, help="micro-batches through the layer")
parser.add_argument("--tokens", type=positive_int, default=512, help="tokens per rank and micro-batch")
parser.add_argument("--out", type=Path, default=Path("out/demo_layer.png"), help="the figure (written by rank 0)")
args = parser.parse_args()

group = ultraep.EPGroup(MPI.COMM_WORLD, use_gpu=False)
R, me = group.size, group.rank
E, S, H, T, K = 4 * R, 2, 64, args.tokens, 2  # experts, replica slots per rank, hidden size, tokens, top-k
layout = ultraep.ExpertLayout(num_ranks=R, num_experts=E, redundant_slots=S)
M = layout.experts_per_rank
spec = ultraep.ExpertSpec([("w", (H, H), "bfloat16")], grad_dtype="float32")
rng = np.random.default_rng(me)
masters = np.stack([(rng.standard_normal((H, H)) / 8).astype(bfloat16) for _ in range(M)])  # this rank's experts
token_args = dict(hidden=H, dtype="bfloat16", top_k=K, max_tokens=T)


def route(mb):
    """This rank's top-k expert ids for micro-batch ``mb``: K distinct experts per token,
    expert popularity ~ 1 / (1 + distance from a hot expert that moves each micro-batch)."""
    hot = (3 * mb * M + 1) % E
    popularity = 1.0 / (1.0 + (np.arange(E) - hot) % E)
    draw = np.random.default_rng((mb, me)).gumbel(size=(T, E)) + np.log(popularity)
    return np.argsort(draw, axis=1)[:, -K:].copy()


def layer(dispatcher, w, x, ids, gates):
    """Forward and backward of sum(output) through ``dispatcher`` with per-slot weights ``w``:
    (output, grad_x, per-slot weight gradients, rows computed here)."""
    recv = dispatcher.dispatch(x, ids, gates)
    y = grouped_mm(recv.x, w, recv.offsets)
    out = dispatcher.combine(y, recv.handle)
    grad_y, _ = dispatcher.combine_backward(np.ones_like(out), y, recv.handle)
    grad_x = dispatcher.dispatch_backward(grouped_mm_dgrad(grad_y, w, recv.offsets), recv.handle)
    grad_w = grouped_mm_wgrad(recv.x, grad_y, recv.offsets, out=np.zeros((len(w), H, H), np.float32))
    return out, grad_x, grad_w, recv.num_rows


def draw(rows, path):
    """Bars of each rank's rows per micro-batch, unbalanced beside balanced; returns the
    axes labels and legend entries it drew."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = np.arange(R)
    fig, axes = plt.subplots(1, len(rows), figsize=(2.6 * len(rows) + 1, 3.4), sharey=True, squeeze=False)
    for ax, (mb, (before, after)) in zip(axes[0], sorted(rows.items())):
        ax.bar(ranks - 0.2, before, width=0.4, color="tab:red", label="unbalanced")
        ax.bar(ranks + 0.2, after, width=0.4, color="tab:blue", label="balanced")
        ax.axhline(np.mean(before), color="black", linestyle="--", linewidth=1, label="mean (ideal)")
        ax.set_title(f"micro-batch {mb}: max/mean\n{max(before) / np.mean(before):.2f} -> "
                     f"{max(after) / np.mean(after):.2f}", fontsize=9)
        ax.set_xticks(ranks)
        ax.set_xlabel("rank")
    axes[0, 0].set_ylabel("rows computed (token, expert pairs)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"one MoE layer, {R} ranks, {E} experts, {S} replica slots per rank", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    drawn = dict(xlabel=axes[0, 0].get_xlabel(), ylabel=axes[0, 0].get_ylabel(), panels=len(fig.axes),
                 legend=[t.get_text() for t in axes[0, 0].get_legend().get_texts()],
                 pixels=tuple(int(v) for v in fig.canvas.get_width_height()))
    plt.close(fig)
    return drawn


need = (ultraep.Balancer.heap_requirements(layout, spec)
        + ultraep.Dispatcher.heap_requirements(R, num_experts=layout.num_physical,
                                               experts_per_rank=layout.slots_per_rank, **token_args))
rows, worst_grad_error = {}, 0.0
with ultraep.open_heap(group, need) as heap, \
        ultraep.Balancer(group, layout, spec, num_layers=1, min_replica_tokens=16, heap=heap) as balancer, \
        ultraep.Dispatcher.for_layout(group, layout, heap=heap, **token_args) as balanced, \
        ultraep.Dispatcher(group, num_experts=E, **token_args) as plain:  # a heap of its own (names are per heap)
    grads = [[np.zeros((H, H), np.float32)] for _ in range(M)]
    balancer.register_layer(0, [[w] for w in masters], grads)
    for mb in range(args.micro_batches):
        x = np.random.default_rng((99, mb, me)).standard_normal((T, H)).astype(bfloat16)
        ids, gates = route(mb), np.full((T, K), 1 / K, np.float32)
        out0, grad_x0, grad_w0, rows0 = layer(plain, masters, x, ids, gates)

        for g in grads:
            g[0][...] = 0
        handle = balancer.update(0, ids)
        balancer.weight_sync(handle)
        slot_ids = balancer.reroute(handle)
        w = np.concatenate([masters, np.stack([r[0] for r in balancer.replica_weights(handle)])])
        out, grad_x, grad_w, rows1 = layer(balanced, w, x, slot_ids, gates)
        for m in range(M):
            grads[m][0] += grad_w[m]
        for s, replica in enumerate(balancer.replica_grads(handle)):
            replica[0][...] = grad_w[M + s]  # zeros where a slot served no rows: reduce_grads adds every slot
        balancer.reduce_grads(handle)

        planned = balancer.stats().records[-1].rank_load_after
        assert rows1 == planned[me], f"rank {me} computed {rows1} rows, its plan says {planned[me]}"
        assert np.array_equal(out.view(np.uint16), out0.view(np.uint16)), "outputs differ from the unbalanced layer"
        assert np.array_equal(grad_x.view(np.uint16), grad_x0.view(np.uint16)), "input gradients differ"
        reduced = np.stack([g[0] for g in grads])
        worst_grad_error = max(worst_grad_error, float(np.abs(reduced - grad_w0).max() / np.abs(grad_w0).max()))
        rows[mb] = (group.allgather(rows0), group.allgather(rows1))

worst_grad_error = max(group.allgather(worst_grad_error))
assert worst_grad_error < 1e-5, f"master gradients differ by {worst_grad_error:.1e} relative"
if me == 0:
    print(f"rows each rank computes, {R} ranks, {E} experts ({M} per rank) + {S} replica slots per rank:")
    for mb, (before, after) in sorted(rows.items()):
        print(f"  micro-batch {mb}: unbalanced {before} max/mean {max(before) / np.mean(before):.2f}  ->  "
              f"balanced {after} max/mean {max(after) / np.mean(after):.2f}")
    print("outputs and input gradients bitwise equal to the unbalanced layer; master weight gradients within "
          f"{worst_grad_error:.1e} relative (replica rows summed apart, then added)")
    drawn = draw(rows, args.out)
    print(f"figure {args.out}: {drawn['panels']} panels, {drawn['pixels'][0]}x{drawn['pixels'][1]} pixels, "
          f"x label {drawn['xlabel']!r}, y label {drawn['ylabel']!r}, legend {drawn['legend']}", flush=True)
print(f"rank {me}/{R}: balanced_layer OK", flush=True)
