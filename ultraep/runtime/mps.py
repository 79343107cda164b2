"""Emulated expert parallelism on one GPU: the ranks under a CUDA MPS daemon, each with its
own share of the SMs.

Ranks that share a GPU without MPS are time-sliced: their kernels take turns, so a
multi-rank time says little. Under an MPS control daemon their kernels run at once, and
each rank behaves like a small GPU of its own (HBM is shared, there is no NVLink), so a
straggler costs time as on a real EP group. Three ways to give each rank its share:

- **static SM partitions** (daemon started with ``-S``, one ``sm_partition add`` per rank,
  each client naming its partition in ``CUDA_MPS_SM_PARTITION``): every rank owns a
  disjoint set of SMs, as one GPU per rank would give it;
- **green contexts** (:mod:`ultraep.runtime.sm_partition`; the daemon at 100 %): each rank
  makes a green context on its own group of the device's SMs current before any work, so
  the ranks' SMs are disjoint too, on a daemon without static partitioning;
- **the thread percentage** (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``): caps how many SMs a
  rank uses but not which, so ranks' blocks can land on the same SMs and one rank's
  persistent kernel can run late behind another's.

:func:`start_emulation` tries them in this order and says on stderr when it falls back (the
thread percentage's shares overlap now and then: measured on the H200 with 4 ranks at 25 %,
a wave of blocks that should hold their 32 SMs for 20 ms took 20 ms as a rule and up to
40 ms some of the time); ``$ULTRAEP_EP_SHARES`` (``static``, ``green`` or ``percent``) asks
for one of them alone, to compare them in one run;
:class:`MPSDaemon` starts a private daemon (its own pipe and log directories, a child of
this process) and stops it again; the launcher (:func:`ultraep.runtime.launch.multi_rank_main`)
uses them for ``--emulate-ep``, each rank takes its partition with :func:`take_rank_partition`
before CUDA starts, and :func:`sharing_label` says in a table's header how the ranks shared the GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ultraep.errors import MPSUnavailable
from ultraep.runtime.sm_partition import GREEN_VARIABLE, LOCAL_RANK_VARIABLES, local_rank_of_job, usable_sms

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup

CONTROL = "nvidia-cuda-mps-control"
EMULATION_VARIABLE = "ULTRAEP_EP_EMULATION"  # "mps:<percent>" in every rank of an emulated job
PARTITIONS_VARIABLE = "ULTRAEP_MPS_SM_PARTITIONS"  # the partition ids, comma-separated, by local rank
SMS_PER_RANK_VARIABLE = "ULTRAEP_MPS_SMS_PER_RANK"  # set only when the ranks have static partitions
PARTITION_VARIABLE = "CUDA_MPS_SM_PARTITION"
SHARES_VARIABLE = "ULTRAEP_EP_SHARES"  # static, green or percent: one way alone (default: the first that works)
SHARE_KINDS = ("static", "green", "percent")
START_TIMEOUT_S = 20.0
GREEN_CHECK_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 15.0
STATIC_MIN_VERSION = 13010  # MPS docs: static SM partitioning needs a control daemon reporting at least this
PARTITION_ID = re.compile(r"GPU-[0-9A-Fa-f-]+/[^\s,]+")  # what "sm_partition add" prints


def default_share(ranks: int) -> int:
    """The SM percentage that splits one GPU evenly among ``ranks``."""
    return max(1, 100 // max(ranks, 1))


def share_error(ranks: int, percent: int) -> str | None:
    """Why ``ranks`` ranks cannot each get ``percent`` % of the SMs, or None."""
    if not 1 <= percent <= 100:
        return f"an SM share must be in [1, 100] %, got {percent}"
    if ranks * percent > 100:
        return (f"{ranks} ranks x {percent} % of the SMs is {ranks * percent} %: the shares do not fit one GPU "
                f"(at most {default_share(ranks)} % per rank)")
    return None


class StaticPartitionsUnavailable(Exception):
    """This machine's MPS cannot give the ranks static SM partitions (the thread percentage can still run)."""


class MPSDaemon:
    """A private MPS control daemon for the length of a ``with`` block.

    With ``static`` it runs in static SM partitioning mode and :meth:`partition` carves one
    partition per rank. ``client_environment(percent)`` is what each rank's environment
    needs to run under it. :meth:`start` (or entering the block) raises
    :class:`~ultraep.errors.MPSUnavailable`, with the daemon's own words, when it cannot start."""

    def __init__(self, *, static: bool = False, start_timeout_s: float = START_TIMEOUT_S):
        self.static = static
        self.start_timeout_s = start_timeout_s
        self.partitions: list[str] = []
        self.sms_per_partition = 0
        self.green_ranks = 0  # > 0: each of that many ranks enters a green context of its own (sm_partition)
        self._root: Path | None = None
        self._process: subprocess.Popen | None = None

    @property
    def _directories(self) -> dict[str, str]:
        assert self._root is not None
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self._root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self._root / "log")}

    def __enter__(self) -> "MPSDaemon":
        if self._process is None:
            self.start()
        return self

    def start(self) -> None:
        control = shutil.which(CONTROL)
        if control is None:
            raise MPSUnavailable(f"{CONTROL} is not on the PATH: MPS cannot start here")
        self._root = Path(tempfile.mkdtemp(prefix="ultraep-mps-"))
        for directory in self._directories.values():
            os.makedirs(directory)
        self._process = subprocess.Popen([control, "-f", *(["-S"] if self.static else [])],
                                         env={**os.environ, **self._directories},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pipe = Path(self._directories["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
        deadline = time.monotonic() + self.start_timeout_s
        while not pipe.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                said = self._stop()
                raise MPSUnavailable(f"the MPS control daemon{' (-S)' if self.static else ''} did not start within "
                                     f"{self.start_timeout_s:g} s" + (f": {said.strip()}" if said.strip() else ""))
            time.sleep(0.05)

    def command(self, line: str) -> str:
        """Send one command to the daemon; its reply (raises StaticPartitionsUnavailable when it fails)."""
        try:
            done = subprocess.run([CONTROL], input=line + "\n", env={**os.environ, **self._directories}, text=True,
                                  capture_output=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StaticPartitionsUnavailable(f"'{line}' to the MPS daemon: {exc}") from exc
        reply = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            raise StaticPartitionsUnavailable(f"'{line}' to the MPS daemon exited {done.returncode}: {reply}")
        return reply

    def partition(self, ranks: int, percent: int) -> None:
        """Carve ``ranks`` disjoint SM partitions of ``percent`` % of the SMs each (whole chunks)."""
        assert self.static and self._process is not None
        free_chunks, free_sms = free_chunks_and_sms(self.command("lspart"))
        chunks = partition_chunks(ranks, percent, free_chunks)
        device = gpu_uuid()
        for _ in range(ranks):
            reply = self.command(f"sm_partition add {device} {chunks}")
            found = PARTITION_ID.search(reply)
            if found is None:
                raise StaticPartitionsUnavailable(f"'sm_partition add {device} {chunks}' gave no partition: {reply}")
            self.partitions.append(found.group(0))
        self.sms_per_partition = chunks * free_sms // free_chunks

    def client_environment(self, percent: int) -> dict[str, str]:
        if self.partitions:  # each rank picks its own partition (take_rank_partition)
            share = {PARTITIONS_VARIABLE: ",".join(self.partitions), SMS_PER_RANK_VARIABLE: str(self.sms_per_partition)}
        elif self.green_ranks:  # each rank enters its green context (EPGroup); MPS lets it use all the SMs
            share = {GREEN_VARIABLE: f"{self.green_ranks}:{percent}", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}
        else:
            share = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
        return {**self._directories, **share, EMULATION_VARIABLE: f"mps:{percent}"}

    def __exit__(self, *exc_info) -> None:
        self._stop()

    def _stop(self) -> str:
        """Ask the daemon to quit (kill it if it will not); its output; the directories go."""
        said = ""
        if self._process is not None:
            if self._process.poll() is None:
                try:
                    subprocess.run([CONTROL], input="quit\n", env={**os.environ, **self._directories}, text=True,
                                   capture_output=True, timeout=STOP_TIMEOUT_S)
                    self._process.wait(timeout=STOP_TIMEOUT_S)
                except (OSError, subprocess.TimeoutExpired):
                    self._process.kill()
            said = self._process.communicate()[0] or ""
            self._process = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        return said


def free_chunks_and_sms(lspart: str) -> tuple[int, int]:
    """The free chunks and free SMs in ``lspart``'s device row (``GPU-… - free used free-SMs used-SMs …``)."""
    for line in lspart.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0].startswith("GPU-") and fields[1] == "-" and fields[2].isdigit() \
                and fields[4].isdigit() and int(fields[2]) > 0:
            return int(fields[2]), int(fields[4])
    raise StaticPartitionsUnavailable(f"no free SM chunks in the daemon's lspart: {lspart!r}")


def partition_chunks(ranks: int, percent: int, free_chunks: int) -> int:
    """Chunks per rank for ``percent`` % of the SMs: the nearest whole number, at most an even split."""
    chunks = min(free_chunks // ranks, round(free_chunks * percent / 100))
    if chunks < 1:
        raise StaticPartitionsUnavailable(f"{percent} % of {free_chunks} SM chunks is less than one chunk per rank")
    return chunks


def gpu_uuid() -> str:
    """The UUID of the GPU the ranks share (the first visible one), which names it to the daemon."""
    device = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        done = subprocess.run(["nvidia-smi", "-i", device, "--query-gpu=uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StaticPartitionsUnavailable(f"nvidia-smi could not name GPU {device}: {exc}") from exc
    uuid, said = done.stdout.strip(), (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not uuid.startswith("GPU-"):
        raise StaticPartitionsUnavailable(f"nvidia-smi could not name GPU {device}: {said}")
    return uuid


def control_version() -> int | None:
    """The version ``nvidia-cuda-mps-control -v`` reports ("Binary version: 13000"), None if it says none."""
    try:
        done = subprocess.run([CONTROL, "-v"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"version:?\s*(\d+)", done.stdout + done.stderr, re.IGNORECASE)
    return int(found.group(1)) if found else None


def start_static(ranks: int, percent: int) -> MPSDaemon:
    """A started daemon in static partitioning mode with one partition per rank, or
    StaticPartitionsUnavailable saying why not. An older daemon is not even asked: the
    H200's 13000 takes ``-S`` for an unknown option, prints its help and never opens its pipe."""
    version = control_version()
    if version is None or version < STATIC_MIN_VERSION:
        raise StaticPartitionsUnavailable(f"{CONTROL} -v reports version {version}; static SM partitions need "
                                          f"{STATIC_MIN_VERSION} or later")
    daemon = MPSDaemon(static=True)
    try:
        daemon.start()
        daemon.partition(ranks, percent)
    except (MPSUnavailable, StaticPartitionsUnavailable) as exc:
        daemon._stop()
        raise StaticPartitionsUnavailable(str(exc)) from exc
    return daemon


def green_sms(ranks: int, percent: int, environment: dict[str, str]) -> int:
    """The SMs each rank's green context would hold (``sm_partition``'s check, in a process of
    its own under the started daemon's ``environment``, as a rank will make it), or
    StaticPartitionsUnavailable saying why there are none."""
    try:
        done = subprocess.run([sys.executable, "-m", "ultraep.runtime.sm_partition", str(ranks), str(percent)],
                              capture_output=True, text=True, timeout=GREEN_CHECK_TIMEOUT_S,
                              env={**os.environ, **environment})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StaticPartitionsUnavailable(f"the green context check did not finish: {exc}") from exc
    if done.returncode != 0:
        raise StaticPartitionsUnavailable(f"no green contexts: {(done.stderr or done.stdout).strip()}")
    first = done.stdout.split()[:1]
    if not first or not first[0].isdigit():
        raise StaticPartitionsUnavailable(f"the green context check printed {done.stdout!r}, not SM counts")
    return int(first[0])


def shares_asked() -> tuple[str, ...]:
    """The ways to share the SMs to try, in order (``$ULTRAEP_EP_SHARES`` names one alone)."""
    asked = os.environ.get(SHARES_VARIABLE, "").strip()
    if not asked:
        return SHARE_KINDS
    if asked not in SHARE_KINDS:
        raise MPSUnavailable(f"{SHARES_VARIABLE}={asked!r}: must be one of {', '.join(SHARE_KINDS)}")
    return (asked,)


def start_emulation(ranks: int, percent: int) -> MPSDaemon:
    """A started daemon giving ``ranks`` ranks ``percent`` % of the SMs each: disjoint static
    partitions when the machine's MPS has them, else disjoint green contexts, else (said on
    stderr) the thread percentage. Raises :class:`~ultraep.errors.MPSUnavailable` when MPS
    cannot start at all, or the one way ``$ULTRAEP_EP_SHARES`` asks for is not there."""
    if shutil.which(CONTROL) is None:
        raise MPSUnavailable(f"{CONTROL} is not on the PATH: MPS cannot start here")
    kinds = shares_asked()
    reasons = []
    if "static" in kinds:
        try:
            return start_static(ranks, percent)
        except StaticPartitionsUnavailable as exc:
            reasons.append(f"no static SM partitions ({exc})")
            if kinds == ("static",):
                raise MPSUnavailable(f"{SHARES_VARIABLE}=static: {reasons[0]}") from exc
    daemon = MPSDaemon()
    daemon.start()
    if "green" in kinds:
        try:
            daemon.sms_per_partition = green_sms(ranks, percent, daemon.client_environment(100))
            daemon.green_ranks = ranks
        except StaticPartitionsUnavailable as exc:
            reasons.append(str(exc))
        except BaseException:  # interrupted: stop the daemon on the way out
            daemon._stop()
            raise
    if not daemon.green_ranks:
        if "percent" not in kinds:  # green alone was asked for
            daemon._stop()
            raise MPSUnavailable(f"{SHARES_VARIABLE}=green: " + "; ".join(reasons))
        if reasons:
            print(f"--emulate-ep: {'; '.join(reasons)}; the ranks get {percent} % of the SMs each by thread "
                  "percentage instead, and their shares may overlap", file=sys.stderr)
    elif reasons:
        print(f"--emulate-ep: {'; '.join(reasons)}; each rank gets {daemon.sms_per_partition} SMs of its own "
              "through a green context", file=sys.stderr)
    return daemon


def take_rank_partition(environ=os.environ) -> None:
    """In a rank of an emulated job with static partitions, before CUDA starts: name this
    rank's own partition in ``CUDA_MPS_SM_PARTITION`` (all ranks were started with one environment)."""
    partitions = environ.get(PARTITIONS_VARIABLE)
    if not partitions:
        return
    from ultraep.errors import LaunchError

    rank = local_rank_of_job(environ)
    names = partitions.split(",")
    if rank is None or rank >= len(names):
        raise LaunchError(f"{PARTITIONS_VARIABLE} holds {len(names)} SM partitions but this rank's local rank is "
                          f"{rank} (from {', '.join(LOCAL_RANK_VARIABLES)}): it has no partition of its own")
    environ[PARTITION_VARIABLE] = names[rank]


def sharing_label(group: "EPGroup") -> str:
    """How the group's ranks share their GPUs, for a benchmark table's header (collective)."""
    from ultraep.runtime.group import ranks_per_gpu

    per_gpu = ranks_per_gpu(group)
    if group.device is None:
        return "host backend: not a figure of merit"
    if per_gpu == 1:
        return "one GPU per rank"
    emulation = os.environ.get(EMULATION_VARIABLE, "")
    if sms := os.environ.get(SMS_PER_RANK_VARIABLE):
        return f"MPS static partition, {sms} SMs per rank ({per_gpu} ranks per GPU)"
    if os.environ.get(GREEN_VARIABLE):
        return f"MPS, a green context of {usable_sms(group.device)} SMs per rank, disjoint ({per_gpu} ranks per GPU)"
    if emulation.startswith("mps:"):
        return f"MPS, {emulation[4:]} % of SMs per rank (shares may overlap; {per_gpu} ranks per GPU)"
    return f"{per_gpu} ranks time-sliced on one GPU: not a figure of merit"


def main(argv: list[str] | None = None) -> int:
    """``python -m ultraep.runtime.mps [--percent P] -- COMMAND...``: run COMMAND (and the
    processes it starts) under a private MPS daemon with ``P`` % of the SMs per process."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ultraep.runtime.mps", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--percent", type=int, default=100, help="SM share of each CUDA process (default 100)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    if (error := share_error(1, args.percent)) is not None:
        parser.error(error)
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the daemon on the way out
    try:
        with MPSDaemon() as daemon:
            return subprocess.run(command, env={**os.environ, **daemon.client_environment(args.percent)}).returncode
    except MPSUnavailable as exc:
        print(f"ultraep.runtime.mps: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
