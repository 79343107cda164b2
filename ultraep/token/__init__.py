"""Token path (UniEP): deterministic expert-parallel dispatch and combine.

* ``dispatcher``   -- :class:`Dispatcher` (the API, set-up bounds, collective input checks,
  the symmetric heap layout) and its handle/result types.
* ``reference``    -- the NumPy semantics: the single-process sequential reference and the
  arithmetic (stable key positions, row plan, slot-order sum, warp-order dot) every
  executor reproduces bit for bit.
* ``cpu_executor`` -- the protocol in NumPy over MPI shared memory (CPU backend).
* ``gpu_executor`` -- the protocol in CUDA kernels (``raw_kernels/dispatch.cu``) over the
  CUDA IPC heap.
* ``torch_autograd`` -- optional ``torch.autograd.Function`` wrappers (imports torch lazily).
"""

from ultraep.token.dispatcher import DispatchError, DispatchHandle, DispatchResult, Dispatcher, Traffic

__all__ = ["DispatchError", "DispatchHandle", "DispatchResult", "Dispatcher", "Traffic"]
