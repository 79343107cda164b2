"""A heap barrier refused by one rank (a bad ``timeout_s``), run under mpiexec by
tests/runtime/test_heap_refusal.py.

Usage: python -m mpi4py heap_refusal_check.py {host|device}
Prints "[refusal] rank N OK" on every rank that passed; raises (MPI_Abort) otherwise.

The refusing rank raises ValueError; every peer raises RankFailedError naming it and the
cause long before its own timeout; the heap stays usable, and a refusal left in a flag
never lets a later barrier through before the refusing rank arrives.
"""

import math
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.errors import RankFailedError
from ultraep.runtime import open_heap
from ultraep.runtime.group import EPGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

backend = sys.argv[1]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"), timeout_s=60.0)
R, me = group.size, group.rank
REFUSER = R - 1
PEER_TIMEOUT_S = 30.0  # a peer that times out instead of seeing the refusal takes this long
PROMPT_S = 5.0         # a refusal reaches every peer well within that


def host(array) -> np.ndarray:
    return array.get() if backend == "device" else np.asarray(array)


def refused_by_one(heap, bad_timeout, wait: bool) -> None:
    """REFUSER passes ``bad_timeout``; the peers a good one, waiting (``wait=False``: the device
    reports through check_barriers)."""
    start = time.monotonic()
    if me == REFUSER:
        expect(lambda: heap.barrier(bad_timeout), ValueError, f"rank {me}: heap barrier",
               "timeout_s must be a positive")
    else:
        def call():
            heap.barrier(PEER_TIMEOUT_S, wait=wait)
            heap.check_barriers()
        message = expect(call, RankFailedError, f"rank {me}:", "heap barrier", f"rank {REFUSER} refused it",
                         "timeout_s must be a positive")
        elapsed = time.monotonic() - start
        assert elapsed < PROMPT_S, f"rank {me}: the refusal took {elapsed:.1f} s to arrive: {message}"


def exchange(heap, tensor, value: float, late: float = 0.0) -> None:
    """Every rank writes ``value + its rank`` into row ``rank`` of every peer's ``tensor``
    (rank REFUSER after sleeping ``late`` seconds), barriers, and checks every row."""
    if me == REFUSER:
        time.sleep(late)
    for peer in range(R):
        tensor.peer(peer)[me] = value + me
    heap.barrier(PEER_TIMEOUT_S)
    seen = host(tensor.local)
    expected = value + np.arange(R, dtype=np.float32)[:, None]
    assert np.array_equal(seen, np.broadcast_to(expected, seen.shape)), f"rank {me}: rows {seen[:, 0]}"


with open_heap(group, 1 << 20, backend=backend) as heap:
    tensor = heap.alloc("rows", (R, 4), np.float32)
    tensor.local[...] = -1.0  # poison
    heap.barrier(PEER_TIMEOUT_S)
    for step, bad in enumerate((0, -1.0, math.nan, math.inf, "1")):
        refused_by_one(heap, bad, wait=True)
        # The epochs stay aligned: the next barrier orders every rank's writes, and the flag
        # the refusal left must not pass it before REFUSER arrives (late on purpose).
        exchange(heap, tensor, float(step + 1), late=0.5)
    refused_by_one(heap, 0, wait=False)
    exchange(heap, tensor, 10.0)
    # Every rank refuses: each raises its own error at once, nobody waits.
    start = time.monotonic()
    expect(lambda: heap.barrier(0), ValueError, f"rank {me}: heap barrier", "timeout_s must be a positive")
    assert time.monotonic() - start < PROMPT_S
    exchange(heap, tensor, 20.0, late=0.5)
print(f"[refusal] rank {me} OK", flush=True)
