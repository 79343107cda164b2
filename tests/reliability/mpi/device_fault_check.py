"""WeightTransfer on the device (2 ranks, one GPU or two) with a fault on rank ``FAULTY``.

argv: kind, timeout_s (the group's and the engine's). Rank ``FAULTY`` prints
``[fault] <wall time> rank <r> <kind>`` when the fault starts, then (plans on the device):

* ``disagree``: passes another plan to weight_sync and reduce_grads. Every rank's
  synchronize must raise the disagreement, within ``timeout_s``, and the refused sync must
  have copied nothing (the masters changed before it; the replicas still hold the old
  weights, and the next agreed sync brings the new ones); every rank prints OK.
* ``sleep``: stops answering before weight_sync (its host sleeps); the other rank's
  synchronize must raise the device-side agreement timeout naming it, and the job ends.
* ``stall``: calls weight_sync behind a kernel that holds its stream far longer than the
  timeout (a rank stuck on the device); the same must happen.
* ``closed``: after the heap's block, its views and every device call of the engine refuse
  (ClosedError), arrays taken inside stay readable and writable by a kernel.
* ``lone``: passes a layer it never registered, so it refuses alone, on the host; the other
  rank's device wait for its plan hash gives up within the timeout naming it, and that
  engine then refuses further calls. Every rank prints OK.

The other rank prints ``[fault] rank <r> got <error>`` before re-raising it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import cupy
import numpy as np
from mpi4py import MPI

from ultraep import ClosedError, EPGroup, ExpertLayout, ExpertSpec, GroupMismatchError, WeightTransfer, open_heap
from ultraep.planner import plan_placement

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

FAULTY = 1
kind, timeout_s = sys.argv[1], float(sys.argv[2])
# Barriers outside the phase under test wait longer than its timeout: before the fault ranks
# compile kernels (NVRTC, seconds each) at their own pace, and after it the failing rank waits
# for peers that sit out the timeout under test.
PATIENT_TIMEOUT_S = 120.0
group = EPGroup(MPI.COMM_WORLD, timeout_s=timeout_s)
me, R = group.rank, group.size
assert group.has_gpu, f"rank {me}: no GPU"
LAYOUT = ExpertLayout(R, 2 * R, 2)
SPEC = ExpertSpec([("w", (64, 64), "float32")])
M = LAYOUT.experts_per_rank

# A kernel that keeps its stream busy for `ns` nanoseconds (bounded, so a job that went wrong
# does not leave the GPU busy for long).
SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}""", "spin")


def hot_plan(expert: int):
    loads = np.ones((R, LAYOUT.num_experts), np.int32)
    loads[:, expert] = 1000
    return plan_placement(cupy.asarray(loads), LAYOUT, min_replica_tokens=1)  # a device plan


def fault() -> None:
    print(f"[fault] {time.time():.3f} rank {me} {kind}", flush=True)


def closed() -> None:
    with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="device") as heap:
        engine = WeightTransfer(heap, LAYOUT, SPEC, timeout_s=timeout_s)
        engine.register_layer(0, [[cupy.full((64, 64), me * M + m + 1, np.float32)] for m in range(M)],
                              [[cupy.zeros((64, 64), np.float32)] for _ in range(M)])
        plan = hot_plan(0)
        engine.weight_sync(0, plan)
        engine.synchronize()
        slot = engine.replica_weights(0)[0]
        view = heap.allocations["transfer.replica_weights"]
    expect(lambda: view.local, ClosedError, f"rank {me}", "closed")
    expect(lambda: view.peer(0), ClosedError, "closed")
    for transfer in (engine.weight_sync, engine.reduce_grads):
        expect(lambda: transfer(0, plan), ClosedError, "heap is closed")
    slot += 1  # a kernel on a view taken inside: its memory was kept
    cupy.cuda.get_current_stream().synchronize()
    assert bool(cupy.isfinite(slot).all()), f"rank {me}: {slot}"
    engine.close()
    expect(lambda: engine.replica_weights(0), ClosedError, "WeightTransfer is closed")
    print(f"[closed] rank {me} OK", flush=True)


def lone() -> None:
    with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="device") as heap, \
            WeightTransfer(heap, LAYOUT, SPEC, timeout_s=timeout_s) as engine:
        engine.register_layer(0, [[cupy.full((64, 64), me * M + m + 1, np.float32)] for m in range(M)],
                              [[cupy.zeros((64, 64), np.float32)] for _ in range(M)])
        plan = hot_plan(0)
        group.barrier(PATIENT_TIMEOUT_S)
        start = time.monotonic()
        if me == FAULTY:
            expect(lambda: engine.weight_sync(1, plan), ValueError, "layer 1 has no registered master",
                   f"on rank {FAULTY}")
        else:
            engine.weight_sync(0, plan)
            expect(engine.synchronize, TimeoutError,
                   f"weight_sync(0) plan agreement timed out after {timeout_s:g} s waiting for rank {FAULTY}")
            expect(lambda: engine.weight_sync(0, plan), TimeoutError, "unusable after an earlier plan agreement")
        took = time.monotonic() - start
        assert took < 2 * timeout_s + 10, f"rank {me}: took {took:.1f} s"  # the agreement's wait, then the barrier's
        group.barrier(PATIENT_TIMEOUT_S)
    print(f"[lone] rank {me} OK", flush=True)


def replicas_hold(engine, plan, added: float) -> None:
    """Each of this rank's replica slots that ``plan`` fills holds its expert's master
    weights (expert e's are e + 1) plus ``added``."""
    P = LAYOUT.slots_per_rank
    experts = plan.phys_to_log.get()[me * P + M:(me + 1) * P]
    for slot, expert in enumerate(experts):
        if expert >= 0:
            held = engine.replica_weights(slot)[0].get()
            assert (held == expert + 1 + added).all(), f"rank {me}: replica slot {slot} holds {held[0, 0]}, " \
                f"expected expert {expert}'s {expert + 1 + added}"


def faulty_step() -> None:
    with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="device") as heap, \
            WeightTransfer(heap, LAYOUT, SPEC, timeout_s=timeout_s) as engine:
        masters = [[cupy.full((64, 64), me * M + m + 1, np.float32)] for m in range(M)]
        engine.register_layer(0, masters, [[cupy.zeros((64, 64), np.float32)] for _ in range(M)])
        same, other = hot_plan(0), hot_plan(1)
        engine.weight_sync(0, same)
        engine.synchronize()
        replicas_hold(engine, same, 0)
        for (weights,) in masters:  # a refused sync that copied anyway would bring these
            weights += 1000
        group.barrier(PATIENT_TIMEOUT_S)
        start = time.monotonic()
        if me == FAULTY:
            fault()
            if kind == "sleep":
                time.sleep(600)
            if kind == "stall":
                SPIN((1,), (1,), (np.uint64(int(60 * 1e9)),))
        try:
            engine.weight_sync(0, other if kind == "disagree" and me == FAULTY else same)
            engine.synchronize()
        except (GroupMismatchError, TimeoutError) as exc:
            print(f"[fault] rank {me} got {type(exc).__name__}: {exc}", flush=True)
            took = time.monotonic() - start
            assert took < timeout_s + 10, f"rank {me}: the error came {took:.1f} s after the fault"
            if kind != "disagree":
                raise
        else:
            raise AssertionError(f"rank {me}: a {kind} fault on rank {FAULTY} went unnoticed")
        replicas_hold(engine, same, 0)  # the refused sync copied nothing
        engine.reduce_grads(0, other if me == FAULTY else same)
        expect(engine.synchronize, GroupMismatchError, "ranks disagree on reduce_grads(0)", f"ranks [{FAULTY}]: 0x")
        engine.weight_sync(0, same)  # every rank reported the refusals: in step again
        engine.synchronize()
        replicas_hold(engine, same, 1000)
    print(f"[{kind}] rank {me} OK", flush=True)


{"closed": closed, "lone": lone}.get(kind, faulty_step)()
