"""Host (NumPy) grouped GEMM: the CPU backend and the reference the kernel is held to.

The arithmetic is stated exactly: each output element is one FP32 sum over the reduction
dimension (K in forward, N in dgrad, the expert's rows in wgrad) in ascending order,
starting from zero, then one round-to-nearest-even to the output dtype. BF16 x BF16
products are exact in FP32 (8 + 8 significand bits), so each step rounds once, as an FMA
would. The kernel keeps the same ascending chunk order but sums inside its tensor-core
steps in the hardware's own way, so device and host agree within the bound the tests
derive, not bit for bit.
"""

from __future__ import annotations

import numpy as np

from ultraep.compute.checks import Problem
from ultraep.runtime.dtypes import BFLOAT16


def sequential_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in FP32 with each element summed over ``j`` in ascending order."""
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    term = np.empty_like(acc)
    for j in range(a.shape[1]):
        np.multiply(a[:, j:j + 1], b[j:j + 1, :], out=term)
        acc += term
    return acc


def _float32(bf16_array: np.ndarray) -> np.ndarray:
    return (bf16_array.view(BFLOAT16).astype(np.float32) if bf16_array.dtype == np.int16
            else bf16_array.astype(np.float32))


class HostGroupedGemm:
    """``run(problem, a, b, offsets, out)`` on checked NumPy arrays (``out`` already allocated)."""

    def run(self, problem: Problem, a: np.ndarray, b: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
        target = out.view(BFLOAT16) if out.dtype == np.int16 else out
        bounds = [int(v) for v in offsets]
        for e in range(problem.experts):
            lo, hi = bounds[e], bounds[e + 1]
            if problem.op == "forward":
                target[lo:hi] = sequential_product(_float32(a[lo:hi]), _float32(b[e])).astype(target.dtype)
            elif problem.op == "dgrad":
                target[lo:hi] = sequential_product(_float32(a[lo:hi]), _float32(b[e]).T).astype(target.dtype)
            else:
                target[e] = sequential_product(_float32(a[lo:hi]).T, _float32(b[lo:hi])).astype(target.dtype)
