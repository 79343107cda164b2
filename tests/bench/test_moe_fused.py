"""``ultraep.bench.moe_fused``: its arguments (the issue's setting by default, bad values
refused) and a tiny run end to end on the CPU backend; the timed GPU run is the H200's
(``python -m ultraep.bench moe-fused --emulate-ep``)."""

import json

import pytest

from ultraep.bench import BENCHMARKS
from ultraep.bench import moe_fused as bench


def test_defaults_are_the_issue_setting():
    args = bench.parse_args([])
    assert (args.ranks, args.tokens, args.hidden, args.top_k) == (4, [4096, 8192, 16384, 32768], [4096, 7168], 8)
    assert args.emulate_ep is None
    assert bench.parse_args(["--emulate-ep"]).emulate_ep == 0  # the default share: 100 / ranks
    assert BENCHMARKS["moe-fused"].module == "ultraep.bench.moe_fused"


@pytest.mark.parametrize("argv,fragment", [
    (["--hidden", "4100"], "multiple of 8"),
    (["--ffn", "0"], "int >= 1"),
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
    code = bench.main(["--backend", "host", "--ranks", "2", "--tokens", "24", "40", "--hidden", "32", "--ffn", "16",
                       "--experts-per-rank", "2", "--top-k", "2", "--repeats", "1", "--json", str(out), "--quiet",
                       "--timeline", str(tmp_path / "tasks.png")])
    printed = capfd.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [(row["tokens"], row["hidden"]) for row in result["rows"]] == [(24, 32), (40, 32)]
    assert all(row["out_diff"] == 0 and row["rerun_diff"] == 0 and row["fused_ms"] > 0 for row in result["rows"])
    assert (tmp_path / "tasks_t24_h32.png").stat().st_size > 0 and (tmp_path / "tasks_t40_h32.png").stat().st_size > 0


def test_timeline_paths_and_plot(tmp_path):
    assert bench.timeline_path("out/tl.png", 4096, 7168) == "out/tl_t4096_h7168.png"
    ms = 1_000_000
    tasks = [("send", 1 * ms, 2 * ms, 0), ("relay", 2 * ms, 3 * ms, 1), ("up", 3 * ms, 7 * ms, 0),
             ("down", 7 * ms, 9 * ms, 1), ("reduce", 9 * ms, 10 * ms, 0)]
    late = [(kind, start + 20 * ms, end + 20 * ms, worker) for kind, start, end, worker in tasks[:3]]
    path = tmp_path / "t.png"
    bench.plot_timeline([tasks, late], str(path), "title")
    assert path.stat().st_size > 0
    spans = bench.phase_spans([tasks, late])
    assert spans == [{"workers": 2, "send": (0, 1), "relay": (1, 2), "up": (2, 6), "down": (6, 8), "reduce": (8, 9)},
                     {"workers": 2, "send": (20, 21), "relay": (21, 22), "up": (22, 26)}]
    assert bench.format_phases(spans).splitlines()[1] == ("rank 1 (2 SMs): send 20.00-21.00  relay 21.00-22.00  "
                                                           "up 22.00-26.00")
