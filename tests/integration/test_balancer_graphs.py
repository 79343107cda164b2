"""The Balancer's CUDA graphs (``cuda_graphs=True``, the default on the GPU): the same plans,
rerouted ids, replica weights and records as launching every kernel, recaptured when the
token count, the ids' dtype or the input kind changes (GPU, 4 ranks); and a bad
``cuda_graphs`` refused (CPU)."""

import numpy as np
import pytest

from tests.conftest import assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.errors import CollectiveError
from ultraep.integration import Balancer
from ultraep.planner import ExpertLayout
from ultraep.transfer import ExpertSpec

RANKS = 4


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["unchecked", "checked"])
def test_graphed_balancer_is_bitwise_the_eager_one(mode):
    out = run_ranks(RANKS, "integration/mpi/balancer_graphs_check.py", mode, timeout=300)
    assert_all_ranks_ok(out, RANKS, f"graphs-{mode}")


def test_cuda_graphs_must_be_a_bool():
    from mpi4py import MPI

    from ultraep.runtime.group import EPGroup

    group = EPGroup(MPI.COMM_SELF, use_gpu=False)
    spec = ExpertSpec([("w", (4, 4), "float32")], grad_dtype="float32")
    with pytest.raises(CollectiveError, match="cuda_graphs must be a bool, got 'yes'"):
        Balancer(group, ExpertLayout(1, 2, 1), spec, num_layers=1, backend="host", cuda_graphs="yes")
    with Balancer(group, ExpertLayout(1, 2, 1), spec, num_layers=1, backend="host", cuda_graphs=False) as bal:
        handle = bal.update(0, np.array([[0], [1], [1]]))
        assert bal.plan(handle).loads.tolist() == [[1, 2]]
