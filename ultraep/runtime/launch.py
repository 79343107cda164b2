"""Launching ranks: the right ``mpiexec`` command for MPICH and Open MPI, run under a timeout.

Tests and examples start ``mpiexec -n N python -m mpi4py script.py``: ``-m mpi4py``
turns an unhandled exception on one rank into ``MPI_Abort`` for the whole job, and the
timeout here kills the whole process group if a rank hangs anyway. Each rank runs its
script through :func:`run_rank`, which records how it ended in a file the launcher reads
when the job fails, since the MPI launcher reports only one process's code. A job that
fails, times out or is interrupted (SIGINT, SIGTERM) is killed as a process group, and the
MPI shared-memory segments it left in ``/dev/shm`` are removed.
"""

from __future__ import annotations

import argparse

import contextlib
import functools
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from ultraep.errors import LaunchError, MPSUnavailable, UltraEPError


# Set by mpiexec in every rank's environment (Open MPI, PMIx, MPICH/Hydra).
MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
STATUS_DIR_VARIABLE = "ULTRAEP_RANK_STATUS_DIR"  # where each rank records how it ended
SHM_DIR = Path("/dev/shm")
MPI_SEGMENT_PREFIXES = ("mpich_shm_", "vader_segment.", "sm_segment.")  # MPICH, Open MPI


def launched_by_mpiexec() -> bool:
    return any(v in os.environ for v in MPI_LAUNCH_VARIABLES)


def job_ranks(args) -> int:
    """The ranks a multi-rank tool runs on: the job's under mpiexec (``--ranks`` only says
    how many to launch otherwise), else ``args.ranks``."""
    if launched_by_mpiexec():
        from mpi4py import MPI

        return MPI.COMM_WORLD.size
    return args.ranks


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
    return [mpiexec, "-n", str(nprocs), *flags, sys.executable, "-m", "mpi4py", "-c", RANK_MAIN, *argv]


RANK_MAIN = "from ultraep.runtime.launch import run_rank; run_rank()"


def run_rank(argv: Sequence[str] | None = None) -> None:
    """Run ``argv`` (``script.py args...`` or ``-m module args...``) as this rank's
    ``__main__`` (in this rank's own SM partition under emulated EP), recording in
    ``$ULTRAEP_RANK_STATUS_DIR/rank<N>`` how it ended; the exception or exit code then goes
    on to ``python -m mpi4py``, which aborts the job."""
    from ultraep.runtime.mps import take_rank_partition

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "?")
    status_dir = os.environ.get(STATUS_DIR_VARIABLE)

    def record(text: str) -> None:
        if status_dir:
            Path(status_dir, f"rank{rank}").write_text(f"{os.getpid()} {text}")

    record("running")
    try:
        take_rank_partition()  # before the script starts CUDA
        if argv[:1] == ["-m"]:
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        record(f"exited with {code or 0}" + ("" if isinstance(exc.code, int) or exc.code is None else f": {exc.code}"))
        raise
    except BaseException as exc:
        record(f"raised {exception_summary(exc)}")
        raise
    record("exited with 0")


def is_verdict(exc: BaseException) -> bool:
    """Whether ``exc`` is a verdict every rank reached alike (bad options refused collectively),
    which ends the job with one line: an error the library raises on every rank, not raised
    while handling anything else. Where some ranks failed first (out of memory, say), the
    ranks' clean-ups then meet in different collectives and raise alike too -- the failure's
    consequence, whose traceback must name the failure. Only what was being handled
    (``__context__``) counts: a verdict's ``__cause__`` is the rank's own part of it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if not (isinstance(exc, UltraEPError) and exc.on_every_rank):
            return False
        seen.add(id(exc))
        exc = exc.__context__
    return True


def exception_summary(exc: BaseException) -> str:
    """``Type: last line of its message``, and where it was raised while handling another
    (a clean-up failing after an out-of-memory error, say), the first of that chain of
    ``__context__`` too: the cause, which the clean-up's error would otherwise hide. A context
    that ``raise ... from None`` hides from the traceback counts too: it was still the error
    being handled."""
    def line(error: BaseException) -> str:
        last = str(error).strip().splitlines()[-1:] or [""]
        return f"{type(error).__name__}: {last[0]}"

    first, seen = exc, {id(exc)}
    while (earlier := first.__context__) is not None and id(earlier) not in seen:
        first = earlier
        seen.add(id(first))
    return line(exc) if first is exc else f"{line(exc)} (raised while handling {line(first)})"


def rank_status(status_dir: str | os.PathLike, rank: int) -> tuple[str, str]:
    """(pid, how it ended) as :func:`run_rank` recorded it for ``rank``; ("?", "never
    started") where nothing was recorded."""
    try:
        pid, _, text = Path(status_dir, f"rank{rank}").read_text().partition(" ")
    except OSError:
        return "?", "never started"
    return pid, text


def rank_report(status_dir: str | os.PathLike, nprocs: int, first_gone: Sequence[int] = ()) -> str:
    """One line per rank of a failed job: how it ended, from the files :func:`run_rank` wrote.
    A rank that left "running" was killed (a signal, ``os._exit`` or the job's abort);
    ``first_gone`` are those that vanished before any other (see :class:`_RankWatcher`)."""
    lines = []
    for rank in range(nprocs):
        pid, text = rank_status(status_dir, rank)
        if text == "running":
            text = ("ended first, without a status (killed by a signal or os._exit)" if rank in first_gone else
                    "ended without a status (killed by a signal, os._exit or the job's abort)")
        lines.append(f"rank {rank} (pid {pid}) {text}")
    return "\n".join(lines)


def all_ranks_exited(status_dir: str | os.PathLike, nprocs: int) -> bool:
    """Whether every rank recorded an exit of its own (none raised, was killed or never
    started): the ranks' output said why, and a line per rank would add nothing."""
    return all(rank_status(status_dir, rank)[1].startswith("exited with ") for rank in range(nprocs))


class _RankWatcher(threading.Thread):
    """Notes which ranks vanish first without a status: the MPI launcher names the first
    process it saw end, often one it killed itself while cleaning up after the real one."""

    def __init__(self, status_dir: str, nprocs: int):
        super().__init__(daemon=True)
        self.status_dir, self.nprocs = status_dir, nprocs
        self.first_gone: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(5e-3) and not self.first_gone:
            running = {}
            for rank in range(self.nprocs):
                pid, text = rank_status(self.status_dir, rank)
                if text == "running":
                    running[rank] = int(pid)
            self.first_gone = [r for r, pid in running.items() if (stat := _proc_stat(pid)) is None or stat[0] == "Z"]


BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def mpi_environment(flavor: str, base: Mapping[str, str] | None = None, ranks: int = 1) -> dict[str, str]:
    """The ranks' environment: ``base`` (default: this process's) with the launcher's settings
    where it has none of its own, BLAS threads included: the cores shared out over ``ranks``
    (each rank's NumPy would otherwise start a spinning thread per core, and the ranks'
    threads would fight over the cores)."""
    env = dict(os.environ if base is None else base)
    threads = str(max(1, len(os.sched_getaffinity(0)) // max(1, ranks)))
    for variable in BLAS_THREAD_VARIABLES:
        env.setdefault(variable, threads)
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
    ``check`` a non-zero exit raises :class:`LaunchError` carrying the output and each
    rank's own exit status. Without ``capture`` the ranks write to this process's stdout
    and stderr as they run (``stdout`` is ""). SIGINT and SIGTERM (turned into SystemExit
    while waiting) kill the job; a job that did not succeed leaves no MPI segment in /dev/shm.
    """
    mpiexec = find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    cmd = mpiexec_command(nprocs, argv, mpiexec=mpiexec, flavor=flavor)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if capture else {}
    segments_before = mpi_segments()
    with tempfile.TemporaryDirectory(prefix="ultraep-ranks-") as status_dir, _sigterm_as_exit():
        proc = subprocess.Popen(cmd, **pipes, text=True, env={**mpi_environment(flavor, env, nprocs),
                                                               STATUS_DIR_VARIABLE: status_dir},
                                cwd=cwd, start_new_session=True)
        watcher = _RankWatcher(status_dir, nprocs)
        watcher.start()
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out = _kill_job(proc, status_dir, segments_before)
            raise LaunchError(f"{' '.join(cmd)} timed out after {timeout:.0f} s; output:\n{out or ''}") from None
        except BaseException:  # Ctrl-C or a SIGTERM turned into SystemExit: the job must not outlive us
            _kill_job(proc, status_dir, segments_before)
            raise
        finally:
            watcher.done.set()
            watcher.join()
        out = out or ""
        if proc.returncode != 0:
            _kill_job(proc, status_dir, segments_before)  # ranks the MPI launcher left behind, and their segments
            report = rank_report(status_dir, nprocs, watcher.first_gone)
            if not capture and not all_ranks_exited(status_dir, nprocs):
                print(f"ultraep: {' '.join(cmd)} exited with {proc.returncode}:\n{report}", file=sys.stderr)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if check and proc.returncode != 0:
        raise LaunchError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{report}\noutput:\n{out}")
    return result


def _kill_job(proc: subprocess.Popen, status_dir: str, segments_before: set[str]) -> str:
    """Kill every process of the job, collect its output, remove the segments it left.

    Hydra starts its proxy and each rank in a session of its own, so the job is found by
    descent from ``mpiexec`` and by the status directory in each rank's environment (a rank
    whose parent died already has been re-parented)."""
    marker = f"{STATUS_DIR_VARIABLE}={status_dir}".encode()
    pids = _job_processes(proc.pid, marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate()
    _wait_gone(pids | _job_processes(proc.pid, marker))
    remove_orphan_segments(segments_before)
    return out or ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _job_processes(root: int, marker: bytes) -> set[int]:
    """``root`` and its live descendants, and every live process whose environment holds ``marker``."""
    parents, found = {}, {root}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (stat := _proc_stat(int(entry.name))) is None or stat[0] == "Z":
            continue
        parents[int(entry.name)] = stat[1]
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            pass
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return found


def _wait_gone(pids: set[int], timeout_s: float = 5.0) -> None:
    """Wait until none of ``pids`` is alive (zombies aside): SIGKILL is asynchronous, and a
    dying rank still maps its segments."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((stat := _proc_stat(pid)) is None or stat[0] == "Z" for pid in pids):
            return
        time.sleep(0.02)


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit while the job runs, so the job is killed on the way out
    (only the main thread may set handlers; elsewhere the default stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def mpi_segments() -> set[str]:
    """Names of the MPI shared-memory segments now in /dev/shm."""
    try:
        return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(MPI_SEGMENT_PREFIXES)}
    except OSError:
        return set()


def mapped_shm_names() -> set[str]:
    """Every /dev/shm file a live process maps (those this process may read: a job's ranks are its own)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            names.update(re.findall(r"/dev/shm/(\S+)", maps.read_text()))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return names


def remove_orphan_segments(before: set[str]) -> list[str]:
    """Remove the MPI segments that appeared since ``before`` and no live process maps (a
    job killed or aborted leaves them); another job's segments are still mapped, older ones
    are not ours. Returns the names removed."""
    new = mpi_segments() - before
    removed = []
    for name in sorted(new - mapped_shm_names() if new else ()):
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed


def relaunch_on_ranks(nprocs: int, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None) -> int:
    """Run ``python -m mpi4py argv`` on ``nprocs`` ranks (``env`` added to this process's
    environment), its output streamed as it comes, and return its exit code (for
    command-line tools that start as one process and need several ranks)."""
    sys.stdout.flush()  # this process's earlier lines before the ranks'
    result = run_mpi(nprocs, argv, timeout=timeout, check=False, env={**os.environ, **(env or {})}, capture=False)
    return result.returncode


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


CPU_OR_GPU = "device: CuPy on the GPU; host: NumPy on the CPU; auto: the GPU when there is one"  # --backend help


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """The tools' --help: each option's default after its help, where it has one worth
    saying (not None or False) and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or not action.option_strings
                or "default" in text.lower()):
            return text
        if isinstance(default, (list, tuple)):  # as typed: --tokens 4096 8192
            shown = " ".join(str(value) for value in default).replace("%", "%%")
            return f"{text} (default: {shown})"
        return f"{text} (default: %(default)s)"


def bounded_type(convert, accept, expected: str):
    """An argparse type: ``convert(text)`` where ``accept`` takes it, else an error saying
    ``expected`` and what was given."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = bounded_type(int, lambda value: value >= 1, "an int >= 1")
non_negative_int = bounded_type(int, lambda value: value >= 0, "an int >= 0")
share = bounded_type(float, lambda value: 0.0 <= value <= 1.0, "a share in [0, 1]")
imbalance_target = bounded_type(float, lambda value: math.isfinite(value) and value >= 1.0,
                                "a number >= 1 (a rank max/mean)")
ROW_ALIGN = 8  # BF16 values in 16 bytes: the grouped GEMM's and the Dispatcher's rows are whole 16-byte chunks
row_width = bounded_type(int, lambda value: value >= 1 and value % ROW_ALIGN == 0,
                         f"a positive multiple of {ROW_ALIGN} (rows of whole 16-byte chunks)")


OUTPUT_OPTIONS = ("json", "plot", "timeline", "out")  # the tools' options naming a file they write
PLOT_OPTIONS = ("plot", "timeline")  # of them, those naming a figure


def output_errors(args) -> list[str]:
    """Why files a tool will write (its ``--json``, ``--plot``, ``--timeline``, ``--out``) cannot
    be written -- a directory, a folder that does not exist or that this process may not
    write -- checked by the tool before any work, so a bad path fails at once, not after a
    run of minutes. (Not an argparse type: a sweep's stored command line is parsed again
    on other machines.)"""
    errors = []
    for option in OUTPUT_OPTIONS:
        text = getattr(args, option, None)
        if not isinstance(text, str):
            continue
        path = Path(text)
        folder = path.parent
        if path.is_dir():
            errors.append(f"--{option} {text}: a directory, not a file to write")
        elif not folder.is_dir():
            errors.append(f"--{option} {text}: folder {str(folder)!r} does not exist")
        else:
            try:  # a file made and removed there: permission bits tell neither root nor /proc
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as exc:
                errors.append(f"--{option} {text}: cannot write in {str(folder)!r} ({exc.strerror})")
        if option in PLOT_OPTIONS and (error := plot_format_error(path)) is not None:
            errors.append(f"--{option} {text}: {error}")
    return errors


# The formats matplotlib's savefig writes (3.10), named by a figure's suffix; listed here
# because the launcher must not import matplotlib (an analysis package).
PLOT_FORMATS = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                "tiff", "webp")


def plot_format_error(path: Path) -> str | None:
    """Why a figure cannot be saved as ``path`` (its suffix names the format), or None."""
    if path.suffix.lstrip(".").lower() in PLOT_FORMATS:
        return None
    what = f"the suffix {path.suffix!r} names no" if path.suffix else "no suffix names its"
    return f"{what} format matplotlib writes ({', '.join('.' + f for f in PLOT_FORMATS)})"


def no_gpu_error(backend: str, emulate_ep) -> str | None:
    """Why a CPU-or-GPU tool cannot run as asked on this machine (``--backend device`` or
    ``--emulate-ep`` without a GPU), or None."""
    from ultraep.runtime.group import gpu_count

    asked = [name for name, wanted in (("--backend device", backend == "device"),
                                       ("--emulate-ep", emulate_ep is not None)) if wanted]
    if asked and gpu_count() == 0:
        return f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''} a CUDA GPU and CuPy; this machine has none"
    return None


def refused(args, tool: str) -> bool:
    """Whether ``tool`` must not start as asked (:func:`output_errors`, :func:`no_gpu_error`);
    the reasons go to stderr, one line each, for the tool to exit 2."""
    reasons = output_errors(args)
    if (error := no_gpu_error(getattr(args, "backend", "auto"), getattr(args, "emulate_ep", None))) is not None:
        reasons.append(error)
    for reason in reasons:
        print(f"{tool}: {reason}", file=sys.stderr)
    return bool(reasons)


def add_launch_options(parser, *, ranks: int = 4, backend_help: str | None = None) -> None:
    """The options every multi-rank tool shares (see :func:`multi_rank_main`): ``--ranks``,
    ``--emulate-ep [SM_PERCENT]`` and, given its help text, ``--backend``."""
    parser.add_argument("--ranks", type=positive_int, default=ranks,
                        help="ranks to launch when started without mpiexec")
    parser.add_argument("--emulate-ep", type=int, nargs="?", const=0, default=None, metavar="SM_PERCENT",
                        help="ranks sharing one GPU run under a private MPS daemon, each with SM_PERCENT %% of the "
                             "SMs (default 100/ranks), so each behaves like a small GPU of its own")
    if backend_help is not None:
        parser.add_argument("--backend", default="auto", choices=["auto", "device", "host"], help=backend_help)


VERDICT_WAIT_S = 10.0  # how long ranks that all refused wait for rank 0 to say why before they exit


def end_job(reason: str, name: str, comm=None):
    """End an MPI job that every rank refuses alike: rank 0 says why once (no traceback),
    the ranks wait a bounded time for each other (in case the refusal was a part of the
    job's) and end without an MPI_Abort (nor its line on every rank); exit 2. ``comm``: the
    communicator of that wait (default ``COMM_WORLD``)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.rank == 0:
        print(f"{name}: {reason}", file=sys.stderr, flush=True)
    everyone, deadline = comm.Ibarrier(), time.monotonic() + VERDICT_WAIT_S
    while not (agreed := everyone.Test()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if agreed:
        MPI.Finalize()
    raise SystemExit(2) from None


class JobArgumentParser(argparse.ArgumentParser):
    """The options of a script that every rank of an MPI job runs (the examples): help, and a
    bad option with the usage, are printed by rank 0 alone; a bad option ends the job
    (:func:`end_job`), as does ``parser.error(reason)`` for any refusal every rank makes."""

    def print_help(self, file=None):
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            super().print_help(file)

    def error(self, message: str):
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            self.print_usage(sys.stderr)
        end_job(f"error: {message}", self.prog)


def tool_name(command: Sequence[str]) -> str:
    """What a tool's messages start with: ``ultraep.bench moe-layer`` for ``-m ultraep.bench
    moe-layer``, the script's name for a script."""
    return " ".join(command[1:]) if command[0] == "-m" else Path(command[-1]).name


def multi_rank_main(argv, parse_args, run, *, nprocs, command: Sequence[str], timeout: float = 580) -> int:
    """Entry point of a tool that needs several ranks: parse ``argv``; under ``mpiexec``
    ``run(args)``, else relaunch ``python -m mpi4py command argv`` on ``nprocs(args)`` ranks,
    under an MPS daemon of its own when ``args.emulate_ep`` is set (:mod:`ultraep.runtime.mps`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, name = parse_args(argv), tool_name(command)
    if launched_by_mpiexec():
        from mpi4py import MPI

        # end_job's wait on a communicator of its own: a rank still in the tool's collectives on
        # COMM_WORLD must not meet that barrier in place of one of them (Open MPI: truncation)
        verdicts = MPI.COMM_WORLD.Dup()
        try:
            return run(args)
        except UltraEPError as exc:
            if not is_verdict(exc):
                raise
            end_job(str(exc), name, verdicts)  # every rank of its group raised this verdict (bad options refused)
    if refused(args, name):
        return 2
    try:
        return _launch(args, argv, nprocs(args), command, timeout, name)
    except LaunchError as exc:  # no mpiexec, or the job timed out: what the ranks did is in the message
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the ranks are stopped on the way out of run_mpi
        print(f"{name}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _launch(args, argv: Sequence[str], ranks: int, command: Sequence[str], timeout: float, name: str) -> int:
    """multi_rank_main's relaunch on ``ranks`` ranks, under an MPS daemon of its own with
    ``args.emulate_ep``."""
    relaunch = [*command, *argv]
    percent = getattr(args, "emulate_ep", None)
    if percent is None:
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout)
    from ultraep.runtime.mps import default_share, share_error, start_emulation

    percent = percent or default_share(ranks)
    if (error := share_error(ranks, percent)) is not None:
        print(f"{name}: --emulate-ep: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the daemon is stopped on the way out
    try:
        daemon = start_emulation(ranks, percent)
    except MPSUnavailable as exc:
        print(f"{name}: --emulate-ep: {exc}; the ranks run time-sliced instead", file=sys.stderr)
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout)
    with daemon:
        return relaunch_on_ranks(ranks, relaunch, timeout=timeout, env=daemon.client_environment(percent))
