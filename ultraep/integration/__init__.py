"""Integration: the objects a framework calls.

* ``balancer`` -- :class:`Balancer`: per-layer, per-micro-batch load gathering, planning,
  weight sync (a :class:`ReplicaSync` whose per-slot waits gate the replicas' compute),
  reroute, restore and gradient reduction, with a ring of plans for pipelines.
* ``moe_layer`` -- :class:`~ultraep.integration.moe_layer.MoELayer` (also ``ultraep.MoELayer``):
  a whole MoE layer in two calls, forward and backward -- Balancer, Dispatcher, grouped
  GEMM and SwiGLU, or with ``fused=True`` the fused kernels of :mod:`ultraep.compute.fused`.
* ``host``     -- the Balancer's host backend (NumPy): the load-row semantics and every
  per-backend step run synchronously.
* ``device``   -- the Balancer's device backend (CuPy): the CUDA load gather and
  planning into ring-slot buffers on the caller's stream.
* ``stats``    -- per (layer, micro-batch) records, stage clocks and summaries (the
  per-rank load plot is :func:`ultraep.analysis.plots.plot_rank_loads`).
* ``traces``   -- the load-trace file format and :class:`TraceRecorder`.
* ``pipeline`` -- the 1F1B order of a pipeline's forwards and backwards, for driving
  several micro-batches in flight from one process.
"""

from ultraep.integration.balancer import (BalanceHandle, Balancer, BalancerError, ReplicaSync, StaleHandleError,
                                          sync_beside_pays)
from ultraep.integration.stats import BalancerStats, LayerRecord

__all__ = ["BalanceHandle", "Balancer", "BalancerError", "BalancerStats", "LayerRecord", "ReplicaSync",
           "StaleHandleError", "sync_beside_pays"]
