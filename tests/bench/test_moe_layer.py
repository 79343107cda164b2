"""``ultraep.bench.moe_layer``: the routings it compares and a tiny run end to end on the CPU
backend (4 ranks) and on one GPU; the timed GPU runs are scripts/multi_gpu_check.sh's."""

import json

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.bench import moe_layer as bench
from ultraep.analysis.traces import rank_imbalance

TINY = ["--layers", "2", "--experts-per-rank", "2", "--slots", "1", "--tokens", "256", "--top-k", "2", "--hidden", "32",
        "--ffn", "16", "--initial-imbalance", "1.5", "--min-replica-tokens", "16",
        "--repeats", "2"]


def loads(ids, experts):
    return np.stack([np.bincount(ids[r].ravel(), minlength=experts) for r in range(ids.shape[0])])


def test_ideal_routing_sends_every_expert_the_same_pairs_from_every_source():
    args = bench.parse_args(TINY)
    ids = bench.routing("ideal", 4, 8, layer=1, args=args)
    assert ids.shape == (4, 256, 2)
    assert (loads(ids, 8) == 256 * 2 // 8).all()
    assert all(len(set(token)) == 2 for token in ids.reshape(-1, 2).tolist())  # distinct experts per token
    assert (bench.received_rows(ids, 2) == 256 * 2).all()


def test_skewed_routing_meets_the_target_and_differs_per_layer():
    args = bench.parse_args(TINY)
    first, second = (bench.routing("none", 4, 8, layer, args) for layer in (0, 1))
    for ids in (first, second):
        assert rank_imbalance(loads(ids, 8)) == pytest.approx(1.5, rel=0.01)
        rows = bench.received_rows(ids, 2)
        assert rows.sum() == 4 * 256 * 2 and rows.max() / rows.mean() == pytest.approx(1.5, rel=0.01)
    assert not np.array_equal(first, second)


def test_skewed_routing_tries_other_rankings_when_the_first_cannot_reach_the_target():
    from ultraep.analysis.traces import zipf_topk

    args = bench.parse_args(["--tokens", "1024", "--top-k", "8", "--initial-imbalance", "1.5"])
    with pytest.raises(ValueError, match="unreachable"):
        zipf_topk(4, 32, 8, 1024, 1.5, seed=0)  # the first ranking of layer 0
    assert rank_imbalance(loads(bench.routing("none", 4, 32, layer=0, args=args), 32)) == pytest.approx(1.5, rel=0.01)


def test_routings_the_ranks_could_not_draw_are_refused_before_the_launch(capsys):
    """Ideal's force-balanced routing needs tokens x top-k divisible by the experts; the
    skewed one a target some Zipf ranking reaches: argparse errors naming the options."""
    for change, message in ((["--tokens", "255"], "divisible by the experts (8)"),
                            (["--initial-imbalance", "9"], "--initial-imbalance 9.0: layer 0: no Zipf ranking")):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args([*TINY, "--ranks", "4", *change])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.mpi
def test_moe_layer_bench_cpu(tmp_path, capfd):
    out = tmp_path / "moe.json"
    code = bench.main(["--backend", "host", "--ranks", "4", *TINY, "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed
    assert "host backend: not a figure of merit" in printed
    data = json.loads(out.read_text())
    rows = {row["policy"]: row for row in data["rows"]}
    assert list(rows) == list(bench.POLICIES) and data["ranks"] == 4
    assert data["initial_imbalance"] == pytest.approx(1.5, rel=0.01)
    assert rows["none"]["rows_max_mean"] == pytest.approx(data["initial_imbalance"])
    assert rows["ideal"]["rows_max_mean"] == 1.0 and rows["ideal"]["vs_ideal"] == 1.0
    assert rows["ultraep"]["rows_max_mean"] < 1.1 and rows["ultraep"]["replicas_mean"] > 0
    # Balancing moves no bit of the outputs or input gradients; weight gradients only by FP32 reassociation.
    assert rows["ultraep"]["out_diff"] == 0 and rows["ultraep"]["dx_diff"] == 0
    assert 0 < rows["ultraep"]["wgrad_rel"] <= 1e-4
    for row in rows.values():
        assert row["rerun_diff"] == 0
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
        assert row["step_ms"] == pytest.approx(row["fwd_ms"] + row["bwd_ms"])
        assert row["tokens_per_s"] == pytest.approx(4 * 256 / row["step_ms"] * 1e3)
        assert row["vs_ideal"] == pytest.approx(rows["ideal"]["step_ms"] / row["step_ms"])


def test_moe_layer_bench_rows_per_sync_stream(tmp_path):
    """``--sync-stream side update``: an ultraep row each, named and labelled by where the
    layers ran the sync, both balanced and both bitwise none's."""
    out = tmp_path / "moe.json"
    assert bench.main(["--backend", "host", "--ranks", "2", *TINY, "--initial-imbalance", "1.25",
                       "--sync-stream", "side", "update", "--json", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["ideal", "none", "ultraep/side", "ultraep/update"]
    assert [row["sync_stream"] for row in rows.values()] == [None, None, "side", "update"]
    for name in ("ultraep/side", "ultraep/update"):
        row = rows[name]
        assert row["replicas_mean"] > 0 and row["out_diff"] == 0 and row["dx_diff"] == 0, row


def test_moe_layer_bench_phases_show_where_each_policy_spends_its_steps(tmp_path, capfd):
    """``--phases``: every policy's steps per direction, the balancing steps ultraep alone
    has without an ideal to compare, the shared ones with; the table printed."""
    out = tmp_path / "moe.json"
    assert bench.main(["--backend", "host", "--ranks", "2", *TINY, "--initial-imbalance", "1.25", "--phases",
                       "--json", str(out)]) == 0
    assert "Where the timed steps went" in capfd.readouterr().out
    phases = json.loads(out.read_text())["phases"]
    steps = {(row["policy"], row["direction"]): [] for row in phases}
    for row in phases:
        steps[row["policy"], row["direction"]].append(row["step"])
        assert 0 <= row["mean_rank_ms"] <= row["max_rank_ms"], row
        assert ("over_ideal_ms" in row) == (row["policy"] != "ideal" and row["step"] in
                                            ("dispatch", "up", "swiglu", "down", "combine", "replica_grads",
                                             "combine_backward", "refill", "dgrad_down", "swiglu_backward",
                                             "dgrad_up", "wgrad_down", "wgrad_up", "dispatch_backward")), row
    assert steps["ideal", "forward"] == ["dispatch", "up", "swiglu", "down", "combine"]
    assert steps["ultraep", "forward"] == ["update", "weight_sync", "reroute", "dispatch", "replicas", "up", "swiglu",
                                           "down", "combine"]
    assert steps["ultraep", "backward"][-3:] == ["grad_copy", "reduce_grads", "dispatch_backward"]
    assert "reduce_grads" not in steps["none", "backward"]


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
def test_moe_layer_bench_gpu_balancing_moves_no_bit(tmp_path):
    """The grouped GEMM on the device: ultraep's outputs and input gradients bitwise none's,
    with the weight sync beside the layers' kernels and started by their updates, every policy's
    two checked steps bitwise equal (4 ranks sharing the GPU, time-sliced)."""
    out = tmp_path / "moe.json"
    code = bench.main(["--backend", "device", "--ranks", "4", *TINY, "--hidden", "256", "--ffn", "128",
                       "--sync-stream", "side", "update", "--phases", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    rows = {row["policy"]: row for row in data["rows"]}
    assert {row["step"] for row in data["phases"] if row["policy"] == "ultraep/update"} >= {"update", "reduce_grads"}
    for name in ("ultraep/side", "ultraep/update"):
        assert rows[name]["out_diff"] == 0 and rows[name]["dx_diff"] == 0, rows[name]
        assert rows[name]["replicas_mean"] > 0 and rows[name]["wgrad_rel"] <= 1e-4, rows[name]
    assert all(row["rerun_diff"] == 0 for row in rows.values())


class OneRank:
    def barrier(self):
        pass

    def allgather(self, value):
        return [value]


def test_alternated_phases_take_turns_at_running_first(monkeypatch):
    """``alternate=[(1, 2)]``: phases 1 and 2 swap places every other repeat (the others keep
    theirs), and each phase's window is still its own (each phase here takes its own time on
    a clock that only the phases move); paired blocks swap whole, each phase given the one
    before it in the block."""
    clock, ran = [0.0], []

    def phase(name, seconds):
        def run(_):
            ran.append(name)
            clock[0] += seconds
        return run

    monkeypatch.setattr(bench.time, "monotonic", lambda: clock[0])
    phases = [phase("a", 0.001), phase("b", 0.002), phase("c", 0.004)]
    windows = bench.phase_windows_ms(OneRank(), phases, 4, lambda: None, alternate=[(1, 2)])
    assert "".join(ran) == "abc" "acb" "abc" "acb"
    assert windows == pytest.approx([1.0, 2.0, 4.0])
    ran.clear()
    bench.phase_windows_ms(OneRank(), phases, 2, lambda: None)
    assert "".join(ran) == "abcabc"

    given = []

    def passing(name):
        def run(previous):
            given.append((previous, name))
            return name
        return run

    blocks = [passing(name) for name in ("s", "a1", "a2", "b1", "b2", "t")]
    bench.phase_windows_ms(OneRank(), blocks, 2, lambda: None, alternate=[(1, 3), (2, 4)])
    assert [name for _, name in given] == ["s", "a1", "a2", "b1", "b2", "t", "s", "b1", "b2", "a1", "a2", "t"]
    assert given[7:10] == [("s", "b1"), ("b1", "b2"), ("b2", "a1")] and given[11] == ("a2", "t")

    # pairs sharing a phase rotate its runs, each phase still run once a repeat
    ran.clear()
    bench.phase_windows_ms(OneRank(), phases, 2, lambda: None, alternate=[(0, 1), (1, 2)])
    assert "".join(ran) == "abc" "bca"


def test_rotated_blocks_start_one_block_later_each_repeat(monkeypatch):
    """``rotate=2``: blocks of two phases, repeat r starting at block r; each phase's window
    is still its own, and a block's second phase is given its first's result."""
    clock, ran, given = [0.0], [], []

    def phase(name, seconds):
        def run(previous):
            ran.append(name)
            given.append((previous, name))
            clock[0] += seconds
            return name
        return run

    monkeypatch.setattr(bench.time, "monotonic", lambda: clock[0])
    phases = [phase(name, 0.001 * (i + 1)) for i, name in enumerate("abcdef")]
    windows = bench.phase_windows_ms(OneRank(), phases, 4, lambda: None, rotate=2)
    assert "".join(ran) == "abcdef" "cdefab" "efabcd" "abcdef"
    assert windows == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert ("c", "d") in given and ("a", "b") in given and ("e", "f") in given
    with pytest.raises(ValueError, match="not whole blocks of 4"):
        bench.phase_windows_ms(OneRank(), phases, 1, lambda: None, rotate=4)


@pytest.mark.mpi
def test_ranks_that_fail_setting_up_are_reported_with_their_error(tmp_path):
    """Three of four ranks fail while building the balanced stack's second layer (as ranks
    out of GPU memory do); their clean-ups then meet the fourth rank's set-up in different
    collectives. The job must end with the first error named on each failing rank -- not as
    a one-line verdict on the options (exit 2) about collectives."""
    from ultraep.errors import LaunchError
    from ultraep.runtime import launch

    script = tmp_path / "fail_setting_up.py"
    script.write_text(
        "import sys\n"
        "from mpi4py import MPI\n"
        "import ultraep.integration.moe_layer as layer\n"
        "from ultraep.bench import moe_layer as bench\n"
        "build = layer.MoELayer.__init__\n"
        "def failing(self, group, *args, balancer=None, layer=0, **kwargs):\n"
        "    if balancer is not None and layer == 1 and MPI.COMM_WORLD.rank != 1:\n"
        "        raise MemoryError('injected: out of memory')\n"
        "    build(self, group, *args, balancer=balancer, layer=layer, **kwargs)\n"
        "layer.MoELayer.__init__ = failing\n"
        f"sys.exit(bench.main(['--backend', 'host', *{TINY!r}]))\n")
    with pytest.raises(LaunchError) as failed:
        launch.run_mpi(4, [str(script)], timeout=240)
    report = str(failed.value)
    assert "exited with 2" not in report, report
    assert report.count("(raised while handling MemoryError: injected: out of memory)") == 3, report
