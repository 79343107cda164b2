"""The public API is typed: ``mypy --strict`` (configured in pyproject.toml) is clean on
``public_api.py``, which uses every exported name, and every public signature of those
names is annotated (including methods public_api.py does not call)."""

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import ultraep

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_is_clean_on_the_public_api(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e .[test] brings it)")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout


def _public_functions(obj):
    if not inspect.isclass(obj):
        yield obj.__name__, obj
        return
    for attr, value in vars(obj).items():
        if attr.startswith("_") and attr not in ("__init__", "__enter__", "__exit__"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if inspect.isfunction(value):
            yield f"{obj.__name__}.{attr}", value


@pytest.mark.parametrize("name", ultraep.__all__)
def test_every_public_signature_is_annotated(name):
    obj = getattr(ultraep, name)
    unannotated = []
    for qualname, function in _public_functions(obj):
        signature = inspect.signature(function)
        unannotated += [f"{qualname}({p.name})" for p in signature.parameters.values()
                        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
        if signature.return_annotation is inspect.Signature.empty and not qualname.endswith("__init__"):
            unannotated.append(f"{qualname} -> ?")
    assert unannotated == []
    if inspect.isclass(obj):
        assert obj.__dict__.get("__doc__"), f"{name} has no docstring of its own"
