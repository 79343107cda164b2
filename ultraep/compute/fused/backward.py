"""The fused MoE layer's backward task semantics in NumPy: the spec the backward kernels
follow and the reference they are held to.

The same two persistent kernels as the forward (:mod:`ultraep.compute.fused.forward`: tasks
claimed from one counter per rank and kernel, ``task = atomicAdd(counter, 1)``, kernel C's
relays by each CTA's relay worker from a second counter, as kernel A's, flags in the
symmetric heap holding the call's epoch) replace ``MoELayer``'s sequential backward
``combine_backward -> dgrad down -> SwiGLU backward -> dgrad up -> dispatch_backward``.
The inputs are the forward's: the Dispatcher's token map and receive-row metadata (its
handle), the up-projection ``h`` (FP32) and the expert outputs ``y`` (BF16) of this rank's
receive rows, and the output gradient ``dy``; the weight gradients stay on the grouped
wgrad, launched after, from the ``grad_y`` and ``dh`` rows these kernels leave behind.

Kernel C, gradient dispatch + dgrad of down (rank ``r``; ``j`` a local slot, ``m`` an
M-tile of ``bm`` rows of slot ``j``, ``n`` a column block of ``F``):

1. ``send(c)``   tokens ``[c*S, (c+1)*S)``: each token's ``dy`` row once into its landing
   row on every destination rank (the forward's landing rows), then, after a system-scope
   release fence, ``row_flag[row] = epoch`` on the destination for every pair row of the
   token. Waits for nothing.
2. ``relay(j, m)``, the relay workers' (slot, then M-tile), waits (acquire) until
   ``row_flag[row] == epoch`` for each row of the tile, then for each row:
   ``grad_y[row] = bf16(gate * dy)`` (one FP32 product, as ``combine_backward``) and the
   gate's gradient ``lane_dot(dy, y[row])`` written into the source's ``slot_grad_w`` at
   the pair's slot (``row_origin``); then releases ``tile_ready[mtile(j, m)] = epoch``.
3. ``dgrad_down(j, n, m)`` waits (acquire, then a proxy fence) until
   ``tile_ready[mtile(j, m)] == epoch``; ``d_act = bf16(grad_y[rows] @ w_down[j][cols]^T)``
   for ``F`` columns ``[n*U, (n+1)*U)`` (``U``: :func:`granularity`'s ``up_cols``), and in
   the epilogue SwiGLU's backward from ``h``'s gate and up columns of the same indices:
   ``dh[rows, cols]`` and ``dh[rows, F + cols]`` (BF16).

Kernel D, dgrad of up + gradient combine (launched after C on the same stream):

1. ``dgrad_up(j, n, m)`` ``d_recv = bf16(dh[rows] @ w_up[j][cols]^T)`` for ``H`` columns
   ``[n*D, (n+1)*D)`` into the heap's ``expert_out`` rows, fences them at system scope and
   counts itself for its M-tile, as the forward's down tiles: the M-tile's last column
   block releases ``done[mtile(j, m)] = epoch``. Waits for nothing: ``dh`` is this rank's
   kernel C's, finished before D starts.
2. ``reduce(c)`` for tokens ``[c*S', (c+1)*S')``, every column: for k = 0..K-1 waits
   (acquire) for the done flag of the M-tile holding slot (t, k)'s row on its expert's
   rank, reads the row there and sums unweighted in slot order in FP32 into ``dx``
   (``slot_sum``, as ``dispatch_backward``), and copies the K gate gradients from
   ``slot_grad_w`` into ``d_gates``: the relay that wrote them ran in that rank's kernel C,
   which finished before the ``dgrad_up`` that released the flag just acquired.

The geometry (``mtile``, slots, tiles, column blocks) is the forward's, and so are the flags
(``row_flag``, ``done`` in the heap, ``tile_ready`` local): one epoch counter serves both
directions, so a flag left by either direction's earlier call never equals the current
epoch and nothing is reset.

Why no order of claims can deadlock: the argument of the forward's, kind for kind. Send
and dgrad_up tasks wait for nothing and precede every waiting claim of their rank and
kernel, so they finish; a relay waits only for row flags, which sends release, and runs on
any resident CTA's relay worker, so relays finish; a dgrad_down tile waits for its relay,
a reduce for dgrad_up tiles. So one resident CTA per rank suffices.
:func:`~ultraep.compute.fused.forward.check_order` verifies this for a task list and
:func:`~ultraep.compute.fused.forward.simulate` runs random interleavings.

Reuse across calls: the backward opens with a heap barrier (as ``combine_backward``; on
the device enqueued on the stream behind this rank's earlier kernels, no host round trip),
which every rank passes only once every rank's earlier kernels are done, so its sends into
peers' landing rows, its relays into peers' ``slot_grad_w`` and its ``expert_out`` rows
overtake no reader of an earlier call. The next call (a forward's count barrier, or a
backward's opening barrier) is entered after this call's kernel D, so nothing of this call
is overwritten before it is read, and no source can set a row flag to the next epoch before
this call's relay has seen its own. A peer that never arrives makes the barrier give up
after the layer's timeout with :func:`opening_barrier_timeout`'s error.

Every rank's offsets and M-tile starts (``mtile``'s geometry) are the ones its forward's
plan computed (the forward's rank tiles, kept in the layer's context for this backward), not
recomputed: micro-batches may run forward, forward, backward, backward, and the second
forward's tiles are not the first one's.

The result is bitwise the sequential backward's: every element of ``grad_y``, ``d_act``,
``dh`` and ``d_recv`` is the same function of its row (one FP32 sum over the reduction in
ascending order for the products, elementwise otherwise), ``d_gates`` is ``lane_dot`` of
the same rows and ``dx`` the same slot-order sum.
:class:`~ultraep.compute.fused.host.HostFusedBackward` runs these tasks for
``MoELayer(fused=True)`` on the host backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ultraep.compute.fused import forward as fused_forward
from ultraep.compute.fused.forward import FusedLayer, Granularity, RankPlan, Task, _f32, _poison
from ultraep.compute.host import sequential_product
from ultraep.errors import BarrierTimeout
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.kernels import kernel_constant
from ultraep.token import reference as ref

KERNELS = "fused_moe_backward.cu"
KERNEL_C = ("send", "relay", "dgrad_down")
KERNEL_D = ("dgrad_up", "reduce")
# A timeline's task kinds by the kernels' FB_KIND_* codes.
KINDS = {kernel_constant(KERNELS, f"FB_KIND_{kind.upper()}"): kind for kind in KERNEL_C + KERNEL_D}


def granularity() -> Granularity:
    """The backward kernels' task sizes (``up_cols``: d_act columns per dgrad_down tile)."""
    names = ("FB_SEND_TOKENS", "FB_REDUCE_TOKENS", "FB_BM", "FB_DACT_COLS", "FB_DOWN_COLS", "GG_GROUP_M",
             "FM_ARRIVAL_BANDS")  # the forward's bands: its arrival order serves the backward
    return Granularity(*(kernel_constant(KERNELS, name) for name in names))


def max_tasks(*, max_tokens: int, max_recv_rows: int, slots_per_rank: int, hidden: int, ffn: int) -> tuple[int, int]:
    """Most tasks kernels C and D can have (the timeline's rows): the forward's bound over
    the backward's task sizes, its tasks being the forward's kind for kind."""
    return fused_forward.max_tasks(max_tokens=max_tokens, max_recv_rows=max_recv_rows,
                                   slots_per_rank=slots_per_rank, hidden=hidden, ffn=ffn, grain=granularity())


def opening_barrier_timeout(rank: int, error: BarrierTimeout) -> BarrierTimeout:
    """The heap barrier a backward opens with timed out (``error``): what it waited for."""
    detail = str(error).removeprefix(f"rank {rank}: ")
    return BarrierTimeout(f"rank {rank}: fused backward: its opening barrier (every rank's earlier kernels done "
                          f"before it rewrites their landing rows, gate-gradient slots and expert rows) gave up: "
                          f"{detail}; the backward's outputs are not valid")


def task_order(plan: RankPlan, ffn: int, hidden: int, grain: Granularity) -> tuple[list[Task], list[Task]]:
    """This rank's tasks of kernel C and kernel D, in claim order (the forward's, with the
    dgrad tiles in place of up and down)."""
    return fused_forward.task_order(plan, ffn, hidden, grain, gemms=(KERNEL_C[2], KERNEL_D[0]))


@dataclass
class BackwardState:
    """One rank's buffers: the heap's (written or read by peers) and its own (None where
    another process holds them)."""

    landing: np.ndarray
    slot_grad_w: np.ndarray
    expert_out: np.ndarray
    flags: dict = field(default_factory=dict)   # name -> integer epoch array: row_flag, tile_ready, done
    down_count: np.ndarray | None = None        # per M-tile: its dgrad_up tiles finished in this call
    dy: np.ndarray | None = None
    row_weight: np.ndarray | None = None        # the forward's receive-row metadata
    row_landing: np.ndarray | None = None
    row_origin: np.ndarray | None = None
    h: np.ndarray | None = None                 # [rows, 2F] FP32
    y: np.ndarray | None = None                 # [rows, H] BF16
    w_up: np.ndarray | None = None              # [slots, H, 2F] BF16
    w_down: np.ndarray | None = None            # [slots, F, H] BF16
    grad_y: np.ndarray | None = None            # [rows, H] BF16
    dh: np.ndarray | None = None                # [rows, 2F] BF16
    dx: np.ndarray | None = None                # [T, H] BF16
    d_gates: np.ndarray | None = None           # [T, K] FP32


class FusedBackward(FusedLayer):
    """The fused backward's tasks, their waits and their effects over every rank's buffers
    (the forward's geometry). ``activation(h, d_act, rows)``: SwiGLU's backward
    (``moe_layer.swiglu_backward``). :meth:`simulation` builds every rank in one process;
    :class:`~ultraep.compute.fused.host.HostFusedBackward` one rank over the heap."""

    def __init__(self, plans: list, states: list, activation: Callable, *, grain: Granularity, epoch: int,
                 max_tokens: int, top_k: int, hidden: int, ffn: int):
        super().__init__(plans, states, activation, grain=grain, epoch=epoch, max_tokens=max_tokens, top_k=top_k,
                         hidden=hidden, ffn=ffn)
        self.tasks = [None if p is None else task_order(p, ffn, hidden, grain) for p in plans]

    @classmethod
    def simulation(cls, dys, expert_ids, gates, hs, ys, w_up, w_down, activation: Callable, *,
                   grain: Granularity | None = None, epoch: int = 1, max_tokens: int | None = None) -> FusedBackward:
        """Every rank in this process, buffers poisoned: ``dys[r] [T_r, H]`` BF16, ``expert_ids``
        and ``gates`` as the forward's, ``hs[r]`` / ``ys[r]`` rank ``r``'s receive rows' ``h``
        and ``y`` in receive order (:func:`sequential_rows`), stacked weights as the forward's."""
        grain = grain or granularity()
        K = np.shape(expert_ids[0])[1]
        ranks, (H, F), max_tokens, plans, sizes = fused_forward.simulation_geometry(expert_ids, w_up, grain, max_tokens)
        states = []
        for r, (rows, tiles) in enumerate(sizes):
            states.append(BackwardState(
                landing=_poison((ranks * max_tokens, H), BFLOAT16), slot_grad_w=_poison(max_tokens * K, np.float32),
                expert_out=_poison((rows, H), BFLOAT16), dy=np.asarray(dys[r]), row_weight=_poison(rows, np.float32),
                row_landing=_poison(rows, np.int64), row_origin=_poison(rows, np.int64), h=np.asarray(hs[r]),
                y=np.asarray(ys[r]), w_up=np.asarray(w_up[r]), w_down=np.asarray(w_down[r]),
                grad_y=_poison((rows, H), BFLOAT16), dh=_poison((rows, 2 * F), BFLOAT16),
                dx=_poison((len(dys[r]), H), BFLOAT16), d_gates=_poison((len(dys[r]), K), np.float32),
                flags={"row_flag": np.zeros(rows, np.int64), "tile_ready": np.zeros(tiles, np.int64),
                       "done": np.zeros(tiles, np.int64)}, down_count=np.zeros(tiles, np.int64)))
        for s, p in enumerate(plans):  # the forward's dispatch left each pair's metadata in its receive row
            for i in range(p.tokens * K):
                t, k = divmod(i, K)
                dest, row = states[int(p.pair_rank[i])], int(p.pair_row[i])
                dest.row_weight[row] = gates[s][t, k]
                dest.row_landing[row] = s * max_tokens + p.send_pos[t * K + p.first_slot[t, k]]
                dest.row_origin[row] = s * max_tokens * K + i
        return cls(plans, states, activation, grain=grain, epoch=epoch, max_tokens=max_tokens, top_k=K, hidden=H,
                   ffn=F)

    # -- waits and producers ----------------------------------------------------------------
    def waits(self, r: int, task: Task) -> list[tuple[int, str, int]]:
        """The flags (rank, name, index) ``task`` of rank ``r`` waits for, each to equal the epoch."""
        if task.kind == "dgrad_down":
            return super().waits(r, Task("up", task.a, task.m, task.n))
        return super().waits(r, task) if task.kind in ("relay", "reduce") else []

    def publishes(self, r: int, task: Task) -> list[tuple[int, str, int]]:
        """The flags ``task`` sets to the epoch when it is done."""
        if task.kind == "dgrad_up":
            return super().publishes(r, Task("down", task.a, task.m, task.n))
        return super().publishes(r, task) if task.kind in ("send", "relay") else []

    # -- effects ----------------------------------------------------------------------------
    def _send(self, r: int, task: Task) -> None:
        p, st, K = self.plans[r], self.state[r], self.top_k
        for t in self._chunk(r, task.a, self.grain.send_tokens):
            for i in range(t * K, (t + 1) * K):
                if p.send_pos[i] >= 0:
                    self.state[int(p.pair_rank[i])].landing[r * self.max_tokens + p.send_pos[i]] = st.dy[t]

    def _relay(self, r: int, task: Task) -> None:
        st, slots_per_source = self.state[r], self.max_tokens * self.top_k
        lo, hi = self._tile_rows(r, task.a, task.m)
        arrived = st.landing[st.row_landing[lo:hi]]
        st.grad_y[lo:hi] = ref.weighted_rows(st.row_weight[lo:hi], arrived).astype(BFLOAT16)
        gate_grads = ref.lane_dot(arrived, st.y[lo:hi])
        for origin, value in zip(st.row_origin[lo:hi], gate_grads):
            source, slot = divmod(int(origin), slots_per_source)
            self.state[source].slot_grad_w[slot] = value

    def _dgrad_down(self, r: int, task: Task) -> None:
        st, F, U = self.state[r], self.ffn, self.grain.up_cols
        lo, hi = self._tile_rows(r, task.a, task.m)
        c0, c1 = task.n * U, min(F, (task.n + 1) * U)
        d_act = sequential_product(_f32(st.grad_y[lo:hi]), _f32(st.w_down[task.a][c0:c1]).T).astype(BFLOAT16)
        h = np.concatenate([st.h[lo:hi, c0:c1], st.h[lo:hi, F + c0:F + c1]], axis=1)
        dh = self.activation(h, d_act, hi - lo)
        st.dh[lo:hi, c0:c1], st.dh[lo:hi, F + c0:F + c1] = dh[:, :c1 - c0], dh[:, c1 - c0:]

    def _dgrad_up(self, r: int, task: Task) -> None:
        st, D = self.state[r], self.grain.down_cols
        lo, hi = self._tile_rows(r, task.a, task.m)
        c0, c1 = task.n * D, min(self.hidden, (task.n + 1) * D)
        st.expert_out[lo:hi, c0:c1] = sequential_product(_f32(st.dh[lo:hi]),
                                                         _f32(st.w_up[task.a][c0:c1]).T).astype(BFLOAT16)

    def _reduce(self, r: int, task: Task) -> None:
        st, K = self.state[r], self.top_k
        tokens = list(self._chunk(r, task.a, self.grain.reduce_tokens))
        slots = np.empty((len(tokens), K, self.hidden), dtype=BFLOAT16)
        for a, t in enumerate(tokens):
            for k in range(K):
                dest, row, _ = self._slot_tile(r, t * K + k)
                slots[a, k] = self.state[dest].expert_out[row]
        first, last = tokens[0], tokens[-1] + 1
        st.dx[first:last] = ref.slot_sum(slots, None, BFLOAT16)
        st.d_gates[first:last] = st.slot_grad_w[first * K:last * K].reshape(-1, K)

    def outputs(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank ``(dx, d_gates)``."""
        return [(s.dx, s.d_gates) for s in self.state]


# -- the sequential path, for comparison ----------------------------------------------------------

def sequential_rows(xs, expert_ids, w_up, w_down, activation: Callable) -> list[dict]:
    """Per rank, its receive rows in the token reference's order (the fused plan's): ``x``,
    ``h`` (FP32), ``act`` and ``y`` (BF16), and the slot ``offsets``, as the sequential forward."""
    slots = w_up[0].shape[0]
    _, sources, counts = ref.sequential_rows(expert_ids, slots)
    rows = []
    for r, order in enumerate(sources):
        recv_x = np.stack([xs[s][t] for s, t, _ in order]) if order else np.zeros((0, xs[0].shape[1]), xs[0].dtype)
        off = np.concatenate([[0], np.cumsum(counts[r])]).astype(np.int64)
        F, H = w_down[r].shape[1:]
        h = np.zeros((len(recv_x), 2 * F), dtype=np.float32)
        act = np.zeros((len(recv_x), F), dtype=BFLOAT16)
        y = np.zeros((len(recv_x), H), dtype=BFLOAT16)
        for j in range(slots):
            lo, hi = int(off[j]), int(off[j + 1])
            h[lo:hi] = sequential_product(_f32(recv_x[lo:hi]), _f32(w_up[r][j]))
            act[lo:hi] = activation(h[lo:hi], hi - lo)
            y[lo:hi] = sequential_product(_f32(act[lo:hi]), _f32(w_down[r][j])).astype(BFLOAT16)
        rows.append({"x": recv_x, "h": h, "act": act, "y": y, "offsets": off})
    return rows


def sequential_backward(dys, expert_ids, gates, rows: list[dict], w_up, w_down, activation: Callable):
    """``MoELayer``'s host backward from the token reference, over :func:`sequential_rows`:
    ``combine_backward``, per slot dgrad of down, ``activation`` (SwiGLU's backward), dgrad
    of up, ``dispatch_backward``. Returns per rank ``(dx, d_gates, grad_y, dh)``."""
    slots = w_up[0].shape[0]
    grad_ys, d_gates = ref.sequential_combine_backward(dys, [r["y"] for r in rows], expert_ids, gates, slots)
    dhs, d_recvs = [], []
    for r, rank_rows in enumerate(rows):
        off, h = rank_rows["offsets"], rank_rows["h"]
        dh = np.zeros(h.shape, dtype=BFLOAT16)
        d_recv = np.zeros(rank_rows["y"].shape, dtype=BFLOAT16)
        for j in range(slots):
            lo, hi = int(off[j]), int(off[j + 1])
            d_act = sequential_product(_f32(grad_ys[r][lo:hi]), _f32(w_down[r][j]).T).astype(BFLOAT16)
            dh[lo:hi] = activation(h[lo:hi], d_act, hi - lo)
            d_recv[lo:hi] = sequential_product(_f32(dh[lo:hi]), _f32(w_up[r][j]).T).astype(BFLOAT16)
        dhs.append(dh)
        d_recvs.append(d_recv)
    dxs = ref.sequential_combine(d_recvs, expert_ids, gates, slots, weighted=False)
    return [(dx, g, gy, dh) for dx, g, gy, dh in zip(dxs, d_gates, grad_ys, dhs)]
