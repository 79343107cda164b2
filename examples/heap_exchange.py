"""Every rank writes a row into every peer's symmetric heap, then checks what it received.

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py examples/heap_exchange.py

Runs on MPI shared memory on a CPU, through CUDA IPC where the ranks have GPUs. The code
below this docstring is the README's "Runtime" snippet, character for character.
"""
from mpi4py import MPI
import numpy as np
import ultraep

group = ultraep.EPGroup(MPI.COMM_WORLD)               # picks GPU local_rank % device_count, if any
with ultraep.open_heap(group, 1 << 20) as heap:       # CUDA IPC on a GPU, MPI shared memory on a CPU
    inbox = heap.alloc("inbox", (group.size, 256), np.float32)  # same offset on every rank, checked
    for peer in range(group.size):
        inbox.peer(peer)[group.rank] = 1000 * group.rank + peer  # write straight into a peer's heap
    heap.barrier(timeout_s=30)                        # times out naming the rank and flag it waited on
    got = inbox.local if heap.backend == "host" else inbox.local.get()   # a view into this rank's heap
    assert (got[:, 0] == 1000 * np.arange(group.size) + group.rank).all(), got[:, 0]
    line = f"rank {group.rank}/{group.size} ({heap.backend}): received {got[:, 0].astype(int).tolist()}"
    lines = group.allgather(line)                     # rank 0 prints every rank's line, in rank order
    if group.rank == 0:
        print("\n".join(lines))
# here the heap is closed: `inbox`, `got` and every other view into it must not be used again
