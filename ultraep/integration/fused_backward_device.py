"""Device launcher of the fused MoE backward: ``raw_kernels/fused_moe_backward.cu`` on the
caller's stream, with the fused forward's flags, epoch counter and status words.

Per backward, all enqueued on the stream with no host round trip: the heap barrier it opens
with (:mod:`ultraep.integration.fused_backward`: after it no rank's earlier kernel still
reads what this call rewrites; :meth:`DeviceFusedBackward.check` reports its timeout) ->
``fused_grad_dispatch_dgrad`` (send dy and dgrad-down tiles with SwiGLU's backward,
claimed by the blocks; relays of grad_y rows and gate gradients on their store warps) ->
``fused_dgrad_combine`` (dgrad-up tiles into the heap's ``expert_out``, slot-order reduce
into dx, gate gradients). Both place each pair's row in
its rank's M-tiles by the rank tiles of its own forward's plan (kept in the layer's
context; a later forward writes its own). The task semantics, the flags and the argument
that no claim order deadlocks are :mod:`ultraep.integration.fused_backward`'s.

While :meth:`DeviceFusedBackward.record_timeline` is on, both kernels stamp every task's
start (before its wait), end and SM into trace buffers sized by the backward's most tasks,
as the forward's kernels do; off, they get null and stamp nothing.
"""

from __future__ import annotations

import numpy as np

from ultraep.errors import BarrierTimeout, MoELayerError
from ultraep.integration import fused
from ultraep.integration.fused_backward import KERNELS, KINDS, max_tasks, opening_barrier_timeout
from ultraep.integration.fused_device import trace_rows
from ultraep.runtime.dtypes import BFLOAT16, cupy_dtype
from ultraep.runtime.kernels import get_function, kernel_constant


class DeviceFusedBackward:
    """The fused backward of one ``MoELayer`` on its GPU; ``forward``: the layer's
    :class:`~ultraep.integration.fused_device.DeviceFusedForward` (its flags, tile_ready,
    epoch, status and tensor maps serve both directions)."""

    def __init__(self, forward):
        import cupy

        for mine, theirs in (("FB_BM", "FM_BM"), ("FB_DOWN_COLS", "FM_DOWN_COLS")):  # they index the same flags
            if kernel_constant(KERNELS, mine) != kernel_constant(fused.KERNELS, theirs):
                raise MoELayerError(f"{KERNELS} {mine} must equal {fused.KERNELS} {theirs}: the backward indexes "
                                    "the forward's flags")
        if forward.spr > kernel_constant(KERNELS, "FB_MAX_SLOTS"):
            raise MoELayerError(f"the fused backward holds at most {kernel_constant(KERNELS, 'FB_MAX_SLOTS')} slots "
                                f"per rank, the layer has {forward.spr}")
        self.cp, self.forward = cupy, forward
        self.k = {name: get_function(KERNELS, name, group=forward.group)
                  for name in ("fused_grad_dispatch_dgrad", "fused_dgrad_combine")}
        for kernel in self.k.values():
            kernel.max_dynamic_shared_size_bytes = forward.shared_bytes
        self.counters = cupy.zeros(3, dtype=np.int32)  # kernel C's claims and relays, kernel D's claims
        self.bn = kernel_constant(KERNELS, "GH_BN")
        self.traces = None  # per kernel: [tasks, FM_TRACE_WORDS] uint64 when recording a timeline

    def backward(self, dy, received, rank_tiles, h, y, w_up, w_down):
        """Collective, on the current stream: ``dy [T, H]`` BF16, ``received`` and ``rank_tiles``
        the forward's DispatchResult and rank tiles, ``h [max_recv_rows, 2F]`` FP32 and
        ``y [max_recv_rows, H]`` BF16 of this rank's receive rows, the stacked weights. Returns
        ``(dx [T, H], d_gates [T, K], grad_y [max_recv_rows, H], dh [max_recv_rows, 2F])``
        (rows past the received ones undefined). With ``sync_checks`` it waits and raises a
        recorded timeout here, else :meth:`check` does."""
        cp, fwd = self.cp, self.forward
        d, b, s = fwd.config, fwd.impl.buffers, received.handle.state
        H, F, spr, rows = fwd.hidden, fwd.ffn, fwd.spr, d.max_recv_rows
        fwd.impl.heap.barrier(d.timeout_s, wait=False)  # every rank's earlier kernels are done
        rank_off, rank_mtile = rank_tiles
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
        traces = (np.uint64(0), np.uint64(0))  # null: no timeline
        if self.traces is not None:
            for trace in self.traces:
                trace.fill(0)
            traces = self.traces
        bases = fwd.impl.heap.peer_bases
        # the forward's CTAs for these tokens: the same footprint (one CTA an SM) meets the same SM shares
        ctas = fwd.schedule.for_tokens(tokens).ctas
        self.k["fused_grad_dispatch_dgrad"]((ctas,), (fwd.threads,), (
            grad_y_map, w_down_map, dy, np.int32(tokens), np.int32(d.top_k), np.int32(H), s["ids"], s["gates"],
            s["positions"], s["base"], bases, np.uint64(b.landing.offset), np.uint64(b.row_weight.offset),
            np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset), np.uint64(fwd.row_flag.offset),
            np.uint64(b.slot_grad_w.offset), np.int32(d.rank), np.int32(spr), np.int32(d.max_tokens), rank_off,
            rank_mtile, s["row_landing"], s["row_weight"], s["row_origin"], cp.ascontiguousarray(y), grad_y,
            fwd.tile_ready, np.int32(F), cp.ascontiguousarray(h), dh, epoch, timeout, self.counters[:2], fwd.status,
            s["outcome"], traces[0]), shared_mem=fwd.shared_bytes)
        self.k["fused_dgrad_combine"]((ctas,), (fwd.threads,), (
            dh_map, w_up_map, np.int32(F), np.int32(H), bases, np.uint64(b.expert_out.offset),
            np.uint64(fwd.done.offset), np.uint64(b.slot_grad_w.offset), np.int32(d.rank), np.int32(spr), rank_off,
            rank_mtile, s["ids"], s["positions"], s["base"], np.int32(tokens), np.int32(d.top_k), dx, d_gates,
            fwd.down_count, epoch, timeout, self.counters[2:], fwd.status, s["outcome"], traces[1]),
            shared_mem=fwd.shared_bytes)
        if d.sync_checks:
            self.check()
        return dx, d_gates, grad_y, dh

    def record_timeline(self, enable: bool) -> None:
        """Whether later backwards stamp each task's start, end and SM (:meth:`timeline`)."""
        if not enable:
            self.traces = None
            return
        fwd, words = self.forward, kernel_constant(KERNELS, "FM_TRACE_WORDS")
        counts = max_tasks(max_tokens=fwd.config.max_tokens, max_recv_rows=fwd.config.max_recv_rows,
                           slots_per_rank=fwd.spr, hidden=fwd.hidden, ffn=fwd.ffn)
        self.traces = tuple(self.cp.zeros((n, words), dtype=np.uint64) for n in counts)

    def timeline(self) -> list:
        """The last recorded backward's tasks as (kind, start ns, end ns, SM id), by start
        (waits for the device); kinds send, relay, dgrad_down (kernel C), dgrad_up, reduce (D)."""
        return trace_rows(self.traces, KINDS)

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
