"""Multi-rank heap check, run under mpiexec by tests/runtime/test_heap*.py.

Usage: python -m mpi4py heap_check.py {cpu|cuda} {exchange|timeout|bad-input|lifecycle}
Prints "[<check>] rank N OK" on every rank that passed; raises (MPI_Abort) otherwise.
"""

import gc
import sys
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.runtime.group import EPGroup, GroupMismatchError
from ultraep.errors import BarrierTimeout, ClosedError, CollectiveError, HeapError, HeapFullError
from ultraep.runtime import open_heap
from ultraep.runtime.heap import HeapRequirements

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

backend, check = sys.argv[1], sys.argv[2]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp
    from ultraep.runtime.kernels import get_function
else:
    xp = np
WORDS = 65_537  # uint32 words per (source, destination) pair: odd, so the byte tail path runs too


def pattern(src: int, dst: int) -> np.ndarray:
    """Distinct, non-zero words for every (source, destination, index)."""
    i = np.arange(WORDS, dtype=np.uint64)
    return ((i * 2654435761 + src * 40503 + dst * 977 + 1) % (1 << 32)).astype(np.uint32)


def exchange() -> None:
    with open_heap(group, 4 * WORDS * R * 2 + 4096, backend=backend) as heap:
        recv = heap.alloc("recv", (R, WORDS), np.uint32)
        send = heap.alloc("send", (R, WORDS), np.uint32)
        assert heap.group.agree(recv.offset, "recv offset") == recv.offset
        recv.local[...] = xp.uint32(0xDEADBEEF)  # poison: a row nobody wrote fails the check
        for dst in range(R):
            send.local[dst] = xp.asarray(pattern(me, dst))
        if backend == "device":
            bases = heap.peer_bases.get()
            gathered = group.allgather(int(heap.base_pointer(me)))
            assert bases[me] == gathered[me], "own entry of the peer table is not the local base"
            assert len(set(int(b) for b in bases)) == R, f"peer table entries not distinct: {bases}"
            xp.cuda.get_current_stream().synchronize()
        heap.barrier()  # poison lands before any peer writes
        copy = get_function("heap.cu", "copy_bytes") if backend == "device" else None
        for dst in range(R):
            target = recv.peer(dst)[me]
            if copy is None:
                target[...] = send.local[dst]
            else:
                copy((264,), (256,), (send.local[dst], target, np.uint64(target.nbytes)))
        heap.barrier()
        got = recv.local.get() if backend == "device" else recv.local.copy()
        for src in range(R):
            expected = pattern(src, me)
            bad = int(np.count_nonzero(got[src] != expected))
            assert bad == 0, f"rank {me}: {bad} of {WORDS} words from rank {src} differ"
        # Odd byte counts and offsets: the 16-byte path's tail, and the byte path (offset 1).
        if backend == "device":
            nxt, prev = (me + 1) % R, (me - 1) % R
            sent = group.allgather(send.local.view(np.uint8)[0].get())[prev]
            for shift in (0, 1):
                src_bytes = send.local.view(np.uint8)[0][shift:]
                dst_bytes = recv.peer(nxt).view(np.uint8)[0][shift:]
                odd = src_bytes.size - 13
                recv.local[...] = xp.uint32(0xDEADBEEF)
                heap.barrier()
                copy((3,), (128,), (src_bytes, dst_bytes, np.uint64(odd)))
                heap.barrier()
                mine = recv.local.view(np.uint8)[0].get()
                poison = np.full(WORDS, 0xDEADBEEF, np.uint32).view(np.uint8)
                assert np.array_equal(mine[shift:shift + odd], sent[shift:shift + odd]), \
                    f"peer copy (shift {shift}) differs"
                assert np.array_equal(mine[:shift], poison[:shift]), "peer copy wrote before its start"
                assert np.array_equal(mine[shift + odd:], poison[shift + odd:]), "peer copy wrote past its end"
    print(f"[exchange] rank {me} OK", flush=True)


def timeout() -> None:
    heap = open_heap(group, 1 << 20, backend=backend)
    late = R - 1
    if me != late:
        try:
            heap.barrier(timeout_s=0.5)
        except BarrierTimeout as exc:
            message = str(exc)
            assert (f"waiting for rank {late}" in message and f"rank {me}" in message
                    and "expected >= 1" in message), message
            print(f"rank {me} saw: {message}", flush=True)
        else:
            raise AssertionError(f"rank {me}: barrier returned although rank {late} never arrived")
        try:
            heap.alloc("after", (4,), np.float32)
        except HeapError as exc:
            assert "unusable" in str(exc)
        else:
            raise AssertionError("heap stayed usable after a barrier timeout")
    group.barrier()
    heap.close()
    print(f"[timeout] rank {me} OK", flush=True)



def bad_input() -> None:
    expect(lambda: open_heap(group, 0, backend=backend), ValueError, "must be positive")
    expect(lambda: open_heap(group, -5, backend=backend), ValueError, "must be positive")
    expect(lambda: open_heap(group, 1 << 20 if me else 2 << 20, backend=backend), GroupMismatchError, "heap size")
    with open_heap(group, 1 << 20, backend=backend) as heap:
        # Only rank 0 asks for something else: every rank must raise, none may hang.
        expect(lambda: heap.alloc("t", (8, 4 if me else 5), np.float32), GroupMismatchError, "allocation request")
        expect(lambda: heap.alloc("t", (8, 4), np.complex64 if me == 1 else np.float32), ValueError,
                     "not supported")
        expect(lambda: heap.alloc("t", (0, 4), np.float32), ValueError, "must be a positive int")
        expect(lambda: heap.alloc("t", (-1,), np.float32), ValueError, "must be a positive int")
        expect(lambda: heap.alloc("big", (1 << 20,), np.float32), HeapError, "out of space")
        ok = heap.alloc("t", (8, 4), "bfloat16")
        assert ok.offset % 256 == 0 and ok.local.shape == (8, 4)
        heap.barrier()
    print(f"[bad-input] rank {me} OK", flush=True)


def lifecycle() -> None:
    # Two heaps closed in crossed order: a refusal naming both on every rank, not a free that hangs.
    first, second = (open_heap(group, 1 << 20, backend=backend) for _ in range(2))
    for heap in ((first, second) if me % 2 == 0 else (second, first)):
        expect(heap.close, HeapError, f"#{first.serial} close'", f"#{second.serial} close'")
    # No room: refused on every rank alike, so a constructor that meets it tears down together.
    with open_heap(group, 1 << 16, backend=backend) as heap:
        expect(lambda: heap.alloc("big", (1 << 20,), np.float32), HeapFullError, "out of space")
        expect(lambda: heap.alloc("big", (1 << 20,), np.float32), CollectiveError, "out of space")
        # Two components of one kind in one heap: the second set under the next instance suffix.
        needs = HeapRequirements.of([("part.x", (8,), np.float32)], [("part.flags", 2)])
        one, two = heap.allocate(needs), heap.allocate(needs)
        assert set(one) == set(two) == {"part.x", "part.flags"}
        assert two["part.x"].name == "part.x#1" and two["part.x"].offset > one["part.x"].offset
        assert two["part.flags"].first_slot == one["part.flags"].first_slot + 2
        expect(lambda: heap.alloc_signals("flags", 1 << 20), HeapFullError, "signal pad full")
    expect(lambda: heap.__enter__(), ClosedError, "with-block", "closed")
    # A heap dropped without close says so (on the CPU: a device heap dropped so frees memory its peers map).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped = open_heap(group, 1 << 16, backend="host")
        serial = dropped.serial
        del dropped
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and f"heap #{serial} was never closed" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    # Closed while a rank holds a view: kept, and the warning says which heap and whose tensors.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_heap(group, 1 << 16, backend="host") as heap:
            kept = heap.alloc("part.rows", (4,), np.float32).local
    assert any(f"heap #{heap.serial} (part.*) closed while rank(s) {list(range(R))}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    del kept
    # Two groups over one communicator: their heaps' serials differ, so crossed closes cannot pass as one.
    with EPGroup(MPI.COMM_WORLD, use_gpu=False) as twin, open_heap(group, 1 << 16, backend="host") as mine, \
            open_heap(twin, 1 << 16, backend="host") as theirs:
        assert mine.serial != theirs.serial
    # A sub-group frees what it holds at close; later collectives refuse.
    with group.split(0) as sub:
        sub.barrier()
    expect(sub.barrier, ClosedError, "the EP group is closed")
    expect(lambda: sub.split(0), ClosedError, "split: the EP group is closed")  # was a raw MPI error
    # A heap still open when its group closes is closed with it (its window freed), not left mapped.
    twin = EPGroup(MPI.COMM_WORLD, use_gpu=False)
    left, closed_first = open_heap(twin, 1 << 16, backend="host"), open_heap(twin, 1 << 16, backend="host")
    closed_first.close()
    twin.close()
    assert not left.is_open and not closed_first.is_open
    expect(lambda: left.alloc("late.rows", (4,), np.float32), ClosedError, "closed")
    group.barrier()
    print(f"[lifecycle] rank {me} OK", flush=True)


{"exchange": exchange, "timeout": timeout, "bad-input": bad_input, "lifecycle": lifecycle}[check]()
