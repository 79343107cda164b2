"""The analytical performance model: what a phase of the layer costs on this machine, from
the machine profile (:mod:`ultraep.tune.profile`), the problem and a configuration, in
NumPy, vectorised over configurations (every function takes arrays of knob values that
broadcast together and returns seconds of their shape).

The phases and their knobs:

* weight sync (``WeightTransfer.weight_sync(..., blocks=)``): the grid;
* dispatch and combine (``Dispatcher``): the grid of its persistent copy kernels;
* the fused kernels (``raw_kernels/fused_moe.cu``): :class:`~ultraep.compute.fused.config.FusedConfig`
  -- the CTAs of the persistent grid and the tokens of a send and of a reduce task (its
  unrolls are not modelled: the kernels are measured at the source's).

The building blocks, each a quantity the profile measures:

* a copy moves its bytes at most at ``peer_bytes_per_s`` (what this process's SMs reach),
  ranks copying at once on one GPU together at most at the rate measured for that many
  (``MachineProfile.gpu_copy_bytes_per_s``), and each warp at most at
  ``copy_warp_bytes_per_s``: a grid of
  ``w`` warps that splits ``u`` equal units (pieces, rows) among them takes ``ceil(u / w)``
  units' time when the memory is not the limit, and blocks beyond those resident at once
  run in later waves; the weight sync's warps claim their pieces, at rates solved from the
  three syncs the profile timed;
* the fused kernels' GEMM tiles and relay tasks cost what the profile measured running
  those kernels (:class:`~ultraep.tune.profile.FusedCosts`, at the grid, with as many ranks
  of the GPU running them at once): ``ceil(t / c)`` waves of ``t`` tiles over the ``c``
  CTAs at work;
  their sends and reduces are counted in dependent round trips of a task warp, each what
  ``copy_warp_bytes_per_s`` gives the copy kernel's loads in flight;
* a flag handoff (a release fence and store, an acquire load) costs ``flag_s``, and so
  does a task's claim (an atomic between two block barriers); a kernel
  adds ``kernel_s`` to the device's time and ``launch_s`` to the host's; the host enqueues
  launches while the device runs earlier ones, so a call of many kernels timed from the
  host takes the longer of the two (a kernel timed on the device alone: the device's).

Not measured by the profile but fitted on the H200's sweeps under MPS, and named where they
are defined: the weight sync's store weight (and the ``SYNC_ESTIMATE_*`` fractions of a profile
that did not time the sync), the Dispatcher's
``L2_TRIP_FRACTION``, ``ROW_ROUND_FRACTION`` and ``ROW_STORE_FRACTION``, and ``MEMORY_CHANNELS`` (an H200
constant).

Two limits are joined by a p-norm (:data:`JOIN_P`) rather than a hard maximum: near the
point where both bind, neither reaches its own rate.

What it leaves out (stated per phase below): relay trees in weight sync, the token map's
dependence on routing beyond its item count, and contention between the fused kernels'
communication and GEMM tiles beyond the shared bandwidth (each is measured with its own
kind running on every rank). Under the MPS emulation one rank's kernels may run on fewer
CTAs than their grid once the ranks' grids together near the GPU's SMs (shares that
overlap; which rank varies from call to call): the profile measures how many the
unluckiest rank has at work (``FusedCosts.ctas_at_work``, profile version 6; kernel B's
apart, ``down_ctas_at_work``, since version 8), the model runs that rank's tiles over those
and the group waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ultraep.compute.fused.config import share_of_ctas
from ultraep.errors import ProfileError
from ultraep.runtime.dtypes import is_bool, is_int
from ultraep.runtime.kernels import kernel_constant
from ultraep.tune.device import COPY_THREADS, DISPATCH_THREADS
from ultraep.tune.profile import UP_RELEASED_SINCE, MachineProfile

JOIN_P = 4.0                 # two rates' limits joined as (a^p + b^p)^(1/p)
WARP_THREADS = 32

PIECE_BYTES = kernel_constant("transfer.cu", "PIECE_BYTES")
SYNC_WARPS = kernel_constant("transfer.cu", "SYNC_WARPS")
SYNC_MIN_BLOCKS = kernel_constant("transfer.cu", "SYNC_MIN_BLOCKS")
FM_BM = kernel_constant("fused_moe.cu", "FM_BM")
FM_UP_COLS = kernel_constant("fused_moe.cu", "FM_UP_COLS")
FM_DOWN_COLS = kernel_constant("fused_moe.cu", "FM_DOWN_COLS")
FM_TASK_WARPS = 4 * kernel_constant("fused_moe.cu", "GH_CONSUMERS")  # send/relay/reduce: the consumer warps
FM_UNROLL = kernel_constant("fused_moe.cu", "FM_UNROLL")  # the source's; FusedConfig's copy_unroll is not modelled
FM_REDUCE_UNROLL = kernel_constant("fused_moe.cu", "FM_REDUCE_UNROLL")
FM_ARRIVAL_BANDS = kernel_constant("fused_moe.cu", "FM_ARRIVAL_BANDS")
# What a call enqueues, kernels and CuPy copies (ultraep/token/device.py): dispatch's token
# map, row plan, send, barriers, expansion and the copies it returns; combine's barriers,
# send and reduce; a combine from expert_output's barriers and pull.
DISPATCH_LAUNCHES = 21
COMBINE_LAUNCHES = 4
PULL_LAUNCHES = 3
TOKEN_MAP_KEY_BYTES = 16     # per (token, slot) item: keys and positions written and read back
TOKEN_MAP_SEGMENT_ITEMS = 256  # items a token map warp walks: ultraep.token.device.SEGMENT_ITEMS (a test holds it)
DISPATCH_COPIES = 10         # of DISPATCH_LAUNCHES, CuPy copies of small arrays (the state kept, the metadata returned)


@dataclass(frozen=True)
class Problem:
    """One MoE layer call: ``tokens`` per rank of width ``hidden`` (``element_bytes`` each),
    experts of FFN width ``ffn``, top-``top_k`` routing over ``experts`` on ``ranks`` ranks,
    ``ranks_per_gpu`` of which share one GPU's memory (MPS emulation: all of them).
    ``slot_rows``: rows each local slot of the busiest rank receives (default: uniform
    routing, ``tokens * top_k * ranks / experts`` each); ``sends_per_token``: ranks a token
    crosses to (default: the expectation under uniform routing over distinct experts)."""

    tokens: int
    hidden: int
    ffn: int
    top_k: int
    experts: int
    ranks: int
    ranks_per_gpu: int = 1
    element_bytes: int = 2
    slot_rows: tuple[int, ...] | None = None
    sends_per_token: float | None = None
    keeps_h: bool = True

    def __post_init__(self):
        for name in ("tokens", "hidden", "ffn", "top_k", "experts", "ranks", "ranks_per_gpu", "element_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ProfileError(f"Problem.{name} must be a positive integer, got {value!r}")
        if self.experts % self.ranks:
            raise ProfileError(f"Problem: {self.experts} experts do not divide over {self.ranks} ranks")
        if self.top_k > self.experts:
            raise ProfileError(f"Problem: top_k {self.top_k} exceeds the {self.experts} experts")
        if self.slot_rows is not None and (len(self.slot_rows) == 0 or min(self.slot_rows) < 0):
            raise ProfileError("Problem.slot_rows must hold a non-negative row count per local slot")
        if not is_bool(self.keeps_h):
            raise ProfileError(f"Problem.keeps_h must be True or False, got {self.keeps_h!r}")

    @property
    def rows(self) -> np.ndarray:
        """Rows each local slot of the busiest rank receives."""
        if self.slot_rows is not None:
            return np.asarray(self.slot_rows, np.int64)
        per_rank = self.experts // self.ranks
        return np.full(per_rank, -(-self.tokens * self.top_k * self.ranks // self.experts), np.int64)

    @property
    def crossings(self) -> float:
        """Ranks a token is sent to (one send per destination rank)."""
        if self.sends_per_token is not None:
            return float(self.sends_per_token)
        # P(no chosen expert on a given rank) for top_k distinct experts drawn uniformly
        others, miss = self.experts - self.experts // self.ranks, 1.0
        for i in range(self.top_k):
            miss *= max(others - i, 0) / (self.experts - i)
        return self.ranks * (1.0 - miss)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_bytes

    def m_tiles(self, bm: int = FM_BM) -> int:
        """M-tiles of ``bm`` rows over the busiest rank's slots."""
        return int(np.sum(-(-self.rows // bm)))


@dataclass(frozen=True)
class SyncProblem:
    """The busiest sender of a weight sync: ``fanouts[i]`` replicas of its ``i``-th
    replicated master, ``expert_bytes`` each (``ExpertSpec.weight_slot_bytes``);
    ``ranks_copying`` ranks copy at once on one GPU's memory."""

    expert_bytes: int
    fanouts: tuple[int, ...]
    ranks_copying: int = 1

    @classmethod
    def from_replica_count(cls, replica_count, experts_per_rank: int, expert_bytes: int, *,
                           ranks_per_gpu: int = 1) -> SyncProblem:
        """The rank that writes the most replica bytes under a plan whose ``replica_count``
        (NumPy, ``Plan.replica_count``: instances of each expert, masters by rank) it is
        (direct copies, no relay trees); the ranks with replicas to send, up to
        ``ranks_per_gpu``, copy at once."""
        replicas = np.asarray(replica_count, np.int64).reshape(-1, experts_per_rank) - 1
        per_rank = replicas.sum(axis=1)
        busiest = int(np.argmax(per_rank))
        senders = int(np.count_nonzero(per_rank))
        return cls(int(expert_bytes), tuple(int(f) for f in replicas[busiest] if f > 0),
                   max(1, min(senders, ranks_per_gpu)))


def join(a, b):
    """Two limits on one duration joined (:data:`JOIN_P`)."""
    return (a ** JOIN_P + b ** JOIN_P) ** (1.0 / JOIN_P)


def bandwidth_s(profile: MachineProfile, copied_bytes, sharing: int):
    """``copied_bytes`` at the bandwidth: this process's SMs bound its own copy, the GPU's
    memory all ``sharing`` processes' copies together (each copying as much)."""
    return np.maximum(copied_bytes / profile.peer_bytes_per_s,
                      copied_bytes * sharing / profile.gpu_copy_bytes_per_s(sharing))


# -- weight sync ---------------------------------------------------------------------------
#
# weight_sync (raw_kernels/transfer.cu) is persistent: each warp claims runs of neighbouring
# pieces of PIECE_BYTES from one counter as it goes, loads each piece into registers and stores
# it to each of its replicas. A warp that runs faster takes more runs, so the call lasts the
# pieces over the grid's rate -- every SM's warps over their piece time -- and a tail
# (SYNC_TAIL_PIECES): no wait for the SM holding the most blocks (with a fixed share a warp, a
# sawtooth past each multiple of the SMs). A piece costs a warp on an SM with k blocks
# its latency (the load's round trip and the piece's bookkeeping: its task, tensor, source and
# destinations), joined (JOIN_P) with two shares, which bind as the SM's warps and the grid's
# SMs fill:
#
# * of the SM's pipe: the k blocks' pieces loaded once and stored to each replica at the SM's
#   rate of bytes loaded + stored;
# * of the process's path to memory, shared evenly by the busy SMs: the same bytes with a
#   stored byte counted as SYNC_STORE_WEIGHT loaded ones (a large fan-out reaches less of the
#   SMs' rate than a fan-out of 1).
#
# The three rates are the kernel's own (SyncRates): the profile times the sync itself where
# ranks share a GPU (SyncTimes) -- one block at fan-out 1 (the latency), one block at its widest
# fan-out (the SM's pipe), the full grid there (the path) -- and sync_rates solves the model for
# the rates that meet those times, so the model meets them and predicts every other grid and
# fan-out; the rates follow the model, not the profile's cache. Where the profile has not timed
# it (one process, the host, a profile before version 12) they are estimated from the copy
# probes with the fractions fitted on the H200's sweeps of the fixed-share kernel
# (SYNC_ESTIMATE_*). All the ranks copying at once move their bytes no faster than the memory's
# shared rate (bandwidth_s). Relay trees and per-chunk flags are not modelled.
SYNC_STORE_WEIGHT = 2.0  # fitted (1.7-2.1 on the H200's full grids; 1.5-2 on the H100's): a stored byte, in loaded ones
SYNC_ESTIMATE_LATENCY_ROUNDS = 1.6  # a piece's latency, in load round trips (1.1 us on the H200, 1.15 on the H100)
SYNC_ESTIMATE_SM_FRACTION = 0.73    # an SM's bytes loaded + stored, of twice its share of the peer copy
SYNC_ESTIMATE_PATH_FRACTION = 0.8   # the process's weighted bytes, of the peer copy's (a byte of each)
# The runs shrink to one piece as the grid's end nears, but a warp holds the two pieces after
# its current one claimed (the next, prefetched, and the one whose task row it reads ahead):
# the last warp to claim ends about two pieces after the grid's rate would have it.
SYNC_TAIL_PIECES = 2.0
SYNC_PATH_UNBOUND = 1e15  # a solved path rate this high: the full grid's time was met without the path
# The kernel's dependent round trips outside its pieces: at start-up the block's claim, then the
# task row of the piece it names (the other tables' reads go beside the claim). A warp counts
# itself done claiming two pieces before its copies end, so the counters' reset is not among them.
SYNC_SERIAL_ROUND_TRIPS = 2


def sms_bound_peer_copy(profile: MachineProfile) -> bool:
    """Whether this process's SMs, not the GPU's memory, bound its peer copy. Its time joins
    (JOIN_P) its SMs' limit with the memory's (what all its sharers moved copying at once):
    the SMs' is the tighter where the process reached less than 2^(-1/JOIN_P) of the
    memory's rate (0.84 at p = 4: 1.37 of 2.0 TB/s on a quarter of
    the H200, 0.62 on an eighth; not 1.79 of 1.99 on a half, whose 66 SMs would move 2.9 at
    the rate each reaches on a quarter). Where the memory bounds it (a whole GPU, no sharers
    measured, or a share that large) its rate says nothing of an SM's."""
    return (profile.shared_by > 1
            and profile.peer_bytes_per_s < 2.0 ** (-1.0 / JOIN_P) * profile.shared_copy_bytes_per_s)


def _sm_copy_bytes_per_s(profile: MachineProfile) -> float:
    """What one SM copies where nothing else bounds it: its share of the peer copy where the
    SMs bound that (:func:`sms_bound_peer_copy`), else one block of the per-warp probe on one
    SM (``copy_warp_bytes_per_s`` over ``COPY_THREADS``, far from the memory's limit)."""
    if sms_bound_peer_copy(profile):
        return profile.peer_bytes_per_s / profile.usable_sms
    return profile.copy_warp_bytes_per_s * COPY_THREADS / WARP_THREADS


@dataclass(frozen=True)
class SyncRates:
    """The weight sync's rates: a piece's latency on a warp (``piece_s``), what an SM loads +
    stores per second (``sm_bytes_per_s``), what the process's path to memory takes per second,
    a stored byte weighing SYNC_STORE_WEIGHT loaded ones (``path_bytes_per_s``)."""

    piece_s: float
    sm_bytes_per_s: float
    path_bytes_per_s: float


def estimated_sync_rates(profile: MachineProfile) -> SyncRates:
    """The rates from the copy probes (SYNC_ESTIMATE_*), for a profile that did not time the sync."""
    path = SYNC_ESTIMATE_PATH_FRACTION * (1.0 + SYNC_STORE_WEIGHT) * profile.peer_bytes_per_s
    return SyncRates(piece_s=_round_trip_s(profile) * SYNC_ESTIMATE_LATENCY_ROUNDS,
                     sm_bytes_per_s=SYNC_ESTIMATE_SM_FRACTION * 2.0 * _sm_copy_bytes_per_s(profile),
                     path_bytes_per_s=path)


@functools.lru_cache(maxsize=16)
def sync_rates(profile: MachineProfile) -> SyncRates:
    """The weight sync's rates: solved from the times the profile took (``profile.sync``) where
    it took them, else :func:`estimated_sync_rates` (memoised: a solve takes ~0.05 s)."""
    if profile.sync is None:
        return estimated_sync_rates(profile)
    timed = profile.sync
    return solved_sync_rates(profile, timed.expert_bytes, timed.fanout, timed.times_s)


def _sync_piece_s(costs: SyncRates, blocks_on_sm, busy_sms, mean_fanout: float):
    """A piece of a warp on an SM holding ``blocks_on_sm`` blocks, ``busy_sms`` SMs at work,
    the piece stored to ``mean_fanout`` replicas."""
    sm_bytes = blocks_on_sm * SYNC_WARPS * PIECE_BYTES
    pipe = sm_bytes * (1.0 + mean_fanout) / costs.sm_bytes_per_s
    path = sm_bytes * (1.0 + SYNC_STORE_WEIGHT * mean_fanout) * busy_sms / costs.path_bytes_per_s
    return (costs.piece_s ** JOIN_P + pipe ** JOIN_P + path ** JOIN_P) ** (1.0 / JOIN_P)


def _sync_warps_s(costs: SyncRates, sms: int, pieces: int, blocks, mean_fanout: float):
    """The grid's warps through ``pieces`` claimed pieces: blocks go to the SMs one at a time
    (``blocks`` at work, at most those resident), so ``blocks mod sms`` SMs hold a block more
    than the others; every SM's warps claim at their own pace, and the last warp ends
    SYNC_TAIL_PIECES of its pieces after the rest, on the fullest SM."""
    blocks = np.asarray(blocks, np.float64)
    busy = np.minimum(blocks, sms)
    fewer = np.floor(blocks / sms)
    more = blocks - fewer * sms  # SMs holding fewer + 1 blocks

    def piece(k):
        return _sync_piece_s(costs, np.maximum(k, 1.0), busy, mean_fanout)

    rate = np.where(blocks < sms, blocks * SYNC_WARPS / piece(1.0),
                    ((sms - more) * fewer / piece(fewer) + more * (fewer + 1) / piece(fewer + 1)) * SYNC_WARPS)
    return pieces / rate + SYNC_TAIL_PIECES * piece(np.ceil(blocks / sms))


def weight_sync_s(profile: MachineProfile, sync: SyncProblem, blocks, rates: SyncRates | None = None):
    """``weight_sync``'s kernel (no barrier, schedule compiled, no per-chunk flags) on ``blocks``
    blocks: its start-up (SYNC_SERIAL_ROUND_TRIPS round trips), then the busiest
    sender's pieces, every master's, claimed by the grid's warps (blocks beyond those
    resident find none left); no faster than the memory moves every copying rank's bytes.
    ``rates``: the sync's rates, default :func:`sync_rates`. Relay trees and per-chunk flags
    are not modelled."""
    blocks = np.asarray(blocks, np.float64)
    if not sync.fanouts:
        return profile.kernel_s + np.zeros_like(blocks)
    fanouts = np.asarray(sync.fanouts, np.float64)
    pieces = -(-sync.expert_bytes // PIECE_BYTES) * len(fanouts)
    at_once = np.minimum(blocks, profile.usable_sms * SYNC_MIN_BLOCKS)
    warps_s = _sync_warps_s(rates or sync_rates(profile), profile.usable_sms, pieces, at_once, float(fanouts.mean()))
    copied = float(np.sum(sync.expert_bytes * (1.0 + fanouts) / 2.0))  # a byte loaded and one stored: one copied
    serial_s = SYNC_SERIAL_ROUND_TRIPS * _round_trip_s(profile)
    return profile.kernel_s + serial_s + np.maximum(warps_s, bandwidth_s(profile, copied, sync.ranks_copying))


def _solve_rising(f, target: float, low: float, high: float) -> float:
    """The x in [low, high] where ``f`` (rising) meets ``target``, by geometric bisection;
    an end where ``target`` lies beyond it."""
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low * high) ** 0.5


def solved_sync_rates(profile: MachineProfile, expert_bytes: int, fanout: int, times_s) -> SyncRates:
    """The rates under which :func:`weight_sync_s` meets three times of one expert of
    ``expert_bytes`` sent by this process alone: ``times_s`` = (fan-out 1 on one block, fan-out
    ``fanout`` on one block, fan-out ``fanout`` on every resident block). Each time pins one
    rate (the latency, the SM's pipe, the process's path), solved in turn until they hold
    together; a rate a time cannot pin (its bound is not reached) stays at its search's end.
    With ``fanout`` 1 the second time says nothing new: the SM's pipe keeps its estimate."""
    one, wide, full = (float(t) for t in times_s)
    grid = profile.usable_sms * SYNC_MIN_BLOCKS
    untimed = dataclasses.replace(profile, sync=None)
    rates = estimated_sync_rates(untimed)

    def time_s(candidate: SyncRates, fan: int, blocks: int) -> float:
        return float(weight_sync_s(untimed, SyncProblem(expert_bytes, (fan,)), blocks, candidate))

    for _ in range(20):
        before = rates
        rates = dataclasses.replace(rates, piece_s=_solve_rising(
            lambda x: time_s(dataclasses.replace(rates, piece_s=x), 1, 1), one, 1e-9, 1e-3))
        if fanout > 1:
            rates = dataclasses.replace(rates, sm_bytes_per_s=_solve_rising(
                lambda x: -time_s(dataclasses.replace(rates, sm_bytes_per_s=x), fanout, 1), -wide, 1e8, 1e14))
        rates = dataclasses.replace(rates, path_bytes_per_s=_solve_rising(
            lambda x: -time_s(dataclasses.replace(rates, path_bytes_per_s=x), fanout, grid), -full, 1e9,
            10 * SYNC_PATH_UNBOUND))
        if all(abs(a / b - 1.0) < 1e-9 for a, b in zip(dataclasses.astuple(rates), dataclasses.astuple(before))):
            break
    return rates


# -- dispatch and combine ------------------------------------------------------------------
#
# Every copy kernel of the Dispatcher (raw_kernels/dispatch.cu) is persistent and grid-stride
# with a warp per unit (a token, or a received row). A warp's time is its dependent round
# trips to memory: each lane issues UNROLL 16-byte loads, waits for them, then stores them
# to every destination of the unit before the next round's loads issue -- a row copied waits
# for its loads (its one store drains behind the next loads), a token reduced for its top_k
# rows', and a token sent to several ranks for its stores: store_row_to_each stores each
# round's vectors once a destination, each row's worth ROW_STORE_FRACTION of a round trip,
# so a send's round lasts the longer of its loads' round and its stores (_row_round_fraction).
# Before its rounds a unit waits for the loads of its indices (row maps, expert ids, bases,
# peer bases: small arrays just written, in L2), each load dependent on the one before:
# L2_TRIP_FRACTION of a round trip each, queueing at no memory channel. A round of a row's
# copy (UNROLL vectors a lane, one contiguous span a warp) returns sooner than a round of
# heap.cu's copy, whose time the profile measures and whose loads lie a grid's stride apart
# (ROW_ROUND_FRACTION); a round of a token's sum loads UNROLL rows apart, as heap.cu's do.
#
# A round trip's time depends on how many warps wait on the memory at once (every sharing
# rank's): the warps and the memory form a closed queueing network, solved exactly by mean
# value analysis (_unit_cycles). A round is a request to one of MEMORY_CHANNELS
# independent channels (any, evenly), each serving its share of the bandwidth: a round's
# "copied" bytes (a byte read and one written, the profile's rates' unit) at
# 1 / MEMORY_CHANNELS of the rate. A warp alone takes the round trip of heap.cu's copy at the
# per-warp rate (_round_trip_s); each request queued ahead of it at its channel adds one
# service. So a few warps wait the round trip, many share the bandwidth, and between them
# the channels' queues grow as requests collide: the round trips stretch well before the
# bandwidth binds (a join of the two bounds keeps the knee sharp, and missed it by 10-20 %).
# Blocks beyond those resident at once run in later waves: the kernels' registers, not
# their threads, bound them (profile.dispatch_blocks_per_sm, measured since version 10).
# The warps of a grid run their units' mean rounded down at once, then those with one more
# unit run it at their own, smaller, concurrency: a ragged end of up to a unit's rounds. Where
# the units divide evenly the end is no sharper: the warps do not run in lockstep (each round
# waits in its channel's queue as long as it happens to), so warps of equal units finish
# spread out and the last of them run their last unit with few others at the memory -- a
# drain charged as one warp's unit (the sweeps gained nothing at even divisions: grid 64 of
# 4096 tokens against 65, 256 against 251, at 4 ranks). A grid just past an even division
# is charged no drain (nearly all its warps run the last unit): 64 is modelled 2-6 % over 65
# where the sweeps measured them alike, and a count just short of one likewise (4095 tokens
# on 256 blocks a drain under 4096). A continuous tail (the ragged warps' share of a unit
# plus the drain) fitted the sweeps worse; the search's buckets are multiples of 4096 tokens.
#
# Ranks sharing a GPU under MPS launch the same kernels at once through one context, whose
# front end starts them one at a time: each of a rank's kernels waits for the others' to
# start, a kernel's device overhead (profile.kernel_s) once for every rank of the GPU -- here,
# for the Dispatcher's kernels, which every rank launches together; the weight-sync sweep
# times one rank's kernel alone, and the fused kernels are measured with every rank running.
#
# Ranks sharing a GPU under MPS shares that overlap launch their kernels together (each
# after a device barrier of all of them), as fused kernel A's ranks do, and one rank then
# finds SMs for fewer of its blocks than it launched: the profile measures how many SMs
# (kernel A's CTAs at work, one CTA an SM), so that rank has as many SMs' worth of blocks
# at work -- up to the first grid measured with fewer at work, all of them up to its count:
# at a smaller grid the other ranks hold no more SMs (_sms_at_work). Its other blocks (and
# any rank's past the residency) start as the first ones end and run their units with only
# each other at the memory.

DISPATCH_UNROLL = kernel_constant("dispatch.cu", "UNROLL")  # 16-byte loads in flight per lane
DISPATCH_VECTOR_BYTES = kernel_constant("dispatch.cu", "VECTOR_BYTES")


# What the copy kernels' registers allow where the profile does not say (before version 10,
# the host): 40-48 registers a thread leave room for 5 blocks of 256 threads an SM, not the 8
# their threads alone would allow.
DISPATCH_BLOCKS_UNMEASURED = 5


def dispatch_blocks_per_sm(profile: MachineProfile) -> int:
    """Resident blocks of the Dispatcher's copy kernels per SM: the profile's measurement
    (the fewest of the kernels, by the occupancy their registers allow), else
    :data:`DISPATCH_BLOCKS_UNMEASURED`."""
    return profile.dispatch_blocks_per_sm or DISPATCH_BLOCKS_UNMEASURED


def _row_rounds(problem: Problem) -> int:
    """Round trips of a warp reading one row: UNROLL vectors per lane at a time."""
    return -(-problem.row_bytes // (DISPATCH_VECTOR_BYTES * WARP_THREADS * DISPATCH_UNROLL))


def _row_round_fraction(stores: float) -> float:
    """A round of a warp's row copy, in the profile's round trips, storing it to ``stores``
    destinations: its loads' round, or its stores where they take longer."""
    return max(ROW_ROUND_FRACTION, stores * ROW_STORE_FRACTION)


def _sum_rounds(problem: Problem) -> int:
    """Round trips of a warp summing a token's ``top_k`` rows (``sum_slots``): each lane walks
    its vectors one at a time, loading that vector of UNROLL rows at once."""
    vectors = -(-problem.row_bytes // (DISPATCH_VECTOR_BYTES * WARP_THREADS))
    return vectors * -(-problem.top_k // DISPATCH_UNROLL)


# The memory's independent channels: the H200's HBM3e, 6 stacks of 16 channels, each two
# 32-bit pseudo-channels. The profile does not measure it: another GPU needs its own.
MEMORY_CHANNELS = 192

# Fitted (with ROW_ROUND_FRACTION, on the eight H200 dispatch sweeps in tests/tune, mostly
# their grids of 1-20 blocks, where a warp's units add up alone): an index load served by
# L2 takes this fraction of the profile's round trip to memory (H100-class L2 hits take
# about half a DRAM access's latency).
L2_TRIP_FRACTION = 0.5
# Fitted likewise: a round of a row's contiguous copy against the profile's round of heap.cu's
# copy (four loads a grid's stride apart). Hidden 2048 (2 rounds a row) and 7168 (7) need
# both this and the index loads: grid 1 measured 2.4 and 6.2 round trips a unit.
ROW_ROUND_FRACTION = 0.65
# Fitted with it: a warp's stores of one row's round to one destination, in round trips.
# At grid 1 (one block, its 8 warps alone at the memory) the dispatch moved 57-62 GB/s loaded
# + stored through its SM at 2, 4 and 8 ranks alike, its sends storing a token to 2.0, 3.7
# and 5.5 ranks: rounds of the loads alone (0.8, the stores free) put 2 ranks 11 % over and
# 8 ranks 3-7 % under. Fitted on the grid-1 rows of the fourteen dispatch problems in
# tests/tune (the index loads held at L2_TRIP_FRACTION): 0.65 a load round, 0.557 a row
# stored (the stores bind from 2 destinations on), each within 4.1 % (rms 1.7 %). 0.5 is kept:
# over the whole sweeps it replays 0.01-0.07 points better than 0.557 (2, 4 and 8 ranks).
ROW_STORE_FRACTION = 0.5
# Dependent index loads before a unit's rounds (raw_kernels/dispatch.cu): send_tokens, the
# slot's expert id, then its rank's peer base and the expert's base row (write_pair_meta's
# stores come before the token's loads); expand_rows, the row's landing row; send_rows, the
# row's origin, then its source rank's peer base; pull_slots, the slot's expert id, then
# the peer base and base row; reduce_slots none (its rows follow from the token).
SEND_TOKEN_INDEX_TRIPS = 2
EXPAND_ROW_INDEX_TRIPS = 1
SEND_ROW_INDEX_TRIPS = 2
PULL_TOKEN_INDEX_TRIPS = 2


@functools.lru_cache(maxsize=256)
def _unit_cycles(most_warps: int, delay_s: float, service_s: float, unit_rounds: int, index_s: float) -> np.ndarray:
    """Mean value analysis of ``n`` warps (every ``n`` up to ``most_warps``; index 0 as one)
    each running units of ``index_s`` (its index loads: no channel's queue) and then
    ``unit_rounds`` rounds, each waiting ``delay_s`` and then at one of MEMORY_CHANNELS
    identical queues (any, evenly) that serve a round in ``service_s``: the mean time of a
    warp's unit."""
    cycles = np.empty(most_warps + 1)
    cycles[0] = index_s + unit_rounds * (delay_s + service_s)
    queued = 0.0  # requests at one channel
    for warps in range(1, most_warps + 1):
        cycle = index_s + unit_rounds * (delay_s + service_s * (1.0 + queued))
        queued = warps / cycle * unit_rounds * service_s / MEMORY_CHANNELS * (1.0 + queued)
        cycles[warps] = cycle
    return cycles


def _loaded_unit_s(profile: MachineProfile, warps, unit_rounds: int, index_trips: int, round_copied_bytes: float,
                   rate: float, round_fraction: float = 1.0) -> np.ndarray:
    """One unit of a warp among ``warps`` (array-like, every rank's) waiting on the memory at
    once: ``index_trips`` dependent loads from L2, then ``unit_rounds`` round trips, each
    ``round_fraction`` of the profile's alone and copying ``round_copied_bytes`` at the
    memory's ``rate``."""
    service = MEMORY_CHANNELS * round_copied_bytes / rate
    # a warp alone: its round trip, whatever it stores; where a round's service at its channel
    # exceeds the round trip (wide rows sent to many ranks) the delay turns slightly negative,
    # which keeps a lone warp at its round trip and the crowd under the memory's rate
    delay = round_fraction * _round_trip_s(profile) - service
    index_s = index_trips * L2_TRIP_FRACTION * _round_trip_s(profile)
    warps = np.maximum(np.asarray(warps, np.float64), 1.0).round().astype(np.int64)
    return _unit_cycles(int(warps.max()), delay, service, unit_rounds, index_s)[warps]



def _phase_s(profile: MachineProfile, warps, units_per_warp, unit_rounds: int, index_trips: int,
             round_copied_bytes: float, rate: float, round_fraction: float):
    """``warps`` (every rank's) at work together, each running ``units_per_warp`` units (a
    mean): its floor at all of them, then the one more unit of those that have one at theirs,
    at least one warp's (the drain of an even division: the section's comment)."""
    whole = np.floor(units_per_warp + 1e-9)
    more = units_per_warp - whole
    unit = functools.partial(_loaded_unit_s, profile, unit_rounds=unit_rounds, index_trips=index_trips,
                             round_copied_bytes=round_copied_bytes, rate=rate, round_fraction=round_fraction)
    at_once = whole * unit(warps)
    ragged = unit(np.maximum(np.ceil(warps * more), 1.0))
    return np.where(warps > 0, at_once + ragged, 0.0)


def _sms_at_work(profile: MachineProfile, sharing: int, sms):
    """Of ``sms`` SMs' worth of blocks, the SMs the unluckiest of ``sharing`` ranks finds: the
    profile's kernel A CTAs at work, except between a grid measured with all of them at work
    and the next one measured with fewer, where the other ranks, running fewer blocks, hold
    no more SMs than there: all of them up to that grid's count at work."""
    costs = profile.fused_costs(sharing)
    measured = costs.working_ctas(sms)
    if costs.ctas_at_work is None:
        return measured
    grids, at_work = np.asarray(costs.grids, np.float64), np.asarray(costs.ctas_at_work, np.float64)
    above = np.minimum(np.searchsorted(grids, sms), len(grids) - 1)  # the first grid measured at or above
    below = np.maximum(above - 1, 0)
    first_loss = (at_work[above] < grids[above]) & ((above == 0) | (at_work[below] >= grids[below]))
    return np.where(first_loss & (sms <= grids[above]), np.minimum(sms, at_work[above]), measured)


def _copy_kernel_s(profile: MachineProfile, grid, units: float, unit_rounds: int, index_trips: int,
                   copied_bytes: float, sharing: int, round_fraction: float = 1.0):
    """One of the Dispatcher's copy kernels on ``grid`` blocks: ``units`` warp units, each
    ``index_trips`` index loads and ``unit_rounds`` round trips (``round_fraction`` of the
    profile's), ``copied_bytes`` in all, on every one of ``sharing`` ranks at once. First the
    blocks at work -- the unluckiest rank's, every other rank's resident ones -- run their
    units; then that rank's others and every rank's past the residency, in as many waves as
    that rank's need. No faster than this process's copy."""
    grid = np.asarray(grid, np.float64)
    warps_per_block = DISPATCH_THREADS // WARP_THREADS
    per_sm = dispatch_blocks_per_sm(profile)
    resident = profile.usable_sms * per_sm
    busy = np.minimum(grid, np.ceil(units / warps_per_block))  # blocks with a unit
    placed = np.minimum(busy, resident)
    at_work = np.minimum(placed, per_sm * _sms_at_work(profile, sharing, placed / per_sm))
    at_work = np.where(np.isclose(at_work, placed, rtol=1e-9, atol=0.0), placed, at_work)
    units_per_warp = units / (busy * warps_per_block)
    round_copied = copied_bytes / (units * unit_rounds)
    memory = profile.gpu_copy_bytes_per_s(sharing)  # every sharer's warps wait on it
    phase = functools.partial(_phase_s, profile, units_per_warp=units_per_warp, unit_rounds=unit_rounds,
                              index_trips=index_trips, round_copied_bytes=round_copied, round_fraction=round_fraction)
    first = phase(warps_per_block * (at_work + (sharing - 1) * placed), rate=memory)
    mine, others = busy - at_work, (sharing - 1) * (busy - placed)
    later_warps = warps_per_block * (np.minimum(mine, resident) + others)
    later = np.where(others > 0, phase(later_warps, rate=memory),
                     phase(later_warps, rate=profile.peer_bytes_per_s))  # that rank's blocks alone: its own rate
    return np.maximum(first + np.ceil(mine / resident) * later, copied_bytes / profile.peer_bytes_per_s)


def _kernels_s(profile: MachineProfile, kernels: int, sharing: int):
    """The device's overhead of ``kernels`` kernels launched by each of ``sharing`` ranks of
    one GPU at once: the front end starts every rank's (the section's comment)."""
    return kernels * sharing * profile.kernel_s


def token_map_trips(problem: Problem) -> int:
    """Dependent round trips to memory of the longest chain of each small kernel before the
    sends (raw_kernels/dispatch.cu), whose launches alone the model counted before:
    ``route_keys`` 1 (a slot's id and its token's earlier ids at once); ``count_segments`` and
    ``rank_segments`` 2 per 32 items of a segment (the keys, then the segment's count of that
    key, loaded after the last chunk's store to it); ``scan_segments`` and ``publish_counts``
    2 each; ``plan_rows`` one per expert of a rank and source rank (each load of the table
    waits for the running sum stored before it) and one per rank for the outcome; each small
    CuPy copy 1. The 2 x 4096 x 8 items of 4096 tokens a rank: 115 of them."""
    segment_chunks = TOKEN_MAP_SEGMENT_ITEMS // WARP_THREADS
    plan = problem.experts // problem.ranks * problem.ranks + problem.ranks
    return 1 + 2 * 2 * segment_chunks + 2 + 2 + plan + DISPATCH_COPIES


def dispatch_s(profile: MachineProfile, problem: Problem, grid):
    """``Dispatcher.dispatch``: the token map (its launches, its key traffic, its round trips
    -- :func:`token_map_trips` -- and the count barrier); ``send_tokens``, a warp per token
    reading it once (a row's rounds, each as long as its stores where they take longer) and
    storing it to each of its ``crossings`` destination ranks (``(1 + crossings) / 2`` rows
    copied); the tokens barrier; ``expand_rows``, a warp
    per received row (a row's rounds, one row copied). ``grid`` sizes both copy kernels."""
    row = problem.row_bytes
    recv = float(problem.rows.sum())
    sharing = problem.ranks_per_gpu
    keys = 2.0 * problem.tokens * problem.top_k * TOKEN_MAP_KEY_BYTES * sharing / profile.copy_bytes_per_s
    rounds = _row_rounds(problem)
    device = (_kernels_s(profile, DISPATCH_LAUNCHES, sharing) + keys + token_map_trips(problem) * _round_trip_s(profile)
              + 2 * profile.flag_s
              + _copy_kernel_s(profile, grid, problem.tokens, rounds, SEND_TOKEN_INDEX_TRIPS,
                               problem.tokens * (1.0 + problem.crossings) / 2.0 * row, sharing,
                               _row_round_fraction(problem.crossings))
              + _copy_kernel_s(profile, grid, recv, rounds, EXPAND_ROW_INDEX_TRIPS, recv * row, sharing,
                               _row_round_fraction(1.0)))
    return join(DISPATCH_LAUNCHES * profile.launch_s, device)


def combine_s(profile: MachineProfile, problem: Problem, grid):
    """``Dispatcher.combine`` (set up without ``expert_output``): a barrier, ``send_rows``
    (a warp per received row: a row's rounds, one row copied back to its token's rank), a
    barrier, ``reduce_slots`` (a warp per token: its ``top_k`` rows' rounds, ``top_k`` rows
    read and one written)."""
    row = problem.row_bytes
    recv = float(problem.rows.sum())
    sharing = problem.ranks_per_gpu
    device = (_kernels_s(profile, COMBINE_LAUNCHES, sharing) + 2 * profile.flag_s
              + _copy_kernel_s(profile, grid, recv, _row_rounds(problem), SEND_ROW_INDEX_TRIPS, recv * row, sharing,
                               _row_round_fraction(1.0))
              + _copy_kernel_s(profile, grid, problem.tokens, _sum_rounds(problem), 0,
                               problem.tokens * (problem.top_k + 1) * row / 2.0, sharing))
    return join(COMBINE_LAUNCHES * profile.launch_s, device)


def pull_s(profile: MachineProfile, problem: Problem, grid):
    """``Dispatcher.combine`` from ``expert_output`` (the fused layer's): a barrier,
    ``pull_slots`` (a warp per token reading its ``top_k`` rows where the experts wrote them,
    in peers' heaps, as ``reduce_slots`` reads its own, and writing one), a barrier. No row
    is sent back."""
    sharing = problem.ranks_per_gpu
    device = (_kernels_s(profile, PULL_LAUNCHES, sharing) + 2 * profile.flag_s
              + _copy_kernel_s(profile, grid, problem.tokens, _sum_rounds(problem), PULL_TOKEN_INDEX_TRIPS,
                               problem.tokens * (problem.top_k + 1) * problem.row_bytes / 2.0, sharing))
    return join(PULL_LAUNCHES * profile.launch_s, device)


# -- the fused kernels ---------------------------------------------------------------------
#
# A rank's CTAs claim kernel A's tasks in order -- sends, then up tiles, while the store warps
# of every CTA claim the relays from a counter of their own -- and kernel B's -- down tiles,
# then reduces -- one at a time. The tiles' and relays' times are the profile's measurement
# of these very kernels (FusedCosts: at the grid, with every rank of the GPU running the same
# at once): a tile's claim, the pipeline's fill, its epilogue (kernel A's SwiGLU through the
# stage ring, kernel B's system fences and done flag) and what every other tile costs it are
# in them. The sends and reduces, which the profile does not run, are counted in dependent
# round trips of a task warp to memory, each the time the per-warp copy rate gives the copy
# kernel's loads in flight (heap.cu keeps COPY_LOADS_IN_FLIGHT 16-byte loads a lane, as
# FM_UNROLL does).
#
# Of a rank's CTAs, those at work may be fewer than its grid: under MPS shares that overlap,
# one rank's CTAs need not all find an SM while the other ranks hold theirs. The profile
# measures how many the unluckiest rank has, in each kernel (FusedCosts.working_ctas,
# working_down_ctas); the tiles cost what they cost at the grid (every rank's CTAs contend as
# launched), their waves run over the CTAs at work.
#
# The sharers' down tile runs start as their hosts leave a barrier, milliseconds apart (3.9 ms
# at 8 sharers, 1.7 at 4, of 1.5-2.8 ms runs), so they overlap only in part; a layer's kernels
# B overlap almost wholly (each starts as its rank's kernel A ends, within a fraction of it).
# Their up tile runs start together behind a device barrier (profile version 8 on): a down
# tile costs what it costs alone times what running together costs the up tiles that keep h
# at the grid -- of the probe's tiles, those whose stores per microsecond are nearest a down
# tile's (160 KB in 30-58 us against 64 KB in 12-24 us; the up tiles without h store a fifth).

COPY_LOADS_IN_FLIGHT = 4     # heap.cu copy_vectors' 16-byte loads in flight a thread (copy_warp_bytes_per_s)
REDUCE_INDEX_TRIPS = 3       # a reduce lane's loads before its rows: ids; base, rank_off, rank_mtile; its done flag
GH_STORE_WARPS = kernel_constant("fused_moe.cu", "GH_STORE_WARPS")  # the warps that relay an M-tile's rows
GG_GROUP_M = kernel_constant("fused_moe.cu", "GG_GROUP_M")  # M-tiles whose column blocks a rank's tiles run first


def _round_trip_s(profile: MachineProfile):
    """One dependent round trip to memory of a task warp: the per-warp copy rate over the
    bytes a warp of the copy kernel keeps in flight (a copy warp waits one round trip per
    round of loads; its stores do not wait)."""
    return WARP_THREADS * 16 * COPY_LOADS_IN_FLIGHT / profile.copy_warp_bytes_per_s


def _copy_rounds(problem: Problem) -> int:
    """Round trips of a warp's row copy: 16-byte vectors, FM_UNROLL per lane in flight."""
    return -(-problem.row_bytes // (16 * WARP_THREADS * FM_UNROLL))


def _task_rounds_s(tasks, working, task_s, traffic_s):
    """``tasks`` equal tasks of ``task_s`` each on ``working`` CTAs, ``traffic_s`` all their
    bytes at the bandwidth. A CTA runs whole tasks, claimed in turn: rounds of ``working``
    tasks at once (the last one partial), each its share of the traffic joined with one
    task's time. Spreading the tasks' time evenly (``tasks / working`` of one) would let 32
    tasks on 28 CTAs end after 1.14 task times; the last four start after the first round."""
    whole = np.floor(tasks / working)
    partial = tasks - whole * working
    per_task = traffic_s / np.maximum(tasks, 1.0)
    return (whole * join(per_task * working, task_s)
            + np.where(partial > 0, join(per_task * partial, task_s), 0.0))


def _working(measured, ctas, working):
    """``working`` CTAs at work of ``ctas`` (float arrays); None: ``measured(ctas)``, the
    profile's unluckiest rank's (FusedCosts.working_ctas or working_down_ctas)."""
    return measured(ctas) if working is None else np.asarray(working, np.float64)


def fused_up_s(profile: MachineProfile, problem: Problem, ctas, send_tokens, working=None, senders=None):
    """Kernel A of the busiest rank on ``ctas`` CTAs, ``working`` of them at work (default:
    as many as the profile's unluckiest rank has, whom the group waits for), ``senders`` of
    those sending first (default FusedConfig's: ``share_of_ctas``).

    A send task is a claim and, per round of FM_TASK_WARPS tokens, a token's copy (read once,
    stored to every destination: a row copy's round trips per row copied) and its system
    fence. A CTA runs whole tasks: the sends take rounds of one task per CTA at work, each
    bounded by its share of their traffic too (every byte read and written at the GPU's
    shared copy rate). With every CTA at work a sender, the tiles wait for the last round;
    with fewer, the sends take their rounds on the senders alone, and the other CTAs run
    tiles meanwhile from the first band's arrival (the sends over FM_ARRIVAL_BANDS) on;
    the last band's tiles wait for the last round. The device's other CTAs send too while
    their next tile's rows are not there (before the first band, and where the senders fall
    behind), which this leaves out; ``senders`` 0, where only they send, counts as every
    CTA sending first. A relay
    task (one M-tile's rows) is measured; one of a partial M-tile is charged by its rows'
    rounds. The up tiles (``bm`` rows x ``2 * up_cols`` columns over ``hidden``, storing
    ``h`` as ``problem.keeps_h`` says) run in waves of the measured tile over the CTAs at work.

    Where the relays run on the store warps (FusedCosts.relays_on_store_warps), the tiles
    start as the sends end: an M-tile's rows are relayed as they arrive, and each CTA's
    store warps keep relaying ahead of the tiles; they bound the kernel only if all the
    relays (one at a time per CTA) and the tiles of the last M-tile group outlast it. Where
    the relays are claimed tasks between the sends and the tiles (before profile version 6),
    every send is claimed before the first relay: the relays are a phase of their own, their
    work over the CTAs bounded by their traffic (a row read and written), then the tiles."""
    ctas = np.asarray(ctas, np.float64)
    send_tokens = np.asarray(send_tokens, np.float64)
    costs = profile.fused_costs(problem.ranks_per_gpu)
    working = _working(costs.working_ctas, ctas, working)
    row, rows = problem.row_bytes, problem.rows
    trip = _round_trip_s(profile)
    # a token is read once and stored to each destination: a row copy's round trips per row copied
    token_trips = _copy_rounds(problem) * (1.0 + problem.crossings) / 2.0 + 1
    send_task = profile.flag_s + np.ceil(send_tokens / FM_TASK_WARPS) * token_trips * trip
    send_traffic = problem.tokens * (1.0 + problem.crossings) * row  # a token read once, stored crossings times
    # a relay's time per round of its warps' rows, its partial M-tiles' rounds counted as theirs
    relay_warps = GH_STORE_WARPS if costs.relays_on_store_warps else FM_TASK_WARPS
    relay_rounds = float(np.sum(rows // FM_BM * -(-FM_BM // relay_warps) + -(-(rows % FM_BM) // relay_warps)))
    relay_work = costs.relay_task_s(problem.hidden, ctas) * relay_rounds / -(-FM_BM // relay_warps)
    m_tiles, col_blocks = problem.m_tiles(), -(-problem.ffn // FM_UP_COLS)
    tile = costs.up_tile_s(problem.hidden, ctas, problem.keeps_h)
    tiles = np.ceil(m_tiles * col_blocks / working) * tile
    senders = share_of_ctas(ctas) if senders is None else np.asarray(senders, np.float64)
    # none first (0): every CTA sends while its next tile's rows are not there, at the start all of them
    sending = np.where(senders == 0, working, np.clip(senders, 1.0, working))
    sends = _task_rounds_s(np.ceil(problem.tokens / send_tokens), sending, send_task,
                           bandwidth_s(profile, send_traffic, problem.ranks_per_gpu))
    if costs.relays_on_store_warps:
        last_group = np.ceil(min(GG_GROUP_M, m_tiles) * col_blocks / working) * tile
        # tiles the CTAs that do not send run during the sends, from the first band's arrival
        beside = (working - sending) * sends * (1.0 - 1.0 / FM_ARRIVAL_BANDS) / tile
        last_band = np.ceil(m_tiles * col_blocks / FM_ARRIVAL_BANDS / working) * tile
        after = np.maximum(np.ceil(np.maximum(m_tiles * col_blocks - beside, 0.0) / working) * tile, last_band)
        body = np.maximum(sends + after, np.maximum(sends, relay_work / working) + last_group)
    else:  # every send is claimed before the first relay: two phases, each its own limits
        relay_traffic = 2.0 * float(rows.sum()) * row  # a row relayed: read and written
        body = sends + join(bandwidth_s(profile, relay_traffic, problem.ranks_per_gpu), relay_work / working) + tiles
    return profile.kernel_s + body


def _down_tile_s(profile: MachineProfile, problem: Problem, ctas):
    """A down tile of ``problem`` at ``ctas`` CTAs (float array) with every rank of its GPU
    running theirs: storing y too in a training forward (``problem.keeps_h``: the fused forward
    keeps h and y together); with sharers, the tile alone times the up tiles' (keeping h)
    shared over alone time at the grid, the mean over their reductions, where those were
    measured together (the section's comment)."""
    costs = profile.fused_costs(problem.ranks_per_gpu)
    alone = profile.fused
    if costs is alone or profile.version < UP_RELEASED_SINCE:
        return costs.down_tile_s(problem.ffn, ctas, problem.keeps_h)
    contention = np.mean([costs.up_tile_s(k, ctas) / alone.up_tile_s(k, ctas) for k in costs.up_k], axis=0)
    return alone.down_tile_s(problem.ffn, ctas, problem.keeps_h) * contention


def fused_down_s(profile: MachineProfile, problem: Problem, ctas, reduce_tokens, working=None):
    """Kernel B of the busiest rank on ``ctas`` CTAs, ``working`` of them at work (default:
    the profile's unluckiest rank's in kernel B, measured on the down tiles since profile
    version 8, kernel A's before): the down tiles (``bm`` x ``down_cols`` over ``ffn``,
    :func:`_down_tile_s`) in waves of the tile over the CTAs at work; then the reduce tasks,
    a claim and per round of FM_TASK_WARPS tokens a token's dependent round trips:
    REDUCE_INDEX_TRIPS loads to find its slots' rows and done flags, then per block of
    FM_DOWN_COLS columns its slots' rows read FM_REDUCE_UNROLL at once. Reduces fill the last
    wave's idle CTAs; what does not fit there, at least one task, extends the kernel in rounds
    of one whole task per CTA at work, each bounded by its share of the reduces' traffic too."""
    ctas = np.asarray(ctas, np.float64)
    reduce_tokens = np.asarray(reduce_tokens, np.float64)
    costs = profile.fused_costs(problem.ranks_per_gpu)
    working = _working(costs.working_down_ctas, ctas, working)
    col_blocks = -(-problem.hidden // FM_DOWN_COLS)
    down_tiles = problem.m_tiles() * col_blocks
    tile = _down_tile_s(profile, problem, ctas)
    waves = np.ceil(down_tiles / working)
    idle = (waves * working - down_tiles) * tile  # CTA-seconds free in the last wave
    token_trips = REDUCE_INDEX_TRIPS + -(-problem.top_k // FM_REDUCE_UNROLL) * col_blocks
    reduce_task = profile.flag_s + np.ceil(reduce_tokens / FM_TASK_WARPS) * token_trips * _round_trip_s(profile)
    # the last wave's idle CTA-time holds some tasks, the rest take whole rounds
    reduce_tasks = np.ceil(problem.tokens / reduce_tokens)
    excess_tasks = np.maximum(reduce_tasks - idle / reduce_task, 1.0)
    reduce_bw = bandwidth_s(profile, problem.tokens * (problem.top_k + 1) * problem.row_bytes / 2.0,
                            problem.ranks_per_gpu)
    tail = _task_rounds_s(excess_tasks, working, reduce_task, reduce_bw * excess_tasks / reduce_tasks)
    return profile.kernel_s + waves * tile + tail


def fused_windows(profile: MachineProfile, problems, ctas, send_tokens, reduce_tokens, senders=None) -> dict:
    """The group's windows of one fused forward, one :class:`Problem` per rank (its own
    routing): ``up``, kernel A's (the slowest rank's); ``down``, kernel B's, which opens when
    the first rank's kernel A ends and closes when the last rank's reduces do -- they wait
    for every rank's down tiles, so the ranks' kernel A ends' spread is in it; ``forward``,
    both (the slowest rank's A and B).

    One rank has only the profile's CTAs at work (FusedCosts.working_ctas in kernel A,
    working_down_ctas in kernel B), the others all of theirs: which rank lags varies from
    call to call, so each rank takes that turn and the windows are the median over the turns
    (a timed window is the median of calls). One problem: that rank, lagging, and its A, B
    and their sum. ``senders``: kernel A's (default FusedConfig's)."""
    ctas = np.asarray(ctas, np.float64)
    full = [(np.asarray(fused_up_s(profile, p, ctas, send_tokens, ctas, senders), np.float64),
             np.asarray(fused_down_s(profile, p, ctas, reduce_tokens, ctas), np.float64)) for p in problems]
    lagging = [(np.asarray(fused_up_s(profile, p, ctas, send_tokens, senders=senders), np.float64),
                np.asarray(fused_down_s(profile, p, ctas, reduce_tokens), np.float64)) for p in problems]
    turns = {"up": [], "down": [], "forward": []}
    for lagger in range(len(problems)):
        up = np.stack([(lagging if r == lagger else full)[r][0] for r in range(len(problems))])
        down = np.stack([(lagging if r == lagger else full)[r][1] for r in range(len(problems))])
        forward = (up + down).max(axis=0)
        turns["up"].append(up.max(axis=0))
        turns["down"].append(forward - up.min(axis=0))
        turns["forward"].append(forward)
    return {name: np.median(np.stack(values), axis=0) for name, values in turns.items()}


PHASES = ("weight_sync", "dispatch", "combine", "fused_up", "fused_down")


def predict(profile: MachineProfile, problem: Problem, sync: SyncProblem | None, configs: dict) -> dict:
    """Each phase's modelled seconds for ``configs`` (arrays that broadcast together:
    ``sync_blocks``, ``dispatch_grid``, ``ctas``, ``send_tokens``, ``reduce_tokens``);
    ``weight_sync`` is zero without a ``sync`` problem."""
    return {
        "weight_sync": (weight_sync_s(profile, sync, configs["sync_blocks"]) if sync is not None
                        else np.zeros_like(np.asarray(configs["sync_blocks"], np.float64))),
        "dispatch": dispatch_s(profile, problem, configs["dispatch_grid"]),
        "combine": combine_s(profile, problem, configs["dispatch_grid"]),
        "fused_up": fused_up_s(profile, problem, configs["ctas"], configs["send_tokens"]),
        "fused_down": fused_down_s(profile, problem, configs["ctas"], configs["reduce_tokens"]),
    }
