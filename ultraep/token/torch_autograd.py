"""Optional PyTorch autograd for the Dispatcher; torch is imported on first use only.

    route = TokenRoute(dispatcher)
    recv_x, recv_w, counts, offsets = route.dispatch(x, expert_ids, gates)
    y = experts(recv_x, counts, offsets)       # any differentiable torch code, [max_recv_rows, H]
    out = route.combine(y, gates)              # [T, H]

Gradients: ``x`` receives :meth:`Dispatcher.dispatch_backward` of ``recv_x``'s gradient,
``y`` and ``gates`` receive :meth:`Dispatcher.combine_backward`'s. The received gates
``recv_w`` carry no gradient (the gates get theirs through combine), nor do the counts
and offsets. One ``TokenRoute`` serves one dispatch/combine pair; make a new one per
micro-batch and layer (it holds the dispatch handle until backward has run).
"""

from __future__ import annotations

import functools

import numpy as np

from ultraep.errors import DispatchError
from ultraep.token.dispatcher import Dispatcher


def to_torch(array):
    """A CuPy/NumPy result as a torch tensor, zero-copy; bf16 crosses as its 16-bit pattern."""
    import torch

    is_bf16 = np.dtype(array.dtype).kind == "V"
    raw = array.view(np.int16) if is_bf16 else array
    tensor = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
    return tensor.view(torch.bfloat16) if is_bf16 else tensor


class TokenRoute:
    """Dispatch then combine with autograd; see the module docstring."""

    def __init__(self, dispatcher: Dispatcher):
        if not isinstance(dispatcher, Dispatcher):
            raise DispatchError("TokenRoute: dispatcher must be an ultraep Dispatcher, "
                                f"got {type(dispatcher).__name__}")
        self.dispatcher = dispatcher
        self.handle = None

    def dispatch(self, x, expert_ids, gates):
        return _functions().Dispatch.apply(x, expert_ids, gates, self)

    def combine(self, y, gates):
        if self.handle is None:
            raise DispatchError("TokenRoute.combine needs a dispatch first: call route.dispatch(x, expert_ids, gates)")
        return _functions().Combine.apply(y, gates, self)


@functools.lru_cache(maxsize=None)
def _functions():
    import torch

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, expert_ids, gates, route):
            result = route.dispatcher.dispatch(x.detach(), expert_ids.detach(), gates.detach())
            route.handle = result.handle
            ctx.dispatcher, ctx.handle = route.dispatcher, result.handle
            outputs = tuple(to_torch(a) for a in (result.x, result.weights, result.counts, result.offsets))
            ctx.mark_non_differentiable(*outputs[1:])
            return outputs

        @staticmethod
        def backward(ctx, grad_recv, *_):
            grad_x = ctx.dispatcher.dispatch_backward(grad_recv.contiguous(), ctx.handle)
            return to_torch(grad_x), None, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, gates, route):
            ctx.dispatcher, ctx.handle, ctx.gates_dtype = route.dispatcher, route.handle, gates.dtype
            ctx.save_for_backward(y)
            return to_torch(route.dispatcher.combine(y.detach().contiguous(), route.handle))

        @staticmethod
        def backward(ctx, grad_out):
            (y,) = ctx.saved_tensors
            grad_y, grad_gates = ctx.dispatcher.combine_backward(grad_out.contiguous(), y.detach(), ctx.handle)
            return to_torch(grad_y), to_torch(grad_gates).to(ctx.gates_dtype), None

    return type("TokenFunctions", (), {"Dispatch": Dispatch, "Combine": Combine})
