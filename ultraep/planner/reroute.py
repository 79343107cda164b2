"""Reroute: logical top-k expert ids of one rank's tokens -> physical slot ids.

The ``k``-th occurrence of logical expert ``e`` in this rank's ``topk_ids`` (token order,
then top-k slot order, i.e. row-major) goes to the first instance ``i`` with
``split_prefix[rank, e, i] > k``, so each instance receives exactly its planned split.
This module holds the NumPy reference (``HostPlanner.reroute``); ``raw_kernels/reroute.cu``
is the device's.
"""

from __future__ import annotations

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan
from ultraep.runtime.dtypes import is_int


def check_rank(layout: ExpertLayout, rank) -> int:
    if not is_int(rank) or not 0 <= rank < layout.num_ranks:
        raise ValueError(f"rank must be an integer in [0, {layout.num_ranks}), got {rank!r}")
    return int(rank)


def check_plan(plan) -> Plan:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan (from plan_placement or a planner), got {type(plan).__name__}")
    return plan


def check_reroute_out(out, shape: tuple, *, by_address: bool) -> None:
    """``out`` of a reroute: an int32 array of the ids' ``shape`` that the call may write,
    C-contiguous where a kernel writes it ``by_address``; TypeError or ValueError naming it."""
    if not (hasattr(out, "shape") and hasattr(out, "dtype") and hasattr(out, "flags")):
        raise TypeError(f"out must be an int32 array of shape {tuple(shape)}, got {type(out).__name__}")
    strided = by_address and not out.flags.c_contiguous
    if tuple(out.shape) != tuple(shape) or out.dtype != np.int32 or strided:
        raise ValueError(f"out must be {'a C-contiguous' if by_address else 'an'} int32 array of shape {tuple(shape)}, "
                         f"got {out.dtype} of shape {tuple(out.shape)}{', not C-contiguous' if strided else ''}")
    if not getattr(out.flags, "writeable", True):  # NumPy's flag; CuPy arrays are always writable
        raise ValueError("out: array is read-only but is written by this call")


def check_plan_out(out, layout: ExpertLayout) -> Plan:
    """``out`` of a planning call: a Plan (from the planner's ``empty_plan``) of ``layout``
    whose arrays the call may write; TypeError or ValueError naming it."""
    if not isinstance(out, Plan):
        raise TypeError(f"out must be a Plan from the planner's empty_plan, got {type(out).__name__}")
    if out.layout != layout:
        raise ValueError("out was allocated for another layout")
    for name in Plan.ARRAYS:
        if not getattr(getattr(out, name).flags, "writeable", True):
            raise ValueError(f"out.{name}: array is read-only but is written by this call")
    return out


def reroute_reference(topk_ids, plan: Plan, rank: int) -> np.ndarray:
    """Physical slot ids, int32, shaped like ``topk_ids``; ``ValueError`` for ids out of
    range or more tokens of an expert than the plan's ``loads[rank, e]``."""
    layout = check_plan(plan).layout
    rank = check_rank(layout, rank)
    plan = plan.to_numpy()
    topk_ids = np.asarray(topk_ids)
    if topk_ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must have an integer dtype, got {topk_ids.dtype}")
    flat = topk_ids.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= layout.num_experts):
        raise ValueError(f"topk_ids must lie in [0, {layout.num_experts})")
    ordinal = occurrence_index(flat)
    prefix = plan.split_prefix[rank]  # [E, K]
    if flat.size and (ordinal >= prefix[flat, -1]).any():
        raise ValueError(f"topk_ids route more tokens to an expert than loads[{rank}] planned for")
    instance = (prefix[flat] <= ordinal[:, None]).sum(axis=1)
    return plan.log_to_phys[flat, instance].astype(np.int32).reshape(topk_ids.shape)


def occurrence_index(ids):
    """For each entry, how many earlier entries hold the same id."""
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]]) if ids.size else np.zeros(0, np.int64)
    group_start = np.repeat(starts, np.diff(np.r_[starts, ids.size]))
    ordinal = np.empty(ids.size, dtype=np.int64)
    ordinal[order] = np.arange(ids.size) - group_start
    return ordinal
