"""``bench moe-layer --min-replica-tokens 0 1024 auto``: one ultraep row per value in one
run, ``auto`` resolved from the machine profile (CPU backend, 2 ranks)."""

import argparse
import json

import pytest

from ultraep import MoELayer
from ultraep.bench import moe_layer as bench
from ultraep.tune import min_replica_tokens_for, read_profile
from ultraep.tune.profile import CACHE_VARIABLE

SMALL = ["--layers", "1", "--experts-per-rank", "2", "--slots", "1", "--tokens", "128", "--top-k", "2",
         "--hidden", "32", "--ffn", "16", "--initial-imbalance", "1.5", "--repeats", "1"]


def test_min_replica_tokens_takes_ints_and_auto():
    assert bench.parse_args([]).min_replica_tokens == [512]
    assert bench.parse_args(["--min-replica-tokens", "0", "1024", "auto"]).min_replica_tokens == [0, 1024, "auto"]
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="int >= 0 or 'auto'"):
            bench.replica_threshold(bad)


@pytest.mark.mpi
def test_one_row_per_value(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    out = tmp_path / "moe.json"
    code = bench.main(["--backend", "host", "--ranks", "2", *SMALL, "--min-replica-tokens", "0", "1024", "auto",
                       "--json", str(out)])
    printed = capfd.readouterr()
    assert code == 0, printed
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["ideal", "none", "ultraep@0", "ultraep@1024", "ultraep@auto"]
    assert rows["ultraep@0"]["min_replica"] == 0 and rows["ultraep@1024"]["min_replica"] == 1024
    assert rows["ultraep@0"]["replicas_mean"] > 0 and rows["ultraep@0"]["balancing_layers"] == 1
    # An expert gets at most 2 x 128 tokens a call, below 1024: the layer never balances, so its
    # weight gradients are none's bits too.
    assert rows["ultraep@1024"]["replicas_mean"] == 0 and rows["ultraep@1024"]["balancing_layers"] == 0
    assert rows["ultraep@1024"]["wgrad_rel"] == 0
    assert "ultraep@1024: no layer balanced" in printed.out and "ultraep@0: no layer" not in printed.out
    profile = read_profile(next((tmp_path / "cache").glob("profile-*.json")))
    spec = MoELayer.expert_spec(32, 16)  # w_up [32, 32] and w_down [16, 32], bf16
    auto = min_replica_tokens_for(spec.weight_slot_bytes, profile, weight_elements=32 * 32 + 16 * 32)
    assert rows["ultraep@auto"]["min_replica"] == auto  # both ranks read the one cached profile
    for name in ("ultraep@0", "ultraep@1024", "ultraep@auto"):
        assert rows[name]["out_diff"] == 0 and rows[name]["dx_diff"] == 0 and rows[name]["wgrad_rel"] <= 1e-4
