"""Data plane: moving expert weights to replicas and replica gradients back to masters.

* ``spec``     -- what one expert's tensors look like (shapes, weight and gradient dtypes)
  and how they pack into a replica slot.
* ``schedule`` -- the task compiler: from a plan, the tile transfers each rank performs,
  relay trees for hot experts, and the gradient-reduction tiles.
* ``engine``   -- :class:`WeightTransfer`, the public object: replica buffers in the
  symmetric heap, per-layer registration of masters, weight sync, restore and gradient
  reduction, each done by the heap's backend:
* ``agreement`` -- every rank holds the same plan for the same layer before a transfer:
  plan hashes compared by a host collective, or on the device (``raw_kernels/agree.cu``);
* ``slot_copy`` -- :class:`FilledSlotCopy`: whole replica slots copied or zeroed only where
  a plan fills them (``MoELayer``'s copy of the replica weights and gradients);
* ``prepared`` -- ``PreparedSync``, a sync counted and checked whose launch comes later
  (at once, or captured in a CUDA graph), as both backends return it;
* ``host``     -- ``HostTransfer``, the NumPy executor of a schedule over the host heap
  (the CPU backend and the reference for the kernels);
* ``device``   -- ``DeviceTransfer``, the kernels of ``raw_kernels/transfer.cu``, on task
  tables that ``device_schedule`` compiles on the device (``raw_kernels/schedule.cu``).
"""

from ultraep.transfer.engine import WeightTransfer
from ultraep.transfer.spec import ExpertSpec

__all__ = ["ExpertSpec", "WeightTransfer"]
