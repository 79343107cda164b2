"""Benchmarks: ``python -m ultraep.bench <name> [args]``.

Each benchmark is a module with ``main(argv: list[str]) -> int``; ``BENCHMARKS`` names
each one's module (imported only when asked for, so a benchmark that needs CuPy or MPI
costs nothing to the others), whether it needs a GPU, and what it measures.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass



@dataclass(frozen=True)
class Benchmark:
    module: str
    needs_gpu: bool
    summary: str


BENCHMARKS = {
    "plan": Benchmark("ultraep.bench.plan", False,
                      "replay a load trace through every balancing policy: imbalance, replicas, gap to a proven bound"),
    "plan-kernel": Benchmark("ultraep.bench.plan_kernel", True,
                             "planning and reroute kernels on the UltraEP anchor cases (EP64, top-8, S=2)"),
    "peer-copy": Benchmark("ultraep.bench.peer_copy", True,
                           "the heap's peer-copy kernel against a device-to-device copy of the same bytes"),
    "weight-sync": Benchmark("ultraep.bench.weight_sync", True,
                             "weight sync to 1-8 replicas against d2d copies of the same memory traffic"),
    "balancer": Benchmark("ultraep.bench.balancer", False,
                          "exposed cost of balancing one MoE layer (update + weight_sync + reroute)"),
    "dispatch": Benchmark("ultraep.bench.dispatch", True,
                          "dispatch and combine bandwidth against a copy of the same bytes and NCCL all-to-all"),
    "stream-wait": Benchmark("ultraep.bench.stream_wait", True,
                             "what work queued on a second stream behind a wait costs the layer stream's launches"),
    "grouped-gemm": Benchmark("ultraep.bench.grouped_gemm", True,
                              "grouped GEMM forward/dgrad/wgrad TFLOPS against cuBLAS dense, a per-expert loop and "
                              "torch._grouped_mm"),
    "moe-layer": Benchmark("ultraep.bench.moe_layer", False,
                           "MoE layers forward + backward under none / ultraep / ideal, as a ratio to ideal"),
    "moe-fused": Benchmark("ultraep.bench.moe_fused", False,
                           "the fused MoE forward (UniEP persistent kernels) against the sequential path, bitwise "
                           "checked"),
}


def _usage() -> str:
    width = max(map(len, BENCHMARKS))
    names = "\n".join(f"  {name:<{width}}  {bench.summary}{'  [GPU]' if bench.needs_gpu else ''}"
                      for name, bench in BENCHMARKS.items())
    return (f"usage: python -m ultraep.bench <name> [args]   (<name> --help for its options)\n\n"
            f"benchmarks ([GPU]: needs a CUDA GPU and CuPy):\n{names}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):  # the list of benchmarks, as the README shows it
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    bench = BENCHMARKS.get(name)
    if bench is None:
        print(f"ultraep.bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if bench.needs_gpu and not {"-h", "--help"} & set(rest):
        from ultraep.runtime.group import gpu_count
        if gpu_count() == 0:
            print(f"ultraep.bench {name}: needs a CUDA GPU and CuPy; this machine has none", file=sys.stderr)
            return 2
    module_name = bench.module
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the benchmark exists but one of its own imports is missing
        print(f"ultraep.bench: benchmark {name!r} is registered but its module {module_name} "
              f"is not available in this installation", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)
