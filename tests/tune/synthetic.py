"""A machine profile of round, H200-like figures for the model's and the search's tests:
132 SMs, 1.5 TB/s copies, 5 GB/s per warp, 2 us flags, 5 us launches, and fused tasks that
slow down as more CTAs run them: an up tile over k = 4096 in 60 us keeping h (40 us
without) on one CTA, half as long again on every SM; a down tile over k = 2048 in 25 us."""

import numpy as np

from ultraep.tune import ComputeCurve, FusedCosts, MachineProfile


def fused_like(sms: int, sharing: int = 1) -> FusedCosts:
    """Per task: a fixed part (claim, fill, epilogue) and a part linear in k, times 1 + half
    the fraction of the SMs busy."""
    grids = tuple(sorted({1, 2, 4, *(round(i * sms / 8) for i in range(1, 9))}))
    slower = 1 + 0.5 * np.asarray(grids) / sms

    def table(ks, fixed_s, per_k_s):
        return tuple(tuple(float(v) for v in (fixed_s + per_k_s * k) * slower) for k in ks)

    up_k, down_k = (2048, 4096), (1024, 2048)
    return FusedCosts(grids=grids, sharing=sharing, up_k=up_k, down_k=down_k,
                      up=table(up_k, 30e-6, 30e-6 / 4096), up_act=table(up_k, 10e-6, 30e-6 / 4096),
                      relay=table(up_k, 4e-6, 40e-6 / 4096), down=table(down_k, 5e-6, 20e-6 / 2048))


def h200_like(*, sm_share: int = 100, peer_bytes_per_s: float = 1.5e12) -> MachineProfile:
    rows = (8, 32, 128, 512, 2048, 8192)
    curve = ComputeCurve(kernel="synthetic", dtype="bfloat16", experts=8, k=2048, n=2048, rows_per_expert=rows,
                         seconds=tuple(8 * max(3e-6, m * 2 * 2048 * 2048 / 600e12) for m in rows))
    sms = 132 * sm_share // 100  # under an MPS share the device reports the share's SMs (a quarter: 33)
    return MachineProfile(backend="device", device="synthetic H200", sm_count=sms, sm_share=sm_share,
                          copy_bytes_per_s=peer_bytes_per_s, copy_method="synthetic",
                          peer_bytes_per_s=peer_bytes_per_s, peer_method="synthetic", launch_s=5e-6, compute=curve,
                          kernel_s=2e-6, copy_warp_bytes_per_s=5e9, flag_s=2e-6, fused=fused_like(sms))
