"""No configuration of the fused kernels changes a result bit: the NumPy spec of their
tasks (``ultraep.compute.fused.forward``) run with several ``FusedConfig``s -- different ones
per rank included, as a tuned layer whose ranks fall into different token buckets runs --
over random interleavings, bitwise the sequential path; ``MoELayer(fused=True,
fused_config=...)`` on 2 and 4 ranks (host in CI, the CUDA kernels on a GPU) bitwise the
sequential layer for each configuration, and bad configurations refused on every rank."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks
from tests.compute.fused.test_forward import bits, problem
from ultraep.compute.fused.forward import FusedLayer, Granularity, check_order, sequential_forward, simulate
from ultraep.integration.moe_layer import swiglu
from ultraep.compute.fused.config import FusedConfig

# (ranks, slots, tokens per rank, top_k) at the kernel's tile geometry (128-row M-tiles)
CASES = [(2, 2, [150, 40], 4), (4, 2, 70, 3)]
CONFIGS = [
    FusedConfig(1, send_tokens=1, reduce_tokens=1, copy_unroll=1, reduce_unroll=1),
    FusedConfig(3, send_tokens=7, reduce_tokens=64),
    FusedConfig(2, send_tokens=128, reduce_tokens=5, copy_unroll=8, reduce_unroll=16),
]


@pytest.mark.parametrize("ranks,slots,tokens,top_k", CASES)
def test_every_configuration_is_bitwise_the_sequential_path(ranks, slots, tokens, top_k):
    xs, ids, gates, w_up, w_down = problem(ranks, slots, tokens, top_k, hidden=24, ffn=16, seed=ranks)
    expected = bits(sequential_forward(xs, ids, gates, w_up, w_down, swiglu))
    per_rank = [[c] * ranks for c in CONFIGS] + [[CONFIGS[r % len(CONFIGS)] for r in range(ranks)]]
    for seed, configs in enumerate(per_rank):
        layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu,
                                      grain=[Granularity.kernel(c) for c in configs], epoch=seed + 1)
        check_order(layer)
        got = bits(simulate(layer, [c.ctas for c in configs], np.random.default_rng(seed)))
        for r in range(ranks):
            assert np.array_equal(got[r], expected[r]), f"rank {r}, configurations {[str(c) for c in configs]}"


def test_a_configurations_task_sizes_set_the_task_lists():
    xs, ids, gates, w_up, w_down = problem(2, 2, [150, 40], 4, hidden=24, ffn=16)
    configs = [FusedConfig(1, send_tokens=7, reduce_tokens=64), FusedConfig(1, send_tokens=128, reduce_tokens=5)]
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=[Granularity.kernel(c) for c in configs])
    for r, (tokens, config) in enumerate(zip([150, 40], configs)):
        a, b = layer.tasks[r]
        assert sum(t.kind == "send" for t in a) == -(-tokens // config.send_tokens)
        assert sum(t.kind == "reduce" for t in b) == -(-tokens // config.reduce_tokens)
    with pytest.raises(ValueError, match="same tile geometry"):
        FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu,
                              grain=[Granularity.kernel(), Granularity(16, 16, 64, 64, 128)])


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_fused_layer_is_bitwise_the_sequential_layer_for_every_configuration(backend, ranks):
    out = run_ranks(ranks, "tune/mpi/fused_config_check.py", backend, timeout=900)
    assert_all_ranks_ok(out, ranks, "fused-config")


def test_bench_columns_by_config():
    from ultraep.bench import moe_fused as bench

    assert bench.columns(False) == bench.COLUMNS and bench.parse_args([]).config == "default"
    assert bench.columns(False, "both") == ["tokens", "hidden", "ffn", "seq_ms", "fused_ms", "speedup", "gemm_bound",
                                            "tuned_ms", "tuned_gain", "tuned_config", "out_diff", "rerun_diff"]
    assert bench.columns(True, "tuned")[7:10] == ["tuned_config", "seq_train_ms", "seq_bwd_ms"]
    both = bench.columns(True, "both")
    assert both[both.index("bwd_gemm_bound") + 1:][:4] == ["tuned_train_ms", "tuned_bwd_ms", "tuned_bwd_gain",
                                                          "out_diff"]


@pytest.mark.mpi
def test_bench_runs_the_default_and_the_tuned_layer_side_by_side(tmp_path, monkeypatch, capfd):
    import json

    from ultraep.bench import moe_fused as bench
    from ultraep.tune.profile import CACHE_VARIABLE

    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))  # the host profile is measured here
    out = tmp_path / "fused.json"
    code = bench.main(["--backend", "host", "--ranks", "2", "--hidden", "32", "--ffn", "16", "--experts-per-rank",
                       "2", "--top-k", "2", "--repeats", "2", "--quiet", "--tokens", "24", "4100", "--config", "both",
                       "--backward", "--json", str(out)])
    assert code == 0, capfd.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["out_diff"] == 0 and row["rerun_diff"] == 0, row
        assert row["tuned_gain"] == pytest.approx(row["fused_ms"] / row["tuned_ms"])
        assert row["tuned_bwd_gain"] == pytest.approx(row["fused_bwd_ms"] / row["tuned_bwd_ms"])
        assert all(row[key] == 0 for key in bench.BACKWARD_DIFFS), row
        assert row["tuned_config"].startswith("ctas=")
