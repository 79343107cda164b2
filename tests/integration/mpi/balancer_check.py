"""Multi-rank Balancer check, run under mpiexec by tests/integration/test_balancer.py.

Usage: python -m mpi4py balancer_check.py {host|device} {flow|pipeline|bad-input|shared-heap|hot-path|streams|
       late-planner}
       [out dir]

Every rank's top-k ids, master weights and replica gradients are seeded functions of
(layer, micro-batch, rank, expert), so each rank computes the gathered loads, the plan,
the replica contents and the reduced gradients it must see without asking anyone.
"""

import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.analysis.plots import plot_rank_loads
from ultraep.errors import ClosedError, CollectiveError, TransferTimeout
from ultraep.integration import Balancer, BalancerError, StaleHandleError
from ultraep.integration.pipeline import max_in_flight, one_f_one_b
from ultraep.integration.traces import load_trace
from ultraep.planner import ExpertLayout, plan_placement, reroute
from ultraep.runtime import open_heap
from ultraep.runtime.group import EPGroup, GroupMismatchError, ranks_per_gpu
from ultraep.runtime.heap import ALLOC_ALIGN, HeapError, HeapRequirements
from ultraep.transfer import ExpertSpec
from ultraep.transfer.host import reference_reduce

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

backend, check = sys.argv[1], sys.argv[2]
out_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else None
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp
    host = xp.asnumpy
else:
    xp = np
    host = np.asarray

E, S, TOKENS, TOP_K, MIN_REPLICA = 2 * R, 2, 96, 2, 4
LAYOUT = ExpertLayout(R, E, S)
M = LAYOUT.experts_per_rank
SPEC = ExpertSpec([("w_in", (8, 16), "float32"), ("w_out", (16, 8), "float32")], grad_dtype="float32")


def routing(layer, step, rank):
    """Skewed top-k ids: a hot expert that moves with (layer, step), distinct per token."""
    rng = np.random.default_rng((layer, step, rank))
    hot = (layer + 3 * step) % E
    weights = 1.0 / (1 + (np.arange(E) - hot) % E) ** 1.5
    p = weights / weights.sum()
    return np.stack([rng.choice(E, size=TOP_K, replace=False, p=p) for _ in range(TOKENS)]).astype(np.int64)


def gathered_loads(layer, step):
    return np.stack([np.bincount(routing(layer, step, r).ravel(), minlength=E) for r in range(R)]).astype(np.int32)


def expected_plan(layer, step):
    return plan_placement(gathered_loads(layer, step), LAYOUT, min_replica_tokens=MIN_REPLICA)


def master_weights(layer, expert):
    return [np.random.default_rng((layer, expert, t)).standard_normal(w.shape).astype(np.float32)
            for t, w in enumerate(SPEC.weights)]


def grads_of(layer, step, expert, rank):
    """The gradient instance `rank` computes for `expert` (rank = master: its own part)."""
    return [np.random.default_rng((layer, step, expert, rank, t, 9)).standard_normal(g.shape).astype(np.float32)
            for t, g in enumerate(SPEC.grads)]



class Model:
    """Masters of every layer on this rank, registered with the Balancer."""

    def __init__(self, balancer, layers):
        self.bal = balancer
        self.weights, self.grads = {}, {}
        for layer in layers:
            self.weights[layer] = [[xp.asarray(w) for w in master_weights(layer, me * M + m)] for m in range(M)]
            self.grads[layer] = [[xp.zeros(g.shape, np.float32) for g in SPEC.grads] for _ in range(M)]
            balancer.register_layer(layer, self.weights[layer], self.grads[layer])

    def forward(self, layer, step, sync_in_update=False):
        """update + weight_sync + reroute, each checked against the NumPy planner
        (``sync_in_update``: the update starts the sync, weight_sync returns it)."""
        ids = routing(layer, step, me)
        handle = self.bal.update(layer, xp.asarray(ids), weight_sync=sync_in_update)
        want = expected_plan(layer, step)
        got = self.bal.plan(handle).to_numpy()
        for name in ("loads", "phys_to_log", "log_to_phys", "replica_count", "quota", "split_prefix", "rank_load"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), f"rank {me}: plan {name} differs"
        self.bal.weight_sync(handle)
        self.check_replicas(handle, layer, want)
        slots = host(self.bal.reroute(handle, xp.asarray(ids)))
        assert np.array_equal(slots, reroute(ids, want, me)), f"rank {me}: reroute differs"
        return handle, want

    def check_replicas(self, handle, layer, want):
        local = host(self.bal.local_experts(handle))
        assert np.array_equal(local, want.phys_to_log[me * (M + S):(me + 1) * (M + S)])
        for s, tensors in enumerate(self.bal.replica_weights(handle)):
            expert = int(local[M + s])
            if expert >= 0:
                for got, ref in zip(tensors, master_weights(layer, expert)):
                    assert np.array_equal(host(got), ref), f"rank {me}: replica slot {s} is not expert {expert}"

    def backward(self, handle, layer, step, want):
        """restore + replica gradients + reduce_grads, against reference_reduce."""
        self.bal.restore(handle)
        self.check_replicas(handle, layer, want)
        local = want.phys_to_log[me * (M + S):(me + 1) * (M + S)]
        for s, tensors in enumerate(self.bal.replica_grads(handle)):
            if local[M + s] >= 0:
                for dst, value in zip(tensors, grads_of(layer, step, int(local[M + s]), me)):
                    dst[...] = xp.asarray(value)
        for m in range(M):
            for t, value in enumerate(grads_of(layer, step, me * M + m, me)):
                self.grads[layer][m][t][...] = xp.asarray(value)
        self.bal.reduce_grads(handle)
        for m in range(M):
            e = me * M + m
            hosts = [int(p) // (M + S) for p in want.log_to_phys[e, 1:want.replica_count[e]]]
            for t in range(len(SPEC.grads)):
                ref = reference_reduce(grads_of(layer, step, e, me)[t], [grads_of(layer, step, e, r)[t] for r in hosts])
                assert np.array_equal(host(self.grads[layer][m][t]), ref), f"rank {me}: layer {layer} expert {e} grad"


def flow():
    """Two layers, three micro-batches, forward then backward (layer 1's syncs started by its
    updates); stats, trace and plot."""
    steps, layers = 3, 2
    with Balancer(group, LAYOUT, SPEC, num_layers=layers, min_replica_tokens=MIN_REPLICA, backend=backend,
                  record_trace=True) as bal:
        model = Model(bal, range(layers))
        replicas = []
        for step in range(steps):
            done = [model.forward(layer, step, sync_in_update=layer == 1) for layer in range(layers)]
            for layer in reversed(range(layers)):
                handle, want = done[layer]
                model.backward(handle, layer, step, want)
                replicas.append(want.slots_used)
        stats = bal.stats()
        records = sorted(stats.records, key=lambda r: (r.step, -r.layer))
        assert len(records) == steps * layers and stats.updates == stats.liveness == steps * layers, stats.summary()
        assert sum(replicas) > 0, "the skewed routing never replicated anything: the check would prove nothing"
        # sync_checks reads the bad-id count back once per update on the GPU; the host never waits for a device
        assert stats.host_waits >= stats.updates if backend == "device" else stats.host_waits == 0, stats.summary()
        for record, used in zip(records, replicas):
            want = expected_plan(record.layer, record.step)
            assert record.replicas == used
            assert record.imbalance_before == want.imbalance_before and record.imbalance_after == want.imbalance_after
            assert record.imbalance_after <= record.imbalance_before
            assert record.weight_bytes == 2 * used * SPEC.weight_slot_bytes  # weight_sync + restore
            assert record.weight_syncs == 2
            assert record.grad_bytes == used * SPEC.grad_slot_bytes
            timed = {"update", "weight_sync", "reroute", "restore", "reduce_grads"}
            assert set(record.times_ms) == timed - ({"weight_sync"} if record.layer == 1 else set())  # in update's
            assert all(t is not None and t >= 0 for t in record.times_ms.values()), record.times_ms
        summary = stats.summary()
        assert summary["imbalance_after_mean"] < summary["imbalance_before_mean"], summary
        if me == 0:
            trace = load_trace(bal.save_trace(out_dir / "balancer_trace.npz"))
            for step in range(steps):
                for layer in range(layers):
                    assert np.array_equal(trace.loads[step, layer], gathered_loads(layer, step))
            plot_rank_loads(stats.records, out_dir / "rank_loads.png")
            print(f"imbalance {summary['imbalance_before_mean']:.3f} -> {summary['imbalance_after_mean']:.3f}, "
                  f"{summary['bytes_moved']} bytes moved", flush=True)
    print(f"[flow] rank {me} OK", flush=True)


def pipeline():
    """2-stage 1F1B with 4 micro-batches: stage 0 has 2 micro-batches in flight. Each
    stage has its own Balancer (2 layers each); backward restores and reduces with the
    plan of its own forward although later forwards replanned the same layers."""
    stages, micro_batches, layers_per_stage = 2, 4, 2
    order = one_f_one_b(stages, micro_batches)
    assert [max_in_flight(order, s) for s in range(stages)] == [2, 1]
    balancers = [Balancer(group, LAYOUT, SPEC, num_layers=layers_per_stage, min_replica_tokens=MIN_REPLICA,
                          max_in_flight=max_in_flight(order, s), backend=backend) for s in range(stages)]
    models = [Model(balancers[s], range(layers_per_stage)) for s in range(stages)]
    saved, plans_differ = {}, False
    for stage, kind, mb in order:
        for local in (range(layers_per_stage) if kind == "F" else reversed(range(layers_per_stage))):
            if kind == "F":
                handle, want = models[stage].forward(local, mb)
                saved[(stage, local, mb)] = (handle, want)
                previous = saved.get((stage, local, mb - 1))
                plans_differ |= previous is not None and not np.array_equal(previous[1].log_to_phys, want.log_to_phys)
            else:
                handle, want = saved.pop((stage, local, mb))
                models[stage].backward(handle, local, mb, want)
    assert plans_differ, "no two micro-batches in flight had different plans: the ring would not be tested"
    for bal in balancers:
        assert bal.stats().updates == micro_batches * layers_per_stage
        bal.close()
    if me == 0:
        print(f"1F1B order: {' '.join(f'{k}{mb}@s{s}' for s, k, mb in order)}", flush=True)
    print(f"[pipeline] rank {me} OK", flush=True)


def bad_input():
    ids = routing(0, 0, me)
    with Balancer(group, LAYOUT, SPEC, num_layers=3, min_replica_tokens=MIN_REPLICA, backend=backend) as bal:
        Model(bal, range(2))  # layer 2 stays unregistered
        bad = ids.copy()
        if me == 1:
            bad[5, 1] = E + 3
        expect(lambda: bal.update(0, xp.asarray(bad)), BalancerError, "rank 1", f"outside [0, {E})", "(5, 1)")
        floats = ids.astype(np.float32) if me == 2 else ids
        expect(lambda: bal.update(0, xp.asarray(floats)), BalancerError, "rank 2", "integer dtype")
        expect(lambda: bal.update(0, [[0, 1]] if me == 0 else xp.asarray(ids)), BalancerError, "rank 0", "not a tensor")
        expect(lambda: bal.update(1 if me == 3 else 0, xp.asarray(ids)), GroupMismatchError, "ranks disagree")
        wide = xp.asarray(np.concatenate([ids, ids[:, :1]], axis=1) if me == 0 else ids)
        expect(lambda: bal.update(0, wide), GroupMismatchError, "ranks disagree", "top-k width")
        expect(lambda: bal.update(3, xp.asarray(ids)), BalancerError, "layer must be an int in [0, 3)")
        expect(lambda: bal.update(2, xp.asarray(ids), weight_sync=True), BalancerError, "layer 2 has no registered",
               "register_layer first")
        expect(lambda: bal.update(0, xp.asarray(ids), local_loads=xp.zeros(E, np.int32)), BalancerError, "exactly one")
        expect(lambda: bal.update(0, xp.asarray(ids), weight_sync="yes" if me == 2 else False), BalancerError,
               "rank 2", "weight_sync must be a bool")
        expect(lambda: bal.update(0, xp.asarray(ids), weight_sync=me == 0), GroupMismatchError, "ranks disagree",
               "weight_sync")
        # the failed calls changed nothing: the next update is micro-batch 0 and plans as expected
        h0 = bal.update(0, xp.asarray(ids))
        assert h0.step == 0
        same = bal.update(1, local_loads=xp.asarray(np.bincount(ids.ravel(), minlength=E).astype(np.int32)))
        assert np.array_equal(host(bal.plan(same).phys_to_log), expected_plan(0, 0).phys_to_log)
        expect(lambda: bal.replica_weights(h0), BalancerError, "hold nothing")
        expect(lambda: bal.reduce_grads(h0), ValueError, "call weight_sync/restore with this handle first")
        too_many = np.concatenate([ids, ids[:1]]) if me == 2 else ids
        if backend == "host":  # the CuPy reroute cannot look at values; it writes -1 instead
            expect(lambda: bal.reroute(h0, xp.asarray(too_many)), BalancerError, "rank 2", "more tokens")
        h1 = bal.update(0, xp.asarray(routing(0, 1, me)))  # max_in_flight=1: reuses h0's slot
        expect(lambda: bal.weight_sync(h0), StaleHandleError, "stale", "micro-batch 0", "now holds micro-batch 1")
        # one rank alone passes a stale handle: every rank raises, nobody waits in the barrier
        expect(lambda: bal.weight_sync(h0 if me == 1 else h1), ValueError, "rank 1", "stale")
        bal.weight_sync(h1)
        assert len(bal.replica_weights(h1)) == S
        expect(lambda: bal.replica_grads(h0), StaleHandleError, "stale")
        # the gradient slots hold one synced handle's gradients from replica_grads to reduce_grads
        expect(lambda: bal.replica_grads(same), BalancerError, "call weight_sync/restore with this handle first")
        bal.weight_sync(same)
        bal.replica_grads(h1)  # h1's weights are no longer in the slots: its gradients may still go there
        expect(lambda: bal.replica_grads(same), BalancerError, "hold layer 0, micro-batch 1's gradients")
        expect(lambda: bal.reduce_grads(same), ValueError, "reduce_grads with that handle first")
        bal.reduce_grads(h1)
        assert len(bal.replica_grads(same)) == S
        bal.reduce_grads(same)
        bal.check()
    expect(lambda: bal.update(0, xp.asarray(ids)), ClosedError, "the Balancer is closed")
    print(f"[bad-input] rank {me} OK", flush=True)


def shared_heap():
    """A Balancer inside a heap the caller opened for it and another component (here one
    tensor, allocated first): it allocates exactly its declared requirements, works, leaves
    the other tensor alone, and close() leaves the heap open. A backend that contradicts the
    heap's is refused on every rank before anything is allocated."""
    other = HeapRequirements.of(tensors=[("caller.tensor", (R, 64), np.float32)])
    options = {"tile_bytes": 256, "chunk_tiles": 2}
    needs = Balancer.heap_requirements(LAYOUT, SPEC, transfer_options=options)
    with open_heap(group, other + needs, backend=backend) as heap:
        tensor = heap.allocate(other)["caller.tensor"]
        for peer in range(R):
            tensor.peer(peer)[me] = me + 1  # each rank fills its row everywhere
        heap.barrier()
        wrong = "host" if backend == "device" else "device"
        expect(lambda: Balancer(group, LAYOUT, SPEC, num_layers=1, backend=wrong, heap=heap), CollectiveError,
               f"on {R} of {R} rank(s)", f"backend={wrong!r} contradicts the heap's backend {backend!r}")
        assert set(heap.allocations) == {"caller.tensor"}, "a refused Balancer allocated in the heap"
        with Balancer(group, LAYOUT, SPEC, num_layers=2, min_replica_tokens=MIN_REPLICA, backend=backend, heap=heap,
                      transfer_options=options) as bal:
            declared = {name for name, _, _ in needs.tensors} | {name for name, _ in needs.signals}
            assert set(heap.allocations) == declared | {"caller.tensor"}, sorted(heap.allocations)
            model = Model(bal, range(2))
            for step in range(2):
                done = [model.forward(layer, step) for layer in range(2)]
                for layer in reversed(range(2)):
                    handle, want = done[layer]
                    model.backward(handle, layer, step, want)
            bal.check()
            assert bal.stats().updates == 4
        heap.barrier()  # still open and usable after the Balancer closed
        assert np.array_equal(host(tensor.local), np.repeat(np.arange(1, R + 1, dtype=np.float32)[:, None], 64, 1))
        # the declared requirements filled the heap to the byte: not one more aligned block fits
        expect(lambda: heap.alloc("one.more", (ALLOC_ALIGN,), np.uint8), HeapError, "out of space")
    print(f"[shared-heap] rank {me} OK", flush=True)


GATE_TIMEOUT_S = 60.0
GATE_SOURCE = r"""
extern "C" __global__ void gate(const volatile int* open, unsigned long long timeout_ns, int* timed_out) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while (!*open) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) { *timed_out = 1; return; }
        __nanosleep(1000);
    }
}
"""


def hot_path():
    """GPU, sync_checks=False. A warm-up uses every ring slot once (two layers, two
    micro-batches in flight). Then, while a gate kernel holds this rank's stream closed,
    two more micro-batches run update -> weight_sync -> reroute -> restore -> reduce_grads
    (1F1B-like: both forwards, then both backwards; each ring slot reused once). The host
    must finish enqueuing all of it with the gate still closed -- a call that waited for
    the device (a stream, event or device synchronisation, a .get()) would have waited
    for the gate -- and without one CuPy memory-pool allocation. The gate then opens and
    every result is checked against the NumPy references."""
    import cupy
    import cupyx
    from cupy.cuda import memory_hook

    class PoolAllocations(memory_hook.MemoryHook):
        name = "PoolAllocations"

        def __init__(self):
            self.stacks = []

        def malloc_preprocess(self, **kwargs):
            self.stacks.append("".join(traceback.format_stack(limit=12)))

    layers, in_flight, warm, gated = 2, 2, (0, 1), (2, 3)
    stream = cupy.cuda.Stream(non_blocking=True)
    gate = cupy.RawKernel(GATE_SOURCE, "gate")
    with stream, Balancer(group, LAYOUT, SPEC, num_layers=layers, min_replica_tokens=MIN_REPLICA,
                          max_in_flight=in_flight, backend="device", sync_checks=False) as bal:
        model = Model(bal, range(layers))
        warm_handles = {(layer, step): model.forward(layer, step) for step in warm for layer in range(layers)}
        for step in warm:
            for layer in reversed(range(layers)):
                handle, plan = warm_handles[(layer, step)]
                model.backward(handle, layer, step, plan)
        # Everything the gated part reads is staged on the device first, so the "framework"
        # side allocates nothing either.
        want = {(layer, step): expected_plan(layer, step) for step in gated for layer in range(layers)}
        ids = {key: xp.asarray(routing(*key, me)) for key in want}
        master_grads = {key: [[xp.asarray(g) for g in grads_of(*key, me * M + m, me)] for m in range(M)]
                        for key in want}
        replica_grads, results = {}, {}
        for (layer, step), plan in want.items():
            local = plan.phys_to_log[me * (M + S) + M:(me + 1) * (M + S)]
            replica_grads[(layer, step)] = {s: [xp.asarray(g) for g in grads_of(layer, step, int(e), me)]
                                            for s, e in enumerate(local) if e >= 0}
            results[(layer, step)] = [[xp.empty(g.shape, np.float32) for g in SPEC.grads] for _ in range(M)]
        opened, timed_out = cupyx.empty_pinned(1, np.int32), xp.zeros(1, np.int32)
        opened[0] = 1
        gate((1,), (32,), (np.uint64(opened.ctypes.data), np.uint64(GATE_TIMEOUT_S * 1e9), timed_out))  # compile
        after_gate = cupy.cuda.Event()
        stream.synchronize()
        bal.check()

        opened[0] = 0
        gate((1,), (32,), (np.uint64(opened.ctypes.data), np.uint64(GATE_TIMEOUT_S * 1e9), timed_out))
        after_gate.record(stream)
        hook, call_times, handles, slots = PoolAllocations(), [], {}, {}
        with hook:  # the hook must see an allocation, or its silence below would prove nothing
            xp.empty(1, np.int8)
        assert len(hook.stacks) == 1, f"rank {me}: the pool hook missed a control allocation"
        hook.stacks.clear()

        def timed(what, fn, *args):
            start = time.perf_counter()
            result = fn(*args)
            call_times.append((time.perf_counter() - start, what))
            return result

        enqueue_start = time.perf_counter()
        with hook:
            for step in gated:
                for layer in range(layers):
                    handle = handles[(layer, step)] = timed(f"update({layer}, {step})", bal.update, layer,
                                                            ids[(layer, step)])
                    timed(f"weight_sync({layer}, {step})", bal.weight_sync, handle)
                    slots[(layer, step)] = timed(f"reroute({layer}, {step})", bal.reroute, handle, ids[(layer, step)])
            for step in gated:
                for layer in reversed(range(layers)):
                    key, handle = (layer, step), handles[(layer, step)]
                    timed(f"restore({layer}, {step})", bal.restore, handle)
                    views = timed(f"replica_grads({layer}, {step})", bal.replica_grads, handle)
                    for s, values in replica_grads[key].items():
                        for dst, value in zip(views[s], values):
                            dst[...] = value
                    for m in range(M):
                        for t in range(len(SPEC.grads)):
                            model.grads[layer][m][t][...] = master_grads[key][m][t]
                    timed(f"reduce_grads({layer}, {step})", bal.reduce_grads, handle)
                    for m in range(M):
                        for t in range(len(SPEC.grads)):
                            results[key][m][t][...] = model.grads[layer][m][t]
        enqueue_s = time.perf_counter() - enqueue_start
        gate_closed = not after_gate.done
        opened[0] = 1
        stream.synchronize()
        bal.check()
        slowest = max(call_times)
        assert gate_closed and not int(timed_out[0]), (
            f"rank {me}: the device ran past the gate before the host had enqueued the hot path "
            f"({enqueue_s:.3f} s; slowest call {slowest[1]}: {slowest[0]:.3f} s): a call waited for the device")
        assert not hook.stacks, (f"rank {me}: {len(hook.stacks)} CuPy pool allocation(s) on the hot path; "
                                 f"the first:\n{hook.stacks[0]}")

        for (layer, step), plan in want.items():
            got = host(slots[(layer, step)])
            assert np.array_equal(got, reroute(routing(layer, step, me), plan, me)), f"rank {me}: reroute {layer, step}"
            for m in range(M):
                e = me * M + m
                hosts = [int(p) // (M + S) for p in plan.log_to_phys[e, 1:plan.replica_count[e]]]
                for t in range(len(SPEC.grads)):
                    ref = reference_reduce(grads_of(layer, step, e, me)[t],
                                           [grads_of(layer, step, e, r)[t] for r in hosts])
                    assert np.array_equal(host(results[(layer, step)][m][t]), ref), f"rank {me}: grad {layer, step, e}"
        last = (0, gated[-1])
        model.check_replicas(handles[last], last[0], want[last])
        stats = bal.stats()
        assert stats.updates == stats.liveness == layers * (len(warm) + len(gated)), stats.summary()
        # the ring slots' earlier records had landed before the gate: no update blocked the host
        assert stats.host_waits == 0 and stats.host_wait_ms == 0.0, stats.summary()
        replicated = sum(plan.slots_used for plan in want.values())
        assert replicated > 0, "the gated micro-batches replicated nothing: the transfers were not exercised"
        calls = len(call_times)
    if me == 0:
        print(f"hot path: {calls} Balancer calls enqueued in {enqueue_s * 1e3:.1f} ms behind a closed gate "
              f"(slowest {slowest[1]} {slowest[0] * 1e3:.2f} ms), 0 pool allocations, {replicated} replicas",
              flush=True)
    print(f"[hot-path] rank {me} OK", flush=True)


def replica_values(bal, handle, layer, plan, stream=None):
    """(slot, want, copy) of every replica slot the plan fills on this rank; on the GPU the
    copies are taken on ``stream`` behind whatever it already holds."""
    local = plan.phys_to_log[me * (M + S) + M:(me + 1) * (M + S)]
    views = bal.replica_weights(handle, wait=False)
    out = []
    for s, expert in enumerate(local):
        if expert >= 0:
            with stream if stream is not None else nullcontext():
                out.append((s, master_weights(layer, int(expert)), [v.copy() for v in views[s]]))
    return out


def assert_replicas(values, stream, what):
    if stream is not None:
        stream.synchronize()
    for s, want, got in values:
        for g, w in zip(got, want):
            assert np.array_equal(host(g), w), f"rank {me}: replica slot {s} {what}"


def step(what: str) -> None:
    """A progress line, so that a check stuck on the GPU shows where."""
    print(f"[streams] rank {me} at {time.monotonic():.3f}: {what}", flush=True)


def streams():
    """The sync on a side stream, each slot waited for alone on a compute stream (and the
    same API on the host, where there is nothing to wait for). On the GPU: a rank whose
    compute stream still reads its replica slots (held by a gate kernel) keeps every
    peer's next sync from overwriting them; a slot whose flags never come times out,
    naming the slot and layer."""
    gpu = backend == "device"
    side = xp.cuda.Stream(non_blocking=True) if gpu else None
    compute = xp.cuda.Stream(non_blocking=True) if gpu else None
    if gpu:
        import cupy
        import cupyx

        opened, timed_out = cupyx.empty_pinned(1, np.int32), cupy.zeros(1, np.int32)
        opened[0] = 1
        gate = cupy.RawKernel(GATE_SOURCE, "gate")
        gate((1,), (32,), (np.uint64(opened.ctypes.data), np.uint64(GATE_TIMEOUT_S * 1e9), timed_out))  # compile
        cupy.cuda.Device().synchronize()
    with Balancer(group, LAYOUT, SPEC, num_layers=2, min_replica_tokens=MIN_REPLICA, backend=backend,
                  timeout_s=5.0) as bal:
        Model(bal, range(2))
        handles, plans = {}, {}
        for layer in range(2):
            plans[layer] = expected_plan(layer, 0)
            handles[layer] = bal.update(layer, xp.asarray(routing(layer, 0, me)))
        assert plans[0].slots_used > 0 and plans[1].slots_used > 0, "nothing replicated: the check would prove nothing"
        expect(lambda: bal.weight_sync(handles[0], stream=side, blocks=0), BalancerError, f"failed on {R} of {R}",
               "weight_sync: blocks must be in [1,")
        sync = bal.weight_sync(handles[0], stream=side)
        expect(lambda: bal.wait_replica(handles[0], S), BalancerError, f"slot must be None or an int in [0, {S})")
        expect(lambda: bal.wait_replica(handles[1], 0), BalancerError, "replica buffers hold layer 0")
        for s in range(S):
            sync.wait(s, stream=compute)
        if gpu:
            # Before the gated window: load CuPy's copy kernel and leave blocks of these sizes in
            # the compute stream's pool, so the copies behind the gate neither load a module nor
            # cudaMalloc (either may wait for the running gate, with the host holding it shut).
            replica_values(bal, handles[0], 0, plans[0], stream=compute)
            compute.synchronize()
            opened[0] = 0
            with compute:  # this rank still "computes" with layer 0's replicas until the gate opens
                gate((1,), (32,), (np.uint64(opened.ctypes.data), np.uint64(GATE_TIMEOUT_S * 1e9), timed_out))
        step("gate closed")
        held = replica_values(bal, handles[0], 0, plans[0], stream=compute)
        step("layer 0's replicas copied behind the gate")
        bal.weight_sync(handles[1], stream=side)  # layer 1's replicas go to the same slots
        step("layer 1's sync enqueued")
        if gpu:
            time.sleep(0.5)  # ample for the peers' syncs, were they not held back
            opened[0] = 1
            step("gate opened")
        assert_replicas(held, compute, "was overwritten while this rank read it")
        bal.wait_replica(handles[1], stream=compute)
        assert_replicas(replica_values(bal, handles[1], 1, plans[1], stream=compute), compute, "is not layer 1's")
        bal.check()
        step("layer 1's replicas checked")
        if gpu:
            assert not int(timed_out[0]), f"rank {me}: the gate timed out"
            filled = [s for s, _, _ in replica_values(bal, handles[1], 1, plans[1])]
            bal.transfer._flagged_epoch += 1  # a sync that never ran: its flags never come
            if filled:
                bal.wait_replica(handles[1], filled[0])
                expect(bal.check, TransferTimeout, f"replica slot {filled[0]} of layer 1", "waited 5 s")
            bal.transfer._flagged_epoch -= 1
            group.barrier()
    print(f"[streams] rank {me} OK", flush=True)


LATE_PLANNER_NS = 1_000_000


def late_planner():
    """Ranks sharing a GPU (MPS), one planning late: the last rank's planner starts 1 ms
    after its gather (a sleep kernel launched ahead of it, inside the update's graph once
    captured), while its peers' update-started syncs already wait for it. Every sync must
    land within the 3 s timeout, every replica its master's (device only), and ranks
    sharing a GPU must take the agreement-before path. The starvation that path removed (a
    sync grid waiting in the agreement on every SM of the share kept the late planner's
    cluster from starting) needs the bench's busy layers: this check alone did not show it."""
    sleep = xp.RawKernel(r"""extern "C" __global__ void sleep_ns(unsigned long long ns) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        do { __nanosleep(1000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    }""", "sleep_ns")
    sleep((1,), (32,), (np.uint64(0),))  # compiled before any timed wait
    sharing = ranks_per_gpu(group) > 1
    # two micro-batches in flight: an update waits for its ring slot's record two steps back, so the host runs ahead
    with Balancer(group, LAYOUT, SPEC, num_layers=2, min_replica_tokens=MIN_REPLICA, backend=backend,
                  sync_checks=False, timeout_s=3.0, max_in_flight=2) as bal:
        assert bal.transfer.impl.agrees_before_sync == sharing, "ranks sharing a GPU must agree before the sync"
        model = Model(bal, range(2))
        planner = bal._impl.planner
        if me == R - 1:
            planning = planner.plan

            def late(*args, **kwargs):
                sleep((1,), (32,), (np.uint64(LATE_PLANNER_NS),))
                return planning(*args, **kwargs)
            planner.plan = late
        steps = 8  # each ring slot runs eagerly, is captured, is replayed
        ids = {(layer, step): xp.asarray(routing(layer, step, me)) for step in range(steps) for layer in range(2)}
        xp.cuda.get_current_stream().synchronize()
        group.barrier()
        for step in range(steps):  # no host read of ours until the end: the device stays busy, as in training
            for layer in range(2):
                handle = bal.update(layer, ids[layer, step], weight_sync=True)
                bal.weight_sync(handle).wait()
        bal.check()
        model.check_replicas(handle, 1, expected_plan(1, steps - 1))
    print(f"[late-planner] rank {me} OK", flush=True)


CHECKS = {"flow": flow, "pipeline": pipeline, "bad-input": bad_input, "shared-heap": shared_heap, "hot-path": hot_path,
          "streams": streams, "late-planner": late_planner}
CHECKS[check]()
