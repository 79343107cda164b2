"""The GPU's micro-benchmarks (CuPy, one GPU of this process): a device-to-device copy,
the heap's copy kernel into a peer GPU (or within this one) and on a few blocks, an empty
kernel's launch, a flag handoff, and the grouped GEMM at a few rows per expert and at a
few waves of tiles. Each quantity is the time per call over a few
batches of back-to-back calls (the fastest batch): the copies and the launch timed from
the host around a synchronised batch, the GEMM on the device alone (at a few rows per
expert the host takes longer to launch it than the GPU to run it, and the cost model
needs the GPU's time)."""

from __future__ import annotations

import time

import numpy as np

from ultraep.errors import ProfileError
from ultraep.tune.host import BATCH_S, MAX_CALLS, ROUNDS, seconds_per_call

COPY_BYTES = 256 << 20          # several times the L2 cache: the copy runs at HBM speed
COPY_THREADS = 512              # threads per block of heap.cu's copy_bytes (as the peer-copy bench)
COPY_BLOCKS_PER_SM = (1, 2, 4)  # grids tried for it; the fastest counts
WARP_COPY_SM_FRACTION = 8       # the per-warp copy runs on one block per this many SMs: far from HBM's limit
WARP_COPY_BYTES = 64 << 20
TILE_WAVES = (1, 2, 4)          # GEMM calls of this many tiles per SM of the grid
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
MAX_HOLD_NS = 10**9  # a hold this long that still ends before the batch is enqueued: the host is stuck


class DeviceProbe:
    """Micro-benchmarks of GPU ``device`` (default: CuPy's current device)."""

    backend = "device"
    copy_method = "cudaMemcpyAsync device to device"
    compute_kernel = "ultraep.compute.grouped_mm"
    compute_dtype = "bfloat16"
    # 8 experts of 2048 x 2048 bf16 weights (64 MiB, more than L2): weight reads come from HBM
    compute_shape = (8, 2048, 2048)
    rows_per_expert = (8, 32, 128, 512, 2048, 8192)

    def __init__(self, device: int | None = None):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device().id if device is None else int(device)

    def _seconds(self, call) -> float:
        with self.cp.cuda.Device(self.device):
            return seconds_per_call(call, time.perf_counter, self.cp.cuda.get_current_stream().synchronize)

    def _device_seconds(self, call) -> float:
        """Device time per call of back-to-back calls: each batch is enqueued behind a kernel
        that holds the stream (``timing.cu``), so the events around the batch time the GPU's
        work and not the host's launches; a hold that ended before the whole batch was
        enqueued is doubled and the batch timed again."""
        from ultraep.runtime.kernels import get_function

        cp = self.cp
        hold = get_function("timing.cu", "hold_stream")
        with cp.cuda.Device(self.device):
            stream = cp.cuda.get_current_stream()
            call()
            stream.synchronize()
            begin = time.perf_counter()
            call()
            stream.synchronize()
            once = max(time.perf_counter() - begin, 1e-9)  # host and device together: an upper bound
            calls = max(1, min(MAX_CALLS, int(BATCH_S / once)))
            hold_ns = int(2e9 * calls * once)
            held, start, stop = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
            times = []
            while len(times) < ROUNDS:
                hold((1,), (1,), (np.uint64(hold_ns),))
                held.record()
                start.record()
                for _ in range(calls):
                    call()
                stop.record()
                waited = held.done  # the hold ended while the host still enqueued: the GPU idled in between
                stop.synchronize()
                if waited:
                    hold_ns *= 2
                    if hold_ns > MAX_HOLD_NS:
                        raise ProfileError(f"the host took over {MAX_HOLD_NS / 1e9:.0f} s to enqueue {calls} "
                                           "expert-compute calls for the machine profile")
                    continue
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3 / calls)
            return min(times)

    def describe(self) -> tuple[str, int]:
        properties = self.cp.cuda.runtime.getDeviceProperties(self.device)
        name = properties["name"]
        return (name.decode() if isinstance(name, bytes) else str(name)), int(properties["multiProcessorCount"])

    def copy_bytes_per_s(self) -> float:
        runtime = self.cp.cuda.runtime
        with self.cp.cuda.Device(self.device):
            source = self.cp.random.randint(0, 256, COPY_BYTES, dtype=np.uint8)
            target = self.cp.empty_like(source)
            stream = self.cp.cuda.get_current_stream()
            return COPY_BYTES / self._seconds(lambda: runtime.memcpyAsync(
                target.data.ptr, source.data.ptr, COPY_BYTES, runtime.memcpyDeviceToDevice, stream.ptr))

    def _peer_device(self) -> int | None:
        runtime = self.cp.cuda.runtime
        for other in range(runtime.getDeviceCount()):
            if other != self.device and runtime.deviceCanAccessPeer(self.device, other):
                return other
        return None

    def peer_bytes_per_s(self, copy_bytes_per_s: float) -> tuple[float, str]:
        from ultraep.runtime.kernels import get_function

        cp, runtime = self.cp, self.cp.cuda.runtime
        copy = get_function("heap.cu", "copy_bytes")
        peer = self._peer_device()
        with cp.cuda.Device(self.device):
            source = cp.random.randint(0, 256, COPY_BYTES, dtype=np.uint8)
            if peer is None:
                target = cp.empty_like(source)
                method = (f"heap.cu copy_bytes within GPU {self.device} (one GPU: a peer's heap on it shares this "
                          "HBM; no link between GPUs measured)")
            else:
                try:
                    runtime.deviceEnablePeerAccess(peer)
                except runtime.CUDARuntimeError as exc:
                    if exc.status != PEER_ACCESS_ALREADY_ENABLED:
                        raise
                method = (f"heap.cu copy_bytes from GPU {self.device} into GPU {peer} (peer access, as into a "
                          "peer's heap)")
        with cp.cuda.Device(self.device if peer is None else peer):
            if peer is not None:
                target = cp.empty((COPY_BYTES,), np.uint8)
            target.fill(0xA5)  # poisoned: the check below sees a copy that left bytes out
            cp.cuda.get_current_stream().synchronize()
        sms = runtime.getDeviceProperties(self.device)["multiProcessorCount"]
        # raw pointers: the target may live on another GPU, which the kernel reaches by peer access
        pointers = (np.uint64(source.data.ptr), np.uint64(target.data.ptr), np.uint64(COPY_BYTES))
        best = min(self._seconds(lambda grid=sms * per_sm: copy((grid,), (COPY_THREADS,), pointers))
                   for per_sm in COPY_BLOCKS_PER_SM)
        with cp.cuda.Device(self.device):
            landed = cp.empty_like(source)
            landed.data.copy_from_device(target.data, COPY_BYTES)
            if not bool(cp.array_equal(landed, source)):
                raise ProfileError(f"the peer copy measured for the machine profile is wrong ({method})")
        return COPY_BYTES / best, method

    def copy_call(self):
        """``(launch, finish, bytes)``: one heap copy kernel of ``bytes`` bytes within this GPU
        on every resident thread, and the wait for it."""
        from ultraep.runtime.kernels import get_function

        cp = self.cp
        copy = get_function("heap.cu", "copy_bytes")
        _, sms = self.describe()
        grid = sms * max(COPY_BLOCKS_PER_SM)
        with cp.cuda.Device(self.device):
            source = cp.random.randint(0, 256, COPY_BYTES, dtype=np.uint8)
            target = cp.empty_like(source)
            stream = cp.cuda.get_current_stream()

        def launch():
            with cp.cuda.Device(self.device):
                copy((grid,), (COPY_THREADS,), (source, target, np.uint64(COPY_BYTES)))
        return launch, stream.synchronize, COPY_BYTES

    def launch_s(self) -> float:
        from ultraep.runtime.kernels import get_function

        hold = get_function("timing.cu", "hold_stream")  # with 0 ns it returns at once: an empty kernel
        return self._seconds(lambda: hold((1,), (1,), (np.uint64(0),)))

    def kernel_s(self) -> float:
        from ultraep.runtime.kernels import get_function

        hold = get_function("timing.cu", "hold_stream")  # with 0 ns it returns at once: an empty kernel
        return self._device_seconds(lambda: hold((1,), (1,), (np.uint64(0),)))

    def copy_warp_bytes_per_s(self) -> float:
        from ultraep.runtime.kernels import get_function

        cp = self.cp
        copy = get_function("heap.cu", "copy_bytes")
        _, sms = self.describe()
        blocks = max(1, sms // WARP_COPY_SM_FRACTION)
        with cp.cuda.Device(self.device):
            source = cp.random.randint(0, 256, WARP_COPY_BYTES, dtype=np.uint8)
            target = cp.empty_like(source)
            pointers = (source, target, np.uint64(WARP_COPY_BYTES))
            seconds = self._device_seconds(lambda: copy((blocks,), (COPY_THREADS,), pointers))
        return WARP_COPY_BYTES / seconds / (blocks * COPY_THREADS // 32)

    def flag_s(self) -> float:
        """A one-rank heap barrier (a system fence, a release store of its flag, an acquire
        load that finds it) less an empty kernel, both on the device alone."""
        from ultraep.runtime.kernels import get_function

        cp = self.cp
        barrier = get_function("heap.cu", "symmetric_barrier")
        with cp.cuda.Device(self.device):
            pad = cp.zeros(8, dtype=np.uint64)
            status = cp.zeros(4, dtype=np.uint64)
            bases = cp.asarray(np.array([pad.data.ptr], dtype=np.uint64))
            # epoch 1 throughout: from the second call on the flag is already there, so the
            # wait ends at its first load and nothing but the handoff itself is timed
            arguments = (bases, np.int32(0), np.int32(1), np.uint64(0), np.uint64(1), np.uint64(10**9), status)
            with_flag = self._device_seconds(lambda: barrier((1,), (32,), arguments))
            empty = self.kernel_s()
            if int(status[0].get()):
                raise ProfileError("the flag handoff measured for the machine profile timed out")
        return max(with_flag - empty, 1e-9)

    def gemm_tile_times(self) -> tuple:
        """The grouped GEMM on one expert whose output is one tile row per SM of its grid
        wide, at ``TILE_WAVES`` tile rows (whole waves of tiles on every SM): what
        :func:`~ultraep.tune.profile.fit_tile_cost` takes."""
        from ultraep.compute import grouped_mm
        from ultraep.runtime.kernels import kernel_constant

        cp = self.cp
        bm, bn = kernel_constant("grouped_gemm.cu", "GH_BM"), kernel_constant("grouped_gemm.cu", "GH_BN")
        k = self.compute_shape[1]
        _, sms = self.describe()
        seconds = []
        with cp.cuda.Device(self.device):
            w = _bf16_bits(cp, (1, k, bn * sms), seed=7)
            for waves in TILE_WAVES:
                x = _bf16_bits(cp, (waves * bm, k), seed=waves)
                offsets = cp.asarray(np.array([0, waves * bm], dtype=np.int32))
                out = cp.empty((waves * bm, bn * sms), dtype=np.int16)
                seconds.append(self._device_seconds(lambda x=x, offsets=offsets, out=out: grouped_mm(x, w, offsets,
                                                                                                   out=out)))
        return self.compute_kernel, bm, bn, k, tuple(waves * sms for waves in TILE_WAVES), tuple(seconds)

    def expert_call_s(self, rows: int) -> float:
        from ultraep.compute import grouped_mm

        cp = self.cp
        experts, k, n = self.compute_shape
        with cp.cuda.Device(self.device):
            x = _bf16_bits(cp, (experts * rows, k), seed=rows)
            w = _bf16_bits(cp, (experts, k, n), seed=rows + 1)
            offsets = cp.arange(0, experts * rows + 1, rows, dtype=np.int32)
            out = cp.empty((experts * rows, n), dtype=np.int16)
            return self._device_seconds(lambda: grouped_mm(x, w, offsets, out=out))


def _bf16_bits(cp, shape, seed: int):
    """Random bf16 values in ``[-1, 1)`` as their int16 bits (the grouped GEMM takes either)."""
    values = cp.random.default_rng(seed).random(shape, dtype=np.float32) * 2 - 1
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
