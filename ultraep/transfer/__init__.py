"""Data plane: moving expert weights to replicas and replica gradients back to masters.

* ``spec``     -- what one expert's tensors look like (shapes, weight and gradient dtypes)
  and how they pack into a replica slot.
* ``schedule`` -- the task compiler: from a plan, the tile transfers each rank performs,
  relay trees for hot experts, and the gradient-reduction tiles.
* ``executor`` -- the NumPy executor of a schedule (CPU backend and test reference).
* ``engine``   -- :class:`WeightTransfer`, the thin object over the kernels: replica
  buffers in the symmetric heap, per-layer registration of masters, weight sync,
  restore and gradient reduction.
"""

from ultraep.transfer.engine import WeightTransfer
from ultraep.transfer.spec import ExpertSpec

__all__ = ["ExpertSpec", "WeightTransfer"]
