"""Benchmarks: ``python -m ultraep.bench <name> [args]``.

Each benchmark is a module with ``main(argv: list[str]) -> int``; ``BENCHMARKS`` maps
names to modules, imported only when asked for, so a benchmark that needs CuPy or MPI
costs nothing to the others.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "plan": "ultraep.bench.plan",
    "plan-kernel": "ultraep.bench.plan_kernel",
    "peer-copy": "ultraep.bench.peer_copy",
    "weight-sync": "ultraep.bench.weight_sync",
    "balancer": "ultraep.bench.balancer",
    "dispatch": "ultraep.bench.dispatch",
    "moe-layer": "ultraep.bench.moe_layer",
}


def _usage() -> str:
    names = "\n".join(f"  {name:<12} {module}" for name, module in BENCHMARKS.items())
    return f"usage: python -m ultraep.bench <name> [args]   (<name> --help for its options)\n\nbenchmarks:\n{names}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module_name = BENCHMARKS.get(name)
    if module_name is None:
        print(f"ultraep.bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the benchmark exists but one of its own imports is missing
        print(f"ultraep.bench: benchmark {name!r} is registered but its module {module_name} "
              f"is not available in this installation", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)
