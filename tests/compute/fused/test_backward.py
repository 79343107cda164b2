"""The fused MoE backward: its task semantics (``ultraep.compute.fused.backward``)
bitwise the sequential backward (dx, d_gates, and the grad_y / dh rows the weight
gradients are computed from) over random routings, empty experts, every token to one
expert and 1, 2, 4 ranks, whatever the CTAs per rank and the interleaving of their
claims; an order that lets a consumer be claimed before its producer is refused and can
deadlock; and ``MoELayer(fused=True)``'s backward on 1, 2 and 4 ranks (host in CI, the
CUDA kernels on a GPU) bitwise the sequential layer's, two micro-batches' backwards in
reverse order bitwise their forward/backward pairs, bounded waits (a peer that sends
nothing, a peer that never enters the backward) and a recorded backward's timeline."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, requires_gpu, run_ranks
from tests.compute.fused.test_forward import CASES, SMALL, _first_difference, _layers_on_one_gpu, _on_gpu, bf16, problem
from ultraep.compute.fused.backward import (KERNEL_C, KERNEL_D, KINDS, FusedBackward, granularity, max_tasks,
                                            sequential_backward, sequential_rows, task_order)
from ultraep.compute.fused.forward import FusedDeadlock, Granularity, check_order, plan_ranks, simulate
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
    assert layer.grain == granularity()
    check_order(layer)
    simulate(layer, [2, 3], np.random.default_rng(0))
    assert_bitwise(layer, sequential_backward(*data, swiglu_backward), "kernel granularity")


def test_the_backward_kernels_index_the_forward_flags_alike():
    """The heap's done flags and tile_ready are sized and indexed by the forward's M-tiles
    and output column blocks; the backward's must be the same."""
    forward, backward = Granularity.kernel(), granularity()
    assert (backward.bm, backward.down_cols) == (forward.bm, forward.down_cols)


@pytest.mark.parametrize("routing", ["random", "one-expert", "empty-experts"])
def test_the_timeline_bounds_hold_every_backward_task(routing):
    """The device sizes the backward's trace buffers by max_tasks at set-up: no routing
    within the receive bound may have more tasks (a stamp past them would corrupt)."""
    ranks, slots, tokens, top_k, hidden, ffn = 4, 3, 700, 4, 520, 264  # several M-tiles, partial column blocks
    ids = problem(ranks, slots, tokens, top_k, hidden, ffn, routing, seed=9)[1]
    for r, plan in enumerate(plan_ranks(ids, slots, granularity())):
        rows = int(plan.offsets[r][-1])  # the tightest receive bound this routing passes
        c, d = task_order(plan, ffn, hidden, granularity())
        bound_c, bound_d = max_tasks(max_tokens=tokens, max_recv_rows=rows, slots_per_rank=slots, hidden=hidden,
                                     ffn=ffn)
        assert len(c) <= bound_c and len(d) <= bound_d


def test_the_timeline_names_every_backward_kind_once():
    assert sorted(KINDS.values()) == sorted(KERNEL_C + KERNEL_D)


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


def test_reduces_claimed_before_their_dgrad_up_tiles_are_refused_and_deadlock():
    data = backward_problem(2, 2, 10, 2, seed=1)
    layer = simulation(*data, grain=SMALL)
    bad = [(c, [t for t in d if t.kind != "dgrad_up"] + [t for t in d if t.kind == "dgrad_up"]) for c, d in layer.tasks]
    with pytest.raises(FusedDeadlock, match="not claimed before it"):
        check_order(layer, bad)
    with pytest.raises(FusedDeadlock, match="no CTA can go on"):
        simulate(layer, [1, 1], np.random.default_rng(0), bad)


@pytest.mark.parametrize("senders", [[1, 1], [0, 0]])
def test_dgrad_down_tiles_listed_before_the_sends_still_finish(senders):
    """Kernel C's sends are a stream of their own: wherever its tiles stand in the list, one
    sender a rank or none (the others send while their next tile waits) sends everything,
    and the result keeps its bits."""
    data = backward_problem(2, 2, 10, 2, seed=1)
    layer = simulation(*data, grain=SMALL)
    early = [([t for t in c if t.kind == "dgrad_down"] + [t for t in c if t.kind != "dgrad_down"], d)
             for c, d in layer.tasks]
    check_order(layer, early)
    simulate(layer, [3, 2], np.random.default_rng(0), early, senders=senders)
    assert_bitwise(layer, sequential_backward(*data, swiglu_backward), "tiles listed first")


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
    out = run_ranks(ranks, "compute/fused/mpi/backward_check.py", backend, "bitwise", runs, timeout=600)
    assert_all_ranks_ok(out, ranks, "bitwise")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_two_forwards_then_their_backwards_in_reverse_give_the_pairs_bits(backend, ranks):
    """Each backward reads the rank tiles of its own forward, not the later forward's."""
    out = run_ranks(ranks, "compute/fused/mpi/backward_check.py", backend, "reverse-order", timeout=600)
    assert_all_ranks_ok(out, ranks, "reverse-order")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check,ranks", [("peer-fails", 2), ("peer-absent", 2), ("peer-absent", 3)])
def test_a_failing_peer_makes_every_backward_time_out(backend, check, ranks):
    """A peer that sends nothing (the kernels' flag waits give up) or never enters the
    backward (its opening barrier gives up): an error naming what was waited for, no hang."""
    out = run_ranks(ranks, "compute/fused/mpi/backward_check.py", backend, check, timeout=240)
    assert_all_ranks_ok(out, ranks, check)


def _poison_heap(moe):
    """NaN patterns in the heap rows a backward fills before it reads them."""
    local = moe.dispatcher._impl.local
    for rows in (local["landing"], local["slot_grad_w"], moe.dispatcher.expert_output()):
        rows.view(np.int16).fill(0x7FC1)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("hidden,ffn,experts,tokens,routing", [
    (256, 256, 4, 64, "random"),            # whole column blocks, one M-tile per expert
    (272, 200, 5, 700, "random"),           # partial column blocks (H, F), several M-tiles per expert
    (512, 72, 6, 300, "empty-experts"),     # F below one box
    (136, 264, 3, 500, "one-expert"),       # every token's first slot on one expert
])
def test_fused_backward_stage_by_stage_on_one_gpu(hidden, ffn, experts, tokens, routing):
    """One rank: kernel C's grad_y and dh rows and kernel D's dx and gate gradients each
    bitwise the sequential backward's on the GPU (combine_backward, grouped dgrad, SwiGLU
    backward, grouped dgrad, dispatch_backward), the same bits over 10 runs; the memory
    pool and the heap's landing rows, gate-gradient slots and expert rows hold NaN
    patterns before every fused backward."""
    import cupy

    from ultraep.compute import grouped_mm, grouped_mm_dgrad

    top_k = 2
    rng = np.random.default_rng(hidden + ffn + 1)
    layers = _layers_on_one_gpu(hidden, ffn, experts, top_k, tokens)
    moe = layers[1]  # the fused one; the sequential pieces run on its Dispatcher and weights
    try:
        moe.load_weights(_on_gpu(bf16(rng, (experts, hidden, 2 * ffn), hidden ** -0.5)),
                         _on_gpu(bf16(rng, (experts, ffn, hidden), ffn ** -0.5)))
        if routing == "empty-experts":
            ids = 2 * rng.integers(0, (experts + 1) // 2, size=(tokens, top_k))
        elif routing == "one-expert":
            ids = np.stack([np.full(tokens, experts - 1), rng.integers(0, experts - 1, size=tokens)], axis=1)
        else:
            ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        x, ids = _on_gpu(bf16(rng, (tokens, hidden))), cupy.asarray(ids.astype(np.int64))
        gates = cupy.asarray(rng.random((tokens, top_k)).astype(np.float32))
        dy = _on_gpu(bf16(rng, (tokens, hidden)))
        _, ctx = moe.forward(x, ids, gates)
        received, offsets, rows = ctx.received, ctx.received.offsets, ctx.received.num_rows
        h = grouped_mm(received.x, moe._w_up, offsets, out=cupy.empty((received.x.shape[0], 2 * ffn), np.float32))
        y = grouped_mm(ctx.act, moe._w_down, offsets)
        grad_y, d_gates = moe.dispatcher.combine_backward(dy, y, received.handle)
        dh = moe._swiglu_backward(h, grouped_mm_dgrad(grad_y, moe._w_down, offsets), offsets)
        d_recv = grouped_mm_dgrad(dh, moe._w_up, offsets, out=moe.dispatcher.expert_output())
        dx = moe.dispatcher.dispatch_backward(d_recv, received.handle)
        want = [cupy.asnumpy(a).view(np.int16 if a.dtype.itemsize == 2 else np.int32)
                for a in (grad_y[:rows], dh[:rows], dx, d_gates)]
        assert np.count_nonzero(want[2]) and np.isfinite(cupy.asnumpy(d_gates)).all()
        launcher, first = moe._fused_backward(), None
        for run in range(10):
            poison = [cupy.full(n, 0x7FC1, dtype=np.int16) for n in (rows * hidden, rows * 2 * ffn, tokens * hidden)]
            del poison  # back to the pool: the fused backward's buffers start as NaN patterns
            _poison_heap(moe)
            outputs = launcher.backward(dy, received, ctx.tile_plan, h, y, moe._w_up, moe._w_down)
            moe.check()
            dx_f, d_gates_f, grad_y_f, dh_f = outputs
            got = [cupy.asnumpy(a).view(np.int16 if a.dtype.itemsize == 2 else np.int32)
                   for a in (grad_y_f[:rows], dh_f[:rows], dx_f, d_gates_f)]
            stages = ("grad_y (relay)", "dh (dgrad-down tiles)", "dx (dgrad-up tiles + reduce)",
                      "d_gates (relay + reduce)")
            problems = [p for p in map(_first_difference, got, want, stages) if p]
            assert not problems, f"run {run}: " + "; ".join(problems)
            if first is None:
                first = got
            assert all(np.array_equal(g, f) for g, f in zip(got, first)), f"run {run} differs from run 0"
    finally:
        for layer in layers:
            layer.close()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("skip,flag", [("sends", "row_flag"), ("dgrad-up tiles", "done")])
def test_every_fused_backward_wait_is_bounded_and_names_its_flag(skip, flag):
    """One rank whose backward kernels start past their producers' tasks (claim counters
    preset): the consumers give up after the layer's timeout and the record names the flag."""
    import cupy
    from mpi4py import MPI

    from ultraep.errors import WaitTimeout
    from ultraep.compute.fused.backward import KERNELS
    from ultraep.compute.fused.device import B_COUNTER
    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.kernels import kernel_constant

    H, F, E, K, T = 256, 128, 4, 2, 200
    group = EPGroup(MPI.COMM_SELF, use_gpu=True)
    rng = np.random.default_rng(0)
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend="device", fused=True,
                  timeout_s=1.0, sync_checks=False) as moe:
        moe.load_weights(_on_gpu(bf16(rng, (E, H, 2 * F))), _on_gpu(bf16(rng, (E, F, H))))
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]
        counts = np.bincount(ids.ravel(), minlength=E)
        bm, cols = kernel_constant(KERNELS, "FB_BM"), kernel_constant(KERNELS, "FB_DOWN_COLS")
        _, ctx = moe.forward(_on_gpu(bf16(rng, (T, H))), cupy.asarray(ids.astype(np.int64)),
                             cupy.asarray(rng.random((T, K)).astype(np.float32)))
        moe.check()
        launcher = moe._fused_backward()
        name = "fused_grad_dispatch_dgrad" if skip == "sends" else "fused_dgrad_combine"
        # kernel C's sends, or kernel D's claims after C's counters
        counter = kernel_constant(KERNELS, "FM_SEND_COUNTER") if skip == "sends" else B_COUNTER
        start = (-(-T // kernel_constant(KERNELS, "FB_SEND_TOKENS")) if skip == "sends"
                 else int(sum(-(-c // bm) for c in counts)) * -(-H // cols))
        kernel = launcher.k[name]

        def skip_then_launch(*args, **kwargs):
            launcher.counters[counter] = start
            kernel(*args, **kwargs)
        launcher.k[name] = skip_then_launch
        moe.backward(ctx, _on_gpu(bf16(rng, (T, H))))
        with pytest.raises(WaitTimeout, match=flag):
            moe.check()


@pytest.mark.gpu
@requires_gpu
def test_a_recorded_device_backward_stamps_every_task():
    """One rank, recording switched on before the backward launcher exists: the recorded
    backward's timeline holds each task of both kernels once (as many of each kind as the
    task order has), every stamp from this call (no end before its start -- %globaltimer
    may tick slower than a short task --, within the call's wall time), on an SM of the
    device; the forward's timeline stays the forward's; switched off, nothing is recorded."""
    import os
    import time

    import cupy
    from mpi4py import MPI

    from ultraep.compute.fused.forward import KERNEL_A, KERNEL_B
    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.group import EPGroup

    H, F, E, K, T = 272, 200, 4, 2, 700  # partial column blocks, several M-tiles per expert
    group = EPGroup(MPI.COMM_SELF, use_gpu=True)
    rng = np.random.default_rng(4)
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend="device", fused=True) as moe:
        moe.load_weights(_on_gpu(bf16(rng, (E, H, 2 * F), H ** -0.5)), _on_gpu(bf16(rng, (E, F, H), F ** -0.5)))
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]
        data = (_on_gpu(bf16(rng, (T, H))), cupy.asarray(ids.astype(np.int64)),
                cupy.asarray(rng.random((T, K)).astype(np.float32)))
        moe.record_timeline(True)
        began = time.time_ns()
        _, ctx = moe.forward(*data)
        moe.backward(ctx, _on_gpu(bf16(rng, (T, H))))
        moe.check()
        wall = time.time_ns() - began
        tasks = moe.timeline("backward")
        grain = granularity()
        plan = plan_ranks([ids], E, grain)[0]
        want = [t.kind for order in task_order(plan, F, H, grain) for t in order]
        assert sorted(kind for kind, *_ in tasks) == sorted(want)
        assert set(want) == set(KERNEL_C + KERNEL_D)
        sms = cupy.cuda.runtime.getDeviceProperties(group.device)["multiProcessorCount"]
        first = min(start for _, start, _, _ in tasks)
        for kind, start, end, sm in tasks:
            assert first <= start <= end <= first + wall, (kind, start, end, first, wall)
            if "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ:  # under a share %smid is the physical SM
                assert sm < sms, (kind, sm, sms)
        assert sum(end - start for _, start, end, _ in tasks) > 0
        assert {kind for kind, *_ in moe.timeline()} == set(KERNEL_A + KERNEL_B)
        moe.record_timeline(False)
        _, ctx = moe.forward(*data)
        moe.backward(ctx, _on_gpu(bf16(rng, (T, H))))
        moe.check()
        assert moe.timeline("backward") == [] and moe.timeline() == []
