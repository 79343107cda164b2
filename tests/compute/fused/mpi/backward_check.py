"""Multi-rank check of ``MoELayer(fused=True)``'s backward, run under mpiexec by
tests/compute/fused/test_backward.py.

Usage: python -m mpi4py backward_check.py {host|device} {bitwise|reverse-order|peer-fails|peer-absent} [runs]

bitwise: for random routings, routings that leave experts empty and every token's first
slot on one expert, unbalanced and balanced: the fused layer's input, gate and weight
gradients bitwise the sequential layer's with the same masters and inputs, with two
micro-batches in flight (forward 1, forward 2, backward 2, backward 1: the backward's
flags share the forward's epoch counter, and its rows must not be overtaken); the heap's
landing rows, gate-gradient slots and expert rows are poisoned (NaN bit patterns) before
every backward, so a row read before it is written shows; ``runs`` repetitions give
identical bits. A recorded backward's timeline lists every kind of task on every rank;
the forward's stays the forward's.

reverse-order: forward 1, forward 2, backward 2, backward 1 with no check between the calls
give the bits of forward 1, backward 1, forward 2, backward 2 (the two micro-batches route
differently, so their rank tiles differ: a backward that read the later forward's would
place rows wrongly); each context's rank tiles are every rank's offsets and M-tile starts
of its own forward, and its arrival tables the NumPy model's of its routing.

peer-fails: the last rank's backward runs no send task (its output gradients never
arrive): every rank's backward gives up after the layer's timeout with WaitTimeout naming
a flag it waited for, instead of hanging.

peer-absent: the last rank never enters the backward: every other rank's backward gives up
at its opening barrier after the layer's timeout with BarrierTimeout naming the barrier and
the absent rank, instead of hanging; the fused kernels' waits that followed it are reported
with it, not by a later check.
"""

import contextlib
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep import Balancer, ExpertLayout, MoELayer, MoELayerError
from ultraep.compute.fused.backward import KERNEL_C, KERNEL_D, KERNELS
from ultraep.compute.fused.forward import KERNEL_A, KERNEL_B, arrival_tables, mtile_starts
from ultraep.errors import BarrierTimeout, WaitTimeout
from ultraep.integration.moe_layer import expert_spec
from ultraep.runtime.group import EPGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root: tests.support
from tests.support.backend_arrays import arrays, bf16  # noqa: E402
from tests.support.fused_problem import K, M, POISON, S, masters, sizes  # noqa: E402
from ultraep.runtime.kernels import kernel_constant

backend, check = sys.argv[1], sys.argv[2]
RUNS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
xp, host, to_backend = arrays(backend)
H, F, T = sizes(backend)
E = M * R


def inputs(routing, rank, batch):
    rng = np.random.default_rng((rank, 23, len(routing), batch))
    if routing == "empty-experts":  # only experts 0 and 1 of every rank's masters (a token may repeat one)
        used = [e for e in range(E) if e % M < 2]
        ids = np.stack([rng.choice(used, size=K, replace=len(used) < K) for _ in range(T)])
    elif routing == "one-expert":   # every token's first slot to expert E - 1
        ids = np.stack([np.concatenate([[E - 1], rng.choice(E - 1, size=K - 1, replace=False)]) for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
    gates = rng.random((T, K)).astype(np.float32) + 0.1
    data = bf16(rng.standard_normal((T, H))), ids.astype(np.int64), gates, bf16(rng.standard_normal((T, H)) / 4)
    return [to_backend(a) for a in data]


def bits(array):
    array = host(array)
    return array.view(np.int16 if array.dtype.itemsize == 2 else np.int32)


def poison(layer):
    """NaN patterns in the heap rows a backward fills before it reads them (landing rows,
    gate-gradient slots, expert rows), once no peer reads them any more."""
    layer.check()
    group.barrier()
    buffers = layer.dispatcher._impl.buffers
    for tensor in (buffers.landing, buffers.slot_grad_w):
        tensor.local.view(np.int16)[...] = POISON
    layer.dispatcher.expert_output().view(np.int16)[...] = POISON


def layer(balanced, fused):
    balancer = Balancer(group, ExpertLayout(R, E, S), expert_spec(H, F), num_layers=1, min_replica_tokens=4,
                        max_in_flight=2, backend=backend) if balanced else None
    moe = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=balancer,
                   backend=backend, fused=fused)
    moe.load_weights(*masters(me, H, F))
    return moe, balancer


def two_in_flight(moe, batches, *, fused):
    """Forward 1, forward 2, backward 2, backward 1; the gradients of each and the weights'."""
    moe.zero_grads()
    contexts = [moe.forward(*data[:3])[1] for data in batches]
    grads = []
    for ctx, data in reversed(list(zip(contexts, batches))):
        if fused:
            poison(moe)
        dx, d_gates = moe.backward(ctx, data[3])
        moe.check()
        grads += [host(dx).copy(), host(d_gates).copy()]
    return grads + [host(moe.grad_up).copy(), host(moe.grad_down).copy()]


def timeline(moe, data):
    """A recorded training step: the backward's timeline holds each of its kinds on every
    rank (random routing: every rank sends, relays and reduces), each task ending after it
    starts, on the host (one worker) in claim order; the forward's timeline is the forward's
    kinds; no other direction is taken. Its phases, recorded alongside, name the fused
    kernels as one step between the layer's own."""
    moe.record_timeline(True)
    moe.record_phases(True)
    _, ctx = moe.forward(*data[:3])
    moe.backward(ctx, data[3])
    moe.check()
    tasks, forward = moe.timeline("backward"), moe.timeline()
    moe.record_timeline(False)
    phases = moe.phases("forward") + moe.phases("backward")
    moe.record_phases(False)
    assert [list(call) for call in phases] == [["fused"], ["replica_grads", "refill", "fused", "wgrad_down",
                                                           "wgrad_up"]], phases
    order = list(KERNEL_C + KERNEL_D)
    for rank, kinds in enumerate(group.allgather([kind for kind, *_ in tasks])):
        assert set(kinds) == set(order), f"rank {rank}: {sorted(set(kinds))}"
    assert all(end >= start for _, start, end, _ in tasks), tasks
    if backend == "host":
        assert [kind for kind, *_ in tasks] == sorted((kind for kind, *_ in tasks), key=order.index)
    assert {kind for kind, *_ in forward} <= set(KERNEL_A + KERNEL_B) and "up" in {k for k, *_ in forward}
    try:
        moe.timeline("sideways")
    except MoELayerError as exc:
        assert "'forward' or 'backward'" in str(exc), str(exc)
    else:
        raise AssertionError("timeline took a direction that is neither")


def bitwise():
    names = ("dx 2", "d_gates 2", "dx 1", "d_gates 1", "grad_up", "grad_down")
    for balanced in (False, True):
        (plain, plain_balancer), (fused, fused_balancer) = layer(balanced, False), layer(balanced, True)
        for routing in ("random", "empty-experts", "one-expert"):
            batches = [inputs(routing, me, batch) for batch in range(2)]
            want = two_in_flight(plain, batches, fused=False)
            assert all(np.isfinite(w.astype(np.float32)).all() for w in want)
            assert np.count_nonzero(want[0].astype(np.float32)) > 0
            first = two_in_flight(fused, batches, fused=True)
            for got, ref, name in zip(first, want, names):
                count = int(np.count_nonzero(bits(got) != bits(ref)))
                assert count == 0, f"balanced={balanced} {routing} {name}: {count} elements differ from sequential"
            for run in range(1, RUNS):
                again = two_in_flight(fused, batches, fused=True)
                for got, ref, name in zip(again, first, names):
                    assert np.array_equal(bits(got), bits(ref)), f"balanced={balanced} {routing} run {run} {name}"
        if not balanced:
            timeline(fused, inputs("random", me, 0))
        for moe, balancer in ((plain, plain_balancer), (fused, fused_balancer)):
            moe.close()
            if balancer is not None:
                balancer.close()


def reverse_order():
    moe = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend, fused=True,
                   sync_checks=False)
    moe.load_weights(*masters(me, H, F))
    batches = [inputs("random", me, 0), inputs("one-expert", me, 1)]
    moe.zero_grads()
    pairs = []
    for data in batches:
        _, ctx = moe.forward(*data[:3])
        pairs.append(moe.backward(ctx, data[3]))
    moe.check()
    want = [host(a).copy() for a in (*pairs[0], *pairs[1], moe.grad_up, moe.grad_down)]
    poison(moe)
    moe.zero_grads()
    contexts = [moe.forward(*data[:3])[1] for data in batches]
    reverse = {i: moe.backward(contexts[i], batches[i][3]) for i in (1, 0)}
    moe.check()
    got = [host(a).copy() for a in (*reverse[0], *reverse[1], moe.grad_up, moe.grad_down)]
    names = ("dx 1", "d_gates 1", "dx 2", "d_gates 2", "grad_up", "grad_down")
    for g, w, name in zip(got, want, names):
        count = int(np.count_nonzero(bits(g) != bits(w)))
        assert count == 0, f"{name}: {count} elements differ from forward/backward pairs"
    tiles = []
    bm, bands = kernel_constant(KERNELS, "FB_BM"), kernel_constant(KERNELS, "FM_ARRIVAL_BANDS")
    for ctx, data in zip(contexts, batches):
        offsets = group.allgather(host(ctx.received.offsets).astype(np.int64))
        expected = np.array([offsets, [mtile_starts(np.diff(o), bm) for o in offsets]])
        tiles.append(host(ctx.tile_plan.rank_tiles))
        assert np.array_equal(tiles[-1], expected), f"rank tiles {tiles[-1]} are not the forward's {expected}"
        table = np.array(group.allgather(np.bincount(host(data[1]).ravel(), minlength=E)))  # no balancer: ids are slots
        order = arrival_tables(table, M, me, bm, bands)
        got = host(ctx.tile_plan.arrival)[:order.size]
        assert np.array_equal(got, order), f"arrival tables {got} are not {order}"
    assert not np.array_equal(*tiles), "the two micro-batches' rank tiles are alike: the check proves nothing"
    moe.close()


def skip_sends(launcher):
    """This rank's fused backward runs everything but its send tasks."""
    if backend == "host":
        from ultraep.compute.fused import backward as fused_backward

        order = fused_backward.task_order
        fused_backward.task_order = lambda *a: ([t for t in order(*a)[0] if t.kind != "send"], order(*a)[1])
        return
    kernel, sends = launcher.k["fused_grad_dispatch_dgrad"], -(-T // kernel_constant(KERNELS, "FB_SEND_TOKENS"))

    def skip_then_launch(*args, **kwargs):
        launcher.counters[kernel_constant(KERNELS, "FM_SEND_COUNTER")] = sends  # kernel C's senders: none left
        kernel(*args, **kwargs)
    launcher.k["fused_grad_dispatch_dgrad"] = skip_then_launch


@contextlib.contextmanager
def after_one_forward(timeout):
    """A fused layer giving up after ``timeout`` s, after one forward: its backward launcher
    (made on every rank: collective), the context and dy."""
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend, fused=True,
                  timeout_s=timeout, sync_checks=False) as moe:
        moe.load_weights(*masters(me, H, F))
        x, ids, gates, dy = inputs("random", me, 0)
        _, ctx = moe.forward(x, ids, gates)
        yield moe, moe._fused_backward(), ctx, dy


def peer_fails():
    timeout = 2.0
    with after_one_forward(timeout) as (moe, launcher, ctx, dy):
        if me == R - 1:
            skip_sends(launcher)
        try:
            moe.backward(ctx, dy)
            moe.check()
        except WaitTimeout as exc:
            assert "row_flag" in str(exc) or "done" in str(exc), str(exc)
            assert f"{timeout:g} s" in str(exc), str(exc)
        else:
            raise AssertionError("a backward whose peer sent nothing did not time out")


def peer_absent():
    timeout = 2.0
    with after_one_forward(timeout) as (moe, _, ctx, dy):
        if me != R - 1:
            try:
                moe.backward(ctx, dy)
                moe.check()
            except BarrierTimeout as exc:
                text = str(exc)
                assert text.startswith(f"rank {me}: fused backward: its opening barrier"), text
                assert f"waiting for rank {R - 1}" in text and f"{timeout:g} s" in text, text
            else:
                raise AssertionError("a backward whose peer never entered it did not time out")
            moe.check()  # the kernels' waits after the barrier were reported with it
        group.barrier(120.0, what="peer-absent: the absent rank stays until the others gave up")


try:
    {"bitwise": bitwise, "reverse-order": reverse_order, "peer-fails": peer_fails,
     "peer-absent": peer_absent}[check]()
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[{check}] rank {me} OK", flush=True)
