"""GPU timing for the benchmarks: CUDA events around launches (Python's launch cost
included), and CUDA-graph replays timed on the device alone, so that neither Python's
launch overhead nor the host's submission latency is counted in kernels that run for only
tens of microseconds."""

from __future__ import annotations

import statistics
import sys
import time

from ultraep.runtime.sm_partition import new_stream


def in_turns(names: list, round_: int) -> list:
    """``names`` in the order of round ``round_``: rotated one place further each round."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def window_ms(spans) -> float:
    """The group's window of one call, in ms: from the first rank's start to the last rank's
    end (``spans``: one (start, end) per rank, in seconds)."""
    return (max(end for _, end in spans) - min(start for start, _ in spans)) * 1e3


class CallStart:
    """When a call began, on the clock its recorded tasks use: on the GPU the device's clock
    as the stream reaches the call's first launch (``timing.cu``'s ``stamp_clock``), on the
    host ``time.monotonic_ns``. :meth:`stamp` just before the call, :meth:`ns` after it."""

    def __init__(self, gpu: bool):
        self.gpu, self.host_ns = gpu, 0
        if gpu:
            import cupy
            import numpy as np

            from ultraep.runtime.kernels import get_function

            self.kernel = get_function("timing.cu", "stamp_clock")
            self.clock = cupy.zeros(1, dtype=np.uint64)

    def stamp(self) -> None:
        if self.gpu:
            self.clock.fill(0)
            self.kernel((1,), (1,), (self.clock,))
        else:
            self.host_ns = time.monotonic_ns()

    def ns(self) -> int:
        """The stamp (waits for the device)."""
        if not self.gpu:
            return self.host_ns
        stamped = int(self.clock.get()[0])
        if not stamped:
            raise RuntimeError("stamp_clock wrote no clock: the stamp never ran")
        return stamped


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


def held_event_ms(launch, repeats: int, warmup: int = 10, hold_us: float = 200.0) -> float:
    """Median device time of ``launch()``: each timed launch is enqueued, between two
    events, while a kernel holds the stream (``raw_kernels/timing.cu``), so the events
    bracket the device's work and not the host's submission latency (the work a
    framework enqueues behind running kernels sees the same). A hold that ended before
    the host had enqueued the stop event is doubled and the launch timed again."""
    return held_event_ms_each({"launch": launch}, repeats, warmup, hold_us)["launch"]


def held_event_ms_each(launches: dict, repeats: int, warmup: int = 10, hold_us: float = 200.0) -> dict:
    """:func:`held_event_ms` of several launches (name -> launch) taken in turns, one call of
    each a round, the order rotating round to round: the GPU's clocks follow its power and
    temperature, which drift by several percent within seconds, so launches timed one after
    another would each see other clocks; taken in turns they see the same."""
    import cupy

    from ultraep.runtime.kernels import get_function

    hold = get_function("timing.cu", "hold_stream")
    names = list(launches)
    for name in names:
        for _ in range(warmup):
            launches[name]()
    held, start, stop = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    times: dict = {name: [] for name in names}
    hold_ns = int(hold_us * 1e3)
    for round_ in range(repeats):
        for name in in_turns(names, round_):
            while True:
                hold((1,), (1,), (cupy.uint64(hold_ns),))
                held.record()
                start.record()
                launches[name]()
                stop.record()
                host_was_late = held.done  # the hold ended before the stop was enqueued: the interval includes the host
                stop.synchronize()
                if not host_was_late:
                    break
                hold_ns *= 2
                if hold_ns > 10**9:
                    raise RuntimeError(f"held_event_ms: the host took over 1 s to enqueue one launch of {name}")
            times[name].append(cupy.cuda.get_elapsed_time(start, stop))
    return {name: statistics.median(values) for name, values in times.items()}


def graph_ms(launch, repeats: int):
    """Median device time (:func:`held_event_ms`) of one replay of ``launch`` captured in
    a CUDA graph (None if it cannot be captured)."""
    import cupy

    launch()  # compile and fill the memory pool outside the capture
    # the replays run on another stream: they must not start while this launch still runs
    # (a kernel whose launches share device state -- the weight sync's claim counter -- breaks)
    cupy.cuda.get_current_stream().synchronize()
    stream = new_stream()
    with stream:
        try:
            stream.begin_capture()
            launch()
            graph = stream.end_capture()
        except Exception as error:  # report, do not fake a number
            print(f"graph capture failed: {error}", file=sys.stderr)
            return None
        return held_event_ms(graph.launch, repeats)


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
    return window_ms(group.allgather((start, time.monotonic()))) / repeats


def group_windows_ms_each(group, launches: dict, repeats: int, synchronize, warmup: int = 3) -> dict:
    """The median group window of one call of each launch (name -> launch) that every rank
    has (the others are left out, and rank 0 says so): every rank calls it at once after a
    barrier, the window runs from the first rank's start to the last rank's end
    (``time.monotonic``, one clock on a host); the launches taken in turns, the order
    rotating round to round, as in :func:`held_event_ms_each`. The host's launch time is
    inside the window: a figure for calls of milliseconds, not of tens of microseconds."""
    everyone = group.allgather(list(launches))
    names = [name for name in launches if all(name in theirs for theirs in everyone)]
    left_out = sorted({name for theirs in everyone for name in theirs} - set(names))
    if left_out and group.rank == 0:
        print(f"group windows: {', '.join(left_out)} left out: not every rank can run it", file=sys.stderr)
    for name in names:
        for _ in range(warmup):
            launches[name]()
    synchronize()
    spans: dict = {name: [] for name in names}
    for round_ in range(repeats):
        for name in in_turns(names, round_):
            group.barrier()
            start = time.monotonic()
            launches[name]()
            synchronize()
            spans[name].append((start, time.monotonic()))
    gathered = group.allgather(spans)
    return {name: statistics.median(window_ms([rank[name][i] for rank in gathered]) for i in range(repeats))
            for name in names}


def array_backend(group, requested: str):
    """``(backend, xp, synchronize, to_host)`` for a bench's ``--backend``: CuPy and the
    current stream's synchronize on the GPU, NumPy and no-ops on the host."""
    import numpy as np

    gpu = group.has_gpu and requested != "host"
    if requested == "device" and not gpu:
        raise SystemExit("--backend device: no GPU here")
    if not gpu:
        return "host", np, (lambda: None), np.asarray
    import cupy

    return "device", cupy, cupy.cuda.get_current_stream().synchronize, cupy.asnumpy
