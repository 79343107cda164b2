"""Fault injection on 4 CPU ranks: one rank raises, exits, is killed or stops answering just
before a phase of a Balancer + Dispatcher step. The job must end within 10 s of the fault (a
rank that stops answering: the configured timeout plus 10 s), its output must carry the
original exception or exit status, and no process or /dev/shm segment of it may remain. A
rank that raises must end the job before even the failing teardown's short grace period."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import MPI_SCRIPTS
from ultraep.runtime import launch
from ultraep.runtime.heap import FAILING_CLOSE_TIMEOUT_S

# The group's, Balancer's and Dispatcher's timeout in the script: short where a rank stops
# answering; long otherwise, so a job that only ends by some rank's timeout fails the bound.
SILENT_TIMEOUT_S, FAILING_TIMEOUT_S = 3.0, 30.0
PHASES = ["update", "weight_sync", "dispatch", "combine", "reduce_grads", "close"]
# Every phase where the library must react (a raise, a silent rank); exits and kills end
# the job through the MPI launcher whatever the phase, so two phases each suffice.
CASES = ([("raise", p) for p in PHASES] + [("sleep", p) for p in PHASES]
         + [("exit", "dispatch"), ("exit", "close"), ("kill", "weight_sync"), ("kill", "combine")]
         + [("raise", "balancer_init"), ("raise", "dispatcher_init")])  # inside a constructor, its own heap open
EXPECTED = {
    "raise": r"RuntimeError: injected fault on rank 2 at {phase}",
    "exit": r"rank 2 \(pid \d+\) exited with 7",
    # which rank vanished first is seen by polling, so under load the launcher may name a rank
    # it killed while cleaning up; that the killed rank left no status must always show
    "kill": r"rank 2 \(pid \d+\) ended (first, )?without a status \(killed by a signal",
    "sleep": r"rank\(s\) \[2\] had not reached it|waiting for rank 2",
}


def job_processes(token: str) -> list[int]:
    """Live processes whose command line holds ``token``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("kind,phase", CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_fault_ends_the_job(kind, phase):
    token = f"fault-{uuid.uuid4().hex}"  # names this job's processes
    segments_before = launch.mpi_segments()
    with pytest.raises(launch.LaunchError) as failed:
        timeout_s = SILENT_TIMEOUT_S if kind == "sleep" else FAILING_TIMEOUT_S
        launch.run_mpi(4, [str(MPI_SCRIPTS / "reliability/mpi/fault_check.py"), kind, phase, str(timeout_s), token],
                       timeout=120)
    ended = time.time()
    message = str(failed.value)
    injected = re.search(r"\[fault\] (\d+\.\d+) rank 2", message)
    assert injected, f"the fault was not injected:\n{message}"
    # A failing rank's peers learn of it at once: no one waits even for the failing close's grace period.
    bound = 10 + SILENT_TIMEOUT_S if kind == "sleep" else FAILING_CLOSE_TIMEOUT_S - 1
    took = ended - float(injected.group(1))
    assert took < bound, f"job ended {took:.1f} s after the fault"
    assert re.search(EXPECTED[kind].format(phase=phase), message), message
    assert "finished" not in message  # no rank went on past a failed step
    assert job_processes(token) == [], "processes of the job remain"
    leaked = launch.mpi_segments() - segments_before - launch.mapped_shm_names()
    assert not leaked, f"segments left in /dev/shm: {leaked}"
