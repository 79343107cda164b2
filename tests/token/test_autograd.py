"""torch autograd through the Dispatcher (TokenRoute) against dense autograd, on 2 ranks."""

import pytest

from tests.conftest import assert_all_ranks_ok, requires_gpu, run_ranks

pytest.importorskip("torch", reason="torch not installed: autograd wrapper not tested")
BACKENDS = [pytest.param("cpu", id="cpu"),
            pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, requires_gpu])]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_matches_dense(backend):
    out = run_ranks(2, "token/mpi/autograd_check.py", backend, timeout=300)
    assert_all_ranks_ok(out, 2, "autograd")
