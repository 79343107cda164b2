"""The Dispatcher's copy kernels' model replayed on the dispatch sweep measured on the H200
(``h200_dispatch_0e4bf36.json``: 4 ranks under the MPS emulation, 25 % of the SMs each, 32 a
rank; ``python -m ultraep.tune validate --emulate-ep --ranks 4 --phase dispatch --tokens
4096 --json``: hidden 4096, top-8 of 64 experts, seed 0; grids 1 to 256, dispatch, combine
and pull each; profile version 8, every rank's routing recomputed from the seed). From grid
44 on, adjacent grids differ by 1.8, 2.1 and 4.1 % on average (dispatch, combine, pull; up
to 8.5, 10.3, 12.5 %) where the model sees hardly any change: were that the noise of 10
calls a grid, independent from grid to grid, a model without error would still be off by
0.7 times it on average: a floor of about 1.3, 1.5 and 2.9 % (2 % overall) under the mean
absolute error.

Held out (463c947, profile version 10, swept before the model changed for them; each keeps
its ranks' problems): the same at 4096 tokens (``h200_dispatch_4r4096_463c947.json``), at
hidden 7168 (``..._4r4096h7168_...``), at 8192 and 16384 tokens (``..._4r8192-16384_...``),
and at 8 ranks, 12 % of the SMs each, 14 a rank (``..._8r4096_...``).

Held out later (1416c82, profile version 10, swept before the model changed for them): 16384
tokens at hidden 2048 and top-4 (``h200_dispatch_4r16384h2048k4_1416c82.json``), 2048 tokens
(``..._4r2048_...``), 8 ranks at 8192 tokens and hidden 7168 (``..._8r8192h7168_...``).

Held out at 88e0717 (profile version 10): 2 ranks, 50 % of the SMs each, 66 a rank, 8192
tokens (``h200_dispatch_2r8192_88e0717.json``: grids 1 to 528, past the 330 resident); 4
ranks at 4096 tokens, hidden 5120, top-6 (``..._4r4096h5120k6_...``) and 8 ranks at 2048
tokens (``..._8r2048_...``). Swept at 8cae346 with the choices and the fastest grids timed
again together: 4 and 8 ranks at 4096 tokens (``h200_dispatch_4r4096_8cae346.json``,
``..._8r4096_8cae346.json``)."""

import copy
import json
from pathlib import Path

import pytest

from ultraep.tune.validate import replay_rows, seeded_dispatch_problems, summarise

HERE = Path(__file__).parent
SWEEP = json.loads((HERE / "h200_dispatch_0e4bf36.json").read_text())
HELD_OUT = {"4r4096": 3.30, "4r4096h7168": 3.46, "4r8192-16384": 3.45, "8r4096": 3.94}  # the MAE replayed
# the later held-out sweeps: the mean absolute error the model reaches on each, and its
# choice's excess over the fastest measured per problem where it misses CHOICE_BAR_PCT
LATER = {"4r16384h2048k4": 3.86, "4r2048": 4.42, "8r8192h7168": 5.31}
LATER_CHOICE_MISSES = {("4r16384h2048k4", "dispatch, 16384 tokens/rank, hidden 2048"): 3.76,
                       ("4r16384h2048k4", "combine, 16384 tokens/rank, hidden 2048"): 5.78,
                       ("4r16384h2048k4", "pull, 16384 tokens/rank, hidden 2048"): 7.50,
                       ("4r2048", "dispatch, 2048 tokens/rank, hidden 4096"): 8.95,
                       ("4r2048", "combine, 2048 tokens/rank, hidden 4096"): 8.44,
                       ("8r8192h7168", "pull, 8192 tokens/rank, hidden 7168"): 10.32}
# swept after the model's changes for the sweeps above, never fitted to
FRESH = {"4r4096h5120k6": 4.52, "8r2048": 4.89}
FRESH_CHOICE_MISSES = {("8r2048", "dispatch, 2048 tokens/rank, hidden 4096"): 3.31}
CHOICE_BAR_PCT = 3.0  # issue 23: the model's choice within this of the fastest measured, in every problem
# where the choice misses it, and by how much: the dispatch (and one pull), whose measured
# curves are flat within their noise where the model's choices differ from the fastest's by
# under 1.2 % predicted. The 8192-token dispatch's choice moved with the sends' stores (grid
# 251, 1.58 % over, to 118, 3.20 %): the two were predicted 0.06 % apart before, 0.2 % after.
CHOICE_MISSES = {("4r4096", "dispatch, 4096 tokens/rank, hidden 4096"): 3.00,
                 ("4r4096h7168", "dispatch, 4096 tokens/rank, hidden 7168"): 3.06,
                 ("4r8192-16384", "dispatch, 8192 tokens/rank, hidden 4096"): 3.20,
                 ("4r8192-16384", "pull, 8192 tokens/rank, hidden 4096"): 3.12,
                 ("8r4096", "dispatch, 4096 tokens/rank, hidden 4096"): 3.85}


def held_out(name: str, commit: str = "463c947") -> dict:
    return json.loads((HERE / f"h200_dispatch_{name}_{commit}.json").read_text())


def assert_choices(name: str, summary: dict, misses: dict) -> None:
    """Each problem's choice within CHOICE_BAR_PCT of the fastest measured, but for the
    ``misses`` pinned at their excess."""
    for problem, figures in summary["problems"].items():
        missed = misses.get((name, problem))
        if missed is None:
            assert figures["chosen_over_best_pct"] <= CHOICE_BAR_PCT, (problem, figures)
        else:
            assert figures["chosen_over_best_pct"] == pytest.approx(missed, abs=0.01), (problem, figures)


def per_operation(summary: dict) -> dict:
    return {problem.split(",")[0]: figures for problem, figures in summary["problems"].items()}


def test_the_dispatch_sweep_replays():
    """0e4bf36's model predicted it at 20.2 % (bytes a warp, every block resident at the
    threads' bound of 8 an SM). Round trips a unit, 5 blocks an SM (the kernels' registers)
    and the lagging rank's blocks past kernel A's CTAs at work running after: 10.9 %
    (dispatch 16.6, combine 6.7, pull 9.4); the token map's round trips: 8.3 % (dispatch
    8.7); round trips stretched by the warps queueing at the memory's channels, and the
    warps with one more unit running it after: 5.2 % (dispatch 5.8, combine 3.4, pull 6.6).
    Its choices, the largest grid (no ragged end at 4096 tokens over 2048 warps), measured
    4.6-5.5 % over the fastest. An even division's drain (one warp's unit, as a ragged end):
    5.1 % (dispatch 5.7, combine 3.3, pull 6.3), its choices grids 118, 118, 107: 1.5, 1.3,
    0.0 % over the fastest. Index loads before a unit's rounds (from L2), a row's round 0.8 of
    heap.cu's and a kernel's device overhead once for every rank of the GPU: 3.8 % (dispatch
    3.7, combine 3.3, pull 4.4), the same choices. A send's rounds as long as its stores to
    its ranks where they take longer (ROW_STORE_FRACTION), a row's load round 0.65: 3.56 %
    (dispatch 3.55, combine 2.72, pull 4.42), the same choices."""
    logged = summarise(copy.deepcopy(SWEEP["rows"]))
    rows, profile = replay_rows(SWEEP)
    summary = summarise(rows)
    assert profile.version == 8 and profile.dispatch_blocks_per_sm == 0  # not measured before version 10
    assert logged["mean_abs_error_pct"] == pytest.approx(20.23, abs=0.01)
    assert summary["mean_abs_error_pct"] == pytest.approx(3.56, abs=0.01)
    ops = per_operation(summary)
    assert {op: figures["mean_abs_error_pct"] for op, figures in ops.items()} == pytest.approx(
        {"dispatch": 3.55, "combine": 2.72, "pull": 4.42}, abs=0.01)
    assert {op: figures["chosen_over_best_pct"] for op, figures in ops.items()} == pytest.approx(
        {"dispatch": 1.52, "combine": 1.30, "pull": 0.0}, abs=0.01)


@pytest.mark.parametrize("name", HELD_OUT)
def test_held_out_sweeps_replay_within_the_error_bar_and_choose_within_the_choice_bar(name):
    """Each held-out sweep within issue 23's 5 % mean absolute error (3.30, 3.46, 3.45, 3.94 %;
    3.54, 3.71, 3.67, 4.06 before the sends' stores; 4.77, 4.01, 4.08, 4.82 before the index
    loads, the row round and the kernels of every rank;
    without the drain of an even division 4.97, 4.11, 4.14, 4.83), and each phase's choice
    within CHOICE_BAR_PCT of the fastest measured but for CHOICE_MISSES (without the drain the
    model chose grid 256 at 4 ranks: combine 8.5-9.4 % over the fastest, pull 10-16 %)."""
    summary = summarise(replay_rows(held_out(name))[0])
    assert summary["mean_abs_error_pct"] == pytest.approx(HELD_OUT[name], abs=0.01)
    assert_choices(name, summary, CHOICE_MISSES)


def test_an_even_division_of_the_units_gains_nothing():
    """Grid 256 at 4 ranks gives each warp two of 4096 tokens, 251 leaves 80 warps a third: the
    sweep measured them alike (dispatch 0.1 %, combine 2.6, pull 0.2 apart), and so does the
    model (without the drain: 256 modelled 0.3-11 % under 251, no ragged end at all)."""
    rows = replay_rows(held_out("4r4096"))[0]
    for op in ("dispatch", "combine", "pull"):
        mine = {row["knob"]: row for row in rows if row["operation"] == op}
        for key in ("predicted_ms", "measured_ms"):
            assert mine[256][key] == pytest.approx(mine[251][key], rel=0.03), (op, key)


def test_a_sweep_written_without_its_problems_replays_from_its_seed(tmp_path):
    """Main's dispatch sweeps keep neither their ranks' problems nor their rows' shape and
    operation: the routing is drawn again from the command line's seed, as the sweep drew it
    -- the stored file's problems (recomputed the same way) to the row, and its replay."""
    bare = copy.deepcopy(SWEEP)
    del bare["problems"]
    for row in bare["rows"]:
        del row["shape"], row["operation"]
    assert json.loads(json.dumps(seeded_dispatch_problems(bare))) == SWEEP["problems"]
    replayed = [row["predicted_ms"] for row in replay_rows(SWEEP)[0]]
    assert [row["predicted_ms"] for row in replay_rows(bare)[0]] == replayed
    with pytest.raises(SystemExit, match="needs its command line"):
        replay_rows(dict(bare, meta={}))


@pytest.mark.parametrize("name", LATER)
def test_later_held_out_sweeps_replay_to_what_the_model_reaches(name):
    """Before the index loads, the row round and the kernels of every rank: 7.54, 9.25, 5.63 %
    (4r16384h2048k4: dispatch 9.7, combine 4.5, pull 8.4; 4r2048: 12.7, 4.2, 10.9, the
    dispatch at large grids 15 % short; 8r8192h7168: 5.1, 5.0, 6.8); 3.88, 4.38 and 5.40 %
    before the sends' stores. Now 3.86, 4.42 and 5.31 %:
    the last misses the bar by its pull and combine near the bandwidth (10-14 % over at grids
    33-56, where it measured the memory's copy rate -- a read-heavy mix, 8 rows read a row
    written, which the profile's copy rate does not see). The choices did not move: where they
    miss, the measured curves rise past grid 50-100 at small problems (2048 tokens, or top-4 at
    hidden 2048) while the model's stay flat within 2 %, and the 8-rank pull's choice (grid 70)
    measured 9 % above both its neighbours."""
    summary = summarise(replay_rows(held_out(name, "1416c82"))[0])
    assert summary["mean_abs_error_pct"] == pytest.approx(LATER[name], abs=0.01)
    assert_choices(name, summary, LATER_CHOICE_MISSES)


def test_the_choices_timed_again_beside_the_fastest():
    """Swept at 8cae346 with the re-timing (5 rounds): 4 ranks and 8 ranks at 4096 tokens, 3.40 and
    4.19 % (3.34 and 4.09 with the sends' stores). Against the sweep's fastest single
    measurement the choices were 3.51 / 2.57 / 2.75 % and 0.65 / 1.71 / 2.53 % over; timed again
    beside the fastest three, 4.25 / 1.12 / 0.58 % and 0.22 / 0.87 / 0.00 %: the dispatch's grid
    118 at 4 ranks is slower than 54 by more than the sweep's luck (an earlier run the same
    hour, its single measurements disturbed by spikes of up to 2.3x, measured the combine and
    pull choices 0.3 and 4.4 % over when timed again, 0.9 and 130 % over the single-pass
    fastest)."""
    expected = {"4r4096": (3.34, {"dispatch": 4.25, "combine": 1.12, "pull": 0.58}),
                "8r4096": (4.09, {"dispatch": 0.22, "combine": 0.87, "pull": 0.00})}
    for name, (mae, retimed) in expected.items():
        summary = summarise(replay_rows(held_out(name, "8cae346"))[0])
        assert summary["mean_abs_error_pct"] == pytest.approx(mae, abs=0.01)
        assert {op: figures["chosen_over_best_retimed_pct"] for op, figures in per_operation(summary).items()} == (
            pytest.approx(retimed, abs=0.01))


@pytest.mark.parametrize("name", FRESH)
def test_sweeps_measured_after_the_model_replay_as_they_were_predicted(name):
    """Swept at 88e0717 after the model's last change for the earlier sweeps, never fitted
    to: 4 ranks at 4096 tokens, hidden 5120, top-6 (4.74 %: dispatch 5.01, combine 3.49, pull
    5.72; choices 1.86, 0.66, 0.00 % over the fastest) and 8 ranks at 2048 tokens (4.90 %:
    4.64, 3.55, 6.52; the dispatch's choice, grid 70, 3.31 % over grid 26). With the sends'
    stores: 4.52 % (5.01, 2.82, 5.72) and 4.89 % (4.96, 3.19, 6.52), the same choices."""
    summary = summarise(replay_rows(held_out(name, "88e0717"))[0])
    assert summary["mean_abs_error_pct"] == pytest.approx(FRESH[name], abs=0.01)
    assert_choices(name, summary, FRESH_CHOICE_MISSES)


def test_two_ranks_replay_to_what_the_model_reaches():
    """2 ranks at 50 % (88e0717's model: 7.88 %, dispatch 8.53, combine 6.43, pull 8.68; worst
    +36.5 %, pull at grid 297). Kernel A measured all 58 CTAs at work at 58 and 60 of 66 at
    66; the measured fraction between them took 5 of the lagging rank's 297 blocks off and
    ran them after, where the sweep measured no step. The other rank, running fewer blocks
    there, holds no more SMs than at 66: the lagging rank keeps 60, and loses blocks from 300
    on: 7.50 % (8.33, 6.05, 8.11). A send's rounds as long as its stores where they take
    longer, a row's load round 0.65 (test_grid_one_moves_what_the_stores_and_loads_take):
    6.97 % (7.61, 5.20, 8.11), grid 1 -1.9 % (was +11.0), combine +5.0 (+13.2). Not reached:
    the bar of 5 %. What is left: the model stays 5-10 % over nearly everywhere from 34 to 122
    blocks (dispatch +6-15 %: the
    sweep reached 2.0 TB/s from 1400 warps on, the model's queues 1.7), and past the
    residency (pull +11-18 % at 407-506: the model charges the first blocks' ragged end and
    the late blocks' drain one after the other, 23 us each; measured at the shared copy
    rate); and 308-341 still step 10-22 % over (the lagging rank's late blocks run alone
    for their whole units, measured about half that). The choices stay within the bar."""
    summary = summarise(replay_rows(held_out("2r8192", "88e0717"))[0])
    assert summary["mean_abs_error_pct"] == pytest.approx(6.97, abs=0.01)
    assert {op: figures["mean_abs_error_pct"] for op, figures in per_operation(summary).items()} == pytest.approx(
        {"dispatch": 7.61, "combine": 5.20, "pull": 8.11}, abs=0.01)
    assert_choices("2r8192", summary, {})


def test_grid_one_moves_what_the_stores_and_loads_take():
    """One block a rank, its 8 warps alone at the memory: the dispatch moved 57-62 GB/s loaded
    + stored through its SM at 2, 4 and 8 ranks alike (hidden 4096-7168), its sends storing a
    token to 2.0, 3.7 and 5.5 ranks. With a send's rounds waiting for its loads alone (the
    stores free), the model was 11.0 % over at 2 ranks and 3.2-6.8 % under at 8; a send's round
    now lasts its stores where they take longer (ROW_STORE_FRACTION a row stored): every sweep's
    grid 1 within 3.2 % at hidden 4096-7168, 5.2 % at hidden 2048 (2 rounds a row, top-4)."""
    for path in sorted(HERE.glob("h200_dispatch_*.json")):
        rows = replay_rows(json.loads(path.read_text()))[0]
        summarise(rows)
        for row in rows:
            if row["knob"] == 1 and row["operation"] == "dispatch":
                bound = 5.3 if "hidden 2048" in row["shape"] else 3.2
                assert abs(row["error_pct"]) < bound, (path.name, row["shape"], row["error_pct"])
