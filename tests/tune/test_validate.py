"""``python -m ultraep.tune validate``: the summary's arithmetic, the fused phases' refusal,
and a smoke test of both sweeps on the CPU backend (2 ranks, 5 configurations, a fresh
profile cache: rank 0 measures, rank 1 reads it, both measure their copy rate together)."""

import json

import pytest

from ultraep.tune.__main__ import main as tune_main
from ultraep.tune.validate import DISPATCH_OPERATIONS, retime_grids, summarise


def test_summary_errors_and_the_rank_of_the_models_choice():
    rows = [{"problem": "a", "config": f"g={g}", "predicted_ms": p, "measured_ms": m}
            for g, p, m in ((1, 2.0, 2.0), (2, 1.0, 1.25), (3, 1.5, 1.0))]
    rows.append({"problem": "b", "config": "g=1", "predicted_ms": 0.9, "measured_ms": 1.0})
    rows[0]["default"] = True
    summary = summarise(rows)
    assert [row["error_pct"] for row in rows] == pytest.approx([0.0, -20.0, 50.0, -10.0])
    assert summary["mean_abs_error_pct"] == pytest.approx(20.0)
    assert summary["within_fraction"] == pytest.approx(0.25)  # only g=1 of a is within 5 %
    assert summary["problems"]["a"]["mean_abs_error_pct"] == pytest.approx(70.0 / 3)
    assert summary["problems"]["a"]["within_fraction"] == pytest.approx(1 / 3)
    assert summary["worst_error_pct"] == pytest.approx(50.0) and summary["worst"] == "a, g=3"
    a = summary["problems"]["a"]  # chose g=2 (predicted 1.0); measured 1.25, behind g=3's 1.0
    assert (a["chosen"], a["chosen_rank"], a["best_measured"]) == ("g=2", 2, "g=3")
    assert a["chosen_over_best_pct"] == pytest.approx(25.0)
    assert a["default"] == "g=1" and a["chosen_vs_default_pct"] == pytest.approx(-37.5)
    assert summary["problems"]["b"]["chosen_rank"] == 1 and "default" not in summary["problems"]["b"]


def test_the_fastest_grids_and_the_choice_are_timed_again_together():
    """The re-timing takes each operation's model choice and its RETIME_FASTEST fastest
    measured grids, times them all in rounds of alternating order and keeps each grid's
    median; the summary sets the choice against the fastest of them."""
    grids = [1, 2, 3, 4, 5, 6]
    predicted = {op: [6.0, 5.0, 4.0, 3.0, 2.0, 1.0] for op in DISPATCH_OPERATIONS}  # the model chooses 6
    measured = {op: [9.0, 1.0, 1.1, 1.2, 9.0, 9.0] for op in DISPATCH_OPERATIONS}  # the sweep's luck: 2, 3, 4
    orders = []

    def time_grids(order, what):
        orders.append(list(order))
        steady = {1: 9.0, 2: 1.5, 3: 1.3, 4: 1.4, 5: 9.0, 6: 1.32}
        return {op: [steady[g] + 0.01 * len(orders) for g in order] for op in DISPATCH_OPERATIONS}

    retimed = retime_grids(grids, predicted, measured, time_grids, rounds=3)
    assert orders == [[2, 3, 4, 6], [6, 4, 3, 2], [2, 3, 4, 6]]
    assert retimed["pull"] == pytest.approx({2: 1.52, 3: 1.32, 4: 1.42, 6: 1.34})
    rows = [{"problem": "pull", "config": f"grid={g}", "predicted_ms": p, "measured_ms": m,
             **({"retimed_ms": retimed["pull"][g]} if g in retimed["pull"] else {})}
            for g, p, m in zip(grids, predicted["pull"], measured["pull"])]
    pull = summarise(rows)["problems"]["pull"]
    assert pull["chosen"] == "grid=6" and pull["chosen_over_best_pct"] == pytest.approx(800.0)
    assert pull["chosen_over_best_retimed_pct"] == pytest.approx(100 * (1.34 / 1.32 - 1))
    assert "chosen_over_best_retimed_pct" not in summarise([dict(row) for row in rows[:-1]])["problems"]["pull"]


@pytest.mark.parametrize("extra, message", [
    (["--phase", "dispatch", "--experts", "7"], "--experts 7 does not divide over 2 ranks"),
    (["--phase", "fused-forward", "--experts", "8", "--top-k", "9"], "--top-k 9 exceeds --experts 8"),
    (["--phase", "weight-sync", "--fanouts", "5"], "--fanouts: at most 1 replicas on 2 ranks"),
    (["--phase", "weight-sync", "--ranks", "1"], "--phase weight-sync needs at least 2 ranks"),
])
def test_a_sweep_that_cannot_run_is_refused_before_the_launch(extra, message, capfd, monkeypatch):
    """Once, exit 2, no rank started (before this, every rank said it after measuring a profile)."""
    monkeypatch.setenv("ULTRAEP_MPIEXEC", "/nonexistent/mpiexec")  # a launch would fail, not run
    with pytest.raises(SystemExit) as exc:
        tune_main(["validate", "--backend", "host", "--ranks", "2", *extra])
    err = capfd.readouterr().err
    assert exc.value.code == 2 and err.count(message) == 1, err


@pytest.mark.mpi
@pytest.mark.parametrize("phase, extra", [
    ("weight-sync", ["--hidden", "256", "--ffn", "128"]),
    ("dispatch", ["--hidden", "256", "--tokens", "64", "--experts", "8", "--top-k", "2"]),
    ("fused-forward", ["--hidden", "64", "--ffn", "32", "--tokens", "48", "--experts", "8", "--top-k", "2"]),
])
def test_sweep_smoke_on_the_host_backend(phase, extra, tmp_path, capfd, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    monkeypatch.setenv("ULTRAEP_CACHE_DIR", str(tmp_path / "cache"))
    png, out_json = tmp_path / "scatter.png", tmp_path / "rows.json"
    code = tune_main(["validate", "--phase", phase, "--configs", "5", "--ranks", "2", "--backend", "host",
                      "--repeats", "2", *extra, "--plot", str(png), "--json", str(out_json)])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "mean absolute error" in out and "predicted_ms" in out
    # the host's Dispatcher has no grid: its sweep measures one configuration again and again
    assert ("nothing to choose among" if phase == "dispatch" else "the model's choice") in out
    # the weight sync's choice and fastest grids timed again beside each other (dispatch's on the GPU only)
    assert ("timed again beside them" in out) == (phase == "weight-sync")
    assert "within 5 %" in out and "worst" in out
    assert "[bench tune validate]" in err and "(5/5)" in err
    data = json.loads(out_json.read_text())
    # the command line kept is the one that ran, which a replay parses (not ultraep.bench's)
    assert f"-m ultraep.tune validate --phase {phase} --configs 5" in data["meta"]["command"]
    problems = 1 if phase == "weight-sync" else 3  # dispatch, combine and pull; kernels A, B and the forward
    assert len(data["rows"]) == 5 * problems and data["profile"]["backend"] == "host"
    # the two ranks share the host's memory: their copy rate together was measured and cached
    assert data["profile"]["shared_by"] == 2 and data["profile"]["shared_copy_bytes_per_s"] > 0
    cached = json.loads(next((tmp_path / "cache").glob("profile-*.json")).read_text())
    assert cached["shared_by"] == 2 and cached["shared_copy_bytes_per_s"] == data["profile"]["shared_copy_bytes_per_s"]
    # and their fused tasks at once, the up and the down tiles' CTAs at work each, and how far apart they started
    assert cached["shared_fused"]["sharing"] == 2 and cached["shared_fused"] == data["profile"]["shared_fused"]
    assert cached["shared_fused"]["down_ctas_at_work"] == [1.0]
    assert "fused down tiles' CTAs at work, the fewest of any" in err and "runs' starts apart" in err
    if phase == "fused-forward":
        assert all(len(row["rank_ms"]) == 2 for row in data["rows"])
        for kernel in "ab":  # the host runs one worker a rank
            assert all(row[f"rank_ctas_{kernel}"] == [1.0, 1.0] for row in data["rows"])
            assert all(row[f"fewest_ctas_{kernel}"] == 1.0 for row in data["rows"])
            assert all(row[f"profile_ctas_{kernel}"] == int(row["config"].split()[0][5:]) for row in data["rows"])
        assert "kernel A's CTAs at work" in out and "kernel B's CTAs at work" in out
        assert "kernel A's stand for them" not in out  # the profile measured kernel B's
        assert len(data["problems"]["48 tokens/rank, hidden 64, ffn 32"]) == 2
    if phase in ("weight-sync", "fused-forward"):  # the problems are kept: the sweep replays to its own predictions
        if phase == "weight-sync":
            assert data["problems"] == {"fan-out 1, 0.2 MB": {"expert_bytes": 3 * 256 * 128 * 2, "fanouts": [1],
                                                              "ranks_copying": 1}}
        assert tune_main(["validate", "--replay", str(out_json)]) == 0
        replayed = capfd.readouterr().out
        assert f"mean absolute error {data['summary']['mean_abs_error_pct']:.2f} %" in replayed
    assert all(row["measured_ms"] > 0 and row["predicted_ms"] > 0 for row in data["rows"])
    assert len(data["summary"]["problems"]) == problems
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_a_forward_enqueued_after_its_hold_ended_is_timed_again_behind_a_longer_hold():
    """On the GPU each timed forward waits behind a hold of the stream; where a rank's host
    was still enqueueing it when the hold ended, the forward does not count (its kernels
    started when their launches came) and the hold doubles for every rank."""
    from ultraep.compute.fused.forward import KERNEL_A, KERNEL_B
    from ultraep.tune import validate

    a, b = next(iter(KERNEL_A)), next(iter(KERNEL_B))

    class Moe:
        def forward(self, x, ids, gates):
            hold.enqueued.append(hold.hold_ns)

        def timeline(self):  # two tasks of A on SMs 0 and 1, then B's on SM 0 and, late, SM 1
            return [(a, 100, 300, 0), (a, 120, 400, 1), (b, 410, 900, 0), (b, 700, 800, 1)]

    class Hold:
        hold_ns, enqueued = validate.HOLD_NS, []

        def start(self):
            pass

        def ended_early(self):  # the host outlasts the first two holds
            return len(self.enqueued) <= 2

    class Group:
        def barrier(self, what):
            pass

        def allgather(self, value):
            return [value, value]

    hold = Hold()
    spans = validate.timed_forwards(Group(), Moe(), None, None, None, hold, repeats=3)
    # each kernel's first task's start and last task's end, and its CTAs at work in its first half
    assert spans.shape == (3, 2, 6) and spans[0, 0].tolist() == [100, 400, 410, 900, 2, 1]
    assert hold.enqueued == [validate.HOLD_NS, 2 * validate.HOLD_NS] + [4 * validate.HOLD_NS] * 3
    hold.enqueued, hold.hold_ns = [], validate.MAX_HOLD_NS
    with pytest.raises(RuntimeError, match="to enqueue one fused forward"):
        validate.timed_forwards(Group(), Moe(), None, None, None, hold, repeats=1)


def test_the_fused_sweep_runs_once_per_share_of_senders():
    from tests.tune.synthetic import h200_like
    from ultraep.compute.fused.config import SEND_SHARE
    from ultraep.tune.model import Problem
    from ultraep.tune.validate import fused_configs

    profile, problem = h200_like(), Problem(tokens=4096, hidden=4096, ffn=1536, top_k=8, experts=64, ranks=4)
    plain = fused_configs(profile, problem, 10)
    assert all(c.send_ctas == max(1, min(c.ctas, round(c.ctas * SEND_SHARE))) for c in plain)
    shared = fused_configs(profile, problem, 10, [1.0, 0.25])
    quarter = [c for c in shared if c.send_ctas == max(1, round(c.ctas * 0.25)) and c.send_ctas < c.ctas]
    assert quarter and len(shared) > len(plain)
    assert {c.ctas for c in quarter} <= {c.ctas for c in shared if c.send_ctas == c.ctas}  # the same CTA counts


@pytest.mark.parametrize("count", [1, 2, 4, 10])
def test_the_fused_sweep_holds_the_constants_of_every_share_whatever_its_size(count):
    from tests.tune.synthetic import h200_like
    from ultraep.compute.fused.config import FusedConfig, share_of_ctas
    from ultraep.tune.model import Problem
    from ultraep.tune.validate import fused_configs

    profile, problem = h200_like(), Problem(tokens=8192, hidden=4096, ffn=2048, top_k=8, experts=32, ranks=4)
    configs = fused_configs(profile, problem, count, [1.0, 0.25, 0.0])
    for share in (1.0, 0.25, 0.0):
        usable = profile.usable_sms
        assert FusedConfig(usable, send_ctas=int(share_of_ctas(usable, share))) in configs
