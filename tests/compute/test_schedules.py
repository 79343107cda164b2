"""The grouped GEMM's kernel schedules on the host side: names, shared memory, and each one's
nvcc build (no spill the default does not have)."""

import os
import re
import subprocess
from contextlib import nullcontext

import numpy as np
import pytest

from tests.runtime.test_kernels_compile import find_nvcc
from ultraep.compute.checks import KERNELS
from ultraep.compute.device import DEFAULT_SCHEDULES, PLAIN_SCHEDULE, SCHEDULES, DeviceGroupedGemm
from ultraep.errors import GroupedGemmError
from ultraep.runtime.kernels import kernel_constant, kernel_source

# The most dynamic plus static shared memory a block may have on sm_90 (227 KiB).
SM90_BLOCK_SHARED_BYTES = 227 * 1024
STATIC_SHARED_BYTES = 8 * (kernel_constant(KERNELS, "GG_MAX_EXPERTS") + 1) + 1024  # offsets, tile prefix, barriers


def test_every_operation_has_a_default_schedule_that_exists():
    assert set(DEFAULT_SCHEDULES) == {"forward", "dgrad", "wgrad"}
    assert set(DEFAULT_SCHEDULES.values()) <= set(SCHEDULES)


def test_an_unknown_schedule_is_refused_by_name():
    with pytest.raises(GroupedGemmError, match="schedule 'fast' does not exist; schedules: staged, ring"):
        DeviceGroupedGemm(0, "fast")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_fits_a_blocks_shared_memory(schedule):
    shared = kernel_constant(KERNELS, SCHEDULES[schedule][1])
    assert shared + STATIC_SHARED_BYTES <= SM90_BLOCK_SHARED_BYTES


def ptxas_spills(report: str) -> dict[str, int]:
    """Spill store + load bytes per compiled kernel in an ``-Xptxas -v`` report."""
    spills, current = {}, None
    for line in report.splitlines():
        if "Compiling entry function" in line:
            current = line.split("'")[1]
        elif current and "spill stores" in line:
            stores, loads = re.findall(r"(\d+) bytes spill (?:stores|loads)", line)
            spills[current] = int(stores) + int(loads)
    return spills


def compile_schedule(nvcc, schedule: str, tmp_path, extra: tuple = ()) -> dict[str, int]:
    value = kernel_constant(KERNELS, SCHEDULES[schedule][0])
    source = kernel_source(KERNELS)
    cmd = [nvcc, "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", f"-DGG_SCHEDULE={value}", *extra,
           "-I", str(source.parent), "-o", str(tmp_path / f"{schedule}{''.join(extra)}.cubin"), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"nvcc failed on {KERNELS} with schedule {schedule!r}:\n{report}"
    assert "serialized" not in report, f"ptxas serialises wgmma with schedule {schedule!r}:\n{report}"
    return ptxas_spills(report)


def nvcc_or_skip():
    nvcc = find_nvcc()
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is expected on the CI machine but was not found")
        pytest.skip("no nvcc on this machine: compile check not run")
    return nvcc


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != PLAIN_SCHEDULE])
def test_each_schedule_compiles_without_spills_the_plain_one_lacks(schedule, tmp_path):
    nvcc = nvcc_or_skip()
    plain = compile_schedule(nvcc, PLAIN_SCHEDULE, tmp_path)
    spills = compile_schedule(nvcc, schedule, tmp_path)
    assert spills.keys() == plain.keys() and len(spills) == 6
    worse = {kernel: (plain[kernel], spilled) for kernel, spilled in spills.items() if spilled > plain[kernel]}
    assert not worse, f"schedule {schedule!r} spills more than {PLAIN_SCHEDULE!r} (bytes: plain, it): {worse}"


def test_the_tile_stamps_build_of_the_default_schedule_compiles_without_more_spills(tmp_path):
    """scripts/gemm_tile_stamps.py's build (-DGG_TILE_STAMPS): the stamps must not make ptxas
    spill or serialise the MMAs, or the times they record would not be the product's."""
    nvcc = nvcc_or_skip()
    schedule = DEFAULT_SCHEDULES["forward"]
    stamped = compile_schedule(nvcc, schedule, tmp_path, ("-DGG_TILE_STAMPS=1",))
    plain = compile_schedule(nvcc, schedule, tmp_path)
    assert stamped.keys() == plain.keys()
    assert all(stamped[kernel] <= plain[kernel] for kernel in plain), (plain, stamped)
    assert "__device__ long long gg_tile_stamps" in kernel_source(KERNELS).read_text()


def test_each_operation_loads_its_default_schedules_module(monkeypatch):
    """Every operation with GG_SCHEDULE set to its schedule's value (none for the plain
    module), with that schedule's shared memory; no GPU needed."""
    import ultraep.compute.device as device

    loaded = {}

    class Function:
        max_dynamic_shared_size_bytes = 0

    def get_function(filename, name, defines=()):
        loaded[name] = dict(defines)
        return Function()

    monkeypatch.setattr(device, "get_function", get_function)
    gemm = object.__new__(DeviceGroupedGemm)  # no CUDA: only what _kernel reads
    gemm.schedules, gemm._kernels, gemm.device, gemm.defines = dict(DEFAULT_SCHEDULES), {}, 0, ()
    gemm.cp = type("NoCupy", (), {"cuda": type("Cuda", (), {"Device": staticmethod(lambda _: nullcontext())})})
    for op in ("forward", "dgrad", "wgrad"):
        _, shared = gemm._kernel(op, np.dtype(np.float32))
        schedule = DEFAULT_SCHEDULES[op]
        schedule_value = {"GG_SCHEDULE": kernel_constant(KERNELS, SCHEDULES[schedule][0])}
        expected = {} if schedule == PLAIN_SCHEDULE else schedule_value
        assert loaded[f"grouped_mm_{op}<float>"] == expected, op
        assert shared == kernel_constant(KERNELS, SCHEDULES[schedule][1]), op
    assert DEFAULT_SCHEDULES["forward"] == DEFAULT_SCHEDULES["dgrad"] == DEFAULT_SCHEDULES["wgrad"] == "ring"
    # a diagnostic build's -D options come after the schedule's, in a module of their own
    gemm.defines, gemm._kernels = (("GG_TILE_STAMPS", 1),), {}
    gemm._kernel("forward", np.dtype(np.float32))
    assert gemm.module_defines("forward") == (("GG_SCHEDULE", kernel_constant(KERNELS, "GG_RING_STAGED")),
                                              ("GG_TILE_STAMPS", 1))
    assert loaded["grouped_mm_forward<float>"] == dict(gemm.module_defines("forward"))
