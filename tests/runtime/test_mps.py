"""Emulated EP: SM shares, the private MPS daemon's start/stop, the launcher's fallback, labels."""

import os
import sys
import textwrap

import pytest

from ultraep.errors import MPSUnavailable
from ultraep.runtime import launch, mps

# Stands in for nvidia-cuda-mps-control: "-f" creates the control pipe and runs until a
# "quit" arrives through a second invocation's stdin, as the real daemon does.
FAKE_CONTROL = """\
#!{python}
import os, pathlib, sys, time
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if sys.argv[1:] == ["-f"]:
    {start}
    while not (pipe / "quit").exists():
        time.sleep(0.01)
    print("daemon quit")
else:
    if sys.stdin.read().strip() == "quit":
        (pipe / "quit").touch()
"""


def fake_control(tmp_path, monkeypatch, start="(pipe / 'control').touch()"):
    script = tmp_path / mps.CONTROL
    script.write_text(textwrap.dedent(FAKE_CONTROL).format(python=sys.executable, start=start))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("ranks, percent, fits", [(4, 25, True), (8, 12, True), (3, 33, True), (4, 26, False),
                                                  (1, 100, True), (2, 0, False), (2, 101, False)])
def test_share_error(ranks, percent, fits):
    assert (mps.share_error(ranks, percent) is None) == fits
    assert mps.share_error(ranks, mps.default_share(ranks)) is None


def test_daemon_starts_gives_client_environment_and_stops(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch)
    with mps.MPSDaemon() as daemon:
        env = daemon.client_environment(25)
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.exists(os.path.join(pipe, "control"))
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env[mps.EMULATION_VARIABLE] == "mps:25"
    assert not os.path.exists(pipe)  # stopped, its directories removed


def test_daemon_that_dies_reports_its_words(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch, start="print('no GPU for MPS'); sys.exit(1)")
    with pytest.raises(MPSUnavailable, match="no GPU for MPS"):
        mps.MPSDaemon(start_timeout_s=10).start()


def test_missing_control_program(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MPSUnavailable, match="not on the PATH"):
        mps.MPSDaemon().start()


def run_emulated(monkeypatch, argv, ranks=4):
    """multi_rank_main with the relaunch replaced by a record of its environment."""
    relaunched = []
    monkeypatch.setattr(launch, "launched_by_mpiexec", lambda: False)
    monkeypatch.setattr(launch, "relaunch_on_ranks",
                        lambda n, args, *, timeout, env=None: relaunched.append((n, env or {})) or 0)

    def parse(argv):
        import argparse
        parser = argparse.ArgumentParser()
        launch.add_launch_options(parser)
        return parser.parse_args(argv)

    code = launch.multi_rank_main(argv, parse, run=None, nprocs=lambda args: ranks, command=["-m", "tool"])
    return code, relaunched


def test_launcher_runs_ranks_under_the_daemon_with_the_default_share(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch)
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep"])
    assert code == 0 and relaunched[0][0] == 4 and relaunched[0][1]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_launcher_refuses_a_share_that_does_not_fit(monkeypatch, capsys):
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep", "30"])
    assert code == 2 and not relaunched and "do not fit one GPU" in capsys.readouterr().err


def test_launcher_falls_back_to_time_sliced_when_mps_cannot_start(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep", "25"])
    assert code == 0 and relaunched == [(4, {})]
    assert "time-sliced instead" in capsys.readouterr().err


class FakeGroup:
    def __init__(self, placements, rank=0):
        self.placements, self.hostname, self.device = placements, placements[rank][0], placements[rank][1]

    def allgather(self, _):
        return list(self.placements)


def test_sharing_label(monkeypatch):
    from ultraep.runtime import group
    monkeypatch.setattr(group, "gpu_identity", lambda g: None if g.device is None else (g.hostname, g.device))
    monkeypatch.delenv(mps.EMULATION_VARIABLE, raising=False)
    assert mps.sharing_label(FakeGroup([("h", None)] * 2)).startswith("host backend")
    assert mps.sharing_label(FakeGroup([("h", 0), ("h", 1)])) == "one GPU per rank"
    assert "time-sliced" in mps.sharing_label(FakeGroup([("h", 0)] * 4))
    monkeypatch.setenv(mps.EMULATION_VARIABLE, "mps:25")
    assert mps.sharing_label(FakeGroup([("h", 0)] * 4)) == "MPS, 25 % of SMs per rank (4 ranks per GPU)"


def test_command_line_runs_a_command_under_the_daemon(tmp_path, monkeypatch, capfd):
    fake_control(tmp_path, monkeypatch)
    code = mps.main(["--percent", "25", "--", sys.executable, "-c",
                     "import os; print('share', os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'])"])
    assert code == 0 and "share 25" in capfd.readouterr().out


def test_command_line_without_mps_exits_3(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert mps.main(["--", "true"]) == 3 and "not on the PATH" in capsys.readouterr().err


def test_sigterm_stops_the_command_and_the_daemon(tmp_path, monkeypatch):
    import signal
    import subprocess
    import time

    fake_control(tmp_path, monkeypatch)
    marker = tmp_path / "pipe-dir"
    child = subprocess.Popen([sys.executable, "-m", "ultraep.runtime.mps", "--", sys.executable, "-c",
                              f"import os, time; open({str(marker)!r}, 'w').write("
                              "os.environ['CUDA_MPS_PIPE_DIRECTORY']); "
                              "time.sleep(60)"])
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=20) == 128 + signal.SIGTERM
    assert not os.path.exists(marker.read_text())  # the daemon was told to quit and its directories removed
