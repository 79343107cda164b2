"""The compute layer: the grouped GEMM, and in :mod:`ultraep.compute.fused` the fused MoE
kernels, which share its tile pipeline through ``raw_kernels/grouped_gemm_common.cuh`` (a
layer of their own above the token path they fuse; the grouped GEMM imports neither).

* :func:`grouped_mm`, :func:`grouped_mm_dgrad`, :func:`grouped_mm_wgrad` -- the
  padding-free BF16 grouped GEMM over expert-major rows (forward, input gradient, weight
  gradient), on a Hopper GPU (``raw_kernels/grouped_gemm.cu``: TMA + wgmma, each operation
  on its faster compile-time schedule, :data:`ultraep.compute.device.DEFAULT_SCHEDULES`)
  or on the host (NumPy reference);
* :func:`check_errors` -- raise what the kernel found wrong with device-side offsets.
"""

from ultraep.compute.grouped_gemm import check_errors, grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad

__all__ = ["check_errors", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad"]
