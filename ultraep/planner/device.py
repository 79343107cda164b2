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
PLAN_PROBE_WARPS = 4  # warps per block that run a threshold probe each
PLAN_WARPS = 16       # warps per block
PROBES = PLAN_CLUSTER * PLAN_PROBE_WARPS
MOVE_INTS = 2         # ints per recorded move
MAX_SHARED_BYTES = 227 * 1024  # per block on sm_90
REROUTE_CHUNK = 1024  # ids per block, = blockDim of both reroute kernels
MAX_DOMAIN = 128      # ranks per domain a warp holds in registers (plan_domains<4>)
MAX_SLOTS = 256       # redundant slots per rank a recorded move can name (its slot field has 8 bits)
_INT = 4


def empty_plan(layout: ExpertLayout) -> Plan:
    """Device buffers for a plan of ``layout`` (outputs of ``plan_placement_cupy``), with
    the planner's small workspace (zeroed once; the kernel leaves it zeroed)."""
    import cupy

    R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
    plan = Plan(layout=layout, loads=cupy.empty((R, E), np.int32),
                phys_to_log=cupy.empty(layout.num_physical, np.int32), log_to_phys=cupy.empty((E, K), np.int32),
                replica_count=cupy.empty(E, np.int32), quota=cupy.empty((E, K), np.int32),
                split_prefix=cupy.empty((R, E, K), np.int32), rank_load=cupy.empty(R, np.int64),
                imbalance_before=cupy.empty((), np.float64), imbalance_after=cupy.empty((), np.float64))
    plan.planner_workspace = cupy.zeros(3 * layout.num_domains + 1, np.int64)
    return plan


_shared_limits: dict[tuple[str, str], int] = {}  # dynamic shared memory each kernel was opened up to


def _kernel(filename, name, shared_bytes):
    function = get_function(filename, name)
    if shared_bytes > max(48 * 1024, _shared_limits.get((filename, name), 0)):  # no driver query per launch
        function.max_dynamic_shared_size_bytes = shared_bytes
        _shared_limits[(filename, name)] = shared_bytes
    return function


def plan_placement_cupy(loads, layout: ExpertLayout, *, min_replica_tokens: int, tau_tolerance: int | None,
                        cap_ppm: int = 0, fit_first: bool = False, out: Plan | None = None) -> Plan:
    """``quota.plan_placement`` on the GPU. NumPy loads are value-checked on the host and
    uploaded; CuPy loads are checked for shape and dtype only (values would need a sync)."""
    import cupy

    if array_module(loads) is np:
        loads = cupy.asarray(check_loads(loads, layout))
    else:
        loads = check_loads(loads, layout, check_values=False)
    shared_bytes = launch_shared_bytes(layout)
    if out is None:
        out = empty_plan(layout)
    elif out.layout != layout:
        raise ValueError("out was allocated for another layout")
    elif getattr(out, "planner_workspace", None) is None:
        raise ValueError("out must come from ultraep.planner.cuda.empty_plan (it carries the planner's workspace)")
    if loads.data.ptr != out.loads.data.ptr:  # callers may gather straight into out.loads
        out.loads[...] = loads
    tolerance = -1 if tau_tolerance is None else min(tau_tolerance, 2**31 - 1)  # -1: quota.auto_tolerance
    R, E, S, D, K, M = (layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.domain_size,
                        layout.max_instances, layout.experts_per_rank)
    chunks = next(c for c in (1, 2, 4) if 32 * c >= D)
    plan_domains = _kernel("planner.cu", f"plan_domains<{chunks}>", shared_bytes)
    plan_domains((layout.num_domains * PLAN_CLUSTER,), (PLAN_WARPS * 32,),
                 (out.loads, np.int32(R), np.int32(E), np.int32(S), np.int32(D), np.int32(K),
                  np.int32(max(min_replica_tokens, 1)), np.int32(tolerance), np.int64(cap_ppm), np.int32(fit_first),
                  out.phys_to_log, out.log_to_phys,
                  out.replica_count, out.quota, out.rank_load, out.split_prefix, out.imbalance_before,
                  out.imbalance_after, out.planner_workspace),
                 shared_mem=shared_bytes)
    return out


def launch_shared_bytes(layout: ExpertLayout) -> int:
    """Dynamic shared memory of one ``plan_domains`` block for ``layout``; ValueError, naming
    the limit, for a layout the CuPy planner cannot take (the numpy backend can)."""
    if layout.domain_size > MAX_DOMAIN:
        raise ValueError(f"the CuPy planner handles domains of up to {MAX_DOMAIN} ranks, got {layout.domain_size}; "
                         "use the numpy backend")
    if layout.redundant_slots > MAX_SLOTS:
        raise ValueError(f"the CuPy planner handles up to {MAX_SLOTS} redundant slots per rank, got "
                         f"{layout.redundant_slots}; use the numpy backend")
    # (This limit also keeps a domain below 2**15 experts, the width of a recorded move's
    # expert field: 6 ints per expert alone would need 768 KiB there.)
    shared_bytes = plan_shared_bytes(layout)
    if shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"{layout} needs {shared_bytes} bytes of shared memory in the CuPy planner "
                         f"(at most {MAX_SHARED_BYTES}); use the numpy backend")
    return shared_bytes


def plan_shared_bytes(layout: ExpertLayout) -> int:
    """Dynamic shared memory of one ``plan_domains`` block (its carve-up, in ints)."""
    R, S, D, K, M = (layout.num_ranks, layout.redundant_slots, layout.domain_size, layout.max_instances,
                     layout.experts_per_rank)
    DM, moves = D * M, -(-MOVE_INTS * S * D // 4) * 4  # moves in whole 16-byte words
    share = -(-DM // PLAN_CLUSTER)
    ints = (3 * DM + 5 * D + 3             # visiting order (4 ints per rank), expert order (2 per expert), loads; alignment
            + 4                            # the cap probe's outcome: an mbarrier and the move count
            + (2 * PLAN_PROBE_WARPS + 1) * moves  # each probe's moves per round parity, the chosen ones
            + 6 * PROBES                   # round results
            + R * share + share            # staged load columns, their sums
            + 3 * DM + D + D * S           # replicas, master quotas, first moves, incoming, slot experts
            + share + 1                    # replicated experts of the block
            + share * (6 * K + 2 * R + 1))  # split of the replicated experts (a double per instance)
    return ints * _INT


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
