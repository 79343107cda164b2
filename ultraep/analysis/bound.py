"""Proven lower bounds: on the optimal max rank load (``lower_bound``), so every plan can
say how far from optimal it is, and on the replicas any plan needs to reach a given max
rank load (``min_replicas_bound``), so a slot budget can be judged against the optimum.

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

``min_replicas_bound`` fixes ``t`` to the cap and minimises ``sum y`` instead; see its
docstring for the component bound that makes it tight on 64-rank layouts.

SciPy (>= 1.9, for ``milp``) is imported only when a solver runs; without it
``lower_bound(method="auto")`` falls back to the trivial bounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import check_loads, master_rank_load
from ultraep.runtime.dtypes import is_int

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_BINARIES = 2000  # replica variables above which "auto" uses the LP relaxation
# min_replicas_bound is an analysis tool: the 64-rank anchor cases take 1-10 s to prove optimal.
DEFAULT_REPLICA_TIME_LIMIT_S = 60.0


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


def _check_count(name: str, value) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


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
    return _trivial_bound_of(loads.sum(axis=0, dtype=np.int64), layout, min_replica_tokens)


def _trivial_bound_of(expert_load, layout: ExpertLayout, min_replica_tokens: int) -> int:
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
    """The MILP over replicable experts (see the module docstring) and its LP relaxation.

    With ``cap`` (a fixed max rank load, for ``min_replicas_bound``) the model also
    tightens each replica's big-M, drops hosts that cannot take a replica, and adds the
    host rows (all explained where they are built).
    """

    def __init__(self, expert_load, layout: ExpertLayout, min_replica_tokens: int, cap: int | None = None):
        R, M, D, S = layout.num_ranks, layout.experts_per_rank, layout.domain_size, layout.redundant_slots
        self.layout, self.m = layout, min_replica_tokens
        self.expert_load = expert_load
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
        pair_expert = np.repeat(np.arange(n), D - 1)
        pair_rank = (domain_first[:, None] + offsets).ravel()
        L = self.expert_load[self.experts].astype(np.float64)
        # Most tokens a replica can serve: the expert's load and, under a cap, what its host
        # can carry beside its pinned load (every token a rank serves counts, none negative).
        # A host below max(m, 1) can only hold a replica under m tokens (invalid) or an
        # empty one, which any plan can delete; so no plan, least of all a minimum, needs it.
        replica_cap = L[pair_expert]
        if cap is not None:
            replica_cap = np.minimum(replica_cap, cap - self.pinned[pair_rank])
            usable = replica_cap >= max(min_replica_tokens, 1)
            pair_expert, pair_rank, replica_cap = pair_expert[usable], pair_rank[usable], replica_cap[usable]
        self.pair_expert, self.pair_rank = pair_expert, pair_rank
        P = len(self.pair_expert)
        self.num_binaries = P
        # Columns: t | master share xm[n] | replica share x[P] | replica flag y[P] (MILP only).
        self.col_xm, self.col_x, self.col_y = 1, 1 + n, 1 + n + P
        pairs = np.arange(P)
        served = (np.r_[np.arange(n), self.pair_expert], np.r_[self.col_xm + np.arange(n), self.col_x + pairs],
                  np.ones(n + P), L, L)
        rank_load = (np.r_[self.master, self.pair_rank, np.arange(R)],
                     np.r_[self.col_xm + np.arange(n), self.col_x + pairs, np.zeros(R, dtype=np.int64)],
                     np.r_[np.ones(n + P), -np.ones(R)], np.full(R, -np.inf), -self.pinned)
        slot_rows = (self.pair_rank, np.full(R, -np.inf), np.full(R, S))
        count_rows = (self.pair_expert, np.full(n, -np.inf), caps[self.experts])
        blocks = [
            served,
            rank_load,
            (slot_rows[0], self.col_y + pairs, np.ones(P), *slot_rows[1:]),
            (count_rows[0], self.col_y + pairs, np.ones(P), *count_rows[1:]),
            # x <= replica_cap * y
            (np.r_[pairs, pairs], np.r_[self.col_x + pairs, self.col_y + pairs],
             np.r_[np.ones(P), -replica_cap], np.full(P, -np.inf), np.zeros(P)),
            # x >= m * y
            (np.r_[pairs, pairs], np.r_[self.col_x + pairs, self.col_y + pairs],
             np.r_[np.ones(P), np.full(P, -float(min_replica_tokens))], np.zeros(P), np.full(P, np.inf)),
        ]
        if cap is not None:
            blocks.append(self._host_rows(cap))
        self.milp = _assemble(blocks, self.col_y + P)
        self.milp_col_upper = np.r_[np.inf, L, replica_cap, np.ones(P)]
        # The LP relaxation with y projected out: at its optimum y = x / replica_cap (the
        # least y that x <= replica_cap * y allows; m * y <= x then holds as replica_cap >= m),
        # so the slot and replica-count rows read sum x / replica_cap. Same value, half the columns.
        inverse = 1.0 / replica_cap
        self.lp = _assemble([
            served,
            rank_load,
            (slot_rows[0], self.col_x + pairs, inverse, *slot_rows[1:]),
            (count_rows[0], self.col_x + pairs, inverse, *count_rows[1:]),
        ], self.col_y)
        self.lp_col_upper = self.milp_col_upper[: self.col_y]

    def _host_rows(self, cap: int):
        """Per replica (e on host h): ``x[e,h] <= (cap - W_h) * y[e,h] + outflow_h``.

        ``W_h`` is h's master load, ``outflow_h = sum over h's replicable masters f of
        (L_f - xm_f)``. Valid for every plan: with ``y = 1``, ``x[e,h]`` is part of h's
        inflow, and h's load ``W_h - outflow_h + inflow_h <= cap``; with ``y = 0``,
        ``x = 0 <= outflow_h``. It is implied by the integer model but not by its LP
        relaxation, where it says a replica on a host that sheds nothing costs at least
        ``x / slack`` (not ``x / L_e``): the relaxation then counts hosts, not tokens.
        Written as ``x - (cap - W_h) y + sum xm_f <= sum L_f``.
        """
        R = self.layout.num_ranks
        P = self.num_binaries
        master_load = self.expert_load.reshape(R, -1).sum(axis=1)
        by_master = np.argsort(self.master, kind="stable")
        per_rank = np.bincount(self.master, minlength=R)
        first = np.cumsum(per_rank) - per_rank
        # Each pair's row lists the xm columns of its host's replicable masters.
        repeats = per_rank[self.pair_rank]
        row_of_entry = np.repeat(np.arange(P), repeats)
        within = np.arange(repeats.sum()) - np.repeat(np.cumsum(repeats) - repeats, repeats)
        master_cols = self.col_xm + by_master[np.repeat(first[self.pair_rank], repeats) + within]
        pairs = np.arange(P)
        movable = master_load - self.pinned
        return (np.r_[pairs, pairs, row_of_entry],
                np.r_[self.col_x + pairs, self.col_y + pairs, master_cols],
                np.r_[np.ones(P), -(cap - master_load[self.pair_rank]).astype(np.float64), np.ones(len(within))],
                np.full(P, -np.inf), movable[self.pair_rank])

    def solve(self, *, integral: bool, t_floor: int, time_limit: float):
        """The MILP (``integral``) or the projected LP relaxation; ``t >= t_floor`` is valid."""
        (matrix, row_lower, row_upper), col_upper = \
            (self.milp, self.milp_col_upper) if integral else (self.lp, self.lp_col_upper)
        cost = np.zeros(matrix.shape[1])
        cost[0] = 1.0
        return self._run(cost, (matrix, row_lower, row_upper), t_floor, col_upper, integral, time_limit)

    def solve_min_replicas(self, cap: int, time_limit: float, *, integral: bool = True):
        """The model built with ``cap``, ``t`` fixed to it, minimising the number of replicas."""
        cost = np.zeros(self.milp[0].shape[1])
        cost[self.col_y:] = 1.0
        col_upper = self.milp_col_upper.copy()
        col_upper[0] = cap
        return self._run(cost, self.milp, cap, col_upper, integral, time_limit)

    def _run(self, cost, rows, t_floor, col_upper, integral, time_limit):
        from scipy.optimize import Bounds, LinearConstraint, milp

        matrix, row_lower, row_upper = rows
        integrality = np.zeros(len(cost))
        if integral:
            integrality[self.col_y:] = 1
        lower = np.zeros(len(cost))
        lower[0] = t_floor
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
    _check_count("min_replica_tokens", min_replica_tokens)
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
    model = _Model(loads.sum(axis=0, dtype=np.int64), layout, min_replica_tokens)
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


@dataclass(frozen=True)
class ReplicaBound:
    """How many replicas any valid plan needs to keep every rank at or below a cap.

    ``status``: ``"optimal"`` (``value == replicas``: a proven minimum, reached by a
    plan that passed the exact integer check), ``"time limit"`` (a gap is left:
    ``value <= optimum``, and ``optimum <= replicas`` when ``replicas`` is known), or
    ``"infeasible"`` (proven: no valid plan reaches the cap; ``value`` and ``replicas``
    are then None).
    """

    value: int | None
    replicas: int | None
    status: str
    solve_time_s: float


def min_replicas_bound(loads, layout: ExpertLayout, max_rank_load: int, *, min_replica_tokens: int = 1024,
                       time_limit: float = DEFAULT_REPLICA_TIME_LIMIT_S) -> ReplicaBound:
    """Fewest replicas (filled redundant slots) of any valid plan whose rank loads are all
    ``<= max_rank_load``, under the planner's constraints (module docstring).

    Domains are solved on their own (replicas never leave one; the minimum is the sum).
    In each, two proven bounds, the larger wins:

    * the **component bound** (``_component_bound``): every plan's replicas connect the
      ranks into groups that balance on their own; a small MILP over such partitions;
    * the **expert-level MILP** (``_expert_min_replicas``): the model of the module
      docstring with ``t`` fixed to the cap, minimising ``sum y``. It is exact, but its
      LP relaxation is weak (7 against an optimum of 38 on a 64-rank anchor, where one
      LP solve takes about 10 s), so it runs only when the component bound is not
      already matched by a plan.

    Token counts are relaxed to reals: that only adds plans, so the minimum can only
    drop and stays a lower bound; it even loses nothing, since for fixed ``y`` the
    tokens form a transportation problem with integer data (loads, cap, ``m``) that has
    an integral solution whenever it has one. Plans come from solving the expert-level
    MILP inside each group of the component bound's partition (small, fast), or from
    the full MILP; every plan is rebuilt and checked in exact integer arithmetic. ``value`` rounds a HiGHS dual bound up
    (``ceil(bound - 1e-6 * max(1, bound))``). ``time_limit`` (seconds) covers all domains.
    """
    max_rank_load = _check_count("max_rank_load", max_rank_load)
    min_replica_tokens = _check_count("min_replica_tokens", min_replica_tokens)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, np.integer, np.floating)) \
            or not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    start = time.perf_counter()
    loads = check_loads(loads, layout)
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        raise ValueError("min_replicas_bound needs SciPy (pip install scipy)") from None
    expert_load = loads.sum(axis=0, dtype=np.int64)
    D, M, domains = layout.domain_size, layout.experts_per_rank, layout.num_domains
    domain_layout = ExpertLayout(D, D * M, layout.redundant_slots, D, layout.max_instances)
    deadline = start + float(time_limit)
    results = []
    for domain in range(domains):
        domain_deadline = time.perf_counter() + (deadline - time.perf_counter()) / (domains - domain)
        part = expert_load[domain * D * M : (domain + 1) * D * M]
        results.append(_domain_min_replicas(part, domain_layout, max_rank_load, min_replica_tokens, domain_deadline))
        if results[-1][0] == "infeasible":
            return ReplicaBound(None, None, "infeasible", time.perf_counter() - start)
    status = "optimal" if all(status == "optimal" for status, _, _ in results) else "time limit"
    found = [replicas for _, _, replicas in results]
    replicas = None if None in found else sum(found)
    return ReplicaBound(sum(value for _, value, _ in results), replicas, status, time.perf_counter() - start)


def _left(deadline: float, share: float = 1.0) -> float:
    """Seconds for the next solve: ``share`` of what is left before ``deadline`` (at least 0.5 s)."""
    return max((deadline - time.perf_counter()) * share, 0.5)


def _domain_min_replicas(expert_load, layout: ExpertLayout, cap: int, min_replica_tokens: int, deadline: float):
    """``(status, bound, best replicas or None)`` of one domain given as a one-domain layout."""
    rank_load = expert_load.reshape(layout.num_ranks, -1).sum(axis=1)
    if int(rank_load.max()) <= cap:
        return "optimal", 0, 0
    if _trivial_bound_of(expert_load, layout, min_replica_tokens) > cap:
        return "infeasible", None, None
    bound, groups = _component_bound(rank_load - cap, min_replica_tokens, _left(deadline, 0.5))
    if bound is None:
        return "infeasible", None, None
    best = _group_plan(expert_load, layout, cap, min_replica_tokens, groups, deadline)
    if best != bound:
        status, full_bound, full_best = _expert_min_replicas(expert_load, layout, cap, min_replica_tokens,
                                                             _left(deadline))
        if status == "infeasible":
            return status, None, None
        bound = max(bound, full_bound)
        found = [count for count in (best, full_best) if count is not None]
        best = min(found) if found else None
    return ("optimal" if best == bound else "time limit"), bound, best


def _component_bound(excess, min_replica_tokens: int, time_limit: float):
    """The component bound of one domain: ``(bound, groups)``; ``(None, None)`` when proven infeasible.

    Take any valid plan and the graph on ranks with one edge per replica, directed from
    the master's rank to the host. A connected part ``C`` with an edge keeps its tokens
    (every instance of an expert sits in its master's part), so ``sum over C of
    (W_r - cap) <= 0``; a rank above the cap lies in such a part. ``C`` has at least
    ``|C| - 1`` edges, and at least ``|C|`` unless some rank of ``C`` has slack
    ``cap - W_r >= m``: without a directed cycle (which needs ``|C|`` edges) some rank
    of ``C`` only receives, at least ``m`` tokens, and must stay below the cap. So the
    replicas are at least the least ``sum (|C| - 1 + [no rank of C with slack >= m])``
    over families of disjoint rank sets that each hold an overloaded rank and balance.

    MILP: ``a[v, g] = 1`` puts rank ``v`` in the group led by overloaded rank ``g``
    (leaders in descending excess; a group's leader is its first overloaded member),
    ``short[g] >= a[g, g] - sum of a[v, g] over ranks with slack >= m``; cost ``sum a -
    number of groups + sum short``. Ranks at exactly the cap are left out: one adds a
    rank and no slack (for ``m = 0`` it may be the receiver, which saves no more than its
    own cost). ``groups`` (arrays of ranks) is the best partition found, or None.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    order = np.argsort(-excess, kind="stable")
    leaders = order[excess[order] > 0]
    ranks = np.r_[leaders, order[excess[order] < 0]]
    G, V = len(leaders), len(ranks)
    var = np.arange(V * G).reshape(V, G)
    upper = np.ones((V, G))
    upper[:G] = np.tril(np.ones((G, G)))  # an overloaded rank joins a group led by itself or an earlier one
    member, group = np.nonzero(np.ones((V, G), dtype=bool))
    linked = member != group
    blocks = [
        # each overloaded rank in one group, every other rank in at most one
        (np.repeat(np.arange(V), G), var.ravel(), np.ones(V * G), np.r_[np.ones(G), np.zeros(V - G)], np.ones(V)),
        # each group balances
        (group, var.ravel(), excess[ranks][member].astype(np.float64), np.full(G, -np.inf), np.zeros(G)),
        # members only in open groups: a[v, g] <= a[g, g]
        (np.r_[np.arange(linked.sum()), np.arange(linked.sum())],
         np.r_[var[member[linked], group[linked]], var[group[linked], group[linked]]],
         np.r_[np.ones(linked.sum()), -np.ones(linked.sum())], np.full(linked.sum(), -np.inf),
         np.zeros(linked.sum())),
    ]
    # A group holding overloaded rank s holds at least need[s] other ranks: the fewest
    # slacks that cover s's excess. a[s, g] <= sum over non-overloaded v of a[v, g] / need[s].
    slack = np.sort(-excess[excess < 0])[::-1]
    need = np.searchsorted(np.cumsum(slack), excess[leaders], side="left") + 1
    over, into = np.nonzero(upper[:G])
    hosts = np.arange(G, V)
    rows = np.arange(len(over))
    blocks.append((np.r_[np.repeat(rows, V - G), rows], np.r_[var[hosts][:, into].T.ravel(), var[over, into]],
                   np.r_[np.ones(len(over) * (V - G)), -need[over].astype(np.float64)],
                   np.zeros(len(over)), np.full(len(over), np.inf)))
    # short[g] (column V * G + g) >= a[g, g] - sum over receivers v of a[v, g]
    receivers = np.nonzero(-excess[ranks] >= min_replica_tokens)[0]
    blocks.append((np.r_[np.arange(G), np.arange(G), np.repeat(np.arange(G), len(receivers))],
                   np.r_[V * G + np.arange(G), var[np.arange(G), np.arange(G)], var[receivers].T.ravel()],
                   np.r_[np.ones(G), -np.ones(G), np.ones(G * len(receivers))], np.zeros(G), np.full(G, np.inf)))
    matrix, row_lower, row_upper = _assemble(blocks, V * G + G)
    cost = np.ones((V + 1, G))
    cost[np.arange(G), np.arange(G)] = 0.0
    res = milp(cost.ravel(), integrality=np.r_[np.ones(V * G), np.zeros(G)],
               bounds=Bounds(0, np.r_[upper.ravel(), np.ones(G)]),
               constraints=LinearConstraint(matrix, row_lower, row_upper),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-9})
    if res.status == 2:
        return None, None
    dual = getattr(res, "mip_dual_bound", None)
    bound = _ceil(dual) if dual is not None and np.isfinite(dual) else G  # each overloaded rank ships a replica
    groups = None
    if res.x is not None:
        chosen = res.x[: V * G].reshape(V, G) > 0.5
        groups = [ranks[chosen[:, g]] for g in range(G) if chosen[g, g]]
    return max(bound, G), groups


def _group_plan(expert_load, layout: ExpertLayout, cap: int, min_replica_tokens: int, groups, deadline: float):
    """Replicas of a plan that balances each group on its own (None if one fails).

    A group is solved as its own domain: a plan there is valid in the full domain
    (replicas stay in the domain, at most ``min(K, group size)`` instances per expert),
    and ranks outside every group keep their masters, at or below the cap."""
    if groups is None:
        return None
    M, S, K = layout.experts_per_rank, layout.redundant_slots, layout.max_instances
    by_rank = expert_load.reshape(layout.num_ranks, M)
    total = 0
    for index, ranks in enumerate(groups):
        n = len(ranks)
        group_layout = ExpertLayout(n, n * M, S, n, min(K, n))
        _, _, best = _expert_min_replicas(by_rank[ranks].ravel(), group_layout, cap, min_replica_tokens,
                                          _left(deadline, 1.0 / (len(groups) - index)))
        if best is None:
            return None
        total += best
    return total


def _expert_min_replicas(expert_load, layout: ExpertLayout, cap: int, min_replica_tokens: int,
                         time_limit: float):
    """``(status, bound, best replicas or None)`` of the expert-level MILP on a one-domain layout."""
    if int(expert_load.reshape(layout.num_ranks, -1).sum(axis=1).max()) <= cap:
        return "optimal", 0, 0
    if _trivial_bound_of(expert_load, layout, min_replica_tokens) > cap:
        return "infeasible", None, None
    model = _Model(expert_load, layout, min_replica_tokens, cap=cap)
    if model.num_binaries == 0:  # nothing can move, and the masters alone exceed the cap
        return "infeasible", None, None
    start = time.perf_counter()
    res = model.solve_min_replicas(cap, time_limit)
    if res.status == 2:
        return "infeasible", None, None
    best = None
    if res.x is not None:
        y = res.x[model.col_y:]
        certified = model.certified_max(y, _left(start + time_limit))
        if certified is not None and certified <= cap:
            best = int((y > 0.5).sum())
    dual = getattr(res, "mip_dual_bound", None)
    if dual is not None and np.isfinite(dual):
        bound = _ceil(dual)
    else:  # out of time before HiGHS had a dual bound: the relaxation's is still valid
        relaxed = model.solve_min_replicas(cap, _left(start + time_limit), integral=False)
        if relaxed.status == 2:
            return "infeasible", None, None
        bound = _ceil(relaxed.fun) if relaxed.status == 0 else 0
    bound = max(bound, 1)  # some rank exceeds the cap, so at least one replica
    return ("optimal" if best == bound else "time limit"), bound, best
