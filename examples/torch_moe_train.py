# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "numpy", "cupy-cuda13x", "torch"]
# ///
"""A small MoE transformer block stack trained in PyTorch, balanced by ``ultraep.Balancer``.

    mpirun -n 4 python -m mpi4py examples/torch_moe_train.py [--steps 4] [--tokens 1024]

Every rank holds M = E / R master experts of each of two MoE blocks (pre-norm, router,
top-k, experts = two-matrix ReLU MLPs run as one matmul pair per local slot over its
contiguous rows: masters, then replica slots). The router is skewed by a fixed bias
towards two hot experts. Each step runs forward, backward and SGD on the expert weights
twice -- unbalanced (tokens go to masters) and balanced (``update`` -> ``weight_sync`` ->
``reroute``; backward ``restore`` -> replica gradients -> ``reduce_grads``) -- from the
same initial weights. Token movement: the library's ``Dispatcher`` through its torch
autograd wrapper ``TokenRoute``.

Checked: with balancing the busiest rank receives at most 1% more (token, expert) rows
than the mean, every step and layer; the two loss curves agree within 1e-4 relative.
They are not bitwise equal: cuBLAS picks its fp32 GEMM kernel (and summation order) by
shape, and balancing changes how many rows each matmul sees; an expert's weight gradient
is summed per instance and the partial sums added in replica order; these rounding
differences then pass through the SGD updates of later steps.
"""

import argparse

import cupy
import torch
from mpi4py import MPI

from ultraep.integration import Balancer
from ultraep.planner import ExpertLayout
from ultraep.runtime.group import EPGroup
from ultraep.token import Dispatcher
from ultraep.token.torch_autograd import TokenRoute
from ultraep.transfer import ExpertSpec

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank and step")
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

group = EPGroup(MPI.COMM_WORLD)
if not group.has_gpu:
    raise SystemExit("torch_moe_train.py needs a GPU (use examples/cupy_framework.py on the CPU)")
R, me = group.size, group.rank
device = torch.device("cuda", group.device)
torch.cuda.set_device(device)
torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs, so the comparison measures ordering only

LAYERS, E, S, H, F, TOP_K, T = 2, 4 * R, 2, 64, 128, 2, args.tokens
layout = ExpertLayout(R, E, S)
M = layout.experts_per_rank
spec = ExpertSpec([("w_in", (H, F), "float32"), ("w_out", (F, H), "float32")], grad_dtype="float32")


def stream():
    return torch.cuda.current_stream(device)


def slot_rows(offsets):
    return [(slot, int(offsets[slot]), int(offsets[slot + 1])) for slot in range(len(offsets) - 1)
            if offsets[slot + 1] > offsets[slot]]


class Experts(torch.autograd.Function):
    """All local slots' MLPs over their rows of the receive buffer. Master slots use the
    parameters; replica slots the Balancer's replica buffers (refilled by ``restore`` in
    backward, since later layers reuse them). Master gradients: this rank's part plus
    the replicas', added by ``reduce_grads`` in replica order."""

    @staticmethod
    def forward(ctx, recv_x, w_in, w_out, block, handle, offsets):
        ctx.save_for_backward(recv_x, w_in, w_out)
        ctx.block, ctx.handle, ctx.offsets = block, handle, offsets
        y = torch.zeros_like(recv_x)
        for slot, begin, end in slot_rows(offsets):
            a, b = block.slot_weights(slot, handle, w_in, w_out)
            y[begin:end] = torch.relu(recv_x[begin:end] @ a) @ b
        return y

    @staticmethod
    def backward(ctx, grad_y):
        recv_x, w_in, w_out = ctx.saved_tensors
        block, handle = ctx.block, ctx.handle
        with cupy.cuda.Device(device.index):  # autograd runs backward in its own thread
            if handle is not None:
                block.balancer.restore(handle, stream=stream())
            grad_x = torch.zeros_like(recv_x)
            grads = [torch.zeros_like(w_in), torch.zeros_like(w_out)]
            replica_grads = block.balancer.replica_grads(handle) if handle is not None else []
            for slot_grads in replica_grads:  # reduce_grads adds every replica slot of the plan: no stale data
                for dst in slot_grads:
                    torch.from_dlpack(dst).zero_()
            for slot, begin, end in slot_rows(ctx.offsets):
                a, b = block.slot_weights(slot, handle, w_in, w_out)
                x, gy = recv_x[begin:end], grad_y[begin:end]
                pre = x @ a
                act = torch.relu(pre)
                grad_pre = (gy @ b.T) * (pre > 0)
                grad_x[begin:end] = grad_pre @ a.T
                if slot < M:
                    grads[0][slot], grads[1][slot] = x.T @ grad_pre, act.T @ gy
                else:  # the whole replica gradient; reduce_grads adds it into its master
                    for dst, g in zip(replica_grads[slot - M], (x.T @ grad_pre, act.T @ gy)):
                        torch.from_dlpack(dst).copy_(g)
            if handle is not None:
                for m in range(M):
                    for t in range(2):
                        block.grad_buffers[t][m].copy_(grads[t][m])
                block.balancer.reduce_grads(handle, stream=stream())
                grads = [g.clone() for g in block.grad_buffers]
        return grad_x, grads[0], grads[1], None, None, None


class MoEBlock(torch.nn.Module):
    def __init__(self, layer, balancer):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + layer)  # router and norm: the same on every rank
        self.layer, self.balancer = layer, balancer
        self.norm = torch.nn.LayerNorm(H).to(device).requires_grad_(False)
        self.router = (torch.randn(H, E, generator=gen) / H ** 0.5).to(device)
        self.skew = torch.zeros(E, device=device)
        self.skew[[layer % E, (layer + 5) % E]] = 2.5  # two hot experts
        mine = torch.Generator().manual_seed(100 * layer + me)
        self.w_in = torch.nn.Parameter((torch.randn(M, H, F, generator=mine) / H ** 0.5).to(device))
        self.w_out = torch.nn.Parameter((torch.randn(M, F, H, generator=mine) / F ** 0.5).to(device))
        common = dict(hidden=H, dtype="float32", top_k=TOP_K, max_tokens=T)
        if balancer is None:
            self.dispatcher = Dispatcher(group, num_experts=E, **common)
        else:
            self.dispatcher = Dispatcher.for_layout(group, layout, **common)
            self.grad_buffers = [torch.zeros_like(self.w_in), torch.zeros_like(self.w_out)]
            balancer.register_layer(layer, [[self.w_in.data[m], self.w_out.data[m]] for m in range(M)],
                                    [[self.grad_buffers[0][m], self.grad_buffers[1][m]] for m in range(M)])

    def slot_weights(self, slot, handle, w_in, w_out):
        if slot < M:
            return w_in[slot], w_out[slot]
        return [torch.from_dlpack(t) for t in self.balancer.replica_weights(handle)[slot - M]]

    def forward(self, x):
        h = self.norm(x)
        probs = torch.softmax(h @ self.router + self.skew, dim=-1)
        gates, ids = torch.topk(probs, TOP_K, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        handle = None
        if self.balancer is not None:
            handle = self.balancer.update(self.layer, ids)
            self.balancer.weight_sync(handle, stream=stream())
            ids = torch.from_dlpack(self.balancer.reroute(handle, ids)).long()
        route = TokenRoute(self.dispatcher)
        recv_x, _, counts, offsets = route.dispatch(h, ids, gates)
        offsets = offsets.tolist()
        y = Experts.apply(recv_x, self.w_in, self.w_out, self, handle, offsets)
        self.received_rows = offsets[-1]
        return x + route.combine(y, gates)


def train(balanced):
    balancer = (Balancer(group, layout, spec, num_layers=LAYERS, min_replica_tokens=16, sync_checks=False)
                if balanced else None)
    blocks = [MoEBlock(layer, balancer) for layer in range(LAYERS)]
    losses, rows = [], []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(10_000 * step + me)
        x = torch.randn(T, H, generator=gen).to(device)
        target = torch.randn(T, H, generator=gen).to(device)
        out = x
        for block in blocks:
            out = block(out)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for block in blocks:
                for p in (block.w_in, block.w_out):
                    p -= args.lr * p.grad
                    p.grad = None
        torch.cuda.synchronize()
        losses.append(sum(group.allgather(float(loss))) / R)
        rows.append([group.allgather(block.received_rows) for block in blocks])
    if balancer is not None:
        balancer.check()
        summary = balancer.stats().summary()
        balancer.close()
    for block in blocks:
        block.dispatcher.close()
    return losses, rows, summary if balanced else None


plain_losses, plain_rows, _ = train(balanced=False)
losses, rows, summary = train(balanced=True)
worst = max(max(r) * R / sum(r) for step in rows for r in step)
relative = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses))
if me == 0:
    for step in range(args.steps):
        print(f"step {step}: loss unbalanced {plain_losses[step]:.6f} balanced {losses[step]:.6f}; received rows "
              + "; ".join(f"layer {l}: {plain_rows[step][l]} -> {rows[step][l]}" for l in range(LAYERS)))
    print(f"balanced busiest rank / mean: {worst:.4f} (unbalanced "
          f"{max(max(r) * R / sum(r) for step in plain_rows for r in step):.4f}); loss curves differ by at most "
          f"{relative:.2e} relative; planner {summary['imbalance_before_mean']:.3f} -> "
          f"{summary['imbalance_after_mean']:.3f}, {summary['replicas_mean']:.1f} replicas, "
          f"stage medians (ms) " + ", ".join(f"{k[:-10]} {v:.3f}" for k, v in summary.items()
                                             if k.endswith("_ms_median")))
assert worst <= 1.01, f"balanced busiest rank is {worst:.4f} x the mean"
assert relative <= 1e-4, f"loss curves differ by {relative:.2e} relative"
print(f"rank {me}/{R} (cuda): torch_moe_train OK", flush=True)
