"""Device launcher of the fused MoE forward: ``raw_kernels/fused_moe.cu`` on the caller's
stream, after the Dispatcher's token map (its count exchange and barrier included).

Per forward: ``DeviceDispatcher.token_map`` -> ``fused_plan`` (every rank's offsets and
M-tile starts into this call's own rank tiles, which its backward reads again; the
counters zeroed) -> ``fused_dispatch_up`` (send and up tiles with the SwiGLU epilogue
claimed by the blocks, relays claimed by their store warps from a counter of their own)
-> ``fused_down_combine`` (down tiles into the heap's
``expert_out``, slot-order reduce). The task semantics, the flags and the argument that
no claim order deadlocks are :mod:`ultraep.integration.fused`'s.

Heap tensors (beside the Dispatcher's, which must be set up with ``expert_output=True``):
``row_flag [max_recv_rows]`` and ``done [max_m_tiles]`` uint64 epoch flags,
zeroed once at set-up; a flag equals the current epoch only once this call set it, so
nothing is reset between calls.

A call runs with its token bucket's :class:`~ultraep.tune.config.FusedConfig` (the layer's
``FusedSchedule``): its ``ctas`` blocks, at most one per SM this process may use (the stage
ring fills an SM's shared memory; any number resident is correct), and the kernel module
variant compiled with its task sizes and unrolls; every variant of the schedule is loaded
at set-up, collectively, so no call compiles.
"""

from __future__ import annotations

import numpy as np

from ultraep.errors import MoELayerError, WaitTimeout
from ultraep.runtime.dtypes import BFLOAT16, cupy_dtype
from ultraep.integration.fused import KERNELS, KINDS, Granularity, max_m_tiles, max_tasks
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.tune.config import FusedSchedule

FLAG_NAMES = {kernel_constant(KERNELS, "FM_ROW_FLAG"): "row_flag (a receive row's arrival from its sender)",
              kernel_constant(KERNELS, "FM_TILE_READY"): "tile_ready (an M-tile's rows relayed)",
              kernel_constant(KERNELS, "FM_TILE_DONE"): "done (a down tile's output rows written)"}


def resident_ctas(device: int) -> int:
    """The fused kernels' CTAs resident at once on ``device``: one per SM this process may
    use (under MPS the device reports its share's SMs)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


def trace_rows(traces, kinds: dict) -> list:
    """The stamped tasks of a recorded call's trace buffers (None: not recording) as (kind,
    start ns, end ns, SM id), by start; ``kinds``: the kernels' kind codes -> names."""
    import cupy

    rows = []
    for trace in traces or ():
        for start, end, where in cupy.asnumpy(trace):
            if start:
                rows.append((kinds[int(where) >> 32], int(start), int(end), int(where) & 0xFFFFFFFF))
    return sorted(rows, key=lambda row: row[1])


class DeviceFusedForward:
    """The fused forward of one ``MoELayer`` on its GPU (a device-backend Dispatcher set up
    with ``expert_output=True``; ``flags``: the heap tensors of :func:`heap_requirements`;
    ``schedule``: the configuration per token bucket, every grid within
    :func:`resident_ctas`, checked by the caller on every rank)."""

    def __init__(self, group, dispatcher, flags: dict, *, hidden: int, ffn: int, timeout_s: float,
                 schedule: FusedSchedule):
        import cupy

        from ultraep.compute.device import _TensorMaps

        self.cp, self.group, self.dispatcher = cupy, group, dispatcher
        self.impl = dispatcher._impl
        d = dispatcher.config
        if not d.expert_output:
            raise MoELayerError("the fused layer needs a Dispatcher set up with expert_output=True")
        spr = d.experts_per_rank
        if spr > kernel_constant(KERNELS, "FM_MAX_SLOTS"):
            raise MoELayerError(f"the fused kernels hold at most {kernel_constant(KERNELS, 'FM_MAX_SLOTS')} slots "
                                f"per rank, the layer has {spr}")
        self.hidden, self.ffn, self.spr, self.config = hidden, ffn, spr, d
        self.timeout_ns = int(timeout_s * 1e9)
        self.shared_bytes = kernel_constant(KERNELS, "GH_SMEM_BYTES")
        self.threads = kernel_constant(KERNELS, "GH_THREADS")
        self.schedule = schedule
        # a config's defines -> its module variant's kernels; the plain module's run fused_plan
        self.k = self._load(group, ())
        self.variants = {(): self.k}
        for config in schedule.configs:  # in the schedule's order: the same collective loads on every rank
            if config.defines() not in self.variants:
                self.variants[config.defines()] = self._load(group, config.defines())
        self.row_flag, self.done = flags["row_flag"], flags["done"]
        self.row_flag.local.fill(0)
        self.done.local.fill(0)
        # kernel A's claims and its store warps' relays, then kernel B's claims
        self.counters = cupy.zeros(3, dtype=np.int32)
        self.status = cupy.zeros(kernel_constant(KERNELS, "FM_STATUS_WORDS"), dtype=np.int64)
        tiles = max_m_tiles(d.max_recv_rows, spr)
        self.tile_ready = cupy.zeros(tiles, dtype=np.uint64)
        self.down_count = cupy.zeros(tiles, dtype=np.int32)
        self.epoch = 0
        self.maps = _TensorMaps()
        self.box = kernel_constant(KERNELS, "GH_BOX")
        self.bm = kernel_constant(KERNELS, "GH_BM")
        self.traces = None  # per kernel: [tasks, FM_TRACE_WORDS] uint64 when recording a timeline

    def forward(self, x, ids, gates, w_up, w_down, keep: bool = True):
        """Collective, on the current stream; ``x``, ``ids``, ``gates`` checked CuPy arrays,
        ``w_up [slots, H, 2F]`` / ``w_down [slots, F, H]`` the stacked BF16 weights. Returns
        ``(out [T, H], received, act [max_recv_rows, F], h [max_recv_rows, 2F] FP32, y
        [max_recv_rows, H], rank_tiles [2, R, slots + 1])``: ``received`` the Dispatcher's
        result (its handle serves the sequential backward); h and y are what the backward
        needs of the forward, the up tiles' accumulators and the down tiles' outputs (stored
        into y beside the heap's expert_out, which the next call overwrites), both None
        unless ``keep``; ``rank_tiles``
        every rank's offsets and M-tile starts, this call's own (a later forward leaves them
        alone) for its backward. With ``sync_checks`` it waits and raises a recorded wait
        timeout here, else :meth:`check` does."""
        cp, d, b = self.cp, self.config, self.impl.buffers
        H, F, spr = self.hidden, self.ffn, self.spr
        config = self.schedule.for_tokens(x.shape[0])
        kernels = self.variants[config.defines()]
        self.epoch += 1
        x, state = self.impl.token_map(x, ids, gates)
        table_cols = d.num_experts + d.size + kernel_constant("dispatch.cu", "BAD_RECORD_FIELDS")
        rank_tiles = cp.empty((2, d.size, spr + 1), dtype=np.int32)
        rank_off, rank_mtile = rank_tiles
        self.k["fused_plan"]((1,), (kernel_constant(KERNELS, "FM_PLAN_THREADS"),), (
            self.impl.local["count_table"], np.int32(d.size), np.int32(d.num_experts), np.int32(table_cols),
            np.int32(spr), rank_off, rank_mtile, self.counters, self.down_count,
            np.int32(self.down_count.size)))
        self.impl.release_counts()  # no later barrier in this call protects the table from the next publish
        bf16 = cupy_dtype(BFLOAT16)
        rows = d.max_recv_rows
        recv = cp.empty((rows, H), dtype=bf16)
        act = cp.empty((rows, F), dtype=bf16)
        h = cp.empty((rows, 2 * F), dtype=np.float32) if keep else None
        y = cp.empty((rows, H), dtype=bf16) if keep else None
        kept_h = np.uint64(0) if h is None else h  # null: the up tiles store only act
        kept_y = np.uint64(0) if y is None else y  # null: the down tiles store only into the heap
        out = cp.empty((state["tokens"], H), dtype=bf16)
        box, bm = self.box, self.bm
        recv_map = self.maps.tiled(recv.data.ptr, (H, rows), (box, bm))
        w_up_map = self.maps.tiled(w_up.data.ptr, (2 * F, H, spr), (box, box, 1))
        act_map = self.maps.tiled(act.data.ptr, (F, rows), (box, bm))
        w_down_map = self.maps.tiled(w_down.data.ptr, (H, F, spr), (box, box, 1))
        epoch, timeout = np.uint64(self.epoch), np.uint64(self.timeout_ns)
        traces = (np.uint64(0), np.uint64(0))  # null: no timeline
        if self.traces is not None:
            for trace in self.traces:
                trace.fill(0)
            traces = self.traces
        bases = self.impl.heap.peer_bases
        kernels["fused_dispatch_up"]((config.ctas,), (self.threads,), (
            recv_map, w_up_map, x, np.int32(state["tokens"]), np.int32(d.top_k), np.int32(H), state["ids"],
            state["gates"], state["positions"], state["base"], bases, np.uint64(b.landing.offset),
            np.uint64(b.row_weight.offset), np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset),
            np.uint64(self.row_flag.offset), np.int32(d.rank), np.int32(spr), np.int32(d.max_tokens), rank_off,
            rank_mtile, np.int32(rows), recv, self.tile_ready, np.int32(F), act, kept_h, epoch, timeout,
            self.counters[:2],
            self.status, state["outcome"], traces[0]), shared_mem=self.shared_bytes)
        kernels["fused_down_combine"]((config.ctas,), (self.threads,), (
            act_map, w_down_map, np.int32(F), np.int32(H), bases, np.uint64(b.expert_out.offset),
            np.uint64(self.done.offset), np.int32(d.rank), np.int32(spr), rank_off, rank_mtile,
            state["ids"], state["positions"], state["base"], state["gates"], np.int32(state["tokens"]),
            np.int32(d.top_k), out, kept_y, self.down_count, epoch, timeout, self.counters[2:], self.status,
            state["outcome"],
            traces[1]),
            shared_mem=self.shared_bytes)
        received = self.impl.received(recv, state)
        if d.sync_checks:
            self.check()
        return out, received, act, h, y, rank_tiles

    def _load(self, group, defines: tuple) -> dict:
        """Collective: the kernels of the module variant compiled with ``defines``."""
        kernels = {name: get_function(KERNELS, name, group=group, defines=defines)
                   for name in ("fused_plan", "fused_dispatch_up", "fused_down_combine")}
        for name in ("fused_dispatch_up", "fused_down_combine"):
            kernels[name].max_dynamic_shared_size_bytes = self.shared_bytes
        return kernels

    def record_timeline(self, enable: bool) -> None:
        """Whether later forwards stamp each task's start, end and SM (:meth:`timeline`)."""
        if not enable:
            self.traces = None
            return
        d, words = self.config, kernel_constant(KERNELS, "FM_TRACE_WORDS")
        counts = np.max([max_tasks(max_tokens=d.max_tokens, max_recv_rows=d.max_recv_rows, slots_per_rank=self.spr,
                                   hidden=self.hidden, ffn=self.ffn, grain=Granularity.kernel(config))
                         for config in self.schedule.configs], axis=0)  # the smallest tasks: the most of them
        self.traces = tuple(self.cp.zeros((n, words), dtype=np.uint64) for n in counts)

    def timeline(self) -> list:
        """The last recorded forward's tasks as (kind, start ns, end ns, SM id), by start
        (waits for the device)."""
        return trace_rows(self.traces, KINDS)

    def check(self) -> None:
        """Synchronise; raise (and clear) the fused kernels' first status record."""
        self.cp.cuda.get_current_stream().synchronize()
        code, what, rank, index, expected, seen, block, _ = (int(v) for v in self.status.get())
        if not code:
            return
        self.status.fill(0)
        if code == kernel_constant(KERNELS, "FM_FLAG_TIMED_OUT"):
            raise WaitTimeout(f"rank {self.config.rank}: fused MoE kernel block {block} waited over "
                              f"{self.timeout_ns / 1e9:g} s for flag {FLAG_NAMES.get(what, what)} index {index} on "
                              f"rank {rank} (expected epoch {expected}, saw {seen}); the outputs are not valid")
        raise MoELayerError(f"rank {self.config.rank}: fused MoE kernel pipeline record {code} (wait {what}, block "
                            f"{rank}, {index} ms): a stage wait gave up; the outputs are not valid")
