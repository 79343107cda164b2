"""Multi-rank MoELayer check, run under mpiexec by tests/integration/test_moe_layer.py.

Usage: python -m mpi4py moe_layer_check.py {host|device} {invariance|no-replica|bad-input}

invariance: two MoE layers sharing one Balancer (``ultraep`` policy) and the same two
layers without one (``none``), with the same masters, inputs and skewed routing, two
micro-batches in flight per layer (forward a, forward b, backward in reverse: b's
backwards run on the layers' own copies of their replicas, a's are restored and
refilled, since b's forwards overwrote those copies). Ten runs each. Checked:

* the Balancer restored exactly the micro-batch-a contexts (the layers' copies serve b's);

* ``ultraep`` against ``none``: outputs, input gradients and gate gradients bitwise equal
  (count of differing bit patterns = 0);
* every run against the first, per policy: all of them and the weight gradients identical;
* the weight gradients of the two policies within FP32 reassociation of the same terms;
* the ``none`` layer against an FP64 NumPy model of the whole layer (every rank's inputs
  and masters are seeded functions of its rank, so each rank can compute all of them).

no-replica: a Balancer whose plans can never make a replica for the layers' calls
(``min_replica_tokens`` above the ``R * T`` tokens an expert can get) leaves them
unbalanced (``MoELayer.balancing`` False, no update reaches it); one just at that bound
still balances, and with this routing plans no replica. Outputs, input and gate gradients
and weight gradients of all three bitwise those of the layers without a Balancer.

bad-input: mismatched set-up, wrong weights on one rank, a context used twice -- each a
clear error on every rank.
"""

import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep import Balancer, ExpertLayout, MoELayer, MoELayerError
from ultraep.errors import CollectiveError
from ultraep.integration import sync_beside_pays
from ultraep.integration.moe_layer import expert_spec
from ultraep.runtime.group import EPGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.backend_arrays import arrays, bf16  # noqa: E402

backend, check = sys.argv[1], sys.argv[2]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
xp, host, to_backend = arrays(backend)
M, S, H, F, T, K, LAYERS, MICRO, RUNS = 2, 2, 32, 16, 48, 2, 2, 2, 10
E = M * R


def masters(layer, rank):
    rng = np.random.default_rng((layer, rank, 7))
    return (bf16(rng.standard_normal((M, H, 2 * F)) / np.sqrt(H)), bf16(rng.standard_normal((M, F, H)) / np.sqrt(F)))


def inputs(layer, micro, rank):
    """x, logical top-k ids (a hot expert per layer and micro-batch, distinct per token), gates, dy."""
    rng = np.random.default_rng((layer, micro, rank, 11))
    hot = (1 + layer + 2 * micro) % E
    weights = 1.0 / (1 + (np.arange(E) - hot) % E) ** 2
    ids = np.stack([rng.choice(E, size=K, replace=False, p=weights / weights.sum()) for _ in range(T)])
    gates = rng.random((T, K)).astype(np.float32) + 0.1
    gates /= gates.sum(axis=1, keepdims=True)
    return (bf16(rng.standard_normal((T, H))), ids.astype(np.int64), gates, bf16(rng.standard_normal((T, H)) / 4))


def bits(array):
    array = host(array)
    return array.view(np.int16 if array.dtype.itemsize == 2 else np.int32)


def differing(a, b) -> int:
    return int(np.count_nonzero(bits(a) != bits(b)))


RESTORED = []  # (layer, micro-batch step) of every Balancer.restore of the last run_policy


FORWARD_STEPS = ["update", "weight_sync", "reroute", "dispatch", "replicas", "up", "swiglu", "down", "combine"]
BACKWARD_STEPS = ["replica_grads", "combine_backward", "refill", "dgrad_down", "swiglu_backward", "dgrad_up",
                  "wgrad_down", "wgrad_up", "grad_copy", "reduce_grads", "dispatch_backward"]


def check_phases(moe, runs: int) -> None:
    """A balancing layer that recorded its phases: every call's steps in order, none negative."""
    for direction, steps in (("forward", FORWARD_STEPS), ("backward", BACKWARD_STEPS)):
        calls = moe.phases(direction)
        assert len(calls) == runs * MICRO, f"{direction}: {len(calls)} calls recorded, expected {runs * MICRO}"
        for call in calls:
            assert list(call) == steps and all(ms >= 0 for ms in call.values()), f"{direction} phases {call}"
    assert moe.phases("forward") == [], "phases() read the same calls twice"


def run_policy(min_replica_tokens=None, runs=RUNS, sync_beside="auto", record_phases=False):
    """The layers with a Balancer of ``min_replica_tokens`` (None: without one), their weight
    syncs beside the layer's stream or in series on it (``sync_beside``; "auto": as
    ``sync_beside_pays`` says, which the layers are checked to follow), ``runs`` times:
    ([per run: ({(layer, micro): (y, dx, d_gates)}, [(grad_up, grad_down) per layer])],
    the Balancer's stats summary or None, the layers' ``balancing``). ``record_phases``: the
    layers record theirs (:func:`check_phases`)."""
    balancer = None
    RESTORED.clear()
    if min_replica_tokens is not None:
        balancer = Balancer(group, ExpertLayout(R, E, S), expert_spec(H, F), num_layers=LAYERS,
                            min_replica_tokens=min_replica_tokens, max_in_flight=MICRO, backend=backend)
        restore = balancer.restore
        balancer.restore = lambda handle, **options: (RESTORED.append((handle.layer, handle.step)),
                                                      restore(handle, **options))[1]
    layers = [MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=balancer, layer=layer,
                       backend=backend, sync_beside=sync_beside) for layer in range(LAYERS)]
    balancing = [moe.balancing for moe in layers]
    beside = sync_beside_pays(group) if sync_beside == "auto" else sync_beside
    placed = [moe.sync_beside for moe in layers]
    assert placed == [backend == "device" and beside and b for b in balancing], \
        f"sync_beside={sync_beside!r} placed the syncs beside: {placed}"
    for layer, moe in enumerate(layers):
        moe.load_weights(*masters(layer, me))  # NumPy in, copied onto the backend
        moe.record_phases(record_phases)
    data = {(layer, micro): [to_backend(a) for a in inputs(layer, micro, me)]
            for layer in range(LAYERS) for micro in range(MICRO)}
    results, summary = [], None
    for _ in range(runs):
        for moe in layers:
            moe.zero_grads()
        outputs, contexts = {}, {}
        for micro in range(MICRO):
            for layer, moe in enumerate(layers):
                x, ids, gates, _ = data[layer, micro]
                outputs[layer, micro], contexts[layer, micro] = moe.forward(x, ids, gates)
        for micro in reversed(range(MICRO)):
            for layer in reversed(range(LAYERS)):
                dy = data[layer, micro][3]
                dx, d_gates = layers[layer].backward(contexts[layer, micro], dy)
                outputs[layer, micro] = tuple(host(a) for a in (outputs[layer, micro], dx, d_gates))
        for moe in layers:
            moe.check()
        results.append((outputs, [(host(moe.grad_up).copy(), host(moe.grad_down).copy()) for moe in layers]))
    if balancer is not None:
        summary = balancer.stats().summary()
    for moe in layers:
        if record_phases:
            check_phases(moe, runs)
        moe.close()
    if balancer is not None:
        balancer.close()
    return results, summary, balancing


def silu_parts(a):
    s = 1.0 / (1.0 + np.exp(-a))
    return s, a * s


def reference():
    """FP64 model: this rank's (layer, micro) -> (y, dx, d_gates) and each layer's master gradients."""
    results, grads = {}, []
    for layer in range(LAYERS):
        weights = [masters(layer, r) for r in range(R)]
        up = [weights[e // M][0][e % M].astype(np.float64) for e in range(E)]
        down = [weights[e // M][1][e % M].astype(np.float64) for e in range(E)]
        g_up, g_down = np.zeros((M, H, 2 * F)), np.zeros((M, F, H))
        for micro in range(MICRO):
            for r in range(R):
                x, ids, gates, dy = inputs(layer, micro, r)
                x, dy = x.astype(np.float64), dy.astype(np.float64)
                y, dx, d_gates = np.zeros((T, H)), np.zeros((T, H)), np.zeros((T, K))
                for t in range(T):
                    for k in range(K):
                        e, g = ids[t, k], float(gates[t, k])
                        h = x[t] @ up[e]
                        a, b = h[:F], h[F:]
                        s, silu = silu_parts(a)
                        act = silu * b
                        out = act @ down[e]
                        y[t] += g * out
                        d_gates[t, k] = dy[t] @ out
                        gy = g * dy[t]
                        d_act = down[e] @ gy
                        dh = np.concatenate([d_act * b * s * (1 + a * (1 - s)), d_act * silu])
                        dx[t] += up[e] @ dh
                        if e // M == me:
                            g_up[e % M] += np.outer(x[t], dh)
                            g_down[e % M] += np.outer(act, gy)
                if r == me:
                    results[layer, micro] = (y, dx, d_gates)
        grads.append((g_up, g_down))
    return results, grads


def close_to(got, want, fraction, what):
    """BF16 intermediates (each rounding at most 2^-9 relative, about four on any path to an
    output) and FP32 sums: a fraction of a percent of the largest magnitude."""
    got = host(got).astype(np.float64)
    error, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    assert error <= fraction * scale, f"{what}: off by {error:.3g}, largest magnitude {scale:.3g}"


def invariance():
    plain, _, _ = run_policy()
    balanced, summary, balancing = run_policy(4, sync_beside=True, record_phases=True)  # recording moves no bit
    assert all(balancing), "layers whose Balancer can replicate do not balance"
    replicas = sum(group.allgather(summary["replicas_mean"]))
    assert replicas > 0, "the routing made no replica: the check would prove nothing"
    # backward order (layer, micro): (1, b) (0, b) (1, a) (0, a); update steps count per layer
    want_restored = [(layer, run * MICRO) for run in range(RUNS) for layer in reversed(range(LAYERS))]
    assert RESTORED == want_restored, f"restores {RESTORED}, expected {want_restored}"
    for runs, name in ((plain, "none"), (balanced, "ultraep")):
        first_out, first_grads = runs[0]
        for i, (out, grads) in enumerate(runs[1:], 1):
            for key in out:
                for a, b, what in zip(out[key], first_out[key], ("y", "dx", "d_gates")):
                    assert differing(a, b) == 0, f"{name} run {i} {key} {what} differs from run 0"
            for layer, (pair, first) in enumerate(zip(grads, first_grads)):
                for a, b, what in zip(pair, first, ("grad_up", "grad_down")):
                    assert differing(a, b) == 0, f"{name} run {i} layer {layer} {what} differs from run 0"
    in_series, _, _ = run_policy(4, runs=1, sync_beside=False)
    for key in plain[0][0]:
        for a, b, what in zip(balanced[0][0][key], plain[0][0][key], ("y", "dx", "d_gates")):
            count = differing(a, b)
            assert count == 0, f"{key} {what}: {count} elements of ultraep differ from none"
        for a, b, what in zip(in_series[0][0][key], balanced[0][0][key], ("y", "dx", "d_gates")):
            count = differing(a, b)
            assert count == 0, f"{key} {what}: {count} elements differ with the sync in series"
    for layer, (pair, beside) in enumerate(zip(in_series[0][1], balanced[0][1])):
        for a, b, what in zip(pair, beside, ("grad_up", "grad_down")):
            assert differing(a, b) == 0, f"layer {layer} {what} differs with the sync in series"
    for layer, (pair, plain_pair) in enumerate(zip(balanced[0][1], plain[0][1])):
        for a, b, what in zip(pair, plain_pair, ("grad_up", "grad_down")):
            # The same FP32 terms, summed per instance and the partials added in replica order.
            close_to(a, b.astype(np.float64), 1e-5, f"layer {layer} {what} ultraep vs none")
    want, want_grads = reference()
    for key, (y, dx, d_gates) in plain[0][0].items():
        for got, ref, what in zip((y, dx, d_gates), want[key], ("y", "dx", "d_gates")):
            close_to(got, ref, 2e-2, f"{key} {what} vs FP64")
    for layer, (pair, ref) in enumerate(zip(plain[0][1], want_grads)):
        for got, ref_g, what in zip(pair, ref, ("grad_up", "grad_down")):
            close_to(got, ref_g, 2e-2, f"layer {layer} {what} vs FP64")


def no_replica():
    plain, _, _ = run_policy(runs=1)
    never, never_summary, never_balancing = run_policy(R * T + 1, runs=1)
    assert not any(never_balancing), "a layer balances though no plan could make a replica"
    assert never_summary["updates"] == 0, f"{never_summary['updates']} updates reached a Balancer that cannot replicate"
    edge, edge_summary, edge_balancing = run_policy(R * T, runs=1)
    assert all(edge_balancing), "a replica of all R * T tokens of one expert is possible, yet the layers do not balance"
    assert edge_summary["updates"] == LAYERS * MICRO and edge_summary["replicas_mean"] == 0
    for runs, name in ((never, "never"), (edge, "no replica planned")):
        out, grads = runs[0]
        for key in out:
            for a, b, what in zip(out[key], plain[0][0][key], ("y", "dx", "d_gates")):
                assert differing(a, b) == 0, f"{name}: {key} {what} differs from the layer without a Balancer"
        for layer, (pair, plain_pair) in enumerate(zip(grads, plain[0][1])):
            for a, b, what in zip(pair, plain_pair, ("grad_up", "grad_down")):
                assert differing(a, b) == 0, f"{name}: layer {layer} {what} differs from the layer without a Balancer"


def expect_everywhere(kind, fragment, call):
    try:
        call()
    except kind as exc:
        assert fragment in str(exc), f"expected {fragment!r} in {exc}"
        return
    raise AssertionError(f"no {kind.__name__} for {fragment!r}")


def bad_input():
    layout = ExpertLayout(R, E, S)
    with Balancer(group, layout, expert_spec(H, F), num_layers=1, min_replica_tokens=4, backend=backend) as balancer:
        # An expert spec that is not the layer's: refused on every rank.
        with Balancer(group, layout, expert_spec(H, 2 * F), num_layers=1, backend=backend) as other:
            expect_everywhere(MoELayerError, "expert spec", lambda: MoELayer(
                group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=other, backend=backend))
        # One rank with another hidden size: every rank raises before anything is allocated.
        expect_everywhere(CollectiveError, "MoELayer set-up", lambda: MoELayer(
            group, hidden=H if me else 2 * H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend))
        expect_everywhere(MoELayerError, "multiples of 8", lambda: MoELayer(
            group, hidden=H + 4, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend))
        with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=balancer,
                      backend=backend) as moe:
            assert moe.balancing  # so the refused forward below could have reached the Balancer
            good = [to_backend(w) for w in masters(0, me)]
            wrong = [to_backend(w) for w in masters(0, me)]
            if me == R - 1:
                wrong[1] = to_backend(masters(0, me)[1].astype(np.float32))
            expect_everywhere(MoELayerError, f"rank {R - 1}: w_down: expected bfloat16",
                              lambda: moe.load_weights(*wrong))
            moe.load_weights(*good)
            x, ids, gates, dy = (to_backend(a) for a in inputs(0, 0, me))
            # Bad tokens on one rank: refused on every rank before the Balancer plans anything.
            bad_x = to_backend(inputs(0, 0, me)[0].astype(np.float32)) if me == R - 1 else x
            expect_everywhere(CollectiveError, f"rank {R - 1}: x: expected dtype bfloat16",
                              lambda: moe.forward(bad_x, ids, gates))
            assert balancer.stats().updates == 0, "a refused forward reached the Balancer"
            _, ctx = moe.forward(x, ids, gates)
            bad_dy = dy[:-1] if me == 0 else dy
            expect_everywhere(MoELayerError, f"rank 0: dy: expected bfloat16 [{T}, {H}]",
                              lambda: moe.backward(ctx, bad_dy))
            moe.backward(ctx, dy)
            expect_everywhere(MoELayerError, "has run already", lambda: moe.backward(ctx, dy))
            # Rebinding an array the layer (and the Balancer, for the replicas' gradients) keeps
            # writing would detach it silently: refused, the layer's arrays kept.
            for name in ("w_up", "w_down", "grad_up", "grad_down"):
                own = getattr(moe, name)
                expect_everywhere(MoELayerError, f"MoELayer.{name} is the layer's own array",
                                  lambda: setattr(moe, name, own.copy()))
                assert getattr(moe, name) is own, f"{name} was replaced"
            # bf16 tokens that arrive as their bits (int16, as DLPack hands them to a consumer
            # without the type) are those bits, not integers converted by value
            y_typed, _ = moe.forward(x, ids, gates, backward=False)
            y_bits, _ = moe.forward(x.view(np.int16), ids, gates, backward=False)
            assert differing(y_bits, y_typed) == 0, "x as its int16 bits gave another output"
            expect_everywhere(MoELayerError, "enable must be a bool", lambda: moe.record_phases("yes"))
            expect_everywhere(MoELayerError, "direction must be", lambda: moe.phases("sideways"))
            assert moe.phases("backward") == [], "phases recorded without record_phases"
        expect_everywhere(Exception, "closed", lambda: moe.forward(x, ids, gates))


try:
    {"invariance": invariance, "no-replica": no_replica, "bad-input": bad_input}[check]()
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[{check}] rank {me} OK", flush=True)
