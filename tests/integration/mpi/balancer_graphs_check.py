"""The Balancer's CUDA graphs change no bit: run under mpiexec (4 ranks, one GPU or more)
by tests/integration/test_balancer_graphs.py.

Usage: python -m mpi4py balancer_graphs_check.py {checked|unchecked}

Two Balancers hold the same masters: one replays its ring slots' launches as CUDA graphs
(the default), the other launches every kernel itself (``cuda_graphs=False``). Both take
the same updates, weight syncs and reroutes, in segments that change what a graph was
captured for: the token count (fewer, then more than the staging buffers hold), the ids'
dtype, ``local_loads`` instead of ids, a caller's reroute ``out``, a rank with no
tokens, and the weight sync started by the update (``weight_sync=True``: captured in the
update's graph, whose every replay must flag a new epoch for the replica waits). Every
plan, rerouted id (``reroute(handle)``, the update's own, and ``reroute(handle, ids)``),
replica weight and stats record must be the same on both and equal the NumPy references;
and in each segment the graphed Balancer must have captured anew and replayed
(``checked``: sync_checks=True, whose update graph publishes the row counted before the
collective and reroutes the ids counted there, so it is keyed on them as the unchecked
one is).
"""

import sys
from pathlib import Path

import cupy
import numpy as np
from mpi4py import MPI

from ultraep.integration import Balancer
from ultraep.planner import ExpertLayout, Plan, plan_placement, reroute
from ultraep.runtime.group import EPGroup
from ultraep.transfer import ExpertSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support

mode = sys.argv[1]
assert mode in ("checked", "unchecked"), mode
group = EPGroup(MPI.COMM_WORLD, use_gpu=True)
R, me = group.size, group.rank
E, S, TOP_K, MIN_REPLICA, LAYERS, IN_FLIGHT = 2 * R, 2, 2, 4, 2, 2
STEPS = 6  # per segment: each of the 4 ring slots runs eagerly, is captured, is replayed
LAYOUT = ExpertLayout(R, E, S)
M = LAYOUT.experts_per_rank
SPEC = ExpertSpec([("w_in", (8, 16), "float32"), ("w_out", (16, 8), "float32")], grad_dtype="float32")
# (name, tokens of rank r, ids dtype, update from local_loads, reroute into a caller's out, update starts the sync)
SEGMENTS = [("96 tokens", lambda r: 96 + 16 * r, np.int64, False, False, False),
            ("fewer tokens, caller's out", lambda r: 64 + 16 * r, np.int64, False, True, False),
            ("more tokens than staged", lambda r: 200 + 16 * r, np.int64, False, False, False),
            ("int32 ids", lambda r: 200 + 16 * r, np.int32, False, False, False),
            ("local_loads", lambda r: 200 + 16 * r, np.int32, True, False, False),
            ("rank 1 without tokens", lambda r: 0 if r == 1 else 64, np.int64, False, False, False),
            ("sync started by the update", lambda r: 0 if r == 1 else 64, np.int64, False, False, True),
            ("sync started by an update of local_loads", lambda r: 96, np.int32, True, False, True)]


def routing(layer, step, rank, tokens, dtype):
    """Skewed top-k ids: a hot expert that moves with (layer, step), distinct per token."""
    rng = np.random.default_rng((layer, step, rank))
    hot = (layer + 3 * step) % E
    weights = 1.0 / (1 + (np.arange(E) - hot) % E) ** 1.5
    p = weights / weights.sum()
    ids = [rng.choice(E, size=TOP_K, replace=False, p=p) for _ in range(tokens)]
    return (np.stack(ids) if ids else np.zeros((0, TOP_K))).astype(dtype)


def master_weights(layer, expert):
    return [np.random.default_rng((layer, expert, t)).standard_normal(w.shape).astype(np.float32)
            for t, w in enumerate(SPEC.weights)]


def balancer(graphs: bool) -> Balancer:
    bal = Balancer(group, LAYOUT, SPEC, num_layers=LAYERS, min_replica_tokens=MIN_REPLICA, max_in_flight=IN_FLIGHT,
                   backend="device", sync_checks=mode == "checked", cuda_graphs=graphs)
    for layer in range(LAYERS):
        bal.register_layer(layer, [[cupy.asarray(w) for w in master_weights(layer, me * M + m)] for m in range(M)],
                           [[cupy.zeros(g.shape, np.float32) for g in SPEC.grads] for _ in range(M)])
    return bal


def replica_bytes(bal, handle):
    """This rank's filled replica slots: slot -> its tensors' bytes."""
    local = cupy.asnumpy(bal.local_experts(handle))
    return {s: [cupy.asnumpy(t).view(np.uint8) for t in tensors]
            for s, tensors in enumerate(bal.replica_weights(handle)) if local[M + s] >= 0}


def one_layer(graphed, eager, layer, step, segment, outs):
    name, tokens, dtype, from_loads, caller_out, sync = segment
    ids = {r: routing(layer, step, r, tokens(r), dtype) for r in range(R)}
    loads = np.stack([np.bincount(ids[r].ravel(), minlength=E) for r in range(R)]).astype(np.int32)
    want = plan_placement(loads, LAYOUT, min_replica_tokens=MIN_REPLICA)
    mine = cupy.asarray(ids[me])
    handles = [bal.update(layer, local_loads=cupy.asarray(loads[me]), weight_sync=sync) if from_loads
               else bal.update(layer, mine, weight_sync=sync) for bal in (graphed, eager)]
    what = f"rank {me}: layer {layer} step {step} ({name})"
    plans = [bal.plan(h).to_numpy() for bal, h in zip((graphed, eager), handles)]
    for array in Plan.ARRAYS:
        for got, which in zip(plans, ("graphed", "eager")):
            assert np.array_equal(getattr(got, array), getattr(want, array)), f"{what}: {which} plan {array} differs"
    assert (plans[0].imbalance_before, plans[0].imbalance_after) == (plans[1].imbalance_before,
                                                                      plans[1].imbalance_after), what
    for bal, h in zip((graphed, eager), handles):
        started = bal.weight_sync(h)
        if sync:  # the update's own sync, returned once: a second call syncs again
            assert bal.weight_sync(h) is not started, f"{what}: the update's sync was returned twice"
    replicas = [replica_bytes(bal, h) for bal, h in zip((graphed, eager), handles)]
    assert replicas[0].keys() == replicas[1].keys(), what
    for slot, tensors in replicas[0].items():
        expert = int(want.phys_to_log[me * (M + S) + M + slot])
        for got, other, master in zip(tensors, replicas[1][slot], master_weights(layer, expert)):
            assert np.array_equal(got, other) and np.array_equal(got, master.view(np.uint8)), \
                f"{what}: replica slot {slot} is not expert {expert}"
    out = None
    if caller_out:
        out = outs.setdefault((layer, mine.shape), cupy.full(mine.shape, -7, np.int32))
    slots = [cupy.asnumpy(bal.reroute(h, mine, out=out)) for bal, h in zip((graphed, eager), handles)]
    reference = reroute(ids[me], want, me)
    for got, which in zip(slots, ("graphed", "eager")):
        assert np.array_equal(got, reference), f"{what}: {which} reroute differs"
    if not from_loads:
        for bal, h, which in zip((graphed, eager), handles, ("graphed", "eager")):
            assert np.array_equal(cupy.asnumpy(bal.reroute(h)), reference), f"{what}: {which} update's reroute differs"


def graph_keys(segment) -> dict:
    """What this rank's ring slots key each launch sequence on, apart from buffers that stay
    put within a segment: a segment that changes a key recaptures that sequence."""
    _, tokens, dtype, from_loads, caller_out, sync = segment
    return {"update": ("local_loads" if from_loads else (dtype, tokens(me)), sync),
            "record": "record", "reroute": (dtype, tokens(me), caller_out)}


def main():
    names, slots = ("update", "record", "reroute"), LAYERS * IN_FLIGHT
    with balancer(True) as graphed, balancer(False) as eager:
        counts = graphed._impl.graphs
        step, outs, keys = 0, {}, {}
        for segment in SEGMENTS:
            captures, replays = dict(counts.captures), dict(counts.replays)
            for _ in range(STEPS):
                for layer in range(LAYERS):
                    one_layer(graphed, eager, layer, step, segment, outs)
                step += 1
            # A new key: each slot runs eagerly, captures and launches, launches (STEPS / IN_FLIGHT = 3
            # uses); an old one: three launches. A reroute of no ids launches nothing.
            before, keys = keys, graph_keys(segment)
            expected_captures, expected_replays = {}, {}
            for name in names:
                changed = keys[name] != before.get(name)
                idle = name == "reroute" and segment[1](me) == 0
                expected_captures[name] = 0 if idle or not changed else slots
                expected_replays[name] = 0 if idle else (2 if changed else 3) * slots
            got_captures = {name: counts.captures[name] - captures.get(name, 0) for name in names}
            got_replays = {name: counts.replays[name] - replays.get(name, 0) for name in names}
            assert (got_captures, got_replays) == (expected_captures, expected_replays), (
                f"rank {me}: segment {segment[0]!r}: captures {got_captures}, replays {got_replays}; expected "
                f"{expected_captures}, {expected_replays}")
        assert not any(eager._impl.graphs.replays.values()), "the eager Balancer replayed a graph"
        stats = [bal.stats() for bal in (graphed, eager)]
        assert stats[0].updates == stats[0].liveness == stats[1].updates == stats[1].liveness == step * LAYERS
        for got, other in zip(*(sorted(s.records, key=lambda r: (r.step, r.layer)) for s in stats)):
            assert (got.layer, got.step, got.replicas, got.weight_bytes) == (other.layer, other.step, other.replicas,
                                                                              other.weight_bytes)
            assert (got.imbalance_before, got.imbalance_after) == (other.imbalance_before, other.imbalance_after)
            assert np.array_equal(got.rank_load_before, other.rank_load_before)
            assert np.array_equal(got.rank_load_after, other.rank_load_after)
        for bal in (graphed, eager):
            bal.check()
    if me == 0:
        print(f"{mode}: {step * LAYERS} updates on each Balancer, graphed {dict(counts.captures)} captures, "
              f"{dict(counts.replays)} replays", flush=True)
    print(f"[graphs-{mode}] rank {me} OK", flush=True)


main()
