"""Importing framework tensors: zero-copy, dtype/device/layout checks, JAX read-only."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.dtypes import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, bf16_typed, is_bool, is_int


def test_numpy_on_cpu_is_zero_copy():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = import_tensor(x, name="x", device=None, writable=True, dtype=np.float32, ndim=2)
    assert np.shares_memory(x, y)


def test_bf16_numpy_round_trip():
    x = np.array([1.5, -2.0, 3.25], dtype=BFLOAT16)
    y = import_tensor(x, name="w", device=None, dtype="bfloat16")
    assert y.dtype == BFLOAT16 and np.array_equal(y.view(np.int16), x.view(np.int16))


def test_bf16_bits_are_typed_as_bf16_and_other_arrays_left_alone():
    """int16 is how bf16 travels without its type: typed again, the same memory, so a copy
    into bf16 moves the bits (an int16 1 is the bf16 subnormal 2^-133, not 1.0)."""
    bits = np.array([1, 0x3F80, -0x4080], dtype=np.int16)
    typed = bf16_typed(bits)
    assert typed.dtype == BFLOAT16 and np.shares_memory(typed, bits)
    assert typed.astype(np.float32).tolist() == [2.0**-133, 1.0, -1.0]
    for other in (np.ones(3, np.float32), np.ones(3, np.uint16), bits.astype(BFLOAT16)):
        assert bf16_typed(other) is other


@pytest.mark.parametrize("fp8", [FLOAT8_E4M3FN, FLOAT8_E5M2], ids=["e4m3fn", "e5m2"])
def test_fp8_numpy_round_trip_and_its_bits(fp8):
    bits = np.arange(256, dtype=np.uint8)  # every pattern, NaNs included
    y = import_tensor(bits.view(fp8), name="w", device=None, dtype=fp8.name)
    assert y.dtype == fp8 and np.shares_memory(y, bits) and np.array_equal(y.view(np.uint8), bits)
    # an FP8 tensor may arrive as its bytes (a consumer that cannot type it); nothing else may
    assert import_tensor(bits, name="w", device=None, dtype=fp8.name).dtype == np.uint8
    with pytest.raises(ValueError, match=f"w: expected dtype {fp8.name}, got int8"):
        import_tensor(bits.view(np.int8), name="w", device=None, dtype=fp8.name)
    with pytest.raises(ValueError, match="expected dtype bfloat16, got float8"):
        import_tensor(bits.view(fp8), name="w", device=None, dtype="bfloat16")


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_torch_fp8_on_cpu_arrives_typed(name):
    """torch exports FP8 through DLPack only with kDLFloat8 codes (newer versions); where it
    refuses, the import takes a uint8 view of the same bytes and types it again."""
    torch = pytest.importorskip("torch")
    t = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name))
    y = import_tensor(t, name="w", device=None, dtype=name)
    assert y.dtype.name == name and y.ctypes.data == t.data_ptr(), "torch FP8 import copied"
    assert np.array_equal(y.view(np.uint8), np.arange(256, dtype=np.uint8))


@pytest.mark.parametrize("make, needle", [
    (lambda: np.zeros((4, 4), np.float32)[:, ::2], "not C-contiguous"),
    (lambda: np.zeros(3, np.complex64), "not supported"),
    (lambda: np.zeros(3, np.float32), "expected dtype int32"),
    (lambda: [1, 2, 3], "not a tensor"),
])
def test_bad_cpu_inputs_are_named(make, needle):
    with pytest.raises(ValueError, match=needle) as info:
        import_tensor(make(), name="topk_ids", device=None, dtype=np.int32 if "int32" in needle else None)
    assert "topk_ids" in str(info.value)


def test_masked_array_refused():
    x = np.ma.masked_array(np.arange(4, dtype=np.float32), mask=[0, 1, 0, 0])
    with pytest.raises(ValueError, match=r"x: a masked array \(numpy.ma\) is not taken"):
        import_tensor(x, name="x", device=None)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix on purpose
def test_ndarray_subclass_comes_back_a_plain_view_of_the_same_memory():
    """np.matrix indexes and multiplies differently: the library must see a plain ndarray,
    and an output written through it must land in the caller's buffer."""
    out = np.matrix(np.zeros((2, 3), np.float32))
    view = import_tensor(out, name="out", device=None, writable=True)
    assert type(view) is np.ndarray and view.shape == (2, 3) and view[0].shape == (3,)
    view[1, 2] = 5.0
    assert out[1, 2] == 5.0
    plain = np.zeros(4, np.float32)
    assert import_tensor(plain, name="x", device=None) is plain


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix on purpose
def test_grouped_mm_on_the_host_takes_np_matrix_operands():
    from ultraep.compute import grouped_mm
    from ultraep.runtime.dtypes import BFLOAT16

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(BFLOAT16)
    w = rng.standard_normal((2, 8, 16)).astype(BFLOAT16)
    offsets = np.array([0, 2, 5])
    expected = grouped_mm(x, w, offsets, out=np.zeros((5, 16), np.float32))
    out = np.matrix(np.full((5, 16), np.nan, np.float32))
    grouped_mm(np.matrix(x), w, offsets, out=out)
    assert np.array_equal(np.asarray(out), expected)


def test_read_only_array_refused_for_writing():
    x = np.zeros(4, np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        import_tensor(x, name="out", device=None, writable=True)


@pytest.mark.gpu
@requires_gpu
def test_gpu_framework_imports():
    import cupy
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 32, device="cuda:0").to(torch.bfloat16)
    a = import_tensor(t, name="t", device=0, writable=True, dtype="bfloat16")
    assert a.data.ptr == t.data_ptr(), "torch import copied"
    assert np.array_equal(cupy.asnumpy(a.view(np.int16)), t.view(torch.int16).cpu().numpy())
    with pytest.raises(ValueError, match="on cpu, expected cuda:0"):
        import_tensor(torch.zeros(4), name="t", device=0)
    with pytest.raises(ValueError, match="not contiguous"):
        import_tensor(t.t(), name="t", device=0)
    c = cupy.arange(10, dtype=cupy.int32)
    assert import_tensor(c, name="c", device=0) is c
    jax = pytest.importorskip("jax")
    j = jax.numpy.arange(16, dtype=jax.numpy.float32)
    ja = import_tensor(j, name="j", device=0)
    assert np.array_equal(cupy.asnumpy(ja), np.arange(16, dtype=np.float32))
    with pytest.raises(ValueError, match="immutable"):
        import_tensor(j, name="j", device=0, writable=True)
    jb = jax.numpy.ones(8, dtype=jax.numpy.bfloat16)
    assert np.array_equal(cupy.asnumpy(import_tensor(jb, name="jb", device=0).view(np.int16)),
                          np.full(8, 0x3F80, np.int16))
    # torch's current stream becomes CuPy's for the import and the work around it
    from ultraep.runtime.dlpack import caller_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), caller_stream(t):
        assert cupy.cuda.get_current_stream().ptr == side.cuda_stream


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_gpu_fp8_imports(name):
    """torch and JAX FP8 tensors on the GPU: zero-copy, the same bytes, typed where CuPy holds
    the type and as uint8 bytes where it does not; a writable import keeps torch's pointer."""
    import cupy

    from ultraep.runtime.dtypes import cupy_dtype, resolve_dtype

    torch = pytest.importorskip("torch")
    bits = np.arange(256, dtype=np.uint8)
    t = torch.arange(256, dtype=torch.uint8, device="cuda:0").view(getattr(torch, name))
    a = import_tensor(t, name="w", device=0, writable=True, dtype=name)
    assert a.data.ptr == t.data_ptr(), "torch FP8 import copied"
    assert np.dtype(a.dtype) == cupy_dtype(resolve_dtype(name))
    assert np.array_equal(cupy.asnumpy(a.view(np.uint8)), bits)
    h = import_tensor(bits.view(resolve_dtype(name)), name="h", device=0, dtype=name)  # host FP8: one copy
    assert np.array_equal(cupy.asnumpy(h.view(np.uint8)), bits)
    jax = pytest.importorskip("jax")
    j = jax.lax.bitcast_convert_type(jax.numpy.arange(256, dtype=jax.numpy.uint8), getattr(jax.numpy, name))
    ja = import_tensor(j, name="j", device=0, dtype=name)
    assert np.array_equal(cupy.asnumpy(ja.view(np.uint8)), bits)


def test_is_int_takes_python_and_numpy_integers_and_not_bools_or_floats():
    assert is_int(3) and is_int(np.int32(-2)) and is_int(np.uint64(2**63))
    assert not any(is_int(v) for v in (True, np.bool_(True), 3.0, np.float32(3), "3", None, np.arange(2)))


def test_is_bool_takes_python_and_numpy_bools_only():
    assert is_bool(True) and is_bool(False) and is_bool(np.bool_(False))
    assert not any(is_bool(v) for v in (1, 0, np.int8(1), "yes", None, np.array([True]), np.arange(3)))
