# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "numpy", "cupy-cuda13x", "torch"]
# ///
"""A small MoE transformer block stack trained in PyTorch on ``ultraep.MoELayer``.

    mpirun -n 4 python -m mpi4py examples/torch_moe_train.py [--steps 4] [--tokens 1024]

Every rank holds M = E / R master experts of each of two MoE blocks (pre-norm, a trained
router, top-k, BF16 SwiGLU experts). Each block's experts are one ``MoELayer`` -- dispatch,
the grouped GEMM over the expert-major receive buffer, SwiGLU, the grouped GEMM, combine
-- wrapped in a ``torch.autograd.Function``: forward is ``layer.forward``, backward
``layer.backward``, which returns the gradients of the tokens and of the gates (so the
router trains) and adds the expert weights' FP32 gradients into ``layer.grad_up`` /
``grad_down``. The expert parameters are zero-copy torch views of the layer's stacked
weights; SGD updates them in place. The router is skewed by a fixed bias towards two hot
experts. The same training runs twice from the same initial weights: unbalanced (tokens
go to the masters) and balanced (the layers share a ``Balancer``).

Checked: with balancing the busiest rank receives at most 1 % more (token, expert) rows
than the mean, every step and layer; at the first step the outputs of the two runs are
bitwise equal (0 differing elements) and so is the loss: the grouped GEMM computes each
row the same way wherever its expert runs. Later steps agree within 1e-3 relative: a
master's weight gradient is summed per instance with balancing, its partial sums added
in replica order, and the FP32 rounding differences pass through the BF16 weight updates.

Runs on the GPU (CUDA tensors, device backend) or, without one, on the CPU backend.
"""

import argparse

import torch
from mpi4py import MPI

from ultraep import Balancer, EPGroup, ExpertLayout, MoELayer
from ultraep.token.torch_autograd import to_torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank and step")
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

group = EPGroup(MPI.COMM_WORLD)
R, me = group.size, group.rank
device = torch.device("cuda", group.device) if group.has_gpu else torch.device("cpu")
if group.has_gpu:
    torch.cuda.set_device(device)

LAYERS, E, S, H, F, TOP_K, T = 2, 4 * R, 2, 64, 64, 2, args.tokens
layout = ExpertLayout(R, E, S)
M = layout.experts_per_rank


class MoE(torch.autograd.Function):
    """``y = layer(x, ids, gates)``; gradients of ``x`` and ``gates`` (the expert weights'
    go into the layer's ``grad_up`` / ``grad_down``)."""

    @staticmethod
    def forward(ctx, x, gates, ids, block):
        y, ctx.moe = block.layer.forward(x.detach(), ids, gates.detach().contiguous())
        ctx.block, ctx.gates_dtype = block, gates.dtype
        block.received_rows = ctx.moe.received.num_rows
        return to_torch(y)

    @staticmethod
    def backward(ctx, dy):
        dx, d_gates = ctx.block.layer.backward(ctx.moe, dy.contiguous())
        return to_torch(dx), to_torch(d_gates).to(ctx.gates_dtype), None, None


class MoEBlock(torch.nn.Module):
    def __init__(self, index, balancer):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + index)  # router and norm: the same on every rank
        self.norm = torch.nn.LayerNorm(H).to(device).requires_grad_(False)
        self.router = torch.nn.Parameter((torch.randn(H, E, generator=gen) / H ** 0.5).to(device))
        self.skew = torch.zeros(E, device=device)
        self.skew[[index % E, (index + 5) % E]] = 2.5  # two hot experts
        self.layer = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=TOP_K, max_tokens=T, balancer=balancer,
                              layer=index)
        mine = torch.Generator().manual_seed(100 * index + me)
        self.layer.load_weights((torch.randn(M, H, 2 * F, generator=mine) / H ** 0.5).bfloat16().to(device),
                                (torch.randn(M, F, H, generator=mine) / F ** 0.5).bfloat16().to(device))
        # The expert parameters: views of the layer's stacked BF16 weights and FP32 gradients.
        self.experts = [(to_torch(self.layer.w_up), to_torch(self.layer.grad_up)),
                        (to_torch(self.layer.w_down), to_torch(self.layer.grad_down))]

    def forward(self, x):
        h = self.norm(x)
        probs = torch.softmax(h @ self.router + self.skew, dim=-1)
        gates, ids = torch.topk(probs, TOP_K, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        return x + MoE.apply(h.bfloat16(), gates, ids, self).float()


def train(balanced):
    balancer = (Balancer(group, layout, MoELayer.expert_spec(H, F), num_layers=LAYERS, min_replica_tokens=16,
                         sync_checks=False) if balanced else None)
    blocks = [MoEBlock(index, balancer) for index in range(LAYERS)]
    losses, rows, first_out = [], [], None
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(10_000 * step + me)
        x = torch.randn(T, H, generator=gen).to(device)
        target = torch.randn(T, H, generator=gen).to(device)
        for block in blocks:
            block.layer.zero_grads()
        out = x
        for block in blocks:
            out = block(out)
        if first_out is None:
            first_out = out.detach().clone()
        loss = ((out - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for block in blocks:
                block.router -= args.lr * block.router.grad
                block.router.grad = None
                for weight, grad in block.experts:
                    weight.sub_(args.lr * grad)  # BF16 weights, FP32 gradients
        losses.append(sum(group.allgather(float(loss.detach()))) / R)
        rows.append([group.allgather(block.received_rows) for block in blocks])
    summary = None
    for block in blocks:
        block.layer.check()
        block.layer.close()
    if balancer is not None:
        summary = balancer.stats().summary()
        balancer.close()
    return losses, rows, first_out, summary


plain_losses, plain_rows, plain_out, _ = train(balanced=False)
losses, rows, out, summary = train(balanced=True)
worst = max(max(r) * R / sum(r) for step in rows for r in step)
relative = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses))
differing = sum(group.allgather(int((out.view(torch.int32) != plain_out.view(torch.int32)).sum())))
if me == 0:
    for step in range(args.steps):
        print(f"step {step}: loss unbalanced {plain_losses[step]:.6f} balanced {losses[step]:.6f}; received rows "
              + "; ".join(f"layer {l}: {plain_rows[step][l]} -> {rows[step][l]}" for l in range(LAYERS)))
    print(f"balanced busiest rank / mean: {worst:.4f} (unbalanced "
          f"{max(max(r) * R / sum(r) for step in plain_rows for r in step):.4f}); first step: {differing} output "
          f"elements differ; loss curves differ by at most {relative:.2e} relative; planner "
          f"{summary['imbalance_before_mean']:.3f} -> {summary['imbalance_after_mean']:.3f}, "
          f"{summary['replicas_mean']:.1f} replicas")
assert worst <= 1.01, f"balanced busiest rank is {worst:.4f} x the mean"
assert differing == 0 and losses[0] == plain_losses[0], f"first step: {differing} output elements differ"
assert relative <= 1e-3, f"loss curves differ by {relative:.2e} relative"
print(f"rank {me}/{R} ({device.type}): torch_moe_train OK", flush=True)
