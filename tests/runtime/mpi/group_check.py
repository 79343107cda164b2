"""Multi-rank EP group check (tests/runtime/test_group.py)."""

from mpi4py import MPI

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
