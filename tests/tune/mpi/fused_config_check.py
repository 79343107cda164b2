"""``MoELayer(fused=True, fused_config=...)`` across ranks, run under mpiexec by
tests/tune/test_fused_configs.py.

Usage: python -m mpi4py fused_config_check.py {host|device}

For several configurations (one CTA and the smallest tasks and unrolls; a third of the
SMs; every SM with the largest unrolls; the source's constants; on the GPU the tuned
schedule, whose ranks fall into different token buckets here: rank 0 carries more than
4096 tokens, the others a few hundred; the default, which is the tuned schedule on the GPU
and the constants on the host), the fused forward's output and its backward's input, gate and
weight gradients are bitwise the sequential layer's, and the same over two runs (the backward
runs on the forward's CTAs for its tokens). Refused on every rank, naming what is wrong: a
grid above the resident CTAs (on the GPU), a fused_config that is not one, ranks that pass
different ones, a fused_config without fused=True.
"""

import sys
import traceback

import numpy as np
from mpi4py import MPI

from ultraep import MoELayer, MoELayerError
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.group import EPGroup
from ultraep.compute.fused.config import FusedConfig

backend = sys.argv[1]
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
if backend == "device":
    import cupy as xp

    from ultraep.compute.fused.device import resident_ctas

    def host(array):
        array = xp.asnumpy(array)
        return array.view(BFLOAT16) if array.dtype == np.int16 else array
    RESIDENT = resident_ctas(group.device)
else:
    xp, host, RESIDENT = np, np.asarray, 4

M, K = 4, 4
E = M * R
H, F = (272, 144) if backend == "device" else (48, 24)
MAX_TOKENS = 6000 if backend == "device" else 40
T = (5000 if me == 0 else 300) if backend == "device" else (40 if me == 0 else 17)


def bf16(values):
    return np.asarray(values, dtype=np.float32).astype(BFLOAT16)


def to_backend(array):
    if array.dtype == BFLOAT16:
        return xp.asarray(array.view(np.int16)).view(BFLOAT16)
    return xp.asarray(array)


def bits(array):
    return np.ascontiguousarray(host(array)).view(np.uint8)


def forward_and_backward(moe, data, dy):
    """The bits of one training forward's output, then of its backward's dx and gate
    gradients and of the weight gradients it leaves (from zero)."""
    moe.zero_grads()
    out, ctx = moe.forward(*data)
    results = [bits(out)] + [bits(a) for a in (*moe.backward(ctx, dy), moe.grad_up, moe.grad_down)]
    moe.check()
    return results


def layer(fused_config=None, *, fused=True):
    moe = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=MAX_TOKENS, backend=backend,
                   fused=fused, fused_config=fused_config)
    rng = np.random.default_rng((me, 5))
    moe.load_weights(to_backend(bf16(rng.standard_normal((M, H, 2 * F)) / np.sqrt(H))),
                     to_backend(bf16(rng.standard_normal((M, F, H)) / np.sqrt(F))))
    return moe


def refused(match, **kwargs):
    try:
        layer(**kwargs).close()
    except MoELayerError as exc:
        assert match in str(exc), str(exc)
    else:
        raise AssertionError(f"{kwargs} was not refused")


def main():
    rng = np.random.default_rng((me, 17))
    ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64)
    data = (to_backend(bf16(rng.standard_normal((T, H)))), to_backend(ids),
            to_backend(rng.random((T, K)).astype(np.float32) + 0.1))
    dy = to_backend(bf16(rng.standard_normal((T, H))))
    with layer(fused=False) as plain:
        want = forward_and_backward(plain, data, dy)
    configs = [FusedConfig(1, send_tokens=1, reduce_tokens=1, copy_unroll=1, reduce_unroll=1),
               FusedConfig(max(1, RESIDENT // 3), send_tokens=7, reduce_tokens=64),
               FusedConfig(RESIDENT, send_tokens=128, reduce_tokens=5, copy_unroll=8, reduce_unroll=16), "constants"]
    if backend == "device":
        configs.append("tuned")
    configs.append(None)  # the default: the tuned schedule on the device, the constants on the host
    schedules = {}
    for config in configs:
        with layer(config) as moe:
            for run in range(2):
                got = forward_and_backward(moe, data, dy)
                for name, g, w in zip(("output", "dx", "d_gates", "grad_up", "grad_down"), got, want):
                    count = int(np.count_nonzero(g != w))
                    assert count == 0, f"fused_config={config} run {run}: {count} bytes of {name} differ from the plain"
            if not isinstance(config, FusedConfig):  # the named schedules, compared below
                schedules[config] = moe._fused.schedule
            if config == "tuned" and me == 0:
                print(f"tuned schedule: {[str(c) for c in moe._fused.schedule.configs]}", flush=True)
    assert schedules[None] == schedules["tuned" if backend == "device" else "constants"], schedules
    if backend == "device":
        refused(f"ctas {RESIDENT + 1} exceeds the {RESIDENT} CTAs", fused_config=FusedConfig(RESIDENT + 1))
    refused("fused_config must be None, 'tuned', 'constants' or a FusedConfig, got 'fast'", fused_config="fast")
    # not a NumPy truth-value error from comparing an array with a name
    refused("fused_config must be None, 'tuned', 'constants' or a FusedConfig, got array([0, 1, 2])",
            fused_config=np.arange(3))
    refused("MoELayer fused_config", fused_config=FusedConfig(1 + me % 2))
    refused("fused_config is set but fused=False", fused_config=FusedConfig(1), fused=False)


try:
    main()
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[fused-config] rank {me} OK", flush=True)
