"""The lower bounds (max rank load, replicas for a cap): exact against brute force on tiny
cases, never above any feasible plan."""

import itertools

import numpy as np
import pytest

from ultraep.planner import ExpertLayout, plan_placement
from ultraep.analysis.baselines import EPLB, no_balancing, replicas_below
from ultraep.analysis.bound import _component_bound, lower_bound, min_replicas_bound, trivial_bound
from ultraep.planner.plan import check_loads
from ultraep.analysis.traces import zipf_loads


def _expert_options(loads, layout, min_replica_tokens):
    """Per expert, every (master share, replica ranks and shares) as a delta of
    (rank loads..., slots used...)."""
    R, M, D, S, K = (layout.num_ranks, layout.experts_per_rank, layout.domain_size, layout.redundant_slots,
                     layout.max_instances)
    expert_load = loads.sum(axis=0)
    for e in range(layout.num_experts):
        master = e // M
        first = master // D * D
        others = [r for r in range(first, first + D) if r != master]
        options = set()
        for count in range(0, min(K - 1, S and D - 1) + 1):
            for ranks in itertools.combinations(others, count):
                minimum = max(min_replica_tokens, 1)
                if minimum * count > expert_load[e]:
                    continue
                for split in _distribute(int(expert_load[e]), count, minimum):
                    delta = [0] * (2 * R)
                    delta[master] += split[0]
                    for r, x in zip(ranks, split[1:]):
                        delta[r] += x
                        delta[R + r] += 1
                    options.add(tuple(delta))
        yield options


def _reachable(loads, layout, min_replica_tokens, max_load):
    """Every (rank loads..., slots used...) of a valid plan with max load <= max_load,
    with the fewest replicas that reach it."""
    R, S = layout.num_ranks, layout.redundant_slots
    states = {(0,) * (2 * R): 0}
    for options in _expert_options(loads, layout, min_replica_tokens):
        new = {}
        for state, replicas in states.items():
            for delta in options:
                nxt = tuple(a + b for a, b in zip(state, delta))
                if max(nxt[R:], default=0) <= S and max(nxt[:R]) <= max_load:
                    count = replicas + sum(delta[R:])
                    new[nxt] = min(new.get(nxt, count), count)
        states = new
    return states


def brute_force_optimum(loads, layout, min_replica_tokens):
    """Smallest max rank load over every placement and integer split (dynamic programme over experts)."""
    upper = int(no_balancing(loads, layout).rank_load.max())
    return min(max(s[: layout.num_ranks]) for s in _reachable(loads, layout, min_replica_tokens, upper))


def brute_force_min_replicas(loads, layout, min_replica_tokens, max_load):
    """Fewest replicas of any valid plan with max rank load <= max_load; None if there is none."""
    states = _reachable(loads, layout, min_replica_tokens, max_load)
    return min(states.values()) if states else None


def _distribute(total, replicas, minimum):
    """(master share, replica shares...) with replica shares >= minimum."""
    if replicas == 0:
        yield (total,)
        return
    for shares in itertools.product(range(minimum, total + 1), repeat=replicas):
        if sum(shares) <= total:
            yield (total - sum(shares),) + shares


TINY = [
    (ExpertLayout(2, 2, 1), 1), (ExpertLayout(2, 4, 1), 2), (ExpertLayout(2, 4, 2), 1),
    (ExpertLayout(3, 3, 1), 2), (ExpertLayout(4, 4, 1, 2), 1), (ExpertLayout(4, 4, 1, 4, max_instances=2), 2),
    (ExpertLayout(4, 4, 2, 4), 3),
]


@pytest.mark.parametrize("layout,min_tokens", TINY, ids=lambda v: repr(v))
def test_bound_is_exact_on_tiny_cases(layout, min_tokens):
    rng = np.random.default_rng(layout.num_ranks * 100 + layout.num_experts * 10 + layout.redundant_slots)
    high = 9 if layout.num_experts <= 3 or layout.domain_size <= 2 else 5
    improved = 0
    for case in range(6):
        loads = np.zeros((layout.num_ranks, layout.num_experts), dtype=np.int32)
        hot = rng.integers(0, layout.num_experts, size=2)
        loads[:, hot] = rng.integers(0, high, size=(layout.num_ranks, 2))
        loads += (rng.random(loads.shape) < 0.3).astype(np.int32)
        optimum = brute_force_optimum(loads, layout, min_tokens)
        bound = lower_bound(loads, layout, min_replica_tokens=min_tokens, method="milp", time_limit=10)
        assert bound.value == optimum, (case, loads.tolist())
        assert bound.exact
        improved += optimum < int(no_balancing(loads, layout).rank_load.max())
        relaxed = lower_bound(loads, layout, min_replica_tokens=min_tokens, method="lp")
        assert trivial_bound(check_loads(loads, layout), layout, min_tokens) <= relaxed.value <= optimum
    assert improved >= 2  # the cases do exercise replication


def test_brute_force_helper_sees_replication():
    # One hot expert of 8 tokens on rank 0 of two ranks: a replica halves it.
    layout = ExpertLayout(2, 2, 1)
    loads = np.array([[8, 0], [0, 0]], dtype=np.int32)
    assert brute_force_optimum(loads, layout, 1) == 4
    assert brute_force_optimum(loads, layout, 5) == 5  # the replica needs 5, the master keeps 3
    assert brute_force_optimum(loads, layout, 9) == 8  # no replica possible
    for min_tokens, optimum in ((1, 4), (5, 5), (9, 8)):
        bound = lower_bound(loads, layout, min_replica_tokens=min_tokens)
        assert bound.value == optimum and bound.exact


RANDOM_LAYOUTS = [ExpertLayout(8, 16, 1), ExpertLayout(8, 32, 2, 4), ExpertLayout(8, 16, 2, 8, max_instances=3),
                  ExpertLayout(16, 32, 2, 8)]


@pytest.mark.parametrize("layout", RANDOM_LAYOUTS, ids=repr)
@pytest.mark.parametrize("method", ["auto", "lp"])
def test_bound_never_exceeds_a_feasible_plan(layout, method):
    rng = np.random.default_rng(hash(repr(layout)) % 2**32)
    min_tokens = 64
    eplb = EPLB(layout, window=2)
    for case in range(5):
        target = 1.2 + case * 0.4
        loads = zipf_loads(layout.num_ranks, layout.num_experts, 2, 256, target, seed=int(rng.integers(1 << 30)),
                           tolerance=0.05)
        bound = lower_bound(loads, layout, min_replica_tokens=min_tokens, method=method, time_limit=2)
        assert bound.method in ("milp", "lp", "trivial")
        plan = plan_placement(loads, layout, min_replica_tokens=min_tokens)
        plan.validate(min_tokens)
        assert bound.value <= int(plan.rank_load.max())
        assert bound.value <= int(no_balancing(loads, layout).rank_load.max())
        eplb_plan = eplb.plan(loads)
        if replicas_below(eplb_plan, min_tokens) == 0:  # EPLB ignores the minimum; compare when it obeys it
            assert bound.value <= int(eplb_plan.rank_load.max())
        assert bound.value >= -(-int(loads.sum()) // layout.num_ranks)
        if bound.exact:
            assert bound.value == bound.upper


def test_no_slots_means_no_balancing_is_optimal():
    layout = ExpertLayout(4, 8, 0)
    loads = zipf_loads(4, 8, 2, 64, 2.0, seed=0, tolerance=0.05)
    bound = lower_bound(loads, layout, min_replica_tokens=1)
    assert bound.exact and bound.value == int(no_balancing(loads, layout).rank_load.max())


def test_domain_bound_and_pinned_experts():
    layout = ExpertLayout(4, 4, 2, 2)
    loads = np.zeros((4, 4), dtype=np.int32)
    loads[0, 0] = 100  # domain 0 carries everything: at least 50 per rank there
    assert lower_bound(loads, layout, min_replica_tokens=1, method="trivial").value == 50
    # Below min_replica_tokens the expert cannot be replicated at all.
    assert lower_bound(loads, layout, min_replica_tokens=101).value == 100
    assert lower_bound(loads, layout, min_replica_tokens=101).exact


def test_feasible_max_marks_exact_without_changing_the_value():
    layout = ExpertLayout(8, 16, 2)
    loads = zipf_loads(8, 16, 2, 512, 2.0, seed=1, tolerance=0.05)
    plan = plan_placement(loads, layout, min_replica_tokens=32)
    plain = lower_bound(loads, layout, min_replica_tokens=32, method="lp")
    told = lower_bound(loads, layout, min_replica_tokens=32, method="lp", feasible_max=int(plan.rank_load.max()))
    assert told.value == plain.value
    assert told.exact == (told.value == int(plan.rank_load.max()))
    assert plain.gap(int(plan.rank_load.max())) >= 0


def test_bound_rejects_bad_arguments():
    layout = ExpertLayout(2, 2, 1)
    with pytest.raises(ValueError, match="method"):
        lower_bound(np.zeros((2, 2), dtype=np.int32), layout, method="exact")
    with pytest.raises(ValueError, match="min_replica_tokens"):
        lower_bound(np.zeros((2, 2), dtype=np.int32), layout, min_replica_tokens=-1)
    with pytest.raises(ValueError, match="shape"):
        lower_bound(np.zeros((2, 3), dtype=np.int32), layout)


# --- min_replicas_bound ---------------------------------------------------------------


def _tiny_loads(layout, rng):
    """Two hot experts plus sparse ones: enough skew that replicas matter."""
    high = 9 if layout.num_experts <= 3 or layout.domain_size <= 2 else 5
    loads = np.zeros((layout.num_ranks, layout.num_experts), dtype=np.int32)
    hot = rng.integers(0, layout.num_experts, size=2)
    loads[:, hot] = rng.integers(0, high, size=(layout.num_ranks, 2))
    return loads + (rng.random(loads.shape) < 0.3).astype(np.int32)


@pytest.mark.parametrize("layout,min_tokens", TINY, ids=lambda v: repr(v))
def test_min_replicas_is_exact_on_tiny_cases(layout, min_tokens):
    rng = np.random.default_rng(7 + layout.num_ranks * 100 + layout.num_experts * 10 + layout.redundant_slots)
    seen = {"infeasible": 0, "replicas": 0}
    for _ in range(8):
        loads = _tiny_loads(layout, rng)
        mean = -(-int(loads.sum()) // layout.num_ranks)
        for cap in range(mean - 1, int(no_balancing(loads, layout).rank_load.max()) + 1):
            optimum = brute_force_min_replicas(loads, layout, min_tokens, cap)
            found = min_replicas_bound(loads, layout, cap, min_replica_tokens=min_tokens, time_limit=10)
            if optimum is None:
                assert (found.status, found.value, found.replicas) == ("infeasible", None, None), (cap, loads.tolist())
                seen["infeasible"] += 1
            else:
                assert (found.status, found.value, found.replicas) == ("optimal", optimum, optimum), \
                    (cap, optimum, loads.tolist())
                seen["replicas"] = max(seen["replicas"], optimum)
    assert seen["infeasible"] and seen["replicas"]  # both outcomes exercised


def test_min_replicas_follows_chains_and_proves_infeasibility_past_the_component_bound():
    # Three ranks 2 over a cap of 6, one empty rank, one slot each and one replica per
    # expert: only the chain 2 -> 1 -> 0 -> 3 (2, 4 and 6 tokens) balances. Groups
    # balance, so with pieces of at least 3 only the expert-level MILP sees that no plan works.
    layout = ExpertLayout(4, 4, 1, max_instances=2)
    loads = np.diag([8, 8, 8, 0]).astype(np.int32)
    assert brute_force_min_replicas(loads, layout, 2, 6) == 3
    found = min_replicas_bound(loads, layout, 6, min_replica_tokens=2)
    assert (found.status, found.value, found.replicas) == ("optimal", 3, 3)
    assert brute_force_min_replicas(loads, layout, 3, 6) is None
    assert min_replicas_bound(loads, layout, 6, min_replica_tokens=3).status == "infeasible"


def test_min_replicas_sums_domains_and_needs_none_when_already_below():
    layout = ExpertLayout(4, 4, 1, 2)
    loads = np.diag([10, 0, 10, 0]).astype(np.int32)
    assert min_replicas_bound(loads, layout, 10).value == 0
    both = min_replicas_bound(loads, layout, 5, min_replica_tokens=1)
    assert (both.status, both.value, both.replicas) == ("optimal", 2, 2)
    loads[2, 2] = 12  # the second domain cannot get below 6
    assert min_replicas_bound(loads, layout, 5, min_replica_tokens=1).status == "infeasible"


@pytest.mark.parametrize("layout", RANDOM_LAYOUTS, ids=repr)
def test_greedy_never_uses_fewer_replicas_than_the_bound(layout):
    rng = np.random.default_rng(hash(repr(layout)) % 2**32)
    min_tokens = 64
    for case in range(3):
        loads = zipf_loads(layout.num_ranks, layout.num_experts, 2, 256, 1.3 + case * 0.5,
                           seed=int(rng.integers(1 << 30)), tolerance=0.05)
        plan = plan_placement(loads, layout, min_replica_tokens=min_tokens)
        achieved = int(plan.rank_load.max())
        found = min_replicas_bound(loads, layout, achieved, min_replica_tokens=min_tokens, time_limit=2)
        assert found.status in ("optimal", "time limit")
        assert found.value <= plan.slots_used
        if found.replicas is not None:
            assert found.value <= found.replicas
        below = min_replicas_bound(loads, layout, -(-int(loads.sum()) // layout.num_ranks) - 1,
                                   min_replica_tokens=min_tokens, time_limit=2)
        assert below.status == "infeasible" and below.value is None


def test_min_replicas_rejects_bad_arguments():
    layout = ExpertLayout(2, 2, 1)
    loads = np.zeros((2, 2), dtype=np.int32)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_rank_load"):
            min_replicas_bound(loads, layout, bad)
    with pytest.raises(ValueError, match="min_replica_tokens"):
        min_replicas_bound(loads, layout, 1, min_replica_tokens=-1)
    for bad in (0, -1.0, "1", float("nan")):
        with pytest.raises(ValueError, match="time_limit"):
            min_replicas_bound(loads, layout, 1, time_limit=bad)
    with pytest.raises(ValueError, match="shape"):
        min_replicas_bound(np.zeros((2, 3), dtype=np.int32), layout, 1)


def test_component_bound_counts_a_swap_when_no_rank_can_only_receive():
    # Rank 0 is 1 over the cap, rank 1 has 1 of slack, replicas need 4 tokens: one
    # replica would overload its host, so the ranks must swap (two replicas).
    layout = ExpertLayout(2, 4, 1)
    loads = np.array([[6, 5, 0, 0], [0, 0, 4, 5]], dtype=np.int32)
    assert brute_force_min_replicas(loads, layout, 4, 10) == 2
    assert _component_bound(np.array([1, -1]), 4, 10.0)[0] == 2
    assert _component_bound(np.array([1, -1]), 1, 10.0)[0] == 1
    found = min_replicas_bound(loads, layout, 10, min_replica_tokens=4)
    assert (found.status, found.value, found.replicas) == ("optimal", 2, 2)
