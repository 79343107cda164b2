"""``python -m ultraep.bench weight-sync``: tile-streaming weight sync against (a) one
``cudaMemcpyAsync`` per replica tensor and (b) one device-to-device ``cudaMemcpyAsync``
that moves as many bytes through memory, measured in the same run.

One master expert (default hidden 4096, ffn 1536, bf16: fc1 ``[2*ffn, hidden]`` and fc2
``[hidden, ffn]``, 37.7 MB) is synced to ``fan-out`` replicas on other ranks (9 ranks
share the GPU, so fan-out 1-8). Bandwidth is bytes delivered to replicas per second
(fan-out x expert bytes). On one GPU every peer is the same HBM, so the bar is the
device-to-device copy; NVLink figures need several GPUs. The tile sync reads the expert
once and writes it fan-out times, ``(1 + fan-out) x expert`` bytes of memory traffic; the
d2d copy is sized to read and write exactly that much (``(1 + fan-out) / 2`` experts), so
``tile_vs_d2d`` compares memory bandwidth like for like (a copy of all the delivered bytes
would move ``2 x fan-out`` experts and flatter the tile sync from fan-out 2 on);
``*_hbm_gb_s`` are bytes read plus written per second. ``tile_*`` time the streaming
kernel; ``bare_vs_d2d`` times the same copy pattern with one pointer table instead of task
tables and chunk flags (``raw_kernels/bench_copy.cu``: an image of the replica slot copied
into the same replica slots, best of the same grids): what this device gives the pattern
at all, and ``tile_vs_bare`` how much of it the sync keeps; ``compile_us`` is what the whole
``weight_sync`` call adds (the plan's device schedule compilation). ``reduce_*``: the
backward's ``reduce_grads`` of the same plan (``--grad-dtype`` gradients, FP32 sums in
replica order): rank 0's master gradient plus each replica's, read from the replica
holders' heaps, written back, ``(2 + fan-out) x gradient`` bytes of traffic, against a d2d
copy of as many (``reduce_vs_d2d``); its result is checked bit for bit once. Started with
one process, it relaunches itself on 9 ranks under ``mpiexec``. Rank 0's columns are timed
as CUDA-graph replays, so Python's launch overhead is not counted.

Group columns (every rank takes part; group windows, :func:`~ultraep.bench.timing.group_window_ms`):
``nccl_gb_s`` sends the master's bytes to each replica holder with one ``batch_isend_irecv``
over NCCL (:mod:`ultraep.bench.nccl`; "not run" where ranks share a GPU), ``tile_vs_nccl``
its time over the tile sync's. With ``--relay-threshold`` a second engine syncs through
relay trees, and the direct and relay syncs (each ending with its heap barrier) are timed
the same way: ``relay_vs_direct``.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

from ultraep.bench.timing import graph_ms, group_window_ms
from ultraep.runtime.kernels import kernel_constant
from ultraep.runtime.launch import DefaultsHelpFormatter, multi_rank_main, non_negative_int, positive_int

FANOUT_COPY_THREADS = kernel_constant("bench_copy.cu", "COPY_THREADS")
FANOUT_COPY_MAX_DESTS = kernel_constant("bench_copy.cu", "COPY_MAX_DESTS")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench weight-sync", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--hidden", type=positive_int, default=4096, help="model width of the synced expert")
    parser.add_argument("--ffn", type=positive_int, default=1536, help="FFN width of the synced expert")
    parser.add_argument("--fanouts", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="replicas per sync, one row each (the run takes the largest + 1 ranks)")
    parser.add_argument("--blocks", type=positive_int, nargs="+", default=None,
                        help="weight-sync grid sizes to try (256 threads each; default: 1/2, 3/4 and all of the "
                             "resident maximum, 4 per SM: 264, 396 and 528 on an H200)")
    parser.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the expert's gradient dtype (reduce_grads' columns; MoELayer keeps float32)")
    parser.add_argument("--tile-kib", type=positive_int, default=32, help="bytes each tile copies, KiB")
    parser.add_argument("--chunk-tiles", type=positive_int, default=4, help="tiles per chunk (one task, one flag)")
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed syncs per figure")
    parser.add_argument("--relay-threshold", type=non_negative_int, default=None,
                        help="also sync through relay trees for more replicas than this (default: no relay run)")
    parser.add_argument("--relay-count", type=positive_int, default=2, help="relays per tree")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: max(args.fanouts) + 1,
                           command=["-m", "ultraep.bench", "weight-sync"])


class FanoutCopy:
    """``source`` (a CuPy uint8 array) to every address of ``dest_ptrs`` (ints) by
    ``fanout_copy`` (raw_kernels/bench_copy.cu): the weight-sync copy pattern without its
    tasks. Checked and uploaded once, so that :meth:`launch` can be captured in a graph."""

    def __init__(self, source, dest_ptrs):
        import cupy

        from ultraep.runtime.kernels import get_function

        if source.dtype != np.uint8 or not source.flags.c_contiguous:
            raise ValueError("the source must be a contiguous uint8 array")
        if len(dest_ptrs) > FANOUT_COPY_MAX_DESTS:
            raise ValueError(f"at most {FANOUT_COPY_MAX_DESTS} destinations, got {len(dest_ptrs)}")
        if any(int(ptr) % 16 for ptr in dest_ptrs):
            raise ValueError("every destination must be 16-byte aligned")
        self.source = source
        self.dest_ptrs = cupy.asarray(np.asarray(dest_ptrs, np.uint64))
        self.kernel = get_function("bench_copy.cu", "fanout_copy")

    def launch(self, blocks: int) -> None:
        """On ``blocks`` blocks of the current stream."""
        if blocks < 1:
            raise ValueError(f"blocks must be at least 1, got {blocks}")
        self.kernel((blocks,), (FANOUT_COPY_THREADS,), (
            self.source, self.dest_ptrs, np.int32(len(self.dest_ptrs)), np.int64(self.source.nbytes)))


def replica_grad_values(spec, rank: int) -> list:
    """What rank ``rank`` writes into its replica slot's gradients: seeded by the rank, so
    rank 0 can make the same values to check the reduction."""
    import cupy

    rng = cupy.random.default_rng(1000 + rank)
    return [rng.standard_normal(g.shape, dtype=np.float32).astype(g.dtype) for g in spec.grads]


def expected_reduction(spec, masters: list, fanout: int) -> list:
    """Rank 0's master gradients after one reduction: FP32 sums in replica order, rounded once."""
    sums = [m.astype(np.float32) for m in masters]
    for rank in range(1, fanout + 1):
        sums = [total + value.astype(np.float32) for total, value in zip(sums, replica_grad_values(spec, rank))]
    return [total.astype(g.dtype) for total, g in zip(sums, spec.grads)]


def check_replicas(group, engine, master_tensors, fanout: int) -> None:
    """Collective: ranks 1..fanout hold rank 0's master bit for bit in replica slot 0."""
    import cupy

    want = group.comm.bcast([w.get() for w in master_tensors] if group.rank == 0 else None, root=0)
    if 1 <= group.rank <= fanout:
        assert all(bool(cupy.array_equal(g.view(np.uint16), cupy.asarray(w).view(np.uint16)))
                   for g, w in zip(engine.replica_weights(0), want)), f"rank {group.rank}: replica differs from master"


def group_columns(group, nccl, engine, relay_engine, plan, fanout: int, expert_bytes: int, row, args) -> None:
    """All ranks: the NCCL and relay columns (see the module docstring), added to rank 0's ``row``."""
    import cupy

    delivered = fanout * expert_bytes
    nccl_ms = nccl.batch_isend_irecv_ms([(0, r, expert_bytes) for r in range(1, fanout + 1)], args.repeats)
    columns = {"nccl_ms": nccl_ms, "nccl_gb_s": nccl.reason if nccl_ms is None else delivered / nccl_ms / 1e6}
    if relay_engine is not None:
        sync = cupy.cuda.get_current_stream().synchronize
        direct_ms = group_window_ms(group, lambda: engine.weight_sync(0, plan), args.repeats, sync)
        relay_ms = group_window_ms(group, lambda: relay_engine.weight_sync(0, plan), args.repeats, sync)
        columns.update(relays=len(relay_engine.schedule(plan).relays.get(0, [])), direct_window_ms=direct_ms,
                       relay_window_ms=relay_ms, relay_gb_s=delivered / relay_ms / 1e6,
                       relay_vs_direct=direct_ms / relay_ms)
    if row is not None:
        row.update(columns, tile_vs_nccl=None if nccl_ms is None else nccl_ms / row["tile_ms"])


def run(args) -> int:
    import cupy
    from mpi4py import MPI

    from ultraep.bench.nccl import NcclBaseline
    from ultraep.bench.report import print_table, write_json
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime import open_heap
    from ultraep.transfer import WeightTransfer
    from ultraep.tune.sync_timing import one_expert, single_expert_plan

    group = EPGroup(MPI.COMM_WORLD)
    R = group.size
    spec, layout = one_expert(args.hidden, args.ffn, R, args.grad_dtype)
    expert_bytes = sum(t.nbytes for t in spec.weights)
    grad_bytes = sum(g.nbytes for g in spec.grads)
    rows = []
    most = max(args.fanouts)
    scratch_bytes = max((most + 1) * expert_bytes, (most + 2) * grad_bytes)  # the d2d copies' traffic
    heap_bytes = 2 * (spec.weight_slot_bytes + spec.grad_slot_bytes) + scratch_bytes
    tiling = dict(tile_bytes=args.tile_kib << 10, chunk_tiles=args.chunk_tiles)
    with NcclBaseline(group) as nccl, open_heap(group, heap_bytes, backend="device") as heap, \
            contextlib.ExitStack() as relay_stack:
        engine = WeightTransfer(heap, layout, spec, relay_threshold=R, **tiling)
        rng = cupy.random.default_rng(group.rank)
        weights = [[rng.standard_normal(t.shape, dtype=np.float32).astype(t.dtype) for t in spec.weights]]
        grads = [[cupy.zeros(t.shape, t.dtype) for t in spec.grads]]
        engine.register_layer(0, weights, grads)
        engines = [engine]
        if args.relay_threshold is not None:
            relay_heap = relay_stack.enter_context(open_heap(group, 2 * (spec.weight_slot_bytes + spec.grad_slot_bytes),
                                                             backend="device"))
            engines.append(relay_stack.enter_context(WeightTransfer(
                relay_heap, layout, spec, relay_threshold=args.relay_threshold, relay_count=args.relay_count,
                **tiling)))
            engines[1].register_layer(0, weights, grads)
        scratch = heap.alloc("bench.scratch", (scratch_bytes,), np.uint8)
        for fanout in args.fanouts:
            plan = single_expert_plan(layout, fanout)
            for each in engines:
                each.weight_sync(0, plan)  # compile, warm up, and check once, collectively
                each.synchronize()
                check_replicas(group, each, weights[0], fanout)
            if 1 <= group.rank <= fanout:
                for view, value in zip(engine.replica_grads(0), replica_grad_values(spec, group.rank)):
                    view[...] = value
            masters = [g.copy() for g in grads[0]] if group.rank == 0 else None
            engine.reduce_grads(0, plan)  # compile, warm up, and check once, collectively
            engine.synchronize()
            if group.rank == 0:
                want = expected_reduction(spec, masters, fanout)
                same = all(bool(cupy.array_equal(g.view(np.uint8), w.view(np.uint8))) for g, w in zip(grads[0], want))
                assert same, "rank 0: reduce_grads differs from the FP32 replica-order sums"
            # Host barriers (a device-side one would keep 8 idle contexts spinning on the
            # shared GPU, time-sliced against the kernels being measured): rank 0 measures
            # alone, after every peer's check (copies and compares on the GPU) has ended.
            group.barrier()
            if group.rank == 0:
                rows.append(measure(engine, plan, weights[0], heap, scratch, fanout, expert_bytes, grad_bytes, args))
            group.barrier()
            group_columns(group, nccl, engine, engines[1] if len(engines) > 1 else None, plan, fanout, expert_bytes,
                          rows[-1] if group.rank == 0 else None, args)
        engine.close()
    if group.rank == 0:
        columns = ["fanout", "mb_delivered", "tile_gb_s", "memcpy_per_replica_gb_s", "tile_hbm_gb_s", "d2d_hbm_gb_s",
                   "tile_vs_memcpy", "tile_vs_d2d", "bare_vs_d2d", "tile_vs_bare", "blocks", "compile_us",
                   "reduce_hbm_gb_s", "reduce_vs_d2d", "reduce_blocks", "nccl_gb_s", "tile_vs_nccl"]
        if args.relay_threshold is not None:
            columns += ["relays", "relay_gb_s", "relay_vs_direct"]
        print_table(rows, columns, title=f"weight sync of one expert ({expert_bytes / 1e6:.1f} MB, bf16; tiles "
                                         f"{args.tile_kib} KiB x {args.chunk_tiles} per chunk) to fan-out replicas, "
                                         f"its {args.grad_dtype} gradients reduced back, "
                                         f"{R} ranks (NCCL: {nccl.reason or 'one rank per GPU'}): bytes delivered "
                                         "per second")
        if args.json:
            write_json(args.json, {"benchmark": "weight-sync", "ranks": R, "hidden": args.hidden, "ffn": args.ffn,
                                   "expert_bytes": expert_bytes, "grad_dtype": args.grad_dtype,
                                   "relay_threshold": args.relay_threshold,
                                   "relay_count": args.relay_count, "nccl": nccl.reason or "run", "rows": rows})
    return 0


def measure(engine, plan, master_tensors, heap, scratch, fanout, expert_bytes, grad_bytes, args) -> dict:
    """Rank 0 alone: in a single-expert plan below the relay threshold only rank 0 has
    tasks and none of them waits on a flag, so it can repeat the sync by itself."""
    import cupy
    from cupy.cuda import runtime

    from ultraep.planner import Plan

    # The streaming kernel alone (the plan's tables were compiled on the device by the
    # checked sync before), then the schedule compile and the copy (not the engine's sync:
    # its plan agreement waits for every rank, and rank 0 measures alone).
    device, entry = engine.impl, engine._layers[0]
    grids = args.blocks or [device.max_sync_blocks * quarters // 4 for quarters in (2, 3, 4)]
    timings = [(graph_ms(lambda: device.run_weight_tasks(entry, device.tables, blocks), args.repeats), blocks)
               for blocks in grids]
    tile_ms, blocks = min(timings)
    device_plan = Plan(layout=plan.layout, imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after,
                       **{name: cupy.asarray(getattr(plan, name)) for name in Plan.ARRAYS})  # capturable compile

    def compile_and_copy():
        device.tables.compile_weights(device_plan)
        device.run_weight_tasks(entry, device.tables, blocks)

    sync_ms = graph_ms(compile_and_copy, args.repeats)
    # (a) one cudaMemcpyAsync per replica tensor, into the same replica slots on the peers
    copies = []
    for r in range(1, fanout + 1):
        base = heap.base_pointer(r) + engine.placement.weight_base
        for t, tensor in enumerate(master_tensors):
            copies.append((base + engine.spec.weight_offsets[t], tensor.data.ptr, tensor.nbytes))
    memcpy_ms = graph_ms(lambda: [runtime.memcpyAsync(d, s, n, runtime.memcpyDeviceToDevice,
                                                      cupy.cuda.get_current_stream().ptr)
                                  for d, s, n in copies], args.repeats)
    # (c) the same copy pattern without tasks or flags (bench_copy.cu) from an image
    # of the replica slot into the same replica slots: what this device gives the pattern
    image = cupy.zeros(engine.spec.weight_slot_bytes, np.uint8)
    for offset, tensor in zip(engine.spec.weight_offsets, master_tensors):
        image[offset:offset + tensor.nbytes] = tensor.view(np.uint8).ravel()
    bare = FanoutCopy(image, [heap.base_pointer(r) + engine.placement.weight_base for r in range(1, fanout + 1)])
    bare_ms = min(graph_ms(lambda: bare.launch(grid), args.repeats) for grid in grids)
    # (b) one device-to-device copy inside this rank's memory with the tile sync's traffic:
    # it reads and writes (1 + fanout) / 2 experts, the tile sync reads 1 and writes fanout
    traffic = (1 + fanout) * expert_bytes
    d2d_ms = d2d_copy_ms(scratch, traffic, args.repeats)
    # the gradient reduction of the tables the checked reduce_grads compiled (it accumulates
    # into the master gradients: the values no longer matter)
    reductions = [(graph_ms(lambda: device.run_grad_tasks(entry, device.tables, grid), args.repeats), grid)
                  for grid in grids]
    reduce_ms, reduce_blocks = min(reductions)
    reduce_traffic = (2 + fanout) * grad_bytes
    reduce_d2d_ms = d2d_copy_ms(scratch, reduce_traffic, args.repeats)
    delivered = fanout * expert_bytes
    return {"fanout": fanout, "mb_delivered": delivered / 1e6, "tile_gb_s": delivered / tile_ms / 1e6,
            "memcpy_per_replica_gb_s": delivered / memcpy_ms / 1e6, "tile_hbm_gb_s": traffic / tile_ms / 1e6,
            "d2d_hbm_gb_s": traffic / d2d_ms / 1e6, "tile_vs_memcpy": memcpy_ms / tile_ms,
            "tile_vs_d2d": d2d_ms / tile_ms, "bare_vs_d2d": d2d_ms / bare_ms, "tile_vs_bare": bare_ms / tile_ms,
            "blocks": blocks, "compile_us": (sync_ms - tile_ms) * 1e3,
            "reduce_hbm_gb_s": reduce_traffic / reduce_ms / 1e6, "reduce_vs_d2d": reduce_d2d_ms / reduce_ms,
            "reduce_blocks": reduce_blocks, "tile_ms": tile_ms, "bare_ms": bare_ms, "sync_ms": sync_ms,
            "memcpy_ms": memcpy_ms, "d2d_ms": d2d_ms, "reduce_ms": reduce_ms, "reduce_d2d_ms": reduce_d2d_ms}


def d2d_copy_ms(scratch, traffic: int, repeats: int):
    """One device-to-device copy inside ``scratch`` that reads and writes ``traffic`` bytes in all."""
    import cupy
    from cupy.cuda import runtime

    base = scratch.local.data.ptr
    return graph_ms(lambda: runtime.memcpyAsync(base + traffic // 2, base, traffic // 2, runtime.memcpyDeviceToDevice,
                                                cupy.cuda.get_current_stream().ptr), repeats)
