"""torch autograd through TokenRoute on several ranks, against dense torch autograd of the
same layer (float32, tolerance: the orders of summation differ).

Usage: python -m mpi4py autograd_check.py {cpu|cuda}; prints "[autograd] rank N OK".
"""

import sys

import torch
from mpi4py import MPI

from ultraep.runtime.group import EPGroup
from ultraep.token import Dispatcher
from ultraep.token.torch_autograd import TokenRoute

backend = sys.argv[1]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
E, K, H, T = 4 * R, 3, 32, 20
device = f"cuda:{group.device}" if backend == "device" else "cpu"
gen = torch.Generator().manual_seed(10 + me)
x = torch.randn(T, H, generator=gen).to(device).requires_grad_()
ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
gates = torch.rand(T, K, generator=gen).to(device).requires_grad_()
scale = 1.0 + torch.arange(E, dtype=torch.float32, device=device) / 8   # expert e multiplies by scale[e]
grad_out = torch.randn(T, H, generator=gen).to(device)

with Dispatcher(group, hidden=H, dtype="float32", top_k=K, num_experts=E, max_tokens=T, backend=backend) as disp:
    route = TokenRoute(disp)
    recv_x, recv_w, counts, offsets = route.dispatch(x, ids, gates)
    rows = int(offsets[-1])
    local_experts = me * (E // R) + torch.repeat_interleave(torch.arange(E // R, device=device), counts.long())
    factor = torch.ones(recv_x.shape[0], device=device)
    factor[:rows] = scale[local_experts]
    out = route.combine(recv_x * factor[:, None], gates)
    (out * grad_out).sum().backward()

x_ref = x.detach().clone().requires_grad_()
gates_ref = gates.detach().clone().requires_grad_()
dense = (gates_ref[:, :, None] * x_ref[:, None, :] * scale[ids][:, :, None]).sum(dim=1)
(dense * grad_out).sum().backward()
torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(gates.grad, gates_ref.grad, rtol=1e-5, atol=1e-5)
print(f"[autograd] rank {me} OK", flush=True)
