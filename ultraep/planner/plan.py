"""The ``Plan``: placement, quotas and per-source token split of one micro-batch.

Every planner (the quota planner on either backend, and the baselines) builds its plan
through ``Plan.from_split`` or fills the same arrays, so all plans share one set of
derived quantities, metrics and invariant checks. Input validation of load matrices
(``check_loads``) lives here too, shared by every policy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ultraep.planner.layout import ExpertLayout

INT32_LIMIT = 2**31


def array_module(array):
    """``cupy`` for CuPy arrays, else ``numpy`` (CuPy is imported only when seen)."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def check_loads(loads, layout: ExpertLayout, *, check_values: bool = True):
    """Validate a load matrix ``[R, E]`` and return it as int32 (same array module).

    Values (NaN, negatives, the int32 total) are checked only when ``check_values`` --
    the device planner skips them, since reading device values would synchronise.
    """
    if not isinstance(layout, ExpertLayout):
        raise ValueError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    xp = array_module(loads)
    if xp is np:
        loads = np.asarray(loads)
    expected = (layout.num_ranks, layout.num_experts)
    if loads.shape != expected:
        raise ValueError(f"loads must have shape (num_ranks, num_experts) = {expected}, got {loads.shape}")
    kind = loads.dtype.kind
    if kind == "f" and check_values and bool(xp.isnan(loads).any()):
        raise ValueError("loads contain NaN; token counts must be integers")
    if kind not in "iu":
        raise ValueError(f"loads must have an integer dtype (token counts), got {loads.dtype}")
    if check_values:
        if loads.size and int(loads.min()) < 0:
            raise ValueError(f"loads must be non-negative, found {int(loads.min())}")
        if loads.size and int(loads.max()) >= INT32_LIMIT:  # checked first: the int64 total could wrap
            raise ValueError(f"a load of {int(loads.max())} tokens must be below 2**31 so every quota fits in int32")
        total = int(loads.sum(dtype=xp.int64))  # R * E entries each below 2**31: no int64 overflow
        if total >= INT32_LIMIT:
            raise ValueError(f"total load ({total}) must be below 2**31 so every quota fits in int32")
    return xp.ascontiguousarray(loads, dtype=xp.int32)


def imbalance(rank_load) -> float:
    """max / mean of rank loads; 1.0 when there is no load. Same formula on every backend."""
    total = int(rank_load.sum())
    if total == 0:
        return 1.0
    return float(int(rank_load.max())) * float(rank_load.shape[0]) / float(total)


def host_rank_of_slots(layout: ExpertLayout, slots):
    """Rank of each physical slot id (``-1`` stays ``-1``)."""
    xp = array_module(slots)
    return xp.where(slots >= 0, slots // layout.slots_per_rank, -1)


class Plan:
    """Arrays of one plan (NumPy, or CuPy from the device planner); see DESIGN.md "Control plane".

    ``imbalance_before``/``imbalance_after`` are floats, or 0-d device arrays on the
    device planner (reading them would synchronise); ``to_numpy()`` gives floats.
    """

    ARRAYS = ("loads", "phys_to_log", "log_to_phys", "replica_count", "quota", "split_prefix", "rank_load")

    def __init__(self, layout: ExpertLayout, loads: Any, phys_to_log: Any, log_to_phys: Any, replica_count: Any,
                 quota: Any, split_prefix: Any, rank_load: Any, imbalance_before: float, imbalance_after: float):
        self.layout = layout
        self.loads = loads
        self.phys_to_log = phys_to_log
        self.log_to_phys = log_to_phys
        self.replica_count = replica_count
        self.quota = quota
        self.split_prefix = split_prefix
        self.rank_load = rank_load
        self.imbalance_before = imbalance_before
        self.imbalance_after = imbalance_after

    @classmethod
    def from_split(cls, layout: ExpertLayout, loads: Any, log_to_phys: Any, split: Any) -> "Plan":
        """Derive and validate a full plan from placement ``log_to_phys[E, K]`` and
        ``split[R, E, K]`` (tokens of each source for each instance)."""
        loads = check_loads(loads, layout)
        log_to_phys = np.asarray(log_to_phys, dtype=np.int32)
        split = np.asarray(split)
        R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
        if log_to_phys.shape != (E, K):
            raise ValueError(f"log_to_phys must have shape {(E, K)}, got {log_to_phys.shape}")
        if split.shape != (R, E, K):
            raise ValueError(f"split must have shape {(R, E, K)}, got {split.shape}")
        if split.size and int(split.min()) < 0:
            raise ValueError("split must be non-negative")
        split = split.astype(np.int64)
        quota = split.sum(axis=0)
        if int(quota.max(initial=0)) >= INT32_LIMIT:
            raise ValueError("quotas must fit in int32")
        present = log_to_phys >= 0
        phys_to_log = np.full(layout.num_physical, -1, dtype=np.int32)
        experts = np.broadcast_to(np.arange(E, dtype=np.int32)[:, None], (E, K))
        if log_to_phys.max(initial=-1) >= layout.num_physical:
            raise ValueError("log_to_phys holds a slot id beyond the layout's physical slots")
        phys_to_log[log_to_phys[present]] = experts[present]
        rank_load = np.zeros(R, dtype=np.int64)
        np.add.at(rank_load, host_rank_of_slots(layout, log_to_phys)[present], quota[present])
        plan = cls(
            layout=layout,
            loads=loads,
            phys_to_log=phys_to_log,
            log_to_phys=log_to_phys,
            replica_count=present.sum(axis=1).astype(np.int32),
            quota=quota.astype(np.int32),
            split_prefix=np.cumsum(split, axis=2).astype(np.int32),
            rank_load=rank_load,
            imbalance_before=imbalance(master_rank_load(layout, loads)),
            imbalance_after=imbalance(rank_load),
        )
        plan.validate()
        return plan

    # --- conversions and metrics -------------------------------------------------------

    def to_numpy(self) -> "Plan":
        if array_module(self.quota) is np:
            return self
        arrays = {name: getattr(self, name).get() for name in self.ARRAYS}
        return Plan(layout=self.layout, imbalance_before=float(self.imbalance_before),
                    imbalance_after=float(self.imbalance_after), **arrays)

    def split(self) -> Any:
        """Tokens of each source for each instance, ``int32[R, E, K]``."""
        xp = array_module(self.split_prefix)
        return xp.diff(self.split_prefix, axis=2, prepend=0).astype(xp.int32)

    @property
    def slots_used(self) -> int:
        """Filled redundant slots."""
        M = self.layout.experts_per_rank
        by_rank = self.phys_to_log.reshape(self.layout.num_ranks, self.layout.slots_per_rank)
        return int((by_rank[:, M:] >= 0).sum())

    @property
    def max_fanout(self) -> int:
        """Largest number of replicas of one expert (master excluded)."""
        return int(self.replica_count.max()) - 1

    def remote_fraction(self) -> float:
        """Share of routed tokens served by an instance on another rank than their source."""
        plan = self.to_numpy()
        split = plan.split().astype(np.int64)
        total = int(split.sum())
        if total == 0:
            return 0.0
        hosts = host_rank_of_slots(plan.layout, plan.log_to_phys)  # [E, K]
        local = hosts[None, :, :] == np.arange(plan.layout.num_ranks)[:, None, None]
        return float(total - int(split[local].sum())) / float(total)

    # --- invariants --------------------------------------------------------------------

    def validate(self, min_replica_tokens: int = 0) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (raised explicitly, so
        ``python -O`` checks as much)."""
        p = self.to_numpy()
        lay = p.layout
        R, E, K, M, S, D = (lay.num_ranks, lay.num_experts, lay.max_instances,
                            lay.experts_per_rank, lay.redundant_slots, lay.domain_size)
        shapes = {"loads": (R, E), "phys_to_log": (lay.num_physical,), "log_to_phys": (E, K),
                  "replica_count": (E,), "quota": (E, K), "split_prefix": (R, E, K), "rank_load": (R,)}
        for name, shape in shapes.items():
            array = getattr(p, name)
            _require(array.shape == shape, f"{name} has shape {array.shape}, expected {shape}")
            wanted = np.int64 if name == "rank_load" else np.int32
            _require(array.dtype == wanted, f"{name} has dtype {array.dtype}, expected {np.dtype(wanted)}")
        count = p.replica_count
        column = np.arange(K)[None, :]
        present = column < count[:, None]
        _require((count >= 1).all() and (count <= K).all(), "replica_count out of [1, K]")
        _require((p.log_to_phys[present] >= 0).all(), "log_to_phys has -1 inside an expert's instances")
        _require((p.log_to_phys[~present] == -1).all(), "log_to_phys padding is not -1")
        _require((p.quota[~present] == 0).all(), "quota of a padded column is not 0")
        _require((p.quota >= 0).all(), "negative quota")
        masters = np.array([lay.master_slot(e) for e in range(E)], dtype=np.int32)
        _require((p.log_to_phys[:, 0] == masters).all(), "a master moved (log_to_phys[:, 0] is not its home slot)")
        by_rank = p.phys_to_log.reshape(R, M + S)
        _require((by_rank[:, :M] == np.arange(E).reshape(R, M)).all(), "a master slot holds the wrong expert")
        experts = np.broadcast_to(np.arange(E)[:, None], (E, K))
        _require((p.phys_to_log[p.log_to_phys[present]] == experts[present]).all(),
                 "phys_to_log disagrees with log_to_phys")
        _require(int((p.phys_to_log >= 0).sum()) == int(count.sum()), "phys_to_log holds a slot no expert lists")
        hosts = host_rank_of_slots(lay, p.log_to_phys)
        for e in range(E):
            ranks = hosts[e, : count[e]]
            _require(len(set(ranks.tolist())) == len(ranks), f"expert {e} has two instances on one rank")
            _require((ranks // D == ranks[0] // D).all(), f"expert {e} has a replica outside its master's domain")
            replicas = p.quota[e, 1 : count[e]]
            _require((replicas >= min_replica_tokens).all(),
                     f"expert {e} has a replica below min_replica_tokens ({min_replica_tokens})")
        loads = p.loads.astype(np.int64)
        _require((p.quota.sum(axis=1, dtype=np.int64) == loads.sum(axis=0)).all(),
                 "quotas do not sum to the expert loads")
        split = np.diff(p.split_prefix.astype(np.int64), axis=2, prepend=0)
        _require((split >= 0).all(), "split_prefix is not non-decreasing (negative split)")
        _require((p.split_prefix[:, :, -1] == p.loads).all(), "splits do not sum to each source's load")
        _require((split.sum(axis=0) == p.quota).all(), "splits do not sum to the quotas")
        expected = np.zeros(R, dtype=np.int64)
        np.add.at(expected, hosts[present], p.quota[present].astype(np.int64))
        _require((p.rank_load == expected).all(), "rank_load does not match the hosted quotas")
        _require(p.imbalance_before == imbalance(master_rank_load(lay, p.loads)), "imbalance_before is wrong")
        _require(p.imbalance_after == imbalance(p.rank_load), "imbalance_after is wrong")


def _require(condition, message: str) -> None:
    """An invariant check that ``python -O`` keeps (an ``assert`` statement would vanish)."""
    if not condition:
        raise AssertionError(message)


def master_rank_load(layout: ExpertLayout, loads):
    """Rank loads without balancing (each rank serves its masters), ``int64[R]``."""
    xp = array_module(loads)
    per_expert = loads.sum(axis=0, dtype=xp.int64)
    return per_expert.reshape(layout.num_ranks, layout.experts_per_rank).sum(axis=1)
