"""``python -m ultraep.bench grouped-gemm``: TFLOPS of the library's grouped GEMM (forward,
dgrad, wgrad) on MoE shapes, side by side in the same run with cuBLAS dense of the same
total rows (``cupy.matmul``), a per-expert cuBLAS loop and ``torch._grouped_mm`` (where
torch is present), on expert sizes that are uniform, Zipf-skewed, or with empty experts
(``--sizes exact``: every expert the mean, a multiple of the tile, so no tile is partial: the
kernel's own speed, without the expert-boundary tiles uneven sizes leave).

Every figure is the median device time of one call, all columns of a row timed in turns
(:func:`~ultraep.bench.timing.held_event_ms_each`: the host enqueues while a kernel holds
the stream, so Python's launch cost is not counted, not even for the loop of launches; in
turns, so that every column sees the same GPU clocks). TFLOPS = 2 x total rows x N x K / time for
every column alike. ``vs_best`` is ours over the better of the loop and
``torch._grouped_mm``; ``vs_dense`` ours over cuBLAS dense. The loop and dense baselines
need the counts on the host; the grouped kernels read them on the device.

``--ops wgrad_acc`` (not in the default set) times the weight gradient as a training step
keeps it, added into an FP32 gradient (``grad[e] += x[rows_e]^T @ dy[rows_e]``): ours with
``add_to`` (the adds in the epilogue, one kernel) against ``two_pass``, our wgrad into an FP32
buffer and then ``grad += dw`` (``vs_two_pass``), and ``torch._grouped_mm`` into FP32 followed
by ``add_`` (``vs_best``); no dense or loop column (cuBLAS through CuPy has no BF16-in, FP32-out
product), no variant.

``--variant SCHEDULE`` also times the kernels compiled with one schedule
(``ultraep.compute.device.SCHEDULES``) for every operation right after ours (each
operation's default) on the same operands: ``variant``
and its ratios to ours, the better baseline and dense, and ``variant_diff``, the output
elements whose bits differ from ours (the schedules must agree: 0).

``--ranks R`` (with ``--emulate-ep [SM_PERCENT]``: under MPS, each rank a share of the SMs)
runs every case on R ranks at once, each the same problem, relaunched under ``mpiexec``,
each rank on its GPU (``EPGroup``): ranks sharing one then compete as an EP group's do.
Every figure is then the median group window of one call
(:func:`~ultraep.bench.timing.group_windows_ms_each`: a barrier, every rank's call, first
rank's start to last rank's end, the host's launches included; columns in turns; a column
not every rank can run is left out), TFLOPS a rank. A persistent grid whose blocks find
some SMs held by another rank's shows there (the grouped GEMM's blocks claim tiles, so a
late block takes fewer); one process alone does not.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from ultraep.bench.report import print_table, write_json
from ultraep.bench.timing import group_windows_ms_each, held_event_ms_each
from ultraep.compute.device import DEFAULT_SCHEDULES, SCHEDULES
from ultraep.runtime.launch import (DefaultsHelpFormatter, add_launch_options, launched_by_mpiexec, multi_rank_main,
                                   non_negative_int, positive_int)


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    rows_per_expert: int
    n: int
    k: int


# The anchor shapes (public UltraEP grouped-GEMM cases) and two model layers (gate+up and down projections).
CASES = [
    Case("8x4096 N4096 K7168", 8, 4096, 4096, 7168),
    Case("8x4096 N7168 K2048", 8, 4096, 7168, 2048),
    Case("32x1024 N4096 K7168", 32, 1024, 4096, 7168),
    Case("32x1024 N7168 K2048", 32, 1024, 7168, 2048),
    Case("32x256 N4096 K7168", 32, 256, 4096, 7168),
    Case("dsv3 up 16x2048", 16, 2048, 2 * 2048, 7168),
    Case("dsv3 down 16x2048", 16, 2048, 7168, 2048),
    Case("qwen3 up 16x2048", 16, 2048, 2 * 1536, 4096),
    Case("qwen3 down 16x2048", 16, 2048, 4096, 1536),
]
DISTRIBUTIONS = ("uniform", "zipf", "empty", "exact")
UNEVEN = DISTRIBUTIONS[:3]  # the default: the bars are set on uneven sizes
OPS = ("forward", "dgrad", "wgrad")
ACCUMULATE = "wgrad_acc"  # the wgrad added into an FP32 gradient: on request
COLUMNS = ["case", "sizes", "op", "rows", "min_rows", "max_rows", "ours", "dense", "loop", "torch_grouped",
           "vs_best", "vs_dense"]
ACCUMULATE_COLUMNS = ["two_pass", "vs_two_pass"]
VARIANT_COLUMNS = ["variant", "variant_vs_ours", "variant_vs_best", "variant_vs_dense", "variant_diff"]
OUTPUTS = {"forward": "y", "dgrad": "dx", "wgrad": "dw"}


def expert_counts(experts: int, mean: int, distribution: str, seed: int) -> np.ndarray:
    """Rows per expert summing to about ``experts * mean``, none rounded to a tile:
    ``uniform`` within 1/8 of the mean, ``zipf`` (exponent 1.2, shuffled), ``empty`` (a
    quarter of the experts get no rows, the rest share the total); or ``exact``: the mean
    each."""
    rng = np.random.default_rng(seed)
    total = experts * mean
    if distribution == "exact":
        return np.full(experts, mean, dtype=np.int64)
    if distribution == "uniform":
        return rng.integers(mean - mean // 8, mean + mean // 8 + 1, size=experts)
    if distribution == "zipf":
        weights = rng.permutation(1.0 / np.arange(1, experts + 1) ** 1.2)
    elif distribution == "empty":
        weights = rng.uniform(0.75, 1.25, size=experts)
        weights[rng.permutation(experts)[:max(1, experts // 4)]] = 0.0
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    counts = np.floor(weights / weights.sum() * total).astype(np.int64)
    counts[np.argmax(weights)] += total - counts.sum()
    return counts


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench grouped-gemm", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="substrings of case names to run (default: all)")
    parser.add_argument("--sizes", nargs="+", choices=DISTRIBUTIONS, default=list(UNEVEN),
                        help="how the rows are spread over the experts (default: the uneven ones; exact: the "
                             "mean each, no partial tile)")
    parser.add_argument("--ops", nargs="+", choices=OPS + (ACCUMULATE,), default=list(OPS),
                        help=f"passes to time ({ACCUMULATE}: the wgrad added into an FP32 gradient)")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls per figure (median reported)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the row counts and the operands")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--variant", choices=list(SCHEDULES),
                        help="also time the kernels of this schedule beside ours, and compare their bits")
    add_launch_options(parser, ranks=1)
    return parser.parse_args(argv)


class Baselines:
    """cuBLAS dense, the per-expert cuBLAS loop and ``torch._grouped_mm`` over one problem
    (``grad``: the FP32 gradient a ``wgrad_acc`` adds into)."""

    def __init__(self, x, w, dy, counts, offsets_dev, grad=None):
        import cupy

        self.cp, self.x, self.w, self.dy = cupy, x, w, dy
        self.bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        try:
            import torch
        except ImportError:
            torch = None
        self.torch = torch
        if torch is not None:  # zero-copy views; bf16 crosses as its bits
            self.tx, self.tw, self.tdy = (torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16) for a in (x, w, dy))
            self.tends = torch.from_dlpack(offsets_dev[1:].astype(np.int32))
            self.tgrad = None if grad is None else torch.from_dlpack(grad)  # wgrad_acc's FP32 gradient
        self.failed: dict[str, str] = {}

    def _spans(self):
        b = self.bounds
        return [(e, int(b[e]), int(b[e + 1])) for e in range(len(b) - 1)]

    def dense(self, op, out):
        if op == ACCUMULATE:
            return None
        x, w0, dy = self.x, self.w[0], self.dy
        if op == "forward":
            return lambda: self.cp.matmul(x, w0, out=out["y"])
        if op == "dgrad":
            return lambda: self.cp.matmul(dy, w0.T, out=out["dx"])
        return lambda: self.cp.matmul(x.T, dy, out=out["dw"][0])

    def loop(self, op, out):
        cp, x, w, dy, spans = self.cp, self.x, self.w, self.dy, self._spans()

        def forward():
            for e, lo, hi in spans:
                if hi > lo:
                    cp.matmul(x[lo:hi], w[e], out=out["y"][lo:hi])

        def dgrad():
            for e, lo, hi in spans:
                if hi > lo:
                    cp.matmul(dy[lo:hi], w[e].T, out=out["dx"][lo:hi])

        def wgrad():
            for e, lo, hi in spans:
                if hi > lo:
                    cp.matmul(x[lo:hi].T, dy[lo:hi], out=out["dw"][e])
                else:
                    out["dw"][e].fill(0)

        return {"forward": forward, "dgrad": dgrad, "wgrad": wgrad}.get(op)

    def torch_grouped(self, op):
        torch = self.torch
        if torch is None or not hasattr(torch, "_grouped_mm"):
            return None
        tx, tw, tdy, ends = self.tx, self.tw, self.tdy, self.tends
        # Some torch versions want the weights' reduction dim contiguous: the second layout
        # (same values) is tried when the first is refused; its copy is made once, untimed.
        column_major = tw.transpose(-2, -1).contiguous().transpose(-2, -1)
        calls = {
            "forward": [lambda: torch._grouped_mm(tx, tw, offs=ends),
                        lambda: torch._grouped_mm(tx, column_major, offs=ends)],
            "dgrad": [lambda: torch._grouped_mm(tdy, tw.transpose(-2, -1), offs=ends),
                      lambda: torch._grouped_mm(tdy, column_major.transpose(-2, -1), offs=ends)],
            "wgrad": [lambda: torch._grouped_mm(tx.t(), tdy, offs=ends)],
            ACCUMULATE: [lambda: self.tgrad.add_(torch._grouped_mm(tx.t(), tdy, offs=ends, out_dtype=torch.float32))],
        }[op]
        for call in calls:
            try:
                call()
                return call
            except (RuntimeError, TypeError, ValueError) as error:
                self.failed[f"torch._grouped_mm {op}"] = str(error).splitlines()[0]
        return None


def problem_arrays(case: Case, distribution: str, seed: int):
    """One case's rows per expert (host), device offsets (int32) and BF16 operands ``x``
    ``[rows, K]``, ``dy`` ``[rows, N]``, ``w`` ``[E, K, N]``, drawn from ``seed``."""
    import cupy

    from ultraep.runtime.dtypes import BFLOAT16

    counts = expert_counts(case.experts, case.rows_per_expert, distribution, seed)
    rows = int(counts.sum())
    offsets = cupy.asarray(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    random = cupy.random.default_rng(seed)
    x = random.standard_normal((rows, case.k), dtype=np.float32).astype(BFLOAT16)
    dy = random.standard_normal((rows, case.n), dtype=np.float32).astype(BFLOAT16)
    w = (random.standard_normal((case.experts, case.k, case.n), dtype=np.float32) * 0.02).astype(BFLOAT16)
    return counts, offsets, x, dy, w


def run_case(case: Case, distribution: str, ops, repeats: int, seed: int, variant=None,
             timer=held_event_ms_each) -> list[dict]:
    """The rows of one case and size distribution; ``variant``: a DeviceGroupedGemm of another
    schedule, timed beside ours; ``timer(launches, repeats)``: ms per call of each launch."""
    import cupy

    from ultraep.compute import check_errors, grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
    from ultraep.compute.checks import check_problem
    from ultraep.runtime.dtypes import BFLOAT16

    counts, offsets, x, dy, w = problem_arrays(case, distribution, seed)
    rows = int(counts.sum())
    out = {"y": cupy.empty((rows, case.n), BFLOAT16), "dx": cupy.empty((rows, case.k), BFLOAT16),
           "dw": cupy.empty((case.experts, case.k, case.n), BFLOAT16)}
    accumulating = ACCUMULATE in ops
    if accumulating:  # the FP32 gradient the wgrad adds into, and the two-pass baseline's dW
        out.update(grad=cupy.random.default_rng(seed).standard_normal((case.experts, case.k, case.n), np.float32),
                   dw32=cupy.empty((case.experts, case.k, case.n), np.float32),
                   none=cupy.empty((0, case.k, case.n), np.float32))
    ours = {"forward": lambda: grouped_mm(x, w, offsets, out=out["y"]),
            "dgrad": lambda: grouped_mm_dgrad(dy, w, offsets, out=out["dx"]),
            "wgrad": lambda: grouped_mm_wgrad(x, dy, offsets, out=out["dw"]),
            ACCUMULATE: lambda: grouped_mm_wgrad(x, dy, offsets, out=out["none"], add_to=out["grad"])}

    def two_pass():
        out["grad"].__iadd__(grouped_mm_wgrad(x, dy, offsets, out=out["dw32"]))

    baselines = Baselines(x, w, dy, counts, offsets, out.get("grad"))
    flops = 2.0 * rows * case.n * case.k

    def runs(name, launch):
        """Whether ``launch`` runs (a baseline this CuPy/torch cannot run: reported, not faked)."""
        try:
            launch()
            return True
        except Exception as error:
            print(f"{case.name} {distribution}: {name}: {error}", file=sys.stderr)
            return False

    operands = {"forward": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}  # a variant's (not wgrad_acc's)
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731

    rows_out = []
    for op in ops:
        row = dict(case=case.name, sizes=distribution, op=op, rows=rows, min_rows=int(counts.min()),
                   max_rows=int(counts.max()))
        launches = {"ours": ours[op]}
        if op == ACCUMULATE:
            launches["two_pass"] = two_pass
        elif variant is not None:  # its bits against ours first (the baselines write the output too)
            ours[op]()
            theirs = cupy.empty_like(out[OUTPUTS[op]])
            problem = check_problem(op, *operands[op], offsets, theirs)
            launches["variant"] = lambda: variant.run(problem, *operands[op], offsets, theirs)
            launches["variant"]()
            variant.check()
            check_errors()
            row["variant_diff"] = int((out[OUTPUTS[op]].view(np.uint16) != theirs.view(np.uint16)).sum())
        for name, launch in (("dense", baselines.dense(op, out)), ("loop", baselines.loop(op, out)),
                             ("torch_grouped", baselines.torch_grouped(op))):
            if launch is not None and runs(name, launch):
                launches[name] = launch
        ms = timer(launches, repeats)
        for name in ("ours", "dense", "loop", "torch_grouped") + tuple(n for n in ("two_pass", "variant")
                                                                       if n in launches):
            row[name] = flops / (ms[name] * 1e-3) / 1e12 if name in ms else None
        if "variant" in launches:
            variant.check()
        check_errors()
        best = max([v for v in (row["loop"], row["torch_grouped"]) if v is not None], default=None)
        row["vs_best"], row["vs_dense"] = ratio(row["ours"], best), ratio(row["ours"], row["dense"])
        if op == ACCUMULATE:
            row["vs_two_pass"] = ratio(row["ours"], row["two_pass"])
        elif variant is not None:
            row.update(variant_vs_ours=ratio(row["variant"], row["ours"]), variant_vs_best=ratio(row["variant"], best),
                       variant_vs_dense=ratio(row["variant"], row["dense"]))
        rows_out.append(row)
    for what, why in baselines.failed.items():
        print(f"{case.name} {distribution}: {what} unavailable: {why}", file=sys.stderr)
    return rows_out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ranks == 1 and args.emulate_ep is None and not launched_by_mpiexec():
        return run(args)  # one process: no MPI
    return multi_rank_main(argv, parse_args, run, nprocs=lambda a: a.ranks, command=["-m", "ultraep.bench",
                                                                                      "grouped-gemm"])


def run(args) -> int:
    cases = [c for c in CASES if not args.cases or any(s in c.name for s in args.cases)]
    if not cases:
        print(f"no case matches {args.cases}; cases: {', '.join(c.name for c in CASES)}", file=sys.stderr)
        return 2
    timer, me, ranks, title = held_event_ms_each, 0, 1, "Grouped GEMM, BF16 in / FP32 accumulate / BF16 out, TFLOPS"
    group = None
    if launched_by_mpiexec():
        from mpi4py import MPI

        from ultraep.runtime.group import EPGroup

        group = EPGroup(MPI.COMM_WORLD, use_gpu=True)
        me, ranks = group.rank, group.size
    if group is not None and group.size > 1:
        import cupy

        from ultraep.runtime.mps import sharing_label

        synchronize = cupy.cuda.get_current_stream().synchronize
        timer = lambda launches, repeats: group_windows_ms_each(group, launches, repeats, synchronize)  # noqa: E731
        title += (f" a rank, {group.size} ranks at once ({sharing_label(group)}), each the same problem; group "
                  "windows of one call (host launches included)")
    variant = None
    if args.variant:
        import cupy

        from ultraep.compute.device import DeviceGroupedGemm
        variant = DeviceGroupedGemm(cupy.cuda.runtime.getDevice(), args.variant)
    rows = []
    for case in cases:
        for distribution in args.sizes:
            rows += run_case(case, distribution, args.ops, args.repeats, args.seed, variant, timer)
    title += " (higher is better)"
    if args.variant:
        ours = ", ".join(f"{op} {name}" for op, name in DEFAULT_SCHEDULES.items())
        title += f"; variant: schedule {args.variant!r} for every op against ours ({ours})"
    if ACCUMULATE in args.ops:
        title += f"; {ACCUMULATE}: FP32 gradient += wgrad, FP32 out"
    if me != 0:
        return 0
    print_table(rows, COLUMNS + (ACCUMULATE_COLUMNS if ACCUMULATE in args.ops else [])
                + (VARIANT_COLUMNS if args.variant else []), title)
    if args.json:
        write_json(args.json, {"benchmark": "grouped-gemm", "variant": args.variant, "ranks": ranks,
                               "title": title, "rows": rows})
    return 0
