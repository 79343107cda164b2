"""The fused MoE backward: its task semantics (``ultraep.integration.fused_backward``)
bitwise the sequential backward (dx, d_gates, and the grad_y / dh rows the weight
gradients are computed from) over random routings, empty experts, every token to one
expert and 1, 2, 4 ranks, whatever the CTAs per rank and the interleaving of their
claims; an order that lets a consumer be claimed before its producer is refused and can
deadlock; and ``MoELayer(fused=True)``'s backward on 1, 2 and 4 ranks (host in CI, the
CUDA kernels on a GPU) bitwise the sequential layer's."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks
from tests.integration.test_fused import CASES, SMALL, bf16, problem
from ultraep.integration.fused import FusedDeadlock, Granularity, check_order, simulate
from ultraep.integration.fused_backward import (FusedBackward, sequential_backward, sequential_rows, task_order)
from ultraep.integration.moe_layer import swiglu, swiglu_backward
from ultraep.runtime.dtypes import BFLOAT16


def backward_problem(ranks, slots, tokens, top_k, hidden=40, ffn=24, routing="random", seed=0):
    xs, ids, gates, w_up, w_down = problem(ranks, slots, tokens, top_k, hidden, ffn, routing, seed)
    rng = np.random.default_rng(seed + 100)
    dys = [bf16(rng, (len(x), hidden)) for x in xs]
    rows = sequential_rows(xs, ids, w_up, w_down, swiglu)
    return dys, ids, gates, rows, w_up, w_down


def simulation(dys, ids, gates, rows, w_up, w_down, **kwargs):
    return FusedBackward.simulation(dys, ids, gates, [r["h"] for r in rows], [r["y"] for r in rows], w_up, w_down,
                                    swiglu_backward, **kwargs)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    width = {2: np.int16, 4: np.int32}[a.dtype.itemsize]
    return a.shape == b.shape and np.array_equal(a.view(width), b.view(width))


def assert_bitwise(layer, want, what):
    for r, (dx, d_gates, grad_y, dh) in enumerate(want):
        st = layer.state[r]
        rows = len(grad_y)
        for name, got, ref in (("dx", st.dx, dx), ("d_gates", st.d_gates, d_gates),
                               ("grad_y", st.grad_y[:rows], grad_y), ("dh", st.dh[:rows], dh)):
            assert same_bits(got, ref), f"rank {r} {name} differs from the sequential backward ({what})"


@pytest.mark.parametrize("ranks,slots,tokens,top_k,routing", CASES)
def test_fused_backward_is_bitwise_the_sequential_backward(ranks, slots, tokens, top_k, routing):
    data = backward_problem(ranks, slots, tokens, top_k, routing=routing, seed=ranks * 7 + slots)
    want = sequential_backward(*data, swiglu_backward)
    assert all(np.isfinite(dx.astype(np.float32)).all() and np.isfinite(g).all() for dx, g, _, _ in want)
    assert any(np.any(dx.astype(np.float32) != 0) for dx, *_ in want)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        layer = simulation(*data, grain=SMALL, epoch=seed + 1)
        check_order(layer)
        ctas = [int(c) for c in rng.integers(1, 4, size=ranks)]
        simulate(layer, ctas, rng)
        assert_bitwise(layer, want, f"{ctas} CTAs, interleaving {seed}")


def test_kernel_granularity_is_bitwise_the_sequential_backward():
    data = backward_problem(2, 2, 150, 4, hidden=24, ffn=16, seed=3)
    layer = simulation(*data)
    assert layer.grain == Granularity.kernel()
    check_order(layer)
    simulate(layer, [2, 3], np.random.default_rng(0))
    assert_bitwise(layer, sequential_backward(*data, swiglu_backward), "kernel granularity")


def test_the_order_puts_every_producer_before_its_consumers():
    data = backward_problem(2, 3, 20, 2, seed=5)
    layer = simulation(*data, grain=SMALL)
    c, d = layer.tasks[0]
    kinds_c = [t.kind for t in c]
    assert kinds_c == sorted(kinds_c, key=("send", "relay", "dgrad_down").index)
    assert set(kinds_c) == {"send", "relay", "dgrad_down"}
    kinds_d = [t.kind for t in d]
    assert kinds_d == sorted(kinds_d, key=("dgrad_up", "reduce").index)
    assert set(kinds_d) == {"dgrad_up", "reduce"}
    assert (c, d) == task_order(layer.plans[0], layer.ffn, layer.hidden, SMALL)


@pytest.mark.parametrize("swap", ["relay", "dgrad_up"])
def test_an_order_with_consumers_first_is_refused_and_deadlocks(swap):
    """dgrad_down tiles claimed before their relays, or reduces before the dgrad_up tiles."""
    data = backward_problem(2, 2, 10, 2, seed=1)
    layer = simulation(*data, grain=SMALL)
    bad = []
    for c, d in layer.tasks:
        if swap == "relay":
            bad.append(([t for t in c if t.kind != "relay"] + [t for t in c if t.kind == "relay"], d))
        else:
            bad.append((c, [t for t in d if t.kind != "dgrad_up"] + [t for t in d if t.kind == "dgrad_up"]))
    with pytest.raises(FusedDeadlock, match="not claimed before it"):
        check_order(layer, bad)
    with pytest.raises(FusedDeadlock, match="no CTA can go on"):
        simulate(layer, [1, 1], np.random.default_rng(0), bad)


def test_a_stale_epoch_is_never_taken_for_arrival():
    """Flags left at the forward's epoch of the same micro-batch: every wait still holds
    until this call sets it."""
    data = backward_problem(2, 2, 10, 2, seed=2)
    layer = simulation(*data, grain=SMALL, epoch=8)
    for state in layer.state:
        for flag in state.flags.values():
            flag[...] = 7
    simulate(layer, [2, 2], np.random.default_rng(1))
    assert_bitwise(layer, sequential_backward(*data, swiglu_backward), "stale flags")


def test_a_poisoned_input_row_shows_in_the_result():
    """The comparison can fail: a NaN in one y row reaches that pair's gate gradient."""
    dys, ids, gates, rows, w_up, w_down = backward_problem(2, 2, 10, 2, seed=4)
    layer = FusedBackward.simulation(dys, ids, gates, [r["h"] for r in rows], [r["y"] for r in rows], w_up,
                                     w_down, swiglu_backward, grain=SMALL)
    layer.state[1].y[0] = np.float32(np.nan)
    simulate(layer, [1, 1], np.random.default_rng(2))
    assert sum(int(np.isnan(st.d_gates).sum()) for st in layer.state) == 1
    assert all(np.isfinite(st.dx.astype(np.float32)).all() for st in layer.state)
    assert BFLOAT16 == layer.state[0].dx.dtype


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fused_backward_layer_is_bitwise_the_sequential_layer(backend, ranks):
    runs = "10" if backend == "device" else "2"
    out = run_ranks(ranks, "integration/mpi/fused_backward_check.py", backend, "bitwise", runs, timeout=600)
    assert_all_ranks_ok(out, ranks, "bitwise")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["host"])
def test_a_peer_that_sends_nothing_makes_every_backward_time_out(backend):
    out = run_ranks(2, "integration/mpi/fused_backward_check.py", backend, "peer-fails", timeout=240)
    assert_all_ranks_ok(out, 2, "peer-fails")
