"""Device (CuPy) grouped GEMM on the caller's stream: the Hopper kernels of
``raw_kernels/grouped_gemm.cu`` (TMA + wgmma, one persistent block per SM).

One launch per call whatever the expert sizes: the kernels read the offsets on the
device, so the host never waits for the counts. Offsets on the device are checked by the
kernel; a bad array is refused by every block before any store, and the first such
record waits in this GPU's status word until :meth:`DeviceGroupedGemm.check`
(``ultraep.compute.check_errors``) raises it. So does a Hopper kernel's pipeline wait that
ran out of time (a bug, reported rather than hung).

The kernels take their operands through TMA tensor maps, encoded here by the driver's
``cuTensorMapEncodeTiled`` (they hold the operands' addresses; the latest are kept for an
address the pool hands out again) and passed by value as kernel parameters.

``schedule`` picks one of the kernels' compile-time schedules (:data:`SCHEDULES`,
``GG_SCHEDULE`` in ``raw_kernels/grouped_gemm.cu``, which says what each does) for every
operation; all give the same bits. Without one, each operation runs its
:data:`DEFAULT_SCHEDULES` entry, the faster on the H200; ``bench grouped-gemm --variant``
measures one schedule beside them.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import numpy as np

from ultraep.compute.checks import KERNELS, Problem, offsets_message
from ultraep.errors import GroupedGemmError
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.runtime.sm_partition import usable_sms

_ALIGN_BYTES = 16  # cp.async and TMA move 16-byte units; the epilogues store 4- or 8-byte pairs

# cuTensorMapEncodeTiled's enumerations (cuda.h).
_BFLOAT16 = 9
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0
# Maps kept per _TensorMaps: a layer's weights, and its activations at the few addresses the pool reuses.
MAP_CACHE_ENTRIES = 64

# Schedule name -> (its GG_SCHEDULE value's macro, its dynamic shared memory's macro).
SCHEDULES = {"staged": ("GG_STAGED_TILE", "GH_SMEM_BYTES"), "ring": ("GG_RING_STAGED", "GG_RING_SMEM_BYTES")}
PLAIN_SCHEDULE = "staged"  # the module compiled without a GG_SCHEDULE option
# The deeper ring pays in every operation: the MMAs wait on copies less.
DEFAULT_SCHEDULES = {"forward": "ring", "dgrad": "ring", "wgrad": "ring"}


class _TensorMaps:
    """TMA tensor maps of row-major BF16 arrays, from the CUDA driver. A map depends on
    nothing but its arguments, so the latest :data:`MAP_CACHE_ENTRIES` are kept and an
    array at a pointer the pool hands out again costs a lookup, not an encode."""

    def __init__(self):
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise GroupedGemmError(f"the CUDA driver library (libcuda.so.1) could not be loaded: {exc}") from exc
        self.encode = driver.cuTensorMapEncodeTiled
        self.encode.restype = ctypes.c_int
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        self.encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p,
                                u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.size = kernel_constant(KERNELS, "GH_TENSOR_MAP_BYTES")
        self.dtype = np.dtype((np.void, self.size))
        self.cache: OrderedDict[tuple, np.void] = OrderedDict()  # least recently used first

    def tiled(self, pointer: int, dims, box, strides=None) -> np.void:
        """The map of an array at ``pointer`` with ``dims`` (innermost first) and byte
        ``strides`` of the outer ones (default: a row-major array's), copied in ``box`` tiles
        into 128-byte-swizzled shared memory, reads out of bounds as zeros."""
        if strides is None:
            strides, stride = [], 2
            for d in dims[:-1]:
                stride *= d
                strides.append(stride)
        key = (pointer, tuple(dims), tuple(box), tuple(strides))
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return cached
        buffer = np.zeros(2 * self.size, dtype=np.uint8)  # the map must be 64-byte aligned
        start = -buffer.ctypes.data % 64
        out = buffer[start:start + self.size]
        rank = len(dims)
        result = self.encode(out.ctypes.data, _BFLOAT16, rank, pointer, (ctypes.c_uint64 * rank)(*dims),
                             (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                             (ctypes.c_uint32 * rank)(*([1] * rank)), _INTERLEAVE_NONE, _SWIZZLE_128B,
                             _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
        if result != 0:
            raise GroupedGemmError(f"cuTensorMapEncodeTiled refused dims {tuple(dims)} box {tuple(box)} "
                                   f"(CUresult {result})")
        tensor_map = self.cache[key] = out.view(self.dtype)[0]
        if len(self.cache) > MAP_CACHE_ENTRIES:
            self.cache.popitem(last=False)
        return tensor_map


class DeviceGroupedGemm:
    """The grouped GEMM on GPU ``device``: its kernels (``schedule`` for every operation, or
    each operation's :data:`DEFAULT_SCHEDULES` entry), persistent grid, status word and, per
    stream launched on, the tile counter its blocks claim tiles from (the last block of a
    launch resets it, so launches on one stream share it and on two streams never do; one
    first made while its stream captured a CUDA graph is zeroed only when the graph runs, so
    it is zeroed again before the stream's first launch outside a capture).
    ``defines``: further ``(name, int)`` -D options of a diagnostic build (e.g.
    ``GG_TILE_STAMPS``, ``scripts/gemm_tile_stamps.py``)."""

    def __init__(self, device: int, schedule: str | None = None, defines: tuple = ()):
        if schedule is not None and schedule not in SCHEDULES:
            raise GroupedGemmError(f"grouped GEMM schedule {schedule!r} does not exist; "
                                   f"schedules: {', '.join(SCHEDULES)}")
        import cupy

        self.schedules = {op: schedule or default for op, default in DEFAULT_SCHEDULES.items()}
        self.defines = tuple(defines)
        self.cp, self.device = cupy, device
        with cupy.cuda.Device(device):
            properties = cupy.cuda.runtime.getDeviceProperties(device)
            self.status = cupy.zeros(4, dtype=np.int64)
            # Stands in for an empty operand in a tensor map (never read: no tile touches it).
            self._placeholder = cupy.zeros(_ALIGN_BYTES, dtype=np.uint8)
        self.hopper = (properties["major"], properties["minor"]) == (9, 0)
        self.grid = usable_sms(device)
        self.threads = kernel_constant(KERNELS, "GH_THREADS")
        self._maps: _TensorMaps | None = None
        self._claims: dict[int, object] = {}  # stream pointer -> int32 [claimed tiles, blocks done claiming]
        self._zeroed_in_graph: set[int] = set()  # streams whose counter's zeros were captured, not yet run
        self._kernels: dict[tuple[str, np.dtype], tuple[object, int]] = {}

    def module_defines(self, op: str) -> tuple:
        """The -D options ``op``'s kernels compile with: its schedule's (none for the plain
        module, shared with every other user), then ``defines``."""
        schedule = self.schedules[op]
        own = () if schedule == PLAIN_SCHEDULE else (("GG_SCHEDULE", kernel_constant(KERNELS, SCHEDULES[schedule][0])),)
        return own + self.defines

    def _kernel(self, op: str, out_dtype: np.dtype):
        """``op``'s kernel for ``out_dtype`` in its schedule, and its dynamic shared memory."""
        kernel = self._kernels.get((op, out_dtype))
        if kernel is None:
            shared_macro = SCHEDULES[self.schedules[op]][1]
            element = "float" if out_dtype == np.float32 else "__nv_bfloat16"
            function = get_function(KERNELS, f"grouped_mm_{op}<{element}>", defines=self.module_defines(op))
            shared_bytes = kernel_constant(KERNELS, shared_macro)
            with self.cp.cuda.Device(self.device):
                function.max_dynamic_shared_size_bytes = shared_bytes
            kernel = self._kernels[(op, out_dtype)] = function, shared_bytes
        return kernel

    def allocate(self, problem: Problem):
        """A fresh output: zeros for forward/dgrad (rows past ``offsets[E]`` stay defined),
        uninitialised for wgrad (the kernel writes every element)."""
        make = self.cp.empty if problem.op == "wgrad" else self.cp.zeros
        return make(problem.out_shape, dtype=problem.out_dtype)

    def _operand_maps(self, problem: Problem, a, b):
        """Tensor maps of the two operands, as the kernel's grouped_mm describes them."""
        if self._maps is None:
            self._maps = _TensorMaps()
        constant = lambda name: kernel_constant(KERNELS, name)  # noqa: E731
        bk, bm, bn, box = constant("GH_BK"), constant("GH_BM"), constant("GH_BN"), constant("GH_BOX")
        rows, k, n, experts = problem.rows, problem.k, problem.n, problem.experts
        if problem.op == "forward":
            shapes = ((k, rows), (bk, bm), None), ((n, k, experts), (box, bk, 1), None)
        elif problem.op == "dgrad":
            shapes = ((n, rows), (bk, bm), None), ((n, k, experts), (bk, bn, 1), None)
        elif k % box == 0 and n % box == 0:  # the kernel's producer makes the same choice
            # Each operand as its 64-column blocks side by side (128 bytes apart), a k-step of
            # it one box of all the tile's blocks.
            shapes = (((box, rows, k // box), (box, bk, bm // box), (2 * k, 2 * box)),
                      ((box, rows, n // box), (box, bk, bn // box), (2 * n, 2 * box)))
        else:
            shapes = ((k, rows), (box, bk), None), ((n, rows), (box, bk), None)

        def tiled(array, dims, box, strides):
            if array.size == 0:  # no tile reads it; the map still needs a real address and 16-byte rows
                return self._maps.tiled(self._placeholder.data.ptr, [_ALIGN_BYTES // 2] + [1] * (len(dims) - 1), box)
            return self._maps.tiled(array.data.ptr, dims, box, strides)

        return tuple(tiled(array, *shape) for array, shape in zip((a, b), shapes))

    def run(self, problem: Problem, a, b, offsets, out, add_to=None) -> None:
        """Launch on the current stream (checked CuPy arrays on this GPU; ``add_to`` None but
        for a wgrad that adds into it)."""
        if not self.hopper:
            raise GroupedGemmError(f"{problem.op}: the grouped GEMM kernels need a Hopper (compute capability 9.0) "
                                   f"GPU; GPU {self.device} is not one")
        for name, array in (("a", a), ("b", b), ("out", out), ("add_to", add_to)):
            if array is not None and array.size and array.data.ptr % _ALIGN_BYTES:
                raise GroupedGemmError(f"{problem.op}: the {name} operand's data is not {_ALIGN_BYTES}-byte aligned "
                                       f"(a view into a larger buffer?); pass an aligned copy")
        kernel, shared_bytes = self._kernel(problem.op, problem.out_dtype)
        claims = self._claims_of(self.cp.cuda.get_current_stream())
        kernel((self.grid,), (self.threads,), (
            *self._operand_maps(problem, a, b), offsets, np.int32(offsets.dtype == np.int64),
            np.int32(problem.experts), np.int64(problem.rows), np.int32(problem.k), np.int32(problem.n), out,
            self._placeholder if add_to is None else add_to, np.int32(problem.added_experts), self.status, claims),
            shared_mem=shared_bytes)

    def _claims_of(self, stream):
        """``stream``'s tile counter, at zero when its next launch runs (the stream's capture
        state is asked only for a new counter or one whose zeros were captured)."""
        claims = self._claims.get(stream.ptr)
        if claims is None:
            claims = self._claims[stream.ptr] = self.cp.zeros(2, dtype=np.int32)
            if stream.is_capturing():
                self._zeroed_in_graph.add(stream.ptr)
        elif stream.ptr in self._zeroed_in_graph and not stream.is_capturing():
            claims.fill(0)
            self._zeroed_in_graph.discard(stream.ptr)
        return claims

    def check(self) -> None:
        """Synchronise this GPU's current stream; raise (and clear) the first status record."""
        with self.cp.cuda.Device(self.device):
            self.cp.cuda.get_current_stream().synchronize()
            code, index, value, rows = (int(v) for v in self.status.get())
            if code:
                self.status.fill(0)
                if code == kernel_constant(KERNELS, "GH_STAGE_TIMED_OUT"):
                    waited = {kernel_constant(KERNELS, "GH_WAITED_FOR_CONSUMERS"): "the MMAs to free a stage",
                              kernel_constant(KERNELS, "GH_WAITED_FOR_COPIES"): "a stage's TMA copies",
                              kernel_constant(KERNELS, "GH_WAITED_FOR_OUTPUT"): "an output tile to store",
                              kernel_constant(KERNELS, "GH_WAITED_FOR_STORES"): "the stores of an output tile",
                              kernel_constant(KERNELS, "GH_WAITED_FOR_TILE"): "the index of its next tile",
                              kernel_constant(KERNELS, "GH_WAITED_FOR_READERS"): "its warps to take a tile index"}
                    raise GroupedGemmError(f"grouped GEMM: block {value} waited over {rows} ms for "
                                           f"{waited.get(index, f'wait {index}')}; its output is not valid")
                raise GroupedGemmError(f"grouped GEMM refused device offsets (nothing was written): "
                                       f"{offsets_message(code, index, value, rows)}")
