"""Balancer records, summaries and the load plot, from NumPy plans (no ranks needed)."""

import numpy as np

from ultraep.analysis.plots import plot_rank_loads
from ultraep.integration.stats import BalancerStats, HostClock, plan_record
from ultraep.planner import ExpertLayout, plan_placement
from ultraep.planner.plan import master_rank_load


def skewed_plan(seed):
    layout = ExpertLayout(4, 8, 2)
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 20, size=(4, 8)).astype(np.int32)
    loads[:, seed % 8] += 200
    return layout, plan_placement(loads, layout, min_replica_tokens=4)


def test_plan_record_matches_the_plan():
    layout, plan = skewed_plan(1)
    record = plan_record(layout, 3, 7, plan.loads, plan.phys_to_log, plan.rank_load)
    assert (record.layer, record.step) == (3, 7)
    assert record.imbalance_before == plan.imbalance_before and record.imbalance_after == plan.imbalance_after
    assert record.replicas == plan.slots_used > 0
    assert np.array_equal(record.rank_load_before, master_rank_load(layout, plan.loads))
    assert np.array_equal(record.rank_load_after, plan.rank_load)
    assert record.as_dict()["rank_load_after"] == plan.rank_load.tolist()


def test_summary_and_health(tmp_path):
    records = []
    for seed in range(3):
        layout, plan = skewed_plan(seed)
        record = plan_record(layout, 0, seed, plan.loads, plan.phys_to_log, plan.rank_load)
        record.weight_bytes, record.grad_bytes = 100 * record.replicas, 10 * record.replicas
        record.times_ms = {"update": float(seed), "weight_sync": None}
        records.append(record)
    healthy = BalancerStats(records, updates=3, liveness=3).summary()
    assert not healthy["stalled"] and healthy["records"] == 3 and healthy["worse_than_unbalanced"] == 0
    assert healthy["bytes_moved"] == sum(110 * r.replicas for r in records)
    assert healthy["imbalance_after_mean"] < healthy["imbalance_before_mean"]
    assert healthy["update_ms_median"] == 1.0 and "weight_sync_ms_median" not in healthy
    assert BalancerStats(records, updates=4, liveness=3).summary()["stalled"]
    assert (healthy["host_waits"], healthy["host_wait_ms"]) == (0, 0.0)  # nothing blocked the host
    blocked = BalancerStats(records, updates=3, liveness=3, host_waits=2, host_wait_ms=1.5).summary()
    assert (blocked["host_waits"], blocked["host_wait_ms"]) == (2, 1.5)
    plot_rank_loads(records, tmp_path / "loads.png")
    assert (tmp_path / "loads.png").stat().st_size > 0


def test_host_clock():
    clock = HostClock()
    clock.start("update")
    assert clock.stop("update") is None and clock.times()["update"] >= 0
    clock.reset()
    assert clock.times() == {}
