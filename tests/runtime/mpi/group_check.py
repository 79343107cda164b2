"""Multi-rank EP group check (tests/runtime/test_group.py)."""

import time

from mpi4py import MPI

from ultraep.errors import WaitTimeout
from ultraep.runtime.group import EPGroup, GroupMismatchError

group = EPGroup(MPI.COMM_WORLD, use_gpu=False)
me, R = group.rank, group.size
assert (me, R) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
assert group.local_rank == me and group.local_size == R, group  # one host in tests
sub = group.split(color=me % 2)
assert sub.size == R // 2 and sub.rank == me // 2, sub
assert sub.allgather(me) == [r for r in range(R) if r % 2 == me % 2]
assert group.agree(("layer", 3), "layer id") == ("layer", 3)
try:
    group.agree(("layer", 3 if me else 4), "layer id")
except GroupMismatchError as exc:
    assert "ranks disagree on layer id" in str(exc) and "ranks [0]" in str(exc), exc
else:
    raise AssertionError("disagreement not detected")
try:
    group.raise_if_any("bad top-k ids" if me == 2 else None, "update")
except ValueError as exc:
    assert "rank 2: bad top-k ids" in str(exc), exc
else:
    raise AssertionError("a failure on rank 2 was not raised on every rank")
print(f"[group] rank {me} OK", flush=True)

# Bounded collectives: a rank that does not come names itself in the others' timeout.
timed = EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=1.0)
if me == R - 1:
    time.sleep(2.5)
    timed.barrier(what="late barrier")  # completes the barrier the others gave up, so COMM_WORLD stays in step
else:
    try:
        timed.barrier(what="late barrier")
    except WaitTimeout as exc:
        assert f"late barrier timed out after 1 s: rank(s) [{R - 1}] had not reached it" in str(exc), exc
    else:
        raise AssertionError("a barrier without rank R-1 completed")
    try:
        timed.allgather(me, what="after the timeout")
    except WaitTimeout as exc:
        assert "refuses collectives after an earlier failure" in str(exc), exc
    else:
        raise AssertionError("a group whose collective timed out went on")
try:
    EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=0 if me == 1 else 5)
except ValueError as exc:
    assert "rank 1: timeout_s must be a positive, finite number" in str(exc), exc
else:
    raise AssertionError("timeout_s=0 on one rank accepted")
try:
    EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=5 + me)
except ValueError as exc:
    assert "ranks disagree on EP group timeout_s" in str(exc), exc
else:
    raise AssertionError("timeouts differing across ranks accepted")
print(f"[group-timeouts] rank {me} OK", flush=True)
