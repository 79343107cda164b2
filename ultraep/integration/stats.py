"""Balancer metrics: stage clocks, one record per (layer, micro-batch) and summaries (the
per-rank load plot of these records is :func:`ultraep.analysis.plots.plot_rank_loads`);
and :class:`HostPhaseRecorder` / :class:`DevicePhaseRecorder`, the times of a MoELayer's steps
(``MoELayer.record_phases``).

A record is built from three host arrays of a plan -- the gathered loads, ``phys_to_log``
and ``rank_load`` -- by :func:`plan_record`, the same code on both backends (the GPU path
copies those arrays into pinned host memory asynchronously and builds the record once
the copies have landed). Stage times come from CUDA events on the GPU and
``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ultraep.planner.plan import imbalance, master_rank_load

STAGES = ("update", "weight_sync", "reroute", "restore", "reduce_grads")


@dataclass
class LayerRecord:
    """What one micro-batch of one layer did. Byte counts are group-wide totals."""

    layer: int
    step: int
    imbalance_before: float
    imbalance_after: float
    replicas: int
    rank_load_before: np.ndarray
    rank_load_after: np.ndarray
    weight_bytes: int = 0
    weight_syncs: int = 0  # the weight syncs and restores that moved weight_bytes
    grad_bytes: int = 0
    times_ms: dict = field(default_factory=dict)  # stage -> ms, None when it had not finished when read
    liveness: int = 0  # plans the device had completed when this one was done

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.grad_bytes

    def as_dict(self) -> dict:
        return {"layer": self.layer, "step": self.step, "imbalance_before": self.imbalance_before,
                "imbalance_after": self.imbalance_after, "replicas": self.replicas,
                "rank_load_before": self.rank_load_before.tolist(), "rank_load_after": self.rank_load_after.tolist(),
                "weight_bytes": self.weight_bytes, "weight_syncs": self.weight_syncs, "grad_bytes": self.grad_bytes,
                "times_ms": dict(self.times_ms), "liveness": self.liveness}


def plan_record(layout, layer: int, step: int, loads, phys_to_log, rank_load) -> LayerRecord:
    """The record of one plan from its host arrays (transfers and times are added later)."""
    loads, rank_load = np.asarray(loads), np.asarray(rank_load)
    M = layout.experts_per_rank
    redundant = np.asarray(phys_to_log).reshape(layout.num_ranks, layout.slots_per_rank)[:, M:]
    before = master_rank_load(layout, loads)
    return LayerRecord(layer=int(layer), step=int(step), imbalance_before=imbalance(before),
                       imbalance_after=imbalance(rank_load), replicas=int((redundant >= 0).sum()),
                       rank_load_before=before.astype(np.int64), rank_load_after=rank_load.astype(np.int64))


class HostClock:
    """Stage times by ``perf_counter`` (the CPU backend runs each stage synchronously)."""

    def __init__(self):
        import time
        self._now = time.perf_counter
        self._start: dict = {}
        self.ms: dict = {}

    def reset(self) -> None:
        self._start.clear()
        self.ms.clear()

    def start(self, stage: str) -> None:
        self._start[stage] = self._now()

    def stop(self, stage: str):
        self.ms[stage] = (self._now() - self._start[stage]) * 1e3
        return None  # nothing to wait on: the stage has finished

    def times(self) -> dict:
        return dict(self.ms)


class DeviceClock:
    """Stage times by CUDA events recorded on the current stream; the events are created
    once, and a stage's stop event is what a caller waits on for that stage."""

    def __init__(self):
        import cupy
        self._cupy = cupy
        self.events = {stage: (cupy.cuda.Event(), cupy.cuda.Event()) for stage in STAGES}
        self._recorded: set = set()

    def reset(self) -> None:
        self._recorded.clear()

    def start(self, stage: str) -> None:
        self.events[stage][0].record()

    def stop(self, stage: str):
        stop = self.events[stage][1]
        stop.record()
        self._recorded.add(stage)
        return stop

    def times(self) -> dict:
        """Milliseconds of the recorded stages that have finished (no waiting)."""
        out = {}
        for stage in sorted(self._recorded):
            start, stop = self.events[stage]
            out[stage] = self._cupy.cuda.get_elapsed_time(start, stop) if stop.done else None
        return out


class HostPhaseRecorder:
    """Where calls of a MoELayer direction spend their time on this rank (CPU backend, where a
    step has finished when it returns): :meth:`begin` at a call's start, :meth:`mark` after
    each step, and :meth:`take`, every call recorded since the last take as ``{step: ms}``."""

    def __init__(self):
        self._calls: list = []  # per call: [(step, a point in time)], the first step "start"

    def begin(self) -> None:
        self._calls.append([])
        self.mark("start")

    def mark(self, step: str) -> None:
        self._calls[-1].append((step, self._now()))

    def take(self) -> list[dict]:
        calls, self._calls = self._calls, []
        return [{step: self._ms(a, b) for (_, a), (step, b) in zip(marks, marks[1:])} for marks in calls]

    @staticmethod
    def _now():
        import time
        return time.perf_counter()

    @staticmethod
    def _ms(start, stop) -> float:
        return (stop - start) * 1e3


class DevicePhaseRecorder(HostPhaseRecorder):
    """:class:`HostPhaseRecorder` on the GPU: a step's point is a CUDA event recorded on the
    current stream, and :meth:`take` waits for the device."""

    def take(self) -> list[dict]:
        for marks in self._calls:
            if marks:
                marks[-1][1].synchronize()
        return super().take()

    @staticmethod
    def _now():
        import cupy
        event = cupy.cuda.Event()
        event.record()
        return event

    @staticmethod
    def _ms(start, stop) -> float:
        import cupy
        return cupy.cuda.get_elapsed_time(start, stop)


@dataclass
class BalancerStats:
    """``records`` in completion order (oldest first, the ring's live ones last);
    ``updates``: plans requested on this rank; ``liveness``: plans the device completed;
    ``host_waits`` / ``host_wait_ms``: how often and how long the per-micro-batch calls
    blocked the host on the device (an ``update`` a whole ring of micro-batches ahead of
    its device, ``sync_checks``' read of bad ids; never on the host backend)."""

    records: list
    updates: int
    liveness: int
    host_waits: int = 0
    host_wait_ms: float = 0.0

    @property
    def stalled(self) -> bool:
        """The device has not completed every requested plan (read after a synchronise)."""
        return self.liveness < self.updates

    def summary(self) -> dict:
        records = self.records
        out = {"updates": self.updates, "liveness": self.liveness, "stalled": self.stalled, "records": len(records),
               "host_waits": self.host_waits, "host_wait_ms": self.host_wait_ms}
        if not records:
            return out
        out.update(
            imbalance_before_mean=float(np.mean([r.imbalance_before for r in records])),
            imbalance_after_mean=float(np.mean([r.imbalance_after for r in records])),
            imbalance_after_max=float(max(r.imbalance_after for r in records)),
            replicas_mean=float(np.mean([r.replicas for r in records])),
            bytes_moved=int(sum(r.bytes_moved for r in records)),
            worse_than_unbalanced=int(sum(r.imbalance_after > r.imbalance_before for r in records)),
        )
        for stage in STAGES:
            times = [r.times_ms[stage] for r in records if r.times_ms.get(stage) is not None]
            if times:
                out[f"{stage}_ms_median"] = float(np.median(times))
        return out
