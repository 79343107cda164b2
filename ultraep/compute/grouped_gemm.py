"""Padding-free grouped GEMM over expert-major rows: forward, dgrad and wgrad.

Rows of expert ``e`` are ``[offsets[e], offsets[e + 1])`` (the Dispatcher's receive
buffer and its ``offsets``), ``offsets[0] = 0``; rows past ``offsets[E]`` are neither read
into any result nor written. BF16 in, FP32 accumulation, BF16 or FP32 out (``out``'s
dtype decides; BF16 when ``out`` is None). K and N must be multiples of 8.

Tensors come from PyTorch, JAX or CuPy through DLPack (zero-copy) and run on the GPU they
live on (a Hopper GPU: the kernels are TMA + wgmma, sm_90a), on the caller's stream (a
torch tensor's current stream, else CuPy's); NumPy arrays (and CPU tensors) run on the
host implementation. The result is ``out`` itself when given (its own memory: sharing bytes
with an input is refused), else a new CuPy (or NumPy) array.

Errors: shapes, dtypes, layout and host-side offsets are checked before anything is
launched or written (:class:`~ultraep.errors.GroupedGemmError`). Offsets on the device
are checked by the kernel without a host round trip: a bad array makes the launch write
nothing and leaves a record that :func:`check_errors` raises.

Determinism: each output element is one FP32 sum in a fixed order (no split-K, no
atomics), so results are identical run to run, and a row's forward output and input
gradient do not depend on which other rows share the call or where its expert starts.
"""

from __future__ import annotations

import numpy as np

from ultraep.compute.checks import OPERANDS, check_problem, offsets_error
from ultraep.compute.host import HostGroupedGemm
from ultraep.errors import GroupedGemmError
from ultraep.runtime.dlpack import caller_stream, framework_of, import_tensor
from ultraep.runtime.dtypes import is_int

_DLPACK_CUDA = 2
_host = HostGroupedGemm()
_devices: dict[int, object] = {}


def grouped_mm(x, w, offsets, out=None):
    """Forward: ``out[rows_e] = x[rows_e] @ w[e]``; ``x [M, K]``, ``w [E, K, N]``,
    ``offsets [E + 1]`` (int32 or int64), ``out [M, N]``."""
    return _run("forward", x, w, offsets, out)


def grouped_mm_dgrad(dy, w, offsets, out=None):
    """Input gradient: ``out[rows_e] = dy[rows_e] @ w[e]^T``; ``dy [M, N]``, ``w [E, K, N]``,
    ``out [M, K]``."""
    return _run("dgrad", dy, w, offsets, out)


def grouped_mm_wgrad(x, dy, offsets, out=None, *, add_to=None):
    """Weight gradient: ``out[e] = x[rows_e]^T @ dy[rows_e]``; ``x [M, K]``, ``dy [M, N]``,
    ``out [E, K, N]`` with ``E = len(offsets) - 1``; all zeros for an expert with no rows.

    ``add_to`` (FP32 ``[A, K, N]``, ``A <= E``): the first ``A`` experts' gradients are added
    into it instead, with no FP32 ``out[e]`` stored, and ``out`` (FP32 ``[E - A, K, N]``) holds
    experts ``A..E-1``: a layer's gradients accumulate with no pass over them and no room for
    their ``dW_e``. The add is one FP32 add an element, as the GPU's memory adds: nearest
    even, subnormal inputs and sums flushed to zeros of their sign
    (:func:`ultraep.compute.host.add_flushing_subnormals`, which the CPU backend uses too)."""
    return _run("wgrad", x, dy, offsets, out, add_to)


def check_errors() -> None:
    """Synchronise every GPU this module has launched on and raise the first bad-offsets
    record its kernels found since the last check (GroupedGemmError)."""
    for device in _devices.values():
        device.check()


def _gpu_of(x, name: str) -> int | None:
    """The CUDA device ``x`` (the operand ``name``) lives on, or None for host memory."""
    kind = framework_of(x)
    if kind == "numpy":
        return None
    if kind == "unknown":
        raise GroupedGemmError(f"{name}: {type(x).__name__} is not a tensor (expected torch, JAX, CuPy or NumPy)")
    device_type, device_id = x.__dlpack_device__()
    return int(device_id) if int(device_type) == _DLPACK_CUDA else None


def _device(gpu: int):
    implementation = _devices.get(gpu)
    if implementation is None:
        from ultraep.compute.device import DeviceGroupedGemm
        implementation = _devices[gpu] = DeviceGroupedGemm(gpu)
    return implementation


def _import(array, name: str, gpu: int | None, writable: bool = False):
    try:
        return import_tensor(array, name=name, device=gpu, writable=writable)
    except ValueError as exc:
        raise GroupedGemmError(str(exc)) from exc


def _import_offsets(offsets, gpu: int | None):
    """``offsets`` imported; a list or tuple becomes int64 if every entry is an int that fits
    (a float, a bool or a string is refused: converting it would round or reinterpret it)."""
    if isinstance(offsets, (list, tuple)):
        for index, value in enumerate(offsets):
            if not is_int(value):
                raise GroupedGemmError(f"offsets: a {type(offsets).__name__} of offsets must hold ints, got "
                                       f"{value!r} ({type(value).__name__}) at index {index}")
            if not -2**63 <= value < 2**63:
                raise GroupedGemmError(f"offsets: offsets[{index}] = {value} does not fit in int64")
        offsets = np.array(offsets, dtype=np.int64)
    return _import(offsets, "offsets", gpu)


def _run(op: str, a, b, offsets, out, add_to=None):
    a_name, b_name = OPERANDS[op]
    gpu = _gpu_of(a, a_name)
    if gpu is None:
        return _run_host(op, a_name, b_name, a, b, offsets, out, add_to)
    import cupy

    with cupy.cuda.Device(gpu), caller_stream(a):
        a_arr, b_arr = _import(a, a_name, gpu), _import(b, b_name, gpu)
        on_host = isinstance(offsets, (list, tuple, np.ndarray))
        offsets_arr = _import_offsets(offsets, None if on_host else gpu)
        out_arr = None if out is None else _import(out, "out", gpu, writable=True)
        add_arr = None if add_to is None else _import(add_to, "add_to", gpu, writable=True)
        problem = check_problem(op, a_arr, b_arr, offsets_arr, out_arr, add_arr)
        if on_host:
            _raise_if_bad(op, offsets_arr, problem.rows)
            offsets_arr = cupy.asarray(offsets_arr)
        implementation = _device(gpu)
        result = implementation.allocate(problem) if out_arr is None else out_arr
        implementation.run(problem, a_arr, b_arr, offsets_arr, result, add_arr)
    return result if out is None else out


def _run_host(op, a_name, b_name, a, b, offsets, out, add_to):
    a_arr, b_arr = _import(a, a_name, None), _import(b, b_name, None)
    offsets_arr = _import_offsets(offsets, None)
    out_arr = None if out is None else _import(out, "out", None, writable=True)
    add_arr = None if add_to is None else _import(add_to, "add_to", None, writable=True)
    problem = check_problem(op, a_arr, b_arr, offsets_arr, out_arr, add_arr)
    _raise_if_bad(op, offsets_arr, problem.rows)
    result = np.zeros(problem.out_shape, dtype=problem.out_dtype) if out_arr is None else out_arr
    _host.run(problem, a_arr, b_arr, offsets_arr, result, add_arr)
    return result if out is None else out


def _raise_if_bad(op: str, offsets: np.ndarray, rows: int) -> None:
    message = offsets_error(offsets, rows)
    if message is not None:
        raise GroupedGemmError(f"{op}: {message}")
