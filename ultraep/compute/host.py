"""Host (NumPy) grouped GEMM: the CPU backend and the reference the kernel is held to.

The arithmetic is stated exactly: each output element is one FP32 sum over the reduction
dimension (K in forward, N in dgrad, the expert's rows in wgrad) in ascending order,
starting from zero, then one round-to-nearest-even to the output dtype. BF16 x BF16
products are exact in FP32 (8 + 8 significand bits), so each step rounds once, as an FMA
would. The kernel keeps the same ascending chunk order but sums inside its tensor-core
steps in the hardware's own way, so device and host agree within the bound the tests
derive, not bit for bit. A wgrad's ``add_to`` adds as the GPU's memory does
(:func:`add_flushing_subnormals`), one add an element.
"""

from __future__ import annotations

import numpy as np

from ultraep.compute.checks import Problem
from ultraep.runtime.dtypes import bf16_typed, flush_subnormals


def sequential_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in FP32 with each element summed over ``j`` in ascending order."""
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    term = np.empty_like(acc)
    for j in range(a.shape[1]):
        np.multiply(a[:, j:j + 1], b[j:j + 1, :], out=term)
        acc += term
    return acc


def add_flushing_subnormals(total: np.ndarray, addend: np.ndarray) -> None:
    """``total += addend`` (FP32) as ``red.global.add.f32`` adds in L2: round to nearest
    even, subnormal inputs and results flushed to zeros of their sign (PTX ISA)."""
    total[...] = flush_subnormals(flush_subnormals(total) + flush_subnormals(addend))


def _float32(bf16_array: np.ndarray) -> np.ndarray:
    return bf16_typed(bf16_array).astype(np.float32)


class HostGroupedGemm:
    """``run(problem, a, b, offsets, out, add_to)`` on checked NumPy arrays (``out`` already
    allocated; ``add_to`` None but for a wgrad that adds into it)."""

    def run(self, problem: Problem, a: np.ndarray, b: np.ndarray, offsets: np.ndarray, out: np.ndarray,
            add_to: np.ndarray | None = None) -> None:
        target = bf16_typed(out)
        bounds = [int(v) for v in offsets]
        for e in range(problem.experts):
            lo, hi = bounds[e], bounds[e + 1]
            if problem.op == "forward":
                target[lo:hi] = sequential_product(_float32(a[lo:hi]), _float32(b[e])).astype(target.dtype)
            elif problem.op == "dgrad":
                target[lo:hi] = sequential_product(_float32(a[lo:hi]), _float32(b[e]).T).astype(target.dtype)
            elif e < problem.added_experts:
                add_flushing_subnormals(add_to[e], sequential_product(_float32(a[lo:hi]).T, _float32(b[lo:hi])))
            else:
                target[e - problem.added_experts] = sequential_product(_float32(a[lo:hi]).T,
                                                                       _float32(b[lo:hi])).astype(target.dtype)
