"""``ultraep.bench.balancer`` runs end to end (CPU backend here, small sizes) and reports
the exposed balancing cost (the balanced layer minus the layer with its plan in place)
beside the MoE layer; the GPU run is the lead's."""

import json

import pytest

from ultraep.bench import balancer as bench


@pytest.mark.mpi
def test_balancer_bench_cpu(tmp_path, capfd):
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "2",
                       "--rounds", "2", "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed
    assert "exposed = balanced layer (update, weight_sync on a side stream" in printed
    assert "- the same layer with its plan and replicas in place, group windows" in printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["imbalance"] > 1.5 and row["imb_after"] < row["imbalance"] and row["replicas"] > 0, row
    # on the CPU every stage is synchronous: balancing adds its whole cost to the layer
    assert row["exposed_ms"] > 0 and row["layer_ms"] > 0 and row["balanced_ms"] > row["layer_ms"], row
    assert row["share_pct"] == pytest.approx(100 * row["exposed_ms"] / row["layer_ms"]), row
