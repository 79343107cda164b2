"""Multi-rank data-plane check, run under mpiexec by tests/transfer/test_transfer.py.

Usage: python -m mpi4py transfer_check.py {host|device} {sync|relay|relay-grids|pipeline|grads|empty|repeat|bad-input|
       relay-timeout}
       [grad dtype]
Every master's weights and every instance's gradients are a seeded function of (layer,
expert, instance), so each rank checks what it holds without asking anyone.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.planner import ExpertLayout, Plan
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.group import EPGroup
from ultraep.runtime import open_heap
from ultraep.transfer import ExpertSpec, WeightTransfer
from ultraep.transfer.host import reference_reduce

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

BAD_INPUT = (ValueError, TypeError)  # what a refused argument raises

backend, check = sys.argv[1], sys.argv[2]
grad_dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp
    to_host = xp.asnumpy
else:
    xp = np
    to_host = np.asarray

HIDDEN, FFN, LAYERS = 64, 96, 2
SPEC = ExpertSpec([("fc1", (2 * FFN, HIDDEN), "bfloat16"), ("fc2", (HIDDEN, FFN), "bfloat16"),
                   ("bias", (37,), "bfloat16")], grad_dtype=grad_dtype)
LAYOUT = ExpertLayout(R, 3 * R, 2)
M = LAYOUT.experts_per_rank


def values(seed, shape, dtype):
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return data.astype(BFLOAT16 if dtype.name == "bfloat16" else dtype)


def master_weights(layer, e):
    return [values((layer, e, t), w.shape, w.dtype) for t, w in enumerate(SPEC.weights)]


def instance_grads(layer, e, instance):
    return [values((layer, e, instance, t, 7), g.shape, g.dtype) for t, g in enumerate(SPEC.grads)]


def random_plan(seed, max_fanout):
    """Random placement that obeys the layout (<= S replicas per rank, one instance per rank)."""
    rng = np.random.default_rng(seed)
    K, P = LAYOUT.max_instances, LAYOUT.slots_per_rank
    log_to_phys = np.full((LAYOUT.num_experts, K), -1, np.int32)
    free = {r: list(range(M, P)) for r in range(R)}
    for e in range(LAYOUT.num_experts):
        log_to_phys[e, 0] = LAYOUT.master_slot(e)
    for e in rng.permutation(LAYOUT.num_experts):
        master = LAYOUT.master_rank(int(e))
        candidates = [r for r in rng.permutation(R) if r != master and free[int(r)]]
        for i, r in enumerate(candidates[: rng.integers(0, max_fanout + 1)]):
            log_to_phys[e, i + 1] = int(r) * P + free[int(r)].pop(0)
    loads = rng.integers(10, 100, size=(R, LAYOUT.num_experts)).astype(np.int32)
    split = np.zeros((R, LAYOUT.num_experts, K), np.int64)
    n = (log_to_phys >= 0).sum(axis=1)
    for e in range(LAYOUT.num_experts):
        split[:, e, : n[e]] = loads[:, e, None] // n[e]
        split[:, e, 0] += loads[:, e] - split[:, e, : n[e]].sum(axis=1)
    return Plan.from_split(LAYOUT, loads, log_to_phys, split)


def misaligned_copy(array, offset=2):
    """``array``'s values in memory that starts ``offset`` bytes past a 16-byte boundary."""
    raw = xp.zeros(array.nbytes + 16, xp.uint8)
    view = raw[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
    view[...] = array
    return view


def register(engine, misaligned=False):
    """Both layers; masters' gradients start as instance-0 gradients. ``misaligned``: each
    rank's first master tensor lies 2 bytes past an aligned address."""
    grads_by_layer = {}
    for layer in range(LAYERS):
        weights = [[xp.asarray(w) for w in master_weights(layer, me * M + m)] for m in range(M)]
        if misaligned:
            weights[0][0] = misaligned_copy(weights[0][0])
        grads = [[xp.asarray(g) for g in instance_grads(layer, me * M + m, 0)] for m in range(M)]
        engine.register_layer(layer, weights, grads)
        grads_by_layer[layer] = grads
    return grads_by_layer


def poison_slots(engine):
    for j in range(LAYOUT.redundant_slots):
        for view in engine.replica_weights(j) + engine.replica_grads(j):
            view.view(np.uint8)[...] = 0xA5


def check_replicas(engine, plan, layer):
    """Every redundant slot of this rank holds its expert's master weights, bit for bit."""
    p2l = np.asarray(plan.phys_to_log).reshape(R, LAYOUT.slots_per_rank)[me, M:]
    bad = 0
    for j, e in enumerate(p2l.tolist()):
        if e < 0:
            continue
        for got, want in zip(engine.replica_weights(j), master_weights(layer, e)):
            bad += int(np.count_nonzero(to_host(got).view(np.uint16) != want.view(np.uint16)))
    assert bad == 0, f"rank {me}: {bad} replica weight elements differ from their masters"
    return int((p2l >= 0).sum())


def run_sync(engine, trials, max_fanout):
    filled = 0
    for trial in range(trials):
        plan, layer = random_plan(trial, max_fanout), trial % LAYERS
        poison_slots(engine)
        engine.heap.barrier()
        engine.weight_sync(layer, plan)
        engine.synchronize()
        filled += check_replicas(engine, plan, layer)
    return filled


def sync(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=R) as engine:
        register(engine)
        filled = run_sync(engine, 12, R - 1)
        assert group.allgather(filled) and sum(group.allgather(filled)) > 0, "no replica was ever placed"
        # Restore in backward = the same sync again, after the slots were used by another layer.
        plan = random_plan(99, R - 1)
        engine.weight_sync(1, plan)
        poison_slots(engine)
        heap.barrier()
        engine.restore(0, plan)
        engine.synchronize()
        check_replicas(engine, plan, 0)


def relay(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=1, relay_count=1) as engine:
        register(engine)
        relayed = 0
        for trial in range(8):
            plan, layer = random_plan(100 + trial, R - 1), trial % LAYERS
            poison_slots(engine)
            heap.barrier()
            engine.weight_sync(layer, plan)
            engine.synchronize()
            check_replicas(engine, plan, layer)
            relayed += sum(len(leaves) for tree in engine.schedule(plan).relays.values() for _, leaves in tree)
        assert relayed > 0, "no plan had a leaf served by a relay: the relay path was not checked"
        held_relay(engine)


def held_relay(engine):
    """Leaves are filled by their relay, not by the master: with the relay's transfer held
    back (it takes part in the call; its launch is replayed later), the master's sync
    completes and every leaf slot is still poisoned (the relay's is filled); once the
    relay's transfer runs, every leaf holds the master's weights."""
    heap = engine.heap
    plan = fanout_plan(0, list(range(1, R)))
    (relay_instance, leaves), = engine.schedule(plan).relays[0]
    ltp = np.asarray(plan.log_to_phys)
    relay_rank = int(ltp[0, relay_instance]) // LAYOUT.slots_per_rank
    leaf_ranks = {int(ltp[0, leaf]) // LAYOUT.slots_per_rank for leaf in leaves}
    assert leaf_ranks and relay_rank not in leaf_ranks
    owner, name = hold_transfer(engine)
    original, held = getattr(owner, name), []
    poison_slots(engine)
    heap.barrier()
    if me == relay_rank:
        setattr(owner, name, lambda *args: held.append(args))
    try:
        engine.weight_sync(0, plan, barrier=False)
        engine.synchronize()
    finally:
        setattr(owner, name, original)
    heap.barrier()  # the master's writes before these reads
    if me in leaf_ranks:
        assert all(bool((to_host(v).view(np.uint8) == 0xA5).all()) for v in engine.replica_weights(0)), \
            f"rank {me}: a leaf slot was written before its relay forwarded a chunk"
    if me == relay_rank:
        assert check_replicas(engine, plan, 0) == 1 and len(held) == 1
    group.barrier()  # the leaves' reads before the relay forwards
    if me == relay_rank:
        original(*held[0])
        engine.synchronize()
    heap.barrier()
    assert check_replicas(engine, plan, 0) == (me != 0)
    if me == 0:
        print(f"relay: {len(leaf_ranks)} leaf replicas stayed unwritten until their relay (rank {relay_rank}) "
              "forwarded every chunk", flush=True)


def hold_transfer(engine):
    """``(owner, name)`` of the method that runs this rank's weight tasks once they are
    compiled (the kernel launch on the device, the NumPy executor on the host): replacing
    it loses or holds them. A device sync that agrees, compiles and copies in one launch
    has no such step, so the engine is switched (on every rank) to its launch-per-step
    path, whose copy is the same device code."""
    engine.impl.agrees_in_sync = False
    return engine.impl, "run_weight_tasks"


def pipeline(_):
    """One or two blocks (8 or 16 warps, each taking many pieces) copy 256-byte tiles
    (pieces shorter than a whole one: the vector-by-vector path), direct and through
    relays, from masters that are not 16-byte aligned (the byte path). A heap holds one
    engine: each configuration gets its own."""
    for blocks in (1, 2):
        for relay_threshold in (R, 1):
            with open_heap(group, 8 << 20, backend=backend) as heap, \
                    WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=256, chunk_tiles=3, relay_threshold=relay_threshold,
                                   relay_count=1, blocks=blocks) as engine:
                register(engine, misaligned=True)
                assert sum(group.allgather(run_sync(engine, 3, R - 1))) > 0, "no replica was ever placed"


def relay_grids(_):
    """Relays on every rank, synced by a few blocks: each warp's piece slots run from its
    rank's master chunks into relay chunks, which wait for peers' chunk flags. A warp must
    count the master pieces it has stored before it waits, or two ranks can each wait for a
    chunk the other holds back (until the timeout). With 5 and 8 blocks, plans 12, 14 and 18
    form such cycles for a kernel whose storing warp hands pieces to a counting warp two
    pieces late."""
    for blocks in (5, 8):
        with open_heap(group, 8 << 20, backend=backend) as heap, \
                WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=1, relay_count=1,
                               blocks=blocks, timeout_s=5.0) as engine:
            register(engine)
            relayed = 0
            for seed in (12, 14, 18):
                plan = random_plan(seed, R - 1)
                poison_slots(engine)
                heap.barrier()
                engine.weight_sync(0, plan)
                engine.synchronize()
                check_replicas(engine, plan, 0)
                relayed += sum(len(leaves) for tree in engine.schedule(plan).relays.values() for _, leaves in tree)
            assert relayed > 0, "no plan had a leaf served by a relay: the relay path was not checked"


def grads(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2) as engine:
        masters = register(engine)
        for trial in range(6):
            plan, layer = random_plan(200 + trial, R - 1), trial % LAYERS
            reset_master_grads(masters, layer)
            write_replica_grads(engine, plan, layer)
            engine.reduce_grads(layer, plan)
            engine.synchronize()
            check_master_grads(masters, plan, layer)


def reset_master_grads(masters, layer):
    for m in range(M):
        for t, g in enumerate(instance_grads(layer, me * M + m, 0)):
            masters[layer][m][t][...] = xp.asarray(g)


def write_replica_grads(engine, plan, layer):
    ltp = np.asarray(plan.log_to_phys)
    for j, e in enumerate(np.asarray(plan.phys_to_log).reshape(R, -1)[me, M:].tolist()):
        if e >= 0:
            instance = int(np.flatnonzero(ltp[e] == me * LAYOUT.slots_per_rank + M + j)[0])
            for view, g in zip(engine.replica_grads(j), instance_grads(layer, e, instance)):
                view[...] = xp.asarray(g)


def check_master_grads(masters, plan, layer):
    counts = np.asarray(plan.replica_count)
    bad = 0
    for m in range(M):
        e = me * M + m
        per_instance = [instance_grads(layer, e, i) for i in range(int(counts[e]))]
        for t in range(len(SPEC.grads)):
            want = reference_reduce(per_instance[0][t], [p[t] for p in per_instance[1:]])
            got = to_host(masters[layer][m][t])
            bad += int(np.count_nonzero(got.view(np.uint8) != want.view(np.uint8)))
    assert bad == 0, f"rank {me}: {bad} gradient bytes differ from the replica-order fp32 reference"


def empty(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2) as engine:
        masters = register(engine)
        plan = random_plan(300, 0)
        assert int(np.asarray(plan.replica_count).max()) == 1
        poison_slots(engine)
        heap.barrier()
        engine.weight_sync(0, plan)
        engine.reduce_grads(0, plan)
        engine.synchronize()
        for j in range(LAYOUT.redundant_slots):
            assert all(bool((to_host(v).view(np.uint8) == 0xA5).all()) for v in engine.replica_weights(j)), \
                "an empty plan wrote into a replica slot"
        check_master_grads(masters, plan, 0)


def repeat(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=1, relay_count=1) as engine:
        masters = register(engine)
        plan = random_plan(400, R - 1)
        digests = set()
        for _ in range(10):
            reset_master_grads(masters, 1)
            poison_slots(engine)
            heap.barrier()
            engine.weight_sync(1, plan)
            write_replica_grads(engine, plan, 1)
            engine.reduce_grads(1, plan)
            engine.synchronize()
            check_master_grads(masters, plan, 1)
            blobs = [to_host(t).tobytes() for per in masters[1] for t in per]
            blobs += [to_host(v).tobytes() for j in range(LAYOUT.redundant_slots) for v in engine.replica_weights(j)]
            digests.add(hash(b"".join(blobs)))
        assert len(digests) == 1, f"rank {me}: results differ across 10 runs"


def fanout_plan(expert, hosts):
    """``expert`` (a master of rank 0) replicated on ``hosts`` in their first redundant slot."""
    K = LAYOUT.max_instances
    log_to_phys = np.full((LAYOUT.num_experts, K), -1, np.int32)
    for e in range(LAYOUT.num_experts):
        log_to_phys[e, 0] = LAYOUT.master_slot(e)
    for i, host in enumerate(hosts, start=1):
        log_to_phys[expert, i] = LAYOUT.physical_slot(host, M)
    loads = np.full((R, LAYOUT.num_experts), 4 * R, np.int32)
    split = np.zeros((R, LAYOUT.num_experts, K), np.int64)
    split[:, :, 0] = loads
    split[:, expert, 0], split[:, expert, 1:len(hosts) + 1] = 4, (4 * R - 4) // len(hosts)
    split[:, expert, 0] += 4 * R - split[:, expert, :len(hosts) + 1].sum(axis=1)
    return Plan.from_split(LAYOUT, loads, log_to_phys, split)


def relay_timeout(heap):
    """The master's sends are lost (it takes part in the call, but its transfer never
    runs): its relay's wait for the first chunk times out naming the flag it waited for,
    no rank hangs, no slot is written, and the same engines then sync the same plan."""
    from ultraep.errors import TransferTimeout

    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2, relay_threshold=1, relay_count=1,
                        timeout_s=2.0) as engine:
        register(engine)
        poison_slots(engine)
        heap.barrier()
        plan = fanout_plan(0, list(range(1, R)))
        (relay_instance, _), = engine.schedule(plan).relays[0]
        relay_rank = int(np.asarray(plan.log_to_phys)[0, relay_instance]) // LAYOUT.slots_per_rank
        owner, name = hold_transfer(engine)
        original = getattr(owner, name)
        if me == 0:
            setattr(owner, name, lambda *args: None)
        error = None
        try:
            engine.weight_sync(0, plan, barrier=False)
            engine.synchronize()
        except TransferTimeout as exc:
            error = str(exc)
        finally:
            setattr(owner, name, original)
        if me == relay_rank:
            assert error is not None and f"rank {me}: relay waited 2 s for a weight chunk" in error, error
        else:
            assert error is None, error
        assert all(bool((to_host(v).view(np.uint8) == 0xA5).all()) for v in engine.replica_weights(0)), \
            f"rank {me}: a slot was written although its chunks never came"
        group.barrier()
        engine.weight_sync(0, plan)
        engine.synchronize()
        assert check_replicas(engine, plan, 0) == (me != 0)



def bad_input(heap):
    with WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=4096, chunk_tiles=2) as engine:
        plan = random_plan(500, 2)
        expect(lambda: engine.weight_sync(0, plan), BAD_INPUT, "no registered master")
        good = [[xp.asarray(w) for w in master_weights(0, me * M + m)] for m in range(M)]
        grads0 = [[xp.asarray(g) for g in instance_grads(0, me * M + m, 0)] for m in range(M)]
        wrong = [[xp.zeros((3, 3), xp.float32) if (me == 1 and t == 0) else w for t, w in enumerate(per)]
                 for per in good]
        expect(lambda: engine.register_layer(0, wrong, grads0), BAD_INPUT, "register_layer(0) failed")
        short = good[:-1] if me == 2 else good
        expect(lambda: engine.register_layer(0, short, grads0), BAD_INPUT, "masters x")
        engine.register_layer(0, good, grads0)
        for transfer in (engine.weight_sync, engine.reduce_grads):
            expect(lambda: transfer(0, random_plan(501, 2), blocks=-1), BAD_INPUT, "blocks must be in")
        if backend == "device":  # more blocks than are resident could wait for blocks that never start
            expect(lambda: engine.weight_sync(0, random_plan(501, 2), blocks=engine.impl.max_sync_blocks + 1),
                   BAD_INPUT, "blocks must be at most")
        other = ExpertLayout(R, 2 * R, 2)
        other_plan = Plan.from_split(other, np.ones((R, 2 * R), np.int32),
                                     np.array([[other.master_slot(e)] + [-1] * (other.max_instances - 1)
                                               for e in range(2 * R)], np.int32),
                                     np.pad(np.ones((R, 2 * R, 1), np.int64),
                                            ((0, 0), (0, 0), (0, other.max_instances - 1))))
        poison_slots(engine)
        heap.barrier()
        expect(lambda: engine.weight_sync(0, other_plan), BAD_INPUT, "plan is for")
        clash = random_plan(600, 0)  # Plan.from_split refuses such a plan: break a valid one
        clash.log_to_phys[[0, M], 1] = 2 * LAYOUT.slots_per_rank + M  # experts of ranks 0 and 1 share a slot on rank 2
        clash.replica_count[[0, M]] = 2
        if backend == "host":
            expect(lambda: engine.weight_sync(0, clash), BAD_INPUT, "weight_sync failed on 4 of 4")
            expect(lambda: engine.reduce_grads(0, clash), BAD_INPUT, "two replicas share one slot")
        else:  # every rank's device compiler refuses the plan, and every rank's synchronize says so
            for transfer in (engine.weight_sync, engine.reduce_grads):
                transfer(0, clash)
                expect(engine.synchronize, BAD_INPUT, f"expert {M} has a replica in a slot that a lower expert's")
        for j in range(LAYOUT.redundant_slots):  # nothing was written by the refused calls
            assert all(bool((to_host(v).view(np.uint8) == 0xA5).all()) for v in engine.replica_weights(j))
    expect(lambda: WeightTransfer(heap, LAYOUT, SPEC, tile_bytes=1000), BAD_INPUT, "tile_bytes")
    expect(lambda: WeightTransfer(heap, LAYOUT, SPEC, blocks=1 << 30), BAD_INPUT, "blocks must be in")


with open_heap(group, 8 << 20, backend=backend) as heap:
    {"sync": sync, "relay": relay, "relay-grids": relay_grids, "pipeline": pipeline, "grads": grads, "empty": empty,
     "repeat": repeat, "bad-input": bad_input, "relay-timeout": relay_timeout}[check](heap)
print(f"[{check}] rank {me} OK", flush=True)
