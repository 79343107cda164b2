"""Importing framework tensors: zero-copy, dtype/device/layout checks, JAX read-only."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.dtypes import BFLOAT16


def test_numpy_on_cpu_is_zero_copy():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = import_tensor(x, name="x", device=None, writable=True, dtype=np.float32, ndim=2)
    assert np.shares_memory(x, y)


def test_bf16_numpy_round_trip():
    x = np.array([1.5, -2.0, 3.25], dtype=BFLOAT16)
    y = import_tensor(x, name="w", device=None, dtype="bfloat16")
    assert y.dtype == BFLOAT16 and np.array_equal(y.view(np.int16), x.view(np.int16))


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
