"""The element types the library's kernels accept, and bf16 through ``ml_dtypes``."""

from __future__ import annotations

import numpy as np

try:  # CuPy 14 and NumPy carry bf16 as ml_dtypes.bfloat16
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # without it bf16 travels as its 16-bit pattern (see dlpack.py)
    BFLOAT16 = None

_NAMES = ("float64", "float32", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
SUPPORTED_DTYPES: frozenset = frozenset([np.dtype(n) for n in _NAMES] + ([BFLOAT16] if BFLOAT16 is not None else []))


def resolve_dtype(dtype, *, what: str = "dtype") -> np.dtype:
    """NumPy dtype for ``dtype`` (a dtype, its name, or 'bfloat16'); ValueError if the kernels don't support it."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        if BFLOAT16 is None:
            raise ValueError(f"{what} bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return BFLOAT16
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"{what} {dtype!r} is not a dtype") from exc
    if resolved not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(d.name for d in SUPPORTED_DTYPES))
        raise ValueError(f"{what} {resolved} is not supported by ultraep kernels (supported: {supported})")
    return resolved
