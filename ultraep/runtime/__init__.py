"""Runtime layer: what every other layer stands on.

* ``group``    -- the EP group: rank, size, local rank, this rank's GPU, sub-groups and
  collective agreement checks (errors raised on every rank).
* ``kernels``  -- loads ``raw_kernels/*.cu`` through ``cupy.RawModule`` (NVRTC), once per
  process, disk-cached, without ranks racing the cache.
* ``heap``     -- the symmetric heap interface: collective, deterministic sub-allocation,
  signal pads, a barrier with a timeout; its transports are ``cuda_ipc`` (GPU) and
  ``mpi_shm`` (CPU backend on MPI shared memory).
* ``dlpack``   -- importing framework tensors (PyTorch, JAX, CuPy, NumPy) zero-copy, on the
  caller's stream, with dtype/device/layout checks.
* ``launch``   -- builds and runs ``mpiexec ... python -m mpi4py`` for MPICH and Open MPI.
"""
