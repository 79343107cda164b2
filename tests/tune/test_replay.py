"""The fused kernels' model replayed on two sweeps measured on the H200 (4 ranks under the
MPS emulation, 25 % of the SMs each: 32 SMs a rank; ``python -m ultraep.tune validate
--emulate-ep --ranks 4 --phase fused-forward --tokens 4096``: hidden 4096, ffn 1536, top-8 of
64 experts, seed 0; 53 configurations, kernel A, kernel B and the forward each):

* ``h200_fused_e9279ab.json``: at e9279ab, profile version 4, with every rank's own spans;
* ``h200_fused_9cb7189.json``: at 9cb7189 (kernel B's stores on its store warps), profile
  version 5, rebuilt from the run's text log (its meta says how).

Both keep every rank's problem (its routing, recomputed from the seed). The model replays
them as they were measured: relays claimed between the sends and the tiles, no CTAs at work
in the profile. One rank at a time ran kernel A as if on fewer CTAs from 27 CTAs a rank on
(MPS shares that overlap); profile version 6 measures those CTAs at work, these profiles do
not: the held-out check derives them from the first run's rank spans and replays the
second run with them."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from ultraep.tune.__main__ import main as tune_main
from ultraep.tune.config import FusedConfig
from ultraep.tune.validate import replay_rows, summarise

HERE = Path(__file__).parent
FIT, HELD_OUT = (json.loads((HERE / name).read_text()) for name in ("h200_fused_e9279ab.json",
                                                                     "h200_fused_9cb7189.json"))
NO_LAG_CTAS = 24  # up to here no rank of either run lagged (its spans are the group's, less the start spread)


def derived_ctas_at_work(document) -> tuple[float, ...]:
    """The lagging rank's CTAs at work at the profile's grids, from a run's kernel A rows: a
    rank's own span (the median over ranks) over the group's window is the ranks' start
    spread where none lags (up to NO_LAG_CTAS), and c times it over that spread above, where
    the window is the lagging rank's span; a line through those gives the grids above."""
    rows = [row for row in document["rows"] if row["window"] == "up"]
    ctas = np.array([FusedConfig.parse(row["config"]).ctas for row in rows], np.float64)
    ratio = np.array([np.median(row["rank_ms"]) / row["measured_ms"] for row in rows])
    spread = np.median(ratio[ctas <= NO_LAG_CTAS])
    lagging = ctas > NO_LAG_CTAS
    line = np.polyfit(ctas[lagging], ctas[lagging] * ratio[lagging] / spread, 1)
    grids = np.asarray(document["profile"]["shared_fused"]["grids"], np.float64)
    return tuple(float(v) for v in np.where(grids <= NO_LAG_CTAS, grids, np.minimum(np.polyval(line, grids), grids)))


def with_ctas_at_work(document, at_work):
    replayed = copy.deepcopy(document)
    replayed["profile"]["shared_fused"]["ctas_at_work"] = list(at_work)
    return replayed


def windows_mae(rows) -> dict:
    summary = summarise(rows)
    return {row["window"]: summary["problems"][row["problem"]] for row in rows}


def test_the_runs_replay_as_they_were_predicted():
    """Today's model on the run's own profile: 9cb7189's run was predicted by nearly it
    (within 1.3 %: its profile rebuilt from rank 0's lines, the sends and relays since two
    phases); e9279ab's by the model before 9348602, today's predicts its kernel B closer."""
    rows, profile = replay_rows(HELD_OUT)
    assert profile.version == 5 and not profile.fused.relays_on_store_warps
    logged = np.array([row["predicted_ms"] for row in HELD_OUT["rows"]])
    assert np.abs(np.array([row["predicted_ms"] for row in rows]) / logged - 1).max() < 0.014
    for document, mae in ((FIT, 10.46), (HELD_OUT, 9.18)):
        assert summarise(replay_rows(document)[0])["mean_abs_error_pct"] == pytest.approx(mae, abs=0.01)


def test_ctas_at_work_derived_from_one_run_predict_the_other():
    at_work = derived_ctas_at_work(FIT)
    grids = FIT["profile"]["shared_fused"]["grids"]
    assert grids[-3:] == [24, 28, 32] and at_work[-3:] == pytest.approx((24.0, 24.8, 24.0), abs=0.05)
    fit = summarise(replay_rows(with_ctas_at_work(FIT, at_work))[0])
    held_out_rows = replay_rows(with_ctas_at_work(HELD_OUT, at_work))[0]
    held_out = summarise(held_out_rows)
    print(f"\nCTAs at work {at_work}: fit {fit['mean_abs_error_pct']:.2f} %, held out "
          f"{held_out['mean_abs_error_pct']:.2f} % (worst {held_out['worst_error_pct']:+.1f} %)")
    assert fit["mean_abs_error_pct"] < 6.5 and held_out["mean_abs_error_pct"] < 5.0
    windows = windows_mae(held_out_rows)
    assert windows["up"]["mean_abs_error_pct"] < 4.0 and windows["forward"]["mean_abs_error_pct"] < 3.5
    # the choice: the forward's within 3 % of the fastest measured (27 CTAs), no longer every SM
    assert windows["forward"]["chosen_over_best_pct"] < 3.0 and not windows["forward"]["chosen"].startswith("ctas=32")


def test_replay_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "replayed.json"
    assert tune_main(["validate", "--replay", str(HERE / "h200_fused_9cb7189.json"), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--replay" in printed and "9cb7189" in printed and "mean absolute error 9.18 %" in printed
    replayed = json.loads(out.read_text())
    assert replayed["replayed"].endswith("h200_fused_9cb7189.json") and len(replayed["rows"]) == 159
    assert replayed["summary"]["mean_abs_error_pct"] == pytest.approx(9.18, abs=0.01)
    assert replay_rows(replayed)[0] == replayed["rows"]  # a replay's file replays to itself


def test_replay_refuses_what_it_cannot_predict(tmp_path):
    other = tmp_path / "dispatch.json"
    other.write_text(json.dumps({"phase": "dispatch", "rows": []}))
    with pytest.raises(SystemExit, match="not a fused-forward sweep"):
        tune_main(["validate", "--replay", str(other)])
    with pytest.raises(SystemExit, match="cannot read"):
        tune_main(["validate", "--replay", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):  # neither a phase to sweep nor a file to replay
        tune_main(["validate"])
