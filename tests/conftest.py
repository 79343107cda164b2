"""Shared test helpers: GPU detection and launching multi-rank scripts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ultraep.runtime.group import gpu_count
from ultraep.runtime.launch import run_mpi

MPI_SCRIPTS = Path(__file__).parent


requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason="no CUDA GPU / CuPy here: GPU test not run")

# Parametrisation of multi-rank tests over the heap backends: CPU in CI, CUDA IPC on a GPU.
BACKENDS = [pytest.param("host", id="host"),
            pytest.param("device", id="device", marks=[pytest.mark.gpu, requires_gpu])]


def run_ranks(nprocs: int, script: str, *args: str, timeout: float = 120.0, env: dict | None = None):
    """Run ``tests/<script>`` on ``nprocs`` ranks; returns the merged output (raises on failure)."""
    path = MPI_SCRIPTS / script
    merged = dict(os.environ)
    merged.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if env:
        merged.update(env)
    return run_mpi(nprocs, [str(path), *args], timeout=timeout, env=merged).stdout


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request):
    """Before a test that launches ranks (marker ``mpi``), hand the GPU memory this pytest
    process's earlier tests left in CuPy's pool back to the device: the ranks share the GPU
    with it, and their machine profile's fused probe alone asks several GB a rank."""
    cupy = sys.modules.get("cupy")
    if request.node.get_closest_marker("mpi") is not None and cupy is not None and gpu_count() > 0:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def assert_all_ranks_ok(output: str, nprocs: int, tag: str) -> None:
    for rank in range(nprocs):
        assert f"[{tag}] rank {rank} OK" in output, f"rank {rank} did not report {tag} OK:\n{output}"
