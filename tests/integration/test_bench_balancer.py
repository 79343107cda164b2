"""``ultraep.bench.balancer`` runs end to end (CPU backend here, small sizes) and reports
the exposed balancing cost beside the MoE layer; the GPU run is the lead's."""

import json

import pytest

from ultraep.bench import balancer as bench


@pytest.mark.mpi
def test_balancer_bench_cpu(tmp_path, capfd):
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "2",
                       "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed
    assert "exposed = update + weight_sync + reroute" in printed
    (row,) = json.loads(out.read_text())["rows"]
    assert row["imbalance"] > 1.5 and row["imb_after"] < row["imbalance"] and row["replicas"] > 0, row
    assert row["exposed_ms"] > 0 and row["moe_layer_ms"] > 0 and 0 < row["share_pct"] < 100, row
