"""The CuPy planner's layout limits, checked on the host (no GPU needed)."""

import pytest

from ultraep.planner import ExpertLayout
from ultraep.planner.cuda import MAX_SHARED_BYTES, launch_shared_bytes


@pytest.mark.parametrize("layout, problem", [
    (ExpertLayout(256, 256, 2), "domains of up to 128 ranks"),
    (ExpertLayout(2, 1200, 300, 2, 2), "up to 256 redundant slots"),  # a move's slot field has 8 bits
    (ExpertLayout(128, 1024, 2), "bytes of shared memory"),
])
def test_layouts_the_kernel_cannot_take_are_refused_by_name(layout, problem):
    with pytest.raises(ValueError, match=problem):
        launch_shared_bytes(layout)


@pytest.mark.parametrize("layout", [ExpertLayout(64, 128, 2), ExpertLayout(64, 256, 2), ExpertLayout(72, 576, 2),
                                    ExpertLayout(2, 1200, 256, 2, 2), ExpertLayout(64, 256, 2, 8)])
def test_anchor_and_edge_layouts_fit(layout):
    assert 0 < launch_shared_bytes(layout) <= MAX_SHARED_BYTES
