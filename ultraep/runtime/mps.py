"""Emulated expert parallelism on one GPU: the ranks under a CUDA MPS daemon, each with its
own share of the SMs.

Ranks that share a GPU without MPS are time-sliced: their kernels take turns, so a
multi-rank time says little. Under an MPS control daemon their kernels run at once, and
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps each rank at a share of the SMs, so every rank
behaves like a small GPU of its own (HBM is shared, there is no NVLink) and a straggler
costs time as on a real EP group. :class:`MPSDaemon` starts a private daemon (its own
pipe and log directories, a child of this process) and stops it again; the launcher
(:func:`ultraep.runtime.launch.multi_rank_main`) uses it for ``--emulate-ep``, and
:func:`sharing_label` says in a table's header how the ranks shared the GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ultraep.errors import MPSUnavailable

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup

CONTROL = "nvidia-cuda-mps-control"
EMULATION_VARIABLE = "ULTRAEP_EP_EMULATION"  # "mps:<percent>" in every rank of an emulated job
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 20.0


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


class MPSDaemon:
    """A private MPS control daemon for the length of a ``with`` block.

    ``client_environment(percent)`` is what each rank's environment needs to run under it
    with ``percent`` % of the SMs. :meth:`start` (or entering the block) raises
    :class:`~ultraep.errors.MPSUnavailable`, with the daemon's own words, when it cannot start."""

    def __init__(self, *, start_timeout_s: float = START_TIMEOUT_S):
        self.start_timeout_s = start_timeout_s
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
        self._process = subprocess.Popen([control, "-f"], env={**os.environ, **self._directories},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pipe = Path(self._directories["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
        deadline = time.monotonic() + self.start_timeout_s
        while not pipe.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                said = self._stop()
                raise MPSUnavailable(f"the MPS control daemon did not start within {self.start_timeout_s:g} s"
                                  + (f": {said.strip()}" if said.strip() else ""))
            time.sleep(0.05)

    def client_environment(self, percent: int) -> dict[str, str]:
        return {**self._directories, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent),
                EMULATION_VARIABLE: f"mps:{percent}"}

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


def sharing_label(group: "EPGroup") -> str:
    """How the group's ranks share their GPUs, for a benchmark table's header (collective)."""
    from ultraep.runtime.group import gpu_identity, most_ranks_on_one_gpu

    per_gpu = most_ranks_on_one_gpu(group.allgather(gpu_identity(group)))
    if group.device is None:
        return "host backend: not a figure of merit"
    if per_gpu == 1:
        return "one GPU per rank"
    emulation = os.environ.get(EMULATION_VARIABLE, "")
    if emulation.startswith("mps:"):
        return f"MPS, {emulation[4:]} % of SMs per rank ({per_gpu} ranks per GPU)"
    return f"{per_gpu} ranks time-sliced on one GPU: not a figure of merit"


def main(argv: list[str] | None = None) -> int:
    """``python -m ultraep.runtime.mps [--percent P] -- COMMAND...``: run COMMAND (and the
    processes it starts) under a private MPS daemon with ``P`` % of the SMs per process."""
    import argparse
    import sys

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
