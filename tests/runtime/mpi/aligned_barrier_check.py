"""Two ranks leave an aligned barrier together (tests/runtime/test_group.py): rank 1 comes
30 ms late, long enough for a sleeping poll to back off to 2 ms pauses."""

import sys
import time

import numpy as np
from mpi4py import MPI

from ultraep.runtime.group import EPGroup


aligned = sys.argv[1:] != ["--sleeping"]  # --sleeping: the default barrier, to see the check fail
group = EPGroup(MPI.COMM_WORLD, use_gpu=False)
me = group.rank
spreads = []
for _ in range(7):
    group.barrier(what="round start")
    if me == 1:
        time.sleep(0.03)
    group.barrier(what="aligned", aligned=aligned)
    left = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    spreads.append(np.ptp(group.allgather(left, what="left")))
median_ms = float(np.median(spreads)) * 1e3
assert median_ms < 0.5, f"rank {me}: the ranks left {median_ms:.3f} ms apart (median of 7), spreads {spreads}"
print(f"[aligned-barrier] rank {me} OK: left {median_ms:.3f} ms apart (median of 7)", flush=True)
