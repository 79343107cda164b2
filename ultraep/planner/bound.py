"""A proven lower bound on the optimal max rank load, so every plan can say how far from
optimal it is.

The optimum is taken over exactly the planner's constraints: masters fixed; at most
``S`` replicas per rank; at most one instance of an expert per rank and ``K``
instances per expert; replicas inside the master's domain; every replica serving at
least ``min_replica_tokens`` tokens. Model (HiGHS through ``scipy.optimize.milp``)::

    minimise t   over   x[e, r] >= 0 (tokens of e served on r),  y[e, r] in {0, 1} (replica of e on r)
    sum_r x[e, r] = L_e                         every token served
    m * y[e, r] <= x[e, r] <= L_e * y[e, r]     replicas only where placed, each >= m tokens
    sum_e y[e, r] <= S,  sum_r y[e, r] <= K - 1 slots per rank, instances per expert
    sum_e x[e, r] <= t                          every rank below t

with ``r`` ranging over the master's domain (``y`` only off the master's rank). Token
counts are integers, so any optimum is an integer ``>= ceil(t*)``; and once ``y`` is
fixed, ``x`` lives in a transportation polytope (integral for integer ``t``), so a MILP
solution gives an integral plan with max load ``ceil(t)`` that we rebuild and check in
exact integer arithmetic -- the certificate behind ``exact``.

Methods: ``"milp"`` (small layouts, under a time limit; when the limit hits, HiGHS's
dual bound is still a valid bound), ``"lp"`` (the relaxation ``y in [0, 1]``, for large
layouts), and always the trivial bounds: ``ceil(total / R)``, each domain's
``ceil(domain total / D)``, each rank's unmovable master load (experts below
``min_replica_tokens`` cannot be replicated), and each expert's
``ceil(L_e / max instances)``.

SciPy (>= 1.9, for ``milp``) is imported only when a solver runs; without it
``method="auto"`` falls back to the trivial bounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import check_loads, master_rank_load

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_BINARIES = 2000  # replica variables above which "auto" uses the LP relaxation


@dataclass(frozen=True)
class LowerBound:
    """``value`` <= the optimal max rank load; ``exact`` when a feasible plan reaches it.

    ``method`` is the solver whose bound (never below the trivial bounds) is ``value``:
    ``"milp"``, ``"lp"``, or ``"trivial"`` when no solver ran or finished.
    ``upper`` is the smallest max rank load of a plan known to be feasible (the
    no-balancing plan, the MILP's certified plan, or ``feasible_max`` from the caller).
    """

    value: int
    method: str
    exact: bool
    upper: int
    trivial: int
    solve_time_s: float

    def gap(self, max_rank_load: int) -> float:
        """Relative excess of ``max_rank_load`` over this bound."""
        return max_rank_load / self.value - 1.0 if self.value else 0.0


def _ceil(value: float) -> int:
    # Solver tolerances: never round a value that is a hair above an integer up past it.
    return int(np.ceil(value - 1e-6 * max(1.0, abs(value))))


def replicable_counts(expert_load: np.ndarray, layout: ExpertLayout, min_replica_tokens: int) -> np.ndarray:
    """Most replicas each expert can have: ``K - 1``, at most ``L_e // m`` (each needs ``m`` tokens)."""
    cap = np.full(expert_load.shape, layout.max_instances - 1, dtype=np.int64)
    if min_replica_tokens > 0:
        cap = np.minimum(cap, expert_load // min_replica_tokens)
    return np.where(expert_load > 0, cap, 0)


def trivial_bound(loads, layout: ExpertLayout, min_replica_tokens: int) -> int:
    """The closed-form bounds of the module docstring (loads already validated)."""
    expert_load = loads.sum(axis=0, dtype=np.int64)
    R, M, D = layout.num_ranks, layout.experts_per_rank, layout.domain_size
    total = int(expert_load.sum())
    bound = -(-total // R)
    domain_totals = expert_load.reshape(layout.num_domains, D * M).sum(axis=1)
    bound = max(bound, int((-(-domain_totals // D)).max()))
    replicas = replicable_counts(expert_load, layout, min_replica_tokens)
    if layout.redundant_slots == 0:
        replicas[:] = 0
    pinned = np.where(replicas == 0, expert_load, 0).reshape(R, M).sum(axis=1)
    bound = max(bound, int(pinned.max()))
    return max(bound, int((-(-expert_load // (1 + replicas))).max()))


def _assemble(blocks, num_cols):
    """Stack ``(rows, cols, vals, row_lower, row_upper)`` blocks into one CSR constraint."""
    from scipy import sparse

    rows, cols, vals, lower, upper, offset = [], [], [], [], [], 0
    for r, c, v, lo, up in blocks:
        rows.append(np.asarray(r) + offset)
        cols.append(np.asarray(c))
        vals.append(np.asarray(v, dtype=np.float64))
        lower.append(np.asarray(lo, dtype=np.float64))
        upper.append(np.asarray(up, dtype=np.float64))
        offset += len(lo)
    matrix = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                              shape=(offset, num_cols))
    return matrix, np.concatenate(lower), np.concatenate(upper)


class _Model:
    """The MILP over replicable experts (see the module docstring) and its LP relaxation."""

    def __init__(self, loads, layout: ExpertLayout, min_replica_tokens: int):
        R, M, D, S = layout.num_ranks, layout.experts_per_rank, layout.domain_size, layout.redundant_slots
        self.layout, self.m = layout, min_replica_tokens
        self.expert_load = loads.sum(axis=0, dtype=np.int64)
        caps = replicable_counts(self.expert_load, layout, min_replica_tokens) if S else 0 * self.expert_load
        self.caps = caps
        self.experts = np.nonzero(caps > 0)[0]
        self.master = self.experts // M
        n = len(self.experts)
        # Load that stays on masters of experts that cannot be replicated.
        self.pinned = np.where(caps > 0, 0, self.expert_load).reshape(R, M).sum(axis=1)
        domain_first = (self.master // D) * D
        others = np.arange(D - 1)
        # The D - 1 ranks of the master's domain other than the master, per replicable expert.
        offsets = others[None, :] + (others[None, :] >= (self.master - domain_first)[:, None])
        self.pair_expert = np.repeat(np.arange(n), D - 1)
        self.pair_rank = (domain_first[:, None] + offsets).ravel()
        P = len(self.pair_expert)
        self.num_binaries = P
        # Columns: t | master share xm[n] | replica share x[P] | replica flag y[P] (MILP only).
        self.col_xm, self.col_x, self.col_y = 1, 1 + n, 1 + n + P
        L = self.expert_load[self.experts].astype(np.float64)
        pairs = np.arange(P)
        served = (np.r_[np.arange(n), self.pair_expert], np.r_[self.col_xm + np.arange(n), self.col_x + pairs],
                  np.ones(n + P), L, L)
        rank_load = (np.r_[self.master, self.pair_rank, np.arange(R)],
                     np.r_[self.col_xm + np.arange(n), self.col_x + pairs, np.zeros(R, dtype=np.int64)],
                     np.r_[np.ones(n + P), -np.ones(R)], np.full(R, -np.inf), -self.pinned)
        slot_rows = (self.pair_rank, np.full(R, -np.inf), np.full(R, S))
        count_rows = (self.pair_expert, np.full(n, -np.inf), caps[self.experts])
        self.milp = _assemble([
            served,
            rank_load,
            (slot_rows[0], self.col_y + pairs, np.ones(P), *slot_rows[1:]),
            (count_rows[0], self.col_y + pairs, np.ones(P), *count_rows[1:]),
            # x <= L_e * y
            (np.r_[pairs, pairs], np.r_[self.col_x + pairs, self.col_y + pairs],
             np.r_[np.ones(P), -L[self.pair_expert]], np.full(P, -np.inf), np.zeros(P)),
            # x >= m * y
            (np.r_[pairs, pairs], np.r_[self.col_x + pairs, self.col_y + pairs],
             np.r_[np.ones(P), np.full(P, -float(min_replica_tokens))], np.zeros(P), np.full(P, np.inf)),
        ], self.col_y + P)
        self.milp_col_upper = np.r_[np.inf, L, L[self.pair_expert], np.ones(P)]
        # The LP relaxation with y projected out: at its optimum y = x / L_e (the least y
        # that x <= L_e * y allows; m * y <= x then holds as L_e >= m), so the slot and
        # replica-count rows read sum x / L_e. Same value, half the columns.
        inverse = 1.0 / L[self.pair_expert]
        self.lp = _assemble([
            served,
            rank_load,
            (slot_rows[0], self.col_x + pairs, inverse, *slot_rows[1:]),
            (count_rows[0], self.col_x + pairs, inverse, *count_rows[1:]),
        ], self.col_y)
        self.lp_col_upper = self.milp_col_upper[: self.col_y]

    def solve(self, *, integral: bool, t_floor: int, time_limit: float):
        """The MILP (``integral``) or the projected LP relaxation; ``t >= t_floor`` is valid."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        (matrix, row_lower, row_upper), col_upper = \
            (self.milp, self.milp_col_upper) if integral else (self.lp, self.lp_col_upper)
        cols = matrix.shape[1]
        integrality = np.zeros(cols)
        integrality[self.col_y:] = 1
        lower = np.zeros(cols)
        lower[0] = t_floor
        cost = np.zeros(cols)
        cost[0] = 1.0
        options = {"time_limit": max(time_limit, 1e-3), "presolve": True}
        if integral:
            options["mip_rel_gap"] = 1e-9
        return milp(cost, integrality=integrality, bounds=Bounds(lower, col_upper),
                    constraints=LinearConstraint(matrix, row_lower, row_upper), options=options)

    def certified_max(self, y_values: np.ndarray, time_limit: float) -> int | None:
        """Max rank load of an integral plan with the replicas ``y``, checked exactly; None if none found."""
        from scipy import sparse
        from scipy.optimize import Bounds, LinearConstraint, milp

        chosen = y_values > 0.5
        R, S = self.layout.num_ranks, self.layout.redundant_slots
        n = len(self.experts)
        pe, pr = self.pair_expert[chosen], self.pair_rank[chosen]
        load = self.expert_load[self.experts]
        # Fixed y: the x problem is a transportation problem; solve it at integer t by LP.
        P = len(pe)
        cols = 1 + n + P
        xm, xr = 1, 1 + n
        matrix_rows = [np.r_[np.arange(n), pe], np.r_[n + self.master, n + pr, n + np.arange(R)]]
        matrix_cols = [np.r_[xm + np.arange(n), xr + np.arange(P)],
                       np.r_[xm + np.arange(n), xr + np.arange(P), np.zeros(R, dtype=np.int64)]]
        vals = np.r_[np.ones(n + P), np.ones(n + P), -np.ones(R)]
        matrix = sparse.csr_array((vals, (np.concatenate(matrix_rows), np.concatenate(matrix_cols))),
                                  shape=(n + R, cols))
        lo = np.r_[load, np.full(R, -np.inf)].astype(np.float64)
        up = np.r_[load, -self.pinned].astype(np.float64)
        col_lo = np.r_[0.0, np.zeros(n), np.full(P, float(self.m))]
        col_up = np.r_[np.inf, load, load[pe]].astype(np.float64)
        cost = np.zeros(cols)
        cost[0] = 1.0
        res = milp(cost, bounds=Bounds(col_lo, col_up), constraints=LinearConstraint(matrix, lo, up),
                   options={"time_limit": max(time_limit, 1e-3)})
        if res.x is None:
            return None
        t = _ceil(res.x[0])
        # Integral t makes the polytope integral; fix t and find a vertex, then verify exactly.
        col_lo[0] = col_up[0] = t
        res = milp(cost * 0, bounds=Bounds(col_lo, col_up), constraints=LinearConstraint(matrix, lo, up),
                   options={"time_limit": max(time_limit, 1e-3)})
        if res.x is None:
            return None
        x = np.rint(res.x).astype(np.int64)
        master_share, replica_share = x[xm : xm + n], x[xr : xr + P]
        served = master_share.copy()
        np.add.at(served, pe, replica_share)
        rank_load = self.pinned.astype(np.int64).copy()
        np.add.at(rank_load, self.master, master_share)
        np.add.at(rank_load, pr, replica_share)
        per_rank = np.bincount(pr, minlength=R)
        per_expert = np.bincount(pe, minlength=n)
        caps = self.caps[self.experts]
        ok = ((served == load).all() and (master_share >= 0).all() and (replica_share >= self.m).all()
              and (per_rank <= S).all() and (per_expert <= caps).all())
        return int(rank_load.max()) if ok else None


def lower_bound(loads, layout: ExpertLayout, *, min_replica_tokens: int = 1024, method: str = "auto",
                time_limit: float = DEFAULT_TIME_LIMIT_S, max_binaries: int = DEFAULT_MAX_BINARIES,
                feasible_max: int | None = None) -> LowerBound:
    """Lower bound on the optimal max rank load of ``loads[R, E]`` under the planner's constraints.

    ``method``: ``"auto"`` (MILP when it has at most ``max_binaries`` replica variables,
    else LP), ``"milp"``, ``"lp"`` or ``"trivial"``. ``time_limit`` (seconds) caps each
    HiGHS call. ``feasible_max``: the max rank load of a plan the caller has validated
    under the same constraints; it can only mark the bound exact, never change it.
    """
    if method not in ("auto", "milp", "lp", "trivial"):
        raise ValueError(f"method must be 'auto', 'milp', 'lp' or 'trivial', got {method!r}")
    if isinstance(min_replica_tokens, bool) or not isinstance(min_replica_tokens, (int, np.integer)) \
            or min_replica_tokens < 0:
        raise ValueError(f"min_replica_tokens must be a non-negative integer, got {min_replica_tokens!r}")
    start = time.perf_counter()
    loads = check_loads(loads, layout)
    trivial = trivial_bound(loads, layout, min_replica_tokens)
    upper = int(master_rank_load(layout, loads).max())  # no balancing is always feasible
    if feasible_max is not None:
        upper = min(upper, int(feasible_max))

    def result(value, how):
        exact = value >= upper
        return LowerBound(int(value), how, exact, upper, trivial, time.perf_counter() - start)

    if trivial >= upper or method == "trivial":
        return result(trivial, "trivial")
    try:
        import scipy.optimize  # noqa: F401  (checked here so a missing SciPy is reported once, clearly)
    except ImportError:
        if method == "auto":
            return result(trivial, "trivial")
        raise ValueError(f"lower_bound(method={method!r}) needs SciPy (pip install scipy)") from None
    model = _Model(loads, layout, min_replica_tokens)
    value = trivial
    if method == "milp" or (method == "auto" and model.num_binaries <= max_binaries):
        res = model.solve(integral=True, t_floor=trivial, time_limit=time_limit)
        if res.x is not None:
            remaining = time_limit - (time.perf_counter() - start)
            certified = model.certified_max(res.x[model.col_y:], max(remaining, 0.2))
            if certified is not None:
                upper = min(upper, certified)
        dual = getattr(res, "mip_dual_bound", None)
        if dual is not None and np.isfinite(dual):
            return result(max(value, _ceil(dual)), "milp")
        # Out of time before HiGHS had a dual bound: fall back to the relaxation.
    remaining = time_limit - (time.perf_counter() - start)
    res = model.solve(integral=False, t_floor=trivial, time_limit=max(remaining, 0.2))
    if res.status != 0 or res.x is None:
        return result(value, "trivial")
    return result(max(value, _ceil(res.fun)), "lp")
