"""The device schedule compiler (raw_kernels/schedule.cu) against the NumPy reference,
bitwise, on many random plans and every rank, with poisoned tables: rows up to the
device-written counts equal ``compile_schedule``'s, rows beyond them stay untouched.
Plans that break the layout are refused with zero-length tables and a reported error
(needs a GPU)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from tests.transfer.random_plans import random_plan
from ultraep.planner import ExpertLayout, Plan
from ultraep.transfer.device_schedule import COUNT_FIELDS, DeviceSchedule
from ultraep.transfer.schedule import HeapPlacement, TileGeometry, compile_schedule
from ultraep.transfer.spec import ExpertSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

POISON = np.int64(-0x5A5A5A5A5A5A5A5B)
LAYOUTS = [ExpertLayout(4, 12, 2), ExpertLayout(8, 16, 3, 8, 8), ExpertLayout(8, 32, 2, 4), ExpertLayout(16, 64, 4),
           ExpertLayout(1, 4, 2), ExpertLayout(2, 2, 0), ExpertLayout(32, 64, 2, 32, 32), ExpertLayout(16, 16, 1),
           ExpertLayout(64, 256, 2, 64, 16)]


def random_setup(rng, layout):
    tensors = [(f"t{i}", tuple(int(d) for d in rng.integers(1, 70, size=2)), str(rng.choice(["float32", "bfloat16"])))
               for i in range(int(rng.integers(1, 4)))]
    spec = ExpertSpec(tensors, grad_dtype=str(rng.choice(["float32", "bfloat16"])))
    geometry = TileGeometry(spec, 256 * int(rng.integers(1, 6)), int(rng.integers(1, 4)))
    placement = HeapPlacement(256 * int(rng.integers(0, 1 << 20)), 256 * int(rng.integers(0, 1 << 20)),
                              int(rng.integers(0, 1000)))
    return spec, geometry, placement, int(rng.integers(1, 4)), int(rng.integers(1, 4))


def poison(tables):
    for name in COUNT_FIELDS:
        getattr(tables, name).fill(POISON)
    tables.counts[:len(COUNT_FIELDS)].fill(-7)


def assert_tables_equal(tables, reference, context):
    counts = tables.counts.get()
    for name, count in zip(COUNT_FIELDS, counts):
        want, got = getattr(reference, name), getattr(tables, name).get()
        assert count == len(want), f"{context}: {name} count {count}, reference {len(want)}"
        assert np.array_equal(got[:count], want), f"{context}: {name} rows differ from compile_schedule"
        assert (got[count:] == POISON).all(), f"{context}: {name} written beyond its count"
    assert not counts[len(COUNT_FIELDS):].any(), f"{context}: a valid plan was refused"


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_device_schedule_equals_numpy_reference(layout):
    import cupy

    rng = np.random.default_rng((layout.num_ranks, layout.num_experts, layout.redundant_slots))
    compared = relayed = 0
    for trial in range(6):
        spec, geometry, placement, threshold, relay_count = random_setup(rng, layout)
        ranks = rng.permutation(layout.num_ranks)[:4].tolist()
        compilers = {r: DeviceSchedule(layout, spec, geometry, placement, r, relay_threshold=threshold,
                                       relay_count=relay_count) for r in ranks}
        for fill in (0.3, 0.7, 1.0):
            plan = random_plan(layout, rng, fill)
            device_plan = Plan(layout=layout, imbalance_before=plan.imbalance_before,
                               imbalance_after=plan.imbalance_after,
                               **{name: cupy.asarray(getattr(plan, name)) for name in Plan.ARRAYS})
            for rank, tables in compilers.items():
                reference = compile_schedule(plan, spec, geometry, placement, rank, relay_threshold=threshold,
                                             relay_count=relay_count)
                for source in (device_plan, plan):  # a device plan in place; a NumPy plan staged
                    poison(tables)
                    tables.compile_weights(source)
                    tables.compile_grads(source)
                    assert_tables_equal(tables, reference, f"{layout} trial {trial} fill {fill} rank {rank}")
                compared += 1
                relayed += int((reference.weight_tasks[:, 6] >= 0).any())
    assert compared == 6 * 3 * min(4, layout.num_ranks)
    if layout.redundant_slots and layout.max_instances > 3:
        assert relayed, "no compared schedule had a relay source: the relay path was not checked"


def broken_plan(layout, log_to_phys, replica_count):
    import cupy

    R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
    zeros = cupy.zeros((R, E, K), np.int32)
    return Plan(layout=layout, loads=zeros[:, :, 0], phys_to_log=cupy.zeros(layout.num_physical, np.int32),
                log_to_phys=cupy.asarray(log_to_phys, dtype=np.int32),
                replica_count=cupy.asarray(replica_count, dtype=np.int32), quota=zeros[0], split_prefix=zeros,
                rank_load=cupy.zeros(R, np.int64), imbalance_before=1.0, imbalance_after=1.0)


def test_plans_breaking_the_layout_are_refused_by_every_rank():
    """Each way a placement can break the layout (schedule.placement_error's checks) is
    refused by every rank's compiler alike, naming the same expert, and no tasks are left."""
    from ultraep.transfer.schedule import placement_error

    layout = ExpertLayout(8, 32, 2, 4)  # M = 4, S = 2, P = 6, domains of 4 ranks, K = 4
    spec, geometry, placement, _, _ = random_setup(np.random.default_rng(1), layout)
    compilers = [DeviceSchedule(layout, spec, geometry, placement, r, relay_threshold=8, relay_count=1)
                 for r in range(layout.num_ranks)]
    P, M, K = layout.slots_per_rank, layout.experts_per_rank, layout.max_instances
    base = np.full((layout.num_experts, K), -1, np.int32)
    base[:, 0] = [layout.master_slot(e) for e in range(layout.num_experts)]

    def broken(expert_replicas, counts=None):
        ltp, count = base.copy(), np.ones(layout.num_experts, np.int32)
        for e, slots in expert_replicas.items():
            ltp[e, 1:1 + len(slots)] = slots
            count[e] = 1 + len(slots)
        for e, n in (counts or {}).items():
            count[e] = n
        return ltp, count

    cases = [(broken({}, {1: K + 1}), "expert 1 has an instance count outside [1, 4]"),
             (broken({2: [1 * P + 0]}), "expert 2 has a replica outside the redundant slots"),
             (broken({0: [4 * P + M]}), "expert 0 has a replica on its master's rank or outside its domain"),
             (broken({3: [0 * P + M]}), "expert 3 has a replica on its master's rank or outside its domain"),
             (broken({3: [1 * P + M, 1 * P + M + 1]}), "expert 3 has two instances on one rank"),
             (broken({1: [2 * P + M], 5: [2 * P + M]}), "expert 5 has a replica in a slot that a lower expert's"),
             (broken({6: [0 * P + M, 5 * P + M], 2: [1 * P + 0]}), "expert 2 has a replica outside")]
    for (ltp, count), needle in cases:
        assert placement_error(layout, ltp, count) is not None, f"{needle}: the NumPy check accepts it"
        plan = broken_plan(layout, ltp, count)
        for tables in compilers:
            poison(tables)
            tables.compile_weights(plan)
            tables.compile_grads(plan)
            assert not tables.counts[:len(COUNT_FIELDS)].get().any(), f"{needle}: a refused plan left tasks"
            message = tables.take_error()
            assert message is not None and needle in message, f"rank {tables.rank}: {message}"
            assert tables.take_error() is None, "the error was not cleared once reported"
    sound = broken({0: [1 * P + M, 2 * P + M], 5: [2 * P + M + 1]})
    assert placement_error(layout, *sound) is None
    for tables in compilers:
        poison(tables)
        tables.compile_weights(broken_plan(layout, *sound))
        assert tables.take_error() is None, f"rank {tables.rank}: a sound placement was refused"
