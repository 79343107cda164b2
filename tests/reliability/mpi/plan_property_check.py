"""Property: a transfer whose plan or layer differs on one rank is always refused, on every
rank, and writes nothing; one whose plans differ only where a transfer does not read is not.

argv: backend, trials. Each trial draws, from a seed every rank shares, a random valid plan
(tests/transfer/random_plans.py), the odd rank and the kind of difference there: another
random plan, the plan with one replica dropped, or another layer; as a control, the plan
with other loads and quotas (a transfer reads only the placement). On the device the
refusal is raised by synchronize. Every rank prints ``[plan_property] rank <r> OK``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep import EPGroup, ExpertLayout, ExpertSpec, GroupMismatchError, WeightTransfer, open_heap
from ultraep.transfer.agreement import plan_hash

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402
from tests.transfer.random_plans import random_plan  # noqa: E402

backend, trials = sys.argv[1], int(sys.argv[2])
group = EPGroup(MPI.COMM_WORLD, use_gpu=backend == "device", timeout_s=30.0)
me, R = group.rank, group.size
if backend == "device":
    import cupy as xp
else:
    xp = np
LAYOUT = ExpertLayout(R, 2 * R, 2)
SPEC = ExpertSpec([("w", (4, 8), "float32")])
M = LAYOUT.experts_per_rank
POISON = -7.0
KINDS = ("other", "drop", "layer", "loads")


def placement_hash(layer, plan) -> int:
    return plan_hash(layer, plan.log_to_phys, plan.replica_count)


def variant(plan, kind: str, rng):
    """(layer, plan) the odd rank passes."""
    if kind == "layer":
        return 1, plan
    changed = copy.copy(plan)
    if kind == "other":
        while placement_hash(0, changed) == placement_hash(0, plan):
            changed = random_plan(LAYOUT, rng)
    elif kind == "drop":
        replicated = np.flatnonzero(plan.replica_count > 1)
        e = int(rng.choice(replicated)) if replicated.size else None
        if e is None:  # no replica to drop: another plan instead
            return variant(plan, "other", rng)
        changed.log_to_phys, changed.replica_count = plan.log_to_phys.copy(), plan.replica_count.copy()
        changed.replica_count[e] -= 1
        changed.log_to_phys[e, changed.replica_count[e]] = -1
    else:  # loads: what a transfer does not read
        changed.loads, changed.quota = plan.loads + 1, plan.quota + 1
    return 0, changed


def poison(engine) -> list:
    slots = [engine.replica_weights(s)[0] for s in range(LAYOUT.redundant_slots)]
    for slot in slots:
        slot[...] = POISON
    return slots


def refused(call, engine) -> str:
    if backend == "device":
        call()
        return expect(engine.synchronize, GroupMismatchError, "ranks disagree on")
    return expect(call, GroupMismatchError, "ranks disagree on")


with open_heap(group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend=backend) as heap, \
        WeightTransfer(heap, LAYOUT, SPEC) as engine:
    for layer in (0, 1):
        engine.register_layer(layer, [[xp.full((4, 8), me * M + m + 1, np.float32)] for m in range(M)],
                              [[xp.zeros((4, 8), np.float32)] for _ in range(M)])
    counts = dict.fromkeys(KINDS, 0)
    for trial in range(trials):
        rng = np.random.default_rng(trial)  # the same draws on every rank
        plan = random_plan(LAYOUT, rng)
        odd, kind = int(rng.integers(R)), KINDS[trial % len(KINDS)]
        layer, changed = variant(plan, kind, rng)
        mine_layer, mine = (layer, changed) if me == odd else (0, plan)
        counts[kind] += 1
        slots = poison(engine)
        for transfer in (engine.weight_sync, engine.reduce_grads):
            if kind == "loads":
                transfer(mine_layer, mine)
                engine.synchronize()
                continue
            message = refused(lambda: transfer(mine_layer, mine), engine)
            assert f"ranks [{odd}]: " in message, f"rank {me}: trial {trial} ({kind}): {message}"
            assert all(bool((slot == POISON).all()) for slot in slots), \
                f"rank {me}: trial {trial} ({kind}): a refused {transfer.__name__} wrote a replica"
        engine.weight_sync(0, plan)  # the agreed plan still goes through
        engine.synchronize()
        filled = sum(group.allgather(sum(not bool((slot == POISON).all()) for slot in slots)))
        replicas = int((np.asarray(plan.replica_count) - 1).sum())
        assert filled == replicas, f"rank {me}: trial {trial}: {filled} replica slots filled, the plan has {replicas}"
    assert all(counts.values()), counts
print(f"[plan_property] rank {me} OK", flush=True)
