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
* ``gemm``: one GEMM tile (:class:`TileCost`): the grouped GEMM's time per ``bm x bn``
  output tile over ``k`` on one SM, from calls of one, two and four waves of tiles, and the
  fixed cost of a call beside it (the host: one ``np.matmul`` of several tiles' rows over
  the cores, nothing fixed);
* ``compute``: the expert compute, time per call at a few rows-per-expert sizes -- the
  grouped GEMM ``ultraep.compute.grouped_mm`` (bf16) on the GPU, timed on the device
  alone (the host's part is ``launch_s``), ``np.matmul`` (float32) per expert on the host.
  Time per call, not only throughput: at a few rows per expert the call reads every
  weight for little arithmetic, so its time hardly depends on the rows.

The cache: ``profile-<device>.json`` in ``$ULTRAEP_CACHE_DIR`` (default
``~/.cache/ultraep``) or at an explicit path. The file carries a format version
(:data:`PROFILE_VERSION`); a file of another version, another device or another SM share
(MPS emulation: ``ultraep.runtime.mps``) is measured again, and so is one that cannot be
read, with a message saying why. Files are replaced atomically, so ranks reading the cache
while another writes it see the old file or the new one.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ultraep.errors import ProfileError

PROFILE_FORMAT = "ultraep-machine-profile"
PROFILE_VERSION = 3
CACHE_VARIABLE = "ULTRAEP_CACHE_DIR"
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


@dataclass(frozen=True)
class TileCost:
    """One GEMM tile of ``bm x bn`` outputs over a reduction of ``k``: ``tile_s`` on one SM
    (the slope of a call's time in whole waves of tiles, times the SMs), and ``fixed_s`` what
    a call costs beside its tiles (the intercept: prologue, the last tile's epilogue)."""

    kernel: str
    bm: int
    bn: int
    k: int
    tile_s: float
    fixed_s: float

    def seconds(self, k) -> np.ndarray:
        """Modelled time of one ``bm x bn`` tile over a reduction of ``k`` (array-like) on one
        SM: linear in ``k`` (each k step streams one slice of both operands through the MMAs)."""
        return self.tile_s * np.asarray(k, np.float64) / self.k


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
    gemm: TileCost
    measured_at: str = ""
    version: int = PROFILE_VERSION
    shared_copy_bytes_per_s: float = 0.0
    shared_by: int = 1

    def gpu_copy_bytes_per_s(self, sharing: int) -> float:
        """What ``sharing`` processes copying at once on one GPU move together: the rate
        measured with that many (:func:`ultraep.tune.replicas.group_profile`), else this
        process's own peer copy rate (one process alone taken to reach the memory's limit)."""
        if sharing > 1 and sharing == self.shared_by and self.shared_copy_bytes_per_s > 0:
            return self.shared_copy_bytes_per_s
        return self.peer_bytes_per_s

    @property
    def usable_sms(self) -> int:
        """SMs (cores) this process's work runs on: ``sm_count``, which under an MPS share
        the device already reports as the share (a quarter of the H200's 132 SMs is 33)."""
        return self.sm_count

    def identity(self) -> tuple[str, str, int]:
        """What a cached profile must match to be reused (besides its version)."""
        return (self.backend, self.device, self.sm_share)

    def to_json(self) -> dict:
        data = asdict(self)
        data["format"] = PROFILE_FORMAT
        return data

    @classmethod
    def from_json(cls, data) -> MachineProfile:
        """A profile from :meth:`to_json`'s dict; ProfileError naming what is missing or wrong."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a machine profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"format version {data.get('version')!r}, this library reads version {PROFILE_VERSION}")
        try:
            compute, gemm = data["compute"], data["gemm"]
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
                          gemm=TileCost(kernel=_text(gemm, "kernel"), bm=_count(gemm, "bm"), bn=_count(gemm, "bn"),
                                        k=_count(gemm, "k"), tile_s=_positive(gemm, "tile_s"),
                                        fixed_s=_positive(gemm, "fixed_s")),
                          measured_at=str(data.get("measured_at", "")),
                          shared_copy_bytes_per_s=float(data.get("shared_copy_bytes_per_s", 0.0)),
                          shared_by=int(data.get("shared_by", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"bad or missing field: {exc}") from None
        rows = curve.rows_per_expert
        if not rows or len(rows) != len(curve.seconds) or list(rows) != sorted(set(rows)) or rows[0] < 1 \
                or not all(math.isfinite(s) and s > 0 for s in curve.seconds):
            raise ProfileError("compute: rows_per_expert must rise from >= 1, one positive time per size")
        return profile

    def table(self) -> str:
        """A readable summary, one quantity per line."""
        curve = self.compute
        lines = [f"machine profile: {self.device} ({self.backend} backend, {self.sm_count} "
                 f"{'SMs' if self.backend == 'device' else 'cores'} at an MPS share of {self.sm_share} %), "
                 f"format version {self.version}, measured {self.measured_at or '-'}",
                 f"  copy        {self.copy_bytes_per_s / 1e9:10.1f} GB/s copied   {self.copy_method}",
                 f"  peer copy   {self.peer_bytes_per_s / 1e9:10.1f} GB/s copied   {self.peer_method}",
                 f"  launch      {self.launch_s * 1e6:10.2f} us per launch",
                 f"  kernel      {self.kernel_s * 1e6:10.2f} us per empty kernel on the device",
                 f"  warp copy   {self.copy_warp_bytes_per_s / 1e9:10.2f} GB/s copied   per warp, far from the "
                 "memory's limit",
                 f"  shared copy {self.shared_copy_bytes_per_s / 1e9:10.1f} GB/s copied   by {self.shared_by} "
                 "processes on one GPU at once" if self.shared_copy_bytes_per_s else
                 "  shared copy          -              (not measured: one process per GPU)",
                 f"  flag        {self.flag_s * 1e6:10.2f} us per release/acquire handoff",
                 f"  GEMM tile   {self.gemm.tile_s * 1e6:10.2f} us per {self.gemm.bm} x {self.gemm.bn} tile over "
                 f"k = {self.gemm.k} on one SM, {self.gemm.fixed_s * 1e6:.2f} us per call beside ({self.gemm.kernel})",
                 f"  expert compute: {curve.kernel}, {curve.dtype}, {curve.experts} experts of {curve.k} x {curve.n}",
                 f"  {'rows/expert':>13}  {'us/call':>10}  {'us/expert':>10}  {'TFLOPS':>8}"]
        for rows, seconds, tflops in zip(curve.rows_per_expert, curve.seconds, curve.tflops()):
            lines.append(f"  {rows:13d}  {seconds * 1e6:10.2f}  {seconds * 1e6 / curve.experts:10.2f}  {tflops:8.2f}")
        return "\n".join(lines)


def fit_tile_cost(kernel: str, bm: int, bn: int, k: int, tiles, seconds, workers: int) -> TileCost:
    """A :class:`TileCost` from calls of ``tiles[i]`` tiles that took ``seconds[i]`` on
    ``workers`` SMs (cores) working at once. Several sizes: the least-squares line through
    them, its slope times the workers a tile's time on one, its intercept the fixed cost
    (at least a nanosecond: noise may put a tiny intercept below zero). One size: its time
    per tile, nothing fixed."""
    tiles, seconds = np.asarray(tiles, np.float64), np.asarray(seconds, np.float64)
    if len(tiles) == 1:
        slope, intercept = seconds[0] / tiles[0], 0.0
    else:
        slope, intercept = np.polyfit(tiles, seconds, 1)
    if not slope > 0:
        raise ProfileError(f"the GEMM's time did not grow with its tiles ({tiles.tolist()} tiles took "
                           f"{[f'{s * 1e6:.1f} us' for s in seconds]})")
    return TileCost(kernel=kernel, bm=bm, bn=bn, k=k, tile_s=float(slope * workers),
                    fixed_s=max(float(intercept), 1e-9))


def _text(data: dict, key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {value!r}")
    return value


def _count(data: dict, key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive(data: dict, key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


# -- measuring -------------------------------------------------------------------------------

def make_probe(backend: str = "auto", device: int | None = None):
    """The probe of ``backend`` (``"auto"``: the GPU when CuPy sees one, else the host)."""
    if backend not in ("auto", "device", "host"):
        raise ProfileError(f"backend must be 'auto', 'device' or 'host', got {backend!r}")
    if backend == "auto":
        from ultraep.runtime.group import gpu_count
        backend = "device" if gpu_count() else "host"
    if backend == "host":
        from ultraep.tune.host import HostProbe
        return HostProbe()
    from ultraep.tune.device import DeviceProbe
    return DeviceProbe(device)


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
    share = sm_share()
    # the tiles of a call run on every SM (core) this process may use at once: under MPS
    # the device's SM count is already the share's
    gemm = fit_tile_cost(*probe.gemm_tile_times(), workers=sm_count)
    say(f"  GEMM tile {gemm.bm} x {gemm.bn} over k = {gemm.k}: {gemm.tile_s * 1e6:.2f} us on one SM, "
        f"{gemm.fixed_s * 1e6:.2f} us per call beside")
    seconds = []
    for rows in probe.rows_per_expert:
        seconds.append(probe.expert_call_s(rows))
        say(f"  expert compute, {rows} rows per expert: {seconds[-1] * 1e6:.1f} us per call")
    experts, k, n = probe.compute_shape
    curve = ComputeCurve(kernel=probe.compute_kernel, dtype=probe.compute_dtype, experts=experts, k=k, n=n,
                         rows_per_expert=tuple(probe.rows_per_expert), seconds=tuple(seconds))
    return MachineProfile(backend=probe.backend, device=name, sm_count=sm_count, sm_share=share,
                          copy_bytes_per_s=copy, copy_method=probe.copy_method, peer_bytes_per_s=peer,
                          peer_method=peer_method, launch_s=launch, compute=curve, kernel_s=kernel,
                          copy_warp_bytes_per_s=warp,
                          flag_s=flag, gemm=gemm,
                          measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


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


def load_profile(backend: str = "auto", *, device: int | None = None, path: str | os.PathLike[str] | None = None,
                 force: bool = False, progress: Callable[[str], None] | None = None) -> MachineProfile:
    """This machine's profile: from the cache (``path``, else :func:`profile_path`) when it
    was measured on this device at this SM share by this format version, else measured now
    (``force``: always) and cached. ``progress`` gets the measurement's lines and the reason
    a cached file was not used; a cache that cannot be written is reported, not raised."""
    say = progress or (lambda line: None)
    probe = make_probe(backend, device)
    name, _ = probe.describe()
    share = sm_share()
    target = Path(path) if path is not None else profile_path(name, share)
    if not force:
        try:
            cached = read_profile(target)
        except FileNotFoundError:
            say(f"no machine profile at {target}: measuring it")
        except (OSError, UnicodeDecodeError, ProfileError) as exc:
            say(f"cannot use the machine profile at {target} ({exc}): measuring it again")
        else:
            if cached.identity() == (probe.backend, name, share):
                return cached
            say(f"the machine profile at {target} is of {cached.device} ({cached.backend} backend, "
                f"{cached.sm_share} % of SMs), not of {name} ({probe.backend}, {share} %): measuring it again")
    profile = measure_profile(probe, say)
    try:
        write_profile(profile, target)
        say(f"machine profile written to {target}")
    except OSError as exc:
        say(f"could not write the machine profile to {target} ({exc}): it will be measured again next time")
    return profile


def stderr_progress(line: str) -> None:
    """Progress lines on stderr, tagged, as the benchmarks print theirs."""
    print(f"[tune] {line}", file=sys.stderr, flush=True)
