"""Multi-rank check of ``MoELayer(fused=True)``, run under mpiexec by tests/compute/fused/test_forward.py.

Usage: python -m mpi4py forward_check.py {host|device} {bitwise|bad-input|peer-fails} [runs]

bitwise: for random routings, routings that leave experts empty and every token's first
slot on one expert, unbalanced and balanced (a Balancer with replica slots): the fused
layer against the sequential layer with the same masters and inputs -- outputs, input
gradients, gate gradients and weight gradients bitwise equal (the backward fused too:
backward_check.py checks it further); ``runs`` fused forwards give identical
bits. The heap's expert rows and the memory pool are poisoned (NaN bit patterns) before
every fused forward, so a row read before it is written shows. A recorded forward's
timeline lists its tasks.

bad-input: an expert id out of range on one rank: refused on every rank, naming it.

peer-fails: the last rank runs no send task (its tokens never arrive): every rank's
forward gives up after the layer's timeout with WaitTimeout naming the row_flag it
waited for, instead of hanging.
"""

import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep import Balancer, ExpertLayout, MoELayer, MoELayerError
from ultraep.errors import CollectiveError, DispatchError, WaitTimeout
from ultraep.compute.fused.forward import KERNELS
from ultraep.integration.moe_layer import expert_spec
from ultraep.runtime.group import EPGroup
from ultraep.runtime.kernels import kernel_constant

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root: tests.support
from tests.support.backend_arrays import arrays, bf16  # noqa: E402
from tests.support.fused_problem import K, M, POISON, S, masters, sizes  # noqa: E402

backend, check = sys.argv[1], sys.argv[2]
RUNS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
xp, host, to_backend = arrays(backend)
H, F, T = sizes(backend)
E = M * R


def inputs(routing, rank):
    rng = np.random.default_rng((rank, 17, len(routing)))
    if routing == "empty-experts":  # only experts 0 and 1 of every rank's masters (a token may repeat one)
        used = [e for e in range(E) if e % M < 2]
        ids = np.stack([rng.choice(used, size=K, replace=len(used) < K) for _ in range(T)])
    elif routing == "one-expert":   # every token's first slot to expert E - 1
        ids = np.stack([np.concatenate([[E - 1], rng.choice(E - 1, size=K - 1, replace=False)]) for _ in range(T)])
    else:
        ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)])
    gates = rng.random((T, K)).astype(np.float32) + 0.1
    return bf16(rng.standard_normal((T, H))), ids.astype(np.int64), gates, bf16(rng.standard_normal((T, H)) / 4)


def bits(array):
    array = host(array)
    return array.view(np.int16 if array.dtype.itemsize == 2 else np.int32)


def differing(a, b) -> int:
    return int(np.count_nonzero(bits(a) != bits(b)))


def poison(layer):
    """NaN patterns in the heap's expert rows and, on the GPU, in the pool's free blocks,
    once no peer reads them any more (a fused backward's last readers are peers' reduces)."""
    layer.check()
    group.barrier()
    rows = layer.dispatcher.expert_output()
    rows.view(np.int16)[...] = POISON
    if backend == "device":
        blocks = [xp.full(size, POISON, dtype=np.int16) for size in (rows.size, rows.size, T * H)]
        del blocks


def layer_pair(balanced):
    layers = []
    for fused in (False, True):
        balancer = Balancer(group, ExpertLayout(R, E, S), expert_spec(H, F), num_layers=1, min_replica_tokens=4,
                            backend=backend) if balanced else None
        moe = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, balancer=balancer,
                       backend=backend, fused=fused)
        moe.load_weights(*masters(me, H, F))
        layers.append((moe, balancer))
    return layers


def step(moe, data, *, fused):
    x, ids, gates, dy = data
    moe.zero_grads()
    if fused:
        poison(moe)
    y, ctx = moe.forward(x, ids, gates)
    y = host(y).copy()  # before the backward rewrites the heap's rows
    dx, d_gates = moe.backward(ctx, dy)
    moe.check()
    return [y, host(dx), host(d_gates), host(moe.grad_up).copy(), host(moe.grad_down).copy()]


def timeline(plain, fused, data):
    """A recorded fused forward lists every task once per kind it has, each ending after it
    starts; on the host (one worker) in claim order. A sequential layer has no timeline."""
    fused.record_timeline(True)
    fused.forward(*data[:3])
    tasks = fused.timeline()
    fused.record_timeline(False)
    kinds = [kind for kind, *_ in tasks]
    order = ["send", "relay", "up", "down", "reduce"]
    assert {"send", "down"} <= set(kinds) <= set(order), kinds
    assert all(end >= start for _, start, end, _ in tasks), tasks
    if backend == "host":
        assert kinds == sorted(kinds, key=order.index), kinds
    try:
        plain.timeline()
    except MoELayerError as exc:
        assert "fused=True" in str(exc)
    else:
        raise AssertionError("a sequential layer returned a timeline")


def bitwise():
    names = ("y", "dx", "d_gates", "grad_up", "grad_down")
    for balanced in (False, True):
        (plain, plain_balancer), (fused, fused_balancer) = layer_pair(balanced)
        for routing in ("random", "empty-experts", "one-expert"):
            data = [to_backend(a) for a in inputs(routing, me)]
            want = step(plain, data, fused=False)
            first = step(fused, data, fused=True)
            for got, ref, name in zip(first, want, names):
                count = differing(got, ref)
                assert count == 0, f"balanced={balanced} {routing} {name}: {count} elements differ from sequential"
            assert np.isfinite(first[0].astype(np.float32)).all(), "a poisoned row reached the output"
            for run in range(1, RUNS):
                again = step(fused, data, fused=True)
                for got, ref, name in zip(again, first, names):
                    assert differing(got, ref) == 0, f"balanced={balanced} {routing} run {run} {name} differs"
        if not balanced:
            timeline(plain, fused, data)
        for moe, balancer in ((plain, plain_balancer), (fused, fused_balancer)):
            moe.close()
            if balancer is not None:
                balancer.close()


def bad_input():
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend, fused=True) as moe:
        moe.load_weights(*masters(me, H, F))
        x, ids, gates, _ = inputs("random", me)
        if me == R - 1:
            ids[3, 1] = E
        try:
            moe.forward(to_backend(x), to_backend(ids), to_backend(gates))
            moe.check()
        except (DispatchError, CollectiveError) as exc:  # host: at the check; device: from the count table
            assert f"expert id {E} at token 3, slot 1" in str(exc), str(exc)
        else:
            raise AssertionError("an expert id out of range was not refused")


def skip_sends(moe):
    """This rank's fused forward runs everything but its send tasks."""
    if backend == "host":
        from ultraep.compute.fused import forward as fused

        order = fused.task_order
        fused.task_order = lambda *a: ([t for t in order(*a)[0] if t.kind != "send"], order(*a)[1])
        return

    launcher = moe._fused
    plan, sends = launcher.k["fused_plan"], -(-T // launcher.schedule.for_tokens(T).send_tokens)

    def plan_then_skip(*args, **kwargs):
        plan(*args, **kwargs)
        launcher.counters[kernel_constant(KERNELS, "FM_SEND_COUNTER")] = sends  # kernel A's senders: none left
    launcher.k["fused_plan"] = plan_then_skip


def peer_fails():
    timeout = 2.0
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend, fused=True,
                  timeout_s=timeout, sync_checks=False) as moe:
        moe.load_weights(*masters(me, H, F))
        x, ids, gates, _ = (to_backend(a) for a in inputs("random", me))
        if me == R - 1:
            skip_sends(moe)
        try:
            moe.forward(x, ids, gates)
            moe.check()
        except WaitTimeout as exc:
            assert "row_flag" in str(exc) and f"{timeout:g} s" in str(exc), str(exc)
        else:
            raise AssertionError("a forward whose peer sent nothing did not time out")


try:
    {"bitwise": bitwise, "bad-input": bad_input, "peer-fails": peer_fails}[check]()
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[{check}] rank {me} OK", flush=True)
