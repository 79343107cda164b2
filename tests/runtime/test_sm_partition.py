"""Green contexts for emulated EP: the group size, the command-line check, the launcher's
choice of them, and on a GPU that the ranks' SMs are their own."""

import ctypes
import shutil
import subprocess

import pytest

from tests.conftest import assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.errors import MPSUnavailable
from ultraep.runtime import mps, sm_partition


def test_the_resource_struct_has_cuda_h_layout():
    assert ctypes.sizeof(sm_partition._DevResource) == 144 and sm_partition._DevResource.sm.offset == 96


@pytest.mark.parametrize("total, ranks, percent, unit, smallest, size", [
    (132, 4, 25, 1, 1, 33), (132, 4, 25, 2, 2, 32), (132, 8, 12, 1, 1, 16), (132, 8, 12, 8, 8, 16),
    (132, 3, 33, 1, 1, 44), (132, 2, 10, 1, 1, 13), (132, 16, 6, 8, 8, 8), (132, 32, 3, 8, 8, 8),
    (132, 4, 25, 0, 1, 33)])
def test_group_size_is_the_nearest_share_in_whole_units_never_past_an_even_split(
        total, ranks, percent, unit, smallest, size):
    assert sm_partition.group_size(total, ranks, percent, unit, smallest) == size


def test_usable_sms_is_the_green_contexts_once_entered(monkeypatch):
    monkeypatch.setattr(sm_partition, "_rank_sms", {0: 32})
    assert sm_partition.usable_sms(0) == 32


def test_a_rank_enters_its_green_context_once(monkeypatch):
    def split(*args):
        raise AssertionError("a second green context was made")

    monkeypatch.setattr(sm_partition, "_rank_sms", {0: 32})
    monkeypatch.setattr(sm_partition, "split", split)
    assert sm_partition.enter(0, 0, 2, 50) == 32  # a sub-group's EPGroup: local rank 0 of its own communicator


def test_no_green_context_outside_an_emulated_job(monkeypatch):
    monkeypatch.delenv(sm_partition.GREEN_VARIABLE, raising=False)
    assert sm_partition.enter_from_environment(0, 1) is None


def test_a_driver_that_cannot_load_is_named(monkeypatch, capsys):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    for name in mps.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sm_partition, "_driver", None)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert sm_partition.main(["4", "25"]) == 1
    assert "the CUDA driver library could not be loaded: libcuda.so.1" in capsys.readouterr().err
    monkeypatch.setenv(sm_partition.GREEN_VARIABLE, "4:25")
    with pytest.raises(sm_partition.SMPartitionError, match="local rank 2: its own SMs of GPU 0"):
        sm_partition.enter_from_environment(0, 2)


def test_the_launchers_local_rank_names_the_group(monkeypatch):
    monkeypatch.setattr(sm_partition, "_rank_sms", {})
    monkeypatch.setattr(sm_partition, "split", lambda *args: ([sm_partition._DevResource()] * 4, 132))
    monkeypatch.setenv(sm_partition.GREEN_VARIABLE, "4:25")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")  # the job's own numbering, not the group's (1)
    with pytest.raises(sm_partition.SMPartitionError, match="local rank 5 has no group of its own among 4"):
        sm_partition.enter_from_environment(0, 1)
    monkeypatch.setenv(sm_partition.GREEN_VARIABLE, "4")
    with pytest.raises(sm_partition.SMPartitionError, match="expected RANKS:PERCENT"):
        sm_partition.enter_from_environment(0, 1)


def test_command_line_usage(capsys):
    assert sm_partition.main(["4"]) == 2 and "usage" in capsys.readouterr().err


@pytest.fixture
def no_static(tmp_path, monkeypatch):
    """A fake MPS daemon too old for static partitions (tests/runtime/test_mps.py)."""
    from tests.runtime.test_mps import fake_control

    fake_control(tmp_path, monkeypatch, version=13000)
    monkeypatch.delenv(mps.SHARES_VARIABLE, raising=False)


def test_green_contexts_come_before_the_thread_percentage(no_static, monkeypatch, capsys):
    checked = []
    monkeypatch.setattr(mps, "green_sms", lambda ranks, percent, environment: checked.append(environment) or 32)
    with mps.start_emulation(4, 25) as daemon:
        env = daemon.client_environment(25)
    assert checked[0]["CUDA_MPS_PIPE_DIRECTORY"] == env["CUDA_MPS_PIPE_DIRECTORY"]  # checked under the started daemon
    assert env[sm_partition.GREEN_VARIABLE] == "4:25" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert env[mps.EMULATION_VARIABLE] == "mps:25"
    err = capsys.readouterr().err
    assert "no static SM partitions" in err and "reports version 13000" in err and "32 SMs of its own" in err


def test_without_green_contexts_the_thread_percentage_says_why(no_static, monkeypatch, capsys):
    def refuse(ranks, percent, environment):
        raise mps.StaticPartitionsUnavailable("no green contexts: the driver is CUDA 12020")

    monkeypatch.setattr(mps, "green_sms", refuse)
    with mps.start_emulation(4, 25) as daemon:
        env = daemon.client_environment(25)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and sm_partition.GREEN_VARIABLE not in env
    err = capsys.readouterr().err
    assert "the driver is CUDA 12020" in err and "may overlap" in err


@pytest.mark.parametrize("code, out, err, result", [
    (0, "32 32 32 32 132\n", "", 32), (0, "", "", "not SM counts"), (1, "", "the driver is CUDA 12020", "CUDA 12020")])
def test_the_green_check_is_read_or_refused(monkeypatch, code, out, err, result):
    ran = []

    def run(command, **kwargs):
        ran.append((command, kwargs["env"]))
        return subprocess.CompletedProcess(command, code, out, err)

    monkeypatch.setattr(mps.subprocess, "run", run)
    if isinstance(result, int):
        assert mps.green_sms(4, 25, {"CUDA_MPS_PIPE_DIRECTORY": "/pipe"}) == result
    else:
        with pytest.raises(mps.StaticPartitionsUnavailable, match=result):
            mps.green_sms(4, 25, {"CUDA_MPS_PIPE_DIRECTORY": "/pipe"})
    command, env = ran[0]
    assert command[-3:] == ["ultraep.runtime.sm_partition", "4", "25"] and env["CUDA_MPS_PIPE_DIRECTORY"] == "/pipe"


def test_one_way_asked_for_alone(no_static, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(mps, "green_sms", lambda ranks, percent, environment: asked.append(ranks) or 32)
    monkeypatch.setenv(mps.SHARES_VARIABLE, "percent")
    with mps.start_emulation(4, 25) as daemon:
        env = daemon.client_environment(25)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and not asked and capsys.readouterr().err == ""
    monkeypatch.setenv(mps.SHARES_VARIABLE, "static")
    with pytest.raises(MPSUnavailable, match="ULTRAEP_EP_SHARES=static: no static SM partitions"):
        mps.start_emulation(4, 25)
    monkeypatch.setenv(mps.SHARES_VARIABLE, "even")
    with pytest.raises(MPSUnavailable, match="must be one of static, green, percent"):
        mps.start_emulation(4, 25)


def test_sharing_label_names_the_green_context(monkeypatch):
    from tests.runtime.test_mps import FakeGroup
    from ultraep.runtime import group

    monkeypatch.setattr(group, "gpu_identity", lambda g: (g.hostname, g.device))
    monkeypatch.setattr(sm_partition, "_rank_sms", {0: 32})
    monkeypatch.delenv(mps.SMS_PER_RANK_VARIABLE, raising=False)
    monkeypatch.setenv(mps.EMULATION_VARIABLE, "mps:25")
    monkeypatch.setenv(sm_partition.GREEN_VARIABLE, "4:25")
    assert (mps.sharing_label(FakeGroup([("h", 0)] * 4))
            == "MPS, a green context of 32 SMs per rank, disjoint (4 ranks per GPU)")


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_each_rank_runs_on_sms_of_its_own(monkeypatch):
    if shutil.which(mps.CONTROL) is None:
        pytest.skip(f"no {mps.CONTROL} here: GPU test not run")
    monkeypatch.setenv(mps.SHARES_VARIABLE, "green")
    with mps.start_emulation(2, 50) as daemon:  # a daemon or a green context that fails here fails the test
        output = run_ranks(2, "runtime/mpi/sm_partition_check.py", timeout=180, env=daemon.client_environment(50))
    assert_all_ranks_ok(output, 2, "sm_partition")
