"""held_event_ms_each's turns and its retry when the host was late, on a stand-in for CuPy's
events and the stream-holding kernel (tests/bench/test_timing.py times real kernels); the
group windows of group_windows_ms_each on a stand-in group and clock."""

import sys
import types

import ultraep.runtime.kernels as kernels
from ultraep.bench.timing import held_event_ms_each


class Clock:
    """Device time in ms; a launch advances it by its duration. ``late`` answers the first
    checks of the hold's event as done, as when the host enqueued the stop after the hold ended."""

    def __init__(self, late: int):
        self.now, self.late, self.synchronized = 0.0, late, False


def fake_cupy(clock: Clock):
    class Event:
        def __init__(self):
            self.at = None

        def record(self):
            self.at = clock.now

        def synchronize(self):
            clock.synchronized = True

        @property
        def done(self):  # after a synchronize every earlier event is done
            clock.late -= 1
            return clock.late >= 0 or clock.synchronized

    cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda start, stop: stop.at - start.at)
    return types.SimpleNamespace(cuda=cuda, uint64=int)


def test_every_launch_is_timed_in_rotating_turns_and_a_late_host_doubles_the_hold(monkeypatch):
    clock, calls, holds = Clock(late=1), [], []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(clock))

    def hold(grid, block, args):
        holds.append(args[0])
        clock.synchronized = False

    monkeypatch.setattr(kernels, "get_function", lambda filename, name: hold)

    def launch(name, ms):
        def run():
            calls.append(name)
            clock.now += ms
        return run

    ms = held_event_ms_each({"a": launch("a", 1.0), "b": launch("b", 3.0)}, repeats=4, warmup=2)
    assert ms == {"a": 1.0, "b": 3.0}
    assert calls[:4] == ["a", "a", "b", "b"]  # the warm-ups
    # round 0: a (late host: timed again), b; round 1: b, a; round 2: a, b; round 3: b, a
    assert calls[4:] == ["a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert holds[0] == 200_000 and holds[1:] == [400_000] * 8


class TwoRanks:
    """A stand-in group of two ranks in one process: rank 1's calls start ``lag`` s after
    rank 0's and last ``extra`` s longer; each launch moves a shared clock by its duration."""

    def __init__(self, clock, names_of_rank_1=None):
        self.rank, self.clock, self.names_of_rank_1 = 0, clock, names_of_rank_1
        self.barriers = 0

    def barrier(self):
        self.barriers += 1

    def allgather(self, value):
        if isinstance(value, list):  # the launch names
            return [value, self.names_of_rank_1 or value]
        lag, extra = 0.002, 0.001  # rank 1: each call starts 2 ms later, ends 1 ms after that
        theirs = {name: [(start + lag, end + lag + extra) for start, end in spans] for name, spans in value.items()}
        return [value, theirs]


def test_group_windows_span_every_rank_and_take_the_launches_in_turns(monkeypatch):
    import pytest

    from ultraep.bench import timing

    clock, order = [0.0], []
    monkeypatch.setattr(timing.time, "monotonic", lambda: clock[0])

    def launch(name, seconds):
        def run():
            order.append(name)
            clock[0] += seconds
        return run

    group = TwoRanks(clock)
    ms = timing.group_windows_ms_each(group, {"a": launch("a", 0.010), "b": launch("b", 0.004)}, 4, lambda: None,
                                      warmup=1)
    # rank 0's call, then rank 1's 2 ms later and 1 ms longer: the window is 3 ms past rank 0's
    assert ms == pytest.approx({"a": 13.0, "b": 7.0})
    assert order[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"] and group.barriers == 8
    order.clear()
    ms = timing.group_windows_ms_each(TwoRanks(clock, ["a"]), {"a": launch("a", 0.010), "b": launch("b", 0.004)}, 1,
                                      lambda: None, warmup=0)
    assert list(ms) == ["a"] and order == ["a"]  # b: not on every rank, not timed


def test_call_start_on_the_host_is_the_monotonic_clock():
    """The host backend's tasks are stamped with time.monotonic_ns; so is the call's start."""
    import time

    from ultraep.bench.timing import CallStart

    start = CallStart(gpu=False)
    before = time.monotonic_ns()
    start.stamp()
    assert before <= start.ns() <= time.monotonic_ns()
