"""The package's public API: the names a framework calls, imported lazily, and an import
of the runtime path that loads none of the optional or heavy packages."""

import subprocess
import sys

import ultraep
from ultraep import errors

FRAMEWORK_API = {"EPGroup", "open_heap", "ExpertLayout", "ExpertSpec", "Balancer", "BalanceHandle", "Dispatcher",
                 "Plan", "plan_placement", "reroute", "save_trace", "load_trace", "TraceRecorder", "WeightTransfer"}
ERRORS = {name for name, value in vars(errors).items()
          if isinstance(value, type) and issubclass(value, errors.UltraEPError)}
RUNTIME_PATH = ("runtime", "planner", "transfer", "token", "integration")


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
            "import ultraep.runtime.dlpack, ultraep.token.dispatcher, ultraep.integration.balancer")
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
