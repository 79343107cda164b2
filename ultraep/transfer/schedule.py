"""The task compiler: from a plan, the tile transfers each rank performs.

Every rank compiles the same global decisions from the same plan (relay trees, chunking)
and keeps its own tasks, so no message is needed. Three task lists per rank:

* **weight tasks** (``int64[N, 6]``: ``src_ref, src_offset, nbytes, dest_begin,
  dest_end, wait_slot``): copy one tile of a source tensor (``src_ref`` indexes the
  layer's source table: master tensors, then this rank's replica slots for relays) to
  every destination in ``dests[dest_begin:dest_end]``. A relay's tasks carry the
  signal-pad slot of the chunk flag they wait on (``-1``: none). Master tasks come first.
* **destinations** (``int64[D, 5]``: ``rank, heap_offset, counter, flag_slot,
  chunk_tiles``): where a tile lands; the writer counts the tiles of each (chunk,
  destination) in ``counter`` and, on the last one, publishes the chunk flag
  ``(epoch << 16) | writer_rank`` in the destination's signal pad. Flags say who wrote a
  chunk, which is how tests prove that leaves got their data from a relay.
* **gradient tasks** (``int64[G, 5]``: ``dst_ref, byte_offset, nbytes, src_begin,
  src_end``) with sources (``int64[., 2]``: ``rank, heap_offset``) in replica order:
  master gradient tile += each replica's gradient tile, fp32 accumulation.

Relay trees: an expert with more replicas than ``relay_threshold`` sends to
``relay_count`` relays; each forwards every chunk to its leaves as soon as the chunk's
flag is set. Relays and leaves are chosen greedily to even out the bytes each rank sends,
hottest experts first, ties to the lowest index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ultraep.transfer.spec import ExpertSpec

FLAG_WRITER_BITS = 16


@dataclass(frozen=True)
class TileGeometry:
    """How an expert's tensors are cut into tiles and tiles into chunks."""

    spec: ExpertSpec
    tile_bytes: int
    chunk_tiles: int
    tiles: tuple = field(init=False)  # (tensor index, byte offset, nbytes) in expert order

    def __post_init__(self):
        if self.tile_bytes <= 0 or self.tile_bytes % 256:
            raise ValueError(f"tile_bytes must be a positive multiple of 256, got {self.tile_bytes}")
        if self.chunk_tiles <= 0:
            raise ValueError(f"chunk_tiles must be positive, got {self.chunk_tiles}")
        tiles = []
        for t, tensor in enumerate(self.spec.weights):
            for offset in range(0, tensor.nbytes, self.tile_bytes):
                tiles.append((t, offset, min(self.tile_bytes, tensor.nbytes - offset)))
        object.__setattr__(self, "tiles", tuple(tiles))

    @property
    def num_chunks(self) -> int:
        return -(-len(self.tiles) // self.chunk_tiles)

    def chunk_size(self, chunk: int) -> int:
        return min(self.chunk_tiles, len(self.tiles) - chunk * self.chunk_tiles)


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
    num_counters: int
    grad_tasks: np.ndarray
    grad_srcs: np.ndarray
    relays: dict            # expert -> [(relay instance, [leaf instances])]
    bytes_sent: np.ndarray  # int64[R]: weight bytes each rank sends (after relay balancing)

    @property
    def empty(self) -> bool:
        return len(self.weight_tasks) == 0 and len(self.grad_tasks) == 0


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

    def flag_slot(slot: int, chunk: int) -> int:
        return placement.flag_base_slot + slot * geometry.num_chunks + chunk

    tasks: list[tuple] = []
    dests: list[tuple] = []
    counters = 0

    def add_source(src_ref_base: int, targets: list[tuple[int, int]], wait_slot_of) -> None:
        """Tasks copying every tile of one source to ``targets`` [(rank, redundant slot)]."""
        nonlocal counters
        chunk_counter = {}
        for k, (t, offset, nbytes) in enumerate(geometry.tiles):
            chunk = k // geometry.chunk_tiles
            begin = len(dests)
            for d, (dst_rank, dst_slot) in enumerate(targets):
                key = (chunk, d)
                if key not in chunk_counter:
                    chunk_counter[key] = counters
                    counters += 1
                heap_offset = placement.weight_base + dst_slot * spec.weight_slot_bytes + spec.weight_offsets[t] + offset
                dests.append((dst_rank, heap_offset, chunk_counter[key], flag_slot(dst_slot, chunk),
                              geometry.chunk_size(chunk)))
            tasks.append((src_ref_base + t, offset, nbytes, begin, len(dests), wait_slot_of(chunk)))

    relay_jobs = []
    for e in range(rank * M, (rank + 1) * M):  # this rank's masters, in expert order
        replicas = instances(layout, log_to_phys, replica_count, e)
        if not replicas:
            continue
        direct = [replicas[i - 1] for i, _ in trees[e]] if e in trees else replicas
        add_source((e - rank * M) * T, direct, lambda chunk: -1)
    for e, tree in sorted(trees.items()):  # relays forward after every master task of this rank
        replicas = instances(layout, log_to_phys, replica_count, e)
        for relay, leaf_ids in tree:
            relay_rank, relay_slot = replicas[relay - 1]
            if relay_rank == rank and leaf_ids:
                relay_jobs.append((relay_slot, [replicas[i - 1] for i in leaf_ids]))
    for relay_slot, targets in relay_jobs:
        add_source((M + relay_slot) * T, targets, lambda chunk, s=relay_slot: flag_slot(s, chunk))

    grad_tasks, grad_srcs = [], []
    for e in range(rank * M, (rank + 1) * M):
        replicas = instances(layout, log_to_phys, replica_count, e)
        if not replicas:
            continue
        for t, tensor in enumerate(spec.grads):
            for offset in range(0, tensor.nbytes, geometry.tile_bytes):
                begin = len(grad_srcs)
                for src_rank, src_slot in replicas:
                    grad_srcs.append((src_rank, placement.grad_base + src_slot * spec.grad_slot_bytes
                                      + spec.grad_offsets[t] + offset))
                grad_tasks.append(((e - rank * M) * T + t, offset, min(geometry.tile_bytes, tensor.nbytes - offset),
                                   begin, len(grad_srcs)))
    return Schedule(rank=rank,
                    weight_tasks=np.array(tasks, dtype=np.int64).reshape(-1, 6),
                    dests=np.array(dests, dtype=np.int64).reshape(-1, 5),
                    num_counters=counters,
                    grad_tasks=np.array(grad_tasks, dtype=np.int64).reshape(-1, 5),
                    grad_srcs=np.array(grad_srcs, dtype=np.int64).reshape(-1, 2),
                    relays=trees, bytes_sent=sent)
