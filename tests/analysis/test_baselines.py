"""Baselines: no balancing, force-balanced ideal, EPLB (history-based, even split)."""

import numpy as np
import pytest

from ultraep.planner import ExpertLayout
from ultraep.analysis.baselines import (EPLB, eplb_placement, even_split, ideal_rank_load, ideal_remote_fraction,
                                       no_balancing, replicas_below)
from ultraep.planner.plan import host_rank_of_slots, master_rank_load
from ultraep.analysis.traces import lognormal_trace, rank_imbalance

LAYOUTS = [ExpertLayout(8, 16, 1), ExpertLayout(8, 32, 2, 4), ExpertLayout(16, 64, 2, 8), ExpertLayout(4, 8, 3, 2)]


def _random_loads(layout, rng, scale=200):
    popularity = rng.lognormal(0, 1.2, size=layout.num_experts)
    return rng.poisson(scale * popularity[None, :], size=(layout.num_ranks, layout.num_experts)).astype(np.int32)


def test_no_balancing_keeps_every_token_on_its_master():
    layout = ExpertLayout(4, 8, 2)
    loads = np.arange(32, dtype=np.int32).reshape(4, 8)
    plan = no_balancing(loads, layout)
    assert np.array_equal(plan.rank_load, master_rank_load(layout, loads))
    assert plan.slots_used == 0 and plan.max_fanout == 0
    local = sum(int(loads[r, 2 * r:2 * r + 2].sum()) for r in range(4))
    assert plan.remote_fraction() == pytest.approx(1 - local / loads.sum())


def test_ideal_is_the_even_integer_spread():
    layout = ExpertLayout(4, 8, 1)
    loads = np.zeros((4, 8), dtype=np.int32)
    loads[0, 0] = 10
    ideal = ideal_rank_load(loads, layout)
    assert ideal.tolist() == [3, 3, 2, 2]
    assert ideal_remote_fraction(layout) == 0.75


def test_even_split_deals_tokens_round_robin():
    layout = ExpertLayout(4, 4, 1)
    placement = np.full((4, 4), -1, dtype=np.int32)
    placement[:, 0] = [0, 2, 4, 6]
    placement[0, 1:3] = [3, 5]  # expert 0 on ranks 0, 1, 2
    loads = np.array([[5, 1, 0, 0], [3, 0, 0, 0], [0, 0, 2, 0], [2, 0, 0, 1]], dtype=np.int32)
    split = even_split(loads, layout, placement)
    assert split[:, 0, :3].sum(axis=0).tolist() == [4, 3, 3]  # 10 tokens over 3 instances
    assert (split.sum(axis=2) == loads).all()
    assert (split[:, 1:, 1:] == 0).all()
    # Source 0's 5 tokens are ordinals 0..4 -> instances 0,1,2,0,1.
    assert split[0, 0, :3].tolist() == [2, 2, 1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_eplb_plans_obey_layout_constraints(layout):
    rng = np.random.default_rng(0)
    policy = EPLB(layout, window=3)
    for step in range(6):
        loads = _random_loads(layout, rng)
        plan = policy.plan(loads)  # Plan.from_split validates every invariant
        plan.validate()
        hosts = host_rank_of_slots(layout, plan.log_to_phys)
        for e in range(layout.num_experts):
            ranks = hosts[e, :plan.replica_count[e]]
            assert len(set(ranks.tolist())) == len(ranks)
            assert (ranks // layout.domain_size == ranks[0] // layout.domain_size).all()
        per_rank = (plan.phys_to_log.reshape(layout.num_ranks, -1)[:, layout.experts_per_rank:] >= 0).sum(axis=1)
        assert (per_rank <= layout.redundant_slots).all()
        quota = plan.quota[np.arange(layout.num_experts)]
        for e in range(layout.num_experts):
            q = quota[e, :plan.replica_count[e]]
            assert q.max() - q.min() <= 1  # even split
        if step == 0:
            assert plan.slots_used == 0  # no history yet
        else:
            assert plan.slots_used > 0


def test_eplb_places_from_history_not_the_current_batch():
    layout = ExpertLayout(4, 8, 1)
    history = np.ones((4, 8), dtype=np.int32)
    history[:, 3] = 100  # expert 3 was hot
    current = np.ones((4, 8), dtype=np.int32)
    current[:, 6] = 100  # now expert 6 is
    policy = EPLB(layout, window=2)
    policy.plan(history)
    plan = policy.plan(current)
    assert plan.replica_count[3] > 1 and plan.replica_count[6] == 1
    # EPLB also fills its spare slots with cold experts, so the stale plan cannot help.
    assert plan.imbalance_after >= no_balancing(current, layout).imbalance_after


def test_eplb_placement_gives_hot_experts_the_most_replicas_and_is_deterministic():
    layout = ExpertLayout(8, 16, 2)
    history = np.full(16, 10, dtype=np.int64)
    history[5] = 1000
    history[9] = 400
    placement = eplb_placement(history, layout)
    counts = (placement >= 0).sum(axis=1)
    # 16 slots: largest load per instance first, up to K = 8 instances; the last two slots
    # go to the cold experts with the lowest ids.
    expected = np.ones(16, dtype=int)
    expected[[5, 9]] = 8
    expected[[0, 1]] = 2
    assert counts.tolist() == expected.tolist()
    assert np.array_equal(placement, eplb_placement(history, layout))


def test_eplb_beats_no_balancing_on_a_stationary_trace():
    layout = ExpertLayout(16, 64, 2)
    trace = lognormal_trace(steps=10, layers=1, num_ranks=16, num_experts=64, top_k=8, tokens_per_rank=1024,
                            seed=3, sigma=1.0)
    policy = EPLB(layout, window=4)
    after = [policy.plan(trace.loads[s, 0]).imbalance_after for s in range(10)]
    before = rank_imbalance(trace.loads[:, 0])
    assert np.mean(after[2:]) < np.mean(before[2:]) - 0.2


def test_replicas_below_counts_small_replicas():
    layout = ExpertLayout(2, 2, 1)
    policy = EPLB(layout, window=1)
    policy.plan(np.array([[10, 0], [10, 0]], dtype=np.int32))
    plan = policy.plan(np.array([[3, 0], [2, 0]], dtype=np.int32))
    assert plan.replica_count[0] == 2
    assert replicas_below(plan, 3) == 1 and replicas_below(plan, 2) == 0


def test_eplb_rejects_bad_arguments():
    with pytest.raises(ValueError):
        EPLB(ExpertLayout(2, 2, 1), window=0)
    with pytest.raises(ValueError, match="history_load"):
        eplb_placement(np.zeros(3), ExpertLayout(2, 2, 1))
    with pytest.raises(ValueError, match="shape"):
        EPLB(ExpertLayout(2, 2, 1)).plan(np.zeros((2, 3), dtype=np.int32))
