"""``python -m ultraep.bench dispatch``: algorithm bandwidth of the Dispatcher's dispatch and
combine, side by side with a plain device-to-device copy of the same bytes and with NCCL's
``all_to_all_single`` for the same routing, in one run.

Every rank routes ``tokens`` bf16 tokens top-k over uniformly random distinct experts
(``experts`` in all, ``experts / R`` per rank). Algorithm bandwidth counts the logical
payload once: ``tokens * top_k * hidden * 2`` bytes per rank (what every (token, expert)
pair carries), summed over ranks and divided by the slowest rank's time per call. The
baseline copies the same bytes per rank with ``cudaMemcpyAsync`` at the same time on
every rank. Times are the whole group's window per call (first start to last end).
Several ranks on one GPU run time-sliced, so every device-side wait costs about a time
slice per other rank, unless ``--emulate-ep`` runs them under MPS with an SM share each
(the title says which); ``--ranks 1`` times the data path alone. "sent" counts what
one-send-per-rank actually moves (a token crosses to a rank once however many of its
experts live there); "saved" is the share of pair bytes
it avoids, over all destinations and over remote ones only. Started with one process,
it relaunches itself on ``--ranks`` ranks under ``mpiexec`` (all on one GPU by default).

``all_to_all_single`` (``torch.distributed`` over NCCL, :mod:`ultraep.bench.nccl`) moves,
between every pair of ranks, the bytes the dispatch sends (one row per token and
destination rank; the combine column times the transposed matrix); it only moves bytes
(no expert-major layout, no gates). NCCL refuses ranks that share a GPU: the columns then
say "not run (N ranks share one GPU)".

``pull``: combine with the expert outputs in the heap (``Dispatcher(expert_output=True)``),
each source reading its rows where they lie instead of receiving them and summing;
``pull_diff`` counts the elements that differ from the combine beside it (must be 0).
``push``: dispatch with the receive buffer in the heap (``Dispatcher(expert_input=True)``),
each source writing each (token, slot) row straight into its final row there instead of
one send per rank and the receiver's copy into expert rows; ``push_diff`` counts the
elements of the receive buffer that differ from the dispatch beside it (must be 0).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ultraep.bench.timing import group_window_ms
from ultraep.runtime.launch import (DefaultsHelpFormatter, add_launch_options, multi_rank_main, non_negative_int,
                                   positive_int, row_width)

COLUMNS = ["tokens", "hidden", "dispatch_ms", "combine_ms", "copy_ms", "dispatch_GBps", "combine_GBps", "copy_GBps",
           "dispatch/copy", "combine/copy", "pull_ms", "pull/copy", "pull_diff", "push_ms", "push/copy",
           "push_diff", "a2a_ms", "a2a_back_ms", "a2a_GBps",
           "dispatch/a2a", "combine/a2a", "sent_GB", "saved_pct", "saved_remote_pct"]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench dispatch", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_launch_options(parser)
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768],
                        help="tokens per rank")
    parser.add_argument("--hidden", type=row_width, nargs="+", default=[4096, 7168], help="token widths (bf16 values)")
    parser.add_argument("--top-k", type=positive_int, default=8, help="experts per token")
    parser.add_argument("--experts", type=positive_int, default=256,
                        help="experts in all (divisible by the rank count)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed calls per measurement (mean reported)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random routing")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "dispatch"])


def random_routing(cupy, tokens: int, experts: int, top_k: int):
    """Distinct uniformly random experts per token, and gates."""
    ids = cupy.argsort(cupy.random.random((tokens, experts), dtype=np.float32), axis=1)[:, :top_k]
    return cupy.ascontiguousarray(ids.astype(np.int32)), cupy.random.random((tokens, top_k), dtype=np.float32)


def sends_per_rank(xp, ids, experts_per_rank: int, ranks: int) -> list[int]:
    """Rows this rank sends to each rank when a token crosses to a rank once, however many
    of its experts live there."""
    hit = xp.zeros((ids.shape[0], ranks), dtype=bool)
    hit[xp.arange(ids.shape[0])[:, None], ids // experts_per_rank] = True
    return [int(v) for v in hit.sum(axis=0).tolist()]


def measure(group, nccl, memory, tokens: int, hidden: int, args) -> dict:
    import cupy

    from ultraep.runtime.dtypes import BFLOAT16
    from ultraep.token import Dispatcher

    R, me, K = group.size, group.rank, args.top_k
    sync = cupy.cuda.get_current_stream().synchronize
    cupy.random.seed(args.seed * 1000 + me)
    ids, gates = random_routing(cupy, tokens, args.experts, K)
    # bf16 values in [0.5, 2): random bits below the exponent of 2.0
    x = cupy.random.randint(0x3F00, 0x4000, size=(tokens, hidden), dtype=np.int32).astype(np.uint16).view(BFLOAT16)
    max_rows = int(tokens * K * 1.15) + 1024  # uniform routing: about tokens * K rows per rank
    row_bytes = hidden * 2
    payload = tokens * K * row_bytes
    with Dispatcher(group, hidden=hidden, dtype="bfloat16", top_k=K, num_experts=args.experts, max_tokens=tokens,
                    max_recv_rows=max_rows, backend="device", sync_checks=False) as disp:
        recv = cupy.empty((disp.max_recv_rows, hidden), dtype=BFLOAT16)
        combined = cupy.empty((tokens, hidden), dtype=BFLOAT16)
        result = disp.dispatch(x, ids, gates, out=recv)
        disp.check()
        rows = result.num_rows
        sent = disp.traffic(result.handle)
        pairs, remote_pairs, sends, remote_sends = (sum(v) for v in zip(*group.allgather(
            (sent.pairs, sent.pairs_remote, sent.sends, sent.sends_remote))))
        my_sends = sends_per_rank(cupy, ids, args.experts // R, R)
        assert sum(my_sends) == sent.sends, f"rank {me}: {sum(my_sends)} rows to send, the dispatcher sent {sent.sends}"
        send_bytes = group.allgather([n * row_bytes for n in my_sends])
        dispatch_ms = group_window_ms(group, lambda: disp.dispatch(x, ids, gates, out=recv), args.repeats, sync)
        combine_ms = group_window_ms(group, lambda handle=result.handle: disp.combine(recv, handle, out=combined),
                                     args.repeats, sync)
        disp.check()
        memory.sample()  # each Dispatcher's heaps go back to the driver as it closes
        del result  # its handle views the heap: a closed dispatcher's heap is freed once nothing views it
    with Dispatcher(group, hidden=hidden, dtype="bfloat16", top_k=K, num_experts=args.experts, max_tokens=tokens,
                    max_recv_rows=max_rows, backend="device", sync_checks=False, expert_output=True) as disp:
        expert_out = disp.expert_output()
        pulled = cupy.empty_like(combined)
        result = disp.dispatch(x, ids, gates, out=expert_out)  # the rows themselves stand in for expert outputs
        pull_ms = group_window_ms(group, lambda rows=expert_out, handle=result.handle: disp.combine(rows, handle,
                                                                                                    out=pulled),
                                  args.repeats, sync)
        disp.check()
        pull_diff = int(cupy.count_nonzero(pulled.view(np.uint16) != combined.view(np.uint16)))
        memory.sample()
        del result, expert_out
    with Dispatcher(group, hidden=hidden, dtype="bfloat16", top_k=K, num_experts=args.experts, max_tokens=tokens,
                    max_recv_rows=max_rows, backend="device", sync_checks=False, expert_input=True) as disp:
        pushed = disp.dispatch(x, ids, gates)  # into the heap's receive buffer, pushed.x
        disp.check()
        assert pushed.num_rows == rows, f"rank {me}: push received {pushed.num_rows} rows, the dispatch {rows}"
        push_ms = group_window_ms(group, lambda: disp.dispatch(x, ids, gates), args.repeats, sync)
        disp.check()
        push_diff = int(cupy.count_nonzero(pushed.x[:rows].view(np.uint16) != recv[:rows].view(np.uint16)))
        memory.sample()
        del pushed
    src = cupy.empty(payload, dtype=np.uint8)
    dst = cupy.empty_like(src)
    copy_ms = group_window_ms(group, lambda: dst.__setitem__(Ellipsis, src), args.repeats, sync)
    a2a_ms = nccl.all_to_all_single_ms(send_bytes, args.repeats)
    a2a_back_ms = nccl.all_to_all_single_ms([list(col) for col in zip(*send_bytes)], args.repeats)
    total_payload = payload * R
    return {
        "tokens": tokens, "hidden": hidden, "dispatch_ms": dispatch_ms, "combine_ms": combine_ms, "copy_ms": copy_ms,
        "dispatch_GBps": total_payload / dispatch_ms / 1e6, "combine_GBps": total_payload / combine_ms / 1e6,
        "copy_GBps": total_payload / copy_ms / 1e6,
        "dispatch/copy": copy_ms / dispatch_ms, "combine/copy": copy_ms / combine_ms,
        "pull_ms": pull_ms, "pull/copy": copy_ms / pull_ms, "pull_diff": pull_diff,
        "push_ms": push_ms, "push/copy": copy_ms / push_ms, "push_diff": push_diff,
        "a2a_ms": a2a_ms, "a2a_back_ms": a2a_back_ms,
        "a2a_GBps": nccl.reason if a2a_ms is None else total_payload / a2a_ms / 1e6,
        "dispatch/a2a": None if a2a_ms is None else a2a_ms / dispatch_ms,
        "combine/a2a": None if a2a_back_ms is None else a2a_back_ms / combine_ms,
        "sent_GB": sends * row_bytes / 1e9, "saved_pct": 100.0 * (1 - sends / pairs),
        "saved_remote_pct": 100.0 * (1 - remote_sends / remote_pairs) if remote_pairs else None,
    }


def run(args) -> int:
    import cupy
    from mpi4py import MPI

    from ultraep.bench.memory import SweepMemory, skip_row
    from ultraep.bench.nccl import NcclBaseline
    from ultraep.bench.report import Progress, RowStream, write_json
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label

    group = EPGroup(MPI.COMM_WORLD)
    if not group.has_gpu:
        raise SystemExit("the dispatch benchmark needs a GPU")
    sharing = sharing_label(group)
    printing = group.rank == 0
    title = (f"dispatch/combine algorithm bandwidth: {group.size} ranks ({sharing}), top-{args.top_k}, "
             f"{args.experts} experts, bf16, aggregate over ranks (GB/s = 1e9 B/s); "
             "copy = cudaMemcpyAsync of the same bytes; "
             f"a2a = NCCL all_to_all_single of the bytes sent (dispatch/a2a > 1: the dispatcher is faster)")
    progress = Progress("dispatch", enabled=printing, quiet=args.quiet)
    cells = [(tokens, hidden) for tokens in args.tokens for hidden in args.hidden]
    with NcclBaseline(group) as nccl, RowStream(COLUMNS, title, enabled=printing) as table:
        rows, skipped, memory = [], [], SweepMemory(group)
        for i, (tokens, hidden) in enumerate(cells):
            too_big = memory.fits(tokens * hidden)
            if too_big:
                skip_row({"tokens": tokens, "hidden": hidden}, too_big, progress, table, skipped)
                continue
            progress(f"{i + 1}/{len(cells)}: {tokens} tokens/rank, hidden {hidden}")
            memory.begin(tokens * hidden)
            rows.append(measure(group, nccl, memory, tokens, hidden, args))
            table.add(rows[-1])
            memory.end()
            cupy.get_default_memory_pool().free_all_blocks()  # this size's buffers died with measure's frame
    if printing:
        if args.json:
            write_json(args.json, {"benchmark": "dispatch", "ranks": group.size, "sharing": sharing,
                                   "top_k": args.top_k, "experts": args.experts, "nccl": nccl.reason or "run",
                                   "rows": rows, "skipped": skipped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
