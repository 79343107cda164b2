"""Launching ranks: the right ``mpiexec`` command for MPICH and Open MPI, run under a timeout.

Tests and examples start ``mpiexec -n N python -m mpi4py script.py``: ``-m mpi4py``
turns an unhandled exception on one rank into ``MPI_Abort`` for the whole job, and the
timeout here kills the whole process group if a rank hangs anyway.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from ultraep.errors import LaunchError, MPSUnavailable


# Set by mpiexec in every rank's environment (Open MPI, PMIx, MPICH/Hydra).
MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpiexec() -> bool:
    return any(v in os.environ for v in MPI_LAUNCH_VARIABLES)


def find_mpiexec() -> str:
    """``$ULTRAEP_MPIEXEC``, else the one beside this Python (the venv's MPICH wheel), else PATH."""
    explicit = os.environ.get("ULTRAEP_MPIEXEC")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError("no mpiexec found: install the project (pip install -e .[test] brings MPICH) "
                      "or set ULTRAEP_MPIEXEC")


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpiexec: str) -> str:
    """'openmpi' or 'mpich', read from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {mpiexec} --version: {exc}") from exc
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text or "Open RTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel" in text:
        return "mpich"
    raise LaunchError(f"unknown MPI flavor from {mpiexec} --version: {text[:200]!r}")


def mpiexec_command(nprocs: int, argv: Sequence[str], *, mpiexec: str | None = None,
                    flavor: str | None = None) -> list[str]:
    """``mpiexec -n N [flags] python -m mpi4py argv...`` for this machine's MPI."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    mpiexec = mpiexec or find_mpiexec()
    flavor = flavor or mpi_flavor(mpiexec)
    flags: list[str] = []
    if flavor == "openmpi":
        # One GPU or a 2-core CI machine hosts more ranks than slots; the GPU machine runs as root.
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [mpiexec, "-n", str(nprocs), *flags, sys.executable, "-m", "mpi4py", *argv]


def mpi_environment(flavor: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if flavor == "mpich":
        env.setdefault("HYDRA_LAUNCHER", "fork")  # never pick up a batch system on a laptop or CI
        env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
        env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")  # oversubscribed ranks must yield the cores
        env.setdefault("FI_PROVIDER", "tcp")
    else:
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_mpi(nprocs: int, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike | None = None, check: bool = True,
            capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m mpi4py argv`` on ``nprocs`` ranks; kill the whole job after ``timeout`` s.

    Returns the completed process (stdout and stderr merged into ``stdout``). With
    ``check`` a non-zero exit raises :class:`LaunchError` carrying the output. Without
    ``capture`` the ranks write to this process's stdout and stderr as they run (``stdout`` is "").
    """
    mpiexec = find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    cmd = mpiexec_command(nprocs, argv, mpiexec=mpiexec, flavor=flavor)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if capture else {}
    proc = subprocess.Popen(cmd, **pipes, text=True,
                            env=mpi_environment(flavor, env), cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise LaunchError(f"{' '.join(cmd)} timed out after {timeout:.0f} s; output:\n{out or ''}") from None
    except BaseException:  # Ctrl-C or a SIGTERM turned into SystemExit: the job must not outlive us
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    out = out or ""
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise LaunchError(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{out}")
    return result


def relaunch_on_ranks(nprocs: int, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None) -> int:
    """Run ``python -m mpi4py argv`` on ``nprocs`` ranks (``env`` added to this process's
    environment), its output streamed as it comes, and return its exit code (for
    command-line tools that start as one process and need several ranks)."""
    sys.stdout.flush()  # this process's earlier lines before the ranks'
    result = run_mpi(nprocs, argv, timeout=timeout, check=False, env={**os.environ, **(env or {})}, capture=False)
    return result.returncode


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def add_emulation_option(parser) -> None:
    """``--emulate-ep [SM_PERCENT]`` for a multi-rank tool (see :func:`multi_rank_main`)."""
    parser.add_argument("--emulate-ep", type=int, nargs="?", const=0, default=None, metavar="SM_PERCENT",
                        help="ranks sharing one GPU run under a private MPS daemon, each with SM_PERCENT %% of the "
                             "SMs (default 100/ranks), so each behaves like a small GPU of its own")


def multi_rank_main(argv, parse_args, run, *, nprocs, command: Sequence[str], timeout: float = 580) -> int:
    """Entry point of a tool that needs several ranks: parse ``argv``; under ``mpiexec``
    ``run(args)``, else relaunch ``python -m mpi4py command argv`` on ``nprocs(args)`` ranks,
    under an MPS daemon of its own when ``args.emulate_ep`` is set (:mod:`ultraep.runtime.mps`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if launched_by_mpiexec():
        return run(args)
    ranks, relaunch = nprocs(args), [*command, *argv]
    percent = getattr(args, "emulate_ep", None)
    if percent is None:
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout)
    from ultraep.runtime.mps import MPSDaemon, default_share, share_error

    percent = percent or default_share(ranks)
    if (error := share_error(ranks, percent)) is not None:
        print(f"--emulate-ep: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the daemon is stopped on the way out
    daemon = MPSDaemon()
    try:
        daemon.start()
    except MPSUnavailable as exc:
        print(f"--emulate-ep: {exc}; the ranks run time-sliced instead", file=sys.stderr)
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout)
    with daemon:
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout, env=daemon.client_environment(percent))
