"""``Balancer.reroute(handle)``, the reroute ``update`` made of the ids it counted: run under
mpiexec (4 ranks) by tests/integration/test_balancer_reroute.py.

Usage: python -m mpi4py balancer_reroute_check.py {host|device} {checked|unchecked} {graphs|eager}

Per (layer, micro-batch) every rank updates from seeded random ids -- int32 and int64
(and int16 on the host), token counts that change between segments (each change
recaptures the device's update graph) up to several reroute chunks, a rank without
tokens, and, unchecked on the GPU, ids outside ``[0, E)`` -- and ``reroute(handle)`` must
equal ``reroute(handle, ids)`` and ``reroute_reference`` bit for bit (bad ids: slot -1).
A handle's result stays put while the other ring slot updates and when an update is
refused (checked: a bad id); a handle updated from ``local_loads``, and ``out=`` without
ids, raise BalancerError on every rank.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.errors import CollectiveError
from ultraep.integration import Balancer, BalancerError
from ultraep.planner import ExpertLayout
from ultraep.planner.reroute import reroute_reference
from ultraep.runtime.group import EPGroup
from ultraep.transfer import ExpertSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

backend, mode, launches = sys.argv[1:4]
assert backend in ("host", "device") and mode in ("checked", "unchecked") and launches in ("graphs", "eager")
group = EPGroup(MPI.COMM_WORLD, use_gpu=backend == "device")
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp
    host = xp.asnumpy
else:
    xp = np
    host = np.asarray
E, S, TOP_K, LAYERS, IN_FLIGHT, STEPS = 4 * R, 2, 4, 2, 2, 5  # STEPS: each ring slot runs, captures, replays
LAYOUT = ExpertLayout(R, E, S)
SPEC = ExpertSpec([("w", (8, 8), "float32")], grad_dtype="float32")
BAD_IDS = backend == "device" and mode == "unchecked"  # elsewhere a bad id refuses the update
# (name, tokens of rank r, ids dtype); 700 tokens of top-4: three reroute chunks
SEGMENTS = [("96 tokens", lambda r: 96 + 8 * r, np.int64), ("700 tokens", lambda r: 700 + 8 * r, np.int64),
            ("int32 ids", lambda r: 700 + 8 * r, np.int32), ("fewer tokens", lambda r: 33 * r + 1, np.int32),
            ("rank 1 without tokens", lambda r: 0 if r == 1 else 300, np.int64)]
if backend == "host":
    SEGMENTS.append(("int16 ids", lambda r: 50 + r, np.int16))


def routing(layer, step, tokens, dtype):
    """Random ids skewed towards a hot expert that moves with (layer, step); a few bad ones
    where the backend lets them through."""
    rng = np.random.default_rng((layer, step, me))
    p = 1.0 / (1 + (np.arange(E) - (layer + 5 * step)) % E)
    ids = rng.choice(E, size=(tokens, TOP_K), p=p / p.sum())
    if BAD_IDS and ids.size:
        ids.flat[rng.integers(0, ids.size, size=3)] = [-1, E, E + 7]
    return ids.astype(dtype)


def expected(ids, plan):
    """reroute_reference of the valid ids; -1 for the others."""
    flat = ids.reshape(-1).astype(np.int64)
    valid = (flat >= 0) & (flat < E)
    slots = np.full(flat.size, -1, np.int32)
    slots[valid] = reroute_reference(flat[valid], plan, me)
    return slots.reshape(ids.shape)


def main():
    with Balancer(group, LAYOUT, SPEC, num_layers=LAYERS, min_replica_tokens=4, max_in_flight=IN_FLIGHT,
                  backend=backend, sync_checks=mode == "checked", cuda_graphs=launches == "graphs") as bal:
        step, live = 0, {}  # live: layer -> [(handle, its routed result)] of the ring
        for name, tokens, dtype in SEGMENTS:
            for _ in range(STEPS):
                for layer in range(LAYERS):
                    ids = routing(layer, step, tokens(me), dtype)
                    handle = bal.update(layer, xp.asarray(ids))
                    what = f"rank {me}: layer {layer} step {step} ({name})"
                    routed = host(bal.reroute(handle))
                    assert routed.dtype == np.int32 and routed.shape == ids.shape, what
                    assert np.array_equal(routed, expected(ids, bal.plan(handle).to_numpy())), f"{what}: vs reference"
                    assert np.array_equal(routed, host(bal.reroute(handle, xp.asarray(ids)))), f"{what}: vs ids"
                    ring = live.setdefault(layer, [])
                    ring.append((handle, routed.copy()))
                    del ring[:-IN_FLIGHT]
                    for older, result in ring:  # the other slot's update left its result alone
                        assert np.array_equal(host(bal.reroute(older)), result), f"{what}: {older} changed"
                step += 1
        if mode == "checked":  # a refused update keeps the slot's handle and its result
            handle, result = live[0][0]
            bad = np.zeros((8, TOP_K), np.int64)
            if me == 1:
                bad[3, 2] = E
            expect(lambda: bal.update(0, xp.asarray(bad)), BalancerError, "rank 1: 1 top-k id(s) outside")
            assert np.array_equal(host(bal.reroute(handle)), result), f"rank {me}: a refused update changed it"
        loads_handle = bal.update(1, local_loads=xp.asarray(np.full(E, me + 1, np.int32)))
        errors = (BalancerError, CollectiveError)
        expect(lambda: bal.reroute(loads_handle), errors, "was updated from local_loads: pass topk_ids")
        expect(lambda: bal.reroute(live[0][-1][0], out=xp.zeros((1, TOP_K), np.int32)), errors,
               "out needs topk_ids")
        if backend == "device" and launches == "graphs":
            captures = bal._impl.graphs.captures["update"]
            assert captures >= len(SEGMENTS) * LAYERS * IN_FLIGHT, f"rank {me}: {captures} update captures"
        if BAD_IDS:
            expect(bal.check, BalancerError, "top-k id(s) outside", "reroute gave them slot -1")
        else:
            bal.check()
    print(f"[reroute-{backend}-{mode}-{launches}] rank {me} OK", flush=True)


main()
