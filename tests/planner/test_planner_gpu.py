"""CuPy planner and reroute: bitwise equal to the NumPy reference (needs a GPU)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.planner import ExpertLayout, Plan, plan_placement, reroute

pytestmark = [pytest.mark.gpu, requires_gpu]

POISON = -123456789


def poisoned_plan(layout):
    from ultraep.planner.device import empty_plan

    out = empty_plan(layout)
    for name in Plan.ARRAYS:
        getattr(out, name).fill(POISON)
    out.imbalance_before.fill(np.nan)
    out.imbalance_after.fill(np.nan)
    return out


def random_case(rng):
    ranks = int(rng.choice([1, 2, 4, 6, 8, 16, 32]))
    domain = int(rng.choice([d for d in range(1, ranks + 1) if ranks % d == 0] + [ranks] * 3))
    layout = ExpertLayout(ranks, ranks * int(rng.integers(1, 5)), int(rng.integers(0, 4)), domain,
                          int(rng.integers(1, domain + 1)))
    skew = np.minimum(rng.pareto(rng.choice([0.7, 1.5, 3.0]), layout.num_experts), 1000) + 0.01
    loads = rng.poisson(rng.choice([5, 200, 5000]) * skew[None, :], (ranks, layout.num_experts))
    return layout, loads.astype(np.int32), int(rng.choice([0, 1, 16, 256, 1024]))


def assert_same_plan(layout, loads, min_tokens, **options):
    import cupy

    expected = plan_placement(loads, layout, min_replica_tokens=min_tokens, **options)
    out = poisoned_plan(layout)
    got = plan_placement(cupy.asarray(loads), layout, min_replica_tokens=min_tokens, backend="device", out=out,
                         **options)
    assert got is out
    got = got.to_numpy()
    for name in Plan.ARRAYS:
        a, b = getattr(expected, name), getattr(got, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{name} differs for {layout}, min {min_tokens}, {options}"
    assert got.imbalance_before == expected.imbalance_before
    assert got.imbalance_after == expected.imbalance_after
    return expected


def test_random_small_cases_bitwise_equal():
    rng = np.random.default_rng(2026)
    replicated = 0
    for case in range(2000):  # every third case searches to the oracle's exact threshold, every fifth from a cap
        options = dict(tau_tolerance=0 if case % 3 == 0 else None,
                       target_imbalance=float(rng.choice([1.0, 1.003, 1.05, 1.5])) if case % 5 == 0 else None,
                       fit_first=case % 4 != 1)  # every fourth case without the oracle's pass 1
        replicated += assert_same_plan(*random_case(rng), **options).slots_used > 0
    assert replicated > 300  # the cases exercise replication, not just the trivial plan


@pytest.mark.parametrize("ranks, experts, domain", [(64, 128, 64), (64, 256, 64), (64, 256, 8), (72, 576, 72)])
def test_large_layouts_bitwise_equal(ranks, experts, domain):
    from ultraep.analysis.traces import zipf_loads

    layout = ExpertLayout(ranks, experts, 2, domain)
    for seed, target in enumerate([1.2, 1.5, 2.0, 3.0]):
        loads = zipf_loads(ranks, experts, 8, 8192, target, seed)
        plan = assert_same_plan(layout, loads, 1024)
        assert plan.slots_used > 0
        assert_same_plan(layout, loads, 1024, tau_tolerance=0)
        assert_same_plan(layout, loads, 1024, target_imbalance=1.005)
        assert_same_plan(layout, loads, 1024, target_imbalance=1.005, fit_first=False)
    assert_same_plan(layout, zipf_loads(ranks, experts, 8, 8192, 2.0, 9), 1024, tau_tolerance=500)


def test_rank_loads_beyond_packed_oracle_keys():
    """Rank loads of 2**23 and more take the oracle's unpacked keys (one ballot per chunk)."""
    from ultraep.analysis.traces import zipf_loads

    layout = ExpertLayout(64, 256, 2)
    loads = zipf_loads(64, 256, 8, 8192, 1.5, 4) * 256  # about 2**24 tokens per rank, total below 2**31
    assert loads.sum(axis=0).reshape(64, 4).sum(axis=1).max() >= 2**23
    assert assert_same_plan(layout, loads, 1024 * 256).slots_used > 0


def test_repeated_calls_on_one_out_multi_domain():
    """Several domains combine their imbalance through a ticket in the plan's workspace,
    which the last cluster resets: the same ``out`` must stay correct call after call."""
    import cupy
    from ultraep.analysis.traces import zipf_loads
    from ultraep.planner.device import empty_plan

    layout = ExpertLayout(64, 256, 2, 8)
    out = poisoned_plan(layout)
    for seed, target in enumerate([1.5, 3.0, 2.0]):
        loads = zipf_loads(64, 256, 8, 8192, target, seed)
        expected = plan_placement(loads, layout)
        plan_placement(cupy.asarray(loads), layout, backend="device", out=out)
        got = out.to_numpy()
        assert (got.imbalance_before, got.imbalance_after) == (expected.imbalance_before, expected.imbalance_after)
        assert np.array_equal(got.split_prefix, expected.split_prefix)
        assert int(out.planner_workspace[-1].get()) == 0  # the ticket is reset
    bare = empty_plan(layout)
    bare.planner_workspace = None
    with pytest.raises(ValueError, match="empty_plan"):
        plan_placement(cupy.asarray(loads), layout, backend="device", out=bare)


def test_captured_in_a_cuda_graph():
    import cupy
    from ultraep.analysis.traces import zipf_loads

    layout = ExpertLayout(64, 256, 2)
    loads = cupy.asarray(zipf_loads(64, 256, 8, 8192, 2.0, 1))
    out = poisoned_plan(layout)
    plan_placement(loads, layout, backend="device", out=out)  # compile outside the capture
    out = poisoned_plan(layout)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan_placement(loads, layout, backend="device", out=out)
        graph = stream.end_capture()
        graph.launch()
    stream.synchronize()
    expected = plan_placement(loads.get(), layout)
    for name in Plan.ARRAYS:
        assert np.array_equal(getattr(out, name).get(), getattr(expected, name)), name


def test_reroute_bitwise_equal():
    import cupy
    from ultraep.analysis.traces import zipf_topk
    from ultraep.planner.device import reroute_workspace_size

    rng = np.random.default_rng(7)
    for ranks, experts, target in [(64, 256, 2.0), (64, 128, 3.0), (72, 576, 1.5)]:
        layout = ExpertLayout(ranks, experts, 2)
        topk = zipf_topk(ranks, experts, 8, 2048, target, 3)
        loads = np.stack([np.bincount(t.ravel(), minlength=experts) for t in topk]).astype(np.int32)
        plan = plan_placement(loads, layout)
        device_plan = plan_placement(cupy.asarray(loads), layout, backend="device")
        for i, rank in enumerate(rng.choice(ranks, 6, replace=False)):
            ids = cupy.asarray(topk[rank], dtype=np.int64 if i % 2 else np.int32)  # both read in place
            out = cupy.full(topk[rank].shape, POISON, np.int32)
            workspace = cupy.full(reroute_workspace_size(layout, ids.size), POISON, np.int32)
            got = reroute(ids, device_plan, int(rank), out=out, workspace=workspace)
            assert np.array_equal(got.get(), reroute(topk[rank], plan, int(rank)))
        with pytest.raises(ValueError, match="workspace must be int32 with at least"):
            reroute(ids, device_plan, 0, workspace=cupy.empty(1, np.int32))
    # random small cases, including ids no plan expects (-> -1 on the GPU)
    for _ in range(500):
        layout, _, min_tokens = random_case(rng)
        tokens = int(rng.integers(0, 3000))
        ids = rng.integers(0, layout.num_experts, (layout.num_ranks, tokens, 1)).astype(np.int32)
        loads = np.stack([np.bincount(t.ravel(), minlength=layout.num_experts) for t in ids]).astype(np.int32)
        plan = plan_placement(loads, layout, min_replica_tokens=min_tokens)
        rank = int(rng.integers(layout.num_ranks))
        got = reroute(cupy.asarray(ids[rank]), plan, rank).get()
        assert np.array_equal(got, reroute(ids[rank], plan, rank))
    layout = ExpertLayout(2, 4, 1)
    plan = plan_placement(np.full((2, 4), 1, np.int32), layout)
    got = reroute(cupy.asarray(np.array([[0, 0, 7, -1]], np.int32)), plan, 0).get()
    assert got.tolist() == [[0, -1, -1, -1]]


@pytest.mark.traps
@pytest.mark.parametrize("layout", [ExpertLayout(64, 256, 2), ExpertLayout(6, 18, 3, 3, 2)])
def test_launch_needs_exactly_the_computed_shared_memory(layout):
    """``plan_shared_bytes`` is the kernel's carve-up: at that size the kernel plans, and
    one byte less traps (in a child: a trap ends the CUDA context) -- shared memory is
    allocated in coarse units, so without the kernel's own check one byte less would
    run on."""
    import subprocess
    import sys

    import cupy
    from ultraep.planner import DevicePlanner
    from ultraep.analysis.traces import zipf_loads

    loads = zipf_loads(layout.num_ranks, layout.num_experts, 2, 4096, 2.0, 5)
    planner = DevicePlanner(layout, min_replica_tokens=16)
    got = planner.plan(cupy.asarray(loads)).to_numpy()
    assert np.array_equal(got.split_prefix, plan_placement(loads, layout, min_replica_tokens=16).split_prefix)
    code = ("import cupy, numpy as np\n"
            "from ultraep.planner import DevicePlanner, ExpertLayout\n"
            f"planner = DevicePlanner({layout!r})\n"
            "planner.shared_bytes -= 1\n"
            f"planner.plan(cupy.ones(({layout.num_ranks}, {layout.num_experts}), np.int32))\n"
            "cupy.cuda.Device().synchronize()\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode != 0 and "cudaErrorLaunchFailure" in child.stderr, child.stderr
