"""The built wheel is a working install: it carries every module and every kernel source,
and ``ultraep.runtime.kernels`` finds the kernels in it from outside the checkout. A
checkout without the ``ultraep/raw_kernels`` link finds the top-level ``raw_kernels/``.

The wheel is built from a copy of the checkout (setuptools' ``build/`` would otherwise
collect stale files in the tree) with the test environment's setuptools, so the test
needs no network, and installed into a fresh virtual environment that cannot see the
checkout."""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.name for p in (REPO / "raw_kernels").iterdir() if p.suffix in (".cu", ".cuh"))

# Run by the installed interpreter, from a directory outside the checkout.
CHECK = """
import json, sys
import ultraep
from ultraep.runtime.kernels import declared_kernels, kernel_dir, kernel_source
sources = json.loads(sys.argv[1])
print(json.dumps({
    "package": ultraep.__file__,
    "kernel_dir": str(kernel_dir()),
    "files": sorted(p.name for p in kernel_dir().iterdir()),
    "declared": {name: declared_kernels(kernel_source(name)) for name in sources},
}))
"""


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.wheel
def test_wheel_installs_kernels_outside_the_checkout(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp_path / "dist"), str(source)])
    (wheel,) = (tmp_path / "dist").glob("ultraep-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "ultraep").rglob("*.py")}
    assert modules - packed == set(), "modules missing from the wheel"
    assert {f"ultraep/raw_kernels/{name}" for name in KERNELS} <= packed
    assert "ultraep/py.typed" in packed

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", purelib, str(wheel)])

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ULTRAEP_KERNEL_DIR", "PYTHONPATH")}
    sources = [name for name in KERNELS if name.endswith(".cu")]
    found = json.loads(run([python, "-I", "-c", CHECK, json.dumps(sources)], cwd=workdir, env=env))

    assert Path(found["package"]).is_relative_to(env_dir), found["package"]
    assert Path(found["kernel_dir"]).is_relative_to(env_dir), found["kernel_dir"]
    assert not Path(found["kernel_dir"]).is_symlink()
    assert found["files"] == KERNELS
    for name in sources:
        assert found["declared"][name], f"{name}: no declared kernels found in the installed copy"


def test_checkout_without_the_link_uses_the_top_level_kernels(tmp_path):
    shutil.copytree(REPO / "ultraep", tmp_path / "ultraep", ignore=shutil.ignore_patterns("raw_kernels", "__pycache__"))
    shutil.copytree(REPO / "raw_kernels", tmp_path / "raw_kernels")
    env = {k: v for k, v in os.environ.items() if k not in ("ULTRAEP_KERNEL_DIR", "PYTHONPATH")}
    found = json.loads(run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + CHECK,
                            json.dumps(["planner.cu"])], cwd=tmp_path, env=env))
    assert Path(found["package"]).is_relative_to(tmp_path), found["package"]
    assert found["kernel_dir"] == str(tmp_path / "raw_kernels")
    assert found["declared"]["planner.cu"]
