"""Reroute (NumPy): each source sends exactly its planned split to each instance."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ultraep.planner import ExpertLayout, plan_placement, reroute
from ultraep.planner.plan import host_rank_of_slots


def routed_tokens(layout, tokens, top_k, seed, skew):
    """Top-k ids ``[R, tokens, top_k]`` (distinct experts per token) and their load matrix."""
    rng = np.random.default_rng(seed)
    weights = rng.pareto(skew, layout.num_experts) + 0.05
    keys = rng.random((layout.num_ranks, tokens, layout.num_experts)) ** (1.0 / weights)
    topk = np.argsort(-keys, axis=2, kind="stable")[:, :, :top_k].astype(np.int32)
    loads = np.stack([np.bincount(t.ravel(), minlength=layout.num_experts) for t in topk]).astype(np.int32)
    return topk, loads


def check_reroute_matches_split(layout, topk, loads, min_tokens):
    plan = plan_placement(loads, layout, min_replica_tokens=min_tokens)
    split = plan.split()
    for rank in range(layout.num_ranks):
        slots = reroute(topk[rank], plan, rank)
        assert slots.shape == topk[rank].shape and slots.dtype == np.int32
        assert (plan.phys_to_log[slots] == topk[rank]).all(), "a token went to another expert's slot"
        counts = np.zeros_like(split[rank])
        column = np.argmax(plan.log_to_phys[topk[rank]] == slots[..., None], axis=-1)
        np.add.at(counts, (topk[rank], column), 1)
        assert (counts == split[rank]).all(), f"rank {rank} does not send its planned split"
    return plan


@settings(max_examples=300, deadline=None)
@given(ranks=st.sampled_from([1, 2, 4, 8]), experts_per_rank=st.integers(1, 4), slots=st.integers(0, 3),
       tokens=st.integers(0, 300), top_k=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       skew=st.sampled_from([0.5, 1.0, 3.0]), min_tokens=st.sampled_from([0, 1, 8, 64]))
def test_reroute_sends_split(ranks, experts_per_rank, slots, tokens, top_k, seed, skew, min_tokens):
    layout = ExpertLayout(ranks, ranks * experts_per_rank, slots)
    topk, loads = routed_tokens(layout, tokens, min(top_k, layout.num_experts), seed, skew)
    check_reroute_matches_split(layout, topk, loads, min_tokens)


def test_locality_first():
    layout = ExpertLayout(4, 8, 2)
    topk, loads = routed_tokens(layout, 2000, 2, 3, 0.3)
    plan = check_reroute_matches_split(layout, topk, loads, 16)
    assert plan.max_fanout >= 1
    hosts = host_rank_of_slots(layout, plan.log_to_phys)
    for e in np.flatnonzero(plan.replica_count > 1):
        for i in range(plan.replica_count[e]):
            host = hosts[e, i]
            # an instance serves its own rank's tokens first, up to its quota
            assert plan.split()[host, e, i] == min(loads[host, e], plan.quota[e, i])


def test_ordinal_rule():
    layout = ExpertLayout(2, 2, 1)
    loads = np.array([[6, 0], [0, 0]], np.int32)
    plan = plan_placement(loads, layout, min_replica_tokens=1)
    assert plan.quota[0].tolist() == [3, 3]
    slots = reroute(np.zeros((3, 2), np.int32), plan, 0)
    # occurrences 0..2 of expert 0 stay on the master (slot 0), 3..5 go to the replica
    assert slots.ravel().tolist() == [0, 0, 0, 3, 3, 3]  # slot 3: rank 1's redundant slot


@pytest.mark.parametrize("topk, message", [
    (np.full((2, 1), 4, np.int32), "lie in"),
    (np.zeros((2, 1), np.float32), "integer dtype"),
    (np.zeros((7, 1), np.int32), "more tokens"),
])
def test_bad_topk(topk, message):
    layout = ExpertLayout(2, 4, 1)
    plan = plan_placement(np.full((2, 4), 3, np.int32), layout)
    with pytest.raises(ValueError, match=message):
        reroute(topk, plan, 0)


@pytest.mark.parametrize("rank", [-1, 2, 1.0, True])
def test_bad_rank(rank):
    layout = ExpertLayout(2, 4, 1)
    plan = plan_placement(np.full((2, 4), 3, np.int32), layout)
    with pytest.raises(ValueError, match="rank"):
        reroute(np.zeros((1, 1), np.int32), plan, rank)
