"""The search over the knobs' product: its answer is the best of every configuration
evaluated one by one, it covers over 10^5 configurations fast enough to run at a bucket
boundary, and the tuner memoises per 4096-token bucket."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tests.tune.synthetic import h200_like
from ultraep.errors import ProfileError
from ultraep.tune.__main__ import main as tune_main
from ultraep.compute.fused.config import FusedConfig, FusedSchedule, bucket
from ultraep.tune.model import Problem, SyncProblem, predict
from ultraep.tune.search import FUSED_MODEL_ERROR, KNOBS, Tuner, fused_phases, fused_schedule, knob_values, search
from ultraep.tune.profile import MachineProfile, write_profile

PROFILE = h200_like()
PROBLEM = Problem(tokens=4096, hidden=4096, ffn=1536, top_k=8, experts=64, ranks=4)
SYNC = SyncProblem(3 * 4096 * 1536 * 2, (3, 1))
SEARCH_BOUND_S = 0.01  # issue 23's bound (about 2 ms here on two shared cores, fastest of 5)


def flat_product(values):
    grids = np.meshgrid(*(values[name] for name in KNOBS), indexing="ij")
    return {name: grid.ravel() for name, grid in zip(KNOBS, grids)}


def fused_s(problem, config: FusedConfig, profile=PROFILE) -> float:
    """The fused phases' modelled seconds, through ``predict`` (the search's own path is
    ``fused_phases``: the two must agree)."""
    phases = predict(profile, problem, None, {"sync_blocks": 1, "dispatch_grid": 1, "ctas": config.ctas,
                                              "send_tokens": config.send_tokens,
                                              "reduce_tokens": config.reduce_tokens})
    seconds = float(phases["fused_up"] + phases["fused_down"])
    assert sum(fused_phases(profile, problem, config).values()) == pytest.approx(seconds)
    return seconds


@pytest.mark.parametrize("problem", [PROBLEM, Problem(1024, 7168, 2048, 8, 256, 8, ranks_per_gpu=8),
                                     Problem(16384, 2048, 768, 4, 32, 4, slot_rows=(9000, 100) + (0,) * 6)])
def test_search_returns_the_best_of_every_configuration(problem):
    """The product's best, except that the fused kernels keep the source's constants where
    the best is not predicted faster than them by more than the model's error."""
    result = search(PROFILE, problem, SYNC)
    values = knob_values(PROFILE)
    flat = flat_product(values)
    total = sum(predict(PROFILE, problem, SYNC, flat).values())
    assert result.evaluated == total.size
    best = int(np.argmin(total))
    config = result.config
    fastest = FusedConfig(int(flat["ctas"][best]), int(flat["send_tokens"][best]), int(flat["reduce_tokens"][best]))
    constants = FusedConfig(PROFILE.usable_sms)
    gain = fused_s(problem, constants) / fused_s(problem, fastest)
    assert config.fused == (fastest if gain > 1 / (1 - FUSED_MODEL_ERROR) else constants)
    assert (config.sync_blocks, config.dispatch_grid) == (int(flat["sync_blocks"][best]),
                                                          int(flat["dispatch_grid"][best]))
    swapped = fused_s(problem, config.fused) - fused_s(problem, fastest)
    assert sum(result.predicted.values()) == pytest.approx(float(total[best]) + swapped)


def test_the_fused_constants_stay_unless_the_model_predicts_a_gain_beyond_its_error():
    """At 8192 tokens the h200-like machine's best task sizes are within the model's error of
    the constants' (kept); a grid of a quarter of the SMs is predicted far slower than the
    best (never kept), so a search among it and the constants takes the constants too."""
    problem = Problem(8192, 4096, 1536, 8, 64, 4)
    constants = FusedConfig(PROFILE.usable_sms)
    values = {**knob_values(PROFILE), "ctas": np.array([PROFILE.usable_sms // 4, PROFILE.usable_sms])}
    free = search(PROFILE, problem, values=values)
    assert free.config.fused == constants
    fastest = min((FusedConfig(PROFILE.usable_sms, int(s), int(r)) for s in values["send_tokens"]
                   for r in values["reduce_tokens"]),
                  key=lambda c: fused_s(problem, c))
    assert fastest != constants and fused_s(problem, fastest) < fused_s(problem, constants)  # a gain, within the error
    quarter = {**values, "ctas": np.array([PROFILE.usable_sms // 4]),
               "send_tokens": np.array([constants.send_tokens]), "reduce_tokens": np.array([constants.reduce_tokens])}
    assert fused_s(problem, FusedConfig(PROFILE.usable_sms // 4)) > fused_s(problem, constants)
    assert search(PROFILE, problem, values=quarter).config.fused == constants


def test_a_predicted_gain_beyond_the_error_leaves_the_constants():
    """4 ranks on an H200 at 25 % each (a profile stored by ``tune validate``): the shares
    overlap, and a rank launching a CTA on each of its 32 SMs finds only 20 at work in kernel
    A, 24 at 28 CTAs; the search takes the smaller grid, predicted more than the model's
    error faster (measured on the sweeps: 2.5-4.4 % faster than the constants)."""
    stored = json.loads((Path(__file__).parent / "h200_sync_b2767b9.json").read_text())["profile"]
    profile = MachineProfile.from_json(stored, stored=True)
    problem = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=profile.shared_by)
    chosen = search(profile, problem).config.fused
    assert chosen.ctas < profile.usable_sms
    assert fused_s(problem, chosen, profile) < (1 - FUSED_MODEL_ERROR) * fused_s(
        problem, FusedConfig(profile.usable_sms), profile)


def test_search_covers_over_1e5_configurations_within_the_bound():
    times = []
    for _ in range(5):
        begin = time.perf_counter()
        result = search(PROFILE, PROBLEM, SYNC)
        times.append(time.perf_counter() - begin)
    print(f"\nsearch: {result.evaluated} configurations, fastest of 5 in {min(times) * 1e3:.2f} ms")
    assert result.evaluated >= 100_000
    assert min(times) <= SEARCH_BOUND_S, times


def test_the_space_respects_the_machine():
    quarter = knob_values(h200_like(sm_share=25))
    assert quarter["ctas"].max() == 33 and quarter["sync_blocks"].max() == 4 * 33
    assert quarter["dispatch_grid"].tolist() == [33 * i for i in range(1, 9)]
    chosen = search(h200_like(sm_share=25), PROBLEM).config.fused
    chosen.check_resident(33)
    with pytest.raises(ProfileError, match="candidate values"):
        search(PROFILE, PROBLEM, values={**knob_values(PROFILE), "ctas": np.array([], np.int64)})


def test_tuner_memoises_per_bucket_and_shape():
    assert [bucket(t) for t in (1, 4096, 4097, 8192, 8193)] == [1, 1, 2, 2, 3]
    tuner = Tuner(PROFILE)
    first = tuner.choose(PROBLEM, SYNC)
    assert tuner.choose(Problem(3000, 4096, 1536, 8, 64, 4), SYNC) is first and len(tuner) == 1
    assert tuner.choose(Problem(5000, 4096, 1536, 8, 64, 4), SYNC) is not first and len(tuner) == 2
    assert tuner.choose(Problem(3000, 7168, 1536, 8, 64, 4), SYNC) is not first and len(tuner) == 3
    assert tuner.choose(PROBLEM, None) is not first and len(tuner) == 4
    with pytest.raises(ProfileError, match="MachineProfile"):
        Tuner("h200")


def test_search_cli_prints_the_choice_and_its_time(tmp_path, capsys):
    path = write_profile(PROFILE, tmp_path / "h200.json")
    assert tune_main(["search", "--profile", str(path), "--fanout", "3"]) == 0
    out = capsys.readouterr().out
    assert "(device backend, 132 SMs at an MPS share of 100 %)" in out
    assert ("problem: 4096 tokens a rank, hidden 4096, ffn 1536, top-8 of 64 experts, 8 ranks (1 a GPU); weight sync "
            "of a 37.7 MB expert to 3 replicas") in out
    assert re.search(r"best: weight-sync grid \d+, dispatch grid \d+, fused ctas=\d+ senders=\d+ send=\d+ "
                     r"reduce=\d+ unroll=4/8", out) and "fused_down" in out and "weight_sync" in out
    assert "search: 147456 configurations in" in out
    assert tune_main(["search", "--profile", str(path)]) == 0  # no weight sync: no grid for it, no time
    out = capsys.readouterr().out
    assert "no weight sync (--fanout 0)" in out and "weight-sync grid -," in out and "weight_sync" not in out
    with pytest.raises(SystemExit) as refused:
        tune_main(["search", "--profile", str(path), "--fanout", "8"])
    assert refused.value.code == 2 and "--fanout 8: at most 7 replicas on 8 ranks" in capsys.readouterr().err


def test_search_cli_refuses_what_it_cannot_search(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        tune_main(["search", "--fanout", "-2"])
    assert refused.value.code == 2 and "--fanout: expected an int >= 0, got '-2'" in capsys.readouterr().err
    assert tune_main(["search", "--profile", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--profile {tmp_path / 'none.json'}" in err and "No such file" in err
    path = write_profile(PROFILE, tmp_path / "h200.json")
    for problem, message in ((["--experts", "7", "--ranks", "4"], "7 experts do not divide over 4 ranks"),
                             (["--top-k", "100", "--experts", "8"], "top_k 100 exceeds the 8 experts")):
        assert tune_main(["search", "--profile", str(path), *problem]) == 2
        err = capsys.readouterr().err
        assert err == f"ultraep.tune search: Problem: {message}\n", err
    with pytest.raises(SystemExit):
        tune_main(["search", "--ranks-per-gpu", "16", "--ranks", "8"])
    assert "--ranks-per-gpu 16 exceeds --ranks 8" in capsys.readouterr().err


def test_a_fused_schedule_holds_each_buckets_choice():
    tuner = Tuner(PROFILE)
    problem = Problem(10000, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    schedule = fused_schedule(tuner, problem)
    assert len(schedule.configs) == bucket(10000) == 3
    for b, tokens in enumerate((4096, 8192, 10000), start=1):
        expected = search(PROFILE, Problem(tokens, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)).config.fused
        assert schedule.configs[b - 1] == expected
        assert schedule.for_tokens(tokens) == expected
    assert schedule.for_tokens(1) == schedule.configs[0] and schedule.for_tokens(10**6) == schedule.configs[-1]
    assert FusedSchedule((FusedConfig(7),)).for_tokens(50000) == FusedConfig(7)
