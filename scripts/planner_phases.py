"""Where the planner kernel's time goes, phase by phase (GPU, a profiling aid).

Builds a copy of ``raw_kernels/planner.cu`` with ``%globaltimer`` stamps (thread 0 of
every cluster block at each phase boundary, and each probe warp around its oracle run),
runs it on the anchor cases (EP64, top-8, 8192 tokens per rank, S=2, as ``bench
plan-kernel``) and prints the median phase times in microseconds for block 0 and for the
block that finishes last, block 0's set-up and output steps in detail, next to the
device time of a plain graph replay of the stamped build. The stamps cost about 0.5 us in all. The stamps are placed
by the kernel's comment lines; when the kernel changes, an anchor that moved stops the
script with an AssertionError naming it. ``--source`` compares variants of the kernel
in one run (each plan is also checked bit for bit against the NumPy planner).

    python scripts/planner_phases.py [--repeats 30] [--source A.cu --source B.cu]
    # with the package installed (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse

import numpy as np

PHASES = ["stage", "exchange", "orders+bounds", "search", "push-sync", "outputs", "split"]
SPLIT_STEPS = ["deficit set-up", "shares", "scans", "rows"]
# Finer steps of block 0 (stamp pairs): the set-up before the search and the outputs after it.
DETAIL = [(0, 11, "stage loads"), (11, 1, "cluster start"), (1, 2, "exchange"), (2, 12, "rank sums"),
          (12, 13, "orders"), (13, 3, "bounds"), (4, 5, "push"), (5, 14, "rebuild"), (14, 15, "expert outputs"),
          (15, 6, "rank outputs")]
TIMER = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));'


def stamped_source(source: str) -> str:
    """planner.cu with stamps: g_stamps[16 * block + 0..7] phases, [+ 8..10] split steps, [+ 11..15]
    finer steps (DETAIL), g_probe per probe."""
    def stamp(index):
        return (f"{{ __syncwarp(); if (blockIdx.x < CLUSTER && threadIdx.x == 0) {{ unsigned long long t; {TIMER} "
                f"g_stamps[16 * blockIdx.x + {index}] = t; }} }}\n")

    def insert(text, anchor, addition, after=True, occurrence=1):
        position = -1
        for _ in range(occurrence):
            position = text.find(anchor, position + 1)
            assert position >= 0, f"anchor not found in planner.cu: {anchor!r}"
        if after:
            position = text.index("\n", position) + 1
        return text[:position] + addition + text[position:]

    for index, anchor, after, occurrence in [
            (0, " smem[];\n", True, 2),  # the kernel's, not the oracle's
            (1, "// every block of the cluster is running", True, 1),
            (2, "// every block holds all the domain's expert loads", True, 1),
            (3, "    // 2. Threshold search.", False, 1),
            (4, "    // 3. Every block holds the winner", False, 1),
            (5, "// the last pushes are complete", True, 1),
            (6, "    // Split (quota.locality_split)", False, 1),
            (8, "        // Proportional shares floor(d * capacity / total)", False, 1),
            (9, "        warp_inclusive_scan(column, ", False, 1),
            (10, "    // Each source's row of K prefixes", False, 1),
            (11, "    __syncthreads();      // the block's partial sums are complete", True, 1),
            (12, "    // Orders by counting how many items precede each one", False, 1),
            (13, "    // Search bounds (every warp computes them)", False, 1),
            (14, "    // This block's experts: placement rows [K]", False, 1),
            (15, "    // This block's ranks: slot contents and loads after balancing.", False, 1)]:
        source = insert(source, anchor, stamp(index), after, occurrence)
    source = insert(source, "            tau = probe_point(lo, hi, probe, &active);", "            unsigned long long "
                    "probe_start; { unsigned long long t; " + TIMER + " probe_start = t; }\n")
    source = insert(source, "            if (cap_round && probe == 0) send_cap_outcome(",
                    "            { unsigned long long t; " + TIMER + " if (lane == 0 && blockIdx.x < CLUSTER) { "
                    "g_probe[2 * probe] = probe_start; g_probe[2 * probe + 1] = t; g_probe_moves[probe] = count; } }\n",
                    after=False)
    end = source.rstrip().rfind("}")  # the kernel is the file's last function
    source = source[:end] + "    __syncthreads();\n" + stamp(7) + source[end:]
    return ("__device__ unsigned long long g_stamps[16 * 8];\n__device__ unsigned long long g_probe[64];\n"
            "__device__ int g_probe_moves[32];\n" + source)


def replicated_per_block(plan, layout) -> list[int]:
    """The split's work items of each cluster block (its share of the domain's experts)."""
    counts = plan.replica_count.get() > 1
    share = -(-layout.num_experts // 8)
    return [int(counts[b * share:(b + 1) * share].sum()) for b in range(8)]


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

    import ultraep.planner.cuda as planner_cuda
    from ultraep.bench.timing import graph_ms
    from ultraep.planner import ExpertLayout, plan_placement
    from ultraep.analysis.traces import zipf_loads
    from ultraep.runtime.kernels import COMPILE_OPTIONS, declared_kernels, inline_local_includes

    path = pathlib.Path(source)
    module = cupy.RawModule(code=stamped_source(inline_local_includes(path)), options=COMPILE_OPTIONS,
                            name_expressions=declared_kernels(path))

    def kernel(filename, name, shared_bytes):  # planner_cuda._kernel, on the stamped module
        function = module.get_function(name)
        if shared_bytes > 48 * 1024:
            function.max_dynamic_shared_size_bytes = shared_bytes
        return function

    planner_cuda._kernel = kernel
    stamps, probes, moves = (module.get_global(name) for name in ("g_stamps", "g_probe", "g_probe_moves"))
    for experts in (128, 256):
        for target in (1.5, 2.0, 3.0):
            layout = ExpertLayout(64, experts, 2)
            loads = cupy.asarray(zipf_loads(64, experts, 8, 8192, target, 0))
            out = planner_cuda.empty_plan(layout)
            for cap in (None, 1.005):
                phases, steps, details, slowest, most_moves = [], [], [], [], 0
                last_phases, last_steps, last_start, last_end = [], [], [], []
                for _ in range(repeats):
                    plan_placement(loads, layout, backend="cupy", out=out, target_imbalance=cap)
                    cupy.cuda.Device().synchronize()
                    t = cupy.ndarray((8, 16), np.uint64, stamps).get().astype(np.int64)
                    t -= t[0, 0]
                    last = int(np.argmax(t[:, 7]))  # the block that finished last ends the kernel
                    spans = cupy.ndarray((64,), np.uint64, probes).get().astype(np.int64).reshape(32, 2)
                    phases.append(np.diff(t[0, :8]))
                    steps.append(np.diff(t[0, [6, 8, 9, 10, 7]]))
                    details.append([t[0, stop] - t[0, start] for start, stop, _ in DETAIL])
                    last_phases.append(np.diff(t[last, :8]))
                    last_start.append(t[last, 0])
                    last_end.append(t[last, 7] - t[0, 7])
                    last_steps.append(np.diff(t[last, [6, 8, 9, 10, 7]]))
                    slowest.append((spans[:, 1] - spans[:, 0]).max())
                    most_moves = max(most_moves, int(cupy.ndarray((32,), np.int32, moves).get().max()))
                expected = plan_placement(loads.get(), layout, target_imbalance=cap)
                equal = all(np.array_equal(cupy.asnumpy(getattr(out, name)), getattr(expected, name))
                            for name in expected.ARRAYS)
                held = graph_ms(lambda: plan_placement(loads, layout, backend="cupy", out=out, target_imbalance=cap),
                                100)
                print(f"E={experts} target={target} cap={cap}: replay {held * 1e3:.2f} us, "
                      f"slowest probe {np.median(slowest) / 1e3:.2f} us ({most_moves} moves), "
                      f"replicated experts per block {replicated_per_block(out, layout)}"
                      + ("" if equal else " | NOT EQUAL TO NUMPY"))
                for name, block_phases, block_steps in (("block 0", phases, steps),
                                                        ("last block", last_phases, last_steps)):
                    phase_us = np.median(block_phases, axis=0) / 1e3
                    step_us = np.median(block_steps, axis=0) / 1e3
                    print(f"    {name}: stamped {phase_us.sum():.2f} us | "
                          + ", ".join(f"{n} {v:.2f}" for n, v in zip(PHASES, phase_us))
                          + " | split: " + ", ".join(f"{n} {v:.2f}" for n, v in zip(SPLIT_STEPS, step_us)))
                detail_us = np.median(details, axis=0) / 1e3
                print("    block 0 in detail: " + ", ".join(f"{name} {v:.2f}" for (_, _, name), v in zip(DETAIL, detail_us)))
                print(f"    the last block starts {np.median(last_start) / 1e3:.2f} us and ends "
                      f"{np.median(last_end) / 1e3:.2f} us after block 0")


if __name__ == "__main__":
    main()
