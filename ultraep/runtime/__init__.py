"""Runtime layer: what every other layer stands on.

* ``group``    -- the EP group: rank, size, local rank, this rank's GPU, sub-groups and
  collective agreement checks (errors raised on every rank).
* ``kernels``  -- loads ``raw_kernels/*.cu`` through ``cupy.RawModule`` (NVRTC), once per
  process, disk-cached, without ranks racing the cache.
* ``heap``     -- the symmetric heap interface: collective, deterministic sub-allocation,
  signal pads, a barrier with a timeout, and :class:`~ultraep.runtime.heap.HeapRequirements`
  that size one heap for every component of a process; its transports are ``cuda_ipc``
  (the device heap) and ``mpi_shm`` (the host heap, on MPI shared memory), and
  :func:`open_heap` (here) picks one.
* ``backend``  -- the host/device vocabulary every component's implementations share.
* ``dlpack``   -- importing framework tensors (PyTorch, JAX, CuPy, NumPy) zero-copy, on the
  caller's stream, with dtype/device/layout checks.
* ``dtypes``   -- the element types the kernels accept (BF16, FP8 through ``ml_dtypes``,
  loaded on first use).
* ``launch``   -- builds and runs ``mpiexec ... python -m mpi4py`` for MPICH and Open MPI.
* ``mps``      -- emulated expert parallelism on one GPU: the ranks under a private MPS
  daemon, each with its share of the SMs (``--emulate-ep``, ``python -m ultraep.runtime.mps``).
* ``sm_partition`` -- a rank's own SMs of a shared GPU (a green context and its streams),
  and the SM count every grid is sized from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.heap import HeapRequirements, SymmetricHeap


def open_heap(group: "EPGroup", size: "int | HeapRequirements", *, backend: str = "auto") -> "SymmetricHeap":
    """Collective: a symmetric heap with ``size`` data bytes per rank, or room for every
    tensor and signal block of ``size`` (a :class:`~ultraep.runtime.heap.HeapRequirements`).

    ``backend``: ``"device"`` (CUDA IPC), ``"host"`` (MPI shared memory) or ``"auto"``
    (the device where the group has a GPU); every rank must pick the same."""
    from ultraep.runtime.backend import choose_backend
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.heap import SIGNAL_SLOTS, HeapRequirements

    if not isinstance(group, EPGroup):  # no group to tell the other ranks through: every rank passed it
        raise TypeError(f"open_heap needs an ultraep EPGroup, got {type(group).__name__} (wrap a communicator "
                        "in EPGroup(comm))")
    chosen = choose_backend(group, backend, "symmetric heap backend")
    if isinstance(size, HeapRequirements):
        group.raise_if_any(None if group.size + size.signal_slots <= SIGNAL_SLOTS else
                           f"the components need {size.signal_slots} signal flags; the pad holds "
                           f"{SIGNAL_SLOTS - group.size} beside the barrier's", "symmetric heap creation")
        size = max(size.data_bytes, 1)
    if chosen == "device":
        from ultraep.runtime.cuda_ipc import DeviceHeap
        return DeviceHeap(group, size)
    from ultraep.runtime.mpi_shm import HostHeap
    return HostHeap(group, size)
