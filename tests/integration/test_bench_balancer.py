"""``ultraep.bench.balancer`` runs end to end (CPU backend here, small sizes) and reports
the exposed balancing cost (the balanced layer minus the layer with its plan in place)
beside the MoE layer; the GPU run is the lead's."""

import json
import pstats

import pytest

from tests.conftest import requires_gpu
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
    header = next(line for line in printed.splitlines() if line.startswith("weights"))
    assert "exposed_ms" in header and not set(header.split()) & set(bench.GPU_ONLY_COLUMNS)  # the GPU's times, knobs
    (row,) = json.loads(out.read_text())["rows"]
    assert row["imbalance"] > 1.5 and row["imb_after"] < row["imbalance"] and row["replicas_mean"] > 0, row
    # on the CPU every stage is synchronous: balancing adds its whole cost to the layer
    assert row["exposed_ms"] > 0 and row["layer_ms"] > 0 and row["balanced_ms"] > row["layer_ms"], row
    assert row["share_pct"] == pytest.approx(100 * row["exposed_ms"] / row["layer_ms"]), row
    assert "no replica was made" not in printed


@pytest.mark.mpi
def test_balancer_bench_says_when_no_replica_was_made(capfd):
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--repeats", "1", "--rounds", "1", "--quiet"])
    printed = capfd.readouterr().out
    assert code == 0, printed
    assert ("bf16, imbalance 2.000: no replica was made (none could serve --min-replica-tokens 1024 tokens)"
            in printed), printed


@pytest.mark.mpi
def test_balancer_bench_rows_per_sync_grid_with_the_host_breakdown_and_profile(tmp_path):
    """One row per ``--sync-blocks`` grid; the Balancer's host time split by call; no host
    waits on the CPU backend and no device stamps; ``--host-profile`` writes each row's profile."""
    out, profiles = tmp_path / "balancer.json", tmp_path / "profiles"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "3",
                       "--rounds", "1", "--sync-blocks", "all", "4", "--host-profile", str(profiles), "--quiet",
                       "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["sync_blocks"] for row in rows] == ["all", 4]
    for row in rows:
        parts = [row[f"{part}_host_ms"] for part in bench.HOST_PARTS]
        assert all(ms >= 0 for ms in parts) and row["update_host_ms"] > 0 and row["sync_host_ms"] > 0, row
        assert row["bal_host_ms"] <= row["call_host_ms"] and row["blocked_host_ms"] == 0.0, row
        assert all(row[column] is None for column in bench.DEVICE_COLUMNS), row
    assert sorted(p.name for p in profiles.iterdir()) == [
        f"bf16_imbalance2_sync{grid}_side.{ext}" for grid in ("4", "all") for ext in ("pstats", "txt")]
    # the Balancer's own functions are in the profile (the whole .pstats: on a loaded machine
    # they need not be among the .txt's top 40 by own time)
    profiled = pstats.Stats(str(profiles / "bf16_imbalance2_syncall_side.pstats")).stats
    assert any(filename.endswith("integration/balancer.py") for filename, _, _ in profiled)
    assert "tottime" in (profiles / "bf16_imbalance2_syncall_side.txt").read_text()


def test_balancer_bench_rows_per_sync_stream(tmp_path, capfd):
    """``--sync-stream side layer``: a row each, in that order, each checked against the
    masters; the title names both."""
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "2",
                       "--rounds", "1", "--sync-stream", "side", "layer", "--quiet", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["sync_stream"] for row in rows] == ["side", "layer"]
    assert all(row["replica_diff"] == 0 and row["replicas_mean"] > 0 for row in rows), rows
    assert f"weight_sync {bench.SYNC_STREAMS['side']} or {bench.SYNC_STREAMS['layer']}," in capfd.readouterr().out


def test_balancer_bench_rows_per_relay_threshold(tmp_path):
    """``--relay-threshold 1 --relay-count 1``: the row names it in the ``relays`` column, its
    replicas, synced through relay trees, are checked against their masters, and its host
    profile's file names the relays (rows of several thresholds do not overwrite each other's)."""
    out, profiles = tmp_path / "balancer.json", tmp_path / "profiles"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "2",
                       "--rounds", "1", "--relay-threshold", "1", "--relay-count", "1", "--host-profile", str(profiles),
                       "--quiet", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["relays"] for row in rows] == [">1: 1"]
    assert rows[0]["replica_diff"] == 0 and rows[0]["replicas_mean"] > 0, rows
    assert sorted(p.name for p in profiles.iterdir()) == [
        f"bf16_imbalance2_syncall_side_relay1x1.{ext}" for ext in ("pstats", "txt")]


class _Placed:
    """allgather of GPU identities as ranks placed on ``(host, GPU)`` pairs (GPU None: none)."""

    has_gpu = False  # this rank's own identity is not asked of CUDA

    def __init__(self, placements):
        self.placements = placements

    def allgather(self, value, what=None):
        return [None if gpu is None else (host, gpu) for host, gpu in self.placements]


@pytest.mark.parametrize("placements, auto", [([("h", 0), ("h", 1)], "side"), ([("a", 0), ("b", 0)], "side"),
                                              ([("h", None)] * 2, "side"), ([("h", 0)] * 4, "update"),
                                              ([("h", 0), ("h", 1), ("h", 1)], "update")])
def test_auto_sync_stream_is_beside_only_where_each_rank_has_its_gpu(placements, auto):
    """``auto`` (MoELayer's default) as ``sync_beside_pays`` decides, each placement once, in
    order; in series the update starts the sync, unless the bench's options keep it from it."""
    group = _Placed(placements)
    assert bench.resolved_sync_streams(group, ["auto"]) == [auto]
    assert bench.resolved_sync_streams(group, ["layer", "auto", "side"]) == list(dict.fromkeys(["layer", auto, "side"]))
    in_series = "layer" if auto == "update" else auto
    assert bench.resolved_sync_streams(group, ["auto"], update_may_start=False) == [in_series]


@pytest.mark.parametrize("options", [["--steps", "plan"], ["--sync-at", "dispatch"], ["--sync-blocks", "8"]])
def test_sync_started_by_the_update_refuses_options_it_cannot_take(options, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sync-stream", "update", *options])
    assert "--sync-stream update: the update starts the sync" in capsys.readouterr().err


@pytest.mark.parametrize("text, blocks", [("all", None), ("16", 16)])
def test_sync_grid_values(text, blocks):
    assert bench.sync_grid(text) == blocks


class _ThreeRanks:
    """allgather as three ranks: this one and two others."""

    def allgather(self, value):
        return [value, [0.1, None, 0.3], [None, None, 0.2]]


def test_stage_columns_are_the_slowest_ranks():
    """A sync copies on the ranks holding the replicated masters: rank 0's own stage time
    may be the agreement alone, so the columns take the slowest rank's."""
    summary = {"update_ms_median": 0.05, "reroute_ms_median": 0.01}  # no sync timed here
    assert bench.slowest_stages(_ThreeRanks(), summary) == {"update_dev_ms": 0.1, "weight_sync_dev_ms": None,
                                                            "reroute_dev_ms": 0.3}


@pytest.mark.parametrize("text", ["0", "-3", "many"])
def test_sync_grid_refuses_what_is_not_a_block_count(text):
    with pytest.raises(Exception, match="expected a positive block count or 'all'"):
        bench.sync_grid(text)


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
def test_balancer_bench_device_breakdown_on_the_gpu(tmp_path):
    """4 ranks on one GPU: the compute stream's stamps fill the device columns, and the
    serial part before dispatch is a part of the balanced layer; with the sync on the
    layer's stream (``--sync-stream layer``) the sync is a part of it too (it ends before
    dispatch starts)."""
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", "device", "--ranks", "4", "--experts", "16", "--tokens", "1024", "--top-k", "2",
                       "--hidden", "256", "--ffn", "128", "--initial-imbalance", "1.5", "--min-replica-tokens", "16",
                       "--repeats", "4", "--rounds", "2", "--sync-blocks", "all", "8", "--sync-stream", "side", "layer",
                       "--quiet", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["sync_blocks"], row["sync_stream"]) for row in rows] == [
        ("all", "side"), ("all", "layer"), (8, "side"), (8, "layer")]
    for row in rows:
        assert row["replica_diff"] == 0 and row["exposed_dev_ms"] is not None, row
        assert 0 < row["update_lead_dev_ms"] < row["lead_dev_ms"] < row["balanced_ms"], row
        assert row["wait_dev_ms"] >= 0 and row["idle_dev_ms"] >= 0 and row["synced_dev_ms"] > 0, row
        assert row["sync_stream"] == "side" or row["synced_dev_ms"] < row["lead_dev_ms"], row
        assert all(row[f"d_{phase}_dev_ms"] is not None for phase in bench.PHASE_NAMES), row
        assert row["blocked_host_ms"] >= 0 and row["update_host_ms"] > 0, row


@pytest.mark.mpi
@pytest.mark.parametrize("steps, sync_at, sync_stream", [("plan", "plan", "side"), ("sync", "plan", "side"),
                                                       ("all", "dispatch", "side"), ("all", "plan", "layer"),
                                                       ("all", "plan", "update")])
def test_balancer_bench_steps_and_where_the_sync_starts(tmp_path, capfd, steps, sync_at, sync_stream):
    """``--steps plan`` / ``sync``: the balanced layer without the sync or without update and
    reroute; ``--sync-at dispatch``: the sync started after dispatch; ``--sync-stream layer``:
    on the layer's stream; ``update``: started by the update. Each still runs, checks its
    replicas against their masters, and says what it ran (in its row and its title)."""
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", "host", "--experts", "16", "--tokens", "256", "--top-k", "2", "--hidden", "32",
                       "--ffn", "16", "--initial-imbalance", "2.0", "--min-replica-tokens", "16", "--repeats", "2",
                       "--rounds", "1", "--steps", steps, "--sync-at", sync_at, "--sync-stream", sync_stream,
                       "--quiet", "--json", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps"] == steps and row["sync_at"] == sync_at and row["replica_diff"] == 0, row
    assert row["sync_stream"] == sync_stream, row
    assert (row["weight_sync_dev_ms"] is None) == (sync_stream == "update"), row  # the update times its syncs
    assert f"weight_sync {bench.SYNC_STREAMS[sync_stream]}," in capfd.readouterr().out  # the title
    assert row["replicas_mean"] > 0, row
    left_out = {"plan": ["sync_host_ms", "wait_host_ms"], "sync": ["update_host_ms", "reroute_host_ms"], "all": []}
    assert all(row[part] == 0.0 for part in left_out[steps]), row  # those calls were not made
    assert all(row[part] > 0 for part in ("update_host_ms", "sync_host_ms", "reroute_host_ms")
               if part not in left_out[steps]), row


def test_options_the_ranks_would_refuse_are_refused_before_the_launch(capsys):
    """Argparse errors naming the option, not every rank's traceback after the launch."""
    from ultraep.bench.balancer import parse_args

    small = ["--ranks", "2", "--experts", "8", "--top-k", "2", "--tokens", "256"]
    for change, message in ((["--initial-imbalance", "1.25", "1.5"], "--initial-imbalance 1.5: zipf_loads: initial "
                                                                     "imbalance 1.5 is unreachable with 2 ranks"),
                            (["--initial-imbalance", "0.5"], "argument --initial-imbalance: expected a number >= 1"),
                            (["--top-k", "9"], "--top-k 9 exceeds --experts 8"),
                            (["--slots", "-1"], "argument --slots: expected an int >= 0"),
                            (["--relay-count", "0"], "argument --relay-count: expected an int >= 1"),
                            (["--relay-count", "3"], "--relay-count sizes the relay trees of --relay-threshold")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([*small, *change])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, change
    assert parse_args([*small, "--initial-imbalance", "1.25"]).initial_imbalance == [1.25]
