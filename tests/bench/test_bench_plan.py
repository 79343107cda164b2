"""``python -m ultraep.bench``: the dispatcher, the report helpers and the ``plan`` benchmark end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest

import ultraep.bench as bench
from ultraep.bench import plan as bench_plan
from ultraep.bench.report import format_value, print_table, write_json
from ultraep.analysis.traces import zipf_loads
from ultraep.integration.traces import save_trace

TINY = ["--ranks", "4", "--experts", "8", "--slots", "1", "--top-k", "2", "--tokens-per-rank", "64",
        "--steps", "4", "--layers", "2", "--min-replica-tokens", "8", "--eplb-window", "2", "--quiet"]


def test_plan_end_to_end_with_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert bench.main(["plan", "--generate", "drift", *TINY, "--json", str(out_json), "--plot", str(out_png)]) == 0
    stdout = capsys.readouterr().out
    for name in bench_plan.POLICIES:
        assert f"\n{name} " in stdout
    assert "lower bound: exact on" in stdout
    data = json.loads(out_json.read_text())
    meta = data["meta"]
    assert {"date_utc", "host", "device", "git_commit", "command"} <= set(meta) and meta["device"] == "cpu"
    assert data["config"]["num_ranks"] == 4 and data["config"]["steps"] == 4
    policies = {row["policy"]: row for row in data["policies"]}
    assert set(policies) == set(bench_plan.POLICIES)
    assert policies["ideal"]["imb max"] == pytest.approx(1.0)
    assert policies["ultraep"]["imb mean"] <= policies["none"]["imb mean"]
    assert policies["none"]["slots max"] == 0 and policies["ideal"]["gap mean"] is None
    bound = np.array(data["lower_bound"]["value"])
    max_load = {p: np.array(data["per_cell"]["max_load"][p]) for p in ("none", "ultraep")}
    assert bound.shape == (4, 2)
    assert (bound <= max_load["ultraep"]).all() and (max_load["ultraep"] <= max_load["none"]).all()
    gaps = np.array(data["per_cell"]["gap"]["ultraep"])
    assert np.allclose(gaps, max_load["ultraep"] / bound - 1)
    assert sum(data["lower_bound"]["methods"].values()) == 8
    assert data["invalid_ultraep_plans"] == []
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_plan_replays_a_trace_file_through_the_module_entry_point(tmp_path):
    loads = np.stack([np.stack([zipf_loads(4, 8, 2, 64, 1.8, seed=s * 2 + l, tolerance=0.05) for l in range(2)])
                      for s in range(3)])
    path = save_trace(tmp_path / "t.npz", loads, metadata={"source": "test"})
    out_json = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, "-m", "ultraep.bench", "plan", "--trace", str(path), "--slots", "2",
                           "--min-replica-tokens", "4", "--bound", "lp", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out_json.read_text())
    assert data["trace_metadata"]["source"] == "test"
    assert data["config"]["trace"] == str(path) and data["config"]["layers"] == 2
    assert set(data["lower_bound"]["method"][0]) <= {"lp", "trivial"}
    assert "ultraep.bench plan" in data["meta"]["command"]
    assert np.allclose(data["imbalance_before"], [[_imbalance(loads[s, l]) for l in range(2)] for s in range(3)])


def _imbalance(loads):
    per_rank = loads.sum(axis=0).reshape(4, 2).sum(axis=1)
    return per_rank.max() / per_rank.mean()


def test_plan_reports_bad_input_clearly(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, loads=np.ones((2, 2), dtype=np.int32))
    assert bench.main(["plan", "--trace", str(bad)]) == 2
    assert "shape" in capsys.readouterr().err
    assert bench.main(["plan", "--generate", "lognormal", "--ranks", "4", "--experts", "8", "--domain", "3"]) == 2
    assert "domain_size" in capsys.readouterr().err


def test_demo_refuses_sizes_it_would_replace(capsys):
    with pytest.raises(SystemExit) as refused:
        bench.main(["plan", "--demo", "--ranks", "4", "--seed", "3"])
    assert refused.value.code == 2
    assert "--demo sets its own sizes; drop --ranks, --seed or use --generate demo" in capsys.readouterr().err


def test_a_trace_refuses_the_generators_sizes_it_would_ignore(tmp_path, capsys):
    path = save_trace(tmp_path / "t.npz", np.ones((1, 1, 4, 8), np.int32))
    with pytest.raises(SystemExit) as refused:
        bench.main(["plan", "--trace", str(path), "--ranks", "8", "--experts", "32"])
    assert refused.value.code == 2
    assert "--trace replays its own sizes; drop --ranks, --experts" in capsys.readouterr().err


def test_dispatcher(monkeypatch, capsys):
    assert bench.main(["--help"]) == 0 and "plan" in capsys.readouterr().out
    assert bench.main([]) == 0
    assert bench.main(["no-such-bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    monkeypatch.setitem(bench.BENCHMARKS, "ghost", bench.Benchmark("ultraep.bench.ghost_module", False, "a ghost"))
    assert bench.main(["ghost"]) == 2
    assert "ultraep.bench.ghost_module is not available" in capsys.readouterr().err


def test_print_table_and_formats(capsys):
    print_table([{"name": "a", "x": 1.23456, "n": 3}, {"name": "long name", "x": None, "n": 12345}],
                ["name", "x", "n"], "title")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "title"
    assert lines[2].split() == ["name", "x", "n"]
    assert lines[4].split() == ["a", "1.2346", "3"]
    assert lines[5].split() == ["long", "name", "-", "12345"]
    assert len(lines[4]) == len(lines[5])  # the last (numeric) column is right-aligned
    assert format_value(1.0) == "1.0000" and format_value(float("nan")) == "nan" and format_value(True) == "yes"


def test_write_json_adds_metadata_and_strict_values(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"a": np.arange(3), "b": np.float32(0.5), "c": float("nan")})
    data = json.loads(path.read_text())
    assert data["a"] == [0, 1, 2] and data["b"] == 0.5 and data["c"] is None
    assert data["meta"]["device"] == "cpu" and data["meta"]["date_utc"].endswith("+00:00")
    with pytest.raises(ValueError, match="meta"):
        write_json(tmp_path / "x.json", {"meta": 1})


def test_plan_streams_each_cell_with_its_bound_kind_and_keeps_the_bound_budget(capsys):
    assert bench.main(["plan", "--generate", "drift", *TINY[:-1], "--bound-budget", "0"]) == 0
    captured = capsys.readouterr()
    cells = [line.split() for line in captured.err.splitlines() if line.split()[:1] and "/8" in line.split()[0]]
    assert [cell[0] for cell in cells] == [f"{i}/8" for i in range(1, 9)]
    assert all(cell[-3] in bench_plan.BOUND_KINDS for cell in cells)
    assert all(cell[-3] != "milp" for cell in cells)  # a zero budget leaves the MILP out
    assert "lower bound: exact on" in captured.out and "--bound trivial" in captured.out


def test_plan_help_names_the_bound_choices():
    help_text = " ".join(bench_plan.build_parser().format_help().split())
    assert "trivial: perfect balance" in help_text and "--bound-budget" in help_text
    assert "--initial-imbalance" in help_text and "--target-imbalance" not in help_text
