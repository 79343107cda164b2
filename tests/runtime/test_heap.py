"""Symmetric heap across ranks: every rank writes every peer, every byte checked; the
barrier's timeout; bad input raising on every rank. CPU backend in CI, CUDA IPC on a GPU."""

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", ["exchange", "timeout", "bad-input", "lifecycle"])
def test_heap_across_ranks(backend, check):
    out = run_ranks(RANKS, "runtime/mpi/heap_check.py", backend, check, timeout=180)
    assert_all_ranks_ok(out, RANKS, check)
    if check == "timeout":
        assert out.count("waiting for rank 3") == RANKS - 1, out


@pytest.mark.parametrize("tensors, signals, text", [
    ([("t", (4, 2.5), "float32")], [], "shape must be a tuple of ints >= 0, got (4, 2.5)"),
    ([("t", (True, 4), "float32")], [], "shape must be a tuple of ints >= 0"),
    ([("t", (-1,), "float32")], [], "shape must be a tuple of ints >= 0"),
    ([("t", 8, "float32")], [], "shape must be a tuple of ints >= 0, got 8"),
    ([], [("s", 3.7)], "signal count must be an int >= 0, got 3.7"),
    ([], [("s", "4")], "signal count must be an int >= 0"),
])
def test_requirements_refuse_dimensions_int_would_round(tensors, signals, text):
    """int() would size the heap for a truncated shape or count (2.5 -> 2, True -> 1)."""
    import numpy as np

    from ultraep.runtime.heap import HeapRequirements

    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        HeapRequirements.of(tensors=tensors, signals=signals)
    ok = HeapRequirements.of(tensors=[("t", (np.int64(4), 0), "float32")], signals=[("s", np.int32(3))])
    assert ok.tensors[0][1] == (4, 0) and ok.signals == (("s", 3),)


def test_the_cpu_heap_refuses_what_dev_shm_cannot_hold(monkeypatch, tmp_path):
    """A full tmpfs kills the process with SIGBUS at the first touch of a page: refuse first."""
    import os

    from ultraep.runtime import mpi_shm

    free = os.statvfs(tmp_path)
    room = free.f_bavail * free.f_frsize
    monkeypatch.setattr(mpi_shm, "SHM_DIR", str(tmp_path))
    assert mpi_shm.shm_space_error(room // 2) is None
    message = mpi_shm.shm_space_error(room + (1 << 30))
    assert "shared memory on this node" in message and "--shm-size" in message
    monkeypatch.setattr(mpi_shm, "SHM_DIR", str(tmp_path / "absent"))
    assert mpi_shm.shm_space_error(1 << 60) is None  # no /dev/shm: the MPI keeps its segments elsewhere
