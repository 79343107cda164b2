"""Integration: the objects a framework calls.

* ``balancer`` -- :class:`Balancer`: per-layer, per-micro-batch load gathering, planning,
  weight sync, reroute, restore and gradient reduction, with a ring of plans for pipelines.
* ``loads``    -- this rank's expert-load row (NumPy semantics and the CUDA counter) and
  its publication into every peer's gathered load matrix.
* ``stats``    -- per (layer, micro-batch) records, stage clocks and summaries (the
  per-rank load plot is :func:`ultraep.analysis.plots.plot_rank_loads`).
* ``traces``   -- the load-trace file format and :class:`TraceRecorder`.
* ``pipeline`` -- the 1F1B order of a pipeline's forwards and backwards, for driving
  several micro-batches in flight from one process.
"""

from ultraep.integration.balancer import BalanceHandle, Balancer, BalancerError, StaleHandleError
from ultraep.integration.stats import BalancerStats, LayerRecord

__all__ = ["BalanceHandle", "Balancer", "BalancerError", "BalancerStats", "LayerRecord", "StaleHandleError"]
