"""The launcher: flags for each MPI flavor, and a hung job killed at its timeout."""

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ultraep.runtime import launch


def test_openmpi_command_oversubscribes_and_allows_root(monkeypatch):
    monkeypatch.setattr(launch.os, "geteuid", lambda: 0)
    cmd = launch.mpiexec_command(4, ["x.py"], mpiexec="/usr/bin/mpirun", flavor="openmpi")
    assert cmd[:3] == ["/usr/bin/mpirun", "-n", "4"]
    assert "--oversubscribe" in cmd and "--allow-run-as-root" in cmd
    assert cmd[-6:] == [sys.executable, "-m", "mpi4py", "-c", launch.RANK_MAIN, "x.py"]


def test_mpich_command_has_no_openmpi_flags():
    cmd = launch.mpiexec_command(2, ["x.py", "a"], mpiexec="mpiexec", flavor="mpich")
    assert cmd == ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-c", launch.RANK_MAIN, "x.py", "a"]
    assert launch.mpi_environment("mpich", {})["HYDRA_LAUNCHER"] == "fork"


def test_the_ranks_share_the_cores_out_as_blas_threads(monkeypatch):
    """Each rank's NumPy would start a spinning BLAS thread per core, so the ranks' threads
    would fight over the cores; a count the user set is kept."""
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    env = launch.mpi_environment("mpich", {}, ranks=4)
    assert all(env[variable] == "2" for variable in launch.BLAS_THREAD_VARIABLES)
    assert launch.mpi_environment("mpich", {}, ranks=16)["OPENBLAS_NUM_THREADS"] == "1"
    assert launch.mpi_environment("mpich", {"OMP_NUM_THREADS": "3"}, ranks=4)["OMP_NUM_THREADS"] == "3"  # the user's


def test_rejects_zero_ranks():
    with pytest.raises(ValueError, match="nprocs"):
        launch.mpiexec_command(0, ["x.py"], mpiexec="m", flavor="mpich")


def test_output_files_are_checked_before_any_work(tmp_path):
    ok = argparse.Namespace(json=str(tmp_path / "r.json"), plot=None, quiet=True)
    assert launch.output_errors(ok) == [] and not list(tmp_path.iterdir())  # the probe file is gone
    bad = argparse.Namespace(json=str(tmp_path), plot=str(tmp_path / "none" / "r.png"), timeline="/proc/t.png")
    assert launch.output_errors(bad) == [f"--json {tmp_path}: a directory, not a file to write",
                                         f"--plot {tmp_path}/none/r.png: folder '{tmp_path}/none' does not exist",
                                         "--timeline /proc/t.png: cannot write in '/proc' (No such file or directory)"]
    # a figure's suffix names its format: one matplotlib cannot write fails now, not after the run
    wrong = argparse.Namespace(json=str(tmp_path / "r.txt"), plot=str(tmp_path / "p.txt"), timeline=str(tmp_path / "t"))
    errors = launch.output_errors(wrong)
    assert [e.split(": ")[0] for e in errors] == [f"--plot {tmp_path}/p.txt", f"--timeline {tmp_path}/t"]
    assert "the suffix '.txt' names no format matplotlib writes (" in errors[0] and ".png" in errors[0]
    assert "no suffix names its format matplotlib writes (" in errors[1]
    right = argparse.Namespace(plot=str(tmp_path / "p.PDF"), timeline=str(tmp_path / "t.svg"))
    assert launch.output_errors(right) == []


def test_gpu_options_are_refused_by_name_without_a_gpu(monkeypatch):
    from ultraep.runtime import group

    monkeypatch.setattr(group, "gpu_count", lambda: 0)
    assert launch.no_gpu_error("host", None) is None and launch.no_gpu_error("auto", None) is None
    assert launch.no_gpu_error("device", 0) == ("--backend device and --emulate-ep need a CUDA GPU and CuPy; "
                                                 "this machine has none")
    monkeypatch.setattr(group, "gpu_count", lambda: 1)
    assert launch.no_gpu_error("device", 25) is None


def test_this_machine_mpi_is_detected():
    assert launch.mpi_flavor(launch.find_mpiexec()) in ("mpich", "openmpi")


@pytest.mark.mpi
def test_hung_rank_is_killed_at_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("from mpi4py import MPI\nimport time\n"
                      "if MPI.COMM_WORLD.rank == 1:\n    time.sleep(600)\nMPI.COMM_WORLD.Barrier()\n")
    start = time.monotonic()
    with pytest.raises(launch.LaunchError, match="timed out"):
        launch.run_mpi(2, [str(script)], timeout=5)
    assert time.monotonic() - start < 60


@pytest.mark.mpi
def test_failing_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1:\n    raise SystemExit('rank 1 gives up')\n"
                      "MPI.COMM_WORLD.Barrier()\n")
    with pytest.raises(launch.LaunchError, match="exited with"):
        launch.run_mpi(2, [str(script)], timeout=60)


@pytest.mark.mpi
def test_each_rank_exit_status_is_reported(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1:\n    sys.exit(5)\n"
                      "MPI.COMM_WORLD.Barrier()\n")
    with pytest.raises(launch.LaunchError, match=r"rank 1 \(pid \d+\) exited with 5\n"):
        launch.run_mpi(3, [str(script)], timeout=60)


@pytest.mark.mpi
def test_sigterm_kills_the_whole_job(tmp_path):
    """Hydra puts its proxy and each rank in sessions of their own: a SIGTERM to the launcher
    must still end every one of them."""
    token = f"sleeper-{uuid.uuid4().hex}"
    script = tmp_path / "sleep.py"
    script.write_text("import time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                      "if MPI.COMM_WORLD.rank == 0:\n    print('started', flush=True)\n"
                      "time.sleep(600)\n")
    code = (f"from ultraep.runtime.launch import run_mpi\nrun_mpi(2, [{str(script)!r}, {token!r}], timeout=300, "
            "capture=False)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "started"
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if _reads(p) and token.encode() in _reads(p)]
    assert left == [], "processes of the job outlived the launcher"


def _reads(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["verdict", "checked", "lone", "after a failure"])
def test_a_verdict_of_every_rank_is_said_once_without_tracebacks(tmp_path, case):
    """A multi-rank tool whose ranks all raise the library's verdict on its options (bad
    sizes the set-up refused collectively): one line from rank 0, exit 2, no traceback. A
    lone rank's error keeps its traceback (it may be a bug), and so does an every-rank error
    raised while handling another (ranks' clean-ups meeting in different collectives after
    some ran out of memory): the traceback names the first error. "checked": the verdict of a
    collective check, raised from each rank's own error, as the library's set-up checks do."""
    script = tmp_path / "tool.py"
    script.write_text(
        "import argparse, sys\n"
        "from ultraep.errors import MoELayerError, everywhere\n"
        "from ultraep.runtime.launch import multi_rank_main\n"
        "def run(args):\n"
        "    from mpi4py import MPI\n"
        "    error = MoELayerError('hidden (7) must be a multiple of 8')\n"
        f"    if {case == 'lone'}:\n"
        "        if MPI.COMM_WORLD.rank == 1:\n"
        "            raise error\n"
        "        MPI.COMM_WORLD.Barrier()\n"
        f"    if {case == 'checked'}:\n"
        "        from ultraep.runtime.group import EPGroup\n"
        "        try:\n"
        "            raise ValueError('hidden (7) must be a multiple of 8')\n"
        "        except ValueError as exc:\n"
        "            local = exc\n"
        "        EPGroup(MPI.COMM_WORLD, use_gpu=False).raise_if_any(local, 'layer set-up')\n"
        f"    if {case == 'after a failure'}:\n"
        "        try:\n"
        "            raise MemoryError('injected: out of memory')\n"
        "        except MemoryError as exc:\n"
        "            raise everywhere(error) from exc\n"
        "    raise everywhere(error)\n"
        "sys.exit(multi_rank_main(None, lambda argv: argparse.Namespace(), run, nprocs=lambda args: 2,\n"
        "                         command=['tool.py']))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "tool.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    if case == "lone":
        assert done.returncode != 0 and "Traceback" in done.stderr
    elif case == "after a failure":
        assert done.returncode not in (0, 2) and "MemoryError: injected: out of memory" in done.stderr, done.stderr
        assert "raised while handling MemoryError: injected: out of memory" in done.stderr, done.stderr
    else:
        assert done.returncode == 2, done.stderr
        said = "tool.py: hidden (7) must be a multiple of 8" if case == "verdict" else "tool.py: layer set-up failed"
        assert done.stderr.count(said) == 1, done.stderr
        assert "Traceback" not in done.stderr
        assert "(pid " not in done.stderr, done.stderr  # every rank exited on its own: no line per rank
        if launch.mpi_flavor(launch.find_mpiexec()) == "mpich":  # the job ended without MPI_Abort's line
            assert "MPI_Abort" not in done.stderr, done.stderr


def test_help_gives_the_defaults_worth_saying():
    parser = argparse.ArgumentParser(formatter_class=launch.DefaultsHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument("--tokens", nargs="+", default=[4096, 8192], help="tokens per rank")
    parser.add_argument("--json", help="a file")
    parser.add_argument("--quiet", action="store_true", help="no lines")
    parser.add_argument("--domain", type=int, help="domain size (default: all ranks)")
    text = " ".join(parser.format_help().split())
    assert "seed (default: 0)" in text and "tokens per rank (default: 4096 8192)" in text
    assert "a file (default" not in text and "no lines (default" not in text
    assert text.count("(default: all ranks)") == 1 and "(default: None)" not in text


def test_bounded_types_name_what_they_expect():
    assert launch.positive_int("3") == 3 and launch.non_negative_int("0") == 0
    assert launch.imbalance_target("1.5") == 1.5
    for parse, text, expected in ((launch.positive_int, "0", "an int >= 1"),
                                  (launch.non_negative_int, "x", "an int >= 0"),
                                  (launch.imbalance_target, "nan", "a number >= 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected {expected}.*got '{text}'"):
            parse(text)


def test_a_rank_status_names_the_first_error_of_a_chain():
    """A clean-up that fails after the real error (heap close after an out-of-memory) must not
    hide it in the per-rank report, not even behind a ``raise ... from None`` on the way."""
    def chained():
        try:
            try:
                raise MemoryError("out of memory allocating 406,876,160 bytes")
            except MemoryError:
                raise RuntimeError("close: collective mismatch\nheap close timed out") from None
        except RuntimeError as closing:
            raise ValueError("MPI_ERR_TRUNCATE: message truncated") from closing

    with pytest.raises(ValueError) as caught:
        chained()
    assert launch.exception_summary(caught.value) == (
        "ValueError: MPI_ERR_TRUNCATE: message truncated (raised while handling MemoryError: out of memory "
        "allocating 406,876,160 bytes)")
    alone = KeyError("slot")
    assert launch.exception_summary(alone) == "KeyError: 'slot'"
