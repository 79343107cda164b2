"""Test helpers for the grouped GEMM: random expert-major problems, the FP64 product, and
error bounds derived from the arithmetic each implementation performs.

Notation, per output element: ``s = sum_j a_j b_j`` over ``R`` terms (R = K in forward,
N in dgrad, the expert's row count in wgrad), ``S = sum_j |a_j| |b_j|``. BF16 x BF16
products are exact in FP32 and FP64, so only the sums and the final rounding err.

* FP64 reference ``r``: any summation order of R exact products, ``|r - s| <= gamma_R(2^-53) S``
  with ``gamma_n(u) = n u / (1 - n u)`` (Higham, Accuracy and Stability, Thm 4.4 / 3.1).
* Host (sequential FP32, ``u = 2^-24``): R - 1 additions of exact terms, each rounded once,
  ``|fp32 - s| <= gamma_{R-1}(2^-24) S``.
* Device (tensor cores): the kernels add ``T = ceil(R / 16)`` k16 MMA steps (mma.sync
  m16n8k16 or wgmma m64nNk16) ``d = c + p_1 + ... + p_16`` (zero-padded past R; a step
  wholly past R adds exact zeros and is not counted). Model of one step: the 17 addends are
  aligned to the largest and truncated, in at most two passes (the hardware may add the
  products in groups), then the sum is normalised with truncation; each truncation loses
  less than one unit in the 24th bit of the largest magnitude, so a step errs by at most
  ``(2 * 17 + 1) 2^-23 (|c| + sum |p_i|)`` and, as ``|c|`` is itself at most the partial
  ``S`` plus the error so far, ``|fp32 - s| <= gamma_T(35 * 2^-23) S``.
* BF16 output: one round to nearest, ``|y - fp32| <= 2^-8 |fp32| <= 2^-8 (|r| + error so far)``.

The bound is the sum of those terms; it is never widened to make a test pass.
"""

from __future__ import annotations

import numpy as np

from ultraep.runtime.dtypes import BFLOAT16

U_FP64, U_FP32, U_BF16 = 2.0**-53, 2.0**-24, 2.0**-8
DEVICE_STEP_ERROR = 35 * 2.0**-23


def gamma(n, u: float):
    n = np.asarray(n, dtype=np.float64)
    return n * u / (1 - n * u)


def random_counts(rng, experts: int, mean_rows: int) -> list[int]:
    """Expert sizes with empty and one-row experts mixed in and no multiple of a tile forced."""
    counts = [int(c) for c in rng.integers(0, 2 * mean_rows + 1, size=experts)]
    if experts >= 3:
        counts[0], counts[-1] = 0, 1
    return counts


def offsets_of(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def bf16(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BFLOAT16)


def random_problem(rng, op: str, experts: int, k: int, n: int, mean_rows: int, spare_rows: int = 0):
    """(a, b, offsets) for ``op`` with ``spare_rows`` rows past ``offsets[E]``."""
    offsets = offsets_of(random_counts(rng, experts, mean_rows))
    rows = int(offsets[-1]) + spare_rows
    if op == "forward":
        return bf16(rng, (rows, k)), bf16(rng, (experts, k, n)), offsets
    if op == "dgrad":
        return bf16(rng, (rows, n)), bf16(rng, (experts, k, n)), offsets
    return bf16(rng, (rows, k)), bf16(rng, (rows, n)), offsets


def exact(op: str, a, b, offsets):
    """(r, S, R): the FP64 product, the sums of absolute products, and terms per element,
    for the rows ``[0, offsets[E])`` (forward/dgrad) or every expert (wgrad)."""
    a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    bounds = [int(v) for v in offsets]
    experts = len(bounds) - 1
    if op == "wgrad":
        r = np.zeros((experts, a64.shape[1], b64.shape[1]))
        s = np.zeros_like(r)
        terms = np.zeros((experts, 1, 1))
        for e in range(experts):
            lo, hi = bounds[e], bounds[e + 1]
            r[e], s[e], terms[e] = a64[lo:hi].T @ b64[lo:hi], np.abs(a64[lo:hi]).T @ np.abs(b64[lo:hi]), hi - lo
        return r, s, terms
    end = bounds[-1]
    weights = b64 if op == "forward" else b64.transpose(0, 2, 1)
    r = np.zeros((end, weights.shape[2]))
    s = np.zeros_like(r)
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        r[lo:hi], s[lo:hi] = a64[lo:hi] @ weights[e], np.abs(a64[lo:hi]) @ np.abs(weights[e])
    return r, s, np.full((1, 1), weights.shape[1])


def error_bound(r, s, terms, out_dtype, device: bool):
    """Largest |y - r| the implementation may show (see the module docstring)."""
    if device:
        steps = np.ceil(np.asarray(terms, dtype=np.float64) / 16)
        sum_error = gamma(steps, DEVICE_STEP_ERROR) * s
    else:
        sum_error = gamma(np.maximum(np.asarray(terms) - 1, 0), U_FP32) * s
    total = sum_error + gamma(terms, U_FP64) * s
    if np.dtype(out_dtype) != np.float32:
        total = total + U_BF16 * (np.abs(r) + total)
    return total


def assert_within_bound(y, r, s, terms, out_dtype, device: bool, what: str) -> None:
    y64 = np.asarray(y).astype(np.float64)
    bound = error_bound(r, s, terms, out_dtype, device)
    excess = np.abs(y64 - r) - bound
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape) if excess.size else None
    assert excess.size == 0 or excess.max() <= 0, (
        f"{what}: |y - r| exceeds the derived bound at {worst}: y={y64[worst]!r} r={r[worst]!r} "
        f"bound={bound[worst]!r} ({int((excess > 0).sum())} of {excess.size} elements)")


def nan_bits(shape, dtype) -> np.ndarray:
    """An output poisoned with NaN, to tell written elements from untouched ones."""
    return np.full(shape, np.nan, dtype=np.float32).astype(dtype)
