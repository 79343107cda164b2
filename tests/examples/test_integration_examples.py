"""The integration examples run as written: the NumPy/CuPy framework on the CPU backend in
CI (and on the GPU), the PyTorch and JAX examples on the GPU."""

import importlib.util
import re
from pathlib import Path

import pytest

from tests.conftest import requires_gpu
from ultraep.runtime.group import gpu_count
from ultraep.runtime.launch import run_mpi

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RANKS = 4
FP8 = ["float8_e4m3fn", "float8_e5m2"]


def requires(module):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed here")


def run_example(name, *args, timeout=300):
    return run_mpi(RANKS, [str(EXAMPLES / name), *args], timeout=timeout).stdout


def assert_ranks_ok(out, what):
    for rank in range(RANKS):
        assert f"rank {rank}/{RANKS}" in out and f"{what} OK" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["host", pytest.param("device", marks=[pytest.mark.gpu, requires_gpu])])
def test_cupy_framework_example(backend, tmp_path):
    out = run_example("cupy_framework.py", "--backend", backend, "--out", str(tmp_path))
    assert_ranks_ok(out, "cupy_framework")
    assert "outputs bitwise equal to the unbalanced run: True" in out, out
    assert "in replica order: True" in out, out  # master gradients bitwise, same partial sums
    assert (tmp_path / "cupy_framework_rank_loads.png").is_file()
    assert (tmp_path / "cupy_framework_stage0_trace.npz").is_file()


def assert_fp8_replicas_checked(out, dtype):
    """The FP8 variant compared every synced replica with its master, byte for byte."""
    checked = re.search(rf"{dtype} experts: after every sync (\d+) of (\d+) replica bytes differ", out)
    assert checked and checked.group(1) == "0" and int(checked.group(2)) > 0, out


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@requires("torch")
def test_torch_moe_train_example():
    out = run_example("torch_moe_train.py", "--steps", "4")
    assert_ranks_ok(out, "torch_moe_train")
    assert "balanced busiest rank / mean" in out and "first step: 0 output elements differ" in out, out


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@requires("torch")
def test_torch_moe_train_example_fused():
    """The fused kernels in training: the balanced fused run bitwise the sequential one."""
    out = run_example("torch_moe_train.py", "--steps", "3", "--fused")
    assert_ranks_ok(out, "torch_moe_train")
    assert "first step 0 output elements differ; losses equal at 3 of 3 steps" in out, out


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@requires("torch")
@pytest.mark.parametrize("dtype", FP8)
def test_torch_moe_train_example_with_fp8_weights(dtype):
    out = run_example("torch_moe_train.py", "--steps", "4", "--weight-dtype", dtype)
    assert_ranks_ok(out, "torch_moe_train")
    assert_fp8_replicas_checked(out, dtype)


@pytest.mark.mpi
@requires("torch")
@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the example runs on it (the tests above)")
@pytest.mark.parametrize("dtype", ["bfloat16", *FP8])
def test_torch_moe_train_example_on_the_cpu_backend(dtype):
    out = run_example("torch_moe_train.py", "--steps", "2", "--tokens", "256", "--weight-dtype", dtype)
    assert_ranks_ok(out, "torch_moe_train")
    assert "(cpu): torch_moe_train OK" in out, out
    if dtype == "bfloat16":
        assert "first step: 0 output elements differ" in out, out
    else:
        assert_fp8_replicas_checked(out, dtype)


@pytest.mark.mpi
@requires("torch")
@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the example runs on it (the tests above)")
def test_torch_moe_train_example_fused_on_the_cpu_backend():
    """--fused on the host: the fused layer's task semantics in NumPy, bitwise the sequential
    layer's over every step of training."""
    out = run_example("torch_moe_train.py", "--steps", "2", "--tokens", "256", "--fused")
    assert_ranks_ok(out, "torch_moe_train")
    assert "(cpu): torch_moe_train OK" in out, out
    assert "first step 0 output elements differ; losses equal at 2 of 2 steps" in out, out


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@requires("jax")
def test_jax_moe_forward_example():
    out = run_example("jax_moe_forward.py", "--steps", "3")  # it sets XLA_PYTHON_CLIENT_PREALLOCATE=false
    assert_ranks_ok(out, "jax_moe_forward")
    assert "0 output elements differ" in out, out


@pytest.mark.mpi
@requires("jax")
@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the example runs on it (the test above)")
def test_jax_moe_forward_example_on_the_cpu_backend():
    out = run_example("jax_moe_forward.py", "--steps", "2", "--tokens", "256")
    assert_ranks_ok(out, "jax_moe_forward")
    assert "(cpu): jax_moe_forward OK" in out and "0 output elements differ" in out, out
