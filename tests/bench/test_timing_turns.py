"""held_event_ms_each's turns and its retry when the host was late, on a stand-in for CuPy's
events and the stream-holding kernel (tests/bench/test_timing.py times real kernels)."""

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
