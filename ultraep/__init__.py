"""ultraep: real-time exact-load expert balancing (UltraEP) and deterministic token
movement (UniEP) for Mixture-of-Experts expert parallelism.

Layers, bottom up (each its own package):

* ``ultraep.runtime`` -- EP group, kernel loading, symmetric heap (CUDA IPC and a CPU
  backend on MPI shared memory), DLPack interop, the ``mpiexec`` launcher.
* ``ultraep.planner`` -- the control plane: expert layout, exact-load quota planner,
  reroute, baselines, lower bounds and load traces.
* ``ultraep.transfer`` -- the data plane: replica buffers, weight sync by tile streaming
  with relay trees, deterministic gradient reduction.
* ``ultraep.token`` -- the token path: deterministic dispatch and combine (UniEP).
* ``ultraep.integration`` -- the :class:`Balancer` a framework drives per layer and
  micro-batch, with its metrics, traces and plots.
* ``ultraep.bench`` -- ``python -m ultraep.bench ...`` benchmarks.

Top-level names are imported on first use, so ``import ultraep`` stays cheap and needs
neither MPI nor CuPy.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "EPGroup": "ultraep.runtime.group",
    "SymmetricHeap": "ultraep.runtime.heap",
    "open_heap": "ultraep.runtime",
    "ExpertLayout": "ultraep.planner",
    "Plan": "ultraep.planner",
    "plan_placement": "ultraep.planner",
    "reroute": "ultraep.planner",
    "lower_bound": "ultraep.planner.bound",
    "load_trace": "ultraep.planner.traces",
    "save_trace": "ultraep.planner.traces",
    "TraceRecorder": "ultraep.planner.traces",
    "ExpertSpec": "ultraep.transfer",
    "WeightTransfer": "ultraep.transfer",
    "Dispatcher": "ultraep.token",
    "Balancer": "ultraep.integration",
    "BalanceHandle": "ultraep.integration",
    "BalancerError": "ultraep.integration",
    "StaleHandleError": "ultraep.integration",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ultraep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
