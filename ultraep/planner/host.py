"""``HostPlanner``: the quota planner and reroute in NumPy -- the reference the CUDA
kernels are tested against bit for bit, and the CPU backend."""

from __future__ import annotations

import numpy as np

from ultraep.planner.plan import Plan, array_module, check_loads
from ultraep.planner.quota import Planner, locality_split, place_replicas
from ultraep.planner.reroute import check_plan_out, check_reroute_out, reroute_reference


class HostPlanner(Planner):
    """The NumPy planner (``Planner`` lists the options). Takes NumPy or CuPy inputs and
    returns NumPy plans and slot ids (or fills the ``out=`` given)."""

    def plan(self, loads, out: Plan | None = None) -> Plan:
        loads = check_loads(loads, self.layout)
        if array_module(loads) is not np:
            loads = loads.get()
        log_to_phys, quota = place_replicas(loads, self.layout, self.min_replica_tokens, self.tau_tolerance,
                                            self.cap_ppm, self.fit_first)
        plan = Plan.from_split(self.layout, loads, log_to_phys, locality_split(loads, self.layout, log_to_phys, quota))
        if out is None:
            return plan
        check_plan_out(out, self.layout)
        for name in Plan.ARRAYS:
            getattr(out, name)[...] = getattr(plan, name)
        out.imbalance_before, out.imbalance_after = plan.imbalance_before, plan.imbalance_after
        return out

    def reroute(self, topk_ids, plan: Plan, rank: int, out=None, workspace=None):
        """``reroute_host``; ``workspace`` is the device's scratch, of which the host needs none."""
        if plan.layout != self.layout:
            raise ValueError("plan is of another layout than the planner")
        return reroute_host(topk_ids, plan, rank, out=out)

    def empty_plan(self) -> Plan:
        R, E, K = self.layout.num_ranks, self.layout.num_experts, self.layout.max_instances
        return Plan(layout=self.layout, loads=np.empty((R, E), np.int32),
                    phys_to_log=np.empty(self.layout.num_physical, np.int32), log_to_phys=np.empty((E, K), np.int32),
                    replica_count=np.empty(E, np.int32), quota=np.empty((E, K), np.int32),
                    split_prefix=np.empty((R, E, K), np.int32), rank_load=np.empty(R, np.int64),
                    imbalance_before=float("nan"), imbalance_after=float("nan"))


def reroute_host(topk_ids, plan: Plan, rank: int, *, out=None):
    """``reroute.reroute_reference``, written into ``out`` (int32, shaped like the ids) when given."""
    slots = reroute_reference(topk_ids, plan, rank)
    if out is None:
        return slots
    check_reroute_out(out, slots.shape, by_address=False)
    out[...] = slots
    return out
