"""ultraep: real-time exact-load expert balancing (UltraEP) and deterministic token
movement (UniEP) for Mixture-of-Experts expert parallelism.

Layers, bottom up (each its own package):

* ``ultraep.runtime`` -- EP group, kernel loading, symmetric heap (CUDA IPC and a CPU
  backend on MPI shared memory), DLPack interop, the ``mpiexec`` launcher.
* ``ultraep.planner`` -- the control plane: expert layout, exact-load quota planner and
  reroute.
* ``ultraep.transfer`` -- the data plane: replica buffers, weight sync by tile streaming
  with relay trees, deterministic gradient reduction.
* ``ultraep.token`` -- the token path: deterministic dispatch and combine (UniEP).
* ``ultraep.compute`` -- the expert compute: the padding-free grouped GEMM, and the fused
  MoE kernels (dispatch + GEMM, GEMM + combine) in ``ultraep.compute.fused``.
* ``ultraep.tune`` -- the machine profile, the performance model of weight sync, dispatch
  and the fused kernels, the search over their knobs, and the replica cost model behind
  ``min_replica_tokens="auto"``.
* ``ultraep.integration`` -- the :class:`Balancer` a framework drives per layer and
  micro-batch, with its metrics and the load-trace format, and :class:`MoELayer`, a whole
  (optionally balanced) MoE layer in two calls.
* ``ultraep.bench`` -- ``python -m ultraep.bench ...`` benchmarks.

Beside them, ``ultraep.analysis`` holds the analysis tools (proven bounds, baselines,
synthetic traces, plots; ``pip install ultraep[analysis]``), imported by none of the above
but the benchmarks.

The names below are the public API, what a framework calls; each is imported on first
use, so ``import ultraep`` stays cheap and needs neither MPI, CuPy, SciPy nor matplotlib.
Every error the library raises on purpose derives from :class:`UltraEPError`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees of the lazily imported names below ("X as X": re-exported)
    from ultraep.errors import (BalancerError as BalancerError, BarrierTimeout as BarrierTimeout,
                                ClosedError as ClosedError, CollectiveError as CollectiveError,
                                DispatchError as DispatchError, FusedDeadlock as FusedDeadlock,
                                GroupedGemmError as GroupedGemmError, GroupMismatchError as GroupMismatchError,
                                HeapError as HeapError, HeapFullError as HeapFullError,
                                LaunchError as LaunchError, MoELayerError as MoELayerError,
                                MPSUnavailable as MPSUnavailable, ProfileError as ProfileError,
                                RankFailedError as RankFailedError, SMPartitionError as SMPartitionError,
                                StaleHandleError as StaleHandleError, TransferTimeout as TransferTimeout,
                                UltraEPError as UltraEPError, WaitTimeout as WaitTimeout)
    from ultraep.integration import BalanceHandle as BalanceHandle, Balancer as Balancer, ReplicaSync as ReplicaSync
    from ultraep.integration.moe_layer import MoELayer as MoELayer
    from ultraep.integration.traces import (load_trace as load_trace, save_trace as save_trace,
                                            TraceRecorder as TraceRecorder)
    from ultraep.planner import ExpertLayout as ExpertLayout, Plan as Plan, plan_placement as plan_placement
    from ultraep.runtime import open_heap as open_heap
    from ultraep.runtime.group import EPGroup as EPGroup
    from ultraep.token import Dispatcher as Dispatcher
    from ultraep.transfer import ExpertSpec as ExpertSpec, WeightTransfer as WeightTransfer

    # A type checker takes ultraep.planner.reroute for the submodule of that name, so the
    # function's signature is restated here (tests/test_package.py keeps the two equal).
    def reroute(topk_ids: Any, plan: Plan, rank: int, *, out: Any = None, workspace: Any = None) -> Any: ...

__version__ = "0.1.0"

_EXPORTS = {
    "EPGroup": "ultraep.runtime.group",
    "open_heap": "ultraep.runtime",
    "ExpertLayout": "ultraep.planner",
    "Plan": "ultraep.planner",
    "plan_placement": "ultraep.planner",
    "reroute": "ultraep.planner",
    "ExpertSpec": "ultraep.transfer",
    "WeightTransfer": "ultraep.transfer",
    "Dispatcher": "ultraep.token",
    "Balancer": "ultraep.integration",
    "BalanceHandle": "ultraep.integration",
    "ReplicaSync": "ultraep.integration",
    "MoELayer": "ultraep.integration.moe_layer",
    "save_trace": "ultraep.integration.traces",
    "load_trace": "ultraep.integration.traces",
    "TraceRecorder": "ultraep.integration.traces",
    "UltraEPError": "ultraep.errors",
    "CollectiveError": "ultraep.errors",
    "GroupMismatchError": "ultraep.errors",
    "LaunchError": "ultraep.errors",
    "MPSUnavailable": "ultraep.errors",
    "SMPartitionError": "ultraep.errors",
    "HeapError": "ultraep.errors",
    "HeapFullError": "ultraep.errors",
    "ClosedError": "ultraep.errors",
    "GroupedGemmError": "ultraep.errors",
    "WaitTimeout": "ultraep.errors",
    "RankFailedError": "ultraep.errors",
    "BarrierTimeout": "ultraep.errors",
    "TransferTimeout": "ultraep.errors",
    "DispatchError": "ultraep.errors",
    "BalancerError": "ultraep.errors",
    "StaleHandleError": "ultraep.errors",
    "ProfileError": "ultraep.errors",
    "MoELayerError": "ultraep.errors",
    "FusedDeadlock": "ultraep.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ultraep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
