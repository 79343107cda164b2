"""The one-launch weight sync (raw_kernels/transfer.cu ``agree_compile_and_sync_weights``:
plan agreement, schedule compile and copy in one grid) on one GPU, one rank's launch at a
time: the other ranks' heaps are buffers of this process, poisoned, and the agreement's
peers are scripted (their call and hash written into this rank's pad beforehand). On
random plans of several layouts, relays included (a relay's own replica slot holds its
expert and its chunk flags are set, as its master would have left them), for grids of 1
block (both roles in one), 2 and many: the compiled tables equal ``compile_schedule``'s,
every destination slot the tables name holds its expert byte for byte with every chunk
flagged with the epoch the compile counted, every other byte keeps its poison, and the
gate is zero again. A peer that publishes another hash refuses the plan: the tables are
still compiled, nothing is copied, and the status names the mismatch. The same with the
agreement run just before by agree.cu's kernel (``agreed_before``: what ranks sharing a GPU
do), the launch reading its verdict (needs a GPU)."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from tests.transfer.random_plans import random_plan
from ultraep.planner import ExpertLayout, Plan
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.transfer.agreement import AGREE_MISMATCH, SLOTS_PER_RANK, STATUS_HASHES, STATUS_KIND, plan_hash
from ultraep.transfer.device_schedule import COUNT_FIELDS, DeviceSchedule
from ultraep.transfer.schedule import FLAG_WRITER_BITS, HeapPlacement, TileGeometry, compile_schedule
from ultraep.transfer.spec import ExpertSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

LAYOUTS = [ExpertLayout(4, 12, 2), ExpertLayout(8, 16, 3, 8, 8), ExpertLayout(8, 32, 2, 4), ExpertLayout(16, 64, 4)]
POISON = 0xA5
EPOCH = 5
FLAG_BYTES = 4096  # the chunk flags open each heap; the replica slots follow


class ScriptedAgreement:
    """agree_on_plan's arguments for rank 0 of ``world`` ranks whose peers have published
    call 1 with ``peer_hash`` into this rank's pad (each rank's pad a buffer of its own)."""

    def __init__(self, world: int, peer_hash: int | None = None):
        import cupy

        self.pads = [cupy.zeros(SLOTS_PER_RANK * world, np.uint64) for _ in range(world)]
        own = np.zeros(SLOTS_PER_RANK * world, np.uint64)
        for peer in range(1, world):  # call 1 has parity 1: its hashes sit in the second block of slots
            own[peer] = 1
            own[2 * world + peer] = np.uint64(peer_hash)
        self.pads[0].set(own)
        self.world = world
        self.peer_bases = cupy.asarray(np.array([pad.data.ptr for pad in self.pads], np.uint64))
        self.calls, self.hashes = cupy.zeros(1, np.uint64), cupy.zeros(world, np.uint64)
        self.status = cupy.zeros(STATUS_HASHES + world, np.uint64)

    def arguments(self, layout, log_to_phys, replica_count, layer: int) -> tuple:
        return (log_to_phys, replica_count, np.int32(layout.num_experts), np.int32(layout.max_instances),
                np.int32(0), np.uint64(layer), self.peer_bases, np.int32(0), np.int32(self.world), np.uint64(0),
                self.calls, np.uint64(10**9), self.hashes, self.status)


def sync_once(layout, plan, rank, spec, geometry, tables, expert_bytes, blocks, agreement, layer, agreed_before):
    """One launch for ``rank`` (after the agreement's own, ``agreed_before``): returns the heaps
    (host copies), the status words and the gate."""
    import cupy

    R, M, S, P = layout.num_ranks, layout.experts_per_rank, layout.redundant_slots, layout.slots_per_rank
    heap_bytes = FLAG_BYTES + S * spec.weight_slot_bytes
    heaps = [cupy.full(heap_bytes, POISON, np.uint8) for _ in range(R)]
    flag_word = np.uint64(EPOCH << FLAG_WRITER_BITS | 0x7777)  # what a master would have left for a relay
    for q in range(S):  # this rank's replica slots: what its masters copied in (a relay's source)
        e = int(plan.phys_to_log[rank * P + M + q])
        if e >= 0:
            heaps[rank][FLAG_BYTES + q * spec.weight_slot_bytes:][:expert_bytes[e].size] = expert_bytes[e]
            heaps[rank][:FLAG_BYTES].view(np.uint64)[q * geometry.num_chunks:(q + 1) * geometry.num_chunks] = flag_word
    before = [h.get() for h in heaps]
    masters = [expert_bytes[rank * M + m] for m in range(M)]
    slot_tensors = [heaps[rank].data.ptr + FLAG_BYTES + q * spec.weight_slot_bytes + off
                    for q in range(S) for off in spec.weight_offsets]
    sources = cupy.asarray(np.array([m.data.ptr + off for m in masters for off in spec.weight_offsets] + slot_tensors,
                                    np.uint64))
    tensor_table = cupy.asarray(geometry.weight_tensor_table())
    device_plan = Plan(layout=layout, imbalance_before=plan.imbalance_before, imbalance_after=plan.imbalance_after,
                       **{name: cupy.asarray(getattr(plan, name)) for name in Plan.ARRAYS})
    sync_status = cupy.zeros(kernel_constant("transfer.cu", "STATUS_WORDS"), np.uint64)
    gate = cupy.zeros(kernel_constant("transfer.cu", "GATE_WORDS"), np.uint64)
    done = cupy.zeros(len(tables.weight_tasks), np.int32)
    kernel = get_function("transfer.cu", "agree_compile_and_sync_weights")
    if tables.weight_shared_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = tables.weight_shared_bytes
    tables.weight_syncs.fill(EPOCH - 1)  # the compile counts this launch's sync: its chunks flag EPOCH
    agreement_arguments = agreement.arguments(layout, device_plan.log_to_phys, device_plan.replica_count, layer)
    if agreed_before:  # no gated placement: the launch reads the verdict
        get_function("agree.cu", "agree_plan")((1,), (kernel_constant("agree.cu", "AGREE_THREADS"),),
                                               agreement_arguments + (np.uintp(0),))
    kernel((blocks,), (kernel_constant("transfer.cu", "SYNC_THREADS"),),
           agreement_arguments + (np.int32(agreed_before),) + tables.weight_compile_arguments(device_plan)
           + (np.int32(len(tables.weight_tasks)), tensor_table, np.int64(geometry.tile_bytes),
              np.int32(len(tables.dests)), sources, np.int32(len(sources)),
              cupy.asarray(np.array([h.data.ptr for h in heaps], np.uint64)), np.int32(R), np.int32(1),
              done, sync_status, gate),
           shared_mem=tables.weight_shared_bytes)
    cupy.cuda.get_current_stream().synchronize()
    assert int(tables.weight_syncs.get()[0]) == EPOCH, "the launch's compile did not count its sync once"
    return before, [h.get() for h in heaps], sync_status.get(), gate.get(), done.get()


def expected_heaps(before, reference, layout, plan, spec, geometry, expert_bytes, rank):
    """``before`` with every destination row of ``reference`` (this rank's schedule)
    holding its slot's expert and every chunk of that slot flagged by this rank."""
    P, M = layout.slots_per_rank, layout.experts_per_rank
    want = [h.copy() for h in before]
    flag_word = np.uint64(EPOCH << FLAG_WRITER_BITS | rank)
    for dest_rank, offset, flag_slot in reference.dests:
        q = (int(offset) - FLAG_BYTES) // spec.weight_slot_bytes
        e = int(plan.phys_to_log[dest_rank * P + M + q])
        expert = expert_bytes[e].get()
        for tensor, start in zip(spec.weights, spec.weight_offsets):  # the tensors, not the gaps between them
            want[dest_rank][offset + start:offset + start + tensor.nbytes] = expert[start:start + tensor.nbytes]
        want[dest_rank][:FLAG_BYTES].view(np.uint64)[flag_slot:flag_slot + geometry.num_chunks] = flag_word
    return want


@pytest.mark.parametrize("agreed_before", [False, True], ids=["agreed in the launch", "agreed before"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_one_launch_sync_equals_compile_then_copy(layout, agreed_before):
    import cupy

    rng = np.random.default_rng((layout.num_ranks, layout.num_experts, 7))
    S = layout.redundant_slots
    checked = relayed = 0
    for trial in range(4):
        tensors = [(f"t{i}", tuple(int(d) for d in rng.integers(1, 70, size=2)),
                    str(rng.choice(["float32", "bfloat16"]))) for i in range(int(rng.integers(1, 4)))]
        spec = ExpertSpec(tensors)
        geometry = TileGeometry(spec, 256 * int(rng.integers(1, 6)), int(rng.integers(1, 4)))
        assert S * geometry.num_chunks * 8 <= FLAG_BYTES
        placement = HeapPlacement(FLAG_BYTES, 0, 0)
        expert_bytes = [cupy.asarray(rng.integers(0, 256, spec.weight_slot_bytes, dtype=np.uint8))
                        for _ in range(layout.num_experts)]
        threshold, relay_count = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        plan = random_plan(layout, rng, float(rng.choice([0.4, 1.0])))
        for rank in rng.permutation(layout.num_ranks)[:3].tolist():
            tables = DeviceSchedule(layout, spec, geometry, placement, rank, relay_threshold=threshold,
                                    relay_count=relay_count)
            reference = compile_schedule(plan, spec, geometry, placement, rank, relay_threshold=threshold,
                                         relay_count=relay_count)
            for blocks in (1, 2, 37):
                context = f"{layout} trial {trial} rank {rank} grid {blocks} agreed before {agreed_before}"
                mine = plan_hash(trial, plan.log_to_phys, plan.replica_count)
                agreement = ScriptedAgreement(3, peer_hash=mine)
                before, after, status, gate, done = sync_once(layout, plan, rank, spec, geometry, tables,
                                                              expert_bytes, blocks, agreement, trial,
                                                              agreed_before)
                assert not status.any(), f"{context}: sync status {status}"
                assert not agreement.status.get().any(), f"{context}: agreement status {agreement.status.get()}"
                assert not gate.any() and not done.any(), f"{context}: gate {gate} or chunk counts {done} left set"
                assert int(agreement.calls.get()[0]) == 1, f"{context}: the sync was not agreed exactly once"
                counts = tables.counts.get()
                for name, count in zip(COUNT_FIELDS[:2], counts):
                    assert np.array_equal(getattr(tables, name)[:count].get(), getattr(reference, name)), \
                        f"{context}: {name} differ from compile_schedule"
                want = expected_heaps(before, reference, layout, plan, spec, geometry, expert_bytes, rank)
                for r, (got, expected) in enumerate(zip(after, want)):
                    differ = np.flatnonzero(got != expected)
                    assert differ.size == 0, f"{context}: rank {r}'s heap: {differ.size} bytes differ, {differ[:4]}.."
                checked += len(reference.dests) > 0
                relayed += int((reference.weight_tasks[:, 6] >= 0).any())

                refusing = ScriptedAgreement(3, peer_hash=mine ^ 1)
                before, after, status, gate, done = sync_once(layout, plan, rank, spec, geometry, tables,
                                                              expert_bytes, blocks, refusing, trial,
                                                              agreed_before)
                assert int(refusing.status.get()[STATUS_KIND]) == AGREE_MISMATCH, f"{context}: no mismatch recorded"
                assert int(refusing.calls.get()[0]) == 1, f"{context}: the refused sync was not agreed exactly once"
                assert not status.any() and not gate.any(), f"{context}: refused sync left {status} / {gate}"
                assert all(np.array_equal(b, a) for b, a in zip(before, after)), f"{context}: a refused sync wrote"
                assert np.array_equal(tables.weight_tasks[:int(tables.counts.get()[0])].get(), reference.weight_tasks)
    assert checked, "no rank had a destination: nothing was copied"
    if layout.max_instances > 3:
        assert relayed, "no schedule had a relay source: the relay path was not checked"
