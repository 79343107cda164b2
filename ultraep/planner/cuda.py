"""CuPy backend of the planner and reroute: launches ``raw_kernels/planner.cu`` and
``raw_kernels/reroute.cu``.

No host synchronisation on these paths: output sizes follow from the layout and the
ids' shape, loads are not inspected on the host, and the imbalances stay 0-d device
arrays. Passing preallocated outputs (``out=``) makes a call capturable in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan, array_module, check_loads
from ultraep.runtime.kernels import get_function

PLAN_CLUSTER = 8      # blocks per domain, a thread-block cluster (raw_kernels/planner.cu)
PLAN_WARPS = 4        # warps per block, one threshold probe each
PROBES = PLAN_CLUSTER * PLAN_WARPS
MAX_SHARED_BYTES = 227 * 1024  # per block on sm_90
SPLIT_THREADS = 256
REROUTE_CHUNK = 1024  # ids per block, = blockDim of both reroute kernels
MAX_DOMAIN = 128      # ranks per domain a warp holds in registers (plan_domains<4>)
_INT = 4


def empty_plan(layout: ExpertLayout) -> Plan:
    """Device buffers for a plan of ``layout`` (outputs of ``plan_placement_cupy``)."""
    import cupy

    R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
    return Plan(layout=layout, loads=cupy.empty((R, E), np.int32),
                phys_to_log=cupy.empty(layout.num_physical, np.int32), log_to_phys=cupy.empty((E, K), np.int32),
                replica_count=cupy.empty(E, np.int32), quota=cupy.empty((E, K), np.int32),
                split_prefix=cupy.empty((R, E, K), np.int32), rank_load=cupy.empty(R, np.int64),
                imbalance_before=cupy.empty((), np.float64), imbalance_after=cupy.empty((), np.float64))


def _kernel(filename, name, shared_bytes):
    function = get_function(filename, name)
    if shared_bytes > 48 * 1024 and function.max_dynamic_shared_size_bytes < shared_bytes:
        function.max_dynamic_shared_size_bytes = shared_bytes
    return function


def plan_placement_cupy(loads, layout: ExpertLayout, *, min_replica_tokens: int, tau_tolerance: int,
                        out: Plan | None = None) -> Plan:
    """``quota.plan_placement`` on the GPU. NumPy loads are value-checked on the host and
    uploaded; CuPy loads are checked for shape and dtype only (values would need a sync)."""
    import cupy

    if array_module(loads) is np:
        loads = cupy.asarray(check_loads(loads, layout))
    else:
        loads = check_loads(loads, layout, check_values=False)
    R, E, S, D, K = (layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.domain_size,
                     layout.max_instances)
    if D > MAX_DOMAIN:
        raise ValueError(f"the CuPy planner handles domains of up to {MAX_DOMAIN} ranks, got {D}")
    if out is None:
        out = empty_plan(layout)
    elif out.layout != layout:
        raise ValueError("out was allocated for another layout")
    if loads.data.ptr != out.loads.data.ptr:  # callers may gather straight into out.loads
        out.loads[...] = loads
    launch_place(out, min_replica_tokens, tau_tolerance)
    launch_split(out)
    return out


def launch_place(out: Plan, min_replica_tokens: int, tau_tolerance: int) -> None:
    """``plan_domains``: placement, quotas and rank loads of ``out`` from ``out.loads``."""
    layout = out.layout
    R, E, S, D, K, M = (layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.domain_size,
                        layout.max_instances, layout.experts_per_rank)
    # the carve-up of shared memory in plan_domains (per block)
    domain_ints = 5 * D * M + 5 * D + 2 * S * D * (PLAN_WARPS + 1) + 6 * PROBES + 2 + -(-D * M // PLAN_CLUSTER)
    if domain_ints * _INT > MAX_SHARED_BYTES:
        raise ValueError(f"{layout} needs {domain_ints * _INT} bytes of shared memory in the CuPy planner "
                         f"(at most {MAX_SHARED_BYTES}); use the numpy backend")
    chunks = next(c for c in (1, 2, 4) if 32 * c >= D)
    plan_domains = _kernel("planner.cu", f"plan_domains<{chunks}>", domain_ints * _INT)
    plan_domains((layout.num_domains * PLAN_CLUSTER,), (PLAN_WARPS * 32,),
                 (out.loads, np.int32(R), np.int32(E), np.int32(S), np.int32(D), np.int32(K),
                  np.int32(max(min_replica_tokens, 1)), np.int32(min(tau_tolerance, 2**31 - 1)),
                  out.phys_to_log, out.log_to_phys, out.replica_count, out.quota, out.rank_load),
                 shared_mem=domain_ints * _INT)


def launch_split(out: Plan) -> None:
    """``plan_split``: the split prefix and the imbalances of ``out`` from its placement."""
    layout = out.layout
    R, E, S, K = layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.max_instances
    split_bytes = (2 * R + 4 * K) * 8
    plan_split = _kernel("planner.cu", "plan_split", split_bytes)
    plan_split((E + 1,), (SPLIT_THREADS,),
               (out.loads, out.log_to_phys, out.replica_count, out.quota, out.rank_load, np.int32(R), np.int32(E),
                np.int32(S), np.int32(K), out.split_prefix, out.imbalance_before, out.imbalance_after),
               shared_mem=split_bytes)


def reroute_workspace_size(layout: ExpertLayout, num_ids: int) -> int:
    """int32 entries of the per-chunk count table ``reroute_cupy`` needs for ``num_ids`` ids."""
    return max(1, -(-num_ids // REROUTE_CHUNK)) * layout.num_experts


def reroute_cupy(topk_ids, plan: Plan, rank: int, *, out=None, workspace=None):
    """``reroute.reroute`` on the GPU; ``-1`` for invalid ids or surplus occurrences.

    int32 and int64 ids are read in place. ``out`` and ``workspace`` (int32, at least
    ``reroute_workspace_size`` entries) make the call allocation-free."""
    import cupy

    layout = plan.layout
    if topk_ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    ids = cupy.asarray(topk_ids)
    if ids.dtype not in (np.int32, np.int64) or not ids.flags.c_contiguous:
        ids = cupy.ascontiguousarray(ids, dtype=np.int64)
    id_type = "int" if ids.dtype == np.int32 else "long long"
    if array_module(plan.split_prefix) is np:
        plan = Plan(layout=layout, imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after,
                    **{name: cupy.asarray(getattr(plan, name)) for name in Plan.ARRAYS})
    if out is None:
        out = cupy.empty(ids.shape, np.int32)
    elif out.shape != ids.shape or out.dtype != np.int32:
        raise ValueError(f"out must be int32 of shape {ids.shape}")
    n, E, K = ids.size, layout.num_experts, layout.max_instances
    if 33 * E * _INT > MAX_SHARED_BYTES:
        raise ValueError(f"the CuPy reroute keeps 33 counters per expert in shared memory: {E} experts "
                         f"need {33 * E * _INT} bytes (at most {MAX_SHARED_BYTES}); use the numpy backend")
    if n == 0:
        return out
    chunks = -(-n // REROUTE_CHUNK)
    if workspace is None:
        workspace = cupy.empty(chunks * E, np.int32)
    elif workspace.dtype != np.int32 or workspace.size < chunks * E:
        raise ValueError(f"workspace must be int32 with at least {chunks * E} entries "
                         f"(reroute_workspace_size), got {workspace.dtype} of {workspace.size}")
    count = _kernel("reroute.cu", f"reroute_count<{id_type}>", E * _INT)
    count((chunks,), (REROUTE_CHUNK,), (ids, np.int64(n), np.int32(E), workspace), shared_mem=E * _INT)
    assign = _kernel("reroute.cu", f"reroute_assign<{id_type}>", 33 * E * _INT)
    assign((chunks,), (REROUTE_CHUNK,),
           (ids, np.int64(n), np.int32(E), np.int32(K), workspace, plan.split_prefix[rank], plan.log_to_phys,
            plan.replica_count, out), shared_mem=33 * E * _INT)
    return out
