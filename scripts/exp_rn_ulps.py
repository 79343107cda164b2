"""exp_rn's worst error over every FP32 input it computes (CPU, minutes): the bound that
``raw_kernels/swiglu.cuh`` states and ``tests/integration/test_moe_layer.py``'s EXP_ULPS
keeps, checked on all 2.2 billion inputs from -86 to 88.75 rather than the test's sweep.

Runs ``ultraep.integration.moe_layer.exp_rn`` (bit for bit the device's ``sigmoid_exp_rn``
from -86 to 88, which the GPU test checks) on every bit pattern in blocks, measures each
result in ulps of FP32 at FP64's exp, and prints the worst input per worker, progress as it
goes, and the worst overall.

    python scripts/exp_rn_ulps.py [--workers 2] [--block-bits 22]
    # with the package installed (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import numpy as np

from ultraep.integration.moe_layer import EXP_INPUT_MAX, EXP_INPUT_MIN, exp_rn


def blocks(block_bits: int) -> list[tuple[int, int]]:
    """Bit-pattern ranges covering [+0, EXP_INPUT_MAX] and [-0, EXP_INPUT_MIN]."""
    size = 1 << block_bits
    ranges = [(0, int(EXP_INPUT_MAX.view(np.uint32)) + 1), (0x80000000, int(EXP_INPUT_MIN.view(np.uint32)) + 1)]
    return [(lo, min(lo + size, hi)) for first, hi in ranges for lo in range(first, hi, size)]


def fp32_ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in ulps of FP32 at ``exact`` (FP64, normal FP32 range); inf counts as 2^128."""
    ulp = np.ldexp(1.0, np.frexp(exact)[1] - 24)
    return np.abs(np.where(np.isinf(got), 2.0**128, got.astype(np.float64)) - np.minimum(exact, 2.0**128)) / ulp


def worst_in(block: tuple[int, int]) -> tuple[float, float]:
    """(ulps, input) of the block's worst result."""
    x = np.arange(*block, dtype=np.uint64).astype(np.uint32).view(np.float32)
    error = fp32_ulps(exp_rn(x), np.exp(x.astype(np.float64)))
    i = int(np.argmax(error))
    return float(error[i]), float(x[i])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--block-bits", type=int, default=22, help="2^N inputs a block (default 22: 4 million)")
    args = parser.parse_args(argv)
    if args.workers < 1 or not 10 <= args.block_bits <= 26:
        parser.error("--workers must be >= 1 and --block-bits in [10, 26]")
    todo = blocks(args.block_bits)
    start, worst = time.monotonic(), (0.0, 0.0)
    with multiprocessing.Pool(args.workers) as pool:
        for done, found in enumerate(pool.imap_unordered(worst_in, todo), 1):
            worst = max(worst, found)
            if done % 32 == 0 or done == len(todo):
                print(f"{done}/{len(todo)} blocks, {time.monotonic() - start:.0f} s: worst so far "
                      f"{worst[0]:.6f} ulp at {worst[1]!r}", flush=True)
    print(f"exp_rn: {worst[0]:.6f} ulp at most, at x = {worst[1]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
