"""The control plane: expert layout, the exact-load quota planner (``HostPlanner`` in
NumPy, ``DevicePlanner`` on the GPU, behind one ``Planner`` interface) and reroute.
Baselines, lower bounds and synthetic traces are in :mod:`ultraep.analysis`."""

from typing import Any

import numpy as np

from ultraep.planner.device import DevicePlanner, reroute_device
from ultraep.planner.host import HostPlanner, reroute_host
from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan, array_module
from ultraep.planner.quota import Planner
from ultraep.planner.reroute import check_plan
from ultraep.runtime.backend import CHOICES, DEVICE, HOST

_PLANNERS = {HOST: HostPlanner, DEVICE: DevicePlanner}


def make_planner(layout: ExpertLayout, backend: str = HOST, **options) -> Planner:
    """The planner of ``backend`` ("host" or "device") for ``layout``; ``options`` as
    ``Planner`` lists them, checked here."""
    if backend not in _PLANNERS:
        raise ValueError(f"backend must be 'host' or 'device', got {backend!r}")
    return _PLANNERS[backend](layout, **options)


def plan_placement(loads: Any, layout: ExpertLayout, *, backend: str = "auto", out: Plan | None = None,
                   **options: Any) -> Plan:
    """Plan replicas, quotas and the per-source split for load matrix ``loads[R, E]``.

    ``backend``: "host", "device", or "auto" (the device for CuPy loads, else the host).
    ``options``: ``min_replica_tokens``, ``tau_tolerance``, ``target_imbalance``,
    ``fit_first`` (``Planner``). ``out`` (from the planner's ``empty_plan``) receives the
    plan in place, e.g. for CUDA graph capture.
    """
    if backend not in CHOICES:
        raise ValueError(f"backend must be one of {', '.join(map(repr, CHOICES))}, got {backend!r}")
    if backend == "auto":
        backend = HOST if array_module(loads) is np else DEVICE
    return make_planner(layout, backend, **options).plan(loads, out=out)


def reroute(topk_ids: Any, plan: Plan, rank: int, *, out: Any = None, workspace: Any = None) -> Any:
    """Physical slot ids, int32, shaped like ``topk_ids``, on the device for CuPy ids.

    The host raises ``ValueError`` for ids out of range or more tokens of an expert than
    the plan's ``loads[rank, e]``; the device cannot check values without synchronising
    and writes ``-1`` for such entries instead; with a preallocated int32 ``out`` and
    ``workspace`` (``device.reroute_workspace_size``) it allocates nothing.
    """
    check_plan(plan)
    if array_module(topk_ids) is np:
        return reroute_host(topk_ids, plan, rank, out=out)
    return reroute_device(topk_ids, plan, rank, out=out, workspace=workspace)


__all__ = ["DevicePlanner", "ExpertLayout", "HostPlanner", "Plan", "Planner", "make_planner", "plan_placement",
           "reroute"]
