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


OVERLAP_PROBE = r"""
extern "C" __global__ void overlap_probe(int* running, int* overlapped, unsigned long long hold_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    if (atomicAdd(running, 1) != 0) atomicAdd(overlapped, 1);
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < hold_ns);
    atomicSub(running, 1);
}
"""


def test_graph_ms_replays_never_run_beside_its_first_launch():
    """graph_ms's first launch (outside the capture) and its replays (another stream) take
    turns: a kernel that counts the launches running at once sees none beside it, as one
    whose launches share device state (the weight sync's claim counter) needs."""
    import cupy

    from ultraep.bench.timing import graph_ms

    kernel = cupy.RawModule(code=OVERLAP_PROBE).get_function("overlap_probe")
    for hold_us in (100, 2000, 20000):  # before the fix each of these saw its replays start beside it (H100)
        running, overlapped = cupy.zeros(1, cupy.int32), cupy.zeros(1, cupy.int32)
        ms = graph_ms(lambda: kernel((1,), (1,), (running, overlapped, cupy.uint64(hold_us * 1000))), repeats=3)
        cupy.cuda.Device().synchronize()
        assert ms is not None and ms >= hold_us / 1e3, f"a {hold_us} us kernel timed {ms} ms"
        assert int(overlapped.get()[0]) == 0, f"{int(overlapped.get()[0])} launches started while another ran"
        assert int(running.get()[0]) == 0


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
