"""The fused MoE layer on the host backend (NumPy over the MPI shared-memory heap): each
rank runs its own tasks of the semantics in :mod:`ultraep.compute.fused.forward` and
:mod:`ultraep.compute.fused.backward` as one CTA (:func:`~ultraep.compute.fused.forward.run_rank`:
its claims and relays), with the flags and the epoch counter in the heap as the device
kernels have them. The CPU backend of ``MoELayer(fused=True)`` and the reference the
kernels are held to bit for bit."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ultraep.compute.fused.backward import BackwardState, FusedBackward, granularity, opening_barrier_timeout
from ultraep.compute.fused.config import FusedSchedule
from ultraep.compute.fused.forward import (FusedLayer, Granularity, RankPlan, RankState, TilePlan, arrival_tables,
                                           max_m_tiles, mtile_starts, run_rank)
from ultraep.errors import BarrierTimeout
from ultraep.token import reference as ref


class HostTimeline:
    """What the host forward and backward share: a timeline of the last recorded call (each
    task's kind, start ns, end ns and worker, by start, as the device's ``TaskTrace``) and a
    ``check`` with nothing to do, since the host raises at once."""

    recording: bool = False
    last_timeline: list | None = None

    def record_timeline(self, enable: bool) -> None:
        """Whether later calls record when each task ran (:meth:`timeline`)."""
        self.recording = bool(enable)

    def timeline(self) -> list:
        """The last recorded call's tasks as (kind, start ns, end ns, worker), by start."""
        return sorted(self.last_timeline or [], key=lambda row: row[1])

    def check(self) -> None:
        """The host backend raises at once; nothing is deferred."""


class HostFusedForward(HostTimeline):
    """The fused forward on the host backend: this rank's tasks of the semantics above over
    the MPI shared-memory heap (peers' landing rows, row metadata, expert outputs and flags
    are their heap views), one CTA (:func:`run_rank`: its claims and relays), after the
    Dispatcher's token map, with the task sizes of ``schedule``'s configuration for the
    call's tokens."""

    def __init__(self, group, dispatcher, flags: dict, *, ffn: int, timeout_s: float, activation: Callable,
                 schedule: FusedSchedule):
        self.group, self.impl, self.config, self.schedule = group, dispatcher._impl, dispatcher.config, schedule
        self.ffn, self.timeout_s, self.activation = ffn, timeout_s, activation
        self.flags = flags
        for tensor in flags.values():
            tensor.local[...] = 0
        self.grain = Granularity.kernel()  # the tile geometry; a call's task sizes are its bucket's (schedule)
        tiles = max_m_tiles(self.config.max_recv_rows, self.config.experts_per_rank)
        self.tile_ready, self.down_count = np.zeros(tiles, np.uint64), np.zeros(tiles, np.int64)
        self.epoch = 0

    def forward(self, x, ids, gates, w_up, w_down, keep: bool = True):
        """As :meth:`~ultraep.compute.fused.device.DeviceFusedForward.forward`: ``(out,
        received, act, h, y, tiles)``."""
        d, b, me = self.config, self.impl.buffers, self.config.rank
        self.epoch += 1
        m = self.impl.token_map(x, ids, gates)
        self.impl.release_counts()  # no later barrier in this call protects the table from the next publish
        self.down_count[...] = 0  # as the device plan does: a failed call may have left counts short
        offsets = [ref.plan_rows(m["table"], d.experts_per_rank, r)[2] for r in range(d.size)]
        rank_tiles = np.array([offsets, [mtile_starts(np.diff(o), self.grain.bm) for o in offsets]], dtype=np.int64)
        tiles = TilePlan(rank_tiles, arrival_tables(m["table"], d.experts_per_rank, me, self.grain.bm,
                                                    self.grain.bands))
        plan = RankPlan(rank=me, tokens=m["tokens"], top_k=d.top_k, pair_row=m["pair_row"],
                        pair_rank=m["pair_rank"], send_pos=m["send_pos"], first_slot=m["first_slot"],
                        offsets=rank_tiles[0], mtiles=rank_tiles[1], arrival=tiles.arrival)
        states = []
        for r in range(d.size):
            view = (lambda t: t.local) if r == me else (lambda t, r=r: t.peer(r))
            states.append(RankState(landing=view(b.landing), row_weight=view(b.row_weight),
                                    row_landing=view(b.row_landing), row_origin=view(b.row_origin),
                                    expert_out=view(b.expert_out),
                                    flags={"row_flag": view(self.flags["row_flag"]), "done": view(self.flags["done"])}))
        own = states[me]
        own.flags["tile_ready"], own.down_count = self.tile_ready, self.down_count
        own.x, own.gates, own.w_up, own.w_down = np.asarray(x), m["gates"], np.asarray(w_up), np.asarray(w_down)
        own.recv = np.zeros((d.max_recv_rows, d.hidden), dtype=d.dtype)
        own.act = np.zeros((d.max_recv_rows, self.ffn), dtype=d.dtype)
        own.h = np.zeros((d.max_recv_rows, 2 * self.ffn), dtype=np.float32) if keep else None
        own.y = np.zeros((d.max_recv_rows, d.hidden), dtype=d.dtype) if keep else None
        own.out = np.zeros((m["tokens"], d.hidden), dtype=d.dtype)
        grains = [Granularity.kernel(self.schedule.for_tokens(m["tokens"]))] * d.size  # only this rank's runs here
        layer = FusedLayer([plan if r == me else None for r in range(d.size)], states, self.activation,
                           grain=grains, epoch=self.epoch, max_tokens=d.max_tokens, top_k=d.top_k,
                           hidden=d.hidden, ffn=self.ffn)
        self.last_timeline = [] if self.recording else None
        run_rank(layer, me, self.timeout_s, timeline=self.last_timeline)
        return own.out, self.impl.received(own.recv, m), own.act, own.h, own.y, tiles


class HostFusedBackward(HostTimeline):
    """The fused backward on the host backend: this rank's tasks of the semantics above over
    the MPI shared-memory heap, one CTA (:func:`~ultraep.compute.fused.forward.run_rank`), with
    the forward's flags and epoch counter (``forward``: the layer's
    :class:`~ultraep.compute.fused.host.HostFusedForward`)."""

    def __init__(self, forward, *, activation: Callable):
        self.forward, self.activation = forward, activation

    def backward(self, dy, received, tiles, h, y, w_up, w_down):
        """``dy [T, H]`` BF16, ``received`` and ``tiles`` the forward's DispatchResult and
        TilePlan, ``h [rows, 2F]`` FP32 and ``y [rows, H]`` BF16 of this rank's receive rows,
        the stacked weights. Returns ``(dx [T, H], d_gates [T, K], grad_y [max_recv_rows, H],
        dh [max_recv_rows, 2F])``; collective."""
        fwd, grain = self.forward, granularity()
        d, b, me, s = fwd.config, fwd.impl.buffers, fwd.config.rank, received.handle.state
        fwd.epoch += 1  # one counter for both directions: a flag of either's earlier call is stale
        try:
            fwd.impl.heap.barrier(d.timeout_s)  # landing rows, slot_grad_w and expert_out are free on every rank
        except BarrierTimeout as exc:
            raise opening_barrier_timeout(me, exc) from None
        tokens = received.handle.tokens
        plan = RankPlan(rank=me, tokens=tokens, top_k=d.top_k, pair_row=s["pair_row"], pair_rank=s["pair_rank"],
                        send_pos=s["send_pos"], first_slot=None, offsets=tiles.rank_tiles[0],
                        mtiles=tiles.rank_tiles[1], arrival=tiles.arrival)
        states = []
        for r in range(d.size):
            view = (lambda t: t.local) if r == me else (lambda t, r=r: t.peer(r))
            states.append(BackwardState(landing=view(b.landing), slot_grad_w=view(b.slot_grad_w),
                                        expert_out=view(b.expert_out),
                                        flags={"row_flag": view(fwd.flags["row_flag"]),
                                               "done": view(fwd.flags["done"])}))
        own = states[me]
        own.flags["tile_ready"], own.down_count = fwd.tile_ready, fwd.down_count
        fwd.down_count[...] = 0  # as the device plan does: a failed call may have left counts short
        own.dy, own.h, own.y, own.w_up, own.w_down = (np.asarray(a) for a in (dy, h, y, w_up, w_down))
        own.row_weight, own.row_landing, own.row_origin = s["row_weight"], s["row_landing"], s["row_origin"]
        own.grad_y = np.zeros((d.max_recv_rows, d.hidden), dtype=d.dtype)
        own.dh = np.zeros((d.max_recv_rows, 2 * fwd.ffn), dtype=d.dtype)
        own.dx = np.zeros((tokens, d.hidden), dtype=d.dtype)
        own.d_gates = np.zeros((tokens, d.top_k), dtype=np.float32)
        layer = FusedBackward([plan if r == me else None for r in range(d.size)], states, self.activation,
                              grain=grain, epoch=fwd.epoch, max_tokens=d.max_tokens, top_k=d.top_k,
                              hidden=d.hidden, ffn=fwd.ffn)
        self.last_timeline = [] if self.recording else None
        run_rank(layer, me, fwd.timeout_s, timeline=self.last_timeline)
        return own.dx, own.d_gates, own.grad_y, own.dh
