"""The element types the library's kernels accept.

bf16 and the two FP8 formats (``float8_e4m3fn``, ``float8_e5m2``) come from ``ml_dtypes``
(as NumPy and CuPy 14 carry them). That import is deferred to the first use of such a
dtype -- ``BFLOAT16``, ``FLOAT8_E4M3FN``, ``resolve_dtype("bfloat16")`` or an array of that
type -- so runs that never touch one never load it. Where a consumer cannot type one of
them, it travels as its bits: bf16 as ``int16``, FP8 as ``uint8`` (:func:`bits_dtype`).
"""

from __future__ import annotations

import functools

import numpy as np

_NAMES = ("float64", "float32", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
_PLAIN = frozenset(np.dtype(n) for n in _NAMES)
# ml_dtypes type -> (this module's attribute for it, the integer type its bits travel as)
_ML_DTYPES = {"bfloat16": ("BFLOAT16", np.int16), "float8_e4m3fn": ("FLOAT8_E4M3FN", np.uint8),
              "float8_e5m2": ("FLOAT8_E5M2", np.uint8)}
ML_DTYPE_NAMES = tuple(_ML_DTYPES)
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
_ALIASES = {"bf16": "bfloat16"}


@functools.cache
def ml_dtype(type_name: str) -> np.dtype | None:
    """The NumPy dtype of ``ml_dtypes.<type_name>``; None without ml_dtypes (bf16 and FP8
    then travel as their bits, see dlpack.py)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, type_name))


def __getattr__(name: str):
    for type_name, (attribute, _) in _ML_DTYPES.items():
        if attribute == name:
            return ml_dtype(type_name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_ml_dtype(dtype: np.dtype) -> bool:
    # A dtype of such a name exists only once ml_dtypes is loaded: the lookup imports nothing new.
    return dtype.name in _ML_DTYPES and dtype == ml_dtype(dtype.name)


def is_supported(dtype: np.dtype) -> bool:
    """Whether the kernels accept ``dtype`` (a NumPy dtype)."""
    return dtype in _PLAIN or _is_ml_dtype(dtype)


def is_fp8(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 formats (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype.name in FP8_NAMES and _is_ml_dtype(dtype)


def bits_dtype(name: str) -> np.dtype | None:
    """The integer type the ml_dtypes type ``name`` travels as where a consumer cannot type
    it (``int16`` for bf16, ``uint8`` for FP8); None for any other name."""
    return np.dtype(_ML_DTYPES[name][1]) if name in _ML_DTYPES else None


def bf16_typed(array):
    """A NumPy array of bf16 that arrived as its bits (``int16``, :func:`bits_dtype`) viewed
    as bf16, so that copying it into bf16 moves its bits instead of converting the integers'
    values; any other array as it is."""
    if isinstance(array, np.ndarray) and array.dtype == np.int16:
        return array.view(ml_dtype("bfloat16"))
    return array


@functools.cache
def cupy_dtype(dtype: np.dtype) -> np.dtype:
    """``dtype`` if CuPy can hold arrays of it, else :func:`bits_dtype` (a CuPy that
    registers bf16 but not FP8 holds FP8 tensors as their ``uint8`` bytes)."""
    import cupy

    try:
        cupy.ndarray((0,), dtype=dtype)
    except (TypeError, ValueError):
        return bits_dtype(dtype.name)
    return dtype


def is_int(value) -> bool:
    """Whether ``value`` is a Python or NumPy integer, a bool not counting as one (True
    would otherwise pass for 1 wherever a count, size or index is checked)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_bool(value) -> bool:
    """Whether ``value`` is True or False, Python's or NumPy's (a truthy string, number or
    array is not: it would be read as on, or raise NumPy's truth-value error later)."""
    return isinstance(value, (bool, np.bool_))


def resolve_dtype(dtype, *, what: str = "dtype") -> np.dtype:
    """NumPy dtype for ``dtype`` (a dtype, its name, 'bfloat16', 'float8_e4m3fn' or
    'float8_e5m2'); ValueError if the kernels don't support it."""
    if dtype is None:  # np.dtype(None) would be float64: a default nobody chose
        raise ValueError(f"{what} is None: name a dtype (e.g. 'bfloat16' or 'float32')")
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


FP32_SMALLEST_NORMAL = np.finfo(np.float32).tiny


def flush_subnormals(x: np.ndarray) -> np.ndarray:
    """FP32 ``x`` with its subnormals replaced by a zero of their sign: what the device's
    FP32 arithmetic does to its operands and results (CuPy compiles every RawModule with
    -ftz=true), so the NumPy references flush after each FP32 operation too."""
    return np.where(np.abs(x) < FP32_SMALLEST_NORMAL, np.copysign(np.float32(0), x), x)
