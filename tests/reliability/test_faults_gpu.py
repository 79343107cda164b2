"""The GPU half of the fault suite: 2 ranks, WeightTransfer on the device (needs a GPU).

A plan that differs on one rank is refused on every rank at synchronize within the timeout;
a rank that refuses alone on the host (an unregistered layer) leaves the other a device-side
timeout naming it;
a rank that stops answering before ``weight_sync`` (its host asleep) or inside it (its
stream held by a long kernel) ends the job within the timeout plus 10 s, the other rank
showing the device-side agreement timeout that names it; views and device calls after the
heap's close refuse instead of faulting. Nothing of the job may remain afterwards."""

from __future__ import annotations

import re
import time

import pytest

from tests.conftest import MPI_SCRIPTS, assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.runtime import launch

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.mpi]

TIMEOUT_S = 3.0
SCRIPT = "reliability/mpi/device_fault_check.py"
JOB_TIMEOUT_S = 300  # the script first compiles its kernels: tens of seconds per file on a cold cache


@pytest.mark.parametrize("kind", ["disagree", "closed", "lone"])
def test_refused_on_every_rank(kind):
    out = run_ranks(2, SCRIPT, kind, str(TIMEOUT_S), timeout=JOB_TIMEOUT_S)
    assert_all_ranks_ok(out, 2, kind)
    if kind == "disagree":
        assert out.count("got GroupMismatchError: ranks disagree on weight_sync(0)") == 2, out


@pytest.mark.parametrize("kind", ["sleep", "stall"])
def test_silent_rank_ends_the_job(kind):
    segments_before = launch.mpi_segments()
    with pytest.raises(launch.LaunchError) as failed:
        launch.run_mpi(2, [str(MPI_SCRIPTS / SCRIPT), kind, str(TIMEOUT_S)], timeout=JOB_TIMEOUT_S)
    ended = time.time()
    message = str(failed.value)
    injected = re.search(r"\[fault\] (\d+\.\d+) rank 1", message)
    assert injected, f"the fault was not injected:\n{message}"
    took = ended - float(injected.group(1))
    assert took < TIMEOUT_S + 10, f"job ended {took:.1f} s after the fault:\n{message}"
    assert re.search(r"rank 0 got WaitTimeout: rank 0: weight_sync\(0\) plan agreement timed out after 3 s "
                     r"waiting for rank 1", message), message
    assert f"[{kind}] rank" not in message  # no rank went on
    leaked = launch.mpi_segments() - segments_before - launch.mapped_shm_names()
    assert not leaked, f"segments left in /dev/shm: {leaked}"
