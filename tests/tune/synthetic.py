"""A machine profile of round, H200-like figures for the model's and the search's tests:
132 SMs, 1.5 TB/s copies, 5 GB/s per warp, 2 us flags, 5 us launches, a 128 x 256 tile
over k = 2048 in 30 us on one SM."""

from ultraep.tune import ComputeCurve, MachineProfile
from ultraep.tune.profile import TileCost


def h200_like(*, sm_share: int = 100, peer_bytes_per_s: float = 1.5e12) -> MachineProfile:
    rows = (8, 32, 128, 512, 2048, 8192)
    curve = ComputeCurve(kernel="synthetic", dtype="bfloat16", experts=8, k=2048, n=2048, rows_per_expert=rows,
                         seconds=tuple(8 * max(3e-6, m * 2 * 2048 * 2048 / 600e12) for m in rows))
    # under an MPS share the device reports the share's SMs (a quarter: 33)
    return MachineProfile(backend="device", device="synthetic H200", sm_count=132 * sm_share // 100, sm_share=sm_share,
                          copy_bytes_per_s=peer_bytes_per_s, copy_method="synthetic",
                          peer_bytes_per_s=peer_bytes_per_s, peer_method="synthetic", launch_s=5e-6, compute=curve,
                          kernel_s=2e-6, copy_warp_bytes_per_s=5e9, flag_s=2e-6,
                          gemm=TileCost(kernel="synthetic", bm=128, bn=256, k=2048, tile_s=30e-6, fixed_s=5e-6))
