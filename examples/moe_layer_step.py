"""README's whole-layer snippet: one balanced MoE layer forward and backward on the CPU backend.

    mpiexec -n 4 python -m mpi4py examples/moe_layer_step.py
"""
from mpi4py import MPI
import numpy as np
from ml_dtypes import bfloat16
import ultraep

group = ultraep.EPGroup(MPI.COMM_WORLD, use_gpu=False)
R, E, S, H, F, T, K = group.size, 4 * group.size, 2, 64, 32, 256, 2  # ranks, experts, slots, hidden, ffn, tokens, top-k
layout = ultraep.ExpertLayout(num_ranks=R, num_experts=E, redundant_slots=S)
M = layout.experts_per_rank
rng = np.random.default_rng(group.rank)
spec = ultraep.MoELayer.expert_spec(H, F)  # SwiGLU experts: w_up [H, 2F], w_down [F, H] in bf16, fp32 gradients
with ultraep.Balancer(group, layout, spec, num_layers=1, min_replica_tokens=16) as bal, \
        ultraep.MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=bal) as layer:
    layer.load_weights((rng.standard_normal((M, H, 2 * F)) / 8).astype(bfloat16),  # this rank's masters
                       (rng.standard_normal((M, F, H)) / 6).astype(bfloat16))
    x = rng.standard_normal((T, H)).astype(bfloat16)
    hot = -np.log(np.arange(1, E + 1))      # a skewed router: expert 0 is the hottest, so rank 0 is overloaded
    topk_ids = np.argsort(rng.gumbel(size=(T, E)) + hot, axis=1)[:, -K:].copy()
    gates = np.full((T, K), 1 / K, np.float32)
    y, ctx = layer.forward(x, topk_ids, gates)  # update, weight_sync, reroute, dispatch, grouped GEMMs, combine
    dx, d_gates = layer.backward(ctx, np.ones_like(y))  # dx, gate gradients; weight grads += layer.grad_up/down
    rows = group.allgather(ctx.received.num_rows)
    print(f"rank {group.rank}: rows per rank {rows} balanced, |grad_up| {float(np.abs(layer.grad_up).sum()):.4g}",
          flush=True)
