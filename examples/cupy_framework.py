# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "mpich", "numpy"]
# ///
"""A two-layer MoE model in a framework written only in NumPy (CPU backend) or CuPy (GPU),
balanced by ``ultraep.Balancer``, run as a 2-stage 1F1B pipeline with several
micro-batches in flight (stage s holds MoE layer s; both stages live in every process).

    mpiexec -n 4 python -m mpi4py examples/cupy_framework.py [--backend host|device] [--micro-batches 4]

Each rank holds M = E / R master experts per layer (a two-matrix ReLU MLP each). The
router is skewed: a few hot experts get most tokens. Every micro-batch runs twice --
unbalanced (tokens go to masters) and balanced (``update`` -> ``weight_sync`` ->
``reroute`` -> replicas compute with the synced weights; backward ``restore`` ->
replica gradients -> ``reduce_grads``). Token movement: the library's ``Dispatcher``.

What it prints and checks: received rows per rank per micro-batch without and with
balancing; outputs of the balanced run bitwise equal to the unbalanced one (every row goes
through the same row-wise expert function; combine sums in a fixed slot order); master
gradients bitwise equal to an unbalanced run that sums each expert's rows in the same
per-instance partial sums (the same reduction over the same rows, added in replica order,
as ``reduce_grads`` does), and within 1e-5 relative of plain per-expert sums -- not
bitwise, since splitting a sum over rows into partial sums reassociates fp32 additions.
"""

from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.analysis.plots import plot_rank_loads
from ultraep.integration import Balancer
from ultraep.integration.pipeline import max_in_flight, one_f_one_b
from ultraep.planner import ExpertLayout
from ultraep.runtime.group import EPGroup
from ultraep.token import Dispatcher
from ultraep.transfer import ExpertSpec
from ultraep.runtime.launch import JobArgumentParser, no_gpu_error, positive_int

parser = JobArgumentParser()
parser.add_argument("--backend", default="host", choices=["host", "device"])
parser.add_argument("--micro-batches", type=positive_int, default=4, help="micro-batches through the layer")
parser.add_argument("--tokens", type=positive_int, default=128, help="tokens per rank and micro-batch")
parser.add_argument("--out", type=Path, default=None, help="directory for the load trace and plot (rank 0)")
args = parser.parse_args()
if (error := no_gpu_error(args.backend, None)) is not None:
    parser.error(error)

group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend == "device")
R, me = group.size, group.rank
if args.backend == "device":
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
    """``(grad_x, factors)``; :func:`weight_grads` of the factors (or of a subset of their rows)."""
    x, pre, act = cache
    grad_pre = rows_times(grad_y, w_out.T) * (pre > 0)
    return rows_times(grad_pre, w_in.T), (x, grad_pre, act, grad_y)


def weight_grads(x, grad_pre, act, grad_y):
    """``(grad_w_in, grad_w_out)``: sums over the rows of outer products, as one reduction
    whose order depends only on the rows (a GEMM's kernel choice may also depend on
    pointer alignment), so the same rows in the same order give the same bits."""
    return (x[:, :, None] * grad_pre[:, None, :]).sum(axis=0), (act[:, :, None] * grad_y[:, None, :]).sum(axis=0)


def instance_rows(plan, expert):
    """For each instance of ``expert`` under ``plan``, the rows it serves, as positions in
    the expert's unbalanced receive rows (sources in rank order, each source's tokens in
    order): reroute sends a source's k-th token for the expert to the instance whose
    split prefix first exceeds k."""
    loads = plan.loads[:, expert].astype(np.int64)
    starts = np.cumsum(loads) - loads
    count = int(plan.replica_count[expert])
    prefix = np.concatenate([np.zeros((R, 1), np.int64), plan.split_prefix[:, expert, :count]], axis=1)
    return [np.concatenate([np.arange(starts[s] + prefix[s, i], starts[s] + prefix[s, i + 1]) for s in range(R)])
            for i in range(count)]


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

    def __init__(self, stage, balancer, instance_plans=None):
        # instance_plans (unbalanced model only): sum each master's weight gradient as the
        # balanced run did -- per instance of that run's plan, added in replica order.
        self.stage, self.bal, self.instance_plans = stage, balancer, instance_plans
        self.plans = {}  # balanced: micro-batch -> plan (host copy), for the comparison
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
            self.plans[mb] = self.bal.plan(handle).to_numpy()
            self.bal.weight_sync(handle)
            ids = self.bal.reroute(handle)
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
                if slot >= M:  # reduce_grads adds every replica slot of the plan: never leave stale data
                    for dst in replica_grads[slot - M]:
                        dst[...] = 0
                continue
            rows = slice(int(offsets[slot]), int(offsets[slot + 1]))
            grad_recv[rows], factors = expert_backward(grad_y[rows], caches[slot], *weights)
            if slot >= M:
                for dst, grad in zip(replica_grads[slot - M], weight_grads(*factors)):
                    dst[...] = grad  # reduce_grads adds it into the master
                continue
            if self.instance_plans is None:
                parts = [weight_grads(*factors)]
            else:
                plan = self.instance_plans[(self.stage, mb)]
                parts = [weight_grads(*(f[xp.asarray(rows)] for f in factors))
                         for rows in instance_rows(plan, me * M + slot)]
            for part in parts:
                for t, grad in enumerate(part):
                    self.grads[slot][t] += grad
        if self.bal is not None:
            self.bal.reduce_grads(handle)
        return self.dispatcher.dispatch_backward(grad_recv, received.handle)


def run(balanced, instance_plans=None):
    """The 1F1B pipeline over all micro-batches; returns outputs, master gradients, rows per
    rank, the balancers' summaries and (balanced) the plans."""
    order = one_f_one_b(STAGES, args.micro_batches)
    balancers = [Balancer(group, layout, spec, num_layers=1, min_replica_tokens=8, backend=args.backend,
                          max_in_flight=max_in_flight(order, s), record_trace=True) if balanced else None
                 for s in range(STAGES)]
    stages = [MoEStage(s, balancers[s], instance_plans) for s in range(STAGES)]
    inputs = {mb: xp.asarray(np.random.default_rng((99, mb, me)).standard_normal((T, H)).astype(np.float32))
              for mb in range(args.micro_batches)}
    activations, grads, outputs, rows = dict(inputs), {}, {}, {}
    for stage, kind, mb in order:
        if kind == "F":
            activations[mb], received_rows = stages[stage].forward(mb, activations[mb])
            rows[(stage, mb)] = np.array(group.allgather(received_rows))
            if stage == STAGES - 1:
                outputs[mb] = to_host(activations[mb])
                grads[mb] = activations[mb] / np.float32(T)  # loss = sum(out^2) / (2T)
        else:
            grads[mb] = stages[stage].backward(mb, grads[mb])
    master_grads = [to_host(g) for st in stages for per_expert in st.grads for g in per_expert]
    plans = {(st.stage, mb): plan for st in stages for mb, plan in st.plans.items()}
    summary = None
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
    return outputs, master_grads, rows, summary, plans


def worst_ratio(rows):
    """Largest max/mean of received rows over ranks, over every (stage, micro-batch)."""
    return max(float(r.max()) * R / float(r.sum()) for r in rows.values())


def relative_difference(a, b):
    return max(float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-30) for x, y in zip(a, b))


out, grads, rows, summary, plans = run(balanced=True)
plain_out, plain_grads, plain_rows, _, _ = run(balanced=False)
_, partitioned_grads, _, _, _ = run(balanced=False, instance_plans=plans)
checks = group.allgather((all(np.array_equal(out[mb], plain_out[mb]) for mb in out),
                          all(np.array_equal(g, p) for g, p in zip(grads, partitioned_grads)),
                          relative_difference(grads, plain_grads)))
outputs_equal, grads_equal = all(c[0] for c in checks), all(c[1] for c in checks)
grad_error = max(c[2] for c in checks)
if me == 0:
    for (stage, mb), plain in sorted(plain_rows.items()):
        print(f"stage {stage} micro-batch {mb}: received rows per rank {plain.tolist()} -> "
              f"{rows[(stage, mb)].tolist()}")
    print(f"busiest rank / mean over micro-batches: unbalanced {worst_ratio(plain_rows):.3f}, balanced "
          f"{worst_ratio(rows):.3f}; " + "; ".join(
              f"stage {s}: planner {m['imbalance_before_mean']:.3f} -> {m['imbalance_after_mean']:.3f}, "
              f"{m['replicas_mean']:.1f} replicas, {m['bytes_moved']} bytes moved" for s, m in enumerate(summary)))
    print(f"outputs bitwise equal to the unbalanced run: {outputs_equal}")
    print(f"master gradients bitwise equal to the unbalanced run summing each expert's rows per instance of the "
          f"plan, in replica order: {grads_equal}; against plain per-expert sums: {grad_error:.2e} relative")
assert outputs_equal, "balanced outputs differ from the unbalanced ones"
assert grads_equal, "balanced master gradients differ from the same partial sums without replication"
assert grad_error < 1e-5, "balanced master gradients differ beyond fp32 reassociation"
assert worst_ratio(rows) < worst_ratio(plain_rows), "balancing did not lower the busiest rank's rows"
print(f"rank {me}/{R} ({args.backend}): cupy_framework OK", flush=True)
