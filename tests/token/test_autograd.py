"""torch autograd through the Dispatcher (TokenRoute) against dense autograd, on 2 ranks."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

pytest.importorskip("torch", reason="torch not installed: autograd wrapper not tested")


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_matches_dense(backend):
    out = run_ranks(2, "token/mpi/autograd_check.py", backend, timeout=300)
    assert_all_ranks_ok(out, 2, "autograd")
