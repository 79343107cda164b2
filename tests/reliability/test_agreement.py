"""Plan agreement (ultraep/transfer/agreement.py, raw_kernels/agree.cu): the NumPy hash
against a word-by-word Python transcription of the kernel's arithmetic; a plan or layer
differing in one place changes it. On a GPU, the kernel alone in one process, its peers'
signal pads played by buffers of this process: the hash it publishes is the NumPy one bit
for bit, an agreeing plan passes unchanged, a differing hash or a silent peer gates the
plan to no replicas and records the failure (naming the rank waited for, within the
timeout), and a recorded failure makes later calls publish nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import requires_gpu
from ultraep.transfer.agreement import (AGREE_MISMATCH, AGREE_THREADS, AGREE_TIMEOUT, SLOTS_PER_RANK,
                                        STATUS_CALL, STATUS_HASHES, STATUS_KIND, STATUS_LAYER, STATUS_OP,
                                        STATUS_SEEN, STATUS_WAITED, disagreement_message, plan_hash)

MASK = 2**64 - 1


def mix64_reference(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def hash_reference(layer: int, log_to_phys, replica_count) -> int:
    """agree_plan's sum, one word at a time in Python integers (columns past an expert's
    count read as -1)."""
    total = mix64_reference(layer & MASK)
    counts = [int(c) for c in np.asarray(replica_count)]
    words = [int(v) if k < counts[e] else -1
             for e, row in enumerate(np.asarray(log_to_phys)) for k, v in enumerate(row)]
    for position, value in enumerate(words + counts, start=1):
        total = (total + mix64_reference(((position << 32) | (value & 0xFFFFFFFF)) & MASK)) & MASK
    return total


def random_placement(rng, E=24, K=3):
    return rng.integers(-1, 64, (E, K), dtype=np.int32), rng.integers(1, K + 1, E, dtype=np.int32)


@pytest.mark.parametrize("seed", range(5))
def test_numpy_hash_is_the_kernels_arithmetic(seed):
    rng = np.random.default_rng(seed)
    log_to_phys, replica_count = random_placement(rng)
    layer = int(rng.integers(-5, 1 << 40))
    assert plan_hash(layer, log_to_phys, replica_count) == hash_reference(layer, log_to_phys, replica_count)


def test_columns_past_the_count_are_not_hashed():
    rng = np.random.default_rng(9)
    log_to_phys, replica_count = random_placement(rng)
    replica_count[:] = 1
    junk = log_to_phys.copy()
    junk[:, 1:] = rng.integers(-1000, 1000, junk[:, 1:].shape)  # what np.empty might hold
    assert plan_hash(0, junk, replica_count) == plan_hash(0, log_to_phys, replica_count)


def test_hash_reads_values_not_dtypes():
    rng = np.random.default_rng(7)
    log_to_phys, replica_count = random_placement(rng)
    assert plan_hash(3, log_to_phys, replica_count) == plan_hash(3, log_to_phys.astype(np.int64),
                                                                 replica_count.astype(np.int64))


@pytest.mark.parametrize("seed", range(20))
def test_one_changed_word_or_layer_changes_the_hash(seed):
    rng = np.random.default_rng(100 + seed)
    log_to_phys, replica_count = random_placement(rng)
    base = plan_hash(0, log_to_phys, replica_count)
    other_l2p, other_count = log_to_phys.copy(), replica_count.copy()
    if seed % 2:
        i = rng.integers(0, log_to_phys.shape[0])
        j = rng.integers(0, replica_count[i])  # a column the transfer reads
        other_l2p[i, j] += int(rng.integers(1, 5))
    else:
        e = rng.integers(0, replica_count.size)
        other_count[e] = other_count[e] % 3 + 1
    assert plan_hash(0, other_l2p, other_count) != base
    assert plan_hash(1, log_to_phys, replica_count) != base
    # swapping two different masters moves values between positions: a different hash
    swapped = log_to_phys.copy()
    a = int(np.flatnonzero(swapped[:, 0] != swapped[0, 0])[0])
    swapped[[0, a], 0] = swapped[[a, 0], 0]
    assert plan_hash(0, swapped, replica_count) != base


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**31 - 1), st.integers(-2**40, 2**40), st.data())
def test_any_one_change_changes_the_hash(E, K, seed, layer, data):
    """Plans of any shape: the hash is the kernel's arithmetic, and a different value in any
    one word a transfer reads changes it (a column past the expert's count is not read)."""
    log_to_phys, replica_count = random_placement(np.random.default_rng(seed), E, K)
    base = plan_hash(layer, log_to_phys, replica_count)
    assert base == hash_reference(layer, log_to_phys, replica_count)
    position = data.draw(st.integers(0, E * K + E - 1), label="position")
    value = data.draw(st.integers(-2**31, 2**31 - 1), label="value")
    words = np.concatenate([log_to_phys.ravel(), replica_count])
    if words[position] == value:
        return
    words[position] = value
    changed = plan_hash(layer, words[:E * K].reshape(E, K), words[E * K:])
    read = position >= E * K or position % K < replica_count[position // K]
    assert (changed != base) == read


def test_disagreement_message_groups_ranks():
    message = disagreement_message("weight_sync(0)", [5, 5, 9, 5])
    assert message.startswith("ranks disagree on weight_sync(0) (layer, hash of the plan's")
    assert "ranks [0, 1, 3]: 0x0000000000000005" in message and "ranks [2]: 0x0000000000000009" in message


# -- the kernel alone (GPU) ------------------------------------------------------------------

WORLD, RANK, E, K = 3, 1, 24, 3
PAD = 512  # byte offset of the agreement's slots in each "heap"


class Pads:
    """WORLD heaps of one process: the kernel publishes into each through peer_bases."""

    def __init__(self):
        import cupy

        from ultraep.runtime.kernels import get_function

        self.kernel = get_function("agree.cu", "agree_plan")  # compiled here (cold: tens of seconds), not when timed
        self.heaps = [cupy.zeros(PAD // 8 + SLOTS_PER_RANK * WORLD, np.uint64) for _ in range(WORLD)]
        self.peer_bases = cupy.asarray(np.array([h.data.ptr for h in self.heaps], np.uint64))
        self.status = cupy.full(STATUS_HASHES + WORLD, 0, np.uint64)
        self.hashes = cupy.full(WORLD, 0xDEAD, np.uint64)

    def slots(self, rank):
        return self.heaps[rank][PAD // 8:]

    def publish_as(self, peer, call, value):
        """What peer ``peer`` would have written into this rank's pad for ``call``."""
        own = self.slots(RANK)
        own[WORLD * (1 + call % 2) + peer] = np.uint64(value)  # a Python int past 2**63 is no int64
        own[peer] = np.uint64(call)

    def run(self, log_to_phys, replica_count, call, layer=4, op=1, timeout_s=2.0):
        import cupy

        gated = cupy.full(E, -7, np.int32)  # poisoned
        calls = cupy.full(1, call - 1, np.uint64)  # the kernel numbers this call
        self.kernel((1,), (AGREE_THREADS,), (
            cupy.asarray(log_to_phys), cupy.asarray(replica_count), np.int32(E), np.int32(K), np.int32(op),
            np.uint64(layer), self.peer_bases, np.int32(RANK), np.int32(WORLD), np.uint64(PAD), calls,
            np.uint64(int(timeout_s * 1e9)), self.hashes, self.status, gated))
        cupy.cuda.get_current_stream().synchronize()
        assert int(calls.get()[0]) == call, "the kernel did not count the call"
        return gated.get(), [int(v) for v in self.status.get()]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("call", [1, 2])
@pytest.mark.parametrize("agree", [True, False])
def test_kernel_publishes_the_numpy_hash_and_gates_a_disagreement(call, agree):
    pads = Pads()
    rng = np.random.default_rng(call)
    log_to_phys, replica_count = random_placement(rng, E, K)
    expected = plan_hash(4, log_to_phys, replica_count)
    for peer in range(WORLD):
        if peer != RANK:
            pads.publish_as(peer, call, expected if agree or peer == 0 else expected ^ 1)
    gated, status = pads.run(log_to_phys, replica_count, call)
    for peer in range(WORLD):  # published into every pad, in the slot of this call's parity
        slots = pads.slots(peer).get()
        assert int(slots[RANK]) == call and int(slots[WORLD * (1 + call % 2) + RANK]) == expected, peer
        assert int(slots[WORLD * (2 - call % 2) + RANK]) == 0, "the other parity's slot was written"
    if agree:
        assert status[STATUS_KIND] == 0, status
        np.testing.assert_array_equal(gated, replica_count)
    else:
        assert status[STATUS_KIND] == AGREE_MISMATCH and status[STATUS_CALL] == call, status
        assert status[STATUS_OP] == 1 and status[STATUS_LAYER] == 4, status
        assert status[STATUS_HASHES:] == [expected, expected, expected ^ 1], status
        np.testing.assert_array_equal(gated, np.ones(E, np.int32))


@pytest.mark.gpu
@requires_gpu
def test_kernel_gives_up_on_a_silent_peer_within_its_timeout():
    pads = Pads()
    log_to_phys, replica_count = random_placement(np.random.default_rng(3), E, K)
    pads.publish_as(0, 5, plan_hash(4, log_to_phys, replica_count))  # rank 2 last published call 4
    pads.publish_as(2, 4, 123)
    start = time.monotonic()
    gated, status = pads.run(log_to_phys, replica_count, 5, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert status[STATUS_KIND] == AGREE_TIMEOUT and status[STATUS_WAITED] == 2 and status[STATUS_SEEN] == 4, status
    assert status[STATUS_CALL] == 5, status
    np.testing.assert_array_equal(gated, np.ones(E, np.int32))


@pytest.mark.gpu
@requires_gpu
def test_a_recorded_failure_gates_later_calls_without_publishing():
    pads = Pads()
    log_to_phys, replica_count = random_placement(np.random.default_rng(4), E, K)
    pads.status[STATUS_KIND] = AGREE_MISMATCH
    pads.status[STATUS_CALL] = 1
    start = time.monotonic()
    gated, status = pads.run(log_to_phys, replica_count, 2, timeout_s=30.0)  # no peer published: no wait either
    assert time.monotonic() - start < 5
    assert status[STATUS_KIND] == AGREE_MISMATCH and status[STATUS_CALL] == 1, status
    np.testing.assert_array_equal(gated, np.ones(E, np.int32))
    assert all(int(pads.slots(peer).get()[RANK]) == 0 for peer in range(WORLD)), "a gated call published"
