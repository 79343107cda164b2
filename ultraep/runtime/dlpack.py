"""Framework tensors in: PyTorch, JAX, CuPy and NumPy arrays as CuPy/NumPy arrays.

Imports are zero-copy where the producer allows (DLPack). bf16 and FP8 tensors a producer
cannot export typed (torch refuses FP8 through DLPack before DLPack 1.1's kDLFloat8
codes) are imported as a view of their bits -- ``int16`` for bf16, ``uint8`` for FP8 --
and typed again where the consumer holds the ml_dtypes type (NumPy with ml_dtypes; CuPy
where it registers the type), else left as bits. Work on a torch tensor runs on torch's current stream
(:func:`caller_stream`). JAX arrays are immutable: asking for a writable import of one is
an error, so the library never writes into a JAX buffer. Every check names the tensor
and says what was expected.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ultraep.runtime.dtypes import ML_DTYPE_NAMES, bits_dtype, cupy_dtype, is_supported, ml_dtype, resolve_dtype


def framework_of(x) -> str:
    module = type(x).__module__.split(".")[0]
    if module in ("torch", "cupy", "numpy"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    return "dlpack" if hasattr(x, "__dlpack__") else "unknown"


@contextlib.contextmanager
def caller_stream(x):
    """Make the stream the caller's framework is using CuPy's current stream (torch only;
    CuPy's own current stream is already the caller's; JAX exports are synchronised by DLPack)."""
    if framework_of(x) == "torch" and x.is_cuda:
        import cupy
        import torch
        stream = torch.cuda.current_stream(x.device)
        with cupy.cuda.Device(x.device.index), external_stream(cupy, stream, x.device.index):
            yield
    else:
        yield


def external_stream(cupy, stream, device: int):
    """CuPy view of a foreign stream (``Stream.from_external`` from CuPy 14, ``ExternalStream`` before)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device)


def import_tensor(x, *, name: str, device: int | None, writable: bool = False, dtype=None, ndim: int | None = None):
    """``x`` as a CuPy array on GPU ``device`` (or a NumPy array when ``device`` is None).

    Raises ValueError naming ``name`` when ``x`` is on the wrong device, not contiguous,
    of an unsupported or unexpected dtype or rank, or immutable but ``writable`` is asked.
    """
    kind = framework_of(x)
    if kind == "unknown":
        raise ValueError(f"{name}: {type(x).__name__} is not a tensor "
                         "(expected torch, JAX, CuPy or NumPy, or any DLPack producer)")
    if isinstance(x, np.ma.MaskedArray):  # its data would be read with the masked values in it
        raise ValueError(f"{name}: a masked array (numpy.ma) is not taken: its masked values would be read as "
                         "data; pass its .filled(value) or .data")
    if writable and kind == "jax":
        raise ValueError(f"{name}: JAX arrays are immutable and are never written; "
                         "pass a torch/CuPy/NumPy buffer for outputs")
    if kind in ("torch", "cupy") and not _contiguous(x, kind):
        raise ValueError(f"{name}: tensor is not contiguous (strides {tuple(_strides(x, kind))}); "
                         "call .contiguous() first")
    array = (_import_gpu(x, kind, name, device, writable) if device is not None
             else _import_host(x, kind, name, writable))
    _check_dtype(array, name, dtype)
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(array.shape)}")
    return array


def _contiguous(x, kind: str) -> bool:
    return x.is_contiguous() if kind == "torch" else bool(x.flags.c_contiguous)


def _strides(x, kind: str):
    return x.stride() if kind == "torch" else x.strides


def _import_gpu(x, kind: str, name: str, device: int, writable: bool):
    import cupy

    where = _device_of(x, kind)
    if where != ("cuda", device):
        shown = "cpu" if where[0] == "cpu" else f"{where[0]}:{where[1]}"
        if kind == "numpy" and not writable:  # host data for a device op: one explicit copy
            return cupy.asarray(x.view(cupy_dtype(x.dtype)) if x.dtype.name in ML_DTYPE_NAMES else x)
        raise ValueError(f"{name}: tensor is on {shown}, expected cuda:{device} (this rank's GPU)")
    if kind == "cupy":
        return x
    with cupy.cuda.Device(device), caller_stream(x):
        return _from_dlpack(cupy.from_dlpack, x, kind)


def _import_host(x, kind: str, name: str, writable: bool):
    where = _device_of(x, kind)
    if where[0] != "cpu":
        raise ValueError(f"{name}: tensor is on {where[0]}:{where[1]}, "
                         "but this group runs the CPU backend (expected a host array)")
    if kind == "numpy":
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: array is not C-contiguous (strides {x.strides}); use numpy.ascontiguousarray")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: array is read-only but is written by this call")
        return np.asarray(x)  # a subclass (np.matrix: indexing keeps 2-D, * multiplies) as a plain view
    return _from_dlpack(np.from_dlpack, x, kind)


def _from_dlpack(consumer, x, kind: str):
    """Zero-copy import; a bf16 or FP8 tensor the consumer cannot type travels as its bits."""
    try:
        return consumer(x)
    except (TypeError, ValueError, RuntimeError, BufferError) as exc:
        name = _ml_dtype_name(x)
        if name is None:
            raise
        try:
            array = consumer(_bits_view(x, kind, bits_dtype(name)))
        except Exception:
            raise exc from None
        typed = ml_dtype(name)
        if typed is None:
            return array
        holds = typed if consumer is np.from_dlpack else cupy_dtype(typed)
        return array.view(holds) if holds != array.dtype else array


def _ml_dtype_name(x) -> str | None:
    """The ml_dtypes type name of ``x``'s elements (bf16, FP8; torch and JAX name them alike), or None."""
    name = str(getattr(x, "dtype", "")).removeprefix("torch.")
    return name if name in ML_DTYPE_NAMES else None


def _bits_view(x, kind: str, bits: np.dtype):
    if kind == "torch":
        import torch
        return x.view(getattr(torch, bits.name))
    if kind == "jax":
        import jax
        return jax.lax.bitcast_convert_type(x, bits.name)
    return x


def _device_of(x, kind: str) -> tuple[str, int]:
    if kind == "numpy":
        return ("cpu", 0)
    if kind == "cupy":
        return ("cuda", x.device.id)
    if kind == "torch":
        return ("cuda", x.device.index) if x.is_cuda else (x.device.type, x.device.index or 0)
    if kind == "jax":
        (dev,) = x.devices()
        return ("cuda", dev.id) if dev.platform == "gpu" else (dev.platform, dev.id)
    dev_type, dev_id = x.__dlpack_device__()
    return ("cuda", int(dev_id)) if int(dev_type) == 2 else ("cpu", 0)


def _check_dtype(array, name: str, expected) -> None:
    dtype = np.dtype(array.dtype)
    if not is_supported(dtype):
        raise ValueError(f"{name}: dtype {dtype} is not supported by ultraep kernels")
    if expected is not None:
        want = resolve_dtype(expected, what=f"{name} expected dtype")
        bits = bits_dtype(want.name)  # bf16 or FP8 may arrive as its bits; None for the others
        if dtype != want and (bits is None or dtype != bits):  # np.dtype(None) is float64: never compare to it
            raise ValueError(f"{name}: expected dtype {want}, got {dtype}")
