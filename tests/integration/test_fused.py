"""The fused MoE layer: its task semantics (``ultraep.integration.fused``) bitwise the
sequential path over random routings, empty experts, every token to one expert and 1, 2,
4 ranks, whatever the CTAs per rank and the interleaving of their claims; an order that
lets a consumer be claimed before its producer is refused and can deadlock; and
``MoELayer(fused=True)`` on 1, 2 and 4 ranks (host in CI, the CUDA kernels on a GPU)
bitwise the sequential layer, forward and backward, identical over repeated runs."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks
from ultraep.integration.fused import (FusedDeadlock, FusedLayer, Granularity, check_order, sequential_forward,
                                       simulate, task_order)
from ultraep.integration.moe_layer import swiglu
from ultraep.runtime.dtypes import BFLOAT16

SMALL = Granularity(send_tokens=3, reduce_tokens=2, bm=4, up_cols=8, down_cols=16)


def bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BFLOAT16)


def problem(ranks, slots, tokens, top_k, hidden=40, ffn=24, routing="random", seed=0):
    rng = np.random.default_rng(seed)
    E = ranks * slots
    xs, ids, gates = [], [], []
    for r in range(ranks):
        T = tokens[r] if isinstance(tokens, list) else tokens
        xs.append(bf16(rng, (T, hidden)))
        if routing == "one-expert":
            choice = np.full((T, top_k), E - 1)
            if top_k > 1:  # a token's other slots still go somewhere, the same expert included
                choice[:, 1:] = rng.integers(0, E, size=(T, top_k - 1))
            choice[:, 0] = E - 1
        elif routing == "empty-experts":  # only even experts get tokens
            choice = 2 * rng.integers(0, (E + 1) // 2, size=(T, top_k))
        else:
            choice = rng.integers(0, E, size=(T, top_k))
        ids.append(choice)
        gates.append(rng.random((T, top_k)).astype(np.float32))
    w_up = [bf16(rng, (slots, hidden, 2 * ffn), 0.2) for _ in range(ranks)]
    w_down = [bf16(rng, (slots, ffn, hidden), 0.2) for _ in range(ranks)]
    return xs, ids, gates, w_up, w_down


def bits(arrays):
    return [a.view(np.int16) for a in arrays]


CASES = [
    (1, 3, 10, 2, "random"),
    (2, 2, 13, 3, "random"),
    (2, 3, [9, 0], 2, "random"),          # a rank with no tokens
    (4, 2, 11, 4, "random"),
    (4, 3, 7, 2, "empty-experts"),
    (2, 4, 12, 1, "one-expert"),          # every token to the last expert
    (4, 2, 9, 3, "one-expert"),
]


@pytest.mark.parametrize("ranks,slots,tokens,top_k,routing", CASES)
def test_fused_forward_is_bitwise_the_sequential_path(ranks, slots, tokens, top_k, routing):
    xs, ids, gates, w_up, w_down = problem(ranks, slots, tokens, top_k, routing=routing, seed=ranks * 7 + slots)
    expected = bits(sequential_forward(xs, ids, gates, w_up, w_down, swiglu))
    assert all(np.isfinite(e.view(BFLOAT16).astype(np.float32)).all() for e in expected)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL, epoch=seed + 1)
        check_order(layer)
        ctas = [int(c) for c in rng.integers(1, 5, size=ranks)]
        got = bits(simulate(layer, ctas, rng))
        for r in range(ranks):
            assert np.array_equal(got[r], expected[r]), f"rank {r}, {ctas} CTAs, interleaving {seed}"


def test_kernel_granularity_is_bitwise_the_sequential_path():
    xs, ids, gates, w_up, w_down = problem(2, 2, 150, 4, hidden=24, ffn=16, seed=3)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu)
    assert layer.grain == Granularity.kernel()
    check_order(layer)
    got = simulate(layer, [2, 3], np.random.default_rng(0))
    expected = sequential_forward(xs, ids, gates, w_up, w_down, swiglu)
    assert all(np.array_equal(g, e) for g, e in zip(bits(got), bits(expected)))


def test_the_order_puts_every_producer_before_its_consumers():
    xs, ids, gates, w_up, w_down = problem(2, 3, 20, 2, seed=5)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    a, b = layer.tasks[0]
    kinds_a = [t.kind for t in a]
    assert kinds_a == sorted(kinds_a, key=("send", "relay", "up").index)
    kinds_b = [t.kind for t in b]
    assert kinds_b == sorted(kinds_b, key=("down", "reduce").index)
    assert a == task_order(layer.plans[0], layer.ffn, layer.hidden, SMALL)[0]


def test_an_order_with_consumers_first_is_refused_and_deadlocks():
    xs, ids, gates, w_up, w_down = problem(2, 2, 10, 2, seed=1)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    bad = []
    for a, b in layer.tasks:  # up tiles claimed before the relays they wait for
        bad.append(([t for t in a if t.kind != "relay"] + [t for t in a if t.kind == "relay"], b))
    with pytest.raises(FusedDeadlock, match="not claimed before it"):
        check_order(layer, bad)
    with pytest.raises(FusedDeadlock, match="no CTA can go on"):
        simulate(layer, [1, 1], np.random.default_rng(0), bad)


def test_a_stale_epoch_is_never_taken_for_arrival():
    """Flags left at an earlier call's epoch: every wait still holds until this call sets it."""
    xs, ids, gates, w_up, w_down = problem(2, 2, 10, 2, seed=2)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL, epoch=7)
    for state in layer.state:
        for flag in state.flags.values():
            flag[...] = 6
    got = simulate(layer, [2, 2], np.random.default_rng(1))
    expected = sequential_forward(xs, ids, gates, w_up, w_down, swiglu)
    assert all(np.array_equal(g, e) for g, e in zip(bits(got), bits(expected)))


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fused_layer_is_bitwise_the_sequential_layer(backend, ranks):
    runs = "10" if backend == "device" else "2"
    out = run_ranks(ranks, "integration/mpi/fused_check.py", backend, "bitwise", runs, timeout=600)
    assert_all_ranks_ok(out, ranks, "bitwise")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_refuses_bad_ids_on_every_rank(backend):
    out = run_ranks(2, "integration/mpi/fused_check.py", backend, "bad-input", timeout=240)
    assert_all_ranks_ok(out, 2, "bad-input")
