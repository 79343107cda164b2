"""The token path's NumPy arithmetic against naive loops: the token map's stable positions,
the row plan, the single-send keys, and the fixed summation orders."""

import numpy as np
from hypothesis import given, settings, strategies as st

from ultraep.runtime.dtypes import BFLOAT16
from ultraep.token import reference as ref


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 5), max_size=200))
def test_stable_key_positions_match_a_loop(keys):
    positions, counts = ref.stable_key_positions(np.array(keys, dtype=np.int64), 6)
    seen = [0] * 6
    for i, key in enumerate(keys):
        assert positions[i] == (-1 if key < 0 else seen[key])
        if key >= 0:
            seen[key] += 1
    assert list(counts) == seen


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_plan_rows_matches_the_definition(ranks, experts_per_rank, data):
    experts = ranks * experts_per_rank
    table = np.array(data.draw(st.lists(st.lists(st.integers(0, 5), min_size=experts, max_size=experts),
                                        min_size=ranks, max_size=ranks)))
    for me in range(ranks):
        base, counts, offsets, totals = ref.plan_rows(table, experts_per_rank, me)
        for r in range(ranks):
            row = 0  # walk rank r's buffer: expert, then source
            for j in range(experts_per_rank):
                e = r * experts_per_rank + j
                if r == me:
                    assert offsets[j] == row and counts[j] == table[:, e].sum()
                for s in range(ranks):
                    if s == me:
                        assert base[e] == row
                    row += table[s, e]
            assert totals[r] == row
        assert offsets[-1] == totals[me]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.data())
def test_pair_rows_are_the_definitions_receive_rows(ranks, experts_per_rank, top_k, data):
    """base[e] + the pair's stable position among its source's pairs to e is the row the
    sequential reference gives it: a push of each pair lands where the expansion puts it.
    Sources may send nothing and experts receive nothing."""
    experts = ranks * experts_per_rank
    ids = [np.array(data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=top_k, max_size=top_k),
                                       max_size=6)), dtype=np.int64).reshape(-1, top_k) for _ in range(ranks)]
    want, _, _ = ref.sequential_rows(ids, experts_per_rank)
    table = np.stack([np.bincount(i.ravel(), minlength=experts) for i in ids])
    for me in range(ranks):
        base = ref.plan_rows(table, experts_per_rank, me)[0]
        positions, _ = ref.stable_key_positions(ids[me].ravel(), experts)
        assert ref.pair_rows(base, ids[me], positions).tolist() == want[me].ravel().tolist()


def test_route_keys_single_send_per_rank():
    ids = np.array([[0, 1, 4, 5], [7, 6, 2, 7], [3, 3, 3, 3]])
    keys = ref.route_keys(ids, experts_per_rank=2, num_experts=8)
    assert keys[0].tolist() == ids.ravel().tolist()
    # ranks:  [0,0,2,2] [3,3,1,3] [1,1,1,1]: the first slot per rank sends
    assert keys[1].tolist() == [8, -1, 10, -1, 11, -1, 9, -1, 9, -1, -1, -1]
    assert ref.first_slot_of_rank(ids, 2).tolist() == [[0, 0, 2, 2], [0, 0, 2, 0], [0, 0, 0, 0]]


def test_slot_sum_is_sequential_fp32():
    rng = np.random.default_rng(0)
    slots = rng.standard_normal((5, 3, 16)).astype(np.float32).astype(BFLOAT16)
    w = rng.random((5, 3)).astype(np.float32)
    got = ref.slot_sum(slots, w, np.float32)
    for t in range(5):
        for h in range(16):
            acc = np.float32(0)
            for k in range(3):
                acc = np.float32(acc + np.float32(w[t, k] * np.float32(slots[t, k, h])))
            assert got[t, h].tobytes() == acc.tobytes()


def test_lane_dot_follows_the_warp_order():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 200)).astype(np.float32)   # 200 = not a multiple of 32 * 4
    b = rng.standard_normal((3, 200)).astype(np.float32)
    got = ref.lane_dot(a, b)
    for i in range(3):
        lanes = [np.float32(0)] * 32
        for h in range(200):
            lane = (h // 4) % 32
            lanes[lane] = np.float32(lanes[lane] + np.float32(a[i, h] * b[i, h]))
        for offset in (16, 8, 4, 2, 1):
            lanes = [np.float32(lanes[l] + lanes[l ^ offset]) for l in range(32)]
        assert got[i].tobytes() == lanes[0].tobytes()
    assert np.allclose(got, (a.astype(np.float64) * b).sum(axis=1), rtol=1e-5)


def test_the_fp32_arithmetic_flushes_subnormals_as_the_device_does():
    """CuPy compiles the kernels with -ftz=true: a subnormal operand or result of an FP32
    multiply or add is a zero of its sign there, so in slot_sum, lane_dot and
    weighted_rows too; normal values pass unchanged."""
    tiny = np.finfo(np.float32).tiny
    slots = np.array([[[tiny / 2, 1.0], [tiny / 4, 2.0]]], np.float32)  # [T 1, K 2, H 2]
    assert ref.slot_sum(slots, None, np.float32).tolist() == [[0.0, 3.0]]  # tiny/2 + tiny/4 would stay subnormal
    weights = np.array([[tiny / 2, 0.5]], np.float32)  # a subnormal gate reads as 0
    assert ref.slot_sum(slots, weights, np.float32).tolist() == [[0.0, 1.0]]
    rows = np.array([[1.5 * tiny, -3.0]], np.float32)
    got = ref.weighted_rows(np.array([0.5], np.float32), rows)  # 0.75 tiny is subnormal: -> +0
    assert got.tolist() == [[0.0, -1.5]] and not np.signbit(got[0, 0])
    a = np.zeros((1, 64), np.float32)
    a[0, 0], a[0, 1] = 1.5 * tiny, -1.25 * tiny  # each product normal, their sum subnormal
    b = np.ones((1, 64), np.float32)
    assert ref.lane_dot(a, b).tolist() == [0.0]
    assert ref.lane_dot(a * 0 + 2, b).tolist() == [128.0]
