"""The task compiler: from a plan, the tile transfers each rank performs.

Every rank compiles the same global decisions from the same plan (relay trees, chunking)
and keeps its own tasks, so no message is needed. Three task lists per rank:

* **weight tasks** (``int64[N, 8]``, columns ``WEIGHT_TASK_COLUMNS``: ``src_ref, chunk,
  tile_begin, tile_end, dest_begin, dest_end, wait_slot, publish``): one chunk -- tiles ``[tile_begin, tile_end)``
  of the expert's tile table -- of one source (``src_ref`` is the source table index of the
  expert's first tensor: master tensors, then this rank's replica slots for relays),
  copied to every destination in ``dests[dest_begin:dest_end]``. A relay's tasks carry
  the signal-pad slot of the chunk flag they wait on (``-1``: none). ``publish`` is 1
  where a destination forwards the chunk (a hot master's task whose relays have leaves)
  and 0 elsewhere: only relays read chunk flags; every other replica is ordered before
  its readers by the heap barrier that ends a weight sync, so its chunks are not counted
  and no flag is written. Master tasks come first.
* **destinations** (``int64[D, 3]``: ``rank, slot_heap_offset, flag_slot``): the replica
  slot a source lands in and the flag of its chunk 0; after the whole chunk of a
  publishing task is stored the writer publishes ``(epoch << FLAG_WRITER_BITS) | writer_rank`` at
  ``flag_slot + chunk``, so a flag also says who wrote the chunk (a relay's timeout
  report names it).
* **tile table** (``int64[T, 3]``: ``tensor, byte_offset, nbytes``): the same for every
  expert; a tile lands at the slot offset of its tensor plus ``byte_offset``.
* **gradient tasks** (``int64[G, 5]``: ``dst_ref, byte_offset, nbytes, src_begin,
  src_end``) with sources (``int64[., 2]``: ``rank, heap_offset``) in replica order:
  master gradient tile += each replica's gradient tile, fp32 accumulation.

Relay trees: an expert with more replicas than ``relay_threshold`` sends to
``relay_count`` relays; each forwards every chunk to its leaves as soon as the chunk's
flag is set. Relays and leaves are chosen greedily to even out the bytes each rank sends,
hottest experts first, ties to the lowest index.

This NumPy compiler is the CPU backend and the reference: on the GPU,
``device_schedule`` writes the same tables, row for row, with ``raw_kernels/schedule.cu``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ultraep.runtime.kernels import kernel_constant
from ultraep.transfer.spec import ExpertSpec

FLAG_WRITER_BITS = kernel_constant("transfer.cu", "FLAG_WRITER_BITS")
# Row widths of the tables above, as the kernels define them; the weight-task columns in the
# order of the kernels' enum WeightTaskField (both in raw_kernels/task_tables.cuh).
WEIGHT_TASK_FIELDS, DEST_FIELDS, GRAD_TASK_FIELDS, GRAD_SRC_FIELDS = (
    kernel_constant("task_tables.cuh", name)
    for name in ("WEIGHT_TASK_FIELDS", "DEST_FIELDS", "GRAD_TASK_FIELDS", "GRAD_SRC_FIELDS"))
WEIGHT_TASK_COLUMNS = ("src_ref", "chunk", "tile_begin", "tile_end", "dest_begin", "dest_end", "wait_slot", "publish")


@dataclass(frozen=True)
class TileGeometry:
    """How an expert's tensors are cut into tiles and tiles into chunks."""

    spec: ExpertSpec
    tile_bytes: int
    chunk_tiles: int
    tiles: tuple = field(init=False)  # (tensor index, byte offset, nbytes) in expert order
    grad_tiles: tuple = field(init=False)  # the same over the gradient tensors (their dtype may differ)

    def __post_init__(self):
        if self.tile_bytes <= 0 or self.tile_bytes % 256:
            raise ValueError(f"tile_bytes must be a positive multiple of 256, got {self.tile_bytes}")
        if self.chunk_tiles <= 0:
            raise ValueError(f"chunk_tiles must be positive, got {self.chunk_tiles}")
        object.__setattr__(self, "tiles", self._cut(self.spec.weights))
        object.__setattr__(self, "grad_tiles", self._cut(self.spec.grads))

    def _cut(self, tensors) -> tuple:
        return tuple((t, offset, min(self.tile_bytes, tensor.nbytes - offset))
                     for t, tensor in enumerate(tensors) for offset in range(0, tensor.nbytes, self.tile_bytes))

    @property
    def num_chunks(self) -> int:
        return -(-len(self.tiles) // self.chunk_tiles)

    def chunk_size(self, chunk: int) -> int:
        return min(self.chunk_tiles, len(self.tiles) - chunk * self.chunk_tiles)

    def weight_tensor_table(self) -> np.ndarray:
        """int64 ``[T, 3]``: each weight tensor's first tile (in expert order), bytes and offset
        in a replica slot -- the tensor table the weight-sync kernels read (transfer.cu)."""
        first = self._first_tiles(self.tiles, len(self.spec.weights))
        return np.array([(f, w.nbytes, off) for f, w, off in zip(first, self.spec.weights, self.spec.weight_offsets)],
                        dtype=np.int64).reshape(-1, 3)

    def grad_tensor_table(self) -> np.ndarray:
        """int64 ``[T, 3]``: each gradient tensor's first tile, offset in a gradient slot and
        bytes -- the tensor table the gradient compiler reads (schedule.cu)."""
        first = self._first_tiles(self.grad_tiles, len(self.spec.grads))
        return np.array([(f, off, g.nbytes) for f, off, g in zip(first, self.spec.grad_offsets, self.spec.grads)],
                        dtype=np.int64).reshape(-1, 3)

    @staticmethod
    def _first_tiles(tiles, count: int) -> np.ndarray:
        return np.searchsorted([t for t, _, _ in tiles], np.arange(count))


@dataclass(frozen=True)
class HeapPlacement:
    """Where the engine's buffers sit in every rank's heap (identical offsets)."""

    weight_base: int        # byte offset of weight slot 0
    grad_base: int          # byte offset of gradient slot 0
    flag_base_slot: int     # signal-pad slot of chunk flag (slot 0, chunk 0)


@dataclass
class Schedule:
    rank: int
    weight_tasks: np.ndarray
    dests: np.ndarray
    tiles: np.ndarray
    grad_tasks: np.ndarray
    grad_srcs: np.ndarray
    relays: dict            # expert -> [(relay instance, [leaf instances])]
    bytes_sent: np.ndarray  # int64[R]: weight bytes each rank sends (after relay balancing)


def host_plan(plan):
    """``plan`` with NumPy arrays (a device plan is read back, which synchronises)."""
    return plan.to_numpy() if hasattr(plan, "to_numpy") else plan


def placement_error(layout, log_to_phys, replica_count) -> str | None:
    """Why a plan's placement cannot drive transfers, or ``None``: an instance count outside
    [1, K], a replica outside the redundant slots, off its master's domain or on its
    master's rank, two instances of an expert on one rank, or two replicas in one slot.
    (On the GPU the device compiler makes the same checks: schedule.cu placement_code.)"""
    log_to_phys, replica_count = np.asarray(log_to_phys), np.asarray(replica_count)
    K, P, M, D = layout.max_instances, layout.slots_per_rank, layout.experts_per_rank, layout.domain_size
    bad = np.flatnonzero((replica_count < 1) | (replica_count > K))
    if bad.size:
        return f"expert {int(bad[0])} has {int(replica_count[bad[0]])} instances, outside [1, {K}]"
    present = np.arange(K)[None, :] < replica_count[:, None]
    present[:, 0] = False  # replicas only; masters are fixed by the layout
    experts, columns = np.nonzero(present)
    phys = log_to_phys[experts, columns].astype(np.int64)
    outside = (phys < 0) | (phys >= layout.num_physical) | (phys % P < M)
    if outside.any():
        return (f"expert {int(experts[outside][0])} has a replica outside the redundant slots "
                f"(slot {int(phys[outside][0])})")
    hosts, masters = phys // P, experts // M
    stray = (hosts // D != masters // D) | (hosts == masters)
    if stray.any():
        e = int(experts[stray][0])
        return f"expert {e} has a replica on rank {int(hosts[stray][0])}: on its master's rank or outside its domain"
    if np.unique(phys).size != phys.size:
        return "two replicas share one slot"
    if np.unique(experts * layout.num_ranks + hosts).size != phys.size:
        return "an expert has two instances on one rank"
    return None


def instances(layout, log_to_phys, replica_count, expert: int) -> list[tuple[int, int]]:
    """``[(rank, redundant slot index), ...]`` of the replicas of ``expert`` (instance 1..n-1)."""
    slots_per_rank, masters = layout.slots_per_rank, layout.experts_per_rank
    out = []
    for i in range(1, int(replica_count[expert])):
        phys = int(log_to_phys[expert, i])
        out.append((phys // slots_per_rank, phys % slots_per_rank - masters))
    return out


def relay_trees(layout, log_to_phys, replica_count, expert_bytes: int, threshold: int, relay_count: int):
    """Global relay decisions: ``({expert: [(relay instance, [leaf instances])]}, bytes sent per rank)``."""
    sent = np.zeros(layout.num_ranks, dtype=np.int64)
    fanout = np.asarray(replica_count, dtype=np.int64) - 1
    for e in np.flatnonzero((fanout >= 1) & (fanout <= threshold)):
        sent[layout.master_rank(int(e))] += fanout[e] * expert_bytes
    trees = {}
    hot = [int(e) for e in np.flatnonzero(fanout > threshold)]
    for e in sorted(hot, key=lambda e: (-fanout[e], e)):
        replicas = instances(layout, log_to_phys, replica_count, e)
        k = min(relay_count, len(replicas))
        chosen = sorted(range(len(replicas)), key=lambda i: (sent[replicas[i][0]], i))[:k]
        sent[layout.master_rank(e)] += k * expert_bytes
        leaves: dict[int, list[int]] = {i: [] for i in chosen}
        for i in range(len(replicas)):
            if i in leaves:
                continue
            relay = min(chosen, key=lambda c: (sent[replicas[c][0]], chosen.index(c)))
            leaves[relay].append(i + 1)
            sent[replicas[relay][0]] += expert_bytes
        trees[e] = [(i + 1, leaves[i]) for i in chosen]
    return trees, sent


def compile_schedule(plan, spec: ExpertSpec, geometry: TileGeometry, placement: HeapPlacement, rank: int, *,
                     relay_threshold: int, relay_count: int) -> Schedule:
    layout = plan.layout
    log_to_phys = np.asarray(plan.log_to_phys)
    replica_count = np.asarray(plan.replica_count)
    M, T = layout.experts_per_rank, len(spec.weights)
    trees, sent = relay_trees(layout, log_to_phys, replica_count, spec.weight_slot_bytes,
                              relay_threshold, max(1, relay_count))
    tasks: list[tuple] = []
    dests: list[tuple] = []

    def add_source(src_ref: int, targets: list[tuple[int, int]], wait_slot=None, publish=False) -> None:
        """One task per chunk of one source, each copied to every target (rank, redundant slot);
        ``publish``: some target forwards the chunks, so each chunk's flag is published."""
        begin = len(dests)
        for dst_rank, dst_slot in targets:
            dests.append((dst_rank, placement.weight_base + dst_slot * spec.weight_slot_bytes,
                          placement.flag_base_slot + dst_slot * geometry.num_chunks))
        for chunk in range(geometry.num_chunks):
            first = chunk * geometry.chunk_tiles
            wait = -1 if wait_slot is None else wait_slot + chunk
            tasks.append((src_ref, chunk, first, first + geometry.chunk_size(chunk), begin, len(dests), wait,
                          int(publish)))

    for e in range(rank * M, (rank + 1) * M):  # this rank's masters, in expert order
        replicas = instances(layout, log_to_phys, replica_count, e)
        if e in trees:  # a hot master sends to its relays; a relay with leaves waits for the chunk flags
            add_source((e - rank * M) * T, [replicas[i - 1] for i, _ in trees[e]],
                       publish=any(leaves for _, leaves in trees[e]))
        elif replicas:
            add_source((e - rank * M) * T, replicas)
    for e, tree in sorted(trees.items()):  # relays forward after every master task of this rank
        replicas = instances(layout, log_to_phys, replica_count, e)
        for relay, leaf_ids in tree:
            relay_rank, relay_slot = replicas[relay - 1]
            if relay_rank == rank and leaf_ids:
                add_source((M + relay_slot) * T, [replicas[i - 1] for i in leaf_ids],
                           wait_slot=placement.flag_base_slot + relay_slot * geometry.num_chunks)

    grad_tasks, grad_srcs = [], []
    for e in range(rank * M, (rank + 1) * M):
        replicas = instances(layout, log_to_phys, replica_count, e)
        if not replicas:
            continue
        for t, offset, nbytes in geometry.grad_tiles:
            begin = len(grad_srcs)
            for src_rank, src_slot in replicas:
                grad_srcs.append((src_rank, placement.grad_base + src_slot * spec.grad_slot_bytes
                                  + spec.grad_offsets[t] + offset))
            grad_tasks.append(((e - rank * M) * T + t, offset, nbytes, begin, len(grad_srcs)))
    tile_table = [(t, offset, nbytes) for t, offset, nbytes in geometry.tiles]
    return Schedule(rank=rank,
                    weight_tasks=np.array(tasks, dtype=np.int64).reshape(-1, WEIGHT_TASK_FIELDS),
                    dests=np.array(dests, dtype=np.int64).reshape(-1, DEST_FIELDS),
                    tiles=np.array(tile_table, dtype=np.int64).reshape(-1, 3),
                    grad_tasks=np.array(grad_tasks, dtype=np.int64).reshape(-1, GRAD_TASK_FIELDS),
                    grad_srcs=np.array(grad_srcs, dtype=np.int64).reshape(-1, GRAD_SRC_FIELDS),
                    relays=trees, bytes_sent=sent)
