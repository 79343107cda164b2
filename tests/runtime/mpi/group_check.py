"""Multi-rank EP group check (tests/runtime/test_group.py)."""

import sys
import time
from pathlib import Path

from mpi4py import MPI

from ultraep.errors import WaitTimeout
from ultraep.runtime.group import EPGroup, GroupMismatchError

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

group = EPGroup(MPI.COMM_WORLD, use_gpu=False)
me, R = group.rank, group.size
assert (me, R) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
assert group.local_rank == me and group.local_size == R, group  # one host in tests
sub = group.split(color=me % 2)
assert sub.size == R // 2 and sub.rank == me // 2, sub
assert sub.allgather(me) == [r for r in range(R) if r % 2 == me % 2]
assert group.agree(("layer", 3), "layer id") == ("layer", 3)
expect(lambda: group.agree(("layer", 3 if me else 4), "layer id"), GroupMismatchError, "ranks disagree on layer id",
       "ranks [0]")
expect(lambda: group.raise_if_any("bad top-k ids" if me == 2 else None, "update"), ValueError, "rank 2: bad top-k ids")
# A rank in another call (a barrier where the others agree on a payload): a mismatch on every
# rank naming both calls, not one payload read as the other's or an MPI abort; still in step after.
expect(lambda: group.barrier(what="close") if me == 1 else group.agree(("layer", 3), "layer id"), GroupMismatchError,
       "the ranks entered different collective calls", "rank(s) [1] in 'close'",
       f"rank(s) {[r for r in range(R) if r != 1]} in 'layer id'")
assert group.agree(("layer", 3), "layer id") == ("layer", 3)
# One name for a barrier and an allgather (a measuring loop's barriers and its error check):
# different calls, else the allgather's second step meets the barrier rank's next collective
# (MPI_ERR_TRUNCATE under Open MPI).
expect(lambda: group.barrier(what="probe") if me == 1 else group.raise_if_any(None, "probe"), GroupMismatchError,
       "rank(s) [1] in 'probe (barrier)'", f"rank(s) {[r for r in range(R) if r != 1]} in 'probe (allgather)'")
assert group.agree(("layer", 3), "layer id") == ("layer", 3)
print(f"[group] rank {me} OK", flush=True)

# Bounded collectives: a rank that does not come names itself in the others' timeout.
timed = EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=1.0)
if me == R - 1:
    time.sleep(2.5)
    timed.barrier(what="late barrier")  # completes the barrier the others gave up, so COMM_WORLD stays in step
else:
    expect(lambda: timed.barrier(what="late barrier"), WaitTimeout,
           f"late barrier timed out after 1 s: rank(s) [{R - 1}] had not reached it")
    expect(lambda: timed.allgather(me, what="after the timeout"), WaitTimeout,
           "refuses collectives after an earlier failure")
expect(lambda: EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=0 if me == 1 else 5), ValueError,
       "rank 1: timeout_s must be a positive, finite number")
expect(lambda: EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=5 + me), ValueError,
       "ranks disagree on EP group timeout_s")
print(f"[group-timeouts] rank {me} OK", flush=True)
