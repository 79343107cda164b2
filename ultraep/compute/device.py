"""Device (CuPy) grouped GEMM: ``raw_kernels/grouped_gemm.cu`` on the caller's stream.

One persistent launch per call, ``GG_BLOCKS_PER_SM`` blocks per SM, whatever the expert
sizes: the kernel reads the offsets on the device, so the host never waits for the counts.
Offsets on the device are checked by the kernel; a bad array is refused by every block
before any store, and the first such record waits in this GPU's status word until
:meth:`DeviceGroupedGemm.check` (``ultraep.compute.check_errors``) raises it.
"""

from __future__ import annotations

import numpy as np

from ultraep.compute.checks import KERNELS, Problem, offsets_message
from ultraep.errors import GroupedGemmError
from ultraep.runtime.kernels import get_function, kernel_constant

_ALIGN_BYTES = 16  # cp.async moves 16-byte chunks; the epilogue stores 4- or 8-byte pairs


class DeviceGroupedGemm:
    """The grouped GEMM on GPU ``device``: kernels, persistent grid and status word."""

    def __init__(self, device: int):
        import cupy

        self.cp, self.device = cupy, device
        self.threads = kernel_constant(KERNELS, "GG_THREADS")
        self.shared_bytes = kernel_constant(KERNELS, "GG_SMEM_BYTES")
        with cupy.cuda.Device(device):
            sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
            self.status = cupy.zeros(4, dtype=np.int64)
        self.grid = sms * kernel_constant(KERNELS, "GG_BLOCKS_PER_SM")
        self._kernels: dict[tuple[str, np.dtype], object] = {}

    def _kernel(self, op: str, out_dtype: np.dtype):
        kernel = self._kernels.get((op, out_dtype))
        if kernel is None:
            element = "float" if out_dtype == np.float32 else "__nv_bfloat16"
            kernel = get_function(KERNELS, f"grouped_mm_{op}<{element}>")
            with self.cp.cuda.Device(self.device):
                kernel.max_dynamic_shared_size_bytes = self.shared_bytes
            self._kernels[(op, out_dtype)] = kernel
        return kernel

    def allocate(self, problem: Problem):
        """A fresh output: zeros for forward/dgrad (rows past ``offsets[E]`` stay defined),
        uninitialised for wgrad (the kernel writes every element)."""
        make = self.cp.empty if problem.op == "wgrad" else self.cp.zeros
        return make(problem.out_shape, dtype=problem.out_dtype)

    def run(self, problem: Problem, a, b, offsets, out) -> None:
        """Launch on the current stream (checked CuPy arrays on this GPU)."""
        for name, array in (("a", a), ("b", b), ("out", out)):
            if array.size and array.data.ptr % _ALIGN_BYTES:
                raise GroupedGemmError(f"{problem.op}: the {name} operand's data is not {_ALIGN_BYTES}-byte aligned "
                                       f"(a view into a larger buffer?); pass an aligned copy")
        kernel = self._kernel(problem.op, problem.out_dtype)
        kernel((self.grid,), (self.threads,), (
            a, b, offsets, np.int32(offsets.dtype == np.int64), np.int32(problem.experts), np.int64(problem.rows),
            np.int32(problem.k), np.int32(problem.n), out, self.status), shared_mem=self.shared_bytes)

    def check(self) -> None:
        """Synchronise this GPU's current stream; raise (and clear) the first bad-offsets record."""
        with self.cp.cuda.Device(self.device):
            self.cp.cuda.get_current_stream().synchronize()
            code, index, value, rows = (int(v) for v in self.status.get())
            if code:
                self.status.fill(0)
                raise GroupedGemmError(f"grouped GEMM refused device offsets (nothing was written): "
                                       f"{offsets_message(code, index, value, rows)}")
