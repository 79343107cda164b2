"""Plots a person reads at a glance: the figure each plot function returns is read back
(titles, axis labels, linear scales, tick labels that tell 1.008 from 1.010), and the PNG
it wrote decodes to an image."""

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from ultraep.analysis.plots import plot_rank_loads, plot_replay  # noqa: E402
from ultraep.analysis.traces import zipf_loads  # noqa: E402
from ultraep.bench import plan as bench_plan  # noqa: E402
from ultraep.integration.stats import plan_record  # noqa: E402
from ultraep.planner import ExpertLayout, plan_placement  # noqa: E402


def decoded(path):
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


def tick_texts(axis):
    return [label.get_text() for label in axis.get_ticklabels() if label.get_text()]


def test_replay_plot_panels_are_linear_with_readable_ticks_and_name_the_bound_kinds(tmp_path):
    layout = ExpertLayout(4, 8, 1)
    loads = np.stack([np.stack([zipf_loads(4, 8, 2, 64, 1.6, seed=s * 2 + l, tolerance=0.05) for l in range(2)])
                      for s in range(4)])
    result = bench_plan.replay(loads, layout, min_replica_tokens=8, eplb_window=2, bound_method="auto",
                               bound_time_limit=0.5, bound_budget=0.0)
    path = tmp_path / "replay.png"
    fig = plot_replay(result, path, "test replay")
    decoded(path)
    top, middle, bottom = fig.axes
    assert top.get_xlabel() == "rank" and top.get_ylabel() == "tokens"
    assert tick_texts(top.xaxis) == ["0", "1", "2", "3"] and top.get_xlim() == (-0.5, 3.5)  # no stray rank tick
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert any(t.startswith("ideal (mean)") for t in legend) and any(t.startswith("lower bound") for t in legend)
    bound_line, ideal_line = top.get_lines()[-2:]
    assert (bound_line.get_linewidth(), bound_line.get_linestyle()) != (ideal_line.get_linewidth(),
                                                                      ideal_line.get_linestyle())
    for ax in (middle, bottom):
        assert ax.get_yscale() == "linear" and ax.get_xlabel() == "step"
        labels = tick_texts(ax.yaxis)
        assert len(labels) >= 3 and len(set(labels)) == len(labels)
    assert all(len(t.split(".")[1]) == 3 for t in tick_texts(bottom.yaxis))  # 1.008 is readable
    kinds = set(result["bound_kind"].ravel())
    bottom_legend = " ".join(t.get_text() for t in bottom.get_legend().get_texts())
    assert kinds and all(f"{kind} bound" in bottom_legend for kind in kinds)


def test_rank_load_plot_shows_per_micro_batch_loads_not_their_sum(tmp_path):
    layout = ExpertLayout(4, 8, 1)
    records = []
    for step in range(3):
        loads = zipf_loads(4, 8, 2, 512, 2.0, seed=step, tolerance=0.05)
        plan = plan_placement(loads, layout, min_replica_tokens=8)
        records.append(plan_record(layout, 0, step, plan.loads, plan.phys_to_log, plan.rank_load))
    path = tmp_path / "loads.png"
    fig = plot_rank_loads(records, path, title="t")
    decoded(path)
    (ax,) = fig.axes
    assert ax.get_yscale() == "linear" and ax.get_xlabel() == "rank" and "per micro-batch" in ax.get_ylabel()
    assert tick_texts(ax.xaxis) == ["0", "1", "2", "3"] and ax.get_xlim() == (-0.5, 3.5)
    heights = [patch.get_height() for patch in ax.patches][:4]  # the unbalanced bars
    per_batch = np.array([r.rank_load_before for r in records])
    assert np.allclose(heights, per_batch.mean(axis=0))  # a micro-batch's scale, not the sum of three
    worst = max(r.imbalance_before for r in records)
    assert any(f"{worst:.3f} at worst" in t.get_text() for t in ax.get_legend().get_texts())
