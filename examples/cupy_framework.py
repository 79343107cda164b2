# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "mpich", "numpy"]
# ///
"""A two-layer MoE model in a framework written only in NumPy (CPU backend) or CuPy (GPU),
balanced by ``ultraep.Balancer``, run as a 2-stage 1F1B pipeline with several
micro-batches in flight (stage s holds MoE layer s; both stages live in every process).

    mpiexec -n 4 python -m mpi4py examples/cupy_framework.py [--backend cpu|cuda] [--micro-batches 4]

Each rank holds M = E / R master experts per layer (a two-matrix ReLU MLP each). The
router is skewed: a few hot experts get most tokens. Every micro-batch runs twice --
unbalanced (tokens go to masters) and balanced (``update`` -> ``weight_sync`` ->
``reroute`` -> replicas compute with the synced weights; backward ``restore`` ->
replica gradients -> ``reduce_grads``). Token movement: the library's ``Dispatcher``.

What it prints and checks: received rows per rank without and with balancing; outputs
of the balanced path bitwise equal to the unbalanced one (every row goes through the
same expert function; combine sums in a fixed slot order); master gradients within
1e-5 relative -- not bitwise, because an expert's weight gradient is a sum over its
token rows, and replication splits those rows into per-instance fp32 partial sums that
``reduce_grads`` then adds in replica order: the same terms, associated differently.
"""

import argparse
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.integration import Balancer, plot_rank_loads
from ultraep.integration.pipeline import max_in_flight, one_f_one_b
from ultraep.planner import ExpertLayout
from ultraep.runtime.group import EPGroup
from ultraep.token import Dispatcher
from ultraep.transfer import ExpertSpec

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--tokens", type=int, default=128, help="tokens per rank and micro-batch")
parser.add_argument("--out", type=Path, default=None, help="directory for the load trace and plot (rank 0)")
args = parser.parse_args()

group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend == "cuda")
R, me = group.size, group.rank
if args.backend == "cuda":
    import cupy as xp
    to_host = xp.asnumpy
else:
    xp = np
    to_host = np.asarray

STAGES, E, S, H, F, TOP_K = 2, 4 * R, 2, 32, 64, 2
T = args.tokens
layout = ExpertLayout(R, E, S)
M = layout.experts_per_rank
spec = ExpertSpec([("w_in", (H, F), "float32"), ("w_out", (F, H), "float32")], grad_dtype="float32")


# -- the framework: an MLP expert, its backward, and a skewed router ----------------------------
def rows_times(a, b):
    """``a @ b`` computed so that each row's result depends only on that row: a BLAS GEMM may
    pick another blocking (and rounding) for another row count, and with balancing an
    expert's rows are split between its master and its replicas."""
    return (a[:, :, None] * b[None, :, :]).sum(axis=1)


def expert_forward(x, w_in, w_out):
    pre = rows_times(x, w_in)
    act = xp.maximum(pre, 0)
    return rows_times(act, w_out), (x, pre, act)


def expert_backward(grad_y, cache, w_in, w_out):
    x, pre, act = cache
    grad_pre = rows_times(grad_y, w_out.T) * (pre > 0)
    return rows_times(grad_pre, w_in.T), x.T @ grad_pre, act.T @ grad_y  # grad_x, grad_w_in, grad_w_out


def route(stage, mb):
    """Top-k expert ids and gates of this rank's tokens: expert e has popularity ~ 1/(1+e')^1.3,
    e' its distance from a hot expert that moves with the micro-batch."""
    rng = np.random.default_rng((stage, mb, me))
    hot = (5 * mb + stage) % E
    p = 1.0 / (1.0 + (np.arange(E) - hot) % E) ** 1.3
    ids = np.stack([rng.choice(E, TOP_K, replace=False, p=p / p.sum()) for _ in range(T)])
    gates = rng.random((T, TOP_K)).astype(np.float32)
    return ids.astype(np.int64), gates / gates.sum(axis=1, keepdims=True)


def masters(stage):
    return [[xp.asarray(np.random.default_rng((stage, me * M + m, t)).standard_normal(s.shape).astype(np.float32)
                        * np.float32(0.2)) for t, s in enumerate(spec.weights)] for m in range(M)]


class MoEStage:
    """One MoE layer held by one pipeline stage; ``balancer`` None is the unbalanced model."""

    def __init__(self, stage, balancer):
        self.stage, self.bal = stage, balancer
        self.weights = masters(stage)
        self.grads = [[xp.zeros(s.shape, np.float32) for s in spec.grads] for _ in range(M)]
        common = dict(hidden=H, dtype=np.float32, top_k=TOP_K, max_tokens=T, backend=args.backend)
        if balancer is None:
            self.dispatcher = Dispatcher(group, num_experts=E, **common)
        else:
            self.dispatcher = Dispatcher.for_layout(group, layout, **common)
            balancer.register_layer(0, self.weights, self.grads)
        self.saved = {}  # micro-batch -> what its backward needs

    def slot_weights(self, handle):
        """Weights of each local slot: masters, then the replica slots (this micro-batch's)."""
        if self.bal is None:
            return self.weights
        return self.weights + self.bal.replica_weights(handle)

    def forward(self, mb, x):
        ids, gates = route(self.stage, mb)
        handle = None
        if self.bal is not None:
            handle = self.bal.update(0, xp.asarray(ids))
            self.bal.weight_sync(handle)
            ids = self.bal.reroute(handle, xp.asarray(ids))
        received = self.dispatcher.dispatch(x, xp.asarray(ids), xp.asarray(gates))
        offsets = to_host(received.offsets)
        y, caches = xp.zeros_like(received.x), {}
        for slot, weights in enumerate(self.slot_weights(handle)):
            rows = slice(int(offsets[slot]), int(offsets[slot + 1]))
            if rows.stop > rows.start:
                y[rows], caches[slot] = expert_forward(received.x[rows], *weights)
        self.saved[mb] = (handle, received, y, caches, offsets)
        return self.dispatcher.combine(y, received.handle), received.num_rows

    def backward(self, mb, grad_out):
        handle, received, y, caches, offsets = self.saved.pop(mb)
        if self.bal is not None:
            self.bal.restore(handle)  # later micro-batches have since synced this layer's replica slots
            replica_grads = self.bal.replica_grads(handle)
        grad_y, _ = self.dispatcher.combine_backward(grad_out, y, received.handle)
        grad_recv = xp.zeros_like(grad_y)
        for slot, weights in enumerate(self.slot_weights(handle)):
            if slot not in caches:
                continue
            rows = slice(int(offsets[slot]), int(offsets[slot + 1]))
            grad_recv[rows], *grads = expert_backward(grad_y[rows], caches[slot], *weights)
            for t, grad in enumerate(grads):
                if slot < M:
                    self.grads[slot][t] += grad
                else:
                    replica_grads[slot - M][t][...] = grad  # reduce_grads adds it into the master
        if self.bal is not None:
            self.bal.reduce_grads(handle)
        return self.dispatcher.dispatch_backward(grad_recv, received.handle)


def run(balanced):
    """The 1F1B pipeline over all micro-batches; returns outputs, master gradients, rows per rank."""
    order = one_f_one_b(STAGES, args.micro_batches)
    balancers = [Balancer(group, layout, spec, num_layers=1, min_replica_tokens=8, backend=args.backend,
                          max_in_flight=max_in_flight(order, s), record_trace=True) if balanced else None
                 for s in range(STAGES)]
    stages = [MoEStage(s, balancers[s]) for s in range(STAGES)]
    inputs = {mb: xp.asarray(np.random.default_rng((99, mb, me)).standard_normal((T, H)).astype(np.float32))
              for mb in range(args.micro_batches)}
    activations, grads, outputs, rows = dict(inputs), {}, {}, np.zeros((STAGES, R), np.int64)
    for stage, kind, mb in order:
        if kind == "F":
            activations[mb], received_rows = stages[stage].forward(mb, activations[mb])
            rows[stage] += np.array(group.allgather(received_rows))
            if stage == STAGES - 1:
                outputs[mb] = to_host(activations[mb])
                grads[mb] = activations[mb] / np.float32(T)  # loss = sum(out^2) / (2T)
        else:
            grads[mb] = stages[stage].backward(mb, grads[mb])
    master_grads = [to_host(g) for st in stages for per_expert in st.grads for g in per_expert]
    if balanced:
        records = [r for b in balancers for r in b.stats().records]
        if me == 0 and args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            plot_rank_loads(records, args.out / "cupy_framework_rank_loads.png", title="cupy_framework")
            balancers[0].save_trace(args.out / "cupy_framework_stage0_trace.npz")
        summary = [b.stats().summary() for b in balancers]
        for b in balancers:
            b.close()
    for st in stages:
        st.dispatcher.close()
    return outputs, master_grads, rows, (summary if balanced else None)


plain_out, plain_grads, plain_rows, _ = run(balanced=False)
out, grads, rows, summary = run(balanced=True)
same_outputs = all(np.array_equal(out[mb], plain_out[mb]) for mb in out)
grad_error = max(float(np.max(np.abs(g - p)) / max(float(np.max(np.abs(p))), 1e-30)) for g, p in zip(grads, plain_grads))
all_same = group.allgather((same_outputs, grad_error))
if me == 0:
    for stage in range(STAGES):
        print(f"stage {stage} received rows per rank: unbalanced {plain_rows[stage].tolist()} "
              f"(max/mean {plain_rows[stage].max() * R / plain_rows[stage].sum():.3f}), balanced {rows[stage].tolist()} "
              f"(max/mean {rows[stage].max() * R / rows[stage].sum():.3f}); planner imbalance "
              f"{summary[stage]['imbalance_before_mean']:.3f} -> {summary[stage]['imbalance_after_mean']:.3f}, "
              f"{summary[stage]['replicas_mean']:.1f} replicas, {summary[stage]['bytes_moved']} bytes moved")
    print(f"outputs bitwise equal on every rank: {all(s for s, _ in all_same)}; "
          f"largest master-gradient relative difference {max(e for _, e in all_same):.2e}")
assert all(s for s, _ in all_same), "balanced outputs differ from the unbalanced ones"
assert max(e for _, e in all_same) < 1e-5, "balanced master gradients differ beyond fp32 reassociation"
assert rows.max() < plain_rows.max(), "balancing did not lower the busiest rank's rows"
print(f"rank {me}/{R} ({args.backend}): cupy_framework OK", flush=True)
