"""One Balancer + Dispatcher step on the host backend with a fault injected on one rank.

argv: kind (raise, exit, kill, sleep), phase (update, weight_sync, dispatch, combine,
reduce_grads, close), timeout_s (the group's, the Balancer's and the Dispatcher's). Rank
``FAULTY`` prints ``[fault] <wall time>`` and then raises, exits with ``EXIT_CODE``, kills
itself or stops answering just before that phase; the other ranks go on, and the job must end.
Phases ``balancer_init`` and ``dispatcher_init`` (kind raise): a Balancer or a Dispatcher
that opens its own heap fails on rank ``FAULTY`` inside its constructor, after the heap is open.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from ultraep import Balancer, Dispatcher, EPGroup, ExpertLayout, ExpertSpec, open_heap

FAULTY, EXIT_CODE = 2, 7
kind, phase, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
group = EPGroup(MPI.COMM_WORLD, use_gpu=False, timeout_s=timeout_s)
me, R = group.rank, group.size
E, H, T, K = 2 * R, 16, 32, 2
layout = ExpertLayout(R, E, 1)
M = layout.experts_per_rank
spec = ExpertSpec([("w", (H, H), "float32")])
token_args = dict(hidden=H, dtype="float32", top_k=K, max_tokens=T, timeout_s=timeout_s)
need = (Balancer.heap_requirements(layout, spec)
        + Dispatcher.heap_requirements(R, num_experts=layout.num_physical, experts_per_rank=layout.slots_per_rank,
                                       **{k: v for k, v in token_args.items() if k != "timeout_s"}))


def fault(here: str) -> None:
    if here != phase or me != FAULTY:
        return
    print(f"[fault] {time.time():.3f} rank {me} {kind} at {phase}", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {me} at {phase}")
    if kind == "exit":
        sys.exit(EXIT_CODE)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def constructor_fault() -> None:
    """The backend a constructor builds once its heap is open fails on rank FAULTY."""
    import ultraep.integration.balancer
    import ultraep.token.host

    def failing(base):
        class Failing(base):
            def __init__(self, *args, **kwargs):
                fault(phase)

        return Failing

    if me == FAULTY:
        if phase == "balancer_init":
            module, name = ultraep.integration.balancer, "WeightTransfer"
        else:
            module, name = ultraep.token.host, "HostDispatcher"
        setattr(module, name, failing(getattr(module, name)))
    if phase == "balancer_init":
        with Balancer(group, layout, spec, num_layers=1, min_replica_tokens=1, timeout_s=timeout_s):
            pass
    else:
        with Dispatcher.for_layout(group, layout, **token_args):
            pass


if phase.endswith("_init"):
    constructor_fault()
    print(f"[fault] rank {me} finished", flush=True)
    sys.exit(0)

rng = np.random.default_rng(me)
weights = [[np.full((H, H), me * M + m, np.float32)] for m in range(M)]
grads = [[np.zeros((H, H), np.float32)] for _ in range(M)]
with open_heap(group, need, backend="host") as heap, \
        Balancer(group, layout, spec, num_layers=1, min_replica_tokens=1, heap=heap, timeout_s=timeout_s) as bal, \
        Dispatcher.for_layout(group, layout, heap=heap, **token_args) as disp:
    bal.register_layer(0, weights, grads)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    ids[: T // 2, 0] = 0  # expert 0 is hot: a replica to sync and reduce
    fault("update")
    handle = bal.update(0, ids)
    fault("weight_sync")
    bal.weight_sync(handle)
    fault("dispatch")
    recv = disp.dispatch(rng.standard_normal((T, H)).astype(np.float32), bal.reroute(handle, ids),
                         np.full((T, K), 1 / K, np.float32))
    fault("combine")
    disp.combine(2 * recv.x, recv.handle)
    for replica in bal.replica_grads(handle):
        replica[0][...] = 1
    fault("reduce_grads")
    bal.reduce_grads(handle)
    fault("close")
print(f"[fault] rank {me} finished", flush=True)
