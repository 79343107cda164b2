"""The machine profile: what this machine's copies, launches and expert compute cost,
measured once by short micro-benchmarks and cached as JSON.

What is measured (``host.py`` / ``device.py`` hold the probes):

* ``copy_bytes_per_s``: a local copy (``cudaMemcpyAsync`` device to device; ``np.copyto``
  on the host), in bytes copied per second (each byte is read once and written once: half
  of the read-plus-write figure ``bench peer-copy`` prints);
* ``peer_bytes_per_s`` and ``peer_method``: the heap's copy kernel (``heap.cu``
  ``copy_bytes``, what a store into a peer's heap runs) into another GPU where this process
  can reach one, else within this GPU, whose HBM a peer on the same GPU shares; on the host
  backend ranks share memory, so a peer copy is the local copy; ``peer_method`` says which;
* ``launch_s``: one kernel launch as the host issues them back to back (on the host: one
  minimal NumPy call);
* ``kernel_s``: an empty kernel on the device alone, back to back (what a launch adds to
  the device's time, as opposed to the host's ``launch_s``; on the host ``launch_s``);
* ``copy_warp_bytes_per_s``: what one warp of the heap's copy kernel copies per second
  while the memory is far from its limit (a grid of a few blocks; on the host the local
  copy: one process is one worker) -- a copy kernel of ``w`` warps moves at most ``w``
  times this, and at most ``peer_bytes_per_s``;
* ``shared_copy_bytes_per_s`` and ``shared_by``: when several processes share one GPU
  (the MPS emulation), the peer copy of all of them at once, measured collectively by
  :func:`~ultraep.tune.replicas.group_profile` and added to the cached file: one process
  on its share of the SMs need not reach what the GPU's memory moves for all;
* ``flag_s``: one flag handoff on the device alone -- a system-scope fence, a flag stored
  with release semantics and loaded back with acquire semantics (``heap.cu``'s barrier of
  one rank, less an empty kernel); on the host a store and a load of a shared word;
* ``fused``: the fused kernels' tasks (:class:`FusedCosts`), measured by running
  ``raw_kernels/fused_moe.cu`` itself on synthetic rows of this process: an up tile (with and
  without the FP32 ``h`` a training forward keeps), a down tile, each at two reductions, and a
  relay task, at a few grids from one CTA to every SM -- everything a tile costs in those
  kernels (its claim, the pipeline's fill, the epilogue's SwiGLU and stores, a down tile's
  system fences and flag) and what the other CTAs' tiles cost it (clocks, L2, HBM), each
  launch reading its weights from HBM as a layer does (version 5; version 4's probe found
  them in L2, left there by its previous launch on the same slot) and its rows too (version
  6: a layer's tiles read rows relayed or written hundreds of MB before); and at each grid
  the CTAs at work, those that started a tile in the first half of a run (version 6), each
  run as long as a layer's kernel A (version 7), of the up tiles (kernel A's) and of the
  down tiles (kernel B's) apart (version 8); the down tiles with and without storing ``y``
  (a training forward's kernel B stores each tile twice, version 9);
  ``shared_fused``: the same with every process sharing this GPU running it at once
  (:func:`~ultraep.tune.replicas.group_profile`, as ``shared_copy_bytes_per_s``), the CTAs
  at work the unluckiest process's: under MPS shares that overlap, one process's grid need
  not find its SMs while the others hold theirs (version 6; version 7's runs, long and held
  behind a stream hold, overlap as a layer's kernels do: version 6's mostly took turns;
  version 8's kernel A runs start together behind a device barrier of the sharers, as a
  layer's kernel A does; the down tile runs start as their hosts leave a barrier,
  milliseconds apart, and overlap in part: the model takes the up tiles' contention for
  them, ``model.py``);
* ``sync``: the weight sync kernel itself (:class:`SyncTimes`), where ranks share one GPU and the
  measuring tool hands in the timing (``tune validate``; the sync is the data plane's, above this
  layer: :func:`~ultraep.tune.replicas.group_profile`'s ``sync_times``): rank 0 times
  ``raw_kernels/transfer.cu``'s sync of one expert alone at fan-out 1 on one block, at its
  widest fan-out on one block and on every resident block; the model solves its three rates
  from those times (version 12; before, it estimated them from the copy probes with fractions
  fitted on the H200, which do not carry to other GPUs);
* ``dispatch_blocks_per_sm``: blocks of the Dispatcher's copy kernels
  (``raw_kernels/dispatch.cu``, ``ultraep.token.device.THREADS`` threads each) resident at
  once on an SM, the fewest of them: what their registers and shared memory allow, from the
  occupancy API on the kernels as this machine compiles them (version 10; before, the model
  took the threads' bound, 8 on the H200, where their 42-48 registers allow 5); 0 on the
  host, which has no copy kernels;
* ``compute``: the expert compute, time per call at a few rows-per-expert sizes -- the
  grouped GEMM ``ultraep.compute.grouped_mm`` (bf16) on the GPU, timed on the device
  alone (the host's part is ``launch_s``), ``np.matmul`` (float32) per expert on the host.
  Time per call, not only throughput: at a few rows per expert the call reads every
  weight for little arithmetic, so its time hardly depends on the rows.

The cache: ``profile-<device>.json`` in ``$ULTRAEP_CACHE_DIR`` (default
``~/.cache/ultraep``) or at an explicit path. The file carries a format version
(:data:`PROFILE_VERSION`) and a digest of the kernel sources its measurements ran
(``kernels``); a file of another version, another device, another SM share (MPS emulation:
``ultraep.runtime.mps``) or other kernels (the library's kernels changed since: the times
it holds are not theirs) is measured again, and so is one that cannot be read, with a
message saying why. Files are replaced atomically, so ranks reading the cache
while another writes it see the old file or the new one.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ultraep.errors import ProfileError
from ultraep.runtime.kernels import sources_digest

PROFILE_FORMAT = "ultraep-machine-profile"
PROFILE_VERSION = 12
# Versions whose fields this one reads when a profile is kept beside measurements (a
# ``tune validate --json``, replayed): before 6 no CTAs at work were measured, and kernel A's
# relays were claimed tasks between its sends and its tiles (they run on the store warps since);
# before 8 one count of CTAs at work stood for the up and the down tiles together, and the
# sharers' up tile runs started as their hosts left a barrier; 6's runs (8 waves, a fraction of
# a millisecond) hardly overlapped, so its shared times and CTAs at work are those of processes
# taking turns; before 9 the down tiles were measured without storing y; before 10 the
# Dispatcher's copy kernels' residency was not measured; before 11 no digest of the kernel
# sources was kept; before 12 the weight sync was not timed.
STORED_VERSIONS = (4, 5, 6, 7, 8, 9, 10, 11, PROFILE_VERSION)
CTAS_AT_WORK_SINCE = 6  # the first version that measured the CTAs at work
DOWN_CTAS_AT_WORK_SINCE = 8  # the first that measured the down tiles' own
UP_RELEASED_SINCE = 8  # the first whose sharers' up tile runs start together, as a layer's kernel A
DOWN_Y_SINCE = 9  # the first that measured the down tiles storing y
DISPATCH_BLOCKS_SINCE = 10  # the first that measured the Dispatcher's copy kernels' resident blocks
KERNELS_SINCE = 11  # the first that kept a digest of the kernel sources it measured
SYNC_SINCE = 12  # the first that timed the weight sync
CACHE_VARIABLE = "ULTRAEP_CACHE_DIR"
PROGRESS_LOGGER = "ultraep.tune"
UNSTEADY_FRACTION = 0.9  # a call of more rows measured below this fraction of one of fewer: not this machine alone
DEFAULT_CACHE_DIR = Path("~/.cache/ultraep")


@dataclass(frozen=True)
class ComputeCurve:
    """The expert compute measured at a few sizes: ``experts`` experts of ``k x n`` weights
    (``dtype``), ``rows_per_expert[i]`` rows each, took ``seconds[i]`` per call."""

    kernel: str
    dtype: str
    experts: int
    k: int
    n: int
    rows_per_expert: tuple[int, ...]
    seconds: tuple[float, ...]

    def expert_seconds(self, rows, weight_elements: int | None = None) -> np.ndarray:
        """Modelled time of one expert's share of a call at ``rows`` rows (array-like).

        Per expert: the call's time over ``experts``, made non-decreasing in the rows
        (measurement noise must not make more rows cheaper), linear between the measured
        sizes, flat below the smallest (reading the weights costs the same for fewer rows)
        and extended with the last segment's slope above the largest (compute-bound: linear
        in the rows). ``weight_elements`` scales it to an expert of that many weight
        elements (reads and multiply-adds both grow with them); default ``k * n``."""
        measured = np.asarray(self.rows_per_expert, np.float64)
        per_expert = np.maximum.accumulate(np.asarray(self.seconds, np.float64) / self.experts)
        rows = np.asarray(rows, np.float64)
        slope = (per_expert[-1] - per_expert[-2]) / (measured[-1] - measured[-2]) if len(measured) > 1 else 0.0
        time = np.where(rows > measured[-1], per_expert[-1] + slope * (rows - measured[-1]),
                        np.interp(rows, measured, per_expert))
        scale = 1.0 if weight_elements is None else weight_elements / (self.k * self.n)
        return time * scale

    def tflops(self) -> list[float]:
        """Achieved multiply-add throughput of each measured size (2 flops per multiply-add)."""
        return [2.0 * self.experts * rows * self.k * self.n / seconds / 1e12
                for rows, seconds in zip(self.rows_per_expert, self.seconds)]


FUSED_TASKS = ("up", "up_act", "relay", "down", "down_y")
OPTIONAL_TASKS = ("down_y",)  # None: not measured (a profile before DOWN_Y_SINCE), "down" stands for it
# the tile tasks whose runs count CTAs at work, and the field each counts for: kernel A's, kernel B's
AT_WORK_OF = {"up": "ctas_at_work", "up_act": "ctas_at_work", "down": "down_ctas_at_work",
              "down_y": "down_ctas_at_work"}
# kernel A's tasks: their shared runs start as a layer's kernel A does, as every rank leaves a device
# barrier (the token map's last); kernel B's as a layer's does, as each rank's own kernel A ends
RELEASED_TASKS = ("up", "up_act", "relay")


@dataclass(frozen=True)
class FusedCosts:
    """The fused kernels' tasks as measured on this machine (``raw_kernels/fused_moe.cu`` on
    synthetic rows): at each of ``grids`` (CTAs per process, ascending), with ``sharing``
    processes of this GPU running the same at once, the seconds

    * ``up[i][g]``: per up tile (``FM_BM`` rows x ``2 * FM_UP_COLS`` columns, SwiGLU epilogue)
      over a reduction of ``up_k[i]``, storing ``h`` (FP32) and ``act`` as a training forward;
    * ``up_act[i][g]``: the same storing ``act`` alone (``backward=False``);
    * ``relay[i][g]``: per relay task (``FM_BM`` rows of ``2 * up_k[i]`` bytes);
    * ``down[i][g]``: per down tile (``FM_BM`` x ``FM_DOWN_COLS``) over ``down_k[i]``, its
      system fences and ``done`` flag included, storing it into ``expert_out`` (an inference
      forward's kernel B);
    * ``down_y[i][g]``: the same storing it into ``y`` too (a training forward's; None: not
      measured, profiles before version 9: ``down`` stands for it);
    * ``ctas_at_work[g]``: of ``grids[g]`` CTAs, those that started an up tile in the first
      half of an up tile run -- with several sharers the fewest of any process in a round, the
      median round (None: not measured, every CTA taken to work): kernel A's;
    * ``down_ctas_at_work[g]``: the same of the down tile runs, kernel B's (None: not
      measured, profiles before version 8: kernel A's stand for them);
    * ``relays_on_store_warps``: whether the relay tasks measured run on the store warps of
      every CTA beside the claimed tasks (kernel A since version 6), not as claimed tasks.

    A tile's time is the kernel's tile phase over its waves (``ceil(tiles / grid)``): what a
    tile costs there, claim and epilogue included, with every CTA of every sharer doing the
    same. Between measured reductions a task's time is the line through them (the k steps
    are linear in the reduction, the rest is not), between grids linear in the grid."""

    grids: tuple[int, ...]
    sharing: int
    up_k: tuple[int, ...]
    down_k: tuple[int, ...]
    up: tuple[tuple[float, ...], ...]
    up_act: tuple[tuple[float, ...], ...]
    relay: tuple[tuple[float, ...], ...]
    down: tuple[tuple[float, ...], ...]
    ctas_at_work: tuple[float, ...] | None = None
    relays_on_store_warps: bool = True
    down_ctas_at_work: tuple[float, ...] | None = None
    down_y: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        grids = list(self.grids)
        if not grids or grids[0] < 1 or grids != sorted(set(grids)):
            raise ProfileError(f"fused: grids must rise from >= 1, got {grids}")
        if self.sharing < 1:
            raise ProfileError(f"fused: sharing must be at least 1, got {self.sharing}")
        for name, ks in (("up_k", self.up_k), ("down_k", self.down_k)):
            if not ks or list(ks) != sorted(set(ks)) or ks[0] < 1:
                raise ProfileError(f"fused: {name} must rise from >= 1, got {list(ks)}")
        for task in FUSED_TASKS:
            table = getattr(self, task)
            if table is None and task in OPTIONAL_TASKS:
                continue
            rows = len(self.down_k if task.startswith("down") else self.up_k)
            if len(table) != rows or any(len(row) != len(grids) for row in table) \
                    or not all(math.isfinite(v) and v > 0 for row in table for v in row):
                raise ProfileError(f"fused: {task} needs one positive time per reduction ({rows}) and grid "
                                   f"({len(grids)})")
        for name in ("ctas_at_work", "down_ctas_at_work"):
            at_work = getattr(self, name)
            if at_work is not None and (len(at_work) != len(grids)
                                        or not all(1 <= v <= g for v, g in zip(at_work, grids))):
                raise ProfileError(f"fused: {name} needs one count per grid ({len(grids)}), each from 1 to its "
                                   f"grid, got {list(at_work)}")

    def up_tile_s(self, k: int, ctas, keeps_h: bool = True) -> np.ndarray:
        """An up tile over a reduction of ``k`` at ``ctas`` CTAs per process (array-like)."""
        return self._at(self.up if keeps_h else self.up_act, self.up_k, k, ctas)

    def relay_task_s(self, hidden: int, ctas) -> np.ndarray:
        """A relay task of ``FM_BM`` rows of ``hidden`` elements at ``ctas`` CTAs per process."""
        return self._at(self.relay, self.up_k, hidden, ctas)

    def down_tile_s(self, k: int, ctas, keeps_y: bool = True) -> np.ndarray:
        """A down tile over a reduction of ``k`` at ``ctas`` CTAs per process, storing ``y`` too
        or not (``keeps_y``); without ``y`` where the profile did not measure it with
        (:attr:`down_y_note` says so)."""
        return self._at(self.down_y if keeps_y and self.down_y is not None else self.down, self.down_k, k, ctas)

    def working_ctas(self, ctas) -> np.ndarray:
        """Of ``ctas`` CTAs per process (array-like), those the unluckiest process has at work
        in kernel A (its up tiles): the measured counts' fraction of their grids, linear
        between grids, never above ``ctas`` (all of them where nothing was measured)."""
        return self._working(self.ctas_at_work, ctas)

    def working_down_ctas(self, ctas) -> np.ndarray:
        """The same in kernel B (its down tiles); kernel A's where a profile before version 8
        did not measure them apart (:attr:`down_at_work_note` says so)."""
        return self._working(self.ctas_at_work if self.down_ctas_at_work is None else self.down_ctas_at_work, ctas)

    @property
    def down_at_work_note(self) -> str | None:
        """Why kernel B's CTAs at work are kernel A's, where they are; else None."""
        if self.down_ctas_at_work is None and self.ctas_at_work is not None:
            return ("kernel B's CTAs at work were not measured apart (profile before version 8): kernel A's stand "
                    "for them")
        return None

    @property
    def down_y_note(self) -> str | None:
        """Why a training forward's down tiles cost what they cost without storing y, where they do."""
        if self.down_y is None:
            return ("the down tiles storing y (a training forward's kernel B) were not measured (profile before "
                    "version 9): those without stand for them")
        return None

    def _working(self, at_work, ctas) -> np.ndarray:
        ctas = np.asarray(ctas, np.float64)
        if at_work is None:
            return ctas
        grids = np.asarray(self.grids, np.float64)
        return ctas * np.minimum(np.interp(ctas, grids, np.asarray(at_work, np.float64) / grids), 1.0)

    def _at(self, table, ks, k: int, ctas) -> np.ndarray:
        measured = np.asarray(table, np.float64)  # [reduction, grid]
        k = float(k)
        if len(ks) == 1:
            at_k = measured[0] * k / ks[0]
        else:
            slope, intercept = np.polyfit(np.asarray(ks, np.float64), measured, 1)
            at_k = slope * k + intercept
            # beyond the reductions measured, noise in the line must not make a task cheaper than the
            # nearest one measured allows: below, its time in proportion; above, its time
            if k < ks[0]:
                at_k = np.maximum(at_k, measured[0] * k / ks[0])
            elif k > ks[-1]:
                at_k = np.maximum(at_k, measured[-1])
        return np.interp(np.asarray(ctas, np.float64), np.asarray(self.grids, np.float64), at_k)

    @classmethod
    def from_json(cls, data) -> FusedCosts:
        at_work, down_at_work = data["ctas_at_work"], data["down_ctas_at_work"]
        relays_on_store_warps = data["relays_on_store_warps"]
        if not isinstance(relays_on_store_warps, bool):
            raise TypeError(f"relays_on_store_warps must be true or false, got {relays_on_store_warps!r}")
        return cls(grids=tuple(int(v) for v in data["grids"]), sharing=_count(data, "sharing"),
                   up_k=tuple(int(v) for v in data["up_k"]), down_k=tuple(int(v) for v in data["down_k"]),
                   **{task: None if data[task] is None and task in OPTIONAL_TASKS
                      else tuple(tuple(float(v) for v in row) for row in data[task]) for task in FUSED_TASKS},
                   ctas_at_work=None if at_work is None else tuple(float(v) for v in at_work),
                   relays_on_store_warps=relays_on_store_warps,
                   down_ctas_at_work=None if down_at_work is None else tuple(float(v) for v in down_at_work))

    def table(self, machine: str) -> list[str]:
        """Readable lines: each task's microseconds per grid (``machine``: "GPU" or "host")."""
        lines = [f"  fused kernels' tasks, us, by CTAs per process ({self.sharing} process"
                 f"{'es' if self.sharing > 1 else ''} of this {machine} at once)",
                 f"  {'task':>22}  " + "".join(f"{g:>8d}" for g in self.grids)]
        for task in FUSED_TASKS:
            for k, row in zip(self.down_k if task.startswith("down") else self.up_k, getattr(self, task) or ()):
                lines.append(f"  {f'{task} k={k}':>22}  " + "".join(f"{v * 1e6:8.1f}" for v in row))
        for name, at_work in (("up", self.ctas_at_work), ("down", self.down_ctas_at_work)):
            if at_work is not None:
                lines.append(f"  {f'{name} CTAs at work':>22}  " + "".join(f"{v:8.1f}" for v in at_work))
        lines += [f"  ({note})" for note in (self.down_at_work_note, self.down_y_note) if note]
        return lines


@dataclass(frozen=True)
class SyncTimes:
    """The weight sync timed where ranks share one GPU: rank 0 alone syncing one expert of
    ``expert_bytes`` at fan-out 1 on one block, at fan-out ``fanout`` (the widest the ``sharing``
    ranks allow, up to 7) on one block and on every resident block (``times_s``, in that
    order). The model solves its rates from them (``ultraep.tune.model.sync_rates``)."""

    sharing: int
    fanout: int
    expert_bytes: int
    times_s: tuple[float, float, float]

    @classmethod
    def from_json(cls, data) -> SyncTimes:
        times = tuple(float(t) for t in data["times_s"])
        if len(times) != 3 or not all(math.isfinite(t) and t > 0 for t in times):
            raise ProfileError("sync: times_s must be three positive times")
        return cls(sharing=_count(data, "sharing"), fanout=_count(data, "fanout"),
                   expert_bytes=_count(data, "expert_bytes"), times_s=times)

    def line(self) -> str:
        return (f"  weight sync {self.times_s[0] * 1e3:10.3f} ms one expert of {self.expert_bytes / 1e6:.1f} MB at "
                f"fan-out 1 on one block; {self.times_s[1] * 1e3:.3f} ms at {self.fanout} on one block, "
                f"{self.times_s[2] * 1e3:.3f} ms on every resident one ({self.sharing} ranks on the GPU)")


@dataclass(frozen=True)
class MachineProfile:
    """One device's measured costs (module docstring). ``sm_count``: SMs this process sees
    (CPU cores on the host; under an MPS share the device reports the share's SMs);
    ``sm_share``: that MPS share in percent, else 100 (it names the cache file)."""

    backend: str
    device: str
    sm_count: int
    sm_share: int
    copy_bytes_per_s: float
    copy_method: str
    peer_bytes_per_s: float
    peer_method: str
    launch_s: float
    compute: ComputeCurve
    kernel_s: float
    copy_warp_bytes_per_s: float
    flag_s: float
    fused: FusedCosts
    measured_at: str = ""
    version: int = PROFILE_VERSION
    shared_copy_bytes_per_s: float = 0.0
    shared_by: int = 1
    shared_fused: FusedCosts | None = None
    dispatch_blocks_per_sm: int = 0
    kernels: str = ""
    sync: SyncTimes | None = None

    def gpu_copy_bytes_per_s(self, sharing: int) -> float:
        """What ``sharing`` processes copying at once on one GPU move together: the rate
        measured with that many (:func:`ultraep.tune.replicas.group_profile`), else this
        process's own peer copy rate (one process alone taken to reach the memory's limit)."""
        if sharing > 1 and sharing == self.shared_by and self.shared_copy_bytes_per_s > 0:
            return self.shared_copy_bytes_per_s
        return self.peer_bytes_per_s

    def fused_costs(self, sharing: int) -> FusedCosts:
        """The fused kernels' task costs with ``sharing`` processes of one GPU running them at
        once: measured with that many where the profile has them, else this process's alone."""
        if sharing > 1 and self.shared_fused is not None and self.shared_fused.sharing == sharing:
            return self.shared_fused
        return self.fused

    @property
    def processors(self) -> str:
        """What this process's work runs on, as the tools say it: a GPU's SMs and MPS share, a host's cores."""
        return f"{self.sm_count} SMs at an MPS share of {self.sm_share} %" if self.on_gpu else f"{self.sm_count} cores"

    @property
    def on_gpu(self) -> bool:
        return self.backend == "device"

    @property
    def usable_sms(self) -> int:
        """SMs (cores) this process's work runs on: ``sm_count``, which under an MPS share
        the device already reports as the share (a quarter of the H200's 132 SMs is 33)."""
        return self.sm_count

    def identity(self) -> tuple[str, str, int, int, str]:
        """What a cached profile must match to be reused (besides its version): at one share,
        a green context's SMs (32 of 132 at 25 %) are not the thread percentage's (33)."""
        return (self.backend, self.device, self.sm_share, self.sm_count, self.kernels)

    def to_json(self) -> dict:
        data = asdict(self)
        data["format"] = PROFILE_FORMAT
        return data

    @classmethod
    def from_json(cls, data, *, stored: bool = False) -> MachineProfile:
        """A profile from :meth:`to_json`'s dict; ProfileError naming what is missing or wrong.
        ``stored``: one kept beside measurements, which may be of any of
        :data:`STORED_VERSIONS` (read as it was measured: no CTAs at work, relays as claimed
        tasks before version 6; no down tiles' CTAs at work apart before 8; no down tiles
        storing y before 9; no resident copy blocks before 10; no kernel digest before 11; no
        weight sync timed before 12); the cache takes this version only."""
        if not is_profile_document(data):
            raise ProfileError(f"not a machine profile (no \"format\": \"{PROFILE_FORMAT}\")")
        version = data.get("version")
        if version not in (STORED_VERSIONS if stored else (PROFILE_VERSION,)):
            raise ProfileError(f"format version {version!r}, this library reads version {PROFILE_VERSION}"
                               + (f" (and {', '.join(map(str, STORED_VERSIONS[:-1]))} stored beside measurements)"
                                  if stored else ""))
        before = {}  # what an older version did not record, as it measured
        if version < CTAS_AT_WORK_SINCE:
            before.update(ctas_at_work=None, relays_on_store_warps=False)
        if version < DOWN_CTAS_AT_WORK_SINCE:
            before.update(down_ctas_at_work=None)
        if version < DOWN_Y_SINCE:
            before.update(down_y=None)
        data = dict(data, **{name: {**before, **data[name]}
                             for name in ("fused", "shared_fused") if isinstance(data.get(name), dict)})
        try:
            compute = data["compute"]
            shared_fused = data.get("shared_fused")
            curve = ComputeCurve(kernel=_text(compute, "kernel"), dtype=_text(compute, "dtype"),
                                 experts=_count(compute, "experts"), k=_count(compute, "k"), n=_count(compute, "n"),
                                 rows_per_expert=tuple(int(v) for v in compute["rows_per_expert"]),
                                 seconds=tuple(float(v) for v in compute["seconds"]))
            profile = cls(backend=_text(data, "backend"), device=_text(data, "device"),
                          sm_count=_count(data, "sm_count"), sm_share=_count(data, "sm_share"),
                          copy_bytes_per_s=_positive(data, "copy_bytes_per_s"), copy_method=_text(data, "copy_method"),
                          peer_bytes_per_s=_positive(data, "peer_bytes_per_s"), peer_method=_text(data, "peer_method"),
                          launch_s=_positive(data, "launch_s"), compute=curve,
                          kernel_s=_positive(data, "kernel_s"),
                          copy_warp_bytes_per_s=_positive(data, "copy_warp_bytes_per_s"),
                          flag_s=_positive(data, "flag_s"),
                          fused=FusedCosts.from_json(data["fused"]),
                          measured_at=str(data.get("measured_at", "")), version=version,
                          shared_copy_bytes_per_s=float(data.get("shared_copy_bytes_per_s", 0.0)),
                          shared_by=int(data.get("shared_by", 1)),
                          shared_fused=None if shared_fused is None else FusedCosts.from_json(shared_fused),
                          dispatch_blocks_per_sm=(0 if version < DISPATCH_BLOCKS_SINCE
                                                  else _natural(data, "dispatch_blocks_per_sm")),
                          kernels="" if version < KERNELS_SINCE else _digest(data, "kernels"),
                          sync=(SyncTimes.from_json(data["sync"])
                                if version >= SYNC_SINCE and data.get("sync") is not None else None))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"bad or missing field: {exc}") from None
        rows = curve.rows_per_expert
        if not rows or len(rows) != len(curve.seconds) or list(rows) != sorted(set(rows)) or rows[0] < 1 \
                or not all(math.isfinite(s) and s > 0 for s in curve.seconds):
            raise ProfileError("compute: rows_per_expert must rise from >= 1, one positive time per size")
        return profile

    def table(self) -> str:
        """A readable summary, one quantity per line."""
        curve, machine = self.compute, "GPU" if self.on_gpu else "host"
        lines = [f"machine profile: {self.device} ({self.backend} backend, {self.processors}), "
                 f"format version {self.version}, measured {self.measured_at or '-'}"
                 + (f", kernel sources {self.kernels}" if self.kernels else ""),
                 f"  copy        {self.copy_bytes_per_s / 1e9:10.1f} GB/s copied   {self.copy_method}",
                 f"  peer copy   {self.peer_bytes_per_s / 1e9:10.1f} GB/s copied   {self.peer_method}",
                 f"  launch      {self.launch_s * 1e6:10.2f} us per launch",
                 f"  kernel      {self.kernel_s * 1e6:10.2f} us "
                 + ("per empty kernel on the device" if self.on_gpu else "per call (the host runs a call at once)"),
                 f"  warp copy   {self.copy_warp_bytes_per_s / 1e9:10.2f} GB/s copied   "
                 + ("per warp, far from the memory's limit" if self.on_gpu else "one process (the host's worker)"),
                 f"  shared copy {self.shared_copy_bytes_per_s / 1e9:10.1f} GB/s copied   by {self.shared_by} "
                 f"processes on one {machine} at once" if self.shared_copy_bytes_per_s else
                 f"  shared copy          -              (not measured: one process per {machine})",
                 f"  flag        {self.flag_s * 1e6:10.2f} us per release/acquire handoff",
                 f"  copy blocks {self.dispatch_blocks_per_sm:10d}      resident per SM, the Dispatcher's copy kernels"
                 if self.dispatch_blocks_per_sm else
                 "  copy blocks          -              (not measured: no copy kernels, or a profile before version "
                 f"{DISPATCH_BLOCKS_SINCE})",
                 self.sync.line() if self.sync is not None else
                 "  weight sync          -              (not timed: tune validate times it where ranks share a GPU; "
                 f"none before version {SYNC_SINCE}; the model estimates it from the copies)",
                 *self.fused.table(machine),
                 *(self.shared_fused.table(machine) if self.shared_fused is not None else ()),
                 f"  expert compute: {curve.kernel}, {curve.dtype}, {curve.experts} experts of {curve.k} x {curve.n}",
                 f"  {'rows/expert':>13}  {'us/call':>10}  {'us/expert':>10}  {'TFLOPS':>8}"]
        for rows, seconds, tflops in zip(curve.rows_per_expert, curve.seconds, curve.tflops()):
            lines.append(f"  {rows:13d}  {seconds * 1e6:10.2f}  {seconds * 1e6 / curve.experts:10.2f}  {tflops:8.2f}")
        return "\n".join(lines)


def _text(data: dict, key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {value!r}")
    return value


def _digest(data: dict, key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]*", value):
        raise ValueError(f"{key} must be a hex digest (empty for none), got {value!r}")
    return value


def _count(data: dict, key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _natural(data: dict, key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _positive(data: dict, key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


# -- measuring -------------------------------------------------------------------------------

def make_probe(backend: str = "auto", device: int | None = None, sharing: int = 1):
    """The probe of ``backend`` (``"auto"``: the GPU when CuPy sees one, else the host);
    ``sharing``: the processes that probe the GPU at once."""
    if backend not in ("auto", "device", "host"):
        raise ProfileError(f"backend must be 'auto', 'device' or 'host', got {backend!r}")
    if backend == "auto":
        from ultraep.runtime.group import gpu_count
        backend = "device" if gpu_count() else "host"
    if backend == "host":
        from ultraep.tune.host import HostProbe
        return HostProbe()
    from ultraep.tune.device import DeviceProbe
    return DeviceProbe(device, sharing)


def sm_share() -> int:
    """This process's percentage of the SMs: its MPS share under the library's EP emulation, else 100."""
    from ultraep.runtime.mps import EMULATION_VARIABLE

    emulation = os.environ.get(EMULATION_VARIABLE, "")
    if emulation.startswith("mps:") and emulation[4:].isdigit():
        return int(emulation[4:])
    return 100


def measure_profile(probe, progress: Callable[[str], None] | None = None) -> MachineProfile:
    """Run the micro-benchmarks of ``probe`` (:func:`make_probe`); each result is reported
    through ``progress`` as it is measured (a few seconds in all)."""
    say = progress or (lambda line: None)
    name, sm_count = probe.describe()
    say(f"measuring a machine profile of {name} ({probe.backend} backend)")
    copy = probe.copy_bytes_per_s()
    say(f"  copy: {copy / 1e9:.1f} GB/s copied ({probe.copy_method})")
    peer, peer_method = probe.peer_bytes_per_s(copy)
    say(f"  peer copy: {peer / 1e9:.1f} GB/s copied ({peer_method})")
    launch = probe.launch_s()
    say(f"  launch: {launch * 1e6:.2f} us")
    kernel = probe.kernel_s()
    say(f"  empty kernel on the device: {kernel * 1e6:.2f} us")
    warp = probe.copy_warp_bytes_per_s()
    say(f"  copy per warp: {warp / 1e9:.2f} GB/s copied")
    flag = probe.flag_s()
    say(f"  flag handoff: {flag * 1e6:.2f} us")
    blocks = probe.dispatch_blocks_per_sm() if probe.backend == "device" else 0  # the host has no copy kernels
    if blocks:
        say(f"  Dispatcher copy kernels: {blocks} blocks resident per SM")
    share = sm_share()
    fused = fused_costs([measure_fused(probe, probe.fused_grids(), say)], probe.fused_grids(),
                        *probe.fused_reductions)
    seconds = measure_compute(probe, say)
    if unsteady_compute(probe.rows_per_expert, seconds):
        say("  expert compute: more rows measured faster than fewer (another process busy?): measuring it again")
        seconds = measure_compute(probe, say)
    experts, k, n = probe.compute_shape
    curve = ComputeCurve(kernel=probe.compute_kernel, dtype=probe.compute_dtype, experts=experts, k=k, n=n,
                         rows_per_expert=tuple(probe.rows_per_expert), seconds=tuple(seconds))
    return MachineProfile(backend=probe.backend, device=name, sm_count=sm_count, sm_share=share,
                          copy_bytes_per_s=copy, copy_method=probe.copy_method, peer_bytes_per_s=peer,
                          peer_method=peer_method, launch_s=launch, compute=curve, kernel_s=kernel,
                          copy_warp_bytes_per_s=warp,
                          flag_s=flag, fused=fused, dispatch_blocks_per_sm=blocks,
                          kernels=sources_digest(probe.kernel_sources),
                          measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def measure_compute(probe, say: Callable[[str], None]) -> list[float]:
    """The expert compute's time per call at each of ``probe.rows_per_expert``."""
    seconds = []
    for rows in probe.rows_per_expert:
        seconds.append(probe.expert_call_s(rows))
        say(f"  expert compute, {rows} rows per expert: {seconds[-1] * 1e6:.1f} us per call")
    return seconds


def unsteady_compute(rows_per_expert, seconds) -> str | None:
    """Why the expert compute ``seconds`` (at ``rows_per_expert``, increasing) cannot be this
    machine's own, or None: a call of more rows measured clearly faster than one of fewer,
    which the same machine cannot do -- something else ran during the smaller one."""
    for (rows_a, a), (rows_b, b) in itertools.pairwise(zip(rows_per_expert, seconds)):
        if b < UNSTEADY_FRACTION * a:
            return (f"the expert compute took {b * 1e6:.1f} us at {rows_b} rows per expert but {a * 1e6:.1f} us "
                    f"at {rows_a}")
    return None


def measure_fused(probe, grids, progress: Callable[[str], None] | None = None,
                  together: Callable[[], None] = lambda: None,
                  release: Callable[[], None] | None = None) -> dict[str, list]:
    """This process's fused-kernel task times (:class:`FusedCosts`' tables) at ``grids`` CTAs,
    each task measured in rounds that ``together()`` starts (a barrier of the processes that
    measure at once; alone, nothing) and, for kernel A's tasks, on the device behind
    ``release()`` where given (:data:`RELEASED_TASKS`): the median round's; per grid the CTAs
    at work in every round of the up tiles (``ctas_at_work``) and of the down tiles
    (``down_ctas_at_work``), rounds in the same order on every process; and per task every
    round's start (``starts``)."""
    say = progress or (lambda line: None)
    up_k, down_k = probe.fused_reductions
    tables = {name: [[] for _ in grids] for name in AT_WORK_OF.values()}
    tables["starts"] = {task: [] for task in FUSED_TASKS}
    for task in FUSED_TASKS:
        tables[task] = []
        for k in down_k if task.startswith("down") else up_k:
            row = []
            for g, grid in enumerate(grids):
                rounds = probe.fused_rounds(task, k, grid, together, release if task in RELEASED_TASKS else None)
                row.append(float(np.median([r.seconds for r in rounds])))
                tables["starts"][task] += [r.start_ns for r in rounds]
                if task in AT_WORK_OF:  # a relay run is too short to tell a CTA that waited for its SM
                    tables[AT_WORK_OF[task]][g] += [r.at_work for r in rounds]
            tables[task].append(row)
            say(f"  fused {task} task, k = {k}: " + ", ".join(f"{seconds * 1e6:.1f}" for seconds in row)
                + f" us at {', '.join(str(g) for g in grids)} CTAs")
    for tiles, name in (("up", "ctas_at_work"), ("down", "down_ctas_at_work")):
        say(f"  fused {tiles} tiles' CTAs at work (median round): "
            + ", ".join(f"{np.median(rounds):g}" for rounds in tables[name])
            + f" of {', '.join(str(g) for g in grids)}")
    return tables


def fused_costs(tables: list[dict], grids, up_k, down_k) -> FusedCosts:
    """:class:`FusedCosts` of ``len(tables)`` processes that measured at once (each's
    :func:`measure_fused`): the slowest one's time of every task, which the group waits for,
    and per grid, of the up tiles and of the down tiles, the CTAs at work of the process with
    the fewest in each round, the median round: the group waits for that one too."""
    def fewest(name):
        return tuple(float(v) for v in np.median(np.min([t[name] for t in tables], axis=0), axis=1))  # [grid, round]

    return FusedCosts(grids=tuple(int(g) for g in grids), sharing=len(tables), up_k=tuple(up_k), down_k=tuple(down_k),
                      **{task: tuple(tuple(float(v) for v in row)
                                     for row in np.max([t[task] for t in tables], axis=0))
                         for task in FUSED_TASKS},
                      **{name: fewest(name) for name in AT_WORK_OF.values()})


# -- the cache -------------------------------------------------------------------------------

def cache_dir() -> Path:
    """``$ULTRAEP_CACHE_DIR`` if set, else ``~/.cache/ultraep``."""
    return Path(os.environ.get(CACHE_VARIABLE) or DEFAULT_CACHE_DIR).expanduser()


def profile_path(device: str, share: int = 100) -> Path:
    """The cache file of the device named ``device`` (at an SM share of ``share`` %)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "unnamed"
    return cache_dir() / f"profile-{slug}{'' if share == 100 else f'-sm{share}'}.json"


def read_profile(path: str | os.PathLike[str]) -> MachineProfile:
    """The profile stored at ``path``; ProfileError saying why it cannot be used (a missing
    file raises FileNotFoundError)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"not JSON ({exc})") from None
    return MachineProfile.from_json(data)


def write_profile(profile: MachineProfile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    os.replace(partial, path)
    return path


def is_profile_document(data) -> bool:
    """Whether parsed JSON is a machine profile's (any version, any machine)."""
    return isinstance(data, dict) and data.get("format") == PROFILE_FORMAT


def check_replaceable(path: Path) -> None:
    """ProfileError unless ``path`` is free (absent or empty: ``--out "$(mktemp)"``) or holds
    a machine profile (of any version or machine): measuring replaces it, and nothing else
    may be overwritten."""
    if (not path.exists() and not path.is_symlink()) or (path.is_file() and path.stat().st_size == 0):
        return
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not is_profile_document(data):
        raise ProfileError(f"{path} exists and is not a machine profile: it is not overwritten (remove it, or "
                           f"give another file)")


def load_profile(backend: str = "auto", *, device: int | None = None, path: str | os.PathLike[str] | None = None,
                 force: bool = False, progress: Callable[[str], None] | None = None) -> MachineProfile:
    """This machine's profile: from the cache (``path``, else :func:`profile_path`) when it
    was measured on this device at this SM share by this format version, else measured now
    (``force``: always) and cached. ``progress`` gets the measurement's lines and the reason
    a cached file was not used; a cache that cannot be written is reported, not raised. A
    file at a given ``path`` that is not a profile is never replaced: ProfileError before
    measuring (a damaged file in the cache directory, which holds only profiles, is)."""
    say = progress or (lambda line: None)
    probe = make_probe(backend, device)
    name, sms = probe.describe()
    share = sm_share()
    target = Path(path) if path is not None else profile_path(name, share)
    if path is not None:
        check_replaceable(target)
    if not force:
        try:
            cached = read_profile(target)
        except FileNotFoundError:
            say(f"no machine profile at {target}: measuring it")
        except (OSError, UnicodeDecodeError, ProfileError) as exc:
            say(f"cannot use the machine profile at {target} ({exc}): measuring it again")
        else:
            kernels = sources_digest(probe.kernel_sources)
            if cached.identity() == (probe.backend, name, share, sms, kernels):
                return cached
            if cached.identity()[:4] == (probe.backend, name, share, sms):
                say(f"the machine profile at {target} was measured with other kernel sources ({cached.kernels or '-'}, "
                    f"these: {kernels or '-'}; the library's kernels changed since): measuring it again")
            else:
                say(f"the machine profile at {target} is of {cached.device} ({cached.backend} backend, "
                    f"{cached.sm_share} % of SMs, {cached.sm_count} at work), not of {name} ({probe.backend}, "
                    f"{share} %, {sms}): measuring it again")
    with probe:
        profile = measure_profile(probe, say)
    cache_profile(profile, target, say)
    return profile


def cache_profile(profile: MachineProfile, path: Path, say: Callable[[str], None]) -> None:
    """Write a measured ``profile`` to the cache file ``path`` unless it looks measured while
    the machine was busy; what happened goes to ``say``, nothing is raised."""
    unsteady = unsteady_compute(profile.compute.rows_per_expert, profile.compute.seconds)
    if unsteady:
        say(f"{unsteady}, measured twice: the machine seems busy; this profile is used but not cached "
            f"(measured again next time)")
        return
    try:
        write_profile(profile, path)
        say(f"machine profile written to {path}")
    except OSError as exc:
        say(f"could not write the machine profile to {path} ({exc}): it will be measured again next time")


class _StderrHandler(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a line is written (not the one at import)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


# The tuner's progress (a profile measured, why a cached one was not used) goes through the
# "ultraep.tune" logger: on stderr tagged [tune] unless the application configures the logger
# first; `logging.getLogger("ultraep.tune").setLevel(logging.WARNING)` silences it (the tools' --quiet).
PROGRESS = logging.getLogger(PROGRESS_LOGGER)
if not PROGRESS.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("[tune] %(message)s"))
    PROGRESS.addHandler(_handler)
    PROGRESS.propagate = False
if PROGRESS.level == logging.NOTSET:
    PROGRESS.setLevel(logging.INFO)


def stderr_progress(line: str) -> None:
    """A progress line of the tuner, through the ``ultraep.tune`` logger (stderr by default)."""
    PROGRESS.info(line)
