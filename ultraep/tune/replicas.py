"""Cost-aware replication: the smallest replica worth its weight transfer, from the
machine profile (``min_replica_tokens="auto"``).

The model (:func:`min_replica_tokens_for`). A replica of an expert is paid for by copying
the expert's bytes ``B`` to a peer before the layer's expert compute (weight sync runs
before dispatch, and the replica's compute waits for its copy):

    copy = B / peer_bytes_per_s

and it pays back by the time its ``d`` tokens would have taken on the hottest rank. Let
``t(m)`` be the modelled time of one expert's compute at ``m`` rows
(:meth:`~ultraep.tune.profile.ComputeCurve.expert_seconds`, scaled to the expert's weight
elements): flat while the call is bound by reading the weights, then growing linearly
once it is compute-bound. The master keeps the rest of its rows and still reads all its
weights, so moving ``d`` of its ``n`` rows away saves ``t(n) - t(n - d)``, and for a ``t``
that is flat then linear that is at least the part of ``d`` rows' compute that grows
with the rows:

    saving(d) = compute_passes * (t(d) - t(0+))        t(0+): the flat floor

``min_replica_tokens`` is the smallest ``d`` with ``saving(d) > copy``. So a replica must
take at least the rows where the expert's compute stops being weight-bound (the knee)
plus as many as the copy's time buys at the compute-bound rate. Decode (tens of tokens
per rank): every expert is weight-bound, moving rows saves next to nothing, and the
threshold exceeds any expert's excess -- no replica is made. Prefill (thousands of tokens
per rank): the threshold is a few hundred tokens, small beside the excess of a hot
expert, and replication proceeds.

What the model leaves out: the receiving rank's own weight read for the replica (it has
slack by construction of the plan), the launches of weight sync (paid once per layer, not
per replica) and any overlap of weight sync with other work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ultraep.errors import CollectiveError, ProfileError
from ultraep.runtime.dtypes import is_int
from ultraep.tune.profile import (MachineProfile, cache_dir, cache_profile, fused_costs, load_profile, make_probe,
                                  measure_fused, profile_path, stderr_progress)

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup
    from ultraep.transfer import ExpertSpec

NEVER = 2**31 - 1  # "no replica pays off": larger than any load the planner's int32 arithmetic holds
PROFILE_TIMEOUT_S = 900.0  # the host's first rank may compile kernels and measure while the others wait
SHARED_WHAT = "machine profile: the copy rate of the ranks sharing a GPU"
SHARED_FUSED_WHAT = "machine profile: the fused kernels' tasks of the ranks sharing a GPU, all at once"
SHARED_COPY_BATCH_S = 0.05  # each rank's copies of one round of the shared copy last about this long
RELEASE_TIMEOUT_S = 10.0  # a device barrier before a probe launch waits this long for the other sharers at most


def min_replica_tokens_for(spec_bytes: int, profile: MachineProfile, *, weight_elements: int | None = None,
                           compute_passes: float = 1.0) -> int:
    """The fewest tokens a replica must serve to save more time than copying it costs (the
    module docstring's model), or :data:`NEVER`.

    ``spec_bytes``: bytes copied per replica (``ExpertSpec.weight_slot_bytes``; in training
    add what restore and the gradient reduction move for it); ``weight_elements``: the
    expert's weight elements, which scale the measured compute (default ``spec_bytes // 2``,
    a bf16 expert); ``compute_passes``: expert GEMM passes its rows run per copy (1 for
    inference; 3 in training: forward, input and weight gradient)."""
    if not isinstance(profile, MachineProfile):
        raise ProfileError(f"profile must be a MachineProfile (ultraep.tune.load_profile), "
                           f"got {type(profile).__name__}")
    for name, value in (("spec_bytes", spec_bytes), ("weight_elements", weight_elements)):
        if value is not None and (not is_int(value) or value < 1):
            raise ProfileError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(compute_passes, bool) or not isinstance(compute_passes, (int, float)) or not compute_passes > 0:
        raise ProfileError(f"compute_passes must be a positive number, got {compute_passes!r}")
    elements = int(spec_bytes) // 2 if weight_elements is None else int(weight_elements)
    copy_s = int(spec_bytes) / profile.peer_bytes_per_s
    curve = profile.compute
    floor = float(curve.expert_seconds(0, max(elements, 1)))

    def pays_off(tokens: int) -> bool:
        return compute_passes * (float(curve.expert_seconds(tokens, max(elements, 1))) - floor) > copy_s

    if not pays_off(NEVER):
        return NEVER
    low, high = 0, NEVER  # saving is non-decreasing in the tokens: bisect for the first that pays off
    while high - low > 1:
        middle = (low + high) // 2
        if pays_off(middle):
            high = middle
        else:
            low = middle
    return high


def expert_weight_elements(spec: ExpertSpec) -> int:
    """Elements of an expert's weights that its compute multiplies (FP8 scales excluded)."""
    return sum(t.numel for t in spec.weights if t.name not in spec.scale_of)


def group_profile(group: EPGroup, backend: str, *, what: str, timeout_s: float = PROFILE_TIMEOUT_S,
                  then: Callable[[MachineProfile], Any] = lambda profile: profile, shared: bool = False,
                  sync_times: Callable[[int], tuple] | None = None) -> list:
    """Collective: every rank's ``then(profile)`` for its machine's profile (of ``backend``,
    ``"host"`` or ``"device"``), in rank order. The first rank of each host loads or
    measures the profile before the host's other ranks look, so a machine is measured once
    (they then find it in the cache) and no two ranks measure one GPU at once; with
    ``shared``, where ranks share a GPU, the profile then gets their copy rate and fused
    tasks' times together (:func:`measure_shared`, which times the weight sync through
    ``sync_times`` where given). An error on any rank is raised on every rank, naming ``what``
    needed the profile."""
    error, profile = None, None
    for turn in (0, 1):
        if (group.local_rank == 0) == (turn == 0):
            try:
                profile = load_profile(backend, device=group.device,
                                       progress=stderr_progress if group.local_rank == 0 else None)
            except Exception as exc:  # reported on every rank below, never left to hang the others
                error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
        if turn == 0:
            group.barrier(timeout_s, what=f"{what} (the first rank of each host measures the machine profile)")
    group.raise_if_any(error, f"{what} (machine profile)", timeout_s=timeout_s)
    if shared:
        profile = measure_shared(group, backend, profile, timeout_s=timeout_s, sync_times=sync_times)
    value = None
    try:
        value = then(profile)
    except Exception as exc:
        error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
    group.raise_if_any(error, what, timeout_s=timeout_s)
    return group.allgather(value, what=what)


def measure_shared(group: EPGroup, backend: str, profile: MachineProfile, *, timeout_s: float = PROFILE_TIMEOUT_S,
                   sync_times: Callable[[int], tuple] | None = None) -> MachineProfile:
    """Collective: ``profile`` with what all ranks sharing this rank's GPU reach together,
    measured now where any rank's profile lacks it for their count and written to the cache
    by each host's first rank; unchanged where no GPU is shared:

    * ``shared_copy_bytes_per_s`` (and ``shared_by``): every rank copies in the same rounds
      between barriers; a GPU's rate is its ranks' bytes over the window from the first
      start to the last end (one clock per host), the best of the rounds;
    * ``shared_fused``: every rank runs the fused tasks of its profile's ``fused`` (the same
      grids and reductions) at once, a barrier before each round -- on the GPU kernel A's
      tasks also behind a device barrier of the GPU's ranks (:func:`sharers_barrier`), so
      that they start together as a layer's kernel A does; a task's time is the slowest
      rank's of that GPU, its CTAs at work the fewest of any rank in a round, the median
      round (:func:`~ultraep.tune.profile.fused_costs`);
    * ``sync``, given ``sync_times`` and every rank on one GPU: rank 0's weight sync times
      (:func:`timed_sync`)."""
    place = (group.hostname, group.device)
    places = group.allgather(place, what=f"{SHARED_WHAT} (ranks per GPU)")
    sharing = places.count(place)
    lacking = sharing > 1 and (profile.shared_by != sharing or profile.shared_fused is None
                               or profile.shared_fused.sharing != sharing)
    untimed_sync = (sync_times is not None and backend == "device" and sharing == group.size > 1
                    and (profile.sync is None or profile.sync.sharing != sharing))
    needs = group.allgather((lacking, untimed_sync), what=SHARED_WHAT)
    if any(lack for lack, _ in needs):
        profile = shared_rates(group, backend, profile, places, timeout_s)
    if any(untimed for _, untimed in needs):
        profile = dataclasses.replace(profile, sync=timed_sync(group, profile, sharing, timeout_s, sync_times))
    if sharing > 1 and group.local_rank == 0 and any(lack or untimed for lack, untimed in needs):
        cache_profile(profile, profile_path(profile.device, profile.sm_share), stderr_progress)
    return profile


def shared_rates(group: EPGroup, backend: str, profile: MachineProfile, places: list,
                 timeout_s: float) -> MachineProfile:
    """Collective: :func:`measure_shared`'s copy rate and fused tasks of the ranks at this
    rank's place (``places``: every rank's)."""
    place = (group.hostname, group.device)
    sharing = places.count(place)
    error, probe, copy = None, None, None
    try:
        probe = make_probe(backend, group.device, sharing)
        copy = probe.copy_call()
        copy[0]()
        copy[1]()
    except Exception as exc:
        error = probe_failure(group, exc, sharing)
    try:  # the probe holds GBs in each process sharing the GPU: given back however this ends
        group.raise_if_any(error, SHARED_WHAT, timeout_s=timeout_s)
        best = shared_copy_rate(group, place, *copy, profile.peer_bytes_per_s, timeout_s)
        tables = shared_fused_tables(group, places, backend, probe, profile.fused.grids, timeout_s)
    finally:
        if probe is not None:
            probe.close()
    fused = profile.fused
    gathered = [t for p, t in group.allgather((place, tables), what=SHARED_FUSED_WHAT, timeout_s=timeout_s)
                if p == place]
    shared_fused = fused_costs(gathered, fused.grids, fused.up_k, fused.down_k)
    if group.local_rank == 0:
        for tiles, at_work in (("up", shared_fused.ctas_at_work), ("down", shared_fused.down_ctas_at_work)):
            stderr_progress(f"  {sharing} processes at once: fused {tiles} tiles' CTAs at work, the fewest of any "
                            f"(median round): {', '.join(f'{v:g}' for v in at_work)} of "
                            f"{', '.join(str(g) for g in shared_fused.grids)}")
        spread = {task: np.median(np.ptp([t["starts"][task] for t in gathered], axis=0)) * 1e-3
                  for task in gathered[0]["starts"]}
        stderr_progress(f"  {sharing} processes at once: their runs' starts apart (median round), us: "
                        + ", ".join(f"{task} {us:.1f}" for task, us in spread.items()))
    return dataclasses.replace(profile, shared_copy_bytes_per_s=best, shared_by=sharing, shared_fused=shared_fused)


def timed_sync(group: EPGroup, profile: MachineProfile, sharing: int, timeout_s: float,
               sync_times: Callable[[int], tuple]):
    """Collective, every rank on one GPU: rank 0's weight sync times as the profile keeps them,
    from ``sync_times(grid)`` (``ultraep.tune.sync_timing.profile_sync_times``, handed in by the
    tool that measures: the sync is the data plane's, above this layer); None where a sync could
    not be captured in a CUDA graph (the model then estimates its rates); a rank's failure is
    raised on every rank."""
    from ultraep.tune.model import SYNC_MIN_BLOCKS, SYNC_PATH_UNBOUND, SYNC_STORE_WEIGHT, sync_rates
    from ultraep.tune.profile import SyncTimes

    what = "machine profile: the weight sync timed by rank 0"
    error, timed = None, None
    try:
        timed = sync_times(profile.usable_sms * SYNC_MIN_BLOCKS)
    except CollectiveError:
        raise
    except Exception as exc:
        error = probe_failure(group, exc, sharing)
    group.raise_if_any(error, what, timeout_s=timeout_s)
    expert_bytes, fanout, times = timed
    if times is None:
        return None
    sync = SyncTimes(sharing=sharing, fanout=fanout, expert_bytes=expert_bytes, times_s=times)
    if group.local_rank == 0:
        rates = sync_rates(dataclasses.replace(profile, sync=sync))
        path = (f"the path {rates.path_bytes_per_s / 1e9:.0f} GB/s (a store {SYNC_STORE_WEIGHT:g} loads)"
                if rates.path_bytes_per_s < SYNC_PATH_UNBOUND else "the path not binding (the full grid's time is "
                "met or beaten without it)")
        stderr_progress(f"{sync.line()}: a piece's latency {rates.piece_s * 1e6:.2f} us, an SM "
                        f"{rates.sm_bytes_per_s / 1e9:.1f} GB/s loaded + stored, {path}")
    return sync


def probe_failure(group: EPGroup, exc: Exception, sharing: int) -> str:
    """This rank's reason for a failed shared probe; running out of memory also says how to
    avoid it."""
    error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError):  # CuPy's OutOfMemoryError is one
        error += (f" (the probe takes a few GB in each of the {sharing} processes on this GPU at once: "
                  "measure it before the rest of the job's GPU memory is taken, or once on a free GPU -- "
                  f"it is cached in {cache_dir()}; a layer with fused_config='constants' needs none)")
    return error


def shared_copy_rate(group: EPGroup, place, launch, finish, nbytes: int, peer_bytes_per_s: float,
                     timeout_s: float) -> float:
    """The copy rate of the ranks at ``place`` (host, GPU) copying in the same rounds
    between barriers: their bytes over the window from the first start to the last end,
    the best of the rounds."""
    from ultraep.tune.host import ROUNDS

    calls, best = max(1, int(SHARED_COPY_BATCH_S * peer_bytes_per_s / nbytes)), 0.0
    for _ in range(ROUNDS):
        group.barrier(timeout_s, what=SHARED_WHAT)
        begin = time.monotonic()
        for _ in range(calls):
            launch()
        finish()
        spans = group.allgather((place, begin, time.monotonic(), calls * nbytes), what=SHARED_WHAT,
                                timeout_s=timeout_s)
        mine = [(b, e, n) for p, b, e, n in spans if p == place]
        best = max(best, sum(n for _, _, n in mine) / (max(e for _, e, _ in mine) - min(b for b, _, _ in mine)))
    return best


def shared_fused_tables(group: EPGroup, places: list, backend: str, probe, grids, timeout_s: float) -> dict:
    """This rank's fused task tables (:func:`~ultraep.tune.profile.measure_fused`) at
    ``grids``, every rank measuring at once, on the GPU behind a device barrier of the
    ranks sharing it; a rank's failure is raised on every rank, an OOM with how to avoid it."""
    sharing = places.count((group.hostname, group.device))
    error, tables = None, None
    with sharers_barrier(group, places) if backend == "device" else contextlib.nullcontext() as heap:
        try:
            # each round starts with the error check that ends the loop: a rank that failed in a
            # round meets its peers' next round in one call, and every rank raises its reason
            tables = measure_fused(probe, grids, stderr_progress if group.local_rank == 0 else None,
                                   together=lambda: group.raise_if_any(None, SHARED_FUSED_WHAT, timeout_s=timeout_s),
                                   release=None if heap is None else lambda: heap.barrier(RELEASE_TIMEOUT_S,
                                                                                           wait=False))
            if heap is not None:
                heap.check_barriers()
        except CollectiveError:
            raise  # a peer's failure, raised on every rank in the same round
        except Exception as exc:
            error = probe_failure(group, exc, sharing)
        group.raise_if_any(error, SHARED_FUSED_WHAT, timeout_s=timeout_s)
    return tables


@contextlib.contextmanager
def sharers_barrier(group: EPGroup, places: list):
    """Collective: a small symmetric heap of the ranks that share this rank's GPU (``places``:
    every rank's (host, device)), whose device barrier releases their probe launches at once;
    the heap and its sub-group are closed on the way out."""
    from ultraep.runtime import open_heap

    place = (group.hostname, group.device)
    with group.split(sorted(set(places)).index(place)) as sharers, open_heap(sharers, 1, backend="device") as heap:
        yield heap


def agreed_min_replica_tokens(group: EPGroup, spec: ExpertSpec, *, backend: str,
                              timeout_s: float = PROFILE_TIMEOUT_S) -> int:
    """Collective: ``min_replica_tokens="auto"`` for an expert of ``spec`` on this group.

    Every rank evaluates :func:`min_replica_tokens_for` on its machine's profile
    (:func:`group_profile`) and all take the largest value, so every rank plans with one
    number."""
    return max(group_profile(group, backend, what="min_replica_tokens='auto'", timeout_s=timeout_s,
                             then=lambda profile: min_replica_tokens_for(
                                 spec.weight_slot_bytes, profile, weight_elements=expert_weight_elements(spec))))
