"""GPU timing for the benchmarks: CUDA events around launches, and CUDA-graph replays so
that Python's launch overhead stays out of kernels that run for only tens of microseconds."""

from __future__ import annotations

import statistics
import sys
import time


def median_event_ms(launch, repeats: int, warmup: int = 10) -> float:
    """Median CUDA-event time of ``launch()`` on the current stream."""
    import cupy

    for _ in range(warmup):
        launch()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        launch()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def graph_ms(launch, repeats: int):
    """Median time of one replay of ``launch`` captured in a CUDA graph (None if it cannot be captured)."""
    import cupy

    launch()  # compile and fill the memory pool outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        try:
            stream.begin_capture()
            launch()
            graph = stream.end_capture()
        except Exception as error:  # report, do not fake a number
            print(f"graph capture failed: {error}", file=sys.stderr)
            return None
        return median_event_ms(graph.launch, repeats)


def group_window_ms(group, fn, repeats: int, synchronize) -> float:
    """ms per call of the whole group: from the first rank's start to the last rank's end.

    Ranks sharing one GPU run time-sliced, so per-rank times would overlap unevenly; the
    group's window (``time.monotonic`` is one clock for all processes of a host) is what
    an aggregate bandwidth divides by. ``synchronize`` waits for this rank's device work.
    """
    fn()  # warm-up
    synchronize()
    group.barrier()
    start = time.monotonic()
    for _ in range(repeats):
        fn()
    synchronize()
    spans = group.allgather((start, time.monotonic()))
    return (max(end for _, end in spans) - min(begin for begin, _ in spans)) / repeats * 1e3
