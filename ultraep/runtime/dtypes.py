"""The element types the library's kernels accept.

bf16 comes from ``ml_dtypes`` (as NumPy and CuPy 14 carry it). That import is deferred to
the first use of a bf16 dtype -- ``BFLOAT16``, ``resolve_dtype("bfloat16")`` or an array
of that type -- so runs that never touch one never load it.
"""

from __future__ import annotations

import functools

import numpy as np

_NAMES = ("float64", "float32", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
_PLAIN = frozenset(np.dtype(n) for n in _NAMES)
_ML_DTYPES = {"bfloat16": "BFLOAT16"}  # ml_dtypes type -> this module's attribute for it
_ALIASES = {"bf16": "bfloat16"}


@functools.cache
def ml_dtype(type_name: str) -> np.dtype | None:
    """The NumPy dtype of ``ml_dtypes.<type_name>``; None without ml_dtypes (bf16 then
    travels as its 16-bit pattern, see dlpack.py)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, type_name))


def __getattr__(name: str):
    for type_name, attribute in _ML_DTYPES.items():
        if attribute == name:
            return ml_dtype(type_name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_supported(dtype: np.dtype) -> bool:
    """Whether the kernels accept ``dtype`` (a NumPy dtype)."""
    if dtype in _PLAIN:
        return True
    # A dtype of this name exists only once ml_dtypes is loaded: the lookup imports nothing new.
    return dtype.name in _ML_DTYPES and dtype == ml_dtype(dtype.name)


def resolve_dtype(dtype, *, what: str = "dtype") -> np.dtype:
    """NumPy dtype for ``dtype`` (a dtype, its name, or 'bfloat16'); ValueError if the kernels don't support it."""
    if isinstance(dtype, str) and _ALIASES.get(dtype, dtype) in _ML_DTYPES:
        resolved = ml_dtype(_ALIASES.get(dtype, dtype))
        if resolved is None:
            raise ValueError(f"{what} {dtype} needs the ml_dtypes package (pip install ml_dtypes)")
        return resolved
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"{what} {dtype!r} is not a dtype") from exc
    if not is_supported(resolved):
        supported = ", ".join(sorted([*_NAMES, *_ML_DTYPES]))
        raise ValueError(f"{what} {resolved} is not supported by ultraep kernels (supported: {supported})")
    return resolved
