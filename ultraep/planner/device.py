"""``DevicePlanner``: the quota planner and reroute as CUDA kernels
(``raw_kernels/planner.cu``, ``raw_kernels/reroute.cu``), bitwise equal to ``HostPlanner``.

No host synchronisation on these paths: output sizes follow from the layout and the
ids' shape, loads are not inspected on the host, and the imbalances stay 0-d device
arrays. Preallocated outputs (``out=``, ``workspace=``) make a call capturable in a CUDA
graph. Every launch constant and limit is read from the kernels' ``#define``s.
"""

from __future__ import annotations

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan, array_module, check_loads
from ultraep.planner.quota import Planner
from ultraep.planner.reroute import check_plan_out, check_rank, check_reroute_out
from ultraep.runtime.kernels import get_function, kernel_constants

_PLANNER = kernel_constants("planner.cu")
PLAN_CLUSTER = _PLANNER["CLUSTER"]  # blocks per domain
PLAN_PROBE_WARPS = _PLANNER["PROBE_WARPS"]
PLAN_THREADS = _PLANNER["THREADS"]
PROBES = _PLANNER["PROBES"]
MOVE_INTS = _PLANNER["MOVE_INTS"]
MAX_CHUNKS = _PLANNER["MAX_CHUNKS"]  # plan_domains<CHUNKS> for CHUNKS = 1, 2, 4, ... MAX_CHUNKS
MAX_DOMAIN = _PLANNER["MAX_DOMAIN"]
MAX_SLOTS = _PLANNER["MAX_SLOTS"]
_REROUTE = kernel_constants("reroute.cu")
REROUTE_CHUNK = _REROUTE["CHUNK"]  # ids per block
REROUTE_COUNTERS = _REROUTE["ASSIGN_COUNTERS"]  # shared ints per expert of reroute_assign
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory a block may have on sm_90
_INT = 4


def empty_plan(layout: ExpertLayout) -> Plan:
    """Device buffers for a plan of ``layout``, with the planner's small workspace (zeroed
    once; the kernel leaves it zeroed)."""
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


class DevicePlanner(Planner):
    """The CUDA planner (``Planner`` lists the options); ``ValueError`` at construction
    for a layout the kernel cannot take (``launch_shared_bytes``), which the host can."""

    def __init__(self, layout: ExpertLayout, **options):
        super().__init__(layout, **options)
        self.shared_bytes = launch_shared_bytes(layout)
        chunks = 1  # the instance whose lanes hold 32 * chunks ranks each, the fewest enough
        while 32 * chunks < layout.domain_size:
            chunks *= 2
        self.kernel_name = f"plan_domains<{chunks}>"
        self._tolerance = -1 if self.tau_tolerance is None else min(self.tau_tolerance, 2**31 - 1)  # -1: auto

    def plan_function(self):
        """The ``plan_domains`` instance for this layout, opened up to its shared memory."""
        return _kernel("planner.cu", self.kernel_name, self.shared_bytes)

    def plan(self, loads, out: Plan | None = None) -> Plan:
        """A plan of CuPy arrays. NumPy loads are value-checked on the host and uploaded;
        CuPy loads are checked for shape and dtype only (values would need a sync).
        ``out`` must come from ``empty_plan`` (it carries the planner's workspace)."""
        import cupy

        layout = self.layout
        if array_module(loads) is np:
            loads = cupy.asarray(check_loads(loads, layout))
        else:
            loads = check_loads(loads, layout, check_values=False)
        if out is None:
            out = empty_plan(layout)
        elif getattr(check_plan_out(out, layout), "planner_workspace", None) is None:
            raise ValueError("out must come from ultraep.planner.device.empty_plan "
                             "(it carries the planner's workspace)")
        if loads.data.ptr != out.loads.data.ptr:  # callers may gather straight into out.loads
            out.loads[...] = loads
        R, E, S, D, K = (layout.num_ranks, layout.num_experts, layout.redundant_slots, layout.domain_size,
                         layout.max_instances)
        self.plan_function()((layout.num_domains * PLAN_CLUSTER,), (PLAN_THREADS,),
                             (out.loads, np.int32(R), np.int32(E), np.int32(S), np.int32(D), np.int32(K),
                              np.int32(max(self.min_replica_tokens, 1)), np.int32(self._tolerance),
                              np.int64(self.cap_ppm), np.int32(self.fit_first), out.phys_to_log, out.log_to_phys,
                              out.replica_count, out.quota, out.rank_load, out.split_prefix, out.imbalance_before,
                              out.imbalance_after, out.planner_workspace),
                             shared_mem=self.shared_bytes)
        return out

    def reroute(self, topk_ids, plan: Plan, rank: int, out=None, workspace=None):
        if plan.layout != self.layout:
            raise ValueError("plan is of another layout than the planner")
        return reroute_device(topk_ids, plan, rank, out=out, workspace=workspace)

    def empty_plan(self) -> Plan:
        return empty_plan(self.layout)


def launch_shared_bytes(layout: ExpertLayout) -> int:
    """Dynamic shared memory of one ``plan_domains`` block for ``layout``; ValueError, naming
    the limit, for a layout the device planner cannot take (the host planner can)."""
    if layout.domain_size > MAX_DOMAIN:
        raise ValueError(f"the device planner handles domains of up to {MAX_DOMAIN} ranks, got {layout.domain_size}; "
                         "use the host backend")
    if layout.redundant_slots > MAX_SLOTS:
        raise ValueError(f"the device planner handles up to {MAX_SLOTS} redundant slots per rank, got "
                         f"{layout.redundant_slots}; use the host backend")
    # (This limit also keeps a domain below 2**15 experts, the width of a recorded move's
    # expert field.)
    shared_bytes = plan_shared_bytes(layout)
    if shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"{layout} needs {shared_bytes} bytes of shared memory in the device planner "
                         f"(at most {MAX_SHARED_BYTES}); use the host backend")
    return shared_bytes


def plan_shared_bytes(layout: ExpertLayout) -> int:
    """Bytes of the kernel's ``BlockShared`` carve-up for ``layout``, in its order (the
    kernel traps when launched with less; tests/planner tie the two)."""
    R, S, D, K, M = (layout.num_ranks, layout.redundant_slots, layout.domain_size, layout.max_instances,
                     layout.experts_per_rank)
    DM = D * M
    share = -(-DM // PLAN_CLUSTER)  # experts a block owns
    move_ints = -(-MOVE_INTS * S * D // 4) * 4  # a probe's moves, in whole 16-byte words
    front = 4 * D + 2 * DM + DM + D  # DomainShared: visits (int4), expert order (int2), expert loads, rank loads
    ints = (front + (-front & 3)  # 16-byte aligned from here
            + 2 * PLAN_PROBE_WARPS * move_ints + move_ints  # each probe warp's moves per round parity, the winner's
            + 2 + 2  # the cap probe's outcome: an mbarrier and the move count
            + 2 * share * K  # split ratios (doubles)
            + 2 * 3 * PROBES  # round results
            + R * share + share  # staged load columns, their sums
            + 3 * DM + D + D * S  # replicas, master quotas, first moves, incoming, slot experts
            + share + 1  # replicated experts of the block
            + 4 * share * K + 2 * share * R + share)  # split of the replicated experts
    return ints * _INT


def reroute_workspace_size(layout: ExpertLayout, num_ids: int) -> int:
    """int32 entries of the per-chunk count table ``reroute_device`` needs for ``num_ids`` ids."""
    return max(1, -(-num_ids // REROUTE_CHUNK)) * layout.num_experts


def reroute_device(topk_ids, plan: Plan, rank: int, *, out=None, workspace=None):
    """``reroute.reroute_reference`` on the GPU; ``-1`` for invalid ids or surplus occurrences
    (checking values would need a sync).

    int32 and int64 ids are read in place. ``out`` and ``workspace`` (int32, at least
    ``reroute_workspace_size`` entries) make the call allocation-free."""
    import cupy

    layout = plan.layout
    rank = check_rank(layout, rank)
    if topk_ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    ids = cupy.asarray(topk_ids)
    if ids.dtype not in (np.int32, np.int64) or not ids.flags.c_contiguous:
        ids = cupy.ascontiguousarray(ids, dtype=np.int64)
    if array_module(plan.split_prefix) is np:
        plan = Plan(layout=layout, imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after,
                    **{name: cupy.asarray(getattr(plan, name)) for name in Plan.ARRAYS})
    if out is None:
        out = cupy.empty(ids.shape, np.int32)
    else:
        check_reroute_out(out, ids.shape, by_address=True)
    n, E = ids.size, layout.num_experts
    reroute_assign_shared_bytes(E)
    if n == 0:
        return out
    chunks = -(-n // REROUTE_CHUNK)
    if workspace is None:
        workspace = cupy.empty(chunks * E, np.int32)
    elif workspace.dtype != np.int32 or workspace.size < chunks * E:
        raise ValueError(f"workspace must be int32 with at least {chunks * E} entries "
                         f"(reroute_workspace_size), got {workspace.dtype} of {workspace.size}")
    count = _kernel("reroute.cu", f"reroute_count<{_id_type(ids)}>", E * _INT)
    count((chunks,), (REROUTE_CHUNK,), (ids, np.int64(n), np.int32(E), workspace), shared_mem=E * _INT)
    reroute_assign_counted(ids, plan, rank, chunk_counts=workspace, out=out)
    return out


def reroute_assign_shared_bytes(num_experts: int) -> int:
    """Dynamic shared memory of one ``reroute_assign`` block; ValueError, naming the limit,
    for more experts than it can count (at most ``MAX_SHARED_BYTES // (4 * REROUTE_COUNTERS)``)."""
    assign_bytes = REROUTE_COUNTERS * num_experts * _INT
    if assign_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"the device reroute keeps {REROUTE_COUNTERS} counters per expert in shared memory: "
                         f"{num_experts} experts need {assign_bytes} bytes (at most {MAX_SHARED_BYTES}); use the "
                         "host backend")
    return assign_bytes


def reroute_assign_counted(ids, plan: Plan, rank: int, *, chunk_counts, out) -> None:
    """The assignment half of :func:`reroute_device` for ids whose per-chunk counts
    (``int32[chunks][E]``, chunks of ``REROUTE_CHUNK`` ids) are already in ``chunk_counts``
    -- written by ``reroute_count``, or by ``gather_loads`` (``raw_kernels/balancer.cu``)
    for the ids an update counted. ``ids``: contiguous int32 or int64 CuPy ids; ``plan``:
    CuPy arrays; ``out``: int32, shaped like ``ids``. No checks beyond the kernel's limit:
    the callers have made these."""
    n, E, K = ids.size, plan.layout.num_experts, plan.layout.max_instances
    if n == 0:
        return
    assign_bytes = reroute_assign_shared_bytes(E)
    assign = _kernel("reroute.cu", f"reroute_assign<{_id_type(ids)}>", assign_bytes)
    assign((-(-n // REROUTE_CHUNK),), (REROUTE_CHUNK,),
           (ids, np.int64(n), np.int32(E), np.int32(K), chunk_counts, _row_pointer(plan.split_prefix, rank),
            plan.log_to_phys, plan.replica_count, out), shared_mem=assign_bytes)


def _id_type(ids) -> str:
    return "int" if ids.dtype == np.int32 else "long long"


def _row_pointer(array, row: int) -> np.uintp:
    """Device address of ``array[row]``: what indexing would pass, without making a view
    (host time on every reroute)."""
    return np.uintp(array.data.ptr + row * array.strides[0])
