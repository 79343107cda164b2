"""``Balancer.reroute(handle)``: the reroute ``update`` made of the ids it counted, equal bit
for bit to ``reroute(handle, ids)`` and ``reroute_reference`` (4 ranks: the host backend
here, the GPU's, graphed and eager, under the ``gpu`` marker), and its misuse refused."""

import numpy as np
import pytest

from tests.conftest import assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.errors import CollectiveError
from ultraep.integration import Balancer, BalancerError
from ultraep.planner import ExpertLayout
from ultraep.planner.reroute import reroute_reference
from ultraep.transfer import ExpertSpec

RANKS = 4
SPEC = ExpertSpec([("w", (4, 4), "float32")], grad_dtype="float32")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["checked", "unchecked"])
def test_update_reroute_across_ranks_host(mode):
    out = run_ranks(RANKS, "integration/mpi/balancer_reroute_check.py", "host", mode, "eager", timeout=240)
    assert_all_ranks_ok(out, RANKS, f"reroute-host-{mode}-eager")


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("launches", ["graphs", "eager"])
@pytest.mark.parametrize("mode", ["checked", "unchecked"])
def test_update_reroute_across_ranks_device(mode, launches):
    out = run_ranks(RANKS, "integration/mpi/balancer_reroute_check.py", "device", mode, launches, timeout=300)
    assert_all_ranks_ok(out, RANKS, f"reroute-device-{mode}-{launches}")


@pytest.fixture
def balancer():
    from mpi4py import MPI

    from ultraep.runtime.group import EPGroup

    group = EPGroup(MPI.COMM_SELF, use_gpu=False)
    with Balancer(group, ExpertLayout(1, 4, 1), SPEC, num_layers=2, max_in_flight=2, backend="host") as bal:
        yield bal


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("shape", [(6, 2), (0, 2), (5,)])
def test_reroute_without_ids_is_the_update_s_own(balancer, dtype, shape):
    ids = np.random.default_rng(3).integers(0, 4, size=shape).astype(dtype)
    handle = balancer.update(0, ids)
    routed = balancer.reroute(handle)
    assert routed.dtype == np.int32 and routed.shape == shape
    assert np.array_equal(routed, balancer.reroute(handle, ids))
    assert np.array_equal(routed, reroute_reference(ids, balancer.plan(handle), 0))


def test_a_later_update_leaves_a_live_handle_s_result(balancer):
    first = balancer.update(0, np.array([[0, 1], [1, 1]]))
    routed = balancer.reroute(first).copy()
    balancer.update(0, np.array([[3, 3], [2, 3]]))  # the other ring slot
    balancer.update(1, np.array([[2, 2], [2, 2]]))
    assert np.array_equal(balancer.reroute(first), routed)


def test_reroute_without_ids_of_a_local_loads_update_is_refused(balancer):
    handle = balancer.update(0, local_loads=np.array([1, 2, 0, 3]))
    with pytest.raises(BalancerError, match="micro-batch 0 was updated from local_loads: pass topk_ids"):
        balancer.reroute(handle)
    ids = np.array([[1, 1], [3, 3], [0, 3]])
    assert np.array_equal(balancer.reroute(handle, ids), reroute_reference(ids, balancer.plan(handle), 0))


def test_out_needs_ids(balancer):
    handle = balancer.update(0, np.array([[0, 1]]))
    with pytest.raises((BalancerError, CollectiveError), match="out needs topk_ids"):
        balancer.reroute(handle, out=np.zeros((1, 2), np.int32))
