"""The fused MoE layer on the device backend: the launchers of ``raw_kernels/fused_moe.cu``
(kernels A and B, :class:`DeviceFusedForward`) and ``raw_kernels/fused_moe_backward.cu``
(kernels C and D, :class:`DeviceFusedBackward`) on the caller's stream. The task
semantics, the flags and the argument that no claim order deadlocks are
:mod:`ultraep.compute.fused.forward`'s and :mod:`ultraep.compute.fused.backward`'s.

Per forward, after the Dispatcher's token map (``DeviceDispatcher.token_map``, its count
exchange and barrier included): ``fused_plan`` (every rank's offsets and M-tile starts
and this rank's arrival order into this call's own TilePlan, which its backward reads
again; the counters zeroed) -> ``fused_dispatch_up`` (sends claimed first by the config's
``send_ctas`` first blocks and by the others while their next tile's rows are not there, up
tiles with the SwiGLU epilogue by every block, relays by their store warps, each from a
counter of its own) -> ``fused_down_combine``
(down tiles into the heap's ``expert_out``, slot-order reduce).

Per backward, all enqueued on the stream with no host round trip, with the forward's flags,
epoch counter and status words: the heap barrier it opens with (after it no rank's earlier
kernel still reads what this call rewrites; :meth:`DeviceFusedBackward.check` reports its
timeout) -> ``fused_grad_dispatch_dgrad`` (send dy and dgrad-down tiles with SwiGLU's
backward, claimed by the blocks; relays of grad_y rows and gate gradients on their store
warps) -> ``fused_dgrad_combine`` (dgrad-up tiles into the heap's ``expert_out``,
slot-order reduce into dx, gate gradients). Both place each pair's row in its rank's
M-tiles by the TilePlan of its own forward (kept in the layer's context; a later forward
writes its own).

Heap tensors (beside the Dispatcher's, which must be set up with ``expert_output=True``):
``row_flag [max_recv_rows]`` and ``done [max_m_tiles]`` uint64 epoch flags, zeroed once at
set-up; a flag equals the current epoch only once this call set it, so nothing is reset
between calls.

A forward runs with its token bucket's :class:`~ultraep.compute.fused.config.FusedConfig`
(the layer's ``FusedSchedule``): its ``ctas`` blocks, at most one per SM this process may
use (the stage ring fills an SM's shared memory; any number resident is correct), and the
kernel module variant compiled with its task sizes and unrolls; every variant of the
schedule is loaded at set-up, collectively, so no call compiles. A backward runs on the
forward's CTAs and senders for its tokens.

While ``record_timeline`` is on, the kernels stamp every task's start (before its wait),
end and SM into trace buffers sized by the most tasks they can have; off, they get null and
stamp nothing.
"""

from __future__ import annotations

import numpy as np

from ultraep.compute.fused.backward import KERNELS as BACKWARD_KERNELS
from ultraep.compute.fused.backward import KINDS as BACKWARD_KINDS
from ultraep.compute.fused.backward import max_tasks as backward_max_tasks
from ultraep.compute.fused.backward import opening_barrier_timeout
from ultraep.compute.fused.config import FusedSchedule
from ultraep.compute.fused.forward import KERNELS as FORWARD_KERNELS
from ultraep.compute.fused.forward import KINDS as FORWARD_KINDS
from ultraep.compute.fused.forward import Granularity, TilePlan, max_m_tiles
from ultraep.compute.fused.forward import max_tasks as forward_max_tasks
from ultraep.errors import BarrierTimeout, MoELayerError, WaitTimeout
from ultraep.runtime.dtypes import BFLOAT16, cupy_dtype
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.runtime.sm_partition import usable_sms

B_COUNTER = kernel_constant(FORWARD_KERNELS, "FM_COUNTERS") - 1  # kernel B's (D's) claims; kernel A's (C's) before it
FLAG_NAMES = {kernel_constant(FORWARD_KERNELS, "FM_ROW_FLAG"): "row_flag (a receive row's arrival from its sender)",
              kernel_constant(FORWARD_KERNELS, "FM_TILE_READY"): "tile_ready (an M-tile's rows relayed)",
              kernel_constant(FORWARD_KERNELS, "FM_TILE_DONE"): "done (a down tile's output rows written)"}


def resident_ctas(device: int) -> int:
    """The fused kernels' CTAs resident at once on ``device``: one per SM this process may
    use (its green context's, or under an MPS thread percentage the share's)."""
    return usable_sms(device)


class TaskTrace:
    """The timeline buffers of a pair of fused kernels: while recording, one ``[tasks,
    FM_TRACE_WORDS]`` uint64 array per kernel, each task's [start ns, end ns, SM | kind << 32]
    stamped by the kernel; otherwise null pointers, and the kernels stamp nothing."""

    def __init__(self, kinds: dict):
        self.kinds, self.buffers = kinds, None  # kinds: the kernels' kind codes -> names

    def record(self, enable: bool, counts=()) -> None:
        """Start (``counts``: the most tasks of each kernel) or stop recording."""
        import cupy

        words = kernel_constant(FORWARD_KERNELS, "FM_TRACE_WORDS")
        self.buffers = tuple(cupy.zeros((int(n), words), dtype=np.uint64) for n in counts) if enable else None

    def arguments(self) -> tuple:
        """The two kernels' trace arguments for a launch: the cleared buffers, or nulls."""
        if self.buffers is None:
            return np.uint64(0), np.uint64(0)
        for buffer in self.buffers:
            buffer.fill(0)
        return self.buffers

    def rows(self) -> list:
        """The last recorded call's tasks as (kind, start ns, end ns, SM id), by start (waits
        for the device)."""
        import cupy

        rows = []
        for buffer in self.buffers or ():
            for start, end, where in cupy.asnumpy(buffer):
                if start:
                    rows.append((self.kinds[int(where) >> 32], int(start), int(end), int(where) & 0xFFFFFFFF))
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
        most = kernel_constant(FORWARD_KERNELS, "FM_MAX_SLOTS")
        if spr > most:
            raise MoELayerError(f"the fused kernels hold at most {most} slots per rank, the layer has {spr}")
        self.hidden, self.ffn, self.spr, self.config = hidden, ffn, spr, d
        self.timeout_ns = int(timeout_s * 1e9)
        self.shared_bytes = kernel_constant(FORWARD_KERNELS, "FM_SMEM_BYTES")
        self.threads = kernel_constant(FORWARD_KERNELS, "GH_THREADS")
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
        # kernel A's streams and sender ticket, then kernel B's claims
        self.counters = cupy.zeros(kernel_constant(FORWARD_KERNELS, "FM_COUNTERS"), dtype=np.int32)
        self.status = cupy.zeros(kernel_constant(FORWARD_KERNELS, "FM_STATUS_WORDS"), dtype=np.int64)
        tiles = max_m_tiles(d.max_recv_rows, spr)
        self.arrival_size = kernel_constant(FORWARD_KERNELS, "FM_ARRIVAL_BANDS") * spr + 1 + tiles
        self.tile_ready = cupy.zeros(tiles, dtype=np.uint64)
        self.down_count = cupy.zeros(tiles, dtype=np.int32)
        self.epoch = 0
        self.maps = _TensorMaps()
        self.box = kernel_constant(FORWARD_KERNELS, "GH_BOX")
        self.bm = kernel_constant(FORWARD_KERNELS, "GH_BM")
        self.trace = TaskTrace(FORWARD_KINDS)

    def forward(self, x, ids, gates, w_up, w_down, keep: bool = True):
        """Collective, on the current stream; ``x``, ``ids``, ``gates`` checked CuPy arrays,
        ``w_up [slots, H, 2F]`` / ``w_down [slots, F, H]`` the stacked BF16 weights. Returns
        ``(out [T, H], received, act [max_recv_rows, F], h [max_recv_rows, 2F] FP32, y
        [max_recv_rows, H], tiles)``: ``received`` the Dispatcher's
        result (its handle serves the sequential backward); h and y are what the backward
        needs of the forward, the up tiles' accumulators and the down tiles' outputs (stored
        into y beside the heap's expert_out, which the next call overwrites), both None
        unless ``keep``; ``tiles`` the :class:`TilePlan` of this call's own (a later forward
        leaves it alone) for its backward. With ``sync_checks`` it waits and raises a recorded wait
        timeout here, else :meth:`check` does."""
        cp, d, b = self.cp, self.config, self.impl.buffers
        H, F, spr = self.hidden, self.ffn, self.spr
        config = self.schedule.for_tokens(x.shape[0])
        kernels = self.variants[config.defines()]
        self.epoch += 1
        x, state = self.impl.token_map(x, ids, gates)
        table_cols = d.num_experts + d.size + kernel_constant("dispatch.cu", "BAD_RECORD_FIELDS")
        tiles = TilePlan(cp.empty((2, d.size, spr + 1), dtype=np.int32), cp.empty(self.arrival_size, dtype=np.int32))
        rank_off, rank_mtile = tiles.rank_tiles
        self.k["fused_plan"]((1,), (kernel_constant(FORWARD_KERNELS, "FM_PLAN_THREADS"),), (
            self.impl.local["count_table"], np.int32(d.size), np.int32(d.num_experts), np.int32(table_cols),
            np.int32(spr), np.int32(d.rank), rank_off, rank_mtile, tiles.arrival, self.counters, self.down_count,
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
        traces = self.trace.arguments()
        bases = self.impl.heap.peer_bases
        kernels["fused_dispatch_up"]((config.ctas,), (self.threads,), (
            recv_map, w_up_map, x, np.int32(state["tokens"]), np.int32(d.top_k), np.int32(H), state["ids"],
            state["gates"], state["positions"], state["base"], bases, np.uint64(b.landing.offset),
            np.uint64(b.row_weight.offset), np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset),
            np.uint64(self.row_flag.offset), np.int32(d.rank), np.int32(spr), np.int32(d.max_tokens), rank_off,
            rank_mtile, tiles.arrival, np.int32(config.send_ctas), np.int32(rows), recv, self.tile_ready, np.int32(F),
            act, kept_h, epoch, timeout, self.counters[:B_COUNTER], self.status, state["outcome"], traces[0]),
            shared_mem=self.shared_bytes)
        kernels["fused_down_combine"]((config.ctas,), (self.threads,), (
            act_map, w_down_map, np.int32(F), np.int32(H), bases, np.uint64(b.expert_out.offset),
            np.uint64(self.done.offset), np.int32(d.rank), np.int32(spr), rank_off, rank_mtile,
            state["ids"], state["positions"], state["base"], state["gates"], np.int32(state["tokens"]),
            np.int32(d.top_k), out, kept_y, self.down_count, epoch, timeout, self.counters[B_COUNTER:], self.status,
            state["outcome"],
            traces[1]),
            shared_mem=self.shared_bytes)
        received = self.impl.received(recv, state)
        if d.sync_checks:
            self.check()
        return out, received, act, h, y, tiles

    def _load(self, group, defines: tuple) -> dict:
        """Collective: the kernels of the module variant compiled with ``defines``."""
        kernels = {name: get_function(FORWARD_KERNELS, name, group=group, defines=defines)
                   for name in ("fused_plan", "fused_dispatch_up", "fused_down_combine")}
        for name in ("fused_dispatch_up", "fused_down_combine"):
            kernels[name].max_dynamic_shared_size_bytes = self.shared_bytes
        return kernels

    def record_timeline(self, enable: bool) -> None:
        """Whether later forwards stamp each task's start, end and SM (:meth:`timeline`)."""
        d = self.config
        counts = np.max([forward_max_tasks(max_tokens=d.max_tokens, max_recv_rows=d.max_recv_rows,
                                           slots_per_rank=self.spr, hidden=self.hidden, ffn=self.ffn,
                                           grain=Granularity.kernel(config))
                         for config in self.schedule.configs], axis=0)  # the smallest tasks: the most of them
        self.trace.record(enable, counts)

    def timeline(self) -> list:
        """The last recorded forward's tasks as (kind, start ns, end ns, SM id), by start
        (waits for the device)."""
        return self.trace.rows()

    def check(self) -> None:
        """Synchronise; raise (and clear) the fused kernels' first status record."""
        self.cp.cuda.get_current_stream().synchronize()
        code, what, rank, index, expected, seen, block, _ = (int(v) for v in self.status.get())
        if not code:
            return
        self.status.fill(0)
        if code == kernel_constant(FORWARD_KERNELS, "FM_FLAG_TIMED_OUT"):
            raise WaitTimeout(f"rank {self.config.rank}: fused MoE kernel block {block} waited over "
                              f"{self.timeout_ns / 1e9:g} s for flag {FLAG_NAMES.get(what, what)} index {index} on "
                              f"rank {rank} (expected epoch {expected}, saw {seen}); the outputs are not valid")
        raise MoELayerError(f"rank {self.config.rank}: fused MoE kernel pipeline record {code} (wait {what}, block "
                            f"{rank}, {index} ms): a stage wait gave up; the outputs are not valid")


class DeviceFusedBackward:
    """The fused backward of one ``MoELayer`` on its GPU; ``forward``: the layer's
    :class:`~ultraep.compute.fused.device.DeviceFusedForward` (its flags, tile_ready,
    epoch, status and tensor maps serve both directions)."""

    def __init__(self, forward):
        import cupy

        for mine, theirs in (("FB_BM", "FM_BM"), ("FB_DOWN_COLS", "FM_DOWN_COLS")):  # they index the same flags
            if kernel_constant(BACKWARD_KERNELS, mine) != kernel_constant(FORWARD_KERNELS, theirs):
                raise MoELayerError(f"{BACKWARD_KERNELS} {mine} must equal {FORWARD_KERNELS} {theirs}: the backward "
                                    "indexes the forward's flags")
        most = kernel_constant(BACKWARD_KERNELS, "FB_MAX_SLOTS")
        if forward.spr > most:
            raise MoELayerError(f"the fused backward holds at most {most} slots per rank, the layer has {forward.spr}")
        self.cp, self.forward = cupy, forward
        self.k = {name: get_function(BACKWARD_KERNELS, name, group=forward.group)
                  for name in ("fused_grad_dispatch_dgrad", "fused_dgrad_combine")}
        for kernel in self.k.values():
            kernel.max_dynamic_shared_size_bytes = forward.shared_bytes
        self.counters = cupy.zeros_like(forward.counters)  # kernel C's streams and ticket, kernel D's claims
        self.bn = kernel_constant(BACKWARD_KERNELS, "GH_BN")
        self.trace = TaskTrace(BACKWARD_KINDS)

    def backward(self, dy, received, tiles, h, y, w_up, w_down):
        """Collective, on the current stream: ``dy [T, H]`` BF16, ``received`` and ``tiles``
        the forward's DispatchResult and TilePlan, ``h [max_recv_rows, 2F]`` FP32 and
        ``y [max_recv_rows, H]`` BF16 of this rank's receive rows, the stacked weights. Returns
        ``(dx [T, H], d_gates [T, K], grad_y [max_recv_rows, H], dh [max_recv_rows, 2F])``
        (rows past the received ones undefined). With ``sync_checks`` it waits and raises a
        recorded timeout here, else :meth:`check` does."""
        cp, fwd = self.cp, self.forward
        d, b, s = fwd.config, fwd.impl.buffers, received.handle.state
        H, F, spr, rows = fwd.hidden, fwd.ffn, fwd.spr, d.max_recv_rows
        fwd.impl.heap.barrier(d.timeout_s, wait=False)  # every rank's earlier kernels are done
        rank_off, rank_mtile = tiles.rank_tiles
        fwd.epoch += 1  # one counter for both directions: a flag of either's earlier call is stale
        self.counters.fill(0)
        fwd.down_count.fill(0)  # as the forward's plan: a failed call may have left counts short
        bf16 = cupy_dtype(BFLOAT16)
        tokens = received.handle.tokens
        dy = cp.ascontiguousarray(dy)
        grad_y = cp.empty((rows, H), dtype=bf16)
        dh = cp.empty((rows, 2 * F), dtype=bf16)
        dx = cp.empty((tokens, H), dtype=bf16)
        d_gates = cp.empty((tokens, d.top_k), dtype=np.float32)
        box, bm, bn = fwd.box, fwd.bm, self.bn
        grad_y_map = fwd.maps.tiled(grad_y.data.ptr, (H, rows), (box, bm))
        w_down_map = fwd.maps.tiled(w_down.data.ptr, (H, F, spr), (box, bn, 1))
        dh_map = fwd.maps.tiled(dh.data.ptr, (2 * F, rows), (box, bm))
        w_up_map = fwd.maps.tiled(w_up.data.ptr, (2 * F, H, spr), (box, bn, 1))
        epoch, timeout = np.uint64(fwd.epoch), np.uint64(fwd.timeout_ns)
        traces = self.trace.arguments()
        bases = fwd.impl.heap.peer_bases
        # the forward's CTAs for these tokens: the same footprint (one CTA an SM) meets the same SM shares
        config = fwd.schedule.for_tokens(tokens)
        self.k["fused_grad_dispatch_dgrad"]((config.ctas,), (fwd.threads,), (
            grad_y_map, w_down_map, dy, np.int32(tokens), np.int32(d.top_k), np.int32(H), s["ids"], s["gates"],
            s["positions"], s["base"], bases, np.uint64(b.landing.offset), np.uint64(b.row_weight.offset),
            np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset), np.uint64(fwd.row_flag.offset),
            np.uint64(b.slot_grad_w.offset), np.int32(d.rank), np.int32(spr), np.int32(d.max_tokens), rank_off,
            rank_mtile, tiles.arrival, np.int32(config.send_ctas), s["row_landing"], s["row_weight"], s["row_origin"],
            cp.ascontiguousarray(y), grad_y, fwd.tile_ready, np.int32(F), cp.ascontiguousarray(h), dh, epoch, timeout,
            self.counters[:B_COUNTER], fwd.status, s["outcome"], traces[0]), shared_mem=fwd.shared_bytes)
        self.k["fused_dgrad_combine"]((config.ctas,), (fwd.threads,), (
            dh_map, w_up_map, np.int32(F), np.int32(H), bases, np.uint64(b.expert_out.offset),
            np.uint64(fwd.done.offset), np.uint64(b.slot_grad_w.offset), np.int32(d.rank), np.int32(spr), rank_off,
            rank_mtile, s["ids"], s["positions"], s["base"], np.int32(tokens), np.int32(d.top_k), dx, d_gates,
            fwd.down_count, epoch, timeout, self.counters[B_COUNTER:], fwd.status, s["outcome"], traces[1]),
            shared_mem=fwd.shared_bytes)
        if d.sync_checks:
            self.check()
        return dx, d_gates, grad_y, dh

    def record_timeline(self, enable: bool) -> None:
        """Whether later backwards stamp each task's start, end and SM (:meth:`timeline`)."""
        fwd = self.forward
        self.trace.record(enable, backward_max_tasks(max_tokens=fwd.config.max_tokens,
                                                     max_recv_rows=fwd.config.max_recv_rows, slots_per_rank=fwd.spr,
                                                     hidden=fwd.hidden, ffn=fwd.ffn))

    def timeline(self) -> list:
        """The last recorded backward's tasks as (kind, start ns, end ns, SM id), by start
        (waits for the device); kinds send, relay, dgrad_down (kernel C), dgrad_up, reduce (D)."""
        return self.trace.rows()

    def check(self) -> None:
        """Synchronise; raise a timeout of the opening barrier (the heap's first unreported
        one: on a heap shared with a Balancer it may be the Balancer's), dropping the fused
        kernels' record its absent peer caused, else the kernels' first record."""
        fwd = self.forward
        try:
            fwd.impl.heap.check_barriers()
        except BarrierTimeout as exc:
            fwd.status.fill(0)
            raise opening_barrier_timeout(fwd.config.rank, exc) from None
        fwd.check()
