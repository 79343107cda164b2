"""Every raw_kernels/*.cu compiles for sm_90a with the machine's nvcc; registers and spills
are reported in the test output. The kernels compiled are exactly those each file
declares on its ``//! kernels:`` lines (template instances included)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ultraep.runtime.kernels import declared_kernels, kernel_dir

SOURCES = sorted(kernel_dir().glob("*.cu"))


def find_nvcc():
    return shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if Path(p).exists()), None)


def test_there_are_kernels():
    assert SOURCES, f"no .cu files in {kernel_dir()}"


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_for_sm90a(source, tmp_path, capsys):
    nvcc = find_nvcc()
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is expected on the CI machine but was not found")
        pytest.skip("no nvcc on this machine: compile check not run")
    names = declared_kernels(source)
    wrapper = tmp_path / f"check_{source.stem}.cu"
    takes = "\n".join(f"    (void)&{name};" for name in names)
    wrapper.write_text(f'#include "{source}"\nvoid ultraep_instantiate_declared_kernels() {{\n{takes}\n}}\n')
    cmd = [nvcc, "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           "-c", str(wrapper), "-o", str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{report}"
    summary = summarize_ptxas(report)
    with capsys.disabled():
        print(f"\n{source.name}:\n{summary}")
    for name in names:
        assert re.sub(r"<.*", "", name) in report, f"{name} declared in {source.name} but not compiled"


def summarize_ptxas(report: str) -> str:
    """One line per kernel: registers, shared memory, stack frame and spills."""
    lines, current = [], None
    for line in report.splitlines():
        if "Compiling entry function" in line:
            current = line.split("'")[1]
        elif current and "bytes stack frame" in line:
            frame = line.strip()
        elif current and "Used" in line and "registers" in line:
            lines.append(f"  {current}: {line.split(':', 1)[1].strip()}; {frame}")
            current = None
    return "\n".join(lines)


def test_local_headers_are_inlined_for_nvrtc():
    """CuPy keys its cache on the code string: headers must be part of it."""
    from ultraep.runtime.kernels import inline_local_includes
    for source in SOURCES:
        code = inline_local_includes(source)
        assert '#include "' not in code, f"{source.name} still includes a local header"
    assert "ld.acquire.sys" in inline_local_includes(kernel_dir() / "heap.cu")


def test_the_sources_digest_follows_every_included_header(tmp_path, monkeypatch):
    """A machine profile keeps this digest of the kernels it measured: a change in a header
    that a source includes must change it, a change elsewhere must not."""
    from ultraep.runtime.kernels import sources_digest

    (tmp_path / "a.cu").write_text('#include "common.cuh"\nextern "C" __global__ void a() {}\n')
    (tmp_path / "common.cuh").write_text("#define TILE 128\n")
    (tmp_path / "other.cu").write_text('extern "C" __global__ void other() {}\n')
    monkeypatch.setenv("ULTRAEP_KERNEL_DIR", str(tmp_path))
    before = sources_digest(["a.cu"])
    assert before == sources_digest(("a.cu",)) and len(before) == 16 and sources_digest(()) == ""
    (tmp_path / "other.cu").write_text('extern "C" __global__ void other() { return; }\n')
    assert sources_digest(["a.cu"]) == before
    (tmp_path / "common.cuh").write_text("#define TILE 256\n")
    assert sources_digest(["a.cu"]) != before
    assert sources_digest(["a.cu", "other.cu"]) == sources_digest(["other.cu", "a.cu"])
