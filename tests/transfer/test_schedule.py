"""The NumPy task compiler (the CPU backend and the device compiler's reference): every
replica is written exactly once, relay trees forward to every leaf, chunk flags are
published exactly where a relay waits for them, gradient tasks cover every replicated
master in replica order, no schedule outgrows the capacity the device tables are
allocated with; and the kernels' table widths, weight-task columns, counts[] layout,
fault kinds and shared-memory carve-ups as the host reads them."""

import re

import numpy as np
import pytest

from tests.transfer.random_plans import random_plan
from ultraep.planner import ExpertLayout
from ultraep.runtime.kernels import kernel_constants, kernel_macro, kernel_source
from ultraep.transfer.device_schedule import COUNT_FIELDS, ERROR_SLOTS, FAULTS, ScheduleCapacity
from ultraep.transfer.schedule import (FLAG_WRITER_BITS, WEIGHT_TASK_COLUMNS, HeapPlacement, TileGeometry,
                                       compile_schedule, placement_error)
from ultraep.transfer.spec import ExpertSpec

LAYOUTS = [ExpertLayout(4, 12, 2), ExpertLayout(8, 16, 3, 8, 8), ExpertLayout(8, 32, 2, 4), ExpertLayout(16, 64, 4),
           ExpertLayout(1, 4, 2), ExpertLayout(2, 2, 0), ExpertLayout(32, 64, 2, 32, 32), ExpertLayout(16, 16, 1)]
SPEC = ExpertSpec([("w_in", (24, 40), "bfloat16"), ("w_out", (40, 24), "bfloat16"), ("bias", (37,), "float32")],
                  grad_dtype="float32")
PLACEMENT = HeapPlacement(weight_base=4096, grad_base=1 << 20, flag_base_slot=17)


def replica_slots(layout, plan, e):
    P, M = layout.slots_per_rank, layout.experts_per_rank
    return [(int(p) // P, int(p) % P - M) for p in plan.log_to_phys[e, 1:plan.replica_count[e]]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
@pytest.mark.parametrize("threshold, relay_count", [(1, 1), (2, 2), (3, 2), (1, 3)])
def test_every_replica_written_once_and_relays_serve_their_leaves(layout, threshold, relay_count):
    rng = np.random.default_rng((layout.num_ranks, layout.num_experts, threshold, relay_count))
    geometry = TileGeometry(SPEC, 512, 3)
    P, M, T = layout.slots_per_rank, layout.experts_per_rank, len(SPEC.weights)
    capacity = ScheduleCapacity.of(layout, geometry)
    relayed = 0
    for fill in (0.3, 0.7, 1.0, 1.0):
        plan = random_plan(layout, rng, fill)
        schedules = [compile_schedule(plan, SPEC, geometry, PLACEMENT, r, relay_threshold=threshold,
                                      relay_count=relay_count) for r in range(layout.num_ranks)]
        writes = {}  # (rank, slot) -> (writer rank, expert, waits for a chunk flag)
        published, waited = set(), set()  # (rank, signal-pad slot) of chunk flags
        relays_at = set()  # (rank, flag slot of chunk 0) of every replica slot a relay forwards from
        for sched in schedules:
            for name in COUNT_FIELDS:
                assert len(getattr(sched, name)) <= getattr(capacity, name), (name, capacity)
            assert sched.relays == schedules[0].relays, "ranks disagree on the relay trees"
            for src_ref, chunk, first, end, begin, stop, wait, publish in sched.weight_tasks.tolist():
                assert first == chunk * geometry.chunk_tiles and end == first + geometry.chunk_size(chunk)
                relay = src_ref >= M * T
                expert = (int(plan.phys_to_log[sched.rank * P + src_ref // T]) if relay
                          else sched.rank * M + src_ref // T)
                assert (wait >= 0) == relay and publish in (0, 1)
                if relay:
                    waited.add((sched.rank, wait))
                    relays_at.add((sched.rank, wait - chunk))
                if publish:
                    published |= {(dst_rank, flag + chunk) for dst_rank, _, flag in sched.dests[begin:stop].tolist()}
                if chunk:
                    continue
                for dst_rank, offset, flag in sched.dests[begin:stop].tolist():
                    slot = (offset - PLACEMENT.weight_base) // SPEC.weight_slot_bytes
                    assert flag == PLACEMENT.flag_base_slot + slot * geometry.num_chunks
                    assert (dst_rank, slot) not in writes, f"replica slot {(dst_rank, slot)} written twice"
                    writes[(dst_rank, slot)] = (sched.rank, expert, relay)
        # every flag a relay waits for is published; a publishing task serves at least one relay
        assert waited <= published, f"relays wait for unpublished chunk flags {sorted(waited - published)[:4]}"
        for sched in schedules:
            for *_, begin, stop, _, publish in sched.weight_tasks.tolist():
                flags = {(dst_rank, flag) for dst_rank, _, flag in sched.dests[begin:stop].tolist()}
                assert publish == bool(flags & relays_at), "a task publishes flags no relay reads"
        expected = {slot: e for e in range(layout.num_experts) for slot in replica_slots(layout, plan, e)}
        assert set(writes) == set(expected), "some replica is never written"
        for slot, (writer, expert, relay) in writes.items():
            assert expert == expected[slot]
            replicas, master = replica_slots(layout, plan, expert), layout.master_rank(expert)
            tree = schedules[0].relays.get(expert)
            assert (tree is not None) == (len(replicas) > threshold)
            if tree is None:
                assert writer == master and not relay
                continue
            assert len(tree) == min(relay_count, len(replicas))
            served_by = {replicas[leaf - 1]: replicas[r - 1][0] for r, leaves in tree for leaf in leaves}
            if slot in served_by:
                assert relay and writer == served_by[slot]
                relayed += 1
            else:
                assert not relay and writer == master and slot in [replicas[r - 1] for r, _ in tree]
        for sched in schedules:
            check_grad_tasks(layout, plan, geometry, sched)
    if layout.redundant_slots and layout.max_instances > 2 and threshold == 1 and relay_count == 1:
        assert relayed, "no leaf was served by a relay: the relay checks proved nothing"


def check_grad_tasks(layout, plan, geometry, sched):
    M, T = layout.experts_per_rank, len(SPEC.grads)
    want_tasks, want_srcs = [], []
    for m in range(M):
        replicas = replica_slots(layout, plan, sched.rank * M + m)
        for t, offset, nbytes in (geometry.grad_tiles if replicas else ()):
            want_tasks.append((m * T + t, offset, nbytes, len(want_srcs), len(want_srcs) + len(replicas)))
            want_srcs += [(r, PLACEMENT.grad_base + s * SPEC.grad_slot_bytes + SPEC.grad_offsets[t] + offset)
                          for r, s in replicas]
    assert sched.grad_tasks.tolist() == [list(t) for t in want_tasks]
    assert sched.grad_srcs.tolist() == [list(s) for s in want_srcs]


def test_grad_tiles_cover_each_gradient_tensor():
    geometry = TileGeometry(SPEC, 512, 2)
    for t, grad in enumerate(SPEC.grads):
        tiles = [(offset, nbytes) for tensor, offset, nbytes in geometry.grad_tiles if tensor == t]
        assert sum(n for _, n in tiles) == grad.nbytes and [o for o, _ in tiles] == list(range(0, grad.nbytes, 512))


def test_tensor_tables_name_each_tensors_first_tile_bytes_and_slot_offset():
    """What the kernels read of an expert's tensors: weights (first tile, bytes, slot offset),
    gradients (first tile, slot offset, bytes), each first tile the index in expert order of
    the tile at the tensor's offset 0."""
    geometry = TileGeometry(SPEC, 512, 2)
    for table, tiles, tensors, offsets, columns in (
            (geometry.weight_tensor_table(), geometry.tiles, SPEC.weights, SPEC.weight_offsets, (0, 1, 2)),
            (geometry.grad_tensor_table(), geometry.grad_tiles, SPEC.grads, SPEC.grad_offsets, (0, 2, 1))):
        assert table.dtype == np.int64 and table.shape == (len(tensors), 3)
        for t, (tensor, offset) in enumerate(zip(tensors, offsets)):
            first, nbytes, slot_offset = (int(table[t, c]) for c in columns)
            assert tiles[first][:2] == (t, 0) and (first == 0 or tiles[first - 1][0] == t - 1)
            assert nbytes == tensor.nbytes and slot_offset == offset


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_placement_error_accepts_planner_placements(layout):
    rng = np.random.default_rng(layout.num_experts)
    for _ in range(20):
        plan = random_plan(layout, rng)
        assert placement_error(layout, plan.log_to_phys, plan.replica_count) is None


def test_placement_error_names_each_broken_rule():
    layout = ExpertLayout(8, 16, 2, 4)  # 2 masters + 2 redundant slots per rank, domains of 4 ranks, K = 4
    P, M = layout.slots_per_rank, layout.experts_per_rank

    def error(**replicas):  # expert -> list of replica slots
        ltp = np.full((16, layout.max_instances), -1, np.int32)
        ltp[:, 0] = [layout.master_slot(e) for e in range(16)]
        count = np.ones(16, np.int32)
        for name, slots in replicas.items():
            e = int(name[1:])
            ltp[e, 1:1 + len(slots)] = slots
            count[e] += len(slots)
        return placement_error(layout, ltp, count)

    assert error(e0=[1 * P + M]) is None
    assert "outside the redundant slots" in error(e0=[1 * P + 0])            # a master slot of rank 1
    assert "outside the redundant slots" in error(e0=[8 * P])                 # beyond the layout
    assert "outside its domain" in error(e0=[4 * P + M])                      # rank 4: the other domain
    assert "master's rank" in error(e0=[0 * P + M])                           # its own rank
    assert "share one slot" in error(e0=[1 * P + M], e1=[1 * P + M])
    assert "two instances on one rank" in error(e0=[1 * P + M, 1 * P + M + 1])
    bad_count = np.ones(16, np.int32)
    bad_count[3] = layout.max_instances + 1
    assert "outside [1," in placement_error(layout, np.zeros((16, layout.max_instances), np.int32), bad_count)


def test_the_reference_writes_the_kernels_table_widths_and_columns():
    header = kernel_source("task_tables.cuh").read_text()
    widths = kernel_constants("task_tables.cuh")
    # the kernel reads weight-task fields by WeightTaskField: the same columns in the same order
    enum = re.search(r"enum WeightTaskField \{([^}]*)\}", header).group(1)
    assert tuple(name.strip().lower() for name in enum.split(",")) == WEIGHT_TASK_COLUMNS
    assert len(WEIGHT_TASK_COLUMNS) == widths["WEIGHT_TASK_FIELDS"]
    layout = LAYOUTS[0]
    schedule = compile_schedule(random_plan(layout, np.random.default_rng(0), 1.0), SPEC, TileGeometry(SPEC, 256, 2),
                                PLACEMENT, 0, relay_threshold=1, relay_count=1)
    for table, name in [("weight_tasks", "WEIGHT_TASK_FIELDS"), ("dests", "DEST_FIELDS"),
                        ("grad_tasks", "GRAD_TASK_FIELDS"), ("grad_srcs", "GRAD_SRC_FIELDS")]:
        assert getattr(schedule, table).shape[1] == widths[name], table
    assert FLAG_WRITER_BITS == kernel_constants("transfer.cu")["FLAG_WRITER_BITS"]


def test_the_schedule_compilers_counts_and_faults_are_the_hosts():
    """counts[] holds the tables' lengths in COUNT_FIELDS order, then the two error codes
    (the GPU tests slice it so); every fault kind placement_code reports has a message."""
    defined = kernel_constants("schedule.cu")
    assert [defined[f"COUNT_{name.upper()}"] for name in COUNT_FIELDS] == list(range(len(COUNT_FIELDS)))
    assert ERROR_SLOTS == (len(COUNT_FIELDS), len(COUNT_FIELDS) + 1)
    assert defined["COUNT_SLOTS"] == len(COUNT_FIELDS) + 2
    kinds = {name for name in defined if name.startswith("FAULT_") and name != "FAULT_KINDS"}
    assert kinds == set(FAULTS), "a fault kind of schedule.cu has no message, or a message no kind"
    assert sorted(defined[name] for name in kinds) == list(range(len(kinds))) and len(kinds) <= defined["FAULT_KINDS"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_the_compilers_shared_memory_is_the_kernels_carve_up(layout):
    """The host launches with what the kernel's macros give: sent (i64 [R]) and the int
    arrays its comment lists, in the order the kernel carves them, the staged plan last."""
    R, E, M, S, K = (layout.num_ranks, layout.num_experts, layout.experts_per_rank, layout.redundant_slots,
                     layout.max_instances)
    weight_ints = [E, E, M + S, M + S, M + S + 1, S, S, S, R * S, E * K, E]
    assert kernel_macro("schedule.cu", "WEIGHT_COMPILE_SHARED_BYTES",
                        R=R, E=E, M=M, S=S, K=K) == 8 * R + 4 * sum(weight_ints)
    assert kernel_macro("schedule.cu", "GRAD_COMPILE_SHARED_BYTES",
                        R=R, E=E, M=M, S=S, K=K) == 4 * (M + M + 1 + R * S + E * K + E)
