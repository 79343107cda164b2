"""The fused MoE layer's task semantics in NumPy: the spec ``raw_kernels/fused_moe.cu``
follows and the reference it is held to.

UniEP's two persistent kernels replace ``dispatch -> grouped GEMM up -> SwiGLU -> grouped
GEMM down -> combine`` (``MoELayer``'s sequential path). Every CTA (a persistent block, one
per SM, however many are resident) claims task ids from a counter per rank, kernel and
stream, ``task = atomicAdd(counter, 1)``, and runs them in the order below until the list
is done. Kernel A has three streams (:func:`streams`): its sends, claimed by the first
``send_ctas`` CTAs to start (a ticket counter decides) before anything else; its relays,
claimed by each CTA's relay worker (on the device its three store warps) beside whatever
its CTA runs; and its up tiles, claimed by every CTA (a sender once the sends are all
taken). Any other CTA claims the next up tile once its rows are relayed, and a send while
the next tile's rows are not there and a send is left. So the GEMM starts as soon as rows
are there instead of after the whole exchange, and no CTA waits for a tile while a send is
unclaimed. A kernel's task list (:func:`task_order`) holds every stream, each in list
order.

Kernel A, dispatch + up-projection (rank ``r``; ``j`` a local slot, ``m`` an M-tile of
``bm`` rows of slot ``j``, ``n`` a column block):

1. ``send(c)``   tokens ``[c*S, (c+1)*S)`` of this rank: each token once into its landing
   row on every destination rank, each (token, k) pair's gate, landing row and origin into
   its receive row there; then, after a system-scope release fence, ``row_flag[row] =
   epoch`` on the destination for every pair row written. Waits for nothing.
2. ``relay(j, m)``, the relay workers' (in arrival order, below), waits (acquire) until
   ``row_flag[row] == epoch`` for each row of the tile (written by senders on any rank),
   copies ``landing[row_landing[row]]`` into the expert-major receive row, then releases
   ``tile_ready[mtile(j, m)] = epoch``.
3. ``up(j, n, m)`` (in arrival order, below; within a run the grouped GEMM's raster)
   waits (acquire, then a proxy fence: the TMA reads what generic stores wrote) until
   ``tile_ready[mtile(j, m)] == epoch`` -- on the device the claiming thread waits before
   the block sees the task, so no stage wait of the GEMM pipeline spans it; multiplies
   the tile's rows by ``w_up[j]``'s gate columns ``[n*U, (n+1)*U)`` and up columns
   ``F + [n*U, (n+1)*U)`` (one accumulator of 2U columns) and stores
   ``act = swiglu(gate | up)`` in the epilogue, BF16.

Kernel B, down-projection + combine (launched after A on the same stream):

1. ``down(j, n, m)`` multiplies ``act`` rows by ``w_down[j]``'s columns ``[n*D, (n+1)*D)``
   into the heap's ``expert_out`` rows (BF16), fences them at system scope and counts
   itself in ``down_count[mtile(j, m)]`` (local); the M-tile's last column block to finish
   resets the count and releases ``done[mtile(j, m)] = epoch``. Waits for nothing.
2. ``reduce(c)`` for tokens ``[c*S', (c+1)*S')`` of this rank, every output column: for
   k = 0..K-1, waits (acquire) until the done flag of the M-tile holding slot (t, k)'s row
   on its expert's rank says ``epoch``, reads the row there, and sums gate-weighted in
   slot order in FP32 (``slot_sum``). One flag per slot, not per slot and column block:
   the reducers' waits and row lookups do not grow with the width.

Arrival order (:func:`arrival_tables`): every source sends its tokens in order, so the rows
of slot ``j`` from source ``s`` arrive in order over the sends. An M-tile's band is where
its last row stands in its source's segment of the slot (the last band if it holds rows of
two sources), in ``bands`` steps; relays and up tiles go band by band, slot by slot. Only
speed depends on it: the first tiles claimed are those whose rows come first.

``mtile(j, m)`` is the tile's index in the rank's prefix of M-tiles (``mtile_starts``), the
same on every rank because every rank derives every rank's counts from the gathered count
table. Flags hold the call's epoch (the same count of fused calls on every rank), so no
flag is ever reset; a stale value from an earlier call never equals the current epoch.

Why no order of claims can deadlock: (a) send tasks wait for nothing, and no CTA claims a
task that waits while a send is unclaimed (a sender claims sends first; any other CTA takes
a tile early only once its rows are relayed): every send is claimed and finishes. Down
tasks wait for nothing and precede every waiting task of their rank's claims, so they
finish once claimed, and every rank claims all of them (a rank's CTAs are never all blocked
while a task that waits for nothing is unclaimed). (b) A relay waits only for row flags,
which sends release; so every relay finishes, whatever the CTAs' claims wait for: a relay
worker waits for nothing but row flags, and every resident CTA has one, which claims the
rank's relays in order until none is left. (c) An up tile waits for ``tile_ready``, which its relay releases (b), and a
reduce for ``done``, which down tasks release (a). So one resident CTA per rank suffices,
which is what makes the kernels correct under an MPS SM share. In general: a claimed task
may wait for tasks of kind (a), for any relay of its rank and kernel, or for a claimed
task of its rank and kernel with a smaller id; a relay for tasks of kind (a) or an earlier
relay. Every wait on the device is bounded (``timeout_s``) and records which flag, index,
rank and value it saw. :func:`check_order` verifies this property for a given task list
and :func:`simulate` runs the tasks in random interleavings of every stream to show it.

Reuse across calls: a rank rewrites its peers' landing rows and row metadata, and its own
``expert_out``, only after the next call's count barrier (the Dispatcher's token map),
which every rank enters after its kernel B of this call: no reader is overtaken. The count
table itself is read after that barrier, and two ranks that exchange no rows never wait
for each other in the kernels, so a barrier after the read (``release_counts``) keeps the
next call's publish from overtaking it.

The result is bitwise the sequential path's on the same backend: each output element of a
tile is one FP32 sum over the reduction in ascending order (``compute.host.sequential_product``
here; on the device the grouped GEMM's tensor-core steps, the same whichever rows and
columns share its tile), SwiGLU is elementwise, and the reduce sums in slot order exactly
as combine does. :class:`~ultraep.compute.fused.host.HostFusedForward` runs these tasks
for ``MoELayer(fused=True)`` on the host backend.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from ultraep.compute.fused.config import KERNELS, FusedConfig
from ultraep.compute.host import sequential_product
from ultraep.errors import FusedDeadlock, WaitTimeout
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.heap import HeapRequirements
from ultraep.runtime.kernels import kernel_constant
from ultraep.token import reference as ref

HEAP_PREFIX = "fused."


@dataclass(frozen=True)
class Granularity:
    """Task sizes (the kernel's, or smaller ones for tests)."""

    send_tokens: int
    reduce_tokens: int
    bm: int
    up_cols: int
    down_cols: int
    group_m: int = 8  # M-tiles per group of the tile order (grouped_raster)
    bands: int = 8    # arrival bands of the first GEMM's tile order (arrival_tables)

    @classmethod
    def kernel(cls, config: FusedConfig | None = None) -> Granularity:
        """The kernel source's sizes, with ``config``'s task sizes where given (the rest
        are fixed by the GEMM tile)."""
        names = ("FM_SEND_TOKENS", "FM_REDUCE_TOKENS", "FM_BM", "FM_UP_COLS", "FM_DOWN_COLS", "GG_GROUP_M",
                 "FM_ARRIVAL_BANDS")
        grain = cls(*(kernel_constant(KERNELS, name) for name in names))
        if config is None:
            return grain
        return dataclasses.replace(grain, send_tokens=config.send_tokens, reduce_tokens=config.reduce_tokens)


@dataclass(frozen=True)
class Task:
    """One task: ``kind`` in send, relay, up (kernel A), down, reduce (kernel B)."""

    kind: str
    a: int        # send/reduce: token chunk; relay/up/down: local slot j
    m: int = 0    # relay/up/down: M-tile
    n: int = 0    # up/down: column block


KERNEL_A = ("send", "relay", "up")
KERNEL_B = ("down", "reduce")
RELAY = "relay"  # the kind the relay workers claim from their own counter
SEND = "send"    # the kind claimed from a counter of its own (senders first, the others while starved)
# A timeline's task kinds by the kernel's FM_KIND_* codes.
KINDS = {kernel_constant(KERNELS, f"FM_KIND_{kind.upper()}"): kind for kind in KERNEL_A + KERNEL_B}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def grouped_raster(m_tiles: int, n_tiles: int, group_m: int) -> list[tuple[int, int]]:
    """One slot's GEMM tiles as (M-tile, column block) in the kernels' order
    (``grouped_raster`` of grouped_gemm_common.cuh): ``group_m`` M-tiles at a time, every
    column block of a group before the next group."""
    return [(m, n) for first in range(0, m_tiles, group_m) for n in range(n_tiles)
            for m in range(first, min(first + group_m, m_tiles))]


def max_m_tiles(max_recv_rows: int, slots_per_rank: int, grain: Granularity | None = None) -> int:
    """M-tiles a rank can have: every slot's partial tile on top of the whole ones."""
    return _ceil(max_recv_rows, (grain or Granularity.kernel()).bm) + slots_per_rank


def max_tasks(*, max_tokens: int, max_recv_rows: int, slots_per_rank: int, hidden: int, ffn: int,
              grain: Granularity) -> tuple[int, int]:
    """Most tasks kernels A and B can have (the timeline's rows)."""
    tiles = max_m_tiles(max_recv_rows, slots_per_rank, grain)
    n_down = _ceil(hidden, grain.down_cols)
    return (_ceil(max_tokens, grain.send_tokens) + tiles * (1 + _ceil(ffn, grain.up_cols)),
            tiles * n_down + _ceil(max_tokens, grain.reduce_tokens))


def heap_requirements(*, hidden: int, max_recv_rows: int, slots_per_rank: int, layer: int = 0) -> HeapRequirements:
    """The fused layer's flags in the symmetric heap (add to the Dispatcher's)."""
    tiles = max_m_tiles(max_recv_rows, slots_per_rank)
    prefix = f"{HEAP_PREFIX}{layer}."
    return HeapRequirements.of(tensors=[(prefix + "row_flag", (max_recv_rows,), np.uint64),
                                        (prefix + "done", (tiles,), np.uint64)])


def mtile_starts(counts: np.ndarray, bm: int) -> np.ndarray:
    """``[slots + 1]``: the first M-tile index of each local slot, then the total."""
    tiles = [_ceil(int(c), bm) for c in counts]
    return np.concatenate([[0], np.cumsum(tiles, dtype=np.int64)]).astype(np.int64)


def tile_band(ends: np.ndarray, lo: int, hi: int, bands: int) -> int:
    """The arrival band of rows ``[lo, hi)`` of one slot, whose rows come from the sources in
    rank order, source ``s``'s ending at ``ends[s]``: a source sends its tokens in order, so
    rows that end a fraction ``f`` into its segment arrive about ``f`` into the sends --
    band ``ceil(bands * f) - 1``; rows of two sources need the first one's last rows: the
    last band."""
    s = int(np.searchsorted(ends, hi - 1, side="right"))  # the source of row hi - 1
    start = int(ends[s - 1]) if s else 0
    if lo < start:
        return bands - 1
    return (bands * (hi - start) - 1) // (int(ends[s]) - start)


def arrival_tables(table: np.ndarray, slots_per_rank: int, rank: int, bm: int, bands: int) -> np.ndarray:
    """Rank ``rank``'s order of its first GEMM's M-tiles (``fused_plan``'s ``arrival``), from
    the gathered count table ``[sources, >= experts]``: the M-tiles by :func:`tile_band`,
    then slot, then M-tile, so the tiles whose rows arrive first are claimed first. Returns
    ``[bands * slots + 1 + M-tiles]``: the run starts -- run ``q`` is band ``q // slots`` of
    slot ``q % slots``, its M-tiles ``[starts[q], starts[q + 1])`` of the order -- then the
    order's M-tile ids."""
    counts = np.asarray(table, dtype=np.int64)[:, rank * slots_per_rank:(rank + 1) * slots_per_rank]
    ends = np.cumsum(counts, axis=0)
    first = mtile_starts(ends[-1], bm)
    runs = [[[] for _ in range(slots_per_rank)] for _ in range(bands)]
    for j in range(slots_per_rank):
        total = int(ends[-1, j])
        for m in range(_ceil(total, bm)):
            lo = m * bm
            runs[tile_band(ends[:, j], lo, min(total, lo + bm), bands)][j].append(int(first[j]) + m)
    sizes = [len(tiles) for band in runs for tiles in band]
    order = [tile for band in runs for tiles in band for tile in tiles]
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64), np.asarray(order, np.int64)]).astype(np.int64)


class TilePlan(NamedTuple):
    """What a forward's plan computed and its backward reuses (micro-batches may run
    forward, forward, backward, backward): every rank's offsets and M-tile starts
    (``rank_tiles [2, R, slots + 1]``) and this rank's :func:`arrival_tables`."""

    rank_tiles: Any
    arrival: Any


@dataclass
class RankPlan:
    """What one rank knows after the token map and the count exchange (every rank's
    counts come from the same gathered table)."""

    rank: int
    tokens: int
    top_k: int
    pair_row: np.ndarray      # [T*K] receive row of each pair on its destination rank
    pair_rank: np.ndarray     # [T*K]
    send_pos: np.ndarray      # [T*K] position among this rank's sends to that rank, -1 if not the token's send
    first_slot: np.ndarray    # [T, K] the token's first slot going to the same rank
    offsets: list             # offsets[r]: rank r's expert-major offsets [slots + 1]
    mtiles: list              # mtiles[r]: mtile_starts of rank r
    arrival: np.ndarray       # this rank's arrival_tables


def plan_ranks(expert_ids: list, slots_per_rank: int, grain: Granularity) -> list[RankPlan]:
    """The token map of every rank (``token.reference``'s arithmetic, as the Dispatcher)."""
    R = len(expert_ids)
    E = R * slots_per_rank
    table = np.zeros((R, E), dtype=np.int64)
    keyed = []
    for s, ids in enumerate(expert_ids):
        ids = np.asarray(ids, dtype=np.int64)
        positions, totals = ref.stable_key_positions(ref.route_keys(ids, slots_per_rank, E), E + R)
        table[s] = totals[:E]
        keyed.append((ids, positions))
    offsets = [ref.plan_rows(table, slots_per_rank, r)[2] for r in range(R)]
    plans = []
    for s, (ids, positions) in enumerate(keyed):
        n = ids.size
        base = ref.plan_rows(table, slots_per_rank, s)[0]
        plans.append(RankPlan(
            rank=s, tokens=ids.shape[0], top_k=ids.shape[1], pair_row=ref.pair_rows(base, ids, positions[:n]),
            pair_rank=ids.ravel() // slots_per_rank, send_pos=positions[n:],
            first_slot=ref.first_slot_of_rank(ids, slots_per_rank), offsets=offsets,
            mtiles=[mtile_starts(np.diff(o), grain.bm) for o in offsets],
            arrival=arrival_tables(table, slots_per_rank, s, grain.bm, grain.bands)))
    return plans


def task_order(plan: RankPlan, ffn: int, hidden: int, grain: Granularity,
               gemms: tuple[str, str] = ("up", "down")) -> tuple[list[Task], list[Task]]:
    """This rank's tasks of the two kernels in task-id order (the device's timeline rows):
    sends, relays, then the first GEMM's tiles (``gemms[0]``, ``ffn`` columns); the second
    GEMM's tiles (``gemms[1]``, ``hidden`` columns), then reduces. The relays and the first
    GEMM's tiles follow the M-tiles' arrival order (``plan.arrival``), the tiles of each run
    of it in :func:`grouped_raster`'s order; the second GEMM's, slot then grouped raster.
    Sends, relays and the rest are claimed from counters of their own (:func:`streams`). The
    forward's GEMMs are up and down; the backward (:mod:`ultraep.compute.fused.backward`)
    runs its dgrad tiles in the same order."""
    first, second = gemms
    off, starts = plan.offsets[plan.rank], plan.mtiles[plan.rank]
    slots = len(off) - 1
    m_tiles = [_ceil(int(off[j + 1] - off[j]), grain.bm) for j in range(slots)]
    runs = grain.bands * slots
    arrival, order = plan.arrival[:runs + 1], plan.arrival[runs + 1:]

    def slot_tile(mtile: int) -> tuple[int, int]:
        j = int(np.searchsorted(starts, mtile, side="right")) - 1  # the last slot starting at or before: non-empty
        return j, mtile - int(starts[j])

    a = [Task("send", c) for c in range(_ceil(plan.tokens, grain.send_tokens))]
    a += [Task("relay", *slot_tile(int(mtile))) for mtile in order]
    for q in range(runs):
        run = order[arrival[q]:arrival[q + 1]]
        a += [Task(first, *slot_tile(int(run[i])), n)
              for i, n in grouped_raster(len(run), _ceil(ffn, grain.up_cols), grain.group_m)]
    b = [Task(second, j, m, n) for j in range(slots)
         for m, n in grouped_raster(m_tiles[j], _ceil(hidden, grain.down_cols), grain.group_m)]
    b += [Task("reduce", c) for c in range(_ceil(plan.tokens, grain.reduce_tokens))]
    return a, b


CLAIMS, RELAYS, SENDS = range(3)  # a kernel's claim streams (streams' order)


def streams(order: list) -> tuple[list[Task], list[Task], list[Task]]:
    """A kernel's task list as its three claim streams, each in list order: the CTAs'
    (every task but the relays and sends), the relay workers' (the relays) and the sends
    (the senders' first, the other CTAs' while their next claim waits: :func:`simulate`)."""
    return ([t for t in order if t.kind not in (RELAY, SEND)], [t for t in order if t.kind == RELAY],
            [t for t in order if t.kind == SEND])


# -- the heaps and the tasks' semantics -----------------------------------------------------------

def simulation_geometry(expert_ids, w_up, grain: Granularity, max_tokens: int | None):
    """What a simulation of every rank needs first: the rank count, ``(H, F)``, the landing
    rows per source (``max_tokens``, default the most tokens of any rank), every rank's
    :class:`RankPlan` and per rank ``(receive rows, M-tiles)``, at least 1 each."""
    ranks, slots = len(expert_ids), w_up[0].shape[0]
    hidden_ffn = (w_up[0].shape[1], w_up[0].shape[2] // 2)
    max_tokens = max_tokens or max(1, max(len(ids) for ids in expert_ids))
    plans = plan_ranks(expert_ids, slots, grain)
    sizes = [(max(1, int(p.offsets[r][-1])), max(1, int(p.mtiles[r][-1]))) for r, p in enumerate(plans)]
    return ranks, hidden_ffn, max_tokens, plans, sizes


@dataclass
class RankState:
    """One rank's buffers: the symmetric heap's (written or read by peers) and its own
    (None where another process holds them)."""

    landing: np.ndarray
    row_weight: np.ndarray
    row_landing: np.ndarray
    row_origin: np.ndarray
    expert_out: np.ndarray
    flags: dict = field(default_factory=dict)   # name -> integer epoch array: row_flag, tile_ready, done
    down_count: np.ndarray | None = None        # per M-tile: its down tiles finished in this call
    x: np.ndarray | None = None
    gates: np.ndarray | None = None
    w_up: np.ndarray | None = None      # [slots, H, 2F] bf16
    w_down: np.ndarray | None = None    # [slots, F, H] bf16
    recv: np.ndarray | None = None
    act: np.ndarray | None = None
    h: np.ndarray | None = None         # [rows, 2F] FP32: the up tiles' sums, kept for the backward
    y: np.ndarray | None = None         # [rows, H] BF16: the down tiles' outputs again, kept for the backward
    out: np.ndarray | None = None


def _poison(shape, dtype) -> np.ndarray:
    """BF16 NaNs (or float NaNs, or -1): a row read before it is written shows in the result."""
    if dtype == BFLOAT16:
        return np.full(shape, 0x7FC1, dtype=np.int16).view(BFLOAT16)
    if np.dtype(dtype).kind == "f":
        return np.full(shape, np.nan, dtype=dtype)
    return np.full(shape, -1, dtype=dtype)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


class FusedLayer:
    """The fused forward's tasks, their waits and their effects over every rank's buffers.

    ``plans[r]``: rank ``r``'s :class:`RankPlan` where this process runs its tasks, else
    None; ``states[r]``: its buffers (a peer's: the heap's views of it). :meth:`simulation`
    builds every rank in one process; :class:`~ultraep.compute.fused.host.HostFusedForward`
    one rank over the heap.
    ``grain``: one :class:`Granularity`, or one per rank -- each rank's kernels may run with
    task sizes of their own (a rank's sends and reduces are its own tasks, chunked only
    where they run); the tile geometry must be every rank's.
    """

    def __init__(self, plans: list, states: list, activation: Callable, *, grain: Granularity | list, epoch: int,
                 max_tokens: int, top_k: int, hidden: int, ffn: int):
        self.grains = list(grain) if isinstance(grain, (list, tuple)) else [grain] * len(states)
        self.grain = self.grains[0]  # the tile geometry (bm, column blocks), every rank's
        if len(self.grains) != len(states) or any(
                (g.bm, g.up_cols, g.down_cols, g.bands) != (self.grain.bm, self.grain.up_cols, self.grain.down_cols,
                                                             self.grain.bands)
                for g in self.grains):
            raise ValueError("FusedLayer: one granularity per rank, every rank's with the same tile geometry")
        self.plans, self.state, self.activation = plans, states, activation
        self.ranks, self.epoch, self.max_tokens = len(states), epoch, max_tokens
        self.top_k, self.hidden, self.ffn = top_k, hidden, ffn
        self.n_down = _ceil(hidden, self.grain.down_cols)
        self.tasks = [None if p is None else task_order(p, ffn, hidden, self.grains[r]) for r, p in enumerate(plans)]

    @classmethod
    def simulation(cls, xs, expert_ids, gates, w_up, w_down, activation: Callable, *,
                   grain: Granularity | list | None = None, epoch: int = 1,
                   max_tokens: int | None = None) -> FusedLayer:
        """Every rank in this process, buffers poisoned: ``xs[r] [T_r, H]`` BF16,
        ``expert_ids[r] [T_r, K]`` physical slot ids, ``gates[r]`` float32, ``w_up[r] [slots,
        H, 2F]`` and ``w_down[r] [slots, F, H]`` BF16 (rank ``r``'s stacked slots),
        ``activation(h, rows)`` the epilogue (``moe_layer.swiglu``); ``grain`` one or per
        rank (a rank's :class:`~ultraep.compute.fused.config.FusedConfig`: ``Granularity.kernel(config)``,
        its CTAs :func:`simulate`'s)."""
        grain = grain or Granularity.kernel()
        geometry = grain[0] if isinstance(grain, (list, tuple)) else grain
        ranks, (H, F), max_tokens, plans, sizes = simulation_geometry(expert_ids, w_up, geometry, max_tokens)
        states = []
        for r, (rows, tiles) in enumerate(sizes):
            states.append(RankState(
                x=np.asarray(xs[r]), gates=np.asarray(gates[r], dtype=np.float32), w_up=np.asarray(w_up[r]),
                w_down=np.asarray(w_down[r]), landing=_poison((ranks * max_tokens, H), BFLOAT16),
                row_weight=_poison(rows, np.float32), row_landing=_poison(rows, np.int64),
                row_origin=_poison(rows, np.int64), recv=_poison((rows, H), BFLOAT16),
                act=_poison((rows, F), BFLOAT16), expert_out=_poison((rows, H), BFLOAT16),
                out=_poison((len(xs[r]), H), BFLOAT16),
                flags={"row_flag": np.zeros(rows, np.int64), "tile_ready": np.zeros(tiles, np.int64),
                       "done": np.zeros(tiles, np.int64)}, down_count=np.zeros(tiles, np.int64)))
        return cls(plans, states, activation, grain=grain, epoch=epoch, max_tokens=max_tokens,
                   top_k=np.shape(expert_ids[0])[1], hidden=H, ffn=F)

    # -- geometry ---------------------------------------------------------------------------
    def _tile_rows(self, r: int, j: int, m: int) -> tuple[int, int]:
        off = self.plans[r].offsets[r]
        lo = int(off[j]) + m * self.grain.bm
        return lo, min(int(off[j + 1]), lo + self.grain.bm)

    def _mtile(self, r: int, j: int, m: int) -> int:
        return int(self.plans[r].mtiles[r][j]) + m

    def _chunk(self, r: int, c: int, size: int) -> range:
        return range(c * size, min(self.plans[r].tokens, (c + 1) * size))

    def _slot_tile(self, r: int, i: int) -> tuple[int, int, int]:
        """Pair ``i`` of source ``r``: (destination rank, its row there, the row's M-tile there)."""
        p = self.plans[r]
        dest, row = int(p.pair_rank[i]), int(p.pair_row[i])
        off = p.offsets[dest]
        j = int(np.searchsorted(off, row, side="right")) - 1  # the last slot starting at or before row: non-empty
        return dest, row, int(p.mtiles[dest][j]) + (row - int(off[j])) // self.grain.bm

    # -- waits and producers ----------------------------------------------------------------
    def waits(self, r: int, task: Task) -> list[tuple[int, str, int]]:
        """The flags (rank, name, index) ``task`` of rank ``r`` waits for, each to equal the epoch."""
        if task.kind == "relay":
            lo, hi = self._tile_rows(r, task.a, task.m)
            return [(r, "row_flag", row) for row in range(lo, hi)]
        if task.kind == "up":
            return [(r, "tile_ready", self._mtile(r, task.a, task.m))]
        if task.kind == "reduce":
            waits = []
            for t in self._chunk(r, task.a, self.grains[r].reduce_tokens):
                for k in range(self.top_k):
                    dest, _, tile = self._slot_tile(r, t * self.top_k + k)
                    waits.append((dest, "done", tile))
            return waits
        return []

    def publishes(self, r: int, task: Task) -> list[tuple[int, str, int]]:
        """The flags ``task`` sets to the epoch when it is done (a down task: when it is its
        M-tile's last column block to finish)."""
        if task.kind == "send":
            p = self.plans[r]
            return [(int(p.pair_rank[i]), "row_flag", int(p.pair_row[i]))
                    for t in self._chunk(r, task.a, self.grains[r].send_tokens)
                    for i in range(t * self.top_k, (t + 1) * self.top_k)]
        if task.kind == "relay":
            return [(r, "tile_ready", self._mtile(r, task.a, task.m))]
        if task.kind == "down":
            return [(r, "done", self._mtile(r, task.a, task.m))]
        return []

    # -- effects ----------------------------------------------------------------------------
    def run(self, r: int, task: Task) -> None:
        """Task ``task`` of rank ``r`` (its waits satisfied), then its flags published."""
        getattr(self, "_" + task.kind)(r, task)
        for rank, name, index in self.publishes(r, task):
            if name == "done":  # an M-tile's output rows: released by its last column block to finish
                count = self.state[rank].down_count
                count[index] += 1
                if count[index] < self.n_down:
                    continue
                count[index] = 0
            self.state[rank].flags[name][index] = self.epoch

    def _send(self, r: int, task: Task) -> None:
        p, st, K = self.plans[r], self.state[r], self.top_k
        for t in self._chunk(r, task.a, self.grains[r].send_tokens):
            for k in range(K):
                i = t * K + k
                dest = self.state[int(p.pair_rank[i])]
                if p.send_pos[i] >= 0:
                    dest.landing[r * self.max_tokens + p.send_pos[i]] = st.x[t]
                row = int(p.pair_row[i])
                dest.row_weight[row] = st.gates[t, k]
                dest.row_landing[row] = r * self.max_tokens + p.send_pos[t * K + p.first_slot[t, k]]
                dest.row_origin[row] = r * self.max_tokens * K + i

    def _relay(self, r: int, task: Task) -> None:
        st = self.state[r]
        lo, hi = self._tile_rows(r, task.a, task.m)
        st.recv[lo:hi] = st.landing[st.row_landing[lo:hi]]

    def _up(self, r: int, task: Task) -> None:
        st, F, U = self.state[r], self.ffn, self.grain.up_cols
        lo, hi = self._tile_rows(r, task.a, task.m)
        c0, c1 = task.n * U, min(F, (task.n + 1) * U)
        w = _f32(st.w_up[task.a])
        a = _f32(st.recv[lo:hi])
        gate, up = sequential_product(a, w[:, c0:c1]), sequential_product(a, w[:, F + c0:F + c1])
        if st.h is not None:
            st.h[lo:hi, c0:c1], st.h[lo:hi, F + c0:F + c1] = gate, up
        st.act[lo:hi, c0:c1] = self.activation(np.concatenate([gate, up], axis=1), hi - lo)

    def _down(self, r: int, task: Task) -> None:
        st, D = self.state[r], self.grain.down_cols
        lo, hi = self._tile_rows(r, task.a, task.m)
        c0, c1 = task.n * D, min(self.hidden, (task.n + 1) * D)
        st.expert_out[lo:hi, c0:c1] = sequential_product(_f32(st.act[lo:hi]),
                                                         _f32(st.w_down[task.a][:, c0:c1])).astype(BFLOAT16)
        if st.y is not None:  # the next call overwrites expert_out; the backward reads y
            st.y[lo:hi, c0:c1] = st.expert_out[lo:hi, c0:c1]

    def _reduce(self, r: int, task: Task) -> None:
        st, K = self.state[r], self.top_k
        tokens = list(self._chunk(r, task.a, self.grains[r].reduce_tokens))
        slots = np.empty((len(tokens), K, self.hidden), dtype=BFLOAT16)
        for a, t in enumerate(tokens):
            for k in range(K):
                dest, row, _ = self._slot_tile(r, t * K + k)
                slots[a, k] = self.state[dest].expert_out[row]
        if tokens:
            st.out[tokens[0]:tokens[-1] + 1] = ref.slot_sum(slots, st.gates[tokens[0]:tokens[-1] + 1], BFLOAT16)

    def outputs(self) -> list[np.ndarray]:
        return [s.out for s in self.state]


# -- order check and interleavings -----------------------------------------------------------------

def check_order(layer: FusedLayer, tasks: list | None = None) -> None:
    """Raise FusedDeadlock unless every wait of every task is one the module docstring's
    argument covers: its producer waits for nothing and is a send or claimed before any
    task of its rank's CTAs that waits, or -- for a task of the CTAs' claims -- is a relay
    of the same rank and kernel or an earlier claim of the same rank and kernel, or -- for
    a relay -- is an earlier relay of the same rank and kernel. Any layer with
    ``waits``/``publishes`` (the backward's too)."""
    tasks = tasks or layer.tasks
    producer, free = {}, set()   # free: (rank, kernel, stream, index) of tasks that finish once claimed
    for r, orders in enumerate(tasks):
        for kernel, order in enumerate(orders):
            split = streams(order)
            waited = False
            for index, task in enumerate(split[CLAIMS]):
                waited = waited or bool(layer.waits(r, task))
                if not waited:
                    free.add((r, kernel, CLAIMS, index))
            for index, task in enumerate(split[SENDS]):
                if layer.waits(r, task):
                    raise FusedDeadlock(f"rank {r} send {index} {task} waits: the senders' claims must finish")
                free.add((r, kernel, SENDS, index))
            for stream, tasks_of_stream in enumerate(split):
                for index, task in enumerate(tasks_of_stream):
                    for flag in layer.publishes(r, task):
                        producer[flag] = (r, kernel, stream, index, task)
    names = {CLAIMS: "claim", RELAYS: "relay", SENDS: "send"}
    for r, orders in enumerate(tasks):
        for kernel, order in enumerate(orders):
            for stream, tasks_of_stream in enumerate(streams(order)):
                for index, task in enumerate(tasks_of_stream):
                    for flag in layer.waits(r, task):
                        if flag not in producer:
                            raise FusedDeadlock(f"rank {r} task {index} {task} waits for {flag}, which no task sets")
                        pr, pk, ps, pi, ptask = producer[flag]
                        if (pr, pk, ps, pi) in free:
                            continue
                        same = (pr, pk) == (r, kernel)
                        if same and ps == RELAYS and stream == CLAIMS:  # a claim waits for a relay: relays finish (b)
                            continue
                        if same and ps == stream and pi < index:
                            continue
                        raise FusedDeadlock(f"rank {r} kernel {kernel} {names[stream]} {index} {task} waits for "
                                            f"{flag}, set by rank {pr} kernel {pk} {names[ps]} {pi} {ptask}, which "
                                            "is not claimed before it and may itself wait")


def run_rank(layer: FusedLayer, rank: int, timeout_s: float, poll_s: float = 5e-5,
             timeline: list | None = None) -> None:
    """Rank ``rank``'s kernels A then B with one CTA, its flags written by other processes:
    the sends (it is the first CTA), the CTAs' claims up to the first that waits, then the
    relays (its relay worker's, each waiting for rows only senders release), then the rest
    of the claims -- one interleaving the device may run. Each wait polls until the flag
    holds the epoch, WaitTimeout after ``timeout_s``. ``timeline``: (kind, start ns, end ns,
    worker 0) of every task is appended to it."""
    def run(task):
        start = time.monotonic_ns()
        for peer, name, index in layer.waits(rank, task):
            flags = layer.state[peer].flags[name]
            deadline = time.monotonic() + timeout_s
            while flags[index] != layer.epoch:
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"rank {rank}: fused task {task} waited over {timeout_s:g} s for flag {name} "
                                      f"index {index} on rank {peer} (expected epoch {layer.epoch}, saw "
                                      f"{int(flags[index])})")
                time.sleep(poll_s)
        layer.run(rank, task)
        if timeline is not None:
            timeline.append((task.kind, start, time.monotonic_ns(), 0))

    for order in layer.tasks[rank]:
        claimed, relays, sends = streams(order)
        free = next((i for i, task in enumerate(claimed) if layer.waits(rank, task)), len(claimed))
        for task in sends + claimed[:free] + relays + claimed[free:]:
            run(task)


def simulate(layer: FusedLayer, ctas: list[int], rng: np.random.Generator, tasks: list | None = None,
             senders: list[int] | None = None) -> list:
    """Run every rank's kernels A then B with ``ctas[r]`` CTAs, each a claiming worker and a
    relay worker (a counter per stream and rank), one random step at a time (a worker claims
    a task of its stream, or runs a claimed task whose waits are met). The first
    ``senders[r]`` CTAs of rank ``r`` (default all) claim the sends while any is left, then
    the CTAs' claims; the rest the next claim once its waits are met, or a send while any is
    left (either where both are possible: on the device a block that loses the claim to
    another sends instead), else the next claim. Returns the outputs; raises FusedDeadlock
    if no step is possible."""
    tasks = tasks or layer.tasks
    R = layer.ranks
    senders = senders or ctas
    kernel = [0] * R                         # 0: A, 1: B, 2: finished
    counters = [[0, 0, 0] for _ in range(R)]  # per stream (CLAIMS, RELAYS, SENDS)
    held = [[[None, None] for _ in range(ctas[r])] for r in range(R)]  # per CTA: its claim, its relay
    done = [0] * R
    split = [[streams(order) for order in orders] for orders in tasks]

    def ready(r, task):
        return all(layer.state[rank].flags[name][index] == layer.epoch for rank, name, index in layer.waits(r, task))

    def sources(r, c, worker):
        """The streams worker ``worker`` of CTA ``c`` may claim from next (none: it is done)."""
        own, counter = split[r][kernel[r]], counters[r]
        if worker == 1:
            return [RELAYS] if counter[RELAYS] < len(own[RELAYS]) else []
        claims_left = counter[CLAIMS] < len(own[CLAIMS])
        if counter[SENDS] < len(own[SENDS]):
            early = c >= senders[r] and claims_left and ready(r, own[CLAIMS][counter[CLAIMS]])
            return [CLAIMS, SENDS] if early else [SENDS]
        return [CLAIMS] if claims_left else []

    while True:
        for r in range(R):  # a rank's next kernel starts when its last one has finished (stream order)
            while kernel[r] < 2 and done[r] == len(tasks[r][kernel[r]]):
                kernel[r], counters[r], done[r] = kernel[r] + 1, [0, 0, 0], 0
        if all(k == 2 for k in kernel):
            return layer.outputs()
        steps = []
        for r in range(R):
            if kernel[r] == 2:
                continue
            for c, workers in enumerate(held[r]):
                for worker, task in enumerate(workers):
                    if task is None:
                        steps += [(r, c, worker, stream) for stream in sources(r, c, worker)]
                    elif ready(r, task):
                        steps.append((r, c, worker, task))
        if not steps:
            blocked = [(r, t) for r in range(R) for workers in held[r] for t in workers if t is not None]
            raise FusedDeadlock(f"no CTA can go on: blocked tasks {blocked}, counters {counters}")
        r, c, worker, task = steps[rng.integers(len(steps))]
        if not isinstance(task, Task):  # a claim from that stream
            stream = task
            held[r][c][worker] = split[r][kernel[r]][stream][counters[r][stream]]
            counters[r][stream] += 1
        else:
            layer.run(r, task)
            held[r][c][worker] = None
            done[r] += 1


# -- the sequential path, for comparison ----------------------------------------------------------

def sequential_forward(xs, expert_ids, gates, w_up, w_down, activation: Callable) -> list[np.ndarray]:
    """``MoELayer``'s host path from the token reference: dispatch, one FP32 product per
    slot for up, ``activation``, down to BF16, combine in slot order."""
    slots = w_up[0].shape[0]
    received = ref.sequential_dispatch(xs, expert_ids, gates, slots)
    ys = []
    for r, (recv_x, _, counts) in enumerate(received):
        off = np.concatenate([[0], np.cumsum(counts)])
        hidden = recv_x.shape[1]
        y = np.zeros((len(recv_x), hidden), dtype=BFLOAT16)
        for j in range(slots):
            lo, hi = int(off[j]), int(off[j + 1])
            h = sequential_product(_f32(recv_x[lo:hi]), _f32(w_up[r][j]))
            act = activation(h, hi - lo)
            y[lo:hi] = sequential_product(_f32(act), _f32(w_down[r][j])).astype(BFLOAT16)
        ys.append(y)
    return ref.sequential_combine(ys, expert_ids, gates, slots)
