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


def test_held_event_ms_each_times_every_launch_in_turns():
    import cupy

    from ultraep.bench.timing import held_event_ms_each
    from ultraep.runtime.kernels import get_function

    hold = get_function("timing.cu", "hold_stream")
    order = []

    def busy(name, us):
        def launch():
            order.append(name)
            hold((1,), (1,), (cupy.uint64(us * 1000),))
        return launch

    ms = held_event_ms_each({"short": busy("short", 50), "long": busy("long", 400)}, repeats=4, warmup=1)
    assert 0.05 <= ms["short"] < 0.3 and 0.4 <= ms["long"] < 0.7, ms
    timed = order[2:]  # after one warm-up call of each
    assert sorted(timed) == ["long"] * 4 + ["short"] * 4
    assert timed[:2] == ["short", "long"] and timed[2:4] == ["long", "short"], f"not taken in rotating turns: {timed}"


def test_call_start_reads_the_device_clock_as_the_stream_reaches_the_stamp():
    """Two stamps 2 ms of device work apart read at least 2 ms apart although the host
    enqueued them at once: the clock is the device's (the fused kernels' task stamps')."""
    import cupy

    from ultraep.bench.timing import CallStart
    from ultraep.runtime.kernels import get_function

    hold, start = get_function("timing.cu", "hold_stream"), CallStart(gpu=True)
    start.stamp()
    before = start.ns()
    hold((1,), (1,), (cupy.uint64(2_000_000),))
    start.stamp()
    after = start.ns()
    assert 2_000_000 <= after - before < 50_000_000, (before, after)
