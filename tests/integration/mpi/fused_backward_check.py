"""Multi-rank check of ``MoELayer(fused=True)``'s backward, run under mpiexec by
tests/integration/test_fused_backward.py.

Usage: python -m mpi4py fused_backward_check.py {host|device} {bitwise|peer-fails} [runs]

bitwise: for random routings, routings that leave experts empty and every token's first
slot on one expert, unbalanced and balanced: the fused layer's input, gate and weight
gradients bitwise the sequential layer's with the same masters and inputs, with two
micro-batches in flight (forward 1, forward 2, backward 2, backward 1: the backward's
flags share the forward's epoch counter, and its rows must not be overtaken); the heap's
landing rows, gate-gradient slots and expert rows are poisoned (NaN bit patterns) before
every backward, so a row read before it is written shows; ``runs`` repetitions give
identical bits.

peer-fails: the last rank's backward runs no send task (its output gradients never
arrive): every rank's backward gives up after the layer's timeout with WaitTimeout naming
a flag it waited for, instead of hanging.
"""

import sys
import traceback

import numpy as np
from mpi4py import MPI

from ultraep import Balancer, ExpertLayout, MoELayer
from ultraep.errors import WaitTimeout
from ultraep.integration.fused_backward import KERNELS
from ultraep.integration.moe_layer import expert_spec
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.group import EPGroup

backend, check = sys.argv[1], sys.argv[2]
RUNS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
POISON = np.int16(0x7FC1)  # a BF16 NaN; as two halves of an FP32 word, an FP32 NaN too
if backend == "device":
    import cupy as xp

    def host(array):
        array = xp.asnumpy(array)
        return array.view(BFLOAT16) if array.dtype == np.int16 else array
else:
    xp, host = np, np.asarray

M, S, K = 4, 2, 4
H, F, T = (272, 144, 300) if backend == "device" else (48, 24, 40)  # device: partial column blocks and M-tiles
E = M * R


def to_backend(array):
    if array.dtype == BFLOAT16:
        return xp.asarray(array.view(np.int16)).view(BFLOAT16)
    return xp.asarray(array)


def bf16(values):
    return np.asarray(values, dtype=np.float32).astype(BFLOAT16)


def masters(rank):
    rng = np.random.default_rng((rank, 5))
    return bf16(rng.standard_normal((M, H, 2 * F)) / np.sqrt(H)), bf16(rng.standard_normal((M, F, H)) / np.sqrt(F))


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
    moe.load_weights(*masters(me))
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
        for moe, balancer in ((plain, plain_balancer), (fused, fused_balancer)):
            moe.close()
            if balancer is not None:
                balancer.close()


def skip_sends(launcher):
    """This rank's fused backward runs everything but its send tasks."""
    if backend == "host":
        from ultraep.integration import fused_backward

        order = fused_backward.task_order
        fused_backward.task_order = lambda *a: ([t for t in order(*a)[0] if t.kind != "send"], order(*a)[1])
        return
    from ultraep.runtime.kernels import kernel_constant

    kernel, sends = launcher.k["fused_grad_dispatch_dgrad"], -(-T // kernel_constant(KERNELS, "FB_SEND_TOKENS"))

    def skip_then_launch(*args, **kwargs):
        launcher.counters[0] = sends  # kernel C's claims start past the send tasks
        kernel(*args, **kwargs)
    launcher.k["fused_grad_dispatch_dgrad"] = skip_then_launch


def peer_fails():
    timeout = 2.0
    with MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T, backend=backend, fused=True,
                  timeout_s=timeout, sync_checks=False) as moe:
        moe.load_weights(*masters(me))
        x, ids, gates, dy = inputs("random", me, 0)
        _, ctx = moe.forward(x, ids, gates)
        launcher = moe._fused_backward()  # collective: made (its kernels loaded) on every rank
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


try:
    {"bitwise": bitwise, "peer-fails": peer_fails}[check]()
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[{check}] rank {me} OK", flush=True)
