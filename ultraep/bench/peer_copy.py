"""``python -m ultraep.bench peer-copy``: the heap's peer-copy kernel against a plain
device-to-device copy of the same bytes, measured in the same run.

Rank 0 copies a buffer from its heap into rank 1's heap (CUDA IPC; on one GPU both heaps
share HBM) with ``copy_bytes``; the baseline is CuPy's device-to-device copy
(``cudaMemcpyAsync``) of the same bytes inside rank 0's heap. Bandwidth counts bytes read
plus bytes written, like the anchor's 4.3 TB/s. Started with one process, it relaunches
itself on two ranks under ``mpiexec``.
"""

from __future__ import annotations

import argparse

import numpy as np

from ultraep.runtime.launch import DefaultsHelpFormatter, multi_rank_main, positive_int
from ultraep.runtime.sm_partition import usable_sms



def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench peer-copy", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--sizes-mib", type=positive_int, nargs="+", default=[64, 256, 1024], help="buffer sizes (MiB)")
    parser.add_argument("--blocks-per-sm", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="grid sizes to try, per SM")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed repetitions (median reported)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: 2, command=["-m", "ultraep.bench", "peer-copy"])


def run(args) -> int:
    import cupy
    from mpi4py import MPI

    from ultraep.bench.report import print_table, write_json
    from ultraep.bench.timing import graph_ms
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime import open_heap
    from ultraep.runtime.kernels import get_function

    group = EPGroup(MPI.COMM_WORLD)
    if group.size < 2 or not group.has_gpu:
        raise SystemExit("peer-copy needs 2 ranks and a GPU")
    copy = get_function("heap.cu", "copy_bytes", group=group)
    sms = usable_sms(group.device)
    rows = []
    for size_mib in args.sizes_mib:
        nbytes = size_mib << 20
        with open_heap(group, 3 * nbytes + (1 << 20), backend="device") as heap:
            src = heap.alloc("src", (nbytes,), np.uint8)
            dst = heap.alloc("dst", (nbytes,), np.uint8)
            local_dst = heap.alloc("local_dst", (nbytes,), np.uint8)
            if group.rank == 0:
                src.local[...] = cupy.random.randint(0, 256, nbytes, dtype=np.uint8)
            dst.local.fill(0xA5)
            cupy.cuda.get_current_stream().synchronize()
            heap.barrier()
            if group.rank == 0:
                peer = dst.peer(1)
                d2d_ms = graph_ms(lambda: local_dst.local.__setitem__(Ellipsis, src.local), args.repeats)
                best = None
                for per_sm in args.blocks_per_sm:
                    grid = sms * per_sm
                    ms = graph_ms(lambda: copy((grid,), (512,), (src.local, peer, np.uint64(nbytes))), args.repeats)
                    if best is None or ms < best[0]:
                        best = (ms, grid)
                cupy.cuda.get_current_stream().synchronize()
                assert bool(cupy.array_equal(peer, src.local)), "peer copy result differs from its source"
                peer_ms, grid = best
                rows.append({
                    "size_mib": size_mib,
                    "d2d_tb_s": 2 * nbytes / d2d_ms / 1e9,
                    "peer_copy_tb_s": 2 * nbytes / peer_ms / 1e9,
                    "ratio": d2d_ms / peer_ms,
                    "grid": grid,
                    "d2d_ms": d2d_ms,
                    "peer_copy_ms": peer_ms,
                })
            group.barrier()  # host barrier: rank 1 must not spin on the GPU while rank 0 measures
    if group.rank == 0:
        columns = ["size_mib", "d2d_tb_s", "peer_copy_tb_s", "ratio", "grid", "d2d_ms", "peer_copy_ms"]
        print_table(rows, columns,
                    title="peer-copy kernel into a peer's heap vs device-to-device copy (read+write bytes)")
        if args.json:
            write_json(args.json, {"benchmark": "peer-copy", "ranks": group.size, "rows": rows})
    return 0
