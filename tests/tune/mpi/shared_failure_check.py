"""A rank failing in the middle of the shared fused probe (``measure_shared``), host backend,
run under mpiexec by tests/tune/test_profile.py.

Usage: python -m mpi4py shared_failure_check.py CACHE_DIR [error|memory|copy-memory]

Every rank measures its host profile's fused tasks at once, rounds started together; rank 1's
third round raises (``memory``: runs out of memory, as CuPy says it, and the reason also says
how to avoid it; ``copy-memory``: rank 1 runs out of memory making the copy probe's buffers,
before any round). Every rank must raise the same CollectiveError naming rank 1 and its
reason within seconds -- not a mismatch of collectives, an MPI error or a timeout (rank 1's
error check used to meet its peers' round barrier of the same name, and the check's second
step their next round: MPI_ERR_TRUNCATE under Open MPI). Every rank's probe is closed on
the way out (a GPU probe's buffers go back to the driver).
"""

import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402
from ultraep.errors import CollectiveError  # noqa: E402
from ultraep.runtime.group import EPGroup  # noqa: E402
from ultraep.tune.host import HostProbe  # noqa: E402
from ultraep.tune.profile import CACHE_VARIABLE, load_profile  # noqa: E402
from ultraep.tune.replicas import SHARED_FUSED_WHAT, SHARED_WHAT, measure_shared  # noqa: E402

os.environ[CACHE_VARIABLE] = sys.argv[1]
MODE = sys.argv[2] if len(sys.argv) > 2 else "error"
MEMORY = MODE in ("memory", "copy-memory")
FAILING, FAILING_ROUND = 1, 3
PROMPT_S = 30.0

group = EPGroup(MPI.COMM_WORLD, use_gpu=False)
me = group.rank
rounds = 0
measured = HostProbe.fused_rounds


class OutOfMemoryError(MemoryError):  # as cupy.cuda.memory's
    pass


def failing_rounds(self, *args, **kwargs):
    global rounds
    rounds += 1
    if me == FAILING and rounds == FAILING_ROUND:
        if MEMORY:
            raise OutOfMemoryError("Out of memory allocating 3,892,314,112 bytes")
        raise RuntimeError("the probe's kernel failed")
    return measured(self, *args, **kwargs)


def failing_copy(self):
    if me == FAILING:
        raise OutOfMemoryError("Out of memory allocating 268,435,456 bytes")
    return copied(self)


copied = HostProbe.copy_call
HostProbe.fused_rounds = failing_rounds
if MODE == "copy-memory":
    HostProbe.copy_call = failing_copy
closed = []
HostProbe.close = lambda self: closed.append(self)

profile = load_profile("host") if me == 0 else None
group.barrier(60.0, what="the first rank measured the profile")
profile = profile or load_profile("host")
closed.clear()
start = time.monotonic()
reason = ([f"rank {FAILING}: OutOfMemoryError: Out of memory allocating", "3 processes on this GPU",
           f"cached in {sys.argv[1]}", "fused_config='constants'"] if MEMORY
          else [f"rank {FAILING}: RuntimeError: the probe's kernel failed"])
expect(lambda: measure_shared(group, "host", profile, timeout_s=60.0), CollectiveError,
       SHARED_WHAT if MODE == "copy-memory" else SHARED_FUSED_WHAT, "failed on 1 of", *reason)
elapsed = time.monotonic() - start
assert elapsed < PROMPT_S, f"rank {me}: the failure took {elapsed:.1f} s to arrive"
assert len(closed) == 1, f"rank {me}: its probe closed {len(closed)} times, not once"
assert group.agree("after", "still in step") == "after"
print(f"[shared-failure] rank {me} OK", flush=True)
