"""``python -m ultraep.bench moe-fused``: the fused MoE forward (UniEP's dispatch + up-GEMM
and down-GEMM + combine persistent kernels, ``MoELayer(fused=True)``) against the
sequential path (``Dispatcher.dispatch`` -> grouped GEMM -> SwiGLU -> grouped GEMM ->
``combine``, ``MoELayer(fused=False)``) in the same run, over tokens per rank and hidden
sizes.

Every rank holds ``experts_per_rank`` BF16 SwiGLU experts; routing is uniform top-k
(distinct experts per token), gates random; no balancing. Per (tokens, hidden): both
layers are built, a checked forward each (also the warm-up), ``--repeats`` timed forwards
each as group windows (first rank's start to last rank's end, a barrier before each), a
second checked fused forward (and, with ``--timeline``, a recorded one); the two layers'
phases take turns at running first (a phase's time can depend by up to ~10 % on what ran
before it). The timed forwards
are inference's (``backward=False``: the fused layer keeps nothing for a backward). ``out_diff``:
elements of the fused output whose bits differ from the sequential output's (must be 0);
``rerun_diff``: between the two checked fused forwards (must be 0). ``speedup`` =
sequential ms / fused ms. ``gemm_bound`` = sequential ms / the sequential forward's two grouped
GEMMs alone (``MoELayer.record_phases`` over ``--repeats`` more inference forwards: up + down,
the median, the slowest rank's; ``fwd_gemm_ms`` in the JSON): what a fused forward would gain
if it hid everything but those GEMMs under them -- the ceiling of ``speedup`` with GEMMs as
fast as the sequential path's.

``--backward``: the checked passes become forward + backward from zeroed weight gradients
(``dy`` random), and each repeat also times, per layer, ``zero_grads`` (untimed, a phase of
its own), then a training forward and its backward, each a window of its own:
``seq_train_ms`` / ``fused_train_ms`` (the forward keeping what its backward needs),
``seq_bwd_ms`` / ``fused_bwd_ms``, their ratios ``train_speedup`` and ``bwd_speedup``, and
``step_speedup``, the ratio of the sums (a training step); ``wgrad_ms``, the weight
gradients alone (the two grouped wgrads and the gradient adds both paths end with, on one
dispatch's rows), and ``bwd_rest_speedup``, the backward's ratio without them: what the
fused kernels C and D make of the part they replace; ``bwd_gemm_bound``, ``seq_bwd_ms`` over
the sequential backward's dgrads and wgrads alone (``bwd_gemm_ms``), the same ceiling for
``bwd_speedup``. Bitwise, fused against
sequential, elements whose bits differ summed over ranks (each must be 0): ``dx_diff``,
``dgates_diff``, ``grad_up_diff``, ``grad_down_diff`` (the weight gradients of one backward);
``bwd_rerun_diff``: all four between the two checked fused passes. The comparison is per
layer as a framework calls it: a training forward of either layer keeps ``h``, ``act`` and
``y`` for its backward (the fused up tiles write ``h`` beside ``act``; ``y`` is copied out of
the heap, whose ``expert_out`` the next call reuses).

``--config``: the fused layer's configuration (``MoELayer(fused_config=)``): ``default``,
the layer's own (tuned on the GPU, the constants on the host); ``constants``, the kernel
source's (every SM, its task sizes); ``tuned``, the model's choice for the setting's token
bucket (``ultraep.tune.search``, from the machine profile, measured once and cached; the
constants where the model predicts no gain beyond its error); ``both``, the constants'
columns and the tuned layer's beside them in the same run: ``tuned_ms``, ``tuned_gain`` =
fused_ms / tuned_ms (expected at least 1: tuned at least as fast as the constants) and
``tuned_config``. Each fused layer's output and rerun count in ``out_diff`` /
``rerun_diff``. With ``--backward`` both layers' training passes are timed too, the two
layers again taking turns at running first: ``tuned_train_ms``, ``tuned_bwd_ms`` and
``tuned_bwd_gain`` = fused_bwd_ms / tuned_bwd_ms (the backward runs on the forward's CTAs);
each fused layer's gradients count in the backward's diffs. The timeline is the first
layer's.

``--send-shares SHARE ...``: beside the ``--config`` layer, one fused layer per share of its
CTAs that sends first (its configuration with ``FusedConfig.send_ctas`` =
:func:`~ultraep.compute.fused.config.share_of_ctas`; 0: every CTA adaptive), timed in the
same repeats, each taking turns at running first with the ``--config`` layer:
``send{SHARE}_ms`` and ``send{SHARE}_gain`` = fused_ms / send{SHARE}_ms (above 1: that share
is faster than the configuration's own); with ``--backward`` its training passes too
(``send{SHARE}_bwd_ms``, ``send{SHARE}_bwd_gain``: kernel C sends alike), with ``--overlap``
its kernel A (``send{SHARE}_a_ms``, as ``fused_a_ms``). Its bits count in every diff.

``--timeline FILE.png``: per setting, every rank's recorded fused forward, a panel per rank
on one time axis, one line per SM (a worker on the host), coloured by task kind (send,
relay, up tile, down tile, reduce): where communication hides under the GEMMs and which
rank holds the others up. Below the table, each rank's phases: when its first task of a
kind started and its last ended, in ms from the first task on any rank (``%globaltimer``:
one clock for ranks sharing a GPU), and in brackets the median task of that kind in µs;
first, for the forward, the ms from the rank's call to its first task (the device's clock as
the stream reached the call: its host path, token map and count exchange).
With ``--backward`` also a recorded training forward (it keeps ``h`` and ``y`` for the
backward; FILE_train_t{tokens}_h{hidden}.png) and its backward, its own file
(FILE_bwd_t{tokens}_h{hidden}.png) and phases: send (dy), relay (grad_y rows and gate
gradients), dgrad-down tile (SwiGLU's backward in its epilogue), dgrad-up tile, reduce (dx).
A task's span starts before its waits, so a relay's or reduce's includes waiting for its
rows. Needs matplotlib (``ultraep[analysis]``).

The issue's setting: 4 ranks under ``--emulate-ep`` (MPS, an SM share each, so each rank
behaves like a small GPU), tokens 4096-32768, hidden 4096 and 7168, top-8. Ranks sharing
a GPU without it run time-sliced (the title says "not a figure of merit", as on the host
backend). Started with one process, it relaunches itself on ``--ranks`` ranks under
``mpiexec``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys

import numpy as np

from ultraep.bench.moe_layer import differing, phase_windows_ms
from ultraep.bench.timing import CallStart, array_backend
from ultraep.runtime.launch import (DefaultsHelpFormatter, add_launch_options, job_ranks, multi_rank_main,
                                   non_negative_int, positive_int, row_width, share)

COLUMNS = ["tokens", "hidden", "ffn", "seq_ms", "fused_ms", "speedup", "gemm_bound", "out_diff", "rerun_diff"]
CONFIGS = ("constants", "tuned")  # --config both: each, the constants first
TUNED = {"tuned": ["tuned_config"], "both": ["tuned_ms", "tuned_gain", "tuned_config"]}
TUNED_BACKWARD = ["tuned_train_ms", "tuned_bwd_ms", "tuned_bwd_gain"]  # --backward --config both
BACKWARD_TIMES = ["seq_train_ms", "seq_bwd_ms", "fused_train_ms", "fused_bwd_ms", "train_speedup", "bwd_speedup",
                  "step_speedup", "wgrad_ms", "bwd_rest_speedup", "bwd_gemm_bound"]
BACKWARD_DIFFS = ["dx_diff", "dgates_diff", "grad_up_diff", "grad_down_diff", "bwd_rerun_diff"]
OVERLAP = ["dispatch_ms", "up_gemm_ms", "fused_a_ms", "a_vs_max"]
FORWARD_GEMMS = ("up", "down")  # MoELayer.record_phases' steps of the sequential path
BACKWARD_GEMMS = ("dgrad_down", "dgrad_up", "wgrad_down", "wgrad_up")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench moe-fused", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_launch_options(parser, backend_help="device: the CUDA kernels; host: the NumPy task semantics; auto: the GPU "
                                            "if any")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768],
                        help="tokens per rank (one row each)")
    parser.add_argument("--hidden", type=row_width, nargs="+", default=[4096, 7168], help="model widths (one row each)")
    parser.add_argument("--ffn", type=row_width, default=2048, help="expert FFN width (w_up is [hidden, 2 x ffn])")
    parser.add_argument("--experts-per-rank", type=positive_int, default=8, help="experts per rank")
    parser.add_argument("--top-k", type=positive_int, default=8, help="experts per token")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed forwards per path (and forward + backward passes with --backward)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the routing, weights and inputs")
    parser.add_argument("--backward", action="store_true",
                        help="also time a training forward and its backward (seq_train_ms, seq_bwd_ms, ...), and check "
                             "the backward")
    parser.add_argument("--config", choices=["default", "constants", "tuned", "both"], default="default",
                        help="the fused layer's configuration: the layer's default (tuned on the GPU, the constants "
                             "on the host), the kernel source's constants, the tuned schedule, or the constants and "
                             "the tuned schedule side by side (tuned_ms, tuned_gain = fused_ms / tuned_ms)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time the sequential dispatch alone and its up-projection GEMM alone, and the "
                             f"fused kernel A (dispatch + up), the median of {KERNEL_A_FORWARDS} recorded forwards: "
                             "a_vs_max = fused_a_ms / max(dispatch_ms, up_gemm_ms), 1.0 when the exchange hides "
                             "wholly under the GEMM "
                             "(fused_a_ms: the kernel's own task stamps; the other two: group windows of calls)")
    parser.add_argument("--send-shares", type=share, nargs="+", default=[], metavar="SHARE",
                        help="also a fused layer per share of the --config layer's CTAs sending first "
                             "(FusedConfig.send_ctas; 0: every CTA adaptive), timed beside it: send{SHARE}_ms, "
                             "send{SHARE}_gain = fused_ms / send{SHARE}_ms")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--timeline", metavar="FILE.png",
                        help="plot every rank's fused tasks per SM over time, a file per setting "
                             "(FILE_t{tokens}_h{hidden}.png; with --backward also the training forward's and the "
                             "backward's, FILE_train_t... and FILE_bwd_t...), and print each rank's phases")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    args.send_shares = list(dict.fromkeys(args.send_shares))  # a share named twice is one layer and its columns
    if args.top_k > args.experts_per_rank * (ranks := job_ranks(args)):
        parser.error(f"--top-k {args.top_k} exceeds the experts ({args.experts_per_rank} per rank x {ranks} "
                     "ranks): a token's experts are distinct")
    return args


def share_name(share: float) -> str:
    """``--send-shares``' layer and column stem of one share: ``send0.25``."""
    return f"send{share:g}"


def share_columns(shares, backward: bool, overlap: bool) -> list[str]:
    """``--send-shares``' columns, share by share."""
    return [f"{share_name(s)}{suffix}" for s in shares
            for suffix in ["_ms", "_gain"] + (["_bwd_ms", "_bwd_gain"] if backward else []) + (["_a_ms"] if overlap
                                                                                                else [])]


def columns(backward: bool, config: str = "default", overlap: bool = False, shares=()) -> list[str]:
    """The table's columns: the tuned layer's, the backward's, the overlap's and the send
    shares' times after the forward's, the diffs last."""
    times = COLUMNS.index("out_diff")
    return (COLUMNS[:times] + TUNED.get(config, []) + (BACKWARD_TIMES if backward else [])
            + (TUNED_BACKWARD if backward and config == "both" else [])
            + (OVERLAP if overlap else []) + share_columns(shares, backward, overlap) + COLUMNS[times:]
            + (BACKWARD_DIFFS if backward else []))


def recorded_forward(group, moe, x, ids, gates, start: CallStart, synchronize) -> tuple[list, list]:
    """Every rank's tasks of one recorded inference forward of the fused layer ``moe``, and
    every rank's clock as its call began (``start``), every rank's device idle and the ranks
    leaving an aligned barrier together before (a rank that came late would count in the
    others' lead; collective)."""
    moe.record_timeline(True)
    synchronize()
    group.barrier(what="recorded fused forward: every rank before its call", aligned=True)
    start.stamp()
    moe.forward(x, ids, gates, backward=False)
    tasks = group.allgather(moe.timeline())
    moe.record_timeline(False)
    return tasks, group.allgather(start.ns())


KERNEL_A_FORWARDS = 5  # recorded forwards whose kernel A --overlap takes the median of: one drifts with the GPU


def median_kernel_a_ms(record, recorded=()) -> float:
    """:func:`kernel_a_ms`'s median over :data:`KERNEL_A_FORWARDS` recorded forwards: those
    ``recorded`` already, then as many more from ``record()`` (collective)."""
    runs = list(recorded) + [record() for _ in range(KERNEL_A_FORWARDS - len(recorded))]
    return float(np.median([kernel_a_ms(tasks) for tasks in runs]))


def kernel_a_ms(ranks_tasks) -> float:
    """Kernel A's time in a recorded fused forward: from the first task on any rank to the
    last up tile's end on any rank (the send and relay tasks come first in every rank's
    claim order), in ms."""
    start = min(s for tasks in ranks_tasks for _, s, _, _ in tasks)
    return (max(e for tasks in ranks_tasks for kind, _, e, _ in tasks if kind == "up") - start) / 1e6


def sequential_gemm_ms(group, layer, x, ids, gates, dy, repeats: int) -> tuple[float, float | None]:
    """The sequential layer's grouped GEMMs alone, in ms: the forward's (up, down) over
    ``repeats`` inference forwards and, given ``dy``, the backward's dgrads and wgrads over as
    many training steps; each step's from ``MoELayer.record_phases``, the median over the
    calls, the slowest rank's."""
    layer.record_phases(True)
    try:
        for _ in range(repeats):
            layer.forward(x, ids, gates, backward=False)
        forward, backward = layer.phases("forward"), []
        if dy is not None:
            for _ in range(repeats):
                _, ctx = layer.forward(x, ids, gates)
                layer.backward(ctx, dy)
            backward = layer.phases("backward")
    finally:
        layer.record_phases(False)

    def gemms(calls, steps):
        return float(np.median([sum(call[step] for step in steps) for call in calls]))

    mine = (gemms(forward, FORWARD_GEMMS), gemms(backward, BACKWARD_GEMMS) if dy is not None else None)
    everyone = group.allgather(mine, what="moe-fused: the sequential path's GEMM times")
    return max(m[0] for m in everyone), None if dy is None else max(m[1] for m in everyone)


def weight_grads_alone(layer, x, ids, gates, bf16, rng):
    """A timed phase: the weight gradients of one backward as ``MoELayer.backward`` computes
    them after either path's exchange and dgrads (the same two grouped wgrads, adding into
    the layer's gradients), alone, on one dispatch's rows with random ``grad_y`` and ``dh``."""
    received = layer.dispatcher.dispatch(x, ids, gates)
    rows = received.x.shape[0]
    act, dh = bf16(rng.standard_normal((rows, layer.ffn))), bf16(rng.standard_normal((rows, 2 * layer.ffn)))
    grad_y, scratch = bf16(rng.standard_normal((rows, layer.hidden))), layer._wgrad_scratch()
    return lambda _: layer._weight_grads(act, grad_y, received.x, dh, received.offsets, scratch)


def fused_configs(config: str) -> dict:
    """``--config``'s fused layers: name -> ``MoELayer``'s ``fused_config``; ``default`` is
    the layer's own (None)."""
    names = CONFIGS if config == "both" else (config,)
    return {name: None if name == "default" else name for name in names}


DIRECTION_TAGS = {"forward": "", "training": "_train", "backward": "_bwd"}


def timeline_path(path: str, tokens: int, hidden: int, direction: str = "forward") -> str:
    """A setting's plot file: the (inference) forward's FILE_t{tokens}_h{hidden}.png, the
    training forward's FILE_train_t..., the backward's FILE_bwd_t..."""
    tag = f"{DIRECTION_TAGS[direction]}_t{tokens}_h{hidden}"
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}{tag}.{suffix}" if dot else f"{path}{tag}"


# Both directions' kinds in claim order (the phases print so): the backward's dgrad tiles in
# place of up and down, its send, relay and reduce the forward's colours.
KIND_COLOURS = {"send": "tab:blue", "relay": "tab:cyan", "up": "tab:orange", "dgrad_down": "tab:purple",
                "down": "tab:red", "dgrad_up": "tab:brown", "reduce": "tab:green"}


def phase_spans(ranks_tasks, called=None) -> list[dict]:
    """Per rank: ``workers`` (the SMs its tasks ran on) and per task kind present ``(first
    start, last end, median task)``: the span in ms from the first task on any rank, and the
    median of the kind's task durations in µs (what one tile or one chunk costs). ``ranks_tasks[r]``:
    rank r's (kind, start ns, end ns, worker) rows. Given ``called[r]``, rank r's clock (ns)
    as its call began: ``lead``, the ms from there to its first task (the call's host path,
    the token map and the count exchange)."""
    t0 = min((start for tasks in ranks_tasks for _, start, _, _ in tasks), default=0)
    spans = []
    for r, tasks in enumerate(ranks_tasks):
        mine = {"workers": len({worker for *_, worker in tasks})}
        if called is not None and tasks:
            mine["lead"] = (min(start for _, start, _, _ in tasks) - called[r]) / 1e6
        for kind in KIND_COLOURS:
            rows = [(s, e) for k, s, e, _ in tasks if k == kind]
            if rows:
                mine[kind] = ((min(s for s, _ in rows) - t0) / 1e6, (max(e for _, e in rows) - t0) / 1e6,
                              float(np.median([e - s for s, e in rows])) / 1e3)
        spans.append(mine)
    return spans


def format_phases(spans: list[dict]) -> str:
    return "\n".join(f"rank {r} ({mine['workers']} SMs): " + "  ".join(
        ([f"call to first task {mine['lead']:.2f} ms"] if "lead" in mine else [])
        + [f"{kind} {mine[kind][0]:.2f}-{mine[kind][1]:.2f} ({mine[kind][2]:.0f} µs)" for kind in KIND_COLOURS
           if kind in mine])
        for r, mine in enumerate(spans))


def plot_timeline(ranks_tasks, path: str, title: str) -> None:
    """``ranks_tasks[r]``: rank r's (kind, start ns, end ns, worker) rows; a panel per rank,
    one horizontal line per worker, one time axis."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("--timeline needs matplotlib: pip install ultraep[analysis]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    t0 = min((start for tasks in ranks_tasks for _, start, _, _ in tasks), default=0)
    t1 = max((end for tasks in ranks_tasks for _, _, end, _ in tasks), default=t0)
    heights = [max(1, len({worker for *_, worker in tasks})) for tasks in ranks_tasks]
    height = 1.5 + sum(max(1.2, 0.05 * h) for h in heights)  # inches
    fig, axes = plt.subplots(len(ranks_tasks), 1, sharex=True, squeeze=False, figsize=(12, height),
                             gridspec_kw={"height_ratios": [max(1.2, 0.05 * h) for h in heights]})
    for r, (tasks, ax) in enumerate(zip(ranks_tasks, axes[:, 0])):
        row = {worker: i for i, worker in enumerate(sorted({worker for *_, worker in tasks}))}
        for kind, colour in KIND_COLOURS.items():
            # One collection of rectangles per kind: a bar per task would take minutes at
            # tens of thousands of tasks, while the other ranks wait in a collective.
            boxes = [((s - t0) / 1e6, (e - t0) / 1e6, row[w]) for k, s, e, w in tasks if k == kind]  # ms
            if boxes:
                ax.add_collection(PolyCollection([((x0, y - 0.4), (x0, y + 0.4), (x1, y + 0.4), (x1, y - 0.4))
                                                  for x0, x1, y in boxes], facecolors=colour, edgecolors="none",
                                                 label=kind if r == 0 else None))
        ax.set_ylim(-0.5, len(row) - 0.5)
        ax.set_ylabel(f"rank {r}\nSM", fontsize=8)
        ax.set_yticks([])
    axes[-1, 0].set_xlim(0, max(t1 - t0, 1) / 1e6)  # the panels share the axis
    axes[-1, 0].ticklabel_format(axis="x", useOffset=False)
    axes[-1, 0].set_xlabel("ms since the first task on any rank")
    fig.suptitle(title, fontsize=9)
    fig.legend(loc="lower center", fontsize=8, ncol=len(KIND_COLOURS), frameon=False)  # below, clear of the title
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "moe-fused"])


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.bench.memory import GIB, SweepMemory, skip_row
    from ultraep.bench.report import Progress, RowStream, host_size_note, write_json
    from ultraep.compute.fused.config import share_of_ctas
    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.dtypes import BFLOAT16
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label

    group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
    R, me, K, F = group.size, group.rank, args.top_k, args.ffn
    if K > R * args.experts_per_rank:
        raise SystemExit(f"--top-k {K} exceeds the {R * args.experts_per_rank} experts of {R} ranks")
    backend, xp, synchronize, to_host = array_backend(group, args.backend)
    gpu = backend == "device"
    M = args.experts_per_rank
    E = R * M

    def bf16(values):  # crosses to the GPU as its bits
        return xp.asarray(values.astype(np.float32).astype(BFLOAT16).view(np.int16)).view(BFLOAT16)

    caveat = sharing_label(group)
    direction = "forward, and forward + backward" if args.backward else "forward"
    title = (f"fused vs sequential MoE {direction}: {R} ranks ({caveat}), {E} experts, top-{K}, ffn {F}, uniform "
             "routing, BF16 SwiGLU experts; speedup = seq_ms / fused_ms; gemm_bound = seq_ms / the sequential "
             "forward's two GEMMs alone (its recorded steps, the slowest rank's): the most a fused forward gains "
             "by hiding all else; out_diff: fused output elements whose bits differ from the sequential path's; "
             "rerun_diff: between two fused forwards")
    if args.backward:
        title += ("; *_train_ms: a training forward (keeping what its backward needs), *_bwd_ms: its backward, "
                  "step_speedup: of the two together; "
                  "dx/dgates/grad_up/grad_down_diff: elements whose bits differ from the sequential backward's; "
                  "bwd_rerun_diff: between two fused backwards; wgrad_ms: the weight gradients alone (both "
                  "paths' last part, the same kernels), bwd_rest_speedup: the backward without them, "
                  "(seq_bwd_ms - wgrad_ms) / (fused_bwd_ms - wgrad_ms), bwd_gemm_bound: seq_bwd_ms / the sequential "
                  "backward's dgrads and wgrads alone")
    diff_columns = ["out_diff", "rerun_diff"] + (BACKWARD_DIFFS if args.backward else [])
    configs = fused_configs(args.config)
    if args.config != "default":
        title += f"; MoELayer(fused_config={args.config!r})" if args.config != "both" else (
            "; fused_config='constants', tuned: 'tuned', tuned_gain = fused_ms / tuned_ms"
            + (", tuned_bwd_gain = fused_bwd_ms / tuned_bwd_ms" if args.backward else ""))
    progress = Progress("moe-fused", enabled=me == 0, quiet=args.quiet)
    host_size_note(progress, not group.has_gpu, max(args.tokens))
    if args.overlap:
        title += ("; dispatch_ms, up_gemm_ms: the sequential path's Dispatcher.dispatch alone and its "
                  "up-projection grouped GEMM (BF16 out) alone; fused_a_ms: kernel A (dispatch + up tiles with "
                  "SwiGLU) in a recorded fused forward, first task to last up tile on any rank, the median of "
                  f"{KERNEL_A_FORWARDS} forwards; a_vs_max = "
                  "fused_a_ms / max(dispatch_ms, up_gemm_ms)")
    if args.send_shares:
        title += ("; send{SHARE}: the first fused layer with that share of its CTAs sending first "
                  "(FusedConfig.send_ctas), send{SHARE}_gain = fused_ms / send{SHARE}_ms"
                  + (", send{SHARE}_bwd_gain = fused_bwd_ms / send{SHARE}_bwd_ms" if args.backward else "")
                  + (", send{SHARE}_a_ms: its kernel A" if args.overlap else ""))
    shares = {share_name(s): s for s in args.send_shares}
    table = RowStream(columns(args.backward, args.config, args.overlap, args.send_shares), title, enabled=me == 0)
    memory = SweepMemory(group)

    def measure_row(T: int, H: int) -> tuple:
        """Set up, check and time one row's layers; what the row's figures come from. Its
        buffers die with its frame, so the pool can give them back before the next row."""
        rng = np.random.default_rng((args.seed, me, T, H))
        w_up = bf16(rng.standard_normal((M, H, 2 * F)) / np.sqrt(H))
        w_down = bf16(rng.standard_normal((M, F, H)) / np.sqrt(F))
        x = bf16(rng.standard_normal((T, H)))
        ids = xp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64))
        gates = xp.asarray(rng.random((T, K)).astype(np.float32))
        dy = bf16(rng.standard_normal((T, H))) if args.backward else None
        # Receive bound: uniform routing's mean with room for its spread (a few standard
        # deviations are well under 10 % of it); the largest setting runs 4 ranks on one GPU.
        bound = int(1.1 * T * K) + 1024
        layers = {}

        def checked(moe):
            """Host copies of one forward's output and, with --backward, of one backward's
            dx, d_gates and weight gradients from zero."""
            if args.backward:
                moe.zero_grads()
            out, ctx = moe.forward(x, ids, gates)
            results = [to_host(out).copy()]
            if args.backward:
                results += [to_host(a).copy() for a in (*moe.backward(ctx, dy), moe.grad_up, moe.grad_down)]
            moe.check()
            return results

        try:
            layers[False] = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                                     max_recv_rows=bound, backend=backend, sync_checks=False)
            for name, config in configs.items():  # the fused layers by --config, the first one's backward
                layers[name] = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                                        max_recv_rows=bound, backend=backend, sync_checks=False, fused=True,
                                        fused_config=config)
            primary = next(iter(configs))
            fused = layers[primary]
            base = fused._fused.schedule.for_tokens(T)
            for name, s in shares.items():  # the first layer's configuration but its senders
                layers[name] = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                                        max_recv_rows=bound, backend=backend, sync_checks=False, fused=True,
                                        fused_config=dataclasses.replace(base, send_ctas=int(share_of_ctas(
                                            base.ctas, s))))
            fused_names = [*configs, *shares]
            for moe in layers.values():
                moe.load_weights(w_up, w_down)
            first = {key: checked(moe) for key, moe in layers.items()}  # also the warm-up
            timed = [lambda _, moe=moe: moe.forward(x, ids, gates, backward=False) for moe in layers.values()]
            if args.backward:  # zero_grads in a phase of its own; the forward hands its context on
                for moe in layers.values():
                    timed += [lambda _, moe=moe: moe.zero_grads(),
                               lambda _, moe=moe: moe.forward(x, ids, gates)[1],
                               lambda ctx, moe=moe: moe.backward(ctx, dy)]
                timed.append(weight_grads_alone(layers[False], x, ids, gates, bf16, rng))
            overlap_at = len(timed)
            if args.overlap:  # the sequential path's two parts that kernel A fuses, each alone (GEMM: BF16 out)
                from ultraep.compute import grouped_mm

                sequential = layers[False]
                received = sequential.dispatcher.dispatch(x, ids, gates)
                up_out = grouped_mm(received.x, sequential._w_up, received.offsets)  # reused: no zero fill timed
                timed += [lambda _: sequential.dispatcher.dispatch(x, ids, gates),
                           lambda _: grouped_mm(received.x, sequential._w_up, received.offsets, out=up_out)]
            # The sequential and the (first) fused layer take turns at running first, in each
            # direction, and so do the constants and the tuned layer: a phase runs up to ~10 %
            # slower after some phases than after others (after the weight gradients alone,
            # e.g., even with the GPU idle in between), which no layer must always pay.
            blocks = len(layers)  # the training blocks' first phase: (zero_grads, forward, backward) a layer
            alternate = [(0, 1)] + ([(blocks + i, blocks + 3 + i) for i in range(3)] if args.backward else [])
            for other in range(2, len(layers)):  # the tuned layer and the shares' against the first
                alternate += [(1, other)] + ([(blocks + 3 + i, blocks + 3 * other + i) for i in range(3)]
                                             if args.backward else [])
            windows = phase_windows_ms(group, timed, args.repeats, synchronize, alternate=alternate)
            again = {name: checked(layers[name]) for name in fused_names}
            layers[False].check()
            gemm_ms = sequential_gemm_ms(group, layers[False], x, ids, gates, dy, args.repeats)
            tuned = str(layers["tuned"]._fused.schedule.for_tokens(T)) if "tuned" in layers else None
            phases, recorded, called = {}, {}, {}
            start = CallStart(gpu) if args.timeline or args.overlap else None  # the recorded forwards' clock
            if args.timeline or args.overlap:
                recorded["forward"], called["forward"] = recorded_forward(group, fused, x, ids, gates, start,
                                                                            synchronize)
            kernel_a = {}
            if args.overlap:  # each layer's over a few forwards (the first layer's recorded above among them)
                kernel_a = {name: median_kernel_a_ms(
                    lambda moe=layers[name]: recorded_forward(group, moe, x, ids, gates, start, synchronize)[0],
                    [recorded["forward"]] if name == primary else []) for name in (primary, *shares)}
            if args.timeline and args.backward:  # a training forward (it keeps h and y), then its backward
                fused.record_timeline(True)
                _, ctx = fused.forward(x, ids, gates)
                recorded["training"] = group.allgather(fused.timeline())
                fused.backward(ctx, dy)
                recorded["backward"] = group.allgather(fused.timeline("backward"))
                fused.check()
                fused.record_timeline(False)
            if args.timeline:
                for which, everyone_tasks in recorded.items():
                    phases[which] = phase_spans(everyone_tasks, called.get(which))  # printed under the table
                    progress(f"tokens {T}, hidden {H}: the fused {which}'s timeline, "
                             f"{timeline_path(args.timeline, T, H, which)}")
                    if me == 0:
                        plot_timeline(everyone_tasks, timeline_path(args.timeline, T, H, which),
                                      f"{R} ranks ({caveat}): fused {which}, {T} tokens, hidden {H}, ffn {F}, "
                                      f"top-{K}")
            want = first[False]
            mine = [sum(differing(first[name][:1], want[:1]) for name in fused_names),
                    sum(differing(again[name][:1], first[name][:1]) for name in fused_names)]
            if args.backward:  # dx, d_gates, grad_up, grad_down each, then all four rerun, over the fused layers
                mine += [sum(differing([first[name][i]], [want[i]]) for name in fused_names) for i in range(1, 5)]
                mine.append(sum(differing(again[name][1:], first[name][1:]) for name in fused_names))
            used = memory.end()
            if used is not None:
                progress(f"tokens {T}, hidden {H}: {used / GIB:.1f} GiB of GPU memory on the ranks' device")
        finally:
            for moe in layers.values():
                moe.close()
        return windows, mine, tuned, blocks, overlap_at, recorded, phases, gemm_ms, kernel_a

    rows, skipped = [], []
    for H in args.hidden:
        for T in args.tokens:
            too_big = memory.fits(T * H)
            if too_big:
                skip_row({"tokens": T, "hidden": H}, too_big, progress, table, skipped)
                continue
            memory.begin(T * H)
            progress(f"tokens {T}, hidden {H}: setting up, a checked {direction} each, {args.repeats} timed each, "
                     f"a checked fused {direction}")
            (windows, mine, tuned, blocks, overlap_at, recorded, phases, (fwd_gemm, bwd_gemm),
             kernel_a) = measure_row(T, H)
            if gpu:  # the next setting's buffers differ in shape: give this one's back to the driver
                gc.collect()  # what of the row only a reference cycle still holds
                xp.get_default_memory_pool().free_all_blocks()
            everyone = group.allgather(mine)
            seq_ms, fused_ms = windows[:2]
            row = {"tokens": T, "hidden": H, "ffn": F, "seq_ms": seq_ms, "fused_ms": fused_ms,
                   "speedup": seq_ms / fused_ms, "fwd_gemm_ms": fwd_gemm, "gemm_bound": seq_ms / fwd_gemm}
            if args.config == "both":
                row.update(tuned_ms=windows[2], tuned_gain=fused_ms / windows[2])
            if tuned is not None:
                row["tuned_config"] = tuned
            if args.backward:  # per layer (zero_grads, training forward, backward), then the weight gradients alone
                (_, seq_train, seq_bwd, _, fused_train, fused_bwd, *more), wgrad = (windows[blocks:overlap_at - 1],
                                                                                   windows[overlap_at - 1])
                tuned_passes = more[:3] if args.config == "both" else []
                row.update(seq_train_ms=seq_train, seq_bwd_ms=seq_bwd, fused_train_ms=fused_train,
                           fused_bwd_ms=fused_bwd, train_speedup=seq_train / fused_train,
                           bwd_speedup=seq_bwd / fused_bwd,
                           step_speedup=(seq_train + seq_bwd) / (fused_train + fused_bwd), wgrad_ms=wgrad,
                           bwd_rest_speedup=(seq_bwd - wgrad) / (fused_bwd - wgrad), bwd_gemm_ms=bwd_gemm,
                           bwd_gemm_bound=seq_bwd / bwd_gemm)
                if tuned_passes:
                    _, tuned_train, tuned_bwd = tuned_passes
                    row.update(tuned_train_ms=tuned_train, tuned_bwd_ms=tuned_bwd, tuned_bwd_gain=fused_bwd / tuned_bwd)
            if args.overlap:
                dispatch_ms, up_gemm_ms = windows[overlap_at:]
                fused_a = kernel_a[next(iter(configs))]
                row.update(dispatch_ms=dispatch_ms, up_gemm_ms=up_gemm_ms, fused_a_ms=fused_a,
                           a_vs_max=fused_a / max(dispatch_ms, up_gemm_ms))
            for i, name in enumerate(shares, start=1 + len(configs)):  # the share layers follow the --config ones
                row.update({f"{name}_ms": windows[i], f"{name}_gain": fused_ms / windows[i]})
                if args.backward:
                    bwd = windows[blocks + 3 * i + 2]
                    row.update({f"{name}_bwd_ms": bwd, f"{name}_bwd_gain": row["fused_bwd_ms"] / bwd})
                if args.overlap:
                    row[f"{name}_a_ms"] = kernel_a[name]
            row.update((key, sum(d[i] for d in everyone)) for i, key in enumerate(diff_columns))
            if phases:
                row["phases"] = phases["forward"]
            if "backward" in phases:
                row["train_phases"], row["bwd_phases"] = phases["training"], phases["backward"]
            rows.append(row)
            table.add(row)
    table.close()
    for row in rows:
        for key, which in (("phases", "forward"), ("train_phases", "training"), ("bwd_phases", "backward")):
            if me == 0 and key in row:
                print(f"phases of a recorded fused {which}, tokens {row['tokens']}, hidden {row['hidden']} (ms from "
                      f"the first task on any rank, first start-last end per kind, median task; the forward's: "
                      f"from each rank's call to its first task first):\n"
                      f"{format_phases(row[key])}")
    problems = [f"tokens {row['tokens']} hidden {row['hidden']}: {key} = {row[key]} (must be 0)"
                for row in rows for key in diff_columns if row[key]]
    if problems:
        raise SystemExit("the fused layer is not bitwise the sequential path: " + "; ".join(problems))
    if me == 0 and args.json:
        write_json(args.json, {"benchmark": "moe-fused", "ranks": R, "caveat": caveat, "args": vars(args),
                               "rows": rows, "skipped": skipped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
