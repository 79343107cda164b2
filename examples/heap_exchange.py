# /// script
# requires-python = ">=3.10"
# dependencies = ["ultraep", "mpi4py", "mpich", "numpy"]
# ///
"""Every rank writes a row into every peer's symmetric heap, then checks what it received.

    mpiexec -n 4 python -m mpi4py examples/heap_exchange.py [--backend cpu|cuda|auto]

Runs on the CPU backend (MPI shared memory) or on GPUs through CUDA IPC.
"""

import argparse

import numpy as np
from mpi4py import MPI

from ultraep.runtime.group import EPGroup
from ultraep.runtime import open_heap

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="auto", choices=["auto", "host", "device"])
args = parser.parse_args()

group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
with open_heap(group, 1 << 20, backend=args.backend) as heap:
    inbox = heap.alloc("inbox", (group.size, 256), np.float32)
    for peer in range(group.size):  # row `rank` of every peer's inbox holds 1000 * rank + peer
        inbox.peer(peer)[group.rank] = 1000 * group.rank + peer
    heap.barrier(timeout_s=30)
    received = inbox.local if heap.backend == "host" else inbox.local.get()
    expected = 1000 * np.arange(group.size, dtype=np.float32)[:, None] + group.rank
    assert np.array_equal(received, np.broadcast_to(expected, received.shape)), received[:, 0]
    print(f"rank {group.rank}/{group.size} ({heap.backend}): received {received[:, 0].tolist()}", flush=True)
