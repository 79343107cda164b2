"""The host backend of the :class:`~ultraep.integration.Balancer`: NumPy on the host heap
(MPI shared memory), and the semantics the device backend must match bit for bit.

:func:`count_loads` is the reference of this rank's load row (``raw_kernels/balancer.cu``
counts the same on the device). :class:`HostBalancer` runs every step synchronously:
the row is written into every peer's gathered matrix directly, the heap barrier waits
(the device needs none: a flag follows each row), the planner's NumPy reference plans
from a copy of the gathered matrix, and the ids the row was counted from are rerouted
(what ``Balancer.reroute(handle)`` returns).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ultraep.errors import BalancerError
from ultraep.integration.stats import HostClock
from ultraep.planner import HostPlanner, Plan
from ultraep.planner.plan import INT32_LIMIT



@dataclass(frozen=True)
class BadIds:
    """Ids outside ``[0, E)``: how many, and the first one (flat index, value)."""

    count: int
    first_index: int
    first_value: int

    def message(self, rank: int, num_experts: int, shape) -> str:
        position = tuple(int(i) for i in np.unravel_index(self.first_index, shape)) if shape else ()
        return (f"rank {rank}: {self.count} top-k id(s) outside [0, {num_experts}); the first is "
                f"{self.first_value} at index {position}")


def count_loads(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, BadIds | None]:
    """``(int32[E] tokens per logical expert, bad ids or None)``; bad ids are not counted."""
    flat = np.asarray(ids).reshape(-1)  # compared in its own dtype: uint64 past 2**63 would wrap negative in int64
    good = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[good].astype(np.int64), minlength=num_experts).astype(np.int32)
    if good.all():
        return counts, None
    first = int(np.argmin(good))
    return counts, BadIds(int((~good).sum()), first, int(flat[first]))


class HostSlot:
    """A ring slot's host state: its stage clock, the gathered loads it plans from, the
    liveness count its plan completed at and the reroute of the ids its update counted
    (None: the update got a load row)."""

    def __init__(self):
        self.clock = HostClock()
        self.loads = None
        self.liveness = 0
        self.routed = None


class HostBalancer:
    """The Balancer's per-backend work on the host; see ``Backends`` in
    :mod:`ultraep.integration.balancer` for the interface :class:`DeviceBalancer` shares.
    Every stage has finished when it returns, so there is nothing to order between
    streams: marks are None."""

    device = None  # tensors are imported as NumPy arrays
    host_waits, host_wait_s = 0, 0.0  # there is no device to wait for

    def __init__(self, heap, layout, gathered, flags, *, min_replica_tokens: int, timeout_s: float,
                 sync_checks: bool, cuda_graphs: bool):
        self.heap, self.layout, self.gathered = heap, layout, gathered
        self.timeout_s = timeout_s
        self.planner = HostPlanner(layout, min_replica_tokens=min_replica_tokens)
        self.liveness = 0  # gathers and plans completed on this rank (cuda_graphs: nothing to capture here)
        self._row = None  # the staged load row
        self._ids = None  # the ids it was counted from (None: a caller's row)

    def new_slot(self) -> HostSlot:
        return HostSlot()

    def stream(self, stream, tensor=None):
        return contextlib.nullcontext()  # every stage runs synchronously

    def current(self):
        return None

    def mark(self, what):
        return None

    def mark_on(self, stream, what):
        return None

    def follow(self, *marks) -> None:
        """Nothing to wait for: every stage has finished."""

    def check_ids(self, ids) -> None:
        """Any integer dtype is counted."""

    def check_loads(self, loads) -> None:
        if loads.size and int(loads.min()) < 0:
            raise BalancerError(f"local_loads: counts must be non-negative, found {int(loads.min())}")
        if loads.size and int(loads.max()) >= INT32_LIMIT:  # the row is int32: a larger count would wrap
            raise BalancerError(f"local_loads: counts must be below 2**31, found {int(loads.max())}")
        total = int(loads.sum(dtype=np.int64))  # each count is below 2**31: the int64 sum cannot wrap
        if total >= INT32_LIMIT:  # the planner's quotas are int32
            raise BalancerError(f"local_loads: the counts must total below 2**31, found {total}")

    def count(self, source, *, from_ids: bool) -> None:
        """Stage this rank's load row; bad ids raise (always: looking costs nothing here)."""
        E = self.layout.num_experts
        if not from_ids:
            self._row, self._ids = source.astype(np.int32), None
            return
        counts, bad = count_loads(source, E)
        if bad is not None:
            raise BalancerError(bad.message(self.heap.rank, E, source.shape))
        self._row, self._ids = counts, source

    def discard(self) -> None:
        self._row = self._ids = None

    def update(self, slot: HostSlot, source, *, from_ids: bool, then=None) -> Plan:
        """Count ``source`` (None: publish the row :meth:`count` staged), write the row into
        every peer's gathered matrix (the one the update's number picks, as on the device),
        wait at the heap barrier, plan from a copy of this rank's matrix (peers overwrite it
        two updates on), reroute the counted ids (the plan has room for every one of them),
        run ``then(plan).launch()`` (the sync the update starts, a ``PreparedSync``) if given
        and stop the update's clock."""
        if source is not None:
            self.count(source, from_ids=from_ids)
        buffer = self.liveness % self.gathered.shape[0]
        for peer in range(self.heap.size):
            self.gathered.peer(peer)[buffer, self.heap.rank] = self._row
        self._row = None
        self.heap.barrier(self.timeout_s)
        slot.loads = np.array(self.gathered.local[buffer])
        plan = self.planner.plan(slot.loads)
        slot.routed = None if self._ids is None else self.planner.reroute(self._ids, plan, self.heap.rank)
        self._ids = None
        self.liveness += 1
        slot.liveness = self.liveness
        if then is not None:
            then(plan).launch()
        slot.clock.stop("update")
        return plan

    def planned(self, slot: HostSlot):
        return None

    def routed(self, slot: HostSlot):
        """The reroute of the ids the slot's update counted."""
        return slot.routed

    def reroute(self, slot: HostSlot, ids, plan: Plan, out):
        """Raises ValueError for ids the plan has no room for."""
        return self.planner.reroute(ids, plan, self.heap.rank, out=out)

    def host_arrays(self, slot: HostSlot, plan: Plan) -> dict:
        return {"loads": plan.loads, "phys_to_log": plan.phys_to_log, "rank_load": plan.rank_load,
                "liveness": slot.liveness}

    def synchronize(self) -> int:
        """Plans completed (every stage has already finished)."""
        return self.liveness

    def check(self) -> None:
        """Nothing is deferred on the host: every error was raised by its call."""
