"""Where the grouped GEMM's time goes, tile by tile (GPU, a profiling aid).

Builds ``raw_kernels/grouped_gemm.cu`` with ``-DGG_TILE_STAMPS``, which turns on its
``TILE_STAMP`` macro (the first consumer thread of each block stamps ``%globaltimer`` before
and after each tile's MMAs and once its output is handed on, with the tile's SM, rows and
k-steps), runs the cases of ``bench grouped-gemm`` on its expert sizes (``--sizes exact``: no
partial tile) and prints per case, sizes and operation: the stamped build's time beside the
plain build's (in turns: what the stamps cost), the tiles, the SMs' busy share, the gap
between a block's tiles, and per kind of tile -- full, more than half, at most half of the
tile's rows -- their count, median time and time per k-step, and the hand-on after the MMAs.

    python scripts/gemm_tile_stamps.py [--cases 32x256] [--sizes uniform exact] [--ops forward dgrad] [--json F]
    # with the package installed (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

STAMP = ("GG_TILE_STAMPS", 1)
FIELDS = ("mma_start", "mma_end", "handed_on", "sm", "rows", "k_steps")  # the kernel's TileStamp order
KINDS = (("full", lambda rows, bm: rows == bm), ("over half", lambda rows, bm: (rows > bm // 2) & (rows < bm)),
         ("half or less", lambda rows, bm: rows <= bm // 2))


def summarise(stamps: np.ndarray, block_rows: int) -> dict:
    """The figures of one launch's stamps (one row per tile, :data:`FIELDS`, ns and counts)."""
    start, end, handed, sm, rows, k_steps = (stamps[:, i] for i in range(len(FIELDS)))
    span = int(handed.max() - start.min())
    sms = np.unique(sm)
    gaps = []
    for s in sms:  # a block's tiles in order: the time from one tile's hand-on to the next's MMAs
        mine = np.argsort(start[sm == s])
        gaps.extend((start[sm == s][mine][1:] - handed[sm == s][mine][:-1]).tolist())
    out = {"tiles": len(stamps), "span_us": span / 1e3, "sms": len(sms),
           "busy": float((handed - start).sum() / (span * len(sms))),
           "gap_ns": float(np.median(gaps)) if gaps else None, "kinds": {}}
    for name, test in KINDS:
        mask = test(rows, block_rows)
        if mask.any():
            mma = end[mask] - start[mask]
            out["kinds"][name] = {"tiles": int(mask.sum()), "mma_us": float(np.median(mma)) / 1e3,
                                  "ns_per_k_step": float(np.median(mma / np.maximum(k_steps[mask], 1))),
                                  "hand_on_ns": float(np.median(handed[mask] - end[mask]))}
    return out


def parse_args(argv):
    from ultraep.bench.grouped_gemm import CASES, DISTRIBUTIONS, OPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="substrings of bench grouped-gemm's case names "
                        f"(default: all; {', '.join(c.name for c in CASES)})")
    parser.add_argument("--sizes", nargs="+", choices=DISTRIBUTIONS, default=["uniform", "exact"])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=["forward", "dgrad"])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each build (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    import cupy

    from ultraep.bench.grouped_gemm import CASES, problem_arrays
    from ultraep.bench.timing import held_event_ms_each
    from ultraep.compute.checks import KERNELS, check_problem
    from ultraep.compute.device import DeviceGroupedGemm
    from ultraep.runtime.kernels import kernel_constant, load_module

    args = parse_args(argv)
    cases = [c for c in CASES if not args.cases or any(s in c.name for s in args.cases)]
    if not cases:
        print(f"no case matches {args.cases}", file=sys.stderr)
        return 2
    plain, stamped = DeviceGroupedGemm(0), DeviceGroupedGemm(0, defines=(STAMP,))
    block_rows, capacity = kernel_constant(KERNELS, "GH_BM"), kernel_constant(KERNELS, "GG_STAMPED_TILES")
    results = []
    for case in cases:
        for sizes in args.sizes:
            _, offsets, x, dy, w = problem_arrays(case, sizes, args.seed)  # bench grouped-gemm's operands
            operands = {"forward": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}
            for op in args.ops:
                a, b = operands[op]
                problem = check_problem(op, a, b, offsets, None)
                outs = {name: impl.allocate(problem) for name, impl in (("plain", plain), ("stamped", stamped))}
                launches = {name: (lambda impl=impl, out=outs[name]: impl.run(problem, a, b, offsets, out))
                            for name, impl in (("plain", plain), ("stamped", stamped))}
                ms = held_event_ms_each(launches, args.repeats)
                plain.check()
                stamped.check()
                module = load_module(KERNELS, defines=stamped.module_defines(op))  # the one the launch compiled
                table = cupy.ndarray((capacity * len(FIELDS),), np.int64, module.get_global("gg_tile_stamps"))
                table.fill(0)
                launches["stamped"]()
                cupy.cuda.runtime.deviceSynchronize()
                stamps = table.get().reshape(capacity, len(FIELDS))
                stamps = stamps[stamps[:, 1] > 0]
                figures = summarise(stamps, block_rows)
                figures.update(case=case.name, sizes=sizes, op=op,
                               plain_ms=ms["plain"], stamped_ms=ms["stamped"])  # medians already
                results.append(figures)
                print_figures(figures)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


def print_figures(f: dict) -> None:
    gap = "-" if f["gap_ns"] is None else f"{f['gap_ns']:.0f} ns"  # no block ran two tiles
    print(f"{f['case']} {f['sizes']} {f['op']}: plain {f['plain_ms']:.3f} ms, stamped {f['stamped_ms']:.3f}; "
          f"{f['tiles']} tiles on {f['sms']} SMs, busy {f['busy']:.3f}, gap {gap}")
    for kind, k in f["kinds"].items():
        print(f"    {kind:12s} {k['tiles']:6d} tiles  {k['mma_us']:8.1f} us  {k['ns_per_k_step']:6.0f} ns a k-step  "
              f"hand-on {k['hand_on_ns']:.0f} ns")


if __name__ == "__main__":
    sys.exit(main())
