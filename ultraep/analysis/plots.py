"""Plots (matplotlib, imported on the first plot; written to files, no display needed)."""

from __future__ import annotations

import numpy as np

from ultraep.planner.plan import imbalance


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def plot_rank_loads(records, path, *, title: str = "per-rank load") -> None:
    """Bar chart of each rank's load without and with balancing, summed over ``records``."""
    if not records:
        raise ValueError("plot_rank_loads: no records to plot")
    plt = _pyplot()
    before = np.sum([r.rank_load_before for r in records], axis=0)
    after = np.sum([r.rank_load_after for r in records], axis=0)
    ranks = np.arange(before.size)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * ranks.size + 2), 3.2))
    ax.bar(ranks - 0.2, before, width=0.4, label=f"unbalanced (max/mean {imbalance(before):.3f})")
    ax.bar(ranks + 0.2, after, width=0.4, label=f"balanced (max/mean {imbalance(after):.3f})")
    ax.axhline(before.mean(), color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlabel("rank")
    ax.set_ylabel("tokens (token, expert pairs)")
    ax.set_title(f"{title}, {len(records)} layer micro-batches")
    ax.set_xticks(ranks)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_replay(result: dict, path, title: str) -> None:
    """Two panels of a ``bench plan`` replay (:func:`ultraep.bench.plan.replay`'s result): per-rank
    loads of each policy in the worst cell before balancing, and the imbalance over steps."""
    plt = _pyplot()
    before = result["before"]
    s, l = np.unravel_index(np.argmax(before), before.shape)  # the worst cell without balancing
    ranks = result["rank_load"]["none"].shape[-1]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, ranks * 0.45), 8))
    width = 0.8 / 3
    x = np.arange(ranks)
    for i, name in enumerate(("none", "ultraep", "eplb")):
        top.bar(x + (i - 1) * width, result["rank_load"][name][s, l], width, label=name)
    top.axhline(result["rank_load"]["ideal"][s, l].mean(), color="k", ls="--", lw=1, label="ideal (mean)")
    top.axhline(result["bound_value"][s, l], color="r", ls=":", lw=1, label="lower bound of max")
    top.set(xlabel="rank", ylabel="tokens", title=f"per-rank load, step {s} layer {l} (worst before balancing)")
    top.legend(fontsize=8)
    steps = np.arange(before.shape[0])
    bottom.plot(steps, before.max(axis=1), label="before (none)", color="C0")
    for i, name in enumerate(("ultraep", "eplb"), start=1):
        bottom.plot(steps, result["cell"]["imbalance"][name].max(axis=1), label=name, color=f"C{i}")
    bottom.set(xlabel="step", ylabel="rank max/mean (worst layer)", title="imbalance over steps", yscale="log")
    bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
