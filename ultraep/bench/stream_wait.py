"""``python -m ultraep.bench stream-wait``: what work queued on a second stream behind a wait
for the layer's stream costs the layer's own launches.

This is the pattern of a weight sync beside the layer (``MoELayer(sync_beside=True)``): the
host runs ahead, so the sync's stream holds a wait for the plan (``cudaStreamWaitEvent``)
and the sync's work behind it while the device still runs the layer before. Each case
times ``--kernels`` small kernels on the layer's stream between two events, with the host
ahead of the device (a kernel holds the stream while the host enqueues):

* ``alone``: nothing on another stream;
* ``wait``: a second stream waits for an event recorded after the kernels, nothing behind the wait;
* ``wait+event``: the same with a timing event queued behind the wait;
* ``wait+kernel``: the same with a one-block kernel queued behind the wait.

``us_per_kernel`` is the slowest rank's median device time per kernel; ``vs_alone`` the
case's over ``alone``'s, measured in the same run, cases in turns. Kernels: ``add`` (an
in-place add on 64 K floats, a few us) and ``gemm`` (fp16, 2048 x 1024 x 512). With
``--ranks R --emulate-ep`` every rank runs the cases at once under its MPS share, as the
emulated EP benches do.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from ultraep.runtime.launch import DefaultsHelpFormatter, add_launch_options, multi_rank_main, positive_int
from ultraep.runtime.sm_partition import new_stream

CASES = ("alone", "wait", "wait+event", "wait+kernel")
KERNELS = ("add", "gemm")
COLUMNS = ["kernel", "case", "us_per_kernel", "vs_alone", "kernels", "ranks"]
HOST_LEAD_NS_PER_KERNEL = 20_000  # the hold covers the host's enqueueing of every kernel (~10 us each)
QUEUED_KERNEL_NS = 20_000


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench stream-wait",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--kernels", type=positive_int, default=60, help="kernels timed per case")
    parser.add_argument("--repeats", type=positive_int, default=30, help="timed rounds (median reported)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    add_launch_options(parser, ranks=1)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "stream-wait"])


class Cases:
    """The layer's stream, the second stream, their events and the kernels of every case."""

    def __init__(self, cupy, kernels: int):
        from ultraep.runtime.kernels import get_function

        self.cupy, self.kernels = cupy, kernels
        self.hold = get_function("timing.cu", "hold_stream")
        self.layer = new_stream()
        self.side = new_stream()
        self.start, self.end, self.queued_stamp = (cupy.cuda.Event() for _ in range(3))
        self.after = cupy.cuda.Event(disable_timing=True)
        with self.layer:
            self.vector = cupy.ones(1 << 16, np.float32)
            self.x = cupy.ones((2048, 1024), np.float16)
            self.w = cupy.ones((1024, 512), np.float16)

    def _work(self, kernel: str) -> None:
        for _ in range(self.kernels):
            if kernel == "add":
                self.vector += 1.0
            else:
                self.x @ self.w

    def time_ms(self, kernel: str, case: str) -> float:
        """One round of ``case``: the layer stream's time for the kernels (ms)."""
        with self.layer:
            self.hold((1,), (32,), (np.uint64(HOST_LEAD_NS_PER_KERNEL * self.kernels + 1_000_000),))
            self.start.record()
            self._work(kernel)
            self.after.record()
            self.end.record()
        if case != "alone":  # the device is still in the hold: the second stream's wait is pending
            self.side.wait_event(self.after)
            if case == "wait+event":
                self.queued_stamp.record(self.side)
            elif case == "wait+kernel":
                with self.side:
                    self.hold((1,), (32,), (np.uint64(QUEUED_KERNEL_NS),))
        self.layer.synchronize()
        self.side.synchronize()
        return self.cupy.cuda.get_elapsed_time(self.start, self.end)


def run(args) -> int:
    import cupy
    from mpi4py import MPI

    from ultraep.bench.report import Progress, RowStream, write_json
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label

    group = EPGroup(MPI.COMM_WORLD)
    if not group.has_gpu:
        raise SystemExit("stream-wait needs a GPU")
    sharing = sharing_label(group)
    progress = Progress("stream-wait", enabled=group.rank == 0)
    title = (f"stream-wait: {args.kernels} kernels on the layer's stream while a second stream has work queued "
             f"behind a wait for it; {group.size} ranks ({sharing}); us per kernel (the slowest rank's median), "
             "vs_alone: over the same kernels with nothing on another stream, cases in turns")
    rows = []
    with cupy.cuda.Device(group.device), RowStream(COLUMNS, title, enabled=group.rank == 0) as table:
        cases = Cases(cupy, args.kernels)
        for kernel in KERNELS:
            progress(f"{kernel}: {args.repeats} rounds of {len(CASES)} cases")
            times = {case: [] for case in CASES}
            for round_ in range(args.repeats + 1):  # the first round warms up
                for case in CASES:
                    group.barrier()
                    ms = cases.time_ms(kernel, case)
                    if round_:
                        times[case].append(ms)
            slowest = {case: max(group.allgather(statistics.median(times[case]))) for case in CASES}
            for case in CASES:
                row = {"kernel": kernel, "case": case, "us_per_kernel": 1e3 * slowest[case] / args.kernels,
                       "vs_alone": slowest[case] / slowest["alone"], "kernels": args.kernels, "ranks": group.size}
                rows.append(row)
                table.add(row)
    if group.rank == 0 and args.json:
        write_json(args.json, {"benchmark": "stream-wait", "title": title, "ranks": group.size, "sharing": sharing,
                               "rows": rows})
    return 0
