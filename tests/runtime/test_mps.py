"""Emulated EP: SM shares, the private MPS daemon's start/stop, the launcher's fallback, labels."""

import os
import sys
import textwrap

import pytest

from ultraep.errors import LaunchError, MPSUnavailable
from ultraep.runtime import group as group_module
from ultraep.runtime import launch, mps

# Stands in for nvidia-cuda-mps-control: "-f" creates the control pipe and runs until a
# "quit" arrives through a second invocation's stdin, as the real daemon does. "-v" reports
# {version}; "-S" is refused when {static} is False; "lspart" answers 16 free chunks of 8
# SMs (an H200's), "sm_partition add" a new partition id. Every invocation is logged.
FAKE_CONTROL = """\
#!{python}
import os, pathlib, sys, time
pipe = pathlib.Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "."))
log = pathlib.Path({log!r})
if sys.argv[1:2] == ["-v"]:
    with log.open("a") as f: f.write("-v\\n")
    print("CUDA MPS Control for Linux/Unix/QNX. Binary version: {version}")
elif sys.argv[1:2] == ["-f"]:
    with log.open("a") as f: f.write(" ".join(sys.argv[1:]) + "\\n")
    if "-S" in sys.argv[2:] and not {static}:
        print("static partitioning is not supported on this device"); sys.exit(1)
    {start}
    while not (pipe / "quit").exists():
        time.sleep(0.01)
    print("daemon quit")
else:
    line = sys.stdin.read().strip()
    with log.open("a") as f: f.write(line + "\\n")
    made = pipe / "partitions"
    count = len(made.read_text().split()) if made.exists() else 0
    if line == "quit":
        (pipe / "quit").touch()
    elif line == "lspart":
        print("GPU                Partition   free   used   free  used  clients")
        print("                               chunk  chunk  SM    SM")
        print(f"GPU-5c1f0a2e  -  {{16 - 4 * count}}  {{4 * count}}  {{128 - 32 * count}}  {{32 * count}}  -")
    elif line.startswith("sm_partition add "):
        name = f"{{line.split()[2]}}/Dx{{count}}AAAAAAAA+b="
        made.write_text((made.read_text() if made.exists() else "") + name + "\\n")
        print(f"Partition {{name}} created")
"""
GPU_UUID = "GPU-5c1f0a2e-0000-1111-2222-333344445555"


def fake_control(tmp_path, monkeypatch, start="(pipe / 'control').touch()", static=True, version=13010):
    """A fake daemon on the PATH (and a fake nvidia-smi naming the GPU); returns the file
    that logs every daemon start and every command sent to it."""
    log = tmp_path / "control.log"
    script = tmp_path / mps.CONTROL
    script.write_text(textwrap.dedent(FAKE_CONTROL).format(python=sys.executable, start=start, static=static,
                                                            version=version, log=str(log)))
    script.chmod(0o755)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {GPU_UUID}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return log


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


def no_green_contexts(ranks, percent, environment):
    raise mps.StaticPartitionsUnavailable("no green contexts: not in this test")


def run_emulated(monkeypatch, argv, ranks=4, gpus=1):
    """multi_rank_main with the relaunch replaced by a record of its environment, on a
    machine that has ``gpus`` GPUs."""
    relaunched = []
    monkeypatch.setattr(mps, "green_sms", no_green_contexts)  # the same fallbacks on a machine that has them
    monkeypatch.setattr(launch, "launched_by_mpiexec", lambda: False)
    monkeypatch.setattr(group_module, "gpu_count", lambda: gpus)
    monkeypatch.setattr(launch, "relaunch_on_ranks",
                        lambda n, args, *, timeout, env=None: relaunched.append((n, env or {})) or 0)

    def parse(argv):
        import argparse
        parser = argparse.ArgumentParser()
        launch.add_launch_options(parser)
        return parser.parse_args(argv)

    code = launch.multi_rank_main(argv, parse, run=None, nprocs=lambda args: ranks, command=["-m", "tool"])
    return code, relaunched


def test_launcher_gives_each_rank_a_static_partition_of_the_default_share(tmp_path, monkeypatch, capsys):
    log = fake_control(tmp_path, monkeypatch)
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep"])
    assert code == 0 and relaunched[0][0] == 4
    env = relaunched[0][1]
    names = env[mps.PARTITIONS_VARIABLE].split(",")
    assert names == [f"{GPU_UUID}/Dx{i}AAAAAAAA+b=" for i in range(4)]
    assert env[mps.SMS_PER_RANK_VARIABLE] == "32" and env[mps.EMULATION_VARIABLE] == "mps:25"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # ignored under -S; the partition is the share
    assert log.read_text().splitlines() == ["-v", "-f -S", "lspart", *[f"sm_partition add {GPU_UUID} 4"] * 4,
                                            "quit"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("version, static, commands, why", [
    (13000, True, ["-v", "-f", "quit"], "reports version 13000; static SM partitions need 13010 or later"),
    (13010, False, ["-v", "-f -S", "-f", "quit"], "not supported on this device")])
def test_launcher_falls_back_to_the_thread_percentage_without_static_partitions(
        tmp_path, monkeypatch, capsys, version, static, commands, why):
    log = fake_control(tmp_path, monkeypatch, static=static, version=version)
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep"])
    env = relaunched[0][1]
    assert code == 0 and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and mps.PARTITIONS_VARIABLE not in env
    assert log.read_text().splitlines() == commands
    err = capsys.readouterr().err
    assert "no static SM partitions" in err and why in err and "may overlap" in err


@pytest.mark.parametrize("ranks, percent, chunks", [(4, 25, 4), (8, 12, 2), (3, 33, 5), (2, 10, 2), (1, 100, 16)])
def test_partition_chunks_round_to_whole_chunks_never_past_an_even_split(ranks, percent, chunks):
    assert mps.partition_chunks(ranks, percent, 16) == chunks


def test_a_share_under_one_chunk_falls_back_to_the_thread_percentage(tmp_path, monkeypatch, capsys):
    log = fake_control(tmp_path, monkeypatch)
    with pytest.raises(mps.StaticPartitionsUnavailable, match="less than one chunk"):
        mps.partition_chunks(16, 2, 16)
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep", "2"], ranks=16)
    assert code == 0 and relaunched[0][1]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "2"
    assert "sm_partition add" not in log.read_text() and "less than one chunk" in capsys.readouterr().err


def test_lspart_without_free_chunks_is_refused():
    with pytest.raises(mps.StaticPartitionsUnavailable, match="no free SM chunks"):
        mps.free_chunks_and_sms("GPU  Partition free used free used clients\nGPU-5c1f  -  0  16  0  128  -\n")


def test_each_rank_takes_its_own_partition():
    names = "GPU-a/Dx0,GPU-a/Dx1,GPU-a/Dx2"
    for variable in mps.LOCAL_RANK_VARIABLES:
        environ = {mps.PARTITIONS_VARIABLE: names, variable: "1"}
        mps.take_rank_partition(environ)
        assert environ[mps.PARTITION_VARIABLE] == "GPU-a/Dx1"
    untouched = {"OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    mps.take_rank_partition(untouched)
    assert mps.PARTITION_VARIABLE not in untouched
    with pytest.raises(LaunchError, match="holds 3 SM partitions but this rank's local rank is 3"):
        mps.take_rank_partition({mps.PARTITIONS_VARIABLE: names, "MPI_LOCALRANKID": "3"})
    with pytest.raises(LaunchError, match="local rank is None"):
        mps.take_rank_partition({mps.PARTITIONS_VARIABLE: names})


def test_run_rank_sets_the_partition_before_the_script_runs(tmp_path, monkeypatch):
    script = tmp_path / "show.py"
    script.write_text("import os; print('partition', os.environ['CUDA_MPS_SM_PARTITION'])")
    monkeypatch.setenv(mps.PARTITIONS_VARIABLE, "GPU-a/Dx0,GPU-a/Dx1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv(mps.PARTITION_VARIABLE, "to be replaced")  # and removed again after the test
    launch.run_rank([str(script)])
    assert os.environ[mps.PARTITION_VARIABLE] == "GPU-a/Dx1"


def test_launcher_refuses_a_share_that_does_not_fit(monkeypatch, capsys):
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep", "30"])
    assert code == 2 and not relaunched and "do not fit one GPU" in capsys.readouterr().err


def test_launcher_refuses_emulation_without_a_gpu(monkeypatch, capsys):
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep"], gpus=0)
    assert code == 2 and not relaunched
    assert "tool: --emulate-ep needs a CUDA GPU and CuPy; this machine has none" in capsys.readouterr().err


def test_launcher_falls_back_to_time_sliced_when_mps_cannot_start(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, relaunched = run_emulated(monkeypatch, ["--emulate-ep", "25"])
    assert code == 0 and relaunched == [(4, {})]
    assert "time-sliced instead" in capsys.readouterr().err


class FakeGroup:
    def __init__(self, placements, rank=0):
        self.placements, self.hostname, self.device = placements, placements[rank][0], placements[rank][1]

    def allgather(self, _, what=None):
        return list(self.placements)


def test_sharing_label(monkeypatch):
    from ultraep.runtime import group
    monkeypatch.setattr(group, "gpu_identity", lambda g: None if g.device is None else (g.hostname, g.device))
    monkeypatch.delenv(mps.EMULATION_VARIABLE, raising=False)
    assert mps.sharing_label(FakeGroup([("h", None)] * 2)).startswith("host backend")
    assert mps.sharing_label(FakeGroup([("h", 0), ("h", 1)])) == "one GPU per rank"
    assert "time-sliced" in mps.sharing_label(FakeGroup([("h", 0)] * 4))
    monkeypatch.setenv(mps.EMULATION_VARIABLE, "mps:25")
    assert (mps.sharing_label(FakeGroup([("h", 0)] * 4))
            == "MPS, 25 % of SMs per rank (shares may overlap; 4 ranks per GPU)")
    monkeypatch.setenv(mps.SMS_PER_RANK_VARIABLE, "32")
    assert mps.sharing_label(FakeGroup([("h", 0)] * 4)) == "MPS static partition, 32 SMs per rank (4 ranks per GPU)"


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
