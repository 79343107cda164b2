"""Where the weight-sync kernel's time goes, block by block (GPU, a profiling aid).

Builds copies of ``raw_kernels/transfer.cu`` (or the ``--source`` files, same kernel
signature) and of the bare bulk-copy prototype (``bulk_fanout`` in
``scripts/weight_sync_variants.cu``: no tasks, no signalling) with ``%globaltimer`` stamps,
syncs one 37.7 MB expert (hidden 4096, ffn 1536, bf16) to fan-out destinations as
``scripts/weight_sync_variants.py`` does (one process, plain allocations, 132 blocks, six
32 KiB stages), and prints min / median / max over the blocks, in microseconds from the
first block's start, of: the block start, the end of its start-up (after the block
barrier), its first and last bulk load issued, its first and last piece's stores issued,
and the storing warp's end (its writes complete); next to the device time of a plain
graph replay of the stamped build. Every destination is checked byte for byte. The stamps
are placed by source lines; when the kernel changes, an anchor that moved stops the script
with a ValueError naming it.

    python scripts/weight_sync_timeline.py [--fanouts 1 8] [--source A.cu --source B.cu]
    # with the package installed (or PYTHONPATH=.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HIDDEN, FFN, TILE, CHUNK_TILES, STAGES, BLOCKS = 4096, 1536, 32 << 10, 4, 6, 132
FC1, FC2 = 2 * FFN * HIDDEN * 2, HIDDEN * FFN * 2
FLAG_BYTES = 4096  # before the expert in each destination, as a replica slot's chunk flags would be
EVENTS = ["start", "started", "1st load", "1st store", "last load", "last store", "end"]
TIMER = 'unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));'


def stamp(event: str, condition: str = "true", first_only: bool = False) -> str:
    slot = f"g_stamps[8 * blockIdx.x + {EVENTS.index(event)}]"
    once = f" && {slot} == 0" if first_only else ""
    return f"{{ if ({condition}{once}) {{ {TIMER} {slot} = t_; }} }}\n"


def insert(source: str, anchor: str, text: str, after: bool = False, skip: int = 0) -> str:
    """`text` before the first `anchor` (after it, or `skip` characters into it)."""
    at = source.find(anchor)
    if at < 0:
        raise ValueError(f"stamp anchor not found: {anchor!r}")
    at += len(anchor) if after else skip
    return source[:at] + text + source[at:]


def stamped_weight_sync(source: str) -> str:
    source = insert(source, "    __shared__ SyncShared s;\n", stamp("start", "threadIdx.x == 0"), after=True)
    source = insert(source, "    if (s.skip) return;\n", stamp("started", "threadIdx.x == 0"), after=True)
    source = insert(source, "        if (bulk_bytes) bulk_load(", stamp("1st load", first_only=True) + stamp("last load"))
    source = insert(source, "            for (int d = 0; d < num_dests && job.bulk_bytes; ++d)\n",
                    stamp("1st store", first_only=True) + stamp("last store"))
    source = insert(source, "        bulk_wait_done<0>();\n        if (pending)", stamp("end"),
                    skip=len("        bulk_wait_done<0>();\n"))
    return "__device__ unsigned long long g_stamps[8 * 1024];\n" + source


def stamped_bulk_fanout(source: str) -> str:
    head, body = source.split("__global__ void bulk_fanout", 1)
    body = "__global__ void bulk_fanout" + body
    body = insert(body, "    __syncthreads();\n    const i64 pieces", stamp("start", "threadIdx.x == 0"))
    body = insert(body, "    const int lane = threadIdx.x % 32;\n    if (threadIdx.x == 0) {\n",
                  stamp("started", "threadIdx.x == 0"))
    body = insert(body, "            bulk_load(stage_mem + s * piece, src + p * piece",
                  stamp("1st load", first_only=True) + stamp("last load"))
    body = insert(body, "            for (int d = SPREAD ? lane", stamp("1st store", "lane == 0", first_only=True) +
                  stamp("last store", "lane == 0"))
    body = insert(body, "        bulk_wait_done<0>();\n    }\n}", stamp("end", "lane == 0"),
                  skip=len("        bulk_wait_done<0>();\n"))
    return "__device__ unsigned long long g_stamps[8 * 1024];\n" + head + body


def weight_sync_arguments(cupy, src, buffers, fanout: int) -> tuple:
    """``weight_sync``'s arguments for a one-expert plan: rank 0's master to ranks
    1..fanout, no relay."""
    tiles = [-(-FC1 // TILE), -(-FC2 // TILE)]
    chunks = -(-sum(tiles) // CHUNK_TILES)
    tasks = np.array([(0, c, c * CHUNK_TILES, min(c * CHUNK_TILES + CHUNK_TILES, sum(tiles)), 0, fanout, -1, 0)
                      for c in range(chunks)], np.int64)
    arrays = [cupy.asarray(a) for a in (
        tasks, np.array([chunks], np.int32), np.array([(0, FC1, 0), (tiles[0], FC2, FC1)], np.int64),
        np.array([(r, FLAG_BYTES, 0) for r in range(1, fanout + 1)], np.int64),
        np.array([src.data.ptr, src.data.ptr + FC1], np.uint64), np.array([b.data.ptr for b in buffers], np.uint64),
        cupy.zeros(chunks, np.int32), cupy.zeros(4, np.uint64))]
    tasks, count, tensors, dests, sources, peers, done, status = arrays
    return (tasks, count, np.int32(chunks), np.int32(CHUNK_TILES), tensors, np.int32(2), np.int64(TILE),
            np.int32(STAGES), np.int32(TILE), dests, sources, np.int32(2), peers, np.int32(len(buffers)), np.int32(0),
            np.uint64(1), done, np.uint64(10**10), status)


def timeline(cupy, module, launch, src, destinations, repeats: int) -> tuple[float, np.ndarray]:
    """Graph-replay ms of the stamped build, and the median over `repeats` launches of each
    block's stamps (us from the first block's start)."""
    from ultraep.bench.timing import graph_ms

    stamps = cupy.ndarray((1024, 8), np.uint64, module.get_global("g_stamps"))
    for d in destinations:
        d.fill(0xA5)
    replay_ms = graph_ms(launch, 20)
    runs = []
    for _ in range(repeats):
        stamps.fill(0)
        launch()
        cupy.cuda.get_current_stream().synchronize()
        t = stamps.get()[:BLOCKS, :len(EVENTS)].astype(np.int64)
        runs.append((t - t[:, 0].min()) / 1e3)
    for d in destinations:
        if not bool(cupy.array_equal(d[FLAG_BYTES:], src)):
            raise AssertionError("a destination differs from the source")
    return replay_ms, np.median(np.stack(runs), axis=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--source", action="append", help="a transfer.cu to time (default raw_kernels/transfer.cu)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import cupy

    from ultraep.runtime.kernels import COMPILE_OPTIONS, inline_local_includes

    def build(code, names):
        module = cupy.RawModule(code=code, options=COMPILE_OPTIONS, name_expressions=names)
        functions = [module.get_function(n) for n in names]
        for function in functions:
            function.max_dynamic_shared_size_bytes = STAGES * TILE + (8 << 10)
        return module, functions

    kernels = {path: build(stamped_weight_sync(inline_local_includes(Path(path))), ["weight_sync"])
               for path in args.source or ["raw_kernels/transfer.cu"]}
    bare, (bare_kernel,) = build(stamped_bulk_fanout(inline_local_includes(Path("scripts/weight_sync_variants.cu"))),
                                 ["bulk_fanout<0, 0>"])
    src = cupy.random.default_rng(0).integers(0, 255, size=FC1 + FC2, dtype=cupy.uint8)
    buffers = [cupy.zeros(FLAG_BYTES + FC1 + FC2, cupy.uint8) for _ in range(1 + max(args.fanouts))]
    for fanout in args.fanouts:
        print(f"== fan-out {fanout}: min / median / max over {BLOCKS} blocks, us from the first block's start")
        print(f"  {'kernel':34s} {'replay us':>9s} " + " ".join(f"{e:>17s}" for e in EVENTS[1:]))
        rows = []
        for path, (module, (kernel,)) in kernels.items():
            arguments = weight_sync_arguments(cupy, src, buffers, fanout)
            rows.append((path, module, lambda k=kernel, a=arguments: k((BLOCKS,), (96,), a, shared_mem=STAGES * TILE)))
        targets = cupy.asarray(np.array([b.data.ptr + FLAG_BYTES for b in buffers[1:fanout + 1]], np.uint64))
        bare_arguments = (src, targets, np.int64(src.size), np.int32(fanout), np.int32(TILE), np.int32(STAGES))
        rows.append(("bare bulk copy (bulk_fanout<0, 0>)", bare,
                     lambda: bare_kernel((BLOCKS,), (64,), bare_arguments, shared_mem=STAGES * TILE)))
        for label, module, launch in rows:
            replay_ms, t = timeline(cupy, module, launch, src, buffers[1:fanout + 1], args.repeats)
            cells = " ".join(f"{t[:, i].min():5.2f}/{np.median(t[:, i]):5.2f}/{t[:, i].max():5.2f}"
                             for i in range(1, len(EVENTS)))
            print(f"  {label[-34:]:34s} {replay_ms * 1e3:9.1f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
