"""The lower bound: exact against brute force on tiny cases, never above any feasible plan."""

import itertools

import numpy as np
import pytest

from ultraep.planner import ExpertLayout, plan_placement
from ultraep.planner.baselines import EPLB, no_balancing, replicas_below
from ultraep.planner.bound import lower_bound, trivial_bound
from ultraep.planner.plan import check_loads
from ultraep.planner.traces import zipf_loads


def brute_force_optimum(loads, layout, min_replica_tokens):
    """Smallest max rank load over every placement and integer split (dynamic programme over experts)."""
    R, M, D, S, K = (layout.num_ranks, layout.experts_per_rank, layout.domain_size, layout.redundant_slots,
                     layout.max_instances)
    expert_load = loads.sum(axis=0)
    upper = int(no_balancing(loads, layout).rank_load.max())
    states = {(0,) * (2 * R)}  # rank loads, then slots used
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
        new = set()
        for state in states:
            for delta in options:
                nxt = tuple(a + b for a, b in zip(state, delta))
                if max(nxt[R:], default=0) <= S and max(nxt[:R]) <= upper:
                    new.add(nxt)
        states = new
    return min(max(s[:R]) for s in states)


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
