"""``python -m ultraep.bench grouped-gemm``: the expert-size generators, and one real run on a GPU."""

import json

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.bench.grouped_gemm import expert_counts, main, parse_args


@pytest.mark.parametrize("distribution", ["uniform", "zipf", "empty"])
def test_expert_sizes(distribution):
    counts = expert_counts(32, 1024, distribution, seed=3)
    assert counts.shape == (32,) and (counts >= 0).all()
    if distribution == "uniform":
        assert counts.min() >= 1024 - 128 and counts.max() <= 1024 + 128
    else:
        assert counts.sum() == 32 * 1024
    if distribution == "empty":
        assert (counts == 0).sum() == 8
    if distribution == "zipf":
        assert counts.max() > 5 * np.median(counts)


def test_exact_sizes_are_the_mean_each_and_only_on_request():
    assert expert_counts(8, 4096, "exact", seed=3).tolist() == [4096] * 8
    assert parse_args([]).sizes == ["uniform", "zipf", "empty"]
    assert parse_args(["--sizes", "exact", "uniform"]).sizes == ["exact", "uniform"]


def test_unknown_case_is_refused(capsys):
    assert main(["--cases", "no such case"]) == 2


def test_variant_is_a_schedule(capsys):
    assert parse_args(["--variant", "ring"]).variant == "ring"
    assert parse_args(["--variant", "staged"]).variant == "staged"
    assert parse_args([]).variant is None
    with pytest.raises(SystemExit):
        parse_args(["--variant", "fast"])


def test_ranks_run_the_cases_at_once_only_when_asked():
    assert parse_args([]).ranks == 1 and parse_args([]).emulate_ep is None
    args = parse_args(["--ranks", "4", "--emulate-ep"])
    assert args.ranks == 4 and args.emulate_ep == 0  # 0: 100 / ranks %


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_two_ranks_time_one_case_at_once(tmp_path):
    path = tmp_path / "gg2.json"
    assert main(["--ranks", "2", "--cases", "32x256", "--sizes", "empty", "--repeats", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["ranks"] == 2 and "2 ranks at once" in result["title"]
    assert [r["op"] for r in result["rows"]] == ["forward", "dgrad", "wgrad"]
    assert all(r["ours"] and r["ours"] > 0 and r["dense"] for r in result["rows"])


@pytest.mark.gpu
@requires_gpu
def test_one_case_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "gg.json"
    assert main(["--cases", "32x256", "--sizes", "empty", "--repeats", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["op"] for r in rows] == ["forward", "dgrad", "wgrad"]
    assert all(r["ours"] and r["ours"] > 0 for r in rows)
    assert "vs_dense" in capsys.readouterr().out


@pytest.mark.gpu
@requires_gpu
def test_variant_is_timed_beside_ours_with_the_same_bits(tmp_path, capsys):
    path = tmp_path / "gg.json"
    assert main(["--cases", "32x256", "--sizes", "empty", "--repeats", "2", "--variant", "staged",
                 "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["op"] for r in rows] == ["forward", "dgrad", "wgrad"]
    assert all(r["variant"] and r["variant"] > 0 and r["variant_diff"] == 0 for r in rows)
    assert "variant_vs_ours" in capsys.readouterr().out


@pytest.mark.gpu
@requires_gpu
def test_accumulated_wgrad_is_timed_against_the_two_pass_way(tmp_path, capsys):
    path = tmp_path / "gg.json"
    assert main(["--cases", "32x256", "--sizes", "empty", "--repeats", "2", "--ops", "wgrad", "wgrad_acc",
                 "--json", str(path)]) == 0
    wgrad, accumulated = json.loads(path.read_text())["rows"]
    assert (wgrad["op"], accumulated["op"]) == ("wgrad", "wgrad_acc") and "two_pass" not in wgrad
    assert accumulated["two_pass"] > 0 and accumulated["vs_two_pass"] > 0
    assert accumulated["dense"] is None and accumulated["loop"] is None
    assert "vs_two_pass" in capsys.readouterr().out


def test_accumulated_wgrad_is_asked_for_not_default():
    assert "wgrad_acc" not in parse_args([]).ops and parse_args(["--ops", "wgrad_acc"]).ops == ["wgrad_acc"]
