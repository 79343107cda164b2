"""The GPU's micro-benchmarks (CuPy, one GPU of this process): a device-to-device copy,
the heap's copy kernel into a peer GPU (or within this one) and on a few blocks, an empty
kernel's launch, a flag handoff, the Dispatcher's copy kernels' resident blocks per SM, the
grouped GEMM at a few rows per expert, and the fused MoE kernels' tasks on synthetic rows.
Each quantity is the time per call over a few batches of back-to-back calls (the fastest
batch): the copies and the launch timed from the host around a synchronised batch, the GEMM
on the device alone (at a few rows per expert the host takes longer to launch it than the
GPU to run it, and the cost model needs the GPU's time), the fused tasks from the kernels'
own task timeline; the resident blocks from the driver's occupancy of the kernels.

The fused kernels (:class:`FusedBench`) run on one process's synthetic problem, no token
sent: kernel A with its M-tiles' relay flags already set (up tiles alone, storing ``h``
or not) or with no up tile (relays alone), kernel B with no token to reduce (down tiles
alone, storing ``y`` or not, each publishing its ``done`` flag as in a layer). A layer
reads each slot's weights from HBM (its slots' weights are several times the L2, and every
call walks all of them), so every launch of the probe reads weight slots that the launches
before it have not touched for :data:`FUSED_COLD_L2S` L2s (a pool of slots the launches
walk through), never the ones the last launch left in L2. Their arguments are passed by the
names the kernel source declares, so a kernel whose parameters change is refused with the
name this probe does not know, never launched with arguments out of place.
"""

from __future__ import annotations

import functools
import math
import re
import time

import numpy as np

from ultraep.errors import ProfileError
from ultraep.runtime.sm_partition import usable_sms
from ultraep.tune.host import BATCH_S, MAX_CALLS, ROUNDS, FusedRound, Probe, seconds_per_call

COPY_BYTES = 256 << 20          # several times the L2 cache: the copy runs at HBM speed
# the Dispatcher's copy kernels' block, and pull_slots' dynamic shared memory a thread (a row
# pointer): ultraep.token.device's THREADS and POINTER_BYTES, which this layer may not import
# (a test holds them equal)
DISPATCH_THREADS = 256
DISPATCH_POINTER_BYTES = 8
COPY_THREADS = 512              # threads per block of heap.cu's copy_bytes (as the peer-copy bench)
COPY_BLOCKS_PER_SM = (1, 2, 4)  # grids tried for it; the fastest counts
WARP_COPY_SM_FRACTION = 8       # the per-warp copy runs on one block per this many SMs: far from HBM's limit
WARP_COPY_BYTES = 64 << 20
FUSED_KERNELS = "fused_moe.cu"
FUSED_UP_K = (2048, 4096)       # hidden sizes the up tiles and relays are measured at (their reductions, row widths)
FUSED_DOWN_K = (1024, 2048)     # FFN sizes the down tiles are measured at
FUSED_SLOT_ROWS = 2048          # a synthetic slot: 16 M-tiles, two rasters of the grouped GEMM's order
FUSED_COLUMN_BLOCKS = 16        # a slot's column blocks: up tiles over 2048 act columns, down tiles over 4096
# A tile run has at least this many waves of tiles on its grid: 1.5-6.5 ms on the H200, as long
# as a layer's kernel A, many times the processes' start skew after a host barrier (whose
# polls back off to 2 ms). Version 6's 8 waves (0.1-0.4 ms) ended before the other sharers'
# began: their shared times were hardly above one process's alone and no CTA waited for an SM.
FUSED_TILE_WAVES = 128
FUSED_RELAY_WAVES = 2           # a relay run, of relay tasks
FUSED_GRID_FRACTIONS = tuple(i / 8 for i in range(1, 9))  # grids measured, of the SMs, besides 1, 2 and 4 CTAs
FUSED_ROUNDS = 3                # launches per measurement (a barrier of the measuring processes before each)
FUSED_HOLD_NS = 2 * 10**6       # each launch is enqueued behind a hold this long, as tune validate's forwards are
FUSED_TIMEOUT_NS = 10 * 10**9   # a flag wait of the probe that lasts this long is a bug: reported, not hung
FUSED_COLD_L2S = 2              # a launch's weights: untouched by the launches before it for this many L2s of weights
# Of the GPU's memory, what a fused task's buffers may take, split among the processes that
# probe it at once: the rest is the CUDA contexts', the other processes' CuPy pools and
# modules'. Where a task's waves on the largest grid need more, its runs have fewer waves.
FUSED_MEMORY_FRACTION = 0.4
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
MAX_HOLD_NS = 10**9  # a hold this long that still ends before the batch is enqueued: the host is stuck


class DeviceProbe(Probe):
    """Micro-benchmarks of GPU ``device`` (default: CuPy's current device)."""

    backend = "device"
    copy_method = "cudaMemcpyAsync device to device"
    compute_kernel = "ultraep.compute.grouped_mm"
    # what the measurements launch: a profile taken with other sources is measured again
    kernel_sources = ("dispatch.cu", FUSED_KERNELS, "grouped_gemm.cu", "heap.cu", "timing.cu", "transfer.cu")
    compute_dtype = "bfloat16"
    # 8 experts of 2048 x 2048 bf16 weights (64 MiB, more than L2): weight reads come from HBM
    compute_shape = (8, 2048, 2048)
    rows_per_expert = (8, 32, 128, 512, 2048, 8192)

    def __init__(self, device: int | None = None, sharing: int = 1):
        """``sharing``: the processes that probe this GPU at once (each keeps its part of the
        memory for its buffers, :data:`FUSED_MEMORY_FRACTION`)."""
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device().id if device is None else int(device)
        self.sharing = sharing
        self._fused: FusedBench | None = None

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
        return (name.decode() if isinstance(name, bytes) else str(name)), usable_sms(self.device)

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
        sms = usable_sms(self.device)
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

    def dispatch_blocks_per_sm(self) -> int:
        """Blocks of the Dispatcher's copy kernels (every element type it compiles them for)
        resident at once on an SM, the fewest of them, at the block and dynamic shared memory
        the Dispatcher launches them with: the driver's occupancy for the kernels as compiled
        here (their registers, not their threads, bound it)."""
        from ultraep.runtime.kernels import get_function

        occupancy = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor
        shared = {"pull_slots": DISPATCH_THREADS * DISPATCH_POINTER_BYTES}  # a row pointer a thread
        names = ["send_tokens", "expand_rows", "send_rows"] + [
            f"{kernel}<{element}>" for kernel in ("reduce_slots", "pull_slots")
            for element in ("__nv_bfloat16", "__half", "float")]
        with self.cp.cuda.Device(self.device):  # a RawKernel's .kernel: its CUfunction on this device
            return min(occupancy(get_function("dispatch.cu", name).kernel.ptr, DISPATCH_THREADS,
                                 shared.get(name.split("<")[0], 0)) for name in names)

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

    def fused_grids(self) -> tuple[int, ...]:
        """The grids (CTAs of this process) the fused tasks are measured at: 1, 2, 4 and
        :data:`FUSED_GRID_FRACTIONS` of the SMs."""
        _, sms = self.describe()
        return tuple(sorted({g for g in (1, 2, 4, *(round(f * sms) for f in FUSED_GRID_FRACTIONS)) if 1 <= g <= sms}))

    fused_reductions = (FUSED_UP_K, FUSED_DOWN_K)

    def fused_rounds(self, task: str, k: int, grid: int, together, release=None) -> list[FusedRound]:
        """One fused task (:class:`~ultraep.tune.profile.FusedCosts`) at ``k`` on ``grid`` CTAs
        in :data:`FUSED_ROUNDS` launches, each after ``together()`` and, where given, on the
        device behind ``release()`` (:meth:`FusedBench.rounds`)."""
        if self._fused is None or self._fused.key != (task, k):
            self._drop_fused()  # its buffers go before the next one's are made
            properties = self.cp.cuda.runtime.getDeviceProperties(self.device)
            memory_bytes = int(properties["totalGlobalMem"] * FUSED_MEMORY_FRACTION) // self.sharing
            self._fused = FusedBench(self.cp, self.device, task, k, max(self.fused_grids()),
                                     int(properties["l2CacheSize"]), memory_bytes)
        return self._fused.rounds(grid, together, release)

    def _drop_fused(self) -> None:
        """The fused task's buffers back to the driver, not only to CuPy's pool: the ranks
        sharing a GPU probe at once, and blocks one of them keeps cached are memory the
        others' next buffers (and the job's) cannot have."""
        self._fused = None
        self.cp.get_default_memory_pool().free_all_blocks()

    def close(self) -> None:
        self._drop_fused()

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


@functools.lru_cache(maxsize=None)  # every probe launch orders its arguments by them
def kernel_parameters(filename: str, name: str) -> tuple[str, ...]:
    """The parameter names of kernel ``name`` as ``raw_kernels/<filename>`` declares it."""
    from ultraep.runtime.kernels import kernel_source

    text = kernel_source(filename).read_text()
    match = re.search(rf"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?{re.escape(name)}\s*\(([^)]*)\)", text)
    if match is None:
        raise ProfileError(f"{filename} declares no kernel {name}")
    return tuple(re.findall(r"\w+", parameter)[-1] for parameter in match.group(1).split(","))


def ordered_arguments(filename: str, name: str, values: dict) -> tuple:
    """``values`` (by parameter name) in the order kernel ``name`` declares them; a name
    either side lacks is refused, naming it."""
    parameters = kernel_parameters(filename, name)
    unknown, unused = set(parameters) - set(values), set(values) - set(parameters)
    if unknown or unused:
        raise ProfileError(f"the machine profile's probe of {name} ({filename}) is out of date with the kernel: "
                           f"it has no value for {sorted(unknown)} and values for no parameter {sorted(unused)} "
                           f"(ultraep/tune/device.py, FusedBench)")
    return tuple(values[parameter] for parameter in parameters)


class FusedBench:
    """One fused task of ``raw_kernels/fused_moe.cu`` on synthetic rows of this process
    (``task``, ``k``: :class:`~ultraep.tune.profile.FusedCosts`), its buffers made once for
    grids up to ``max_grid`` (a run on a smaller grid uses fewer slots: every run has
    :data:`FUSED_TILE_WAVES` waves of tiles, or :data:`FUSED_RELAY_WAVES` of relays, at least),
    in ``memory_bytes`` where given: the largest grids' runs have fewer waves where those
    slots' buffers (:meth:`buffer_bytes`) would not fit.
    Both operands of the tiles come from pools (:class:`OperandPool`) that the launches walk
    through, each launch the slots after the last one's, so that every launch reads them from
    HBM, as a layer does: its slots' weights (version 5), and its rows (version 6) -- a
    layer's up tiles read rows relayed long before (a rank relays hundreds of MB ahead of its
    tiles), its down tiles the ``act`` kernel A wrote (as much), never what L2 still holds.

    * ``up`` / ``up_act``: kernel A on slots of :data:`FUSED_SLOT_ROWS` rows whose M-tiles are
      already relayed (no relay task: the M-tile table is all zeros, and the flags every up
      tile waits for hold the epoch before the launch), ``k`` = hidden, 2048 act columns,
      storing ``h`` (FP32) and ``act``, or ``act`` alone;
    * ``relay``: kernel A with no up tile (ffn 0), each M-tile's rows flagged as arrived and
      copied from landing rows of their own;
    * ``down``: kernel B with no token to reduce, ``k`` = ffn, hidden 4096: down tiles into a
      heap of this process's, each M-tile's last one publishing its ``done`` flag;
    * ``down_y``: the same storing each tile into ``y`` too (a training forward's kernel B).

    Each launch waits on the device behind ``timing.cu``'s ``hold_stream`` (as ``tune
    validate``'s forwards do), so it starts as the device reaches it, not as the host gets
    there; where the processes sharing the GPU measure at once, kernel A's runs wait behind a
    device barrier of theirs too (``release``, :func:`~ultraep.tune.replicas.measure_shared`):
    a layer's kernel A starts as every rank leaves such a barrier. A run's CTAs at work are
    the SMs its tasks started on in the first half of its span; a tile's time is the tile
    phase's span (first tile's claim to the last tile's end, from the timeline the kernels
    stamp) over its waves on those CTAs (the model runs its waves over the CTAs at work: a
    tile time over the grid's waves would count a lag twice); a relay's, the mean relay
    task."""

    def __init__(self, cp, device: int, task: str, k: int, max_grid: int, l2_bytes: int,
                 memory_bytes: int | None = None):
        from ultraep.compute.device import _TensorMaps
        from ultraep.runtime.kernels import get_function, kernel_constant

        if task not in ("up", "up_act", "relay", "down", "down_y"):
            raise ProfileError(f"no fused task {task!r}")
        self.cp, self.device, self.task, self.key = cp, device, task, (task, k)
        constant = lambda name: kernel_constant(FUSED_KERNELS, name)  # noqa: E731
        self.bm, self.box, self.bands = constant("FM_BM"), constant("GH_BOX"), constant("FM_ARRIVAL_BANDS")
        self.kind = constant({"up": "FM_KIND_UP", "up_act": "FM_KIND_UP", "relay": "FM_KIND_RELAY",
                              "down": "FM_KIND_DOWN", "down_y": "FM_KIND_DOWN"}[task])
        self.kernel_name = "fused_down_combine" if task.startswith("down") else "fused_dispatch_up"
        self.tiles_per_slot = 0 if task == "relay" else (FUSED_SLOT_ROWS // self.bm) * FUSED_COLUMN_BLOCKS
        self.tasks_per_slot = self.tiles_per_slot or FUSED_SLOT_ROWS // self.bm
        self.trace_words = constant("FM_TRACE_WORDS")
        if task.startswith("down"):
            self.ffn, self.hidden = k, FUSED_COLUMN_BLOCKS * constant("FM_DOWN_COLS")
        else:
            self.ffn, self.hidden = 0 if task == "relay" else FUSED_COLUMN_BLOCKS * constant("FM_UP_COLS"), k
        waves = FUSED_RELAY_WAVES if task == "relay" else FUSED_TILE_WAVES
        self.slots = self.slots_for(max_grid, waves)
        while memory_bytes is not None and self.slots > 1 and self.buffer_bytes(self.slots, l2_bytes) > memory_bytes:
            self.slots -= 1
        self.waves = waves
        self.pools = {}  # a tile operand's tensor map argument: its pool
        rows = self.slots * FUSED_SLOT_ROWS
        self.threads, self.shared_bytes = constant("GH_THREADS"), constant("FM_SMEM_BYTES")
        self.kernel = get_function(FUSED_KERNELS, self.kernel_name)
        self.hold = get_function("timing.cu", "hold_stream")
        with cp.cuda.Device(device):
            self.kernel.max_dynamic_shared_size_bytes = self.shared_bytes
            maps = _TensorMaps()
            m_tiles = rows // self.bm
            self.epoch = 0
            self.counter = cp.zeros(constant("FM_COUNTERS"), np.int32)  # kernel A's streams; B's claims: word 0
            self.status = cp.zeros(constant("FM_STATUS_WORDS"), np.int64)
            self.outcome = cp.zeros(1, np.int32)  # the token map's verdict: OK
            self.trace = cp.zeros((self.slots * self.tasks_per_slot, self.trace_words), np.uint64)
            ffn, hidden = self.ffn, self.hidden
            if task.startswith("down"):
                self._pools(maps, l2_bytes, "act_map", ffn, "w_down_map", (ffn, hidden))
                self.heap, offsets = _carve(cp, (("expert_out", rows * hidden * 2), ("done", m_tiles * 8)))
                self.flags = None
                self.down_count = cp.zeros(m_tiles, np.int32)
                self.y = cp.empty((rows, hidden), np.int16) if task == "down_y" else None
                self.fixed = dict(ffn=np.int32(ffn), hidden=np.int32(hidden),
                                  expert_out_offset=np.uint64(offsets["expert_out"]),
                                  done_offset=np.uint64(offsets["done"]), down_count=self.down_count)
            else:
                parts = [("landing", rows * hidden * 2), ("row_landing", rows * 4), ("row_flag", rows * 8)]
                self.heap, offsets = _carve(cp, parts if task == "relay" else parts[:1])
                if task == "relay":  # every row lands in a row of its own, as a layer's do
                    self.recv = cp.empty((rows, hidden), np.int16)
                    self.heap[:rows * hidden * 2].view(np.int16)[:] = _bf16_bits(cp, (rows * hidden,), seed=k)
                    landing = self.heap[offsets["row_landing"]:offsets["row_landing"] + rows * 4].view(np.int32)
                    landing[:] = cp.arange(rows, dtype=np.int32)
                    self.flags = self.heap[offsets["row_flag"]:offsets["row_flag"] + rows * 8].view(np.uint64)
                    recv_map = maps.tiled(self.recv.data.ptr, (hidden, rows), (self.box, self.bm))
                    tiles_maps = dict(recv_map=recv_map, w_up_map=recv_map)  # no tile reads them
                else:
                    self.recv = self._pools(maps, l2_bytes, "recv_map", hidden, "w_up_map", (hidden, 2 * ffn))
                    self.flags = None
                    tiles_maps = {}
                self.tile_ready = cp.zeros(m_tiles, np.uint64)
                self.act = cp.empty((rows, max(ffn, 1)), np.int16)
                self.h = cp.empty((rows, 2 * ffn), np.float32) if task == "up" else None
                self.fixed = dict(tiles_maps,
                                  x=self.recv, hidden=np.int32(hidden), landing_offset=np.uint64(0),
                                  weight_offset=np.uint64(0),
                                  row_landing_offset=np.uint64(offsets.get("row_landing", 0)),
                                  origin_offset=np.uint64(0), row_flag_offset=np.uint64(offsets.get("row_flag", 0)),
                                  max_tokens=np.int32(rows), max_rows=np.int32(rows), recv=self.recv,
                                  tile_ready=self.tile_ready, ffn=np.int32(ffn), act=self.act,
                                  h=np.uint64(0) if self.h is None else self.h)
            self.bases = cp.asarray(np.array([self.heap.data.ptr], dtype=np.uint64))
            unread = self.counter  # sends and reduces only read these, and no token is sent or reduced
            self.fixed.update(peer_bases=self.bases, me=np.int32(0), tokens=np.int32(0), top_k=np.int32(1), ids=unread,
                              gates=unread, positions=unread, base=unread, timeout_ns=np.uint64(FUSED_TIMEOUT_NS),
                              counter=self.counter, status=self.status, outcome=self.outcome, trace=self.trace)
            if task.startswith("down"):
                self.fixed.update(out=unread, y=np.uint64(0) if self.y is None else self.y)
            self._prepare(max_grid)[0](None)  # warm-up: the module's first launch, the buffers' first touch
            cp.cuda.get_current_stream().synchronize()

    def buffer_bytes(self, slots: int, l2_bytes: int) -> int:
        """The bytes of the buffers made below for runs of ``slots`` slots (the pools' at
        ``l2_bytes``), to the few KB of counters and tables."""
        rows, ffn, hidden = slots * FUSED_SLOT_ROWS, self.ffn, self.hidden
        row_bytes = self.trace_words * 8 * self.tasks_per_slot / FUSED_SLOT_ROWS + 8 / self.bm  # trace, flags
        if self.task.startswith("down"):
            row_bytes += hidden * 2 * (2 if self.task == "down_y" else 1) + 4 / self.bm
            operands = ((FUSED_SLOT_ROWS, ffn), (ffn, hidden))
        else:
            row_bytes += hidden * 2 + max(ffn, 1) * 2 + (2 * ffn * 4 if self.task == "up" else 0)
            if self.task == "relay":
                row_bytes += hidden * 2 + 4 + 8  # recv, row_landing, row_flag
            operands = () if self.task == "relay" else ((FUSED_SLOT_ROWS, hidden), (hidden, 2 * ffn))
        pools = sum(2 * a * b * OperandPool.slot_count((a, b), touched, l2_bytes, slots)
                    for (a, b), touched in zip(operands, (1, FUSED_COLUMN_BLOCKS)))
        return int(rows * row_bytes) + pools

    def _pools(self, maps, l2_bytes: int, rows_map: str, k: int, weights_map: str, weight_slot: tuple[int, int]):
        """The tiles' operand pools: their rows (``rows_map``, a slot's :data:`FUSED_SLOT_ROWS`
        rows of ``k``; a run reads every row of its slots) and their weights
        (``weights_map``, slots of ``weight_slot``; a run reads a column block of each of its
        slots at least). Returns the rows' buffer (kernel A's ``recv``)."""
        rows = OperandPool(self.cp, (FUSED_SLOT_ROWS, k), 1, l2_bytes, self.slots,
                           lambda pointer, slots: maps.tiled(pointer, (k, slots * FUSED_SLOT_ROWS),
                                                             (self.box, self.bm)))
        weights = OperandPool(self.cp, weight_slot, FUSED_COLUMN_BLOCKS, l2_bytes, self.slots,
                              lambda pointer, slots: maps.tiled(pointer, (weight_slot[1], weight_slot[0], slots),
                                                                (self.box, self.box, 1)))
        self.pools = {rows_map: rows, weights_map: weights}
        return rows.data

    def slots_for(self, grid: int, waves: int) -> int:
        return max(1, -(-waves * grid // self.tasks_per_slot))

    def _prepare(self, grid: int):
        """A launch on ``grid`` CTAs over enough slots for the run's waves, its flags and
        counters reset: ``(launch, tasks)``."""
        cp = self.cp
        slots = min(self.slots, self.slots_for(grid, self.waves))
        self.epoch += 1
        epoch = np.uint64(self.epoch)
        if self.flags is not None:
            self.flags.fill(epoch)  # every relayed row has arrived
        if self.task in ("up", "up_act"):
            self.tile_ready.fill(epoch)  # every M-tile is relayed
        self.counter.fill(0)
        self.trace.fill(0)
        m_tiles = FUSED_SLOT_ROWS // self.bm
        offsets = np.arange(slots + 1, dtype=np.int32)
        # a run of up tiles has no relay task: its M-tile table is all zeros (the flags are set)
        mtiles = np.zeros(slots + 1, np.int32) if self.task in ("up", "up_act") else offsets * m_tiles
        values = dict(self.fixed, spr=np.int32(slots), rank_off=cp.asarray(offsets * FUSED_SLOT_ROWS),
                      rank_mtile=cp.asarray(mtiles), epoch=epoch)
        if self.kernel_name == "fused_dispatch_up":  # one sender (no token to send); M-tiles slot by slot
            runs = self.bands * slots
            if self.task == "relay":  # relays alone: the order only
                starts, order = np.zeros(runs + 1, np.int32), np.arange(slots * m_tiles, dtype=np.int32)
            else:  # each slot's M-tiles one run of band 0, numbered within the slot as the all-zero table has them
                starts = np.minimum(np.arange(runs + 1), slots) * m_tiles
                order = np.tile(np.arange(m_tiles, dtype=np.int32), slots)
            values.update(arrival=cp.asarray(np.concatenate([starts, order]).astype(np.int32)), send_ctas=np.int32(1))
        values.update({name: pool.next_map(slots) for name, pool in self.pools.items()})
        arguments = ordered_arguments(FUSED_KERNELS, self.kernel_name, values)

        def launch(release):
            self.hold((1,), (1,), (np.uint64(FUSED_HOLD_NS),))
            if release is not None:
                release()
            self.kernel((grid,), (self.threads,), arguments, shared_mem=self.shared_bytes)
        return launch, slots * self.tasks_per_slot

    def rounds(self, grid: int, together, release=None) -> list[FusedRound]:
        """:data:`FUSED_ROUNDS` launches on ``grid`` CTAs, each after ``together()`` and on the
        device after ``release()`` where given (it enqueues what the launch waits for, between
        the hold and the kernel): per launch the task's time, the CTAs at work -- those
        (distinct SMs) that started a task in the first half of the run: a CTA that found no
        SM free until others ended starts late; a tile's time is over its waves on those --
        and its first task's start."""
        cp = self.cp
        rounds = []
        with cp.cuda.Device(self.device):
            for _ in range(FUSED_ROUNDS):
                launch, tasks = self._prepare(grid)
                cp.cuda.get_current_stream().synchronize()  # the resets are done before the barrier
                together()
                launch(release)
                cp.cuda.get_current_stream().synchronize()
                status = [int(v) for v in self.status.get()]
                if status[0]:
                    raise ProfileError(f"the fused kernels' {self.task} probe on {grid} CTAs recorded status {status} "
                                       "(a flag wait timed out: the probe's set-up is wrong)")
                start, end, where = (column[:tasks] for column in cp.asnumpy(self.trace).T)
                mine = (where >> np.uint64(32)) == self.kind
                if not mine.any() or not (start[mine].all() and end[mine].all()):
                    raise ProfileError(f"the fused kernels' {self.task} probe on {grid} CTAs left tasks unstamped")
                first, last = int(start[mine].min()), int(end[mine].max())
                early = mine & (start < np.uint64(first + (last - first) // 2))
                at_work = len(np.unique(where[early] & np.uint64(0xFFFFFFFF)))
                if self.task == "relay":
                    seconds = float(np.mean((end[mine] - start[mine]).astype(np.float64))) * 1e-9
                else:
                    seconds = (last - first) * 1e-9 / math.ceil(int(mine.sum()) / at_work)
                rounds.append(FusedRound(seconds, at_work, first))
        return rounds


class OperandPool:
    """One tile operand in slots of ``slot_shape`` (BF16) that a probe's launches walk
    through, each launch the slots after the last one's, from the start again where they do
    not fit: enough slots that between two launches on one slot the others have touched
    :data:`FUSED_COLD_L2S` times ``l2_bytes`` (a run touching a ``1 / touched`` part of each of
    its slots at least), besides two runs' slots (a walk that wraps skips at most one run's).
    ``map_at(pointer, slots)``: the operand's tensor map of ``slots`` slots from ``pointer``."""

    def __init__(self, cp, slot_shape: tuple[int, int], touched: int, l2_bytes: int, run_slots: int, map_at):
        self.slot_bytes = 2 * slot_shape[0] * slot_shape[1]
        self.slots = self.slot_count(slot_shape, touched, l2_bytes, run_slots)
        self.data = cp.empty((self.slots * slot_shape[0], slot_shape[1]), np.int16)
        for slot in range(self.slots):  # slot by slot: the FP32 draws of the whole pool need not fit
            self.data[slot * slot_shape[0]:(slot + 1) * slot_shape[0]] = _bf16_bits(cp, slot_shape,
                                                                                    seed=slot_shape[0] + slot)
        self.map_at, self.next_slot = map_at, 0

    @staticmethod
    def slot_count(slot_shape: tuple[int, int], touched: int, l2_bytes: int, run_slots: int) -> int:
        return -(-FUSED_COLD_L2S * l2_bytes * touched // (2 * slot_shape[0] * slot_shape[1])) + 2 * run_slots

    def next_map(self, slots: int):
        """The tensor map of a launch over ``slots`` slots."""
        first = self.next_slot if self.next_slot + slots <= self.slots else 0
        self.next_slot = first + slots
        return self.map_at(self.data.data.ptr + first * self.slot_bytes, slots)


def _carve(cp, parts):
    """One device buffer holding ``parts`` ((name, bytes), each 256-byte aligned): a
    process's heap as the kernels address it (offsets from its base); the offsets by name."""
    offsets, total = {}, 0
    for name, size in parts:
        offsets[name] = total
        total += -(-size // 256) * 256
    return cp.zeros(total, np.uint8), offsets
