"""Reroute: logical top-k expert ids of one rank's tokens -> physical slot ids.

The ``k``-th occurrence of logical expert ``e`` in this rank's ``topk_ids`` (token order,
then top-k slot order, i.e. row-major) goes to the first instance ``i`` with
``split_prefix[rank, e, i] > k``, so each instance receives exactly its planned split.
"""

from __future__ import annotations

import numpy as np

from ultraep.planner.plan import Plan, array_module


def reroute(topk_ids, plan: Plan, rank: int, *, backend: str | None = None, out=None, workspace=None):
    """Physical slot ids, int32, shaped like ``topk_ids``.

    ``backend`` defaults to the array type of ``topk_ids`` ("cupy" for CuPy arrays).
    The NumPy path raises ``ValueError`` for ids out of range or more tokens of an expert
    than the plan's ``loads[rank, e]``; the CuPy path cannot check values without
    synchronising and writes ``-1`` for such entries instead; with a preallocated int32
    ``out`` and ``workspace`` (``cuda.reroute_workspace_size``) it allocates nothing.
    """
    if backend is None:
        backend = "cupy" if array_module(topk_ids) is not np else "numpy"
    layout = plan.layout
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < layout.num_ranks:
        raise ValueError(f"rank must be an integer in [0, {layout.num_ranks}), got {rank!r}")
    if backend == "cupy":
        from ultraep.planner.cuda import reroute_cupy

        return reroute_cupy(topk_ids, plan, int(rank), out=out, workspace=workspace)
    if backend != "numpy":
        raise ValueError(f"backend must be 'numpy' or 'cupy', got {backend!r}")
    if out is not None or workspace is not None:
        raise ValueError("out= and workspace= are only supported by the cupy backend")
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
