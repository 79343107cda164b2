"""Where the planner kernel's time goes, phase by phase (GPU, a profiling aid).

Compiles ``raw_kernels/planner.cu`` with ``-DPLANNER_PHASE_STAMPS``, which turns on its
``PHASE_STAMP`` / ``PROBE_STAMP`` macros (``%globaltimer`` stamps by thread 0 of every
cluster block at each phase boundary, and by each probe warp around its oracle run),
runs it on the anchor cases (EP64, top-8, 8192 tokens per rank, S=2, as ``bench
plan-kernel``) and prints the median phase times in microseconds for block 0 and for the
block that finishes last, block 0's set-up and output steps in detail, next to the
device time of a plain graph replay of the stamped build. ``--source`` compares variants
of the kernel in one run (each plan is also checked bit for bit against the NumPy
planner).

    python scripts/planner_phases.py [--repeats 30] [--source A.cu --source B.cu]
    # with the package installed (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
import re

import numpy as np

# Phases of a block (consecutive stamps), the split's steps, and finer steps of block 0,
# by the names of the kernel's PhaseStamp enum.
PHASES = [("stage", "START", "CLUSTER_STARTED"), ("exchange", "CLUSTER_STARTED", "EXCHANGED"),
          ("orders+bounds", "EXCHANGED", "SEARCH"), ("search", "SEARCH", "SEARCH_DONE"),
          ("push-sync", "SEARCH_DONE", "MOVES_RECEIVED"), ("outputs", "MOVES_RECEIVED", "SPLIT"),
          ("split", "SPLIT", "END")]
SPLIT_STEPS = [("deficit set-up", "SPLIT", "SHARES"), ("shares", "SHARES", "SCANS"), ("scans", "SCANS", "ROWS"),
               ("rows", "ROWS", "END")]
DETAIL = [("stage loads", "START", "STAGED"), ("cluster start", "STAGED", "CLUSTER_STARTED"),
          ("exchange", "CLUSTER_STARTED", "EXCHANGED"), ("rank sums", "EXCHANGED", "ORDERS"),
          ("orders", "ORDERS", "BOUNDS"), ("bounds", "BOUNDS", "SEARCH"), ("push", "SEARCH_DONE", "MOVES_RECEIVED"),
          ("rebuild", "MOVES_RECEIVED", "EXPERT_OUTPUTS"), ("expert outputs", "EXPERT_OUTPUTS", "RANK_OUTPUTS"),
          ("rank outputs", "RANK_OUTPUTS", "SPLIT")]
DEFINE = "-DPLANNER_PHASE_STAMPS"


def stamp_indices(source: str) -> dict[str, int]:
    """The kernel's PhaseStamp enum: name (without STAMP_) -> index; "STAMPS" is the count."""
    body = re.search(r"enum PhaseStamp \{([^}]*)\}", source).group(1)
    return {name.strip().removeprefix("STAMP_"): i for i, name in enumerate(body.split(",")) if name.strip()}


def replicated_per_block(plan, layout) -> list[int]:
    """The split's work items of each cluster block (its share of the domain's experts)."""
    from ultraep.planner.device import PLAN_CLUSTER

    counts = plan.replica_count.get() > 1
    share = -(-layout.num_experts // PLAN_CLUSTER)
    return [int(counts[b * share:(b + 1) * share].sum()) for b in range(PLAN_CLUSTER)]


def main() -> None:
    from ultraep.runtime.kernels import kernel_source

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--source", action="append", help="a variant of planner.cu (default: the package's)")
    args = parser.parse_args()
    for source in args.source or [str(kernel_source("planner.cu"))]:
        print(f"== {source}")
        time_phases(source, args.repeats)


def time_phases(source: str, repeats: int) -> None:
    import pathlib

    import cupy

    from ultraep.bench.timing import graph_ms
    from ultraep.analysis.traces import zipf_loads
    from ultraep.planner import DevicePlanner, ExpertLayout, plan_placement
    from ultraep.planner.device import PLAN_CLUSTER, PROBES
    from ultraep.runtime.kernels import COMPILE_OPTIONS, declared_kernels, inline_local_includes

    path = pathlib.Path(source)
    code = inline_local_includes(path)
    stamp = stamp_indices(code)
    module = cupy.RawModule(code=code, options=COMPILE_OPTIONS + (DEFINE,), name_expressions=declared_kernels(path))

    class StampedPlanner(DevicePlanner):
        def plan_function(self):
            function = module.get_function(self.kernel_name)
            if self.shared_bytes > 48 * 1024:
                function.max_dynamic_shared_size_bytes = self.shared_bytes
            return function

    def columns(t, spans):
        return np.array([t[..., stamp[stop]] - t[..., stamp[start]] for _, start, stop in spans]).T

    stamps, probes, moves = (module.get_global(name) for name in ("g_stamps", "g_probe", "g_probe_moves"))
    for experts in (128, 256):
        for target in (1.5, 2.0, 3.0):
            layout = ExpertLayout(64, experts, 2)
            loads = cupy.asarray(zipf_loads(64, experts, 8, 8192, target, 0))
            for cap in (None, 1.005):
                planner = StampedPlanner(layout, target_imbalance=cap)
                out = planner.empty_plan()
                phases, steps, details, slowest, most_moves = [], [], [], [], 0
                last_phases, last_steps, last_start, last_end = [], [], [], []
                for _ in range(repeats):
                    planner.plan(loads, out=out)
                    cupy.cuda.Device().synchronize()
                    t = cupy.ndarray((PLAN_CLUSTER, stamp["STAMPS"]), np.uint64, stamps).get().astype(np.int64)
                    t -= t[0, stamp["START"]]
                    last = int(np.argmax(t[:, stamp["END"]]))  # the block that finished last ends the kernel
                    spans = cupy.ndarray((2 * PROBES,), np.uint64, probes).get().astype(np.int64).reshape(PROBES, 2)
                    phases.append(columns(t[0], PHASES))
                    steps.append(columns(t[0], SPLIT_STEPS))
                    details.append(columns(t[0], DETAIL))
                    last_phases.append(columns(t[last], PHASES))
                    last_start.append(t[last, stamp["START"]])
                    last_end.append(t[last, stamp["END"]] - t[0, stamp["END"]])
                    last_steps.append(columns(t[last], SPLIT_STEPS))
                    slowest.append((spans[:, 1] - spans[:, 0]).max())
                    most_moves = max(most_moves, int(cupy.ndarray((PROBES,), np.int32, moves).get().max()))
                expected = plan_placement(loads.get(), layout, target_imbalance=cap)
                equal = all(np.array_equal(cupy.asnumpy(getattr(out, name)), getattr(expected, name))
                            for name in expected.ARRAYS)
                held = graph_ms(lambda: planner.plan(loads, out=out), 100)
                print(f"E={experts} target={target} cap={cap}: replay {held * 1e3:.2f} us, "
                      f"slowest probe {np.median(slowest) / 1e3:.2f} us ({most_moves} moves), "
                      f"replicated experts per block {replicated_per_block(out, layout)}"
                      + ("" if equal else " | NOT EQUAL TO NUMPY"))
                for name, block_phases, block_steps in (("block 0", phases, steps),
                                                        ("last block", last_phases, last_steps)):
                    phase_us = np.median(block_phases, axis=0) / 1e3
                    step_us = np.median(block_steps, axis=0) / 1e3
                    print(f"    {name}: stamped {phase_us.sum():.2f} us | "
                          + ", ".join(f"{n} {v:.2f}" for (n, _, _), v in zip(PHASES, phase_us))
                          + " | split: " + ", ".join(f"{n} {v:.2f}" for (n, _, _), v in zip(SPLIT_STEPS, step_us)))
                detail_us = np.median(details, axis=0) / 1e3
                print("    block 0 in detail: " + ", ".join(f"{n} {v:.2f}" for (n, _, _), v in zip(DETAIL, detail_us)))
                print(f"    the last block starts {np.median(last_start) / 1e3:.2f} us and ends "
                      f"{np.median(last_end) / 1e3:.2f} us after block 0")


if __name__ == "__main__":
    main()
