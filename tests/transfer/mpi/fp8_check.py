"""Multi-rank FP8 data-plane check, run under mpiexec by tests/transfer/test_fp8_transfer.py.

Usage: python -m mpi4py fp8_check.py {host|device} {sync|grads}
Experts of FP8 weights (both formats, every byte pattern, NaNs included) with float32
block scales: after weight sync and after restore every replica is byte for byte its
master; the gradient reduction adds the weights' gradients and leaves the scales' zero.
"""

import sys

import numpy as np
from mpi4py import MPI

from ultraep.planner import ExpertLayout, plan_placement
from ultraep.runtime import open_heap
from ultraep.runtime.dtypes import cupy_dtype
from ultraep.runtime.group import EPGroup
from ultraep.transfer import ExpertSpec, WeightTransfer
from ultraep.transfer.host import reference_reduce

backend, check = sys.argv[1], sys.argv[2]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp
    to_host = xp.asnumpy
    held = cupy_dtype  # the dtype CuPy holds an FP8 array as (the type or its bytes)
else:
    xp = np
    to_host = np.asarray
    held = np.dtype

HIDDEN, FFN, BLOCK, LAYERS = 256, 192, 128, 2
SPEC = ExpertSpec([("fc1", (2 * FFN, HIDDEN), "float8_e4m3fn"),
                   ("fc1_scale", (-(-2 * FFN // BLOCK), HIDDEN // BLOCK), "float32", "fc1"),
                   ("fc2", (HIDDEN, FFN), "float8_e5m2"),
                   ("fc2_scale", (HIDDEN // BLOCK, -(-FFN // BLOCK)), "float32", "fc2"),
                   ("bias", (37,), "float8_e4m3fn")], grad_dtype="float32")
LAYOUT = ExpertLayout(R, 2 * R, 2)
M = LAYOUT.experts_per_rank


def master_weights(layer, e):
    """Seeded per (layer, expert): FP8 tensors of random bytes (any pattern is a value or a
    NaN, and the transfer must not care), scales of random positive float32."""
    rng = np.random.default_rng((layer, e))
    return [rng.integers(0, 256, t.shape, dtype=np.uint8).view(t.dtype) if t.dtype.itemsize == 1
            else rng.uniform(1e-3, 1.0, t.shape).astype(t.dtype) for t in SPEC.weights]


def on_device(array):
    """Where the masters live: NumPy on the host; on the GPU CuPy, FP8 as its bytes where
    CuPy does not hold the type (the import accepts those bits)."""
    return xp.asarray(array.view(held(array.dtype)))


def skewed_plan(seed):
    """The planner's plan for a load with one or two hot experts (so replicas, relays when
    an expert is hot enough)."""
    rng = np.random.default_rng(seed)
    loads = rng.integers(10, 40, size=(R, LAYOUT.num_experts)).astype(np.int32)
    loads[:, rng.integers(0, LAYOUT.num_experts, 2)] += 400
    return plan_placement(loads, LAYOUT, backend="host", min_replica_tokens=0)


def register(engine):
    grads = {}
    for layer in range(LAYERS):
        weights = [[on_device(w) for w in master_weights(layer, me * M + m)] for m in range(M)]
        grads[layer] = [[xp.zeros(g.shape, g.dtype) for g in SPEC.grads] for _ in range(M)]
        engine.register_layer(layer, weights, grads[layer])
    return grads


def poison(engine):
    for j in range(LAYOUT.redundant_slots):
        for view in engine.replica_weights(j) + engine.replica_grads(j):
            view.view(np.uint8)[...] = 0xA5


def replicas_of_this_rank(plan):
    """``[(redundant slot, expert)]`` that ``plan`` fills on this rank."""
    p2l = np.asarray(plan.phys_to_log).reshape(R, LAYOUT.slots_per_rank)[me, M:]
    return [(j, int(e)) for j, e in enumerate(p2l.tolist()) if e >= 0]


def check_replicas(engine, plan, layer):
    """Every replica slot of this rank holds its master's bytes; the views are typed."""
    filled = replicas_of_this_rank(plan)
    for j, e in filled:
        views = engine.replica_weights(j)
        for view, want, t in zip(views, master_weights(layer, e), SPEC.weights):
            assert view.shape == t.shape and np.dtype(view.dtype) == held(t.dtype), \
                f"rank {me}: replica {t.name!r} is a {view.dtype} view of shape {view.shape}"
            got = to_host(view).view(np.uint8)
            bad = int(np.count_nonzero(got != want.view(np.uint8)))
            assert bad == 0, f"rank {me}: replica slot {j} {t.name!r} of expert {e}: {bad} bytes differ from the master"
    return len(filled)


def sync(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=1, relay_count=1) as engine:
        register(engine)
        filled = 0
        for trial in range(6):
            plan, layer = skewed_plan(trial), trial % LAYERS
            poison(engine)
            heap.barrier()
            engine.weight_sync(layer, plan)
            engine.synchronize()
            filled += check_replicas(engine, plan, layer)
        assert sum(group.allgather(filled)) > 0, "no replica was ever placed"
        # backward: restore layer 0's plan after another layer's sync overwrote the slots
        plan = skewed_plan(99)
        engine.weight_sync(0, plan)
        engine.weight_sync(1, skewed_plan(98))
        poison(engine)
        heap.barrier()
        engine.restore(0, plan)
        engine.synchronize()
        check_replicas(engine, plan, 0)


def grads(heap):
    """Replica gradients: seeded float32 for the weights, zeros for the scales (what a
    framework writes); each master's gradient becomes the replica-order fp32 sum, and its
    scales' stay zero."""
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2) as engine:
        masters = register(engine)
        plan = skewed_plan(7)
        ltp = np.asarray(plan.log_to_phys)

        def grad(e, instance, t):
            if SPEC.weights[t].name in SPEC.scale_of:
                return np.zeros(SPEC.grads[t].shape, np.float32)
            return np.random.default_rng((e, instance, t)).standard_normal(SPEC.grads[t].shape).astype(np.float32)

        for m in range(M):
            for t in range(len(SPEC.grads)):
                masters[0][m][t][...] = xp.asarray(grad(me * M + m, 0, t))
        for j, e in replicas_of_this_rank(plan):
            instance = int(np.flatnonzero(ltp[e] == LAYOUT.physical_slot(me, M + j))[0])
            for t, view in enumerate(engine.replica_grads(j)):
                view[...] = xp.asarray(grad(e, instance, t))
        engine.reduce_grads(0, plan)
        engine.synchronize()
        counts = np.asarray(plan.replica_count)
        for m in range(M):
            e = me * M + m
            for t, g in enumerate(SPEC.grads):
                want = reference_reduce(grad(e, 0, t), [grad(e, i, t) for i in range(1, int(counts[e]))])
                got = to_host(masters[0][m][t])
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                    f"rank {me}: master {m} gradient {g.name!r} differs from the replica-order fp32 sum"
                if g.name in SPEC.scale_of:
                    assert not got.any(), f"rank {me}: the scale {g.name!r} got a nonzero gradient"
        assert max(counts.tolist()) > 1, "no expert was replicated: the reduction was not checked"


with open_heap(group, 16 << 20, backend=backend) as heap:
    {"sync": sync, "grads": grads}[check](heap)
print(f"[{check}] rank {me} OK", flush=True)
