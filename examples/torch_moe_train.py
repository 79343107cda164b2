# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "numpy", "cupy-cuda13x", "torch"]
# ///
"""A small MoE transformer block stack trained in PyTorch on ``ultraep.MoELayer``.

    mpirun -n 4 python -m mpi4py examples/torch_moe_train.py [--steps 4] [--tokens 1024] [--fused]
                                                            [--weight-dtype float8_e4m3fn]

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
than the mean, every step and layer, or one smallest replica's rows more where 1 % is
fewer (a replica takes at least ``MIN_REPLICA`` rows, and only onto a rank with that much
room: below about 200 tokens a rank the planner stops a few rows above the mean); at the
first step the outputs of the two runs are bitwise equal (0 differing elements) and so
is the loss: the grouped GEMM computes each row the same way wherever its expert runs.
Later steps agree within 1e-3 relative: a master's weight gradient is summed per instance
with balancing, its partial sums added in replica order, and the FP32 rounding
differences pass through the BF16 weight updates.

``--fused``: each block's experts run as UniEP's fused persistent kernels
(``MoELayer(fused=True)``: dispatch + up-projection, down-projection + combine, and the
backward alike). A third run trains the balanced stack on the sequential layer, and every
step's loss and the first step's outputs must be bitwise the fused run's: the fused kernels
compute every output and gradient as the sequential path does.

FP8 variant (``--weight-dtype float8_e4m3fn`` or ``float8_e5m2``), DeepSeek-V3 style: the
experts' weights are FP8 with a float32 scale per 32 x 32 block (128 in DeepSeek-V3; these
matrices are small), trained through FP32 copies that are quantised again after each SGD
step. The FP8 weights and their scales are what the Balancer syncs to the replicas; each
slot's compute dequantises them (weight x its block's scale) and runs in torch between a
``TokenRoute`` dispatch and combine, the replicas' weight gradients going back through
``reduce_grads``. Checked besides: after every sync the replicas are byte-identical to
their masters (gathered from the ranks that own them), and the first step's outputs agree
within the BF16 rounding of the combined tokens (torch's products of a slot's rows are
not the same kernel for every row count).

Runs on the GPU (CUDA tensors, device backend) or, without one, on the CPU backend.
"""

import numpy as np

from ultraep.runtime.launch import JobArgumentParser, end_job, positive_int

try:
    import torch
except ModuleNotFoundError:
    end_job("needs PyTorch (pip install torch)", "examples/torch_moe_train.py")
from mpi4py import MPI

from ultraep import Balancer, Dispatcher, EPGroup, ExpertLayout, ExpertSpec, MoELayer
from ultraep.token.torch_autograd import TokenRoute, to_torch

parser = JobArgumentParser()
parser.add_argument("--steps", type=positive_int, default=4, help="training steps")
parser.add_argument("--tokens", type=positive_int, default=1024, help="tokens per rank and step")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn", "float8_e5m2"],
                    help="the experts' weights: BF16 (MoELayer) or FP8 with float32 block scales")
parser.add_argument("--fused", action="store_true",
                    help="MoELayer(fused=True): the fused persistent kernels, checked bitwise against the sequential "
                         "layer (BF16 weights)")
args = parser.parse_args()
if args.fused and args.weight_dtype != "bfloat16":
    parser.error("--fused runs MoELayer's fused kernels, which take BF16 expert weights")

group = EPGroup(MPI.COMM_WORLD)
R, me = group.size, group.rank
device = torch.device("cuda", group.device) if group.has_gpu else torch.device("cpu")
if group.has_gpu:
    torch.cuda.set_device(device)

LAYERS, E, S, H, F, TOP_K, T = 2, 4 * R, 2, 64, 64, 2, args.tokens
MIN_REPLICA = 16  # the fewest rows a replica may take (min_replica_tokens)
layout = ExpertLayout(R, E, S)
M = layout.experts_per_rank
FP8 = args.weight_dtype != "bfloat16"
BLOCK = 32  # edge of the square block one FP8 scale covers


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


def initial_weights(index):
    """This rank's masters of block ``index``: ``w_up [M, H, 2F]`` and ``w_down [M, F, H]``, FP32."""
    mine = torch.Generator().manual_seed(100 * index + me)
    return (torch.randn(M, H, 2 * F, generator=mine) / H ** 0.5, torch.randn(M, F, H, generator=mine) / F ** 0.5)


class BF16Experts:
    """A block's experts as one ``MoELayer``: BF16 weights, the library's grouped GEMM."""

    def __init__(self, index, balancer, fused):
        self.layer = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=TOP_K, max_tokens=T, balancer=balancer,
                              layer=index, fused=fused)
        self.layer.load_weights(*(w.bfloat16().to(device) for w in initial_weights(index)))
        # The expert parameters: views of the layer's stacked BF16 weights and FP32 gradients.
        self.params = [(to_torch(self.layer.w_up), to_torch(self.layer.grad_up)),
                       (to_torch(self.layer.w_down), to_torch(self.layer.grad_down))]

    def __call__(self, h, gates, ids):
        return MoE.apply(h, gates, ids, self)

    def zero_grads(self):
        self.layer.zero_grads()

    def after_backward(self):
        """The layer's backward already added every gradient into ``grad_up`` / ``grad_down``."""

    def step(self, lr):
        for weight, grad in self.params:
            weight.sub_(lr * grad)  # BF16 weights, FP32 gradients

    def close(self):
        self.layer.check()
        self.layer.close()


def fp8_spec():
    """One expert: FP8 ``w_up`` and ``w_down``, each followed by its float32 block scales."""
    return ExpertSpec([("w_up", (H, 2 * F), args.weight_dtype),
                       ("w_up_scale", (H // BLOCK, 2 * F // BLOCK), "float32", "w_up"),
                       ("w_down", (F, H), args.weight_dtype),
                       ("w_down_scale", (F // BLOCK, H // BLOCK), "float32", "w_down")], grad_dtype="float32")


def blockwise(scale):
    """Each block's scale repeated over the block's elements (the last two dimensions)."""
    return scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)


def as_bytes(tensor):
    """A tensor's bytes on the host (torch tensor, or a replica view CuPy/NumPy holds)."""
    if not isinstance(tensor, torch.Tensor):
        tensor = to_torch(tensor.view(np.uint8))
    return tensor.contiguous().view(torch.uint8).flatten().cpu().numpy()


class FP8Experts:
    """A block's experts as FP8 weights with float32 block scales, computed in torch: FP32
    copies take the SGD steps and are quantised into the FP8 tensors and scales that the
    Balancer syncs; each local slot (masters, then replica slots) dequantises its own."""

    def __init__(self, index, balancer):
        self.index, self.balancer, self.handle = index, balancer, None
        self.fp8_type = getattr(torch, args.weight_dtype)
        self.fp32 = [w.to(device) for w in initial_weights(index)]
        self.fp8 = [torch.empty(w.shape, dtype=self.fp8_type, device=device) for w in self.fp32]
        self.scales = [torch.empty(M, w.shape[1] // BLOCK, w.shape[2] // BLOCK, device=device) for w in self.fp32]
        self.grads = [torch.zeros_like(w) for w in self.fp32]
        scale_grads = [torch.zeros_like(s) for s in self.scales]  # scales are not trained: they stay zero
        self.quantise()
        common = dict(hidden=H, dtype="bfloat16", top_k=TOP_K, max_tokens=T)
        if balancer is None:
            self.dispatcher = Dispatcher(group, num_experts=E, **common)
        else:
            self.dispatcher = Dispatcher.for_layout(group, layout, **common)
            balancer.register_layer(index, [self.expert_tensors(m) for m in range(M)],
                                    [[self.grads[0][m], scale_grads[0][m], self.grads[1][m], scale_grads[1][m]]
                                     for m in range(M)])
        self.checked_bytes = self.differing_bytes = 0

    def expert_tensors(self, m):
        """Master ``m``'s tensors in the spec's order (views: quantise writes through them)."""
        return [self.fp8[0][m], self.scales[0][m], self.fp8[1][m], self.scales[1][m]]

    def quantise(self):
        """Each block's largest magnitude maps to the format's largest; written in place."""
        largest = torch.finfo(self.fp8_type).max
        for w, q, scale in zip(self.fp32, self.fp8, self.scales):
            blocks = w.reshape(M, w.shape[1] // BLOCK, BLOCK, w.shape[2] // BLOCK, BLOCK).abs().amax(dim=(2, 4))
            scale.copy_(blocks.clamp(min=1e-12) / largest)
            q.copy_((w / blockwise(scale)).clamp(-largest, largest).to(self.fp8_type))

    def check_replicas(self, replicas):
        """Count the bytes of this rank's replica slots that differ from their masters."""
        masters = [expert for rank in group.allgather([np.concatenate([as_bytes(t) for t in self.expert_tensors(m)])
                                                       for m in range(M)]) for expert in rank]
        for slot, expert in enumerate(self.balancer.local_experts(self.handle).tolist()[M:]):
            if expert >= 0:
                got = np.concatenate([as_bytes(t) for t in replicas[slot]])
                self.checked_bytes += got.size
                self.differing_bytes += int(np.count_nonzero(got != masters[expert]))

    def __call__(self, h, gates, ids):
        """Dispatch, each local slot's SwiGLU on its dequantised weights, combine."""
        slots, replicas = ids, []
        if self.balancer is not None:
            self.handle = self.balancer.update(self.index, ids)
            self.balancer.weight_sync(self.handle)
            stream = torch.cuda.current_stream() if ids.is_cuda else None  # where the update ran (ids')
            slots = to_torch(self.balancer.reroute(self.handle, stream=stream))
            views = self.balancer.replica_weights(self.handle)  # waits for the sync
            self.check_replicas(views)
            replicas = [[to_torch(v.view(np.uint8)).view(self.fp8_type) if t % 2 == 0 else to_torch(v)
                         for t, v in enumerate(slot)] for slot in views]
        route = TokenRoute(self.dispatcher)
        recv_x, _, _, offsets = route.dispatch(h, slots, gates)
        offsets = offsets.tolist()
        self.received_rows = offsets[-1]
        self.leaves, ys = {}, []
        for slot in range(len(offsets) - 1):
            rows = recv_x[offsets[slot]:offsets[slot + 1]].float()
            if len(rows):
                tensors = self.expert_tensors(slot) if slot < M else replicas[slot - M]
                w_up, w_down = self.leaves[slot] = [(q.float() * blockwise(s)).requires_grad_()
                                                     for q, s in (tensors[:2], tensors[2:])]
                gate, up = (rows @ w_up).chunk(2, dim=-1)
                ys.append((torch.nn.functional.silu(gate) * up) @ w_down)
        ys.append(recv_x.new_zeros(len(recv_x) - offsets[-1], H, dtype=torch.float32))
        return route.combine(torch.cat(ys).bfloat16(), gates)

    def zero_grads(self):
        for grad in self.grads:
            grad.zero_()

    def after_backward(self):
        """Masters' weight gradients added here; replicas' into their slots, then reduced into
        the masters (``restore`` first: a later block's sync has reused the replica slots)."""
        if self.balancer is not None:
            self.balancer.restore(self.handle)
            replica_grads = self.balancer.replica_grads(self.handle)
        for slot, leaves in self.leaves.items():
            for t, leaf in enumerate(leaves):
                if slot < M:
                    self.grads[t][slot] += leaf.grad
                else:
                    to_torch(replica_grads[slot - M][2 * t]).copy_(leaf.grad)  # reduce_grads adds it
        if self.balancer is not None:
            self.balancer.reduce_grads(self.handle)

    def step(self, lr):
        for weight, grad in zip(self.fp32, self.grads):
            weight.sub_(lr * grad)
        self.quantise()

    def close(self):
        self.dispatcher.check()
        self.dispatcher.close()


class MoEBlock(torch.nn.Module):
    def __init__(self, index, balancer, fused):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + index)  # router and norm: the same on every rank
        self.norm = torch.nn.LayerNorm(H).to(device).requires_grad_(False)
        self.router = torch.nn.Parameter((torch.randn(H, E, generator=gen) / H ** 0.5).to(device))
        self.skew = torch.zeros(E, device=device)
        self.skew[[index % E, (index + 5) % E]] = 2.5  # two hot experts
        self.experts = FP8Experts(index, balancer) if FP8 else BF16Experts(index, balancer, fused)

    def forward(self, x):
        h = self.norm(x)
        probs = torch.softmax(h @ self.router + self.skew, dim=-1)
        gates, ids = torch.topk(probs, TOP_K, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        return x + self.experts(h.bfloat16(), gates, ids).float()


def train(balanced, fused=args.fused):
    spec = fp8_spec() if FP8 else MoELayer.expert_spec(H, F)
    balancer = (Balancer(group, layout, spec, num_layers=LAYERS, min_replica_tokens=MIN_REPLICA, sync_checks=False)
                if balanced else None)
    blocks = [MoEBlock(index, balancer, fused) for index in range(LAYERS)]
    losses, rows, first_out = [], [], None
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(10_000 * step + me)
        x = torch.randn(T, H, generator=gen).to(device)
        target = torch.randn(T, H, generator=gen).to(device)
        for block in blocks:
            block.experts.zero_grads()
        out = x
        for block in blocks:
            out = block(out)
        if first_out is None:
            first_out = out.detach().clone()
        loss = ((out - target) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for block in blocks:
                block.experts.after_backward()
                block.router -= args.lr * block.router.grad
                block.router.grad = None
                block.experts.step(args.lr)
        losses.append(sum(group.allgather(float(loss.detach()))) / R)
        rows.append([group.allgather(block.experts.received_rows) for block in blocks])
    summary = None
    if FP8 and balanced:
        summary = {"checked": sum(group.allgather(sum(b.experts.checked_bytes for b in blocks))),
                   "differing": sum(group.allgather(sum(b.experts.differing_bytes for b in blocks)))}
    for block in blocks:
        block.experts.close()
    if balancer is not None:
        summary = {**balancer.stats().summary(), **(summary or {})}
        balancer.close()
    return losses, rows, first_out, summary


plain_losses, plain_rows, plain_out, _ = train(balanced=False)
losses, rows, out, summary = train(balanced=True)
worst = max(max(r) * R / sum(r) for step in rows for r in step)
bound = max(1.01, 1 + MIN_REPLICA / (T * TOP_K))  # a rank's mean rows: T * TOP_K
relative = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses))
differing = sum(group.allgather(int((out.view(torch.int32) != plain_out.view(torch.int32)).sum())))
deviation = max(group.allgather(float((out - plain_out).abs().max() / plain_out.abs().max())))
if me == 0:
    for step in range(args.steps):
        print(f"step {step}: loss unbalanced {plain_losses[step]:.6f} balanced {losses[step]:.6f}; received rows "
              + "; ".join(f"layer {l}: {plain_rows[step][l]} -> {rows[step][l]}" for l in range(LAYERS)))
    print(f"balanced busiest rank / mean: {worst:.4f} (unbalanced "
          f"{max(max(r) * R / sum(r) for step in plain_rows for r in step):.4f}); first step: {differing} output "
          f"elements differ; loss curves differ by at most {relative:.2e} relative; planner "
          f"{summary['imbalance_before_mean']:.3f} -> {summary['imbalance_after_mean']:.3f}, "
          f"{summary['replicas_mean']:.1f} replicas")
    if FP8:
        print(f"{args.weight_dtype} experts: after every sync {summary['differing']} of {summary['checked']} replica "
              f"bytes differ from their masters; first step: outputs within {deviation:.1e} of the largest")
assert worst <= bound, f"balanced busiest rank is {worst:.4f} x the mean (at most {bound:.4f})"
if FP8:
    assert summary["checked"] > 0 and summary["differing"] == 0, f"replicas: {summary['differing']} bytes differ"
    assert deviation <= 1e-2, f"first step: outputs differ by {deviation:.1e} of the largest"
else:
    assert differing == 0 and losses[0] == plain_losses[0], f"first step: {differing} output elements differ"
assert relative <= 1e-3, f"loss curves differ by {relative:.2e} relative"
if args.fused:
    sequential_losses, _, sequential_out, _ = train(balanced=True, fused=False)
    fused_differing = sum(group.allgather(int((out.view(torch.int32) != sequential_out.view(torch.int32)).sum())))
    if me == 0:
        print(f"fused against sequential (balanced): first step {fused_differing} output elements differ; losses "
              f"equal at {sum(a == b for a, b in zip(losses, sequential_losses))} of {args.steps} steps")
    assert fused_differing == 0 and losses == sequential_losses, "the fused layer trained differently"
print(f"rank {me}/{R} ({device.type}): torch_moe_train OK", flush=True)
