"""The fused MoE layer (UniEP): dispatch + up-projection and down-projection + combine as
persistent kernels (``raw_kernels/fused_moe.cu``, ``fused_moe_backward.cu``) whose tile
loop is the grouped GEMM's, bitwise equal to the sequential path. It sits above the token
path, whose token map and send-once dispatch it fuses with the GEMM tiles, and below
``tune``, which chooses its configuration, and ``integration``, whose ``MoELayer(fused=True)``
calls it.

* ``forward``  -- the forward's task semantics in NumPy (task order, scoreboard, why no
  claim order deadlocks), the simulator that checks them in random interleavings, and the
  sequential forward they are held to;
* ``backward`` -- the same for the backward;
* ``host``     -- :class:`HostFusedForward`, :class:`HostFusedBackward`: the CPU backend,
  those tasks run by one CTA a rank over the MPI shared-memory heap;
* ``device``   -- :class:`DeviceFusedForward`, :class:`DeviceFusedBackward`: the
  launchers of kernels A, B and C, D (CuPy);
* ``config``   -- :class:`FusedConfig` (grid, task sizes, unrolls: no result bit depends
  on them) and the per-token-bucket :class:`FusedSchedule`.

The modules are imported where used (``MoELayer`` picks host or device, as every component).
"""
