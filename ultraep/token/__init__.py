"""Token path (UniEP): deterministic expert-parallel dispatch and combine.

* ``dispatcher``   -- :class:`Dispatcher`, the API: set-up bounds, what it needs in a heap
  (:meth:`Dispatcher.heap_requirements`), the choice of implementation.
* ``base``         -- what the dispatcher and its implementations share: the frozen
  configuration, the heap buffers, the handle/result types, the input checks.
* ``host``         -- :class:`~ultraep.token.host.HostDispatcher`: the protocol in NumPy over
  MPI shared memory (the host backend).
* ``device``       -- :class:`~ultraep.token.device.DeviceDispatcher`: the protocol in CUDA
  kernels (``raw_kernels/dispatch.cu``) over the CUDA IPC heap.
* ``reference``    -- the NumPy semantics: the single-process sequential reference and the
  arithmetic (stable key positions, row plan, slot-order sum, warp-order dot) both
  implementations reproduce bit for bit.
* ``torch_autograd`` -- optional ``torch.autograd.Function`` wrappers (imports torch lazily).
"""

from ultraep.errors import DispatchError
from ultraep.token.base import DispatchHandle, DispatchResult, Traffic
from ultraep.token.dispatcher import Dispatcher

__all__ = ["DispatchError", "DispatchHandle", "DispatchResult", "Dispatcher", "Traffic"]
