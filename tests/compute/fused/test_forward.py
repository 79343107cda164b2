"""The fused MoE layer: its task semantics (``ultraep.compute.fused.forward``) bitwise the
sequential path over random routings, empty experts, every token to one expert and 1, 2,
4 ranks, whatever the CTAs per rank and the interleaving of their claims and of their relay
workers' (kernel A's relays, a stream of their own); an order that lets a consumer be
claimed before its producer is refused and can deadlock; and
``MoELayer(fused=True)`` on 1, 2 and 4 ranks (host in CI, the CUDA kernels on a GPU)
bitwise the sequential layer, forward and backward, identical over repeated runs."""

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.compute.fused.forward import (FusedDeadlock, FusedLayer, Granularity, arrival_tables, check_order,
                                           max_m_tiles, max_tasks, run_rank, sequential_forward, simulate, task_order)
from ultraep.integration.moe_layer import swiglu
from ultraep.runtime.dtypes import BFLOAT16

SMALL = Granularity(send_tokens=3, reduce_tokens=2, bm=4, up_cols=8, down_cols=16, group_m=2, bands=3)


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


@pytest.mark.parametrize("routing", ["random", "one-expert", "empty-experts"])
def test_the_set_up_bounds_hold_every_task_and_tile(routing):
    """The device sizes its flags and timeline from max_m_tiles / max_tasks at set-up: no
    routing within the receive bound may exceed them (a write past them would corrupt)."""
    ranks, slots, tokens, top_k = 4, 3, 50, 4
    xs, ids, gates, w_up, w_down = problem(ranks, slots, tokens, top_k, hidden=40, ffn=24, routing=routing, seed=9)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    for r, (a, b) in enumerate(layer.tasks):
        rows = int(layer.plans[r].offsets[r][-1])  # the tightest receive bound this routing passes
        bound_a, bound_b = max_tasks(max_tokens=tokens, max_recv_rows=rows, slots_per_rank=slots, hidden=40, ffn=24,
                                     grain=SMALL)
        assert len(a) <= bound_a and len(b) <= bound_b
        assert layer.plans[r].mtiles[r][-1] <= max_m_tiles(rows, slots, SMALL)


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
    for a, b in layer.tasks:  # reduces claimed before the down tiles whose done flags they wait for
        bad.append((a, [t for t in b if t.kind == "reduce"] + [t for t in b if t.kind != "reduce"]))
    with pytest.raises(FusedDeadlock, match="not claimed before it"):
        check_order(layer, bad)
    with pytest.raises(FusedDeadlock, match="no CTA can go on"):
        simulate(layer, [1, 1], np.random.default_rng(0), bad)


@pytest.mark.parametrize("seed", range(6))
def test_senders_send_while_the_other_ctas_start_up_tiles(seed):
    """Only the first senders[r] CTAs of a rank send first; the others take the next up tile
    once its rows are relayed, else a send while any is left. Up tiles listed before the
    sends, one sender or none among several CTAs, or every CTA a sender: no deadlock, the
    same bits."""
    xs, ids, gates, w_up, w_down = problem(4, 2, 11, 3, seed=seed)
    expected = bits(sequential_forward(xs, ids, gates, w_up, w_down, swiglu))
    rng = np.random.default_rng(seed)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    early = [([t for t in a if t.kind == "up"] + [t for t in a if t.kind != "up"], b) for a, b in layer.tasks]
    ctas = [int(c) for c in rng.integers(1, 5, size=4)]
    senders = [int(rng.integers(0, c + 1)) for c in ctas]  # none at all included: the others still send
    check_order(layer, early)
    got = bits(simulate(layer, ctas, rng, early, senders=senders))
    assert all(np.array_equal(g, e) for g, e in zip(got, expected)), f"{ctas} CTAs, {senders} senders"
    # no sender at all: every send is claimed by CTAs whose next tile's rows are not there yet
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    got = bits(simulate(layer, [2] * 4, rng, senders=[0] * 4))
    assert all(np.array_equal(g, e) for g, e in zip(got, expected)), "no sender"


def test_arrival_tables_order_the_m_tiles_by_band_then_slot():
    """Rank 0's two slots, rows from two sources: slot 0 holds 8 + 8 rows, slot 1 4 + 0.
    With 4-row M-tiles and 2 bands, slot 0's tiles end 4/8, 8/8, 4/8, 8/8 into their
    source's rows (bands 0 1 0 1) and slot 1's 4/4 (band 1)."""
    table = np.array([[8, 4, 3, 3], [8, 0, 5, 5]])
    arrival = arrival_tables(table, 2, 0, bm=4, bands=2)
    # runs (band 0, slot 0) (band 0, slot 1) (band 1, slot 0) (band 1, slot 1): 2, 0, 2, 1 M-tiles
    assert arrival.tolist() == [0, 2, 2, 4, 5] + [0, 2, 1, 3, 4]
    # M-tile 0 holds source 0's 2 rows and source 1's first 2 of 8: it waits for source 0's
    # last row, the last band (3), not its rows of source 1 (band 0); M-tiles 1, 2: 6/8, 8/8
    assert arrival_tables(np.array([[2, 0], [8, 0]]), 1, 0, bm=4, bands=4).tolist() == [0, 0, 0, 1, 3] + [1, 0, 2]


@pytest.mark.parametrize("routing", ["random", "one-expert", "empty-experts"])
def test_arrival_order_holds_every_m_tile_once_and_follows_the_tiles(routing):
    xs, ids, gates, w_up, w_down = problem(4, 3, 40, 3, routing=routing, seed=4)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    for r, plan in enumerate(layer.plans):
        runs = SMALL.bands * 3
        starts, order = plan.arrival[:runs + 1], plan.arrival[runs + 1:]
        assert np.all(np.diff(starts) >= 0) and starts[-1] == order.size == plan.mtiles[r][-1]
        assert sorted(order.tolist()) == list(range(order.size))
        relays = [layer._mtile(r, t.a, t.m) for t in layer.tasks[r][0] if t.kind == "relay"]
        assert relays == order.tolist()
        first_ups = list(dict.fromkeys(layer._mtile(r, t.a, t.m) for t in layer.tasks[r][0] if t.kind == "up"))
        assert first_ups == order.tolist()  # each run's M-tiles in order, group by group (group_m=2 here)


def test_the_relays_are_a_stream_of_their_own():
    """The relay workers claim the relays from a counter of their own: wherever they stand
    in the list, the CTAs' claims (sends, then up tiles) cannot starve them, one CTA a rank
    suffices and the result keeps its bits."""
    xs, ids, gates, w_up, w_down = problem(2, 2, 10, 2, seed=1)
    expected = bits(sequential_forward(xs, ids, gates, w_up, w_down, swiglu))
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    late = [([t for t in a if t.kind != "relay"] + [t for t in a if t.kind == "relay"], b) for a, b in layer.tasks]
    check_order(layer, late)
    got = bits(simulate(layer, [1, 1], np.random.default_rng(0), late))
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))


def test_one_rank_runs_its_claims_and_relays_in_one_interleaving():
    """run_rank (the host backend's one CTA): the sends, the relays its relay worker runs,
    then the up tiles; bitwise the sequential path."""
    xs, ids, gates, w_up, w_down = problem(1, 3, 20, 2, seed=6)
    layer = FusedLayer.simulation(xs, ids, gates, w_up, w_down, swiglu, grain=SMALL)
    timeline = []
    for r in range(layer.ranks):
        run_rank(layer, r, timeout_s=1.0, timeline=timeline)
    kinds = [kind for kind, *_ in timeline]
    assert kinds == sorted(kinds, key=("send", "relay", "up", "down", "reduce").index)
    assert set(kinds) == {"send", "relay", "up", "down", "reduce"}
    expected = bits(sequential_forward(xs, ids, gates, w_up, w_down, swiglu))
    assert all(np.array_equal(g, e) for g, e in zip(bits(layer.outputs()), expected))


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
    out = run_ranks(ranks, "compute/fused/mpi/forward_check.py", backend, "bitwise", runs, timeout=600)
    assert_all_ranks_ok(out, ranks, "bitwise")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_layer_refuses_bad_ids_on_every_rank(backend):
    out = run_ranks(2, "compute/fused/mpi/forward_check.py", backend, "bad-input", timeout=240)
    assert_all_ranks_ok(out, 2, "bad-input")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_that_sends_nothing_makes_every_rank_time_out(backend):
    out = run_ranks(2, "compute/fused/mpi/forward_check.py", backend, "peer-fails", timeout=240)
    assert_all_ranks_ok(out, 2, "peer-fails")


def _layers_on_one_gpu(hidden, ffn, experts, top_k, tokens, fused_config=None):
    """The sequential and the fused layer on one GPU; ``fused_config(ctas)``: the fused
    layer's FusedConfig for the CTAs this process may keep resident (default: the layer's)."""
    from mpi4py import MPI

    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.sm_partition import usable_sms

    group = EPGroup(MPI.COMM_SELF, use_gpu=True)
    config = None if fused_config is None else fused_config(usable_sms(group.device))
    return [MoELayer(group, hidden=hidden, ffn=ffn, num_experts=experts, top_k=top_k, max_tokens=tokens,
                     backend="device", fused=fused, fused_config=config if fused else None)
            for fused in (False, True)]


def _on_gpu(array):
    """A host array on the GPU (BF16 crosses as its bits)."""
    import cupy

    if array.dtype == BFLOAT16:
        return cupy.asarray(array.view(np.int16)).view(BFLOAT16)
    return cupy.asarray(array)


def _bits(array):
    """The bit patterns of a BF16 (int16) or FP32 (int32) array: NaN patterns compare too."""
    return array.view(np.int16 if array.dtype.itemsize == 2 else np.int32)


def _first_difference(got, want, what):
    rows, cols = np.nonzero(got != want)
    return f"{what}: {rows.size} elements differ, first at row {rows[0]}, column {cols[0]}" if rows.size else ""


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("hidden,ffn,experts,tokens,routing", [
    (256, 128, 4, 64, "random"),            # whole column blocks, one M-tile per expert
    (272, 200, 5, 700, "random"),           # partial column blocks (H, F), several M-tiles per expert
    (512, 72, 6, 300, "empty-experts"),     # F below one box: the up tile's gate and up halves one box each
    (136, 264, 3, 500, "one-expert"),       # every token's first slot on one expert
])
def test_fused_kernels_stage_by_stage_on_one_gpu(hidden, ffn, experts, tokens, routing):
    """One rank: the fused kernels' receive rows, act (kernel A) and output (kernel B) each
    bitwise the sequential layer's, and the same bits over 10 runs; the memory pool and the
    heap's expert rows hold NaN patterns before every fused forward."""
    import cupy

    top_k = 2
    rng = np.random.default_rng(hidden + ffn)
    sequential, fused = _layers_on_one_gpu(hidden, ffn, experts, top_k, tokens)
    try:
        w_up = _on_gpu(bf16(rng, (experts, hidden, 2 * ffn), hidden ** -0.5))
        w_down = _on_gpu(bf16(rng, (experts, ffn, hidden), ffn ** -0.5))
        for moe in (sequential, fused):
            moe.load_weights(w_up, w_down)
        if routing == "empty-experts":
            ids = 2 * rng.integers(0, (experts + 1) // 2, size=(tokens, top_k))
        elif routing == "one-expert":
            ids = np.stack([np.full(tokens, experts - 1), rng.integers(0, experts - 1, size=tokens)], axis=1)
        else:
            ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        x, ids = _on_gpu(bf16(rng, (tokens, hidden))), cupy.asarray(ids.astype(np.int64))
        gates = cupy.asarray(rng.random((tokens, top_k)).astype(np.float32))
        y, ctx = sequential.forward(x, ids, gates)
        rows = ctx.received.num_rows
        kept = (ctx.received.x[:rows], ctx.act[:rows], y, ctx.h[:rows], ctx.y[:rows])
        want = [_bits(cupy.asnumpy(a)) for a in kept]
        first = None
        for run in range(10):
            poison = [cupy.full(n, 0x7FC1, dtype=np.int16)
                      for n in (rows * hidden, rows * ffn, tokens * hidden, 4 * rows * ffn, rows * hidden)]
            del poison  # back to the pool: the fused forward's buffers start as NaN patterns
            fused.dispatcher.expert_output().view(np.int16).fill(0x7FC1)
            y_fused, ctx_fused = fused.forward(x, ids, gates)
            fused.check()
            kept = (ctx_fused.received.x[:rows], ctx_fused.act[:rows], y_fused, ctx_fused.h[:rows], ctx_fused.y[:rows])
            got = [_bits(cupy.asnumpy(a)) for a in kept]
            stages = ("receive rows (relay)", "act (up tiles)", "output (down + reduce)", "h kept (up tiles, FP32)",
                      "y kept (down tiles, copied out of the heap)")
            problems = [p for p in map(_first_difference, got, want, stages) if p]
            assert not problems, f"run {run}: " + "; ".join(problems)
            if first is None:
                first = got
            assert all(np.array_equal(g, f) for g, f in zip(got, first)), f"run {run} differs from run 0"
    finally:
        for moe in (sequential, fused):
            moe.close()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("senders", ["none", "one", "half"])
def test_every_share_of_senders_gives_the_sequential_bits_on_one_gpu(senders):
    """One rank, kernels A and C with fewer senders than CTAs (none: every block takes a tile
    once its rows are relayed and sends while they are not): output, input and gate
    gradients and weight gradients bitwise the sequential layer's, over 3 runs."""
    import cupy

    from ultraep.compute.fused.config import FusedConfig

    hidden, ffn, experts, top_k, tokens = 256, 128, 4, 2, 3000
    count = {"none": lambda ctas: 0, "one": lambda ctas: 1, "half": lambda ctas: ctas // 2}[senders]
    rng = np.random.default_rng(5)
    layers = _layers_on_one_gpu(hidden, ffn, experts, top_k, tokens,
                                fused_config=lambda ctas: FusedConfig(ctas, send_ctas=count(ctas)))
    try:
        config = layers[1]._fused.schedule.for_tokens(tokens)
        assert config.send_ctas == count(config.ctas)
        w_up = _on_gpu(bf16(rng, (experts, hidden, 2 * ffn), hidden ** -0.5))
        w_down = _on_gpu(bf16(rng, (experts, ffn, hidden), ffn ** -0.5))
        ids = cupy.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int64))
        x, dy = _on_gpu(bf16(rng, (tokens, hidden))), _on_gpu(bf16(rng, (tokens, hidden)))
        gates = cupy.asarray(rng.random((tokens, top_k)).astype(np.float32))
        results = []
        for moe in layers * 3:  # the sequential layer, then the fused one, three times
            moe.load_weights(w_up, w_down)
            moe.zero_grads()
            y, ctx = moe.forward(x, ids, gates)
            dx, d_gates = moe.backward(ctx, dy)
            moe.check()
            results.append([_bits(cupy.asnumpy(a)) for a in (y, dx, d_gates, moe.grad_up, moe.grad_down)])
        names = ("output", "dx", "d_gates", "grad_up", "grad_down")
        for run, got in enumerate(results[1:], 1):
            problems = [f"{name}: {np.count_nonzero(g != w)} differ" for name, g, w in zip(names, got, results[0])
                        if not np.array_equal(g, w)]
            assert not problems, f"{senders} senders, pass {run}: " + "; ".join(problems)
    finally:
        for moe in layers:
            moe.close()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("skip,flag", [("sends", "row_flag"), ("down tiles", "done")])
def test_every_fused_wait_is_bounded_and_names_its_flag(skip, flag):
    """One rank whose kernels start past their producers' tasks (claim counters preset):
    the consumers give up after the layer's timeout and the record names the flag."""
    import cupy
    from mpi4py import MPI

    from ultraep.compute.fused.device import B_COUNTER
    from ultraep.errors import WaitTimeout
    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.kernels import kernel_constant

    H, F, E, K, T = 256, 128, 4, 2, 200
    group = EPGroup(MPI.COMM_SELF, use_gpu=True)
    rng = np.random.default_rng(0)
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend="device", fused=True,
                  timeout_s=1.0, sync_checks=False) as moe:
        moe.load_weights(_on_gpu(bf16(rng, (E, H, 2 * F))), _on_gpu(bf16(rng, (E, F, H))))
        launcher, plan = moe._fused, moe._fused.k["fused_plan"]
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]
        counts = np.bincount(ids.ravel(), minlength=E)
        bm = kernel_constant("fused_moe.cu", "FM_BM")
        down_tiles = int(sum(-(-c // bm) for c in counts)) * -(-H // kernel_constant("fused_moe.cu", "FM_DOWN_COLS"))

        def plan_then_skip(*args, **kwargs):
            plan(*args, **kwargs)
            if skip == "sends":
                launcher.counters[kernel_constant("fused_moe.cu", "FM_SEND_COUNTER")] = -(
                    -T // launcher.schedule.for_tokens(T).send_tokens)
            else:
                launcher.counters[B_COUNTER] = down_tiles  # kernel B's claims, after kernel A's counters
        launcher.k["fused_plan"] = plan_then_skip
        x = _on_gpu(bf16(rng, (T, H)))
        moe.forward(x, cupy.asarray(ids.astype(np.int64)), cupy.asarray(rng.random((T, K)).astype(np.float32)))
        with pytest.raises(WaitTimeout, match=flag):
            moe.check()


def test_a_forward_without_backward_keeps_nothing_and_its_context_refuses_one():
    """backward=False (inference): the same output bits, no h or y kept, and a backward on
    that context is refused with a message; a training context of the same layer still works."""
    from mpi4py import MPI

    from ultraep.errors import MoELayerError
    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.group import EPGroup

    H, F, E, K, T = 256, 128, 4, 2, 40
    rng = np.random.default_rng(7)
    group = EPGroup(MPI.COMM_SELF, use_gpu=False)
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend="host", fused=True) as moe:
        moe.load_weights(bf16(rng, (E, H, 2 * F), H ** -0.5), bf16(rng, (E, F, H), F ** -0.5))
        x, dy = bf16(rng, (T, H)), bf16(rng, (T, H))
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
        gates = rng.random((T, K)).astype(np.float32)
        y_train, ctx_train = moe.forward(x, ids, gates)
        y_infer, ctx_infer = moe.forward(x, ids, gates, backward=False)
        assert np.array_equal(y_infer.view(np.int16), y_train.view(np.int16))
        assert ctx_infer.h is None and ctx_infer.y is None and ctx_train.h is not None
        with pytest.raises(MoELayerError, match="backward=False"):
            moe.backward(ctx_infer, dy)
        moe.backward(ctx_train, dy)
