"""One micro-batch of one balanced MoE layer, forward and backward, on the CPU backend.

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py examples/layer_step.py

The code below this docstring is the README's "A balanced MoE layer" snippet, character for
character. On GPUs the same calls take CuPy or PyTorch tensors (drop ``use_gpu=False``).
"""
from mpi4py import MPI
import numpy as np
from ml_dtypes import bfloat16
import ultraep
from ultraep.compute import grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad

group = ultraep.EPGroup(MPI.COMM_WORLD, use_gpu=False)
R, E, S, H, T, K = group.size, 4 * group.size, 2, 64, 256, 2  # ranks, experts, replica slots, hidden, tokens, top-k
layout = ultraep.ExpertLayout(num_ranks=R, num_experts=E, redundant_slots=S)
M = layout.experts_per_rank                                   # masters per rank: expert e lives on rank e // M
spec = ultraep.ExpertSpec([("w", (H, H), "bfloat16")], grad_dtype="float32")  # one H x H matrix per expert
rng = np.random.default_rng(group.rank)
weights = [[(rng.standard_normal((H, H)) / 8).astype(bfloat16)] for _ in range(M)]  # [master][tensor]
grads = [[np.zeros((H, H), np.float32)] for _ in range(M)]
token_args = dict(hidden=H, dtype="bfloat16", top_k=K, max_tokens=T)
need = (ultraep.Balancer.heap_requirements(layout, spec)      # one heap for the Balancer and the Dispatcher
        + ultraep.Dispatcher.heap_requirements(R, num_experts=layout.num_physical,
                                               experts_per_rank=layout.slots_per_rank, **token_args))
with ultraep.open_heap(group, need) as heap, \
        ultraep.Balancer(group, layout, spec, num_layers=1, min_replica_tokens=16, heap=heap) as bal, \
        ultraep.Dispatcher.for_layout(group, layout, heap=heap, **token_args) as disp:
    bal.register_layer(0, weights, grads)
    x = rng.standard_normal((T, H)).astype(bfloat16)
    hot = -np.log(np.arange(1, E + 1))      # a skewed router: expert 0 is the hottest, so rank 0 is overloaded
    topk_ids = np.argsort(rng.gumbel(size=(T, E)) + hot, axis=1)[:, -K:].copy()  # K distinct experts per token
    gates = np.full((T, K), 1 / K, np.float32)
    # forward
    h = bal.update(0, topk_ids)             # gathers every rank's exact load, plans (the same plan on every rank)
    sync = bal.weight_sync(h)               # copies hot experts' weights into replica slots (GPU: stream=side
                                            # where ultraep.integration.sync_beside_pays(group), else in series:
                                            # then update(0, topk_ids, weight_sync=True) starts it behind the plan)
    slot_ids = bal.reroute(h)              # update's logical expert ids -> physical slot ids
    recv = disp.dispatch(x, slot_ids, gates)  # expert-major rows: local slot j owns rows offsets[j]:offsets[j+1]
    for s in range(S):                      # GPU: dispatch and the masters' compute run while replicas arrive;
        sync.wait(s)                        # replica slot s's compute waits for its own chunks (stream=compute)
    w = np.stack([m[0] for m in weights] + [r[0] for r in bal.replica_weights(h, wait=False)])  # masters, replicas
    y = grouped_mm(recv.x, w, recv.offsets)
    out = disp.combine(y, recv.handle)      # per token: gate-weighted sum of its K experts' outputs
    # backward of sum(out)
    grad_y, grad_gates = disp.combine_backward(np.ones_like(out), y, recv.handle)
    grad_x = disp.dispatch_backward(grouped_mm_dgrad(grad_y, w, recv.offsets), recv.handle)
    grad_w = grouped_mm_wgrad(recv.x, grad_y, recv.offsets, out=np.zeros((M + S, H, H), np.float32))
    for m in range(M):
        grads[m][0] += grad_w[m]            # masters' gradients: the framework's own memory
    for s, replica in enumerate(bal.replica_grads(h)):
        replica[0][...] = grad_w[M + s]     # every replica slot, zeros where it served no rows
    bal.reduce_grads(h)                     # each master's gradient += its replicas' (replica order, fp32)
    record = bal.stats().records[-1]
    assert recv.num_rows == record.rank_load_after[group.rank]  # this rank computes exactly its planned rows
    print(f"rank {group.rank}: rows per rank {record.rank_load_before.tolist()} unbalanced, "
          f"{record.rank_load_after.tolist()} balanced", flush=True)
# here the heap is closed: views into it (replica_weights, replica_grads, recv.x) must not be used again
