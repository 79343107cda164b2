"""The device-only timing of the GPU benchmarks (ultraep.bench.timing)."""

import time

import pytest

from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def test_held_event_ms_times_the_device_work_and_not_the_host():
    import cupy

    from ultraep.bench.timing import held_event_ms, median_event_ms
    from ultraep.runtime.kernels import get_function

    hold = get_function("timing.cu", "hold_stream")
    busy_us = 50

    def launch():  # 2 ms of host time before 50 us of device work
        time.sleep(0.002)
        hold((1,), (1,), (cupy.uint64(busy_us * 1000),))

    held = held_event_ms(launch, repeats=5, warmup=1)
    plain = median_event_ms(launch, repeats=5, warmup=1)
    assert busy_us / 1e3 <= held < 0.5, f"held timing {held} ms: not the 0.05 ms kernel alone"
    assert plain >= 2.0, f"plain event timing {plain} ms should include the host's 2 ms"
