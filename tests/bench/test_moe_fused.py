"""``ultraep.bench.moe_fused``: its arguments (the issue's setting by default, bad values
refused) and a tiny run end to end on the CPU backend; the timed GPU run is the H200's
(``python -m ultraep.bench moe-fused --emulate-ep``)."""

import json
import textwrap

import pytest

from ultraep.bench import BENCHMARKS
from ultraep.bench import moe_fused as bench
from ultraep.runtime.launch import run_mpi

TINY = ["--backend", "host", "--ranks", "2", "--hidden", "32", "--ffn", "16", "--experts-per-rank", "2", "--top-k", "2",
        "--repeats", "1", "--quiet"]


def test_defaults_are_the_issue_setting():
    args = bench.parse_args([])
    assert (args.ranks, args.tokens, args.hidden, args.top_k) == (4, [4096, 8192, 16384, 32768], [4096, 7168], 8)
    assert args.emulate_ep is None
    assert bench.parse_args(["--emulate-ep"]).emulate_ep == 0  # the default share: 100 / ranks
    assert BENCHMARKS["moe-fused"].module == "ultraep.bench.moe_fused"


@pytest.mark.parametrize("argv,fragment", [
    (["--hidden", "4100"], "multiple of 8"),
    (["--ffn", "0"], "a positive multiple of 8"),
    (["--tokens", "0"], "int >= 1"),
    (["--ranks", "1", "--experts-per-rank", "4", "--top-k", "8"], "exceeds the experts"),
])
def test_bad_arguments_are_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.mpi
def test_tiny_host_run(tmp_path, capfd):
    out = tmp_path / "fused.json"
    code = bench.main([*TINY, "--tokens", "24", "40", "--json", str(out), "--timeline", str(tmp_path / "tasks.png")])
    printed = capfd.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [(row["tokens"], row["hidden"]) for row in result["rows"]] == [(24, 32), (40, 32)]
    assert all(row["out_diff"] == 0 and row["rerun_diff"] == 0 and row["fused_ms"] > 0 for row in result["rows"])
    for row in result["rows"]:  # the sequential forward's up and down GEMMs: a part of its time
        assert 0 < row["fwd_gemm_ms"] and row["gemm_bound"] == row["seq_ms"] / row["fwd_gemm_ms"], row
    backward = bench.BACKWARD_TIMES + bench.BACKWARD_DIFFS
    assert not any(key in row for row in result["rows"] for key in backward)  # without --backward: as before
    assert not any(key in printed for key in backward)
    assert (tmp_path / "tasks_t24_h32.png").stat().st_size > 0 and (tmp_path / "tasks_t40_h32.png").stat().st_size > 0


def test_timeline_paths_and_plot(tmp_path):
    assert bench.timeline_path("out/tl.png", 4096, 7168) == "out/tl_t4096_h7168.png"
    assert bench.timeline_path("out/tl.png", 4096, 7168, "backward") == "out/tl_bwd_t4096_h7168.png"
    assert bench.timeline_path("tl", 8, 16, "backward") == "tl_bwd_t8_h16"
    assert bench.timeline_path("tl.png", 8, 16, "training") == "tl_train_t8_h16.png"
    ms = 1_000_000
    tasks = [("send", 1 * ms, 2 * ms, 0), ("relay", 2 * ms, 3 * ms, 1), ("up", 3 * ms, 7 * ms, 0),
             ("up", 3 * ms, 4 * ms, 1), ("up", 4 * ms, 6 * ms, 1), ("down", 7 * ms, 9 * ms, 1),
             ("reduce", 9 * ms, 10 * ms, 0)]
    late = [(kind, start + 20 * ms, end + 20 * ms, worker) for kind, start, end, worker in tasks[:3]]
    path = tmp_path / "t.png"
    bench.plot_timeline([tasks, late], str(path), "title")
    assert path.stat().st_size > 0
    spans = bench.phase_spans([tasks, late])
    # the median up tile of rank 0: 1, 2 and 4 ms long
    assert spans == [{"workers": 2, "send": (0, 1, 1000), "relay": (1, 2, 1000), "up": (2, 6, 2000),
                      "down": (6, 8, 2000), "reduce": (8, 9, 1000)},
                     {"workers": 2, "send": (20, 21, 1000), "relay": (21, 22, 1000), "up": (22, 26, 4000)}]
    assert bench.format_phases(spans).splitlines()[1] == ("rank 1 (2 SMs): send 20.00-21.00 (1000 µs)  "
                                                           "relay 21.00-22.00 (1000 µs)  up 22.00-26.00 (4000 µs)")
    called = [ms // 2, 19 * ms]  # each rank's call: its first task 0.5 and 2 ms later
    led = bench.phase_spans([tasks, late], called)
    assert [mine.pop("lead") for mine in led] == [0.5, 2.0] and led == spans
    assert bench.format_phases(bench.phase_spans([tasks, late], called)).splitlines()[1] == (
        "rank 1 (2 SMs): call to first task 2.00 ms  send 20.00-21.00 (1000 µs)  relay 21.00-22.00 (1000 µs)  "
        "up 22.00-26.00 (4000 µs)")


def test_backward_timeline_spans_and_plot(tmp_path):
    """The backward's kinds have colours and phases of their own."""
    ms = 1_000_000
    tasks = [("send", 0, 1 * ms, 0), ("relay", 1 * ms, 2 * ms, 1), ("dgrad_down", 2 * ms, 5 * ms, 0),
             ("dgrad_up", 5 * ms, 8 * ms, 1), ("reduce", 8 * ms, 9 * ms, 0)]
    path = tmp_path / "bwd.png"
    bench.plot_timeline([tasks, tasks[1:]], str(path), "title")
    assert path.stat().st_size > 0
    spans = bench.phase_spans([tasks, tasks[1:]])
    assert spans[1] == {"workers": 2, "relay": (1, 2, 1000), "dgrad_down": (2, 5, 3000), "dgrad_up": (5, 8, 3000),
                        "reduce": (8, 9, 1000)}
    assert bench.format_phases(spans).splitlines()[0] == ("rank 0 (2 SMs): send 0.00-1.00 (1000 µs)  "
                                                           "relay 1.00-2.00 (1000 µs)  dgrad_down 2.00-5.00 (3000 µs)  "
                                                           "dgrad_up 5.00-8.00 (3000 µs)  reduce 8.00-9.00 (1000 µs)")


def test_backward_columns_follow_the_forward_ones():
    assert bench.columns(False) == bench.COLUMNS
    assert bench.columns(True) == ["tokens", "hidden", "ffn", "seq_ms", "fused_ms", "speedup", "gemm_bound",
                                   "seq_train_ms", "seq_bwd_ms", "fused_train_ms", "fused_bwd_ms", "train_speedup",
                                   "bwd_speedup", "step_speedup", "wgrad_ms", "bwd_rest_speedup", "bwd_gemm_bound",
                                   "out_diff", "rerun_diff", "dx_diff", "dgates_diff", "grad_up_diff",
                                   "grad_down_diff", "bwd_rerun_diff"]
    assert not bench.parse_args([]).backward and bench.parse_args(["--backward"]).backward


@pytest.mark.mpi
def test_tiny_host_run_with_backward(tmp_path, capfd):
    """--backward: forward and backward of both layers, the backward's gradients bitwise the
    sequential layer's (weight gradients after one backward from zero) and rerun alike;
    with --timeline a recorded training forward and backward too: their phases per rank
    printed and in the JSON, their plots beside the forward's."""
    out = tmp_path / "fused.json"
    code = bench.main([*TINY, "--tokens", "24", "40", "--backward", "--json", str(out), "--timeline",
                       str(tmp_path / "tasks.png")])
    printed = capfd.readouterr().out
    assert code == 0, printed
    header = next(line for line in printed.splitlines() if line.startswith("tokens"))
    assert header.split() == bench.columns(True)
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [24, 40]
    for row in rows:
        assert all(row[key] == 0 for key in ["out_diff", "rerun_diff", *bench.BACKWARD_DIFFS]), row
        assert all(isinstance(row[key], float) for key in ("seq_train_ms", "seq_bwd_ms", "fused_train_ms",
                                                            "fused_bwd_ms")), row
        assert row["bwd_speedup"] == row["seq_bwd_ms"] / row["fused_bwd_ms"]
        assert row["step_speedup"] == ((row["seq_train_ms"] + row["seq_bwd_ms"])
                                       / (row["fused_train_ms"] + row["fused_bwd_ms"]))
        assert 0 < row["wgrad_ms"] and row["bwd_rest_speedup"] == ((row["seq_bwd_ms"] - row["wgrad_ms"])
                                                                   / (row["fused_bwd_ms"] - row["wgrad_ms"]))
        assert 0 < row["bwd_gemm_ms"] and row["bwd_gemm_bound"] == row["seq_bwd_ms"] / row["bwd_gemm_ms"], row
        assert [set(rank) for rank in row["bwd_phases"]] == [{"workers", "send", "relay", "dgrad_down", "dgrad_up",
                                                              "reduce"}] * 2, row["bwd_phases"]
        for key in ("phases", "train_phases"):
            assert {"up", "down"} <= set(row[key][0]) and "dgrad_up" not in row[key][0]
        # the call's host path before the first task, on the clock the tasks were stamped with
        assert all(rank["lead"] >= 0 for rank in row["phases"]) and "lead" not in row["train_phases"][0]
        for which in ("forward", "training", "backward"):
            assert f"phases of a recorded fused {which}, tokens {row['tokens']}, hidden 32" in printed
            assert (tmp_path / bench.timeline_path("tasks.png", row["tokens"], 32, which)).stat().st_size > 0
    assert printed.count("rank 1 (1 SMs): send") == 4  # each setting's training forward and backward
    assert printed.count("rank 1 (1 SMs): call to first task") == 2  # and its inference forward


@pytest.mark.mpi
def test_backward_that_differs_is_refused(tmp_path):
    """One bit of one element of the fused backward's dx flipped on rank 1 (its weight and
    gate gradients untouched, the same flip in the rerun): the bench exits non-zero naming
    dx_diff and nothing else."""
    script = tmp_path / "flip_dx.py"
    script.write_text(textwrap.dedent(f"""\
        import sys

        import numpy as np
        from mpi4py import MPI

        from ultraep.bench import moe_fused
        from ultraep.compute.fused.host import HostFusedBackward

        backward = HostFusedBackward.backward

        def flipped(self, *args):
            dx, *rest = backward(self, *args)
            if MPI.COMM_WORLD.rank == 1:
                dx.view(np.int16)[0, 0] ^= 1
            return (dx, *rest)

        HostFusedBackward.backward = flipped
        sys.exit(moe_fused.main({[*TINY, "--tokens", "24", "--backward"]!r}))
        """))
    done = run_mpi(2, [str(script)], timeout=120, check=False)
    assert done.returncode != 0, done.stdout
    assert "not bitwise the sequential path: tokens 24 hidden 32: dx_diff = 1 (must be 0)\n" in done.stdout, \
        done.stdout
    for other in ("out_diff =", "rerun_diff =", "dgates_diff =", "grad_up_diff =", "grad_down_diff ="):
        assert other not in done.stdout, done.stdout


def test_kernel_a_spans_every_rank_up_to_the_last_up_tile():
    ms = 1_000_000
    ranks = [[("send", 2 * ms, 3 * ms, 0), ("up", 3 * ms, 9 * ms, 0), ("down", 9 * ms, 12 * ms, 0)],
             [("relay", 1 * ms, 4 * ms, 1), ("up", 4 * ms, 10 * ms, 1), ("reduce", 10 * ms, 14 * ms, 1)]]
    assert bench.kernel_a_ms(ranks) == 9.0


def test_kernel_a_is_the_median_of_a_few_recorded_forwards():
    """One forward's kernel A drifts with the GPU's clocks: --overlap takes the median of
    KERNEL_A_FORWARDS, the forward recorded for the timeline among them."""
    ms = 1_000_000

    def forward(span_ms):  # rank 0 sends from 0, rank 1's last up tile ends at span_ms
        return [[("send", 0, ms, 0)], [("up", ms, span_ms * ms, 1)]]

    spans = iter([12, 10, 30, 11])
    asked = []

    def record():
        asked.append(1)
        return forward(next(spans))

    assert bench.KERNEL_A_FORWARDS == 5
    assert bench.median_kernel_a_ms(record, [forward(9)]) == 11.0 and len(asked) == 4
    assert bench.median_kernel_a_ms(lambda: forward(7)) == 7.0


@pytest.mark.mpi
def test_tiny_host_run_with_overlap(tmp_path, capfd):
    """--overlap: the sequential dispatch and up GEMM timed alone beside kernel A's span,
    their columns before the diffs, a_vs_max their ratio."""
    out = tmp_path / "fused.json"
    code = bench.main([*TINY, "--tokens", "24", "--overlap", "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed
    header = next(line for line in printed.splitlines() if line.startswith("tokens"))
    assert header.split() == bench.columns(False, overlap=True)
    assert bench.columns(False, overlap=True)[7:11] == bench.OVERLAP
    row = json.loads(out.read_text())["rows"][0]
    assert all(row[key] > 0 for key in ("dispatch_ms", "up_gemm_ms", "fused_a_ms")), row
    assert row["a_vs_max"] == row["fused_a_ms"] / max(row["dispatch_ms"], row["up_gemm_ms"])
    assert "phases" not in row  # recorded for the overlap, not printed without --timeline


def test_send_share_columns_follow_the_overlap_ones():
    assert bench.share_name(0.25) == "send0.25" and bench.share_name(1.0) == "send1"
    assert bench.columns(False, shares=[0.5])[-4:] == ["send0.5_ms", "send0.5_gain", "out_diff", "rerun_diff"]
    assert bench.columns(True, overlap=True, shares=[0, 1])[21:31] == [
        "send0_ms", "send0_gain", "send0_bwd_ms", "send0_bwd_gain", "send0_a_ms",
        "send1_ms", "send1_gain", "send1_bwd_ms", "send1_bwd_gain", "send1_a_ms"]
    assert bench.parse_args(["--send-shares", "0", "0.25", "0.250"]).send_shares == [0.0, 0.25]
    with pytest.raises(SystemExit):
        bench.parse_args(["--send-shares", "1.5"])


@pytest.mark.mpi
def test_tiny_host_run_with_send_shares(tmp_path, capfd):
    """--send-shares: a fused layer per share beside the --config one, timed in the same
    repeats, forward, backward and kernel A, every one's bits checked."""
    out = tmp_path / "fused.json"
    code = bench.main([*TINY, "--tokens", "24", "--send-shares", "0", "0.5", "--backward", "--overlap",
                       "--json", str(out)])
    printed = capfd.readouterr().out
    assert code == 0, printed
    header = next(line for line in printed.splitlines() if line.startswith("tokens"))
    assert header.split() == bench.columns(True, overlap=True, shares=[0, 0.5])
    row = json.loads(out.read_text())["rows"][0]
    for name in ("send0", "send0.5"):
        assert row[f"{name}_gain"] == row["fused_ms"] / row[f"{name}_ms"], row
        assert row[f"{name}_bwd_gain"] == row["fused_bwd_ms"] / row[f"{name}_bwd_ms"], row
        assert row[f"{name}_a_ms"] > 0, row
    assert all(row[key] == 0 for key in ["out_diff", "rerun_diff", *bench.BACKWARD_DIFFS]), row


@pytest.mark.mpi
def test_a_send_share_layer_that_differs_is_refused(tmp_path):
    """One bit of the output flipped on rank 1 in the layer with no CTA sending first alone
    (the host's one CTA: share 0 of it): the bench exits non-zero naming out_diff."""
    script = tmp_path / "flip_out.py"
    script.write_text(textwrap.dedent(f"""\
        import sys

        import numpy as np
        from mpi4py import MPI

        from ultraep.bench import moe_fused
        from ultraep.compute.fused.host import HostFusedForward

        forward = HostFusedForward.forward

        def flipped(self, x, *args, **kwargs):
            out, *rest = forward(self, x, *args, **kwargs)
            if MPI.COMM_WORLD.rank == 1 and self.schedule.for_tokens(len(x)).send_ctas == 0:
                out.view(np.int16)[0, 0] ^= 1
            return (out, *rest)

        HostFusedForward.forward = flipped
        sys.exit(moe_fused.main({[*TINY, "--tokens", "24", "--send-shares", "0"]!r}))
        """))
    done = run_mpi(2, [str(script)], timeout=120, check=False)
    assert done.returncode != 0, done.stdout
    assert "not bitwise the sequential path: tokens 24 hidden 32: out_diff = 1 (must be 0)\n" in done.stdout, \
        done.stdout
