"""The examples run as written."""

from pathlib import Path

import pytest

from tests.conftest import requires_gpu
from ultraep.runtime.launch import run_mpi

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["host", pytest.param("device", marks=[pytest.mark.gpu, requires_gpu])])
def test_heap_exchange_example(backend):
    out = run_mpi(4, [str(EXAMPLES / "heap_exchange.py"), "--backend", backend], timeout=120).stdout
    for rank in range(4):
        assert f"rank {rank}/4 ({backend}): received" in out, out
