"""The package's public API: the names a framework calls, imported lazily, and an import
of the runtime path that loads none of the optional or heavy packages."""

import importlib
import subprocess
import sys

import ultraep
from ultraep import errors

FRAMEWORK_API = {"EPGroup", "open_heap", "ExpertLayout", "ExpertSpec", "Balancer", "BalanceHandle", "ReplicaSync",
                 "Dispatcher", "MoELayer", "Plan", "plan_placement", "reroute", "save_trace", "load_trace",
                 "TraceRecorder", "WeightTransfer"}
ERRORS = {name for name, value in vars(errors).items()
          if isinstance(value, type) and issubclass(value, errors.UltraEPError)}
RUNTIME_PATH = ("runtime", "planner", "transfer", "token", "compute", "integration")


def test_public_api_is_the_framework_api_and_every_error():
    assert "UltraEPError" in ERRORS and "StaleHandleError" in ERRORS
    assert set(ultraep.__all__) == FRAMEWORK_API | ERRORS
    assert ultraep.__all__ == sorted(ultraep.__all__)


def test_every_exported_name_resolves():
    for name in ultraep.__all__:
        assert getattr(ultraep, name) is not None, name
    for name in ERRORS:
        assert getattr(ultraep, name) is getattr(errors, name)


def test_analysis_names_are_not_top_level():
    for name in ("lower_bound", "plot_rank_loads", "zipf_loads", "EPLB"):
        assert not hasattr(ultraep, name), name


def _loaded_after(code: str) -> set[str]:
    """Top-level packages of interest that ``code`` loads, in a fresh interpreter."""
    probe = ("import sys\n" + code + "\nwatched = ('mpi4py', 'cupy', 'torch', 'jax', 'scipy', 'matplotlib', "
             "'ml_dtypes')\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules} & set(watched))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_import_ultraep_is_cheap():
    assert _loaded_after("import ultraep") == set()


def test_public_api_and_cpu_path_load_no_optional_package():
    """Neither SciPy nor matplotlib (the ``analysis`` extra), nor ml_dtypes before a bf16 dtype is used."""
    code = ("import ultraep\n"
            "for name in ultraep.__all__: getattr(ultraep, name)\n"
            "import ultraep.runtime.dlpack, ultraep.token.dispatcher, ultraep.integration.balancer\n"
            "ultraep.ExpertSpec([('w', (4, 4), 'float32')], grad_dtype='float32')")
    assert _loaded_after(code) == set()
    code += "\nfrom ultraep.runtime.dtypes import resolve_dtype\nresolve_dtype('bfloat16')"
    assert _loaded_after(code) == {"ml_dtypes"}


def test_no_runtime_path_module_loads_scipy_or_matplotlib():
    code = ("import importlib, pkgutil\n"
            f"for layer in {RUNTIME_PATH!r}:\n"
            "    package = importlib.import_module('ultraep.' + layer)\n"
            "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        try:\n"
            "            importlib.import_module(info.name)\n"
            "        except ModuleNotFoundError as missing:  # device modules need CuPy, absent on a CPU machine\n"
            "            if missing.name != 'cupy':\n"
            "                raise")
    assert _loaded_after(code).isdisjoint({"scipy", "matplotlib"})


def test_type_checkers_see_every_lazy_name_as_it_is_at_run_time():
    """``ultraep/__init__.py``'s TYPE_CHECKING block imports each name of ``_EXPORTS`` from
    its module, and restates ``reroute``'s signature exactly."""
    import ast
    import inspect
    from pathlib import Path

    tree = ast.parse(Path(ultraep.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {alias.asname: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names if alias.asname == alias.name}
    stubs = {node.name: node for node in block.body if isinstance(node, ast.FunctionDef)}
    assert seen.keys() | stubs.keys() == set(ultraep.__all__)
    for name, module in seen.items():
        assert getattr(importlib.import_module(module), name) is getattr(ultraep, name), name
    from ultraep import planner

    planner_tree = ast.parse(inspect.getsource(planner))
    for name, stub in stubs.items():
        real = next(node for node in planner_tree.body if isinstance(node, ast.FunctionDef) and node.name == name)
        assert ast.unparse(stub.args) == ast.unparse(real.args) and ast.unparse(stub.returns) == ast.unparse(
            real.returns), name


def _best_of_3(code: str) -> float:
    """Least wall seconds of ``code`` over three fresh interpreters (after a warm-up run)."""
    probe = "import time\nstart = time.perf_counter()\n" + code + "\nprint(time.perf_counter() - start)"
    runs = []
    for _ in range(4):
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        runs.append(float(result.stdout))
    return min(runs[1:])


def test_import_and_balancer_are_fast_on_the_cpu():
    """The target is 0.3 s (NumPy's own import included); the margin absorbs a loaded CI machine.
    Wall time: process CPU time counts the BLAS threads NumPy starts, more with more cores."""
    wall = _best_of_3("import ultraep\nultraep.Balancer\nultraep.ExpertSpec([('w', (4, 4), 'float32')])")
    assert wall < 0.9, wall
