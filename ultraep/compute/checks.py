"""The grouped GEMM's input contract, shared by the host and the device implementation.

Every check here runs before anything is launched or written. Expert offsets that live on
the host are checked here too; offsets on the device are checked by the kernels themselves
(``raw_kernels/grouped_gemm_common.cuh``), which word their verdict with the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ultraep.errors import GroupedGemmError
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.kernels import kernel_constant

KERNELS = "grouped_gemm.cu"  # includes grouped_gemm_common.cuh: the limits and codes below are its constants
OPERANDS = {"forward": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}
MAX_ROWS = 2**31 - 1  # the kernel's row arithmetic is 32-bit


@dataclass(frozen=True)
class Problem:
    """One grouped GEMM: ``experts`` experts over ``rows`` rows, weights ``[experts, k, n]``."""

    op: str
    experts: int
    rows: int
    k: int
    n: int
    out_shape: tuple
    out_dtype: np.dtype
    added_experts: int = 0  # wgrad: the first experts, added into ``add_to`` instead of stored in ``out``


def is_bf16(dtype) -> bool:
    """bf16, or its 16-bit pattern as DLPack delivers it where the consumer has no bf16 type."""
    dtype = np.dtype(dtype)
    return (BFLOAT16 is not None and dtype == BFLOAT16) or dtype == np.int16


def check_problem(op: str, a, b, offsets, out, add_to=None) -> Problem:
    """The problem ``op`` poses with imported arrays ``a``, ``b`` (named as in :data:`OPERANDS`),
    ``offsets``, ``out`` (or None) and, for wgrad, ``add_to`` (or None); GroupedGemmError naming
    the first thing wrong."""
    a_name, b_name = OPERANDS[op]
    for name, array in ((a_name, a), (b_name, b)):
        if not is_bf16(array.dtype):
            raise GroupedGemmError(f"{op}: {name} must be bfloat16, got {np.dtype(array.dtype)}")
    _check_ndim(op, a_name, a, 2)
    _check_ndim(op, b_name, b, 2 if op == "wgrad" else 3)
    _check_ndim(op, "offsets", offsets, 1)
    if np.dtype(offsets.dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise GroupedGemmError(f"{op}: offsets must be int32 or int64, got {np.dtype(offsets.dtype)}")
    rows = a.shape[0]
    if op == "wgrad":
        if offsets.shape[0] < 1:
            raise GroupedGemmError(f"{op}: offsets must have E + 1 >= 1 entries, got an empty array")
        experts, k, n = offsets.shape[0] - 1, a.shape[1], b.shape[1]
        if b.shape[0] != rows:
            raise GroupedGemmError(f"{op}: x has {rows} rows but dy has {b.shape[0]}")
        added_experts = _added_experts(op, add_to, experts, k, n)
        out_shape = (experts - added_experts, k, n)
    else:
        experts, k, n = b.shape
        inner = k if op == "forward" else n
        if a.shape[1] != inner:
            raise GroupedGemmError(f"{op}: {a_name} {tuple(a.shape)} does not match w {tuple(b.shape)} "
                                   f"({a_name} needs {inner} columns)")
        if offsets.shape[0] != experts + 1:
            raise GroupedGemmError(f"{op}: offsets must have E + 1 = {experts + 1} entries for {experts} experts, "
                                   f"got {offsets.shape[0]}")
        out_shape = (rows, n if op == "forward" else k)
        added_experts = 0
    align = kernel_constant(KERNELS, "GG_ALIGN_ELEMENTS")
    if k % align or n % align:
        raise GroupedGemmError(f"{op}: K = {k} and N = {n} must be multiples of {align} (rows of whole 16-byte chunks)")
    limit = kernel_constant(KERNELS, "GG_MAX_EXPERTS")
    if experts > limit:
        raise GroupedGemmError(f"{op}: {experts} experts, at most {limit} are supported")
    if rows > MAX_ROWS:
        raise GroupedGemmError(f"{op}: {rows} rows, at most {MAX_ROWS} are supported")
    out_dtype = BFLOAT16 if add_to is None else np.dtype(np.float32)
    if out is not None:
        if tuple(out.shape) != out_shape:
            raise GroupedGemmError(f"{op}: out must have shape {out_shape}, got {tuple(out.shape)}")
        out_dtype = np.dtype(out.dtype)
        if not is_bf16(out_dtype) and out_dtype != np.float32:
            raise GroupedGemmError(f"{op}: out must be bfloat16 or float32, got {out_dtype}")
        out_dtype = np.dtype(np.float32) if out_dtype == np.float32 else BFLOAT16
        if add_to is not None and out_dtype != np.float32:
            raise GroupedGemmError(f"{op}: with add_to, out must be float32 (the sums stay FP32), got {out_dtype}")
        for name, array in ((a_name, a), (b_name, b), ("offsets", offsets)):
            if _overlap(out, array):  # the kernel's tiles would overwrite input other tiles still read
                raise GroupedGemmError(f"{op}: out shares memory with {name}; pass a separate out buffer")
    if add_to is not None:
        for name, array in ((a_name, a), (b_name, b), ("offsets", offsets), ("out", out)):
            if array is not None and _overlap(add_to, array):
                raise GroupedGemmError(f"{op}: add_to shares memory with {name}; pass a separate buffer")
    return Problem(op, experts, rows, k, n, out_shape, out_dtype, added_experts)


def _added_experts(op: str, add_to, experts: int, k: int, n: int) -> int:
    """How many experts a wgrad adds into ``add_to`` (0 without it): ``[A, K, N]`` FP32, A <= E."""
    if add_to is None:
        return 0
    if np.dtype(add_to.dtype) != np.float32:
        raise GroupedGemmError(f"{op}: add_to must be float32 (it holds FP32 gradients), got {np.dtype(add_to.dtype)}")
    if add_to.ndim != 3 or tuple(add_to.shape[1:]) != (k, n) or add_to.shape[0] > experts:
        raise GroupedGemmError(f"{op}: add_to must have shape [A, {k}, {n}] with A <= {experts} experts, "
                               f"got {tuple(add_to.shape)}")
    return int(add_to.shape[0])


def _overlap(a, b) -> bool:
    """Whether two contiguous NumPy or CuPy arrays share any byte."""
    def start(array):
        return array.__array_interface__["data"][0] if isinstance(array, np.ndarray) else array.data.ptr
    if a.nbytes == 0 or b.nbytes == 0 or isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        return False
    return start(a) < start(b) + b.nbytes and start(b) < start(a) + a.nbytes


def _check_ndim(op: str, name: str, array, ndim: int) -> None:
    if array.ndim != ndim:
        raise GroupedGemmError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(array.shape)}")


def offsets_error(offsets: np.ndarray, rows: int) -> str | None:
    """Why host ``offsets`` are unusable over ``rows`` rows (the first bad entry, in the order
    the kernel scans), or None."""
    values = np.asarray(offsets, dtype=np.int64)
    if values[0] != 0:
        return offsets_message(kernel_constant(KERNELS, "GG_FIRST_OFFSET_NOT_ZERO"), 0, int(values[0]), rows)
    decrease = np.flatnonzero(values[1:] < values[:-1]) + 1
    past = np.flatnonzero(values > rows)
    first_decrease = int(decrease[0]) if decrease.size else len(values)
    first_past = int(past[0]) if past.size else len(values)
    if first_decrease == first_past == len(values):
        return None
    code = "GG_OFFSETS_DECREASE" if first_decrease <= first_past else "GG_OFFSETS_PAST_ROWS"
    index = min(first_decrease, first_past)
    return offsets_message(kernel_constant(KERNELS, code), index, int(values[index]), rows)


def offsets_message(code: int, index: int, value: int, rows: int) -> str:
    """The words for a bad-offsets record (``code`` as ``raw_kernels/grouped_gemm_common.cuh`` defines it)."""
    if code == kernel_constant(KERNELS, "GG_FIRST_OFFSET_NOT_ZERO"):
        return f"offsets[0] is {value}, expected 0 (expert 0's rows start at row 0)"
    if code == kernel_constant(KERNELS, "GG_OFFSETS_DECREASE"):
        return f"offsets must not decrease: offsets[{index}] = {value} is below offsets[{index - 1}]"
    if code == kernel_constant(KERNELS, "GG_OFFSETS_PAST_ROWS"):
        return f"offsets[{index}] = {value} is past the {rows} rows of the input"
    return f"unknown offsets status code {code} (index {index}, value {value})"
