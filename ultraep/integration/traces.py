"""Load traces: the ``.npz`` file format and a recorder hook.

A trace is what the planner sees over time: ``loads`` ``int32[steps, layers, ranks,
experts]`` (tokens each source rank routes to each logical expert, per micro-batch and
MoE layer), optionally the logical top-k ids behind them (``topk`` ``int32[steps,
layers, ranks, tokens, top_k]``), and free-form JSON metadata. Any framework can write
one (``TraceRecorder``, which the :class:`Balancer` drives) and ``python -m ultraep.bench
plan --trace`` replays it. Seeded synthetic traces are in :mod:`ultraep.analysis.traces`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TRACE_FORMAT_VERSION = 1
_LOADS_KEY, _TOPK_KEY, _META_KEY = "loads", "topk", "metadata_json"


@dataclass(frozen=True)
class Trace:
    """A validated load trace (see the module docstring for the array layouts)."""

    loads: np.ndarray
    topk: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        _validate_loads(self.loads)
        if self.topk is not None:
            _validate_topk(self.topk, self.loads)
        if not isinstance(self.metadata, dict):
            raise ValueError(f"trace metadata must be a dict, got {type(self.metadata).__name__}")

    @property
    def num_steps(self) -> int:
        return self.loads.shape[0]

    @property
    def num_layers(self) -> int:
        return self.loads.shape[1]

    @property
    def num_ranks(self) -> int:
        return self.loads.shape[2]

    @property
    def num_experts(self) -> int:
        return self.loads.shape[3]


def _validate_loads(loads) -> None:
    if not isinstance(loads, np.ndarray):
        raise ValueError(f"trace loads must be a numpy array, got {type(loads).__name__}")
    if loads.dtype != np.int32:
        raise ValueError(f"trace loads must be int32, got {loads.dtype}")
    if loads.ndim != 4:
        raise ValueError(
            f"trace loads must have shape [steps, layers, ranks, experts], got shape {loads.shape}")
    if 0 in loads.shape:
        raise ValueError(f"trace loads must not be empty, got shape {loads.shape}")
    if loads.shape[3] % loads.shape[2]:
        raise ValueError(
            f"trace loads: {loads.shape[3]} experts are not divisible by {loads.shape[2]} ranks")
    if loads.min() < 0:
        raise ValueError(f"trace loads must be non-negative, found {int(loads.min())}")


def _validate_topk(topk, loads: np.ndarray) -> None:
    if not isinstance(topk, np.ndarray):
        raise ValueError(f"trace topk must be a numpy array, got {type(topk).__name__}")
    if topk.dtype != np.int32:
        raise ValueError(f"trace topk must be int32, got {topk.dtype}")
    steps, layers, ranks, experts = loads.shape
    if topk.ndim != 5 or topk.shape[:3] != (steps, layers, ranks):
        raise ValueError(
            f"trace topk must have shape [steps, layers, ranks, tokens, top_k] = "
            f"[{steps}, {layers}, {ranks}, T, k], got shape {topk.shape}")
    if topk.size and (topk.min() < 0 or topk.max() >= experts):
        raise ValueError(f"trace topk holds expert ids outside [0, {experts})")
    # The ids must be the tokens behind the loads: count them per (step, layer, source).
    cell = np.arange(steps * layers * ranks, dtype=np.int64).reshape(steps, layers, ranks, 1, 1)
    flat = (cell * experts + topk).ravel()
    counts = np.bincount(flat, minlength=loads.size).reshape(loads.shape)
    if not np.array_equal(counts, loads):
        bad = np.argwhere(counts != loads)[0]
        raise ValueError(
            f"trace topk does not match loads: at (step, layer, rank, expert) = {tuple(bad.tolist())} "
            f"topk counts {int(counts[tuple(bad)])} tokens, loads says {int(loads[tuple(bad)])}")


def save_trace(path: str | os.PathLike[str], loads: Any, topk: Any = None, metadata: dict | None = None) -> Path:
    """Validate and write a trace to ``path`` (``.npz``, compressed); returns the path."""
    trace = Trace(np.asarray(loads), None if topk is None else np.asarray(topk), dict(metadata or {}))
    meta = dict(trace.metadata, trace_format_version=TRACE_FORMAT_VERSION)
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"trace metadata must be JSON-serialisable: {exc}") from None
    arrays = {_LOADS_KEY: trace.loads, _META_KEY: np.array(meta_json)}
    if trace.topk is not None:
        arrays[_TOPK_KEY] = trace.topk
    path = Path(path)
    with open(path, "wb") as fh:  # a file object keeps numpy from appending ".npz"
        np.savez_compressed(fh, **arrays)
    return path


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace written by ``save_trace`` (or any compatible tool)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace file {str(path)!r} is a directory: pass the .npz file save_trace wrote")
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    archive, reason = None, "a lone .npy array"
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as exc:
        reason = "not a NumPy file" if "pickled" in str(exc) else str(exc)  # numpy's advice to unpickle misleads
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"trace file {str(path)!r} is not a readable .npz archive ({reason}): a trace is the file "
                         "save_trace or TraceRecorder writes")
    with archive:
        if _LOADS_KEY not in archive.files:
            raise ValueError(
                f"trace file {str(path)!r} has no {_LOADS_KEY!r} array (found {sorted(archive.files)})")
        loads = archive[_LOADS_KEY]
        topk = archive[_TOPK_KEY] if _TOPK_KEY in archive.files else None
        metadata = {}
        if _META_KEY in archive.files:
            try:
                metadata = json.loads(str(archive[_META_KEY][()]))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"trace file {str(path)!r}: metadata is not valid JSON: {exc}") from None
            if not isinstance(metadata, dict):
                raise ValueError(f"trace file {str(path)!r}: metadata must be a JSON object")
    try:
        return Trace(loads, topk, metadata)
    except ValueError as exc:
        raise ValueError(f"trace file {str(path)!r}: {exc}") from None


class TraceRecorder:
    """Collects per-(step, layer) load matrices during a run and writes them as a trace.

    Call ``record(step, layer, loads, topk=None)`` after each gating step (CuPy arrays
    are copied to the host); ``save(path)`` requires every (step, layer) of the grid
    ``0..max_step x 0..max_layer`` to be recorded, and topk for all of them or none.
    """

    def __init__(self, num_ranks: int, num_experts: int, metadata: dict | None = None):
        if num_ranks <= 0 or num_experts <= 0 or num_experts % num_ranks:
            raise ValueError(
                f"TraceRecorder: need num_experts ({num_experts}) a positive multiple of "
                f"num_ranks ({num_ranks})")
        self.num_ranks, self.num_experts = num_ranks, num_experts
        self.metadata = dict(metadata or {})
        self._loads: dict[tuple[int, int], np.ndarray] = {}
        self._topk: dict[tuple[int, int], np.ndarray] = {}

    def record(self, step: int, layer: int, loads: Any, topk: Any = None) -> None:
        if step < 0 or layer < 0:
            raise ValueError(f"TraceRecorder.record: step and layer must be >= 0, got {step}, {layer}")
        loads = _to_host(loads)
        if loads.shape != (self.num_ranks, self.num_experts):
            raise ValueError(
                f"TraceRecorder.record: loads must have shape ({self.num_ranks}, {self.num_experts}), "
                f"got {loads.shape}")
        if not np.issubdtype(loads.dtype, np.integer):
            raise ValueError(f"TraceRecorder.record: loads must be integers, got {loads.dtype}")
        self._loads[(step, layer)] = loads.astype(np.int32)
        if topk is not None:
            topk = _to_host(topk)
            if topk.ndim != 3 or topk.shape[0] != self.num_ranks:
                raise ValueError(
                    f"TraceRecorder.record: topk must have shape ({self.num_ranks}, tokens, top_k), "
                    f"got {topk.shape}")
            self._topk[(step, layer)] = topk.astype(np.int32)

    def to_trace(self) -> Trace:
        if not self._loads:
            raise ValueError("TraceRecorder: nothing recorded")
        steps = 1 + max(s for s, _ in self._loads)
        layers = 1 + max(l for _, l in self._loads)
        missing = [(s, l) for s in range(steps) for l in range(layers) if (s, l) not in self._loads]
        if missing:
            raise ValueError(f"TraceRecorder: {len(missing)} (step, layer) cells never recorded, "
                             f"first {missing[0]}")
        loads = np.stack([np.stack([self._loads[(s, l)] for l in range(layers)]) for s in range(steps)])
        topk = None
        if self._topk:
            if len(self._topk) != len(self._loads):
                raise ValueError("TraceRecorder: topk recorded for some (step, layer) cells but not all")
            shapes = {a.shape for a in self._topk.values()}
            if len(shapes) != 1:
                raise ValueError(f"TraceRecorder: topk shapes differ between cells: {sorted(shapes)}")
            topk = np.stack([np.stack([self._topk[(s, l)] for l in range(layers)]) for s in range(steps)])
        return Trace(loads, topk, dict(self.metadata))

    def save(self, path: str | os.PathLike[str]) -> Path:
        trace = self.to_trace()
        return save_trace(path, trace.loads, trace.topk, trace.metadata)


def _to_host(array) -> np.ndarray:
    if hasattr(array, "get") and not isinstance(array, np.ndarray):  # CuPy
        array = array.get()
    return np.asarray(array)
