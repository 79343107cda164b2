"""The stream-wait bench on one GPU (one process, no MPS)."""

import json
import math

import pytest

from tests.conftest import requires_gpu


@pytest.mark.gpu
@pytest.mark.mpi
@requires_gpu
def test_stream_wait_rows_and_no_cost_without_mps(tmp_path):
    """A row per kernel and case, each case timed against ``alone`` of the same run. One
    process with the GPU to itself: a wait pending on a second stream, with or without
    work behind it, leaves the layer stream's launches as they were (H200: 1.00-1.01, the bound
    15 % for a shared machine's noise); the cost the bench exists for appears only among
    several MPS clients."""
    from ultraep.bench import stream_wait

    out = tmp_path / "sw.json"
    assert stream_wait.main(["--kernels", "40", "--repeats", "10", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["kernel"], row["case"]) for row in rows] == [(k, c) for k in stream_wait.KERNELS
                                                              for c in stream_wait.CASES]
    for row in rows:
        assert math.isfinite(row["us_per_kernel"]) and row["us_per_kernel"] > 0, row
        assert 0.85 < row["vs_alone"] < 1.15, row
