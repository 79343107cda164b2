"""Reliability under bad input: use after close, arguments that differ on one rank, stale
gradients, non-finite or oversized values, and the messages each gives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks
from ultraep import ExpertLayout, plan_placement, reroute
from ultraep.errors import BalancerError, CollectiveError
from ultraep.integration.host import HostBalancer
from ultraep.runtime.group import EPGroup

CASES = ["use_after_close", "disagreement", "stale_grads", "lone_bad_id"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_multi_rank(backend, case):
    """Two ranks; a SIGSEGV, a hang (timeout) or a missing OK line fails."""
    out = run_ranks(2, "reliability/mpi/reliability_check.py", backend, case, timeout=120)
    assert_all_ranks_ok(out, 2, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["closed_on_one_rank", "crossed_objects"])
def test_a_rank_on_another_object_is_refused_on_every_rank_at_once(backend, case):
    """An object closed on one rank, or another object's call on one rank."""
    out = run_ranks(3, "reliability/mpi/reliability_check.py", backend, case, timeout=120)
    assert_all_ranks_ok(out, 3, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", ["dispatcher", "moe_layer", "moe_allocation"])
def test_a_constructor_failing_on_one_rank_reaches_the_peers_with_its_cause(backend, target):
    out = run_ranks(2, "reliability/mpi/reliability_check.py", backend, "lone_constructor_failure", target,
                    timeout=120)
    assert_all_ranks_ok(out, 2, "lone_constructor_failure")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_differing_on_one_rank_is_always_refused(backend):
    """Random plans, each changed on a random rank (another plan, a replica dropped, another
    layer): refused on every rank, nothing written; other loads alone are accepted."""
    ranks, trials = (4, 40) if backend == "host" else (2, 12)
    out = run_ranks(ranks, "reliability/mpi/plan_property_check.py", backend, str(trials), timeout=300)
    assert_all_ranks_ok(out, ranks, "plan_property")


def test_uint64_loads_report_the_real_load():
    layout = ExpertLayout(2, 4, 1)
    loads = np.zeros((2, 4), np.uint64)
    loads[1, 2] = 2**63  # its int64 total wraps to a small number
    with pytest.raises(ValueError, match=r"a load of 9223372036854775808 tokens must be below 2\*\*31"):
        plan_placement(loads, layout)
    loads[1, 2] = 2**30
    loads[0, 0] = 2**30
    with pytest.raises(ValueError, match=r"total load \(2147483648\) must be below 2\*\*31"):
        plan_placement(loads, layout)


def test_balancer_refuses_loads_over_int32():
    balancer = HostBalancer.__new__(HostBalancer)
    with pytest.raises(BalancerError, match=r"below 2\*\*31, found 4294967296"):
        balancer.check_loads(np.array([1, 2**32], dtype=np.int64))
    with pytest.raises(BalancerError, match="non-negative"):
        balancer.check_loads(np.array([1, -1], dtype=np.int64))


def test_reroute_refuses_what_is_not_a_plan():
    with pytest.raises(TypeError, match="plan must be a Plan .* got str"):
        reroute(np.zeros((2, 2), np.int64), "plan", 0)


def test_rank_named_once():
    class Comm:
        rank, size = 3, 4

        def allgather(self, obj):  # obj: (the call's name, this rank's value); the peers saw no error
            return [(obj[0], None)] * 3 + [obj]

    group = EPGroup.__new__(EPGroup)
    group.comm, group.rank, group.size = Comm(), 3, 4
    with pytest.raises(CollectiveError) as caught:
        group.raise_if_any("rank 3: bad ids", "update")
    assert "rank 3: bad ids" in str(caught.value) and "rank 3: rank 3" not in str(caught.value)


def test_validate_checks_under_python_O():
    """Plan.validate must not rely on assert statements, which ``python -O`` removes."""
    code = ("import numpy as np; from ultraep import ExpertLayout, plan_placement\n"
            "plan = plan_placement(np.ones((2, 4), np.int32), ExpertLayout(2, 4, 1))\n"
            "plan.quota[0, 0] += 1\n"
            "try:\n    plan.validate()\nexcept AssertionError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused: quotas do not sum to the expert loads" in done.stdout, done.stdout
