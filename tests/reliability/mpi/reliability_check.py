"""Bad input on one rank, use after close and stale gradients, on ``backend`` (argv[1]); one
case per argv[2]. Every rank prints ``[<case>] rank <r> OK``; a rank that does not, or a
crash, fails the test that launched it."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep import (Balancer, ClosedError, CollectiveError, Dispatcher, EPGroup, ExpertLayout, ExpertSpec,
                     GroupMismatchError, UltraEPError, WeightTransfer, open_heap, plan_placement)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.backend_arrays import arrays, bf16  # noqa: E402
from tests.support.mpi_checks import expect  # noqa: E402

backend, case = sys.argv[1], sys.argv[2]
group = EPGroup(MPI.COMM_WORLD, use_gpu=backend == "device")
me, R = group.rank, group.size
odd = R - 1  # the rank that differs
if backend == "device":
    import cupy as xp
else:
    xp = np
LAYOUT = ExpertLayout(R, 2 * R, 2)
SPEC = ExpertSpec([("w", (4, 8), "float32")])
M = LAYOUT.experts_per_rank



# The token path's small problem of the closed- and crossed-object cases.
TOKENS = dict(hidden=16, dtype="float32", top_k=2, num_experts=2 * R, max_tokens=4)
TOKEN_HEAP = Dispatcher.heap_requirements(R, **TOKENS)
X = xp.ones((4, 16), np.float32)
IDS = xp.asarray(np.arange(8).reshape(4, 2) % (2 * R))
GATES = xp.full((4, 2), 0.5, np.float32)


def hot_plan(expert: int):
    loads = np.ones((R, LAYOUT.num_experts), np.int32)
    loads[:, expert] = 1000  # replicated into redundant slots
    return plan_placement(loads, LAYOUT, min_replica_tokens=1)


def masters():
    return [[xp.full((4, 8), me * M + m + 1, dtype=np.float32)] for m in range(M)]


def use_after_close() -> None:
    """The README's pattern: a tensor read after the heap's block raises; an array taken
    inside stays readable (no SIGSEGV); every object refuses calls after close."""
    with open_heap(group, 1 << 20, backend=backend) as heap:
        buf = heap.alloc("recv", (R, 16), np.float32)
        buf.peer((me + 1) % R)[me] = me + 1.0
        heap.barrier(timeout_s=10)
        kept = buf.local
        signals = heap.alloc_signals("flags", 4)
    expect(lambda: buf.local, ClosedError, f"rank {me}", "tensor 'recv'", "closed")
    expect(lambda: buf.peer(0), ClosedError, "closed")
    expect(lambda: signals.local, ClosedError, "signal block 'flags'")
    expect(lambda: heap.barrier(), ClosedError, "closed")
    expect(lambda: heap.alloc("more", (4,), np.float32), ClosedError, "closed")
    got = np.asarray(kept.get() if hasattr(kept, "get") else kept)  # memory kept alive for this view
    assert got[(me - 1) % R, 0] == (me - 1) % R + 1.0, got
    del kept, got

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # nothing held: the heap is freed, no warning
        with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend=backend) as heap:
            engine = WeightTransfer(heap, LAYOUT, SPEC)
            engine.register_layer(0, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
            engine.weight_sync(0, hot_plan(0))
            engine.close()
    expect(lambda: engine.weight_sync(0, hot_plan(0)), ClosedError, "WeightTransfer is closed")
    expect(lambda: engine.replica_weights(0), ClosedError, "WeightTransfer is closed")
    with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend=backend) as heap:
        engine = WeightTransfer(heap, LAYOUT, SPEC)  # left open, its heap closed under it
        engine.register_layer(0, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
    for transfer in (engine.weight_sync, engine.reduce_grads):
        expect(lambda: transfer(0, hot_plan(0)), ClosedError, f"rank {me}: WeightTransfer.", "heap is closed")

    disp = Dispatcher(group, hidden=16, dtype="float32", top_k=2, num_experts=2 * R, max_tokens=4, backend=backend)
    disp.close()
    disp.close()  # idempotent
    ids = xp.zeros((4, 2), dtype=np.int64)
    expect(lambda: disp.dispatch(xp.ones((4, 16), np.float32), ids, xp.ones((4, 2), np.float32)), ClosedError,
           "Dispatcher is closed")

    bal = Balancer(group, LAYOUT, SPEC, num_layers=1, min_replica_tokens=1, backend=backend)
    bal.register_layer(0, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
    handle = bal.update(0, local_loads=xp.asarray(hot_plan(0).loads[me]))
    bal.weight_sync(handle)
    views = bal.replica_weights(handle)
    bal.close()
    expect(lambda: bal.replica_weights(handle), ClosedError, "Balancer is closed")
    expect(lambda: bal.weight_sync(handle), ClosedError, "Balancer is closed")
    float(views[0][0].sum())  # the heap outlives views taken before close
    print(f"[use_after_close] rank {me} OK", flush=True)


def disagreement() -> None:
    """A plan, layer or timeout that differs on one rank is refused on every rank."""
    requirements = WeightTransfer.heap_requirements(LAYOUT, SPEC)
    with open_heap(group, requirements, backend=backend) as heap:
        expect(lambda: WeightTransfer(heap, LAYOUT, SPEC, timeout_s=0 if me == odd else 30.0), UltraEPError,
               f"rank {odd}: timeout_s must be a positive")
        expect(lambda: WeightTransfer(heap, LAYOUT, SPEC, timeout_s=5.0 if me == odd else 30.0), UltraEPError,
               "ranks disagree", "timeout_s")
    with open_heap(group, requirements, backend=backend) as heap, WeightTransfer(heap, LAYOUT, SPEC) as engine:
        grads = [[xp.zeros((4, 8), np.float32)] for _ in range(M)]
        engine.register_layer(0, masters(), grads)
        same, other = hot_plan(0), hot_plan(1)
        mine = other if me == odd else same
        if backend == "device":
            device_disagreement(engine, grads, same, mine)
            print(f"[disagreement] rank {me} OK", flush=True)
            return
        expect(lambda: engine.weight_sync(0, mine), UltraEPError, "ranks disagree on weight_sync", "hash of the plan")
        expect(lambda: engine.reduce_grads(0, mine), UltraEPError, "ranks disagree on reduce_grads")
        expect(lambda: engine.restore(0, mine), UltraEPError, "ranks disagree on weight_sync")
        expect(lambda: engine.weight_sync(1 if me == odd else 0, same), UltraEPError,
               f"rank {odd}: layer 1 has no registered master")
        expect(lambda: engine.weight_sync(0, "plan"), UltraEPError, "weight_sync(0) failed")
        expect(lambda: heap.barrier(timeout_s=0), ValueError, "timeout_s must be a positive")
        engine.weight_sync(0, same)  # still usable: nothing was written by a refused call
        engine.reduce_grads(0, same)
    print(f"[disagreement] rank {me} OK", flush=True)


def device_disagreement(engine, grads, same, mine) -> None:
    """On the device the plans are compared by a kernel: a refused transfer writes nothing,
    every transfer after it up to the report does nothing either, and synchronize raises the
    disagreement on every rank, naming the odd rank's hash."""
    wanted = ("ranks disagree on", "hash of the plan", f"ranks [{odd}]: 0x")
    engine.register_layer(1, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
    slots = [engine.replica_weights(s)[0] for s in range(LAYOUT.redundant_slots)]
    for slot in slots:
        slot[...] = -5.0  # poison: a refused weight_sync leaves it
    engine.weight_sync(0, mine)
    engine.weight_sync(0, same)  # after a refusal, until it is reported: nothing either
    expect(engine.synchronize, UltraEPError, "ranks disagree on weight_sync(0)", *wanted)
    assert all(bool((slot == -5.0).all()) for slot in slots), f"rank {me}: a refused weight_sync wrote a replica"
    engine.restore(1 if me == odd else 0, same)  # the layer is hashed too
    expect(engine.synchronize, UltraEPError, "ranks disagree on weight_sync(", *wanted)
    engine.weight_sync(0, same)  # reported: usable again
    engine.synchronize()
    filled = sum(group.allgather(sum(not bool((slot == -5.0).all()) for slot in slots)))
    replicas = int((np.asarray(same.replica_count) - 1).sum())
    assert filled == replicas > 0, f"rank {me}: the agreed weight_sync filled {filled} of {replicas} replica slots"
    for slot in range(LAYOUT.redundant_slots):
        engine.replica_grads(slot)[0][...] = 1.0
    engine.reduce_grads(0, mine)
    expect(engine.synchronize, UltraEPError, "ranks disagree on reduce_grads(0)", *wanted)
    assert all(float(abs(g[0]).sum()) == 0.0 for g in grads), f"rank {me}: a refused reduce_grads added gradients"
    engine.reduce_grads(0, same)
    engine.synchronize()


def stale_grads() -> None:
    """A micro-batch that writes no replica gradient adds nothing: reduce_grads zeroed the slots after reading."""
    with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend=backend) as heap, \
            WeightTransfer(heap, LAYOUT, SPEC) as engine:
        grads = [[xp.zeros((4, 8), np.float32)] for _ in range(M)]
        engine.register_layer(0, masters(), grads)
        plan = hot_plan(0)
        engine.weight_sync(0, plan)
        for slot in range(LAYOUT.redundant_slots):
            engine.replica_grads(slot)[0][...] = 1.0
        engine.reduce_grads(0, plan)
        engine.synchronize()
        first = [float(g[0].sum()) for g in grads]
        engine.restore(0, plan)  # the next micro-batch writes no replica gradient
        engine.reduce_grads(0, plan)
        engine.synchronize()
        second = [float(g[0].sum()) for g in grads]
        assert second == first, f"rank {me}: stale replica gradients added again: {first} -> {second}"
        replicas = int(sum(group.allgather(int((np.asarray(plan.replica_count) - 1).sum()))))
        assert replicas > 0 and sum(group.allgather(sum(first))) > 0, "the plan reduced no replica"
    print(f"[stale_grads] rank {me} OK", flush=True)


def lone_bad_id() -> None:
    """sync_checks=False, a bad id on one rank: it raises at once, the others give up within
    their timeout naming it -- nobody hangs."""
    start = time.monotonic()
    with Dispatcher(group, hidden=16, dtype="float32", top_k=2, num_experts=2 * R, max_tokens=4, backend=backend,
                    sync_checks=False, timeout_s=2.0) as disp:
        ids = np.zeros((4, 2), np.int64)
        if me == odd:
            ids[0, 0] = 99
        try:
            disp.dispatch(xp.ones((4, 16), np.float32), xp.asarray(ids), xp.ones((4, 2), np.float32))
            disp.check()
        except (UltraEPError, TimeoutError) as exc:
            # the others either hear rank odd's own error or give up waiting for it
            wanted = ["expert id 99"] if me == odd else [f"rank {odd}: expert id 99", f"waiting for rank {odd}"]
            assert any(text in str(exc) for text in wanted), f"rank {me}: {exc}"
        else:
            raise AssertionError(f"rank {me}: dispatch returned")
    assert time.monotonic() - start < 20, f"rank {me}: took {time.monotonic() - start:.1f} s"
    print(f"[lone_bad_id] rank {me} OK", flush=True)


def closed_on_one_rank() -> None:
    """An object closed on one rank that the others still call: every rank raises at once,
    naming the close, instead of the others waiting out their timeout."""
    with open_heap(group, TOKEN_HEAP, backend=backend) as heap:
        disp = Dispatcher(group, heap=heap, **TOKENS, backend=backend)  # a caller's heap: its close runs no collective
        if me == odd:
            disp.close()
        expect(lambda: disp.dispatch(X, IDS, GATES), GroupMismatchError, "on a closed Dispatcher")
        disp.close()
    if backend == "host":  # on the device the peers' agreement kernel reports the missing rank by a timeout
        with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend=backend) as heap:
            engine = WeightTransfer(heap, LAYOUT, SPEC)
            engine.register_layer(0, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
            if me == odd:
                engine.close()
            expect(lambda: engine.weight_sync(0, hot_plan(0)), ClosedError if me == odd else CollectiveError,
                   f"rank {odd}: the WeightTransfer is closed")
            engine.close()
    # A MoELayer on a caller's heap (its close runs no collective) closed on one rank.
    from ultraep import MoELayer, MoELayerError

    layer_tokens = dict(hidden=64, dtype="bfloat16", top_k=2, num_experts=2 * R, max_tokens=4)
    with open_heap(group, Dispatcher.heap_requirements(R, **layer_tokens), backend=backend) as heap:
        layer = MoELayer(group, hidden=64, ffn=32, num_experts=2 * R, top_k=2, max_tokens=4, backend=backend,
                         heap=heap)
        if me == odd:
            layer.close()
        x64 = arrays(backend)[2](bf16(np.ones((4, 64))))
        expect(lambda: layer.forward(x64, IDS, GATES), (GroupMismatchError, MoELayerError),
               "on a closed MoELayer")
        layer.close()
    # A caller's heap closed on every rank: the constructor refuses alike everywhere, the group goes on.
    with open_heap(group, TOKEN_HEAP, backend=backend) as heap:
        pass
    expect(lambda: Dispatcher(group, heap=heap, **TOKENS, backend=backend), ClosedError, "symmetric heap is closed")
    group.barrier(timeout_s=60)
    print(f"[closed_on_one_rank] rank {me} OK", flush=True)


def crossed_objects() -> None:
    """One rank calls another Dispatcher than its peers: GroupMismatchError naming both at
    once (the same call name on two objects passed the check, then timed out in a barrier)."""
    with Dispatcher(group, **TOKENS, backend=backend) as first, Dispatcher(group, **TOKENS, backend=backend) as second:
        serials = first.config.serial, second.config.serial
        mine = second if me == odd else first
        expect(lambda: mine.dispatch(X, IDS, GATES), GroupMismatchError, *(f"of Dispatcher #{n}'" for n in serials))
        for disp in (first, second):  # both still usable, in step
            recv = disp.dispatch(X, IDS, GATES)
            disp.combine(recv.x, recv.handle)
        second.close()  # in the same order on every rank
    if backend == "host":  # the device engines agree on the device, where the crossing reads as a timeout
        needs = WeightTransfer.heap_requirements(LAYOUT, SPEC)
        with open_heap(group, needs + needs, backend=backend) as heap:
            engines = [WeightTransfer(heap, LAYOUT, SPEC) for _ in range(2)]
            for engine in engines:
                engine.register_layer(0, masters(), [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
            mine = engines[1] if me == odd else engines[0]
            expect(lambda: mine.weight_sync(0, hot_plan(0)), GroupMismatchError,
                   *(f"of WeightTransfer #{engine.serial}" for engine in engines))
            for engine in engines:
                engine.close()
    print(f"[crossed_objects] rank {me} OK", flush=True)


def lone_constructor_failure() -> None:
    """A constructor failing on one rank only, on a caller's heap and on its own: the peers'
    next wait raises RankFailedError carrying the cause at once. A MoELayer whose weights
    cannot be allocated on one rank fails on every rank alike, the group still usable."""
    from ultraep import MoELayer, MoELayerError, RankFailedError
    from ultraep.integration import moe_layer

    target = sys.argv[3]
    if me == odd:
        def injected(*args, **kwargs):
            raise RuntimeError(f"injected failure on rank {me}")
        if target == "moe_layer":
            moe_layer._fused_forward = injected
        elif target == "moe_allocation":
            moe_layer.MoELayer._allocate = injected
        elif backend == "device":
            from ultraep.token.device import DeviceDispatcher
            DeviceDispatcher.__init__ = injected
        else:
            from ultraep.token.host import HostDispatcher
            HostDispatcher.__init__ = injected
    try:
        if target.startswith("moe"):  # its own heap
            MoELayer(group, hidden=64, ffn=32, num_experts=2 * R, top_k=2, max_tokens=8, backend=backend,
                     fused=target == "moe_layer")
        else:  # a caller's heap
            heap = open_heap(group, TOKEN_HEAP, backend=backend)
            Dispatcher(group, heap=heap, **TOKENS, backend=backend)
        group.barrier(timeout_s=60)  # the peers' next collective
    except (RuntimeError, MoELayerError) as exc:
        assert f"injected failure on rank {odd}" in str(exc), str(exc)
        if target == "moe_allocation":
            assert isinstance(exc, MoELayerError), repr(exc)
            group.barrier(timeout_s=60)  # every rank raised it: the group goes on
        else:
            assert me == odd or isinstance(exc, RankFailedError), repr(exc)
    else:
        raise AssertionError(f"rank {me}: a peer's constructor failure went unnoticed")
    print(f"[lone_constructor_failure] rank {me} OK", flush=True)


{"use_after_close": use_after_close, "disagreement": disagreement, "stale_grads": stale_grads,
 "lone_bad_id": lone_bad_id, "closed_on_one_rank": closed_on_one_rank, "crossed_objects": crossed_objects,
 "lone_constructor_failure": lone_constructor_failure}[case]()
