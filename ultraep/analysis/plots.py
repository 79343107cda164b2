"""Plots (matplotlib, imported on the first plot; written to files, no display needed).

Each function writes one PNG and returns the closed ``matplotlib.figure.Figure``, so a
caller (or a test) can read back what was drawn: titles, axis labels, scales, tick labels.
Axes are linear, and the imbalance axes that sit near 1 get tick labels with enough
decimals to read a 1.008 from a 1.010.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ultraep.planner.plan import imbalance

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Marker of each lower-bound kind (``ultraep.bench.plan.bound_kind``) in the replay plot.
BOUND_MARKERS = {"exact": "o", "milp": "s", "lp": "^", "trivial": "x"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def _rank_axis(ax, ranks: int) -> None:
    """One labelled tick per rank and nothing past the last one."""
    ax.set_xticks(np.arange(ranks))
    ax.set_xlim(-0.5, ranks - 0.5)
    ax.set_xlabel("rank")


def _ratio_axis(ax, values, decimals: int) -> None:
    """Linear y axis around ``values`` (ratios near 1), its ticks labelled with ``decimals`` decimals."""
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator

    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
    pad = max(high - low, 10.0 ** -decimals) * 0.15
    ax.set_ylim(min(low, 1.0) - pad, high + pad)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FormatStrFormatter(f"%.{decimals}f"))
    ax.grid(axis="y", linewidth=0.4, alpha=0.5)


def plot_rank_loads(records, path, *, title: str = "per-rank load") -> Figure:
    """Each rank's load per micro-batch without and with balancing, over ``records``
    (:class:`ultraep.integration.stats.LayerRecord`, one per layer and micro-batch): bars
    are the mean over the records, markers the largest one, so a skewed micro-batch is not
    averaged away by the others."""
    if not records:
        raise ValueError("plot_rank_loads: no records to plot")
    plt = _pyplot()
    before = np.array([r.rank_load_before for r in records], dtype=np.float64)
    after = np.array([r.rank_load_after for r in records], dtype=np.float64)
    ranks = np.arange(before.shape[1])
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * ranks.size + 3), 3.6))
    for offset, loads, name, color in ((-0.2, before, "unbalanced", "C0"), (0.2, after, "balanced", "C1")):
        per_batch = [imbalance(row) for row in loads]
        ax.bar(ranks + offset, loads.mean(axis=0), width=0.4, color=color,
               label=f"{name}: mean over micro-batches (max/mean {np.mean(per_batch):.3f} on average, "
                     f"{max(per_batch):.3f} at worst)")
        ax.plot(ranks + offset, loads.max(axis=0), linestyle="none", marker="v", color=color, markeredgecolor="k",
                label=f"{name}: largest micro-batch")
    ax.axhline(before.mean(), color="gray", linewidth=0.8, linestyle="--", label="mean load of a rank")
    _rank_axis(ax, ranks.size)
    ax.set_ylabel("tokens per micro-batch\n(token, expert pairs)")
    ax.set_title(f"{title}: {len(records)} micro-batches (layer calls)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: the bars stay clear
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig


def plot_replay(result: dict, path, title: str) -> Figure:
    """Three panels of a ``bench plan`` replay (:func:`ultraep.bench.plan.replay`'s result):
    per-rank loads of each policy in the worst cell before balancing; the imbalance of every
    policy over steps; and a close-up of ultraep, its imbalance and its max rank load over
    each cell's lower bound, marked by how that bound was obtained."""
    plt = _pyplot()
    before = result["before"]
    s, l = np.unravel_index(np.argmax(before), before.shape)  # the worst cell without balancing
    ranks = result["rank_load"]["none"].shape[-1]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(max(8, ranks * 0.45), 11))
    width = 0.8 / 3
    x = np.arange(ranks)
    for i, name in enumerate(("none", "ultraep", "eplb")):
        top.bar(x + (i - 1) * width, result["rank_load"][name][s, l], width, label=name, color=f"C{i}")
    kind = result["bound_kind"][s, l]
    # The bound often equals the mean: a wide pale band under a thin dashed line keeps both visible.
    top.axhline(result["bound_value"][s, l], color="tab:red", lw=5, alpha=0.35,
                label=f"lower bound of the max ({kind}): {result['bound_value'][s, l]}")
    top.axhline(result["rank_load"]["ideal"][s, l].mean(), color="k", ls="--", lw=1,
                label=f"ideal (mean): {result['rank_load']['ideal'][s, l].mean():.0f}")
    _rank_axis(top, ranks)
    top.set_ylim(0, 1.3 * max(int(result["rank_load"][name][s, l].max()) for name in ("none", "eplb")))
    top.set(ylabel="tokens", title=f"per-rank load, step {s} layer {l} (worst before balancing)")
    top.legend(fontsize=8, loc="upper center", ncol=3)  # in the headroom above the bars

    steps = np.arange(before.shape[0])
    worst = {name: result["cell"]["imbalance"][name].max(axis=1) for name in ("ultraep", "eplb")}
    middle.plot(steps, before.max(axis=1), label="none (before)", color="C0", marker=".")
    for i, name in enumerate(("ultraep", "eplb"), start=1):
        middle.plot(steps, worst[name], label=name, color=f"C{i}", marker=".")
    middle.axhline(1.0, color="k", ls="--", lw=1, label="ideal")
    _ratio_axis(middle, np.concatenate([before.max(axis=1), worst["eplb"], worst["ultraep"]]), decimals=2)
    middle.set(xlabel="step", ylabel="rank max/mean\n(worst layer)", title="imbalance over steps")
    middle.legend(fontsize=8)

    gap = result["cell"]["gap"]["ultraep"]
    bottom.plot(steps, worst["ultraep"], color="C1", label="ultraep rank max/mean (worst layer)")
    kinds = result["bound_kind"]
    for name, marker in BOUND_MARKERS.items():
        where = kinds == name
        if where.any():
            cell_steps = np.broadcast_to(steps[:, None], gap.shape)[where]
            bottom.plot(cell_steps, 1.0 + gap[where], linestyle="none", marker=marker, color="tab:red",
                        fillstyle="none", label=f"max load / lower bound, {name} bound ({int(where.sum())} cells)")
    _ratio_axis(bottom, np.concatenate([worst["ultraep"], 1.0 + gap.ravel()]), decimals=3)
    bottom.set(xlabel="step", ylabel="ratio", title="ultraep close up: imbalance and distance to the lower bound")
    bottom.legend(fontsize=8)
    for ax in (middle, bottom):
        ax.set_xticks(steps if steps.size <= 20 else steps[::max(1, steps.size // 10)])
        ax.set_xlim(-0.5, steps.size - 0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
