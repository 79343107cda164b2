"""The host backend's micro-benchmarks (NumPy, this process): what the CPU backend's
copies and expert compute cost, measured the way :mod:`ultraep.tune.device` measures the
GPU, so that CI exercises the whole profile."""

from __future__ import annotations

import os
import platform
import time
from typing import NamedTuple

import numpy as np

from ultraep.errors import ProfileError

ROUNDS = 5               # timed batches per quantity; the fastest is kept
BATCH_S = 0.02           # each batch runs about this long
MAX_CALLS = 1000         # calls per batch at most
COPY_BYTES = 32 << 20    # larger than the last-level cache of a common CPU
LAUNCH_CALLS = 2000


class FusedRound(NamedTuple):
    """One round of a fused task's probe: the task's time, the CTAs (workers) at work, and
    when its first task started (ns; one clock for the processes of one GPU or host)."""

    seconds: float
    at_work: int
    start_ns: int


def seconds_per_call(call, clock, finish=lambda: None) -> float:
    """Time per ``call()`` back to back, by ``clock`` (``finish()`` waits for the batch's
    work): the fastest of ``ROUNDS`` batches, since other processes only ever add time;
    each batch has as many calls as fill about ``BATCH_S``, estimated from a warm-up call."""
    call()
    finish()
    begin = clock()
    call()
    finish()
    calls = max(1, min(MAX_CALLS, int(BATCH_S / max(clock() - begin, 1e-9))))
    times = []
    for _ in range(ROUNDS):
        begin = clock()
        for _ in range(calls):
            call()
        finish()
        times.append((clock() - begin) / calls)
    return min(times)


class Probe:
    """What every backend's probe is besides its measurements: a context manager whose
    ``close()`` gives back what the probe still holds once the measuring is done."""

    def close(self) -> None:
        """Nothing to give back unless a backend's probe keeps buffers (the host's are each
        call's own)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HostProbe(Probe):
    """Micro-benchmarks of the host backend; :func:`ultraep.tune.profile.measure_profile` runs them."""

    backend = "host"
    copy_method = "np.copyto, one process"
    compute_kernel = "np.matmul per expert (the host backend's expert compute)"
    kernel_sources = ()  # no CUDA kernel runs
    compute_dtype = "float32"
    compute_shape = (4, 256, 256)  # experts, k, n
    rows_per_expert = (4, 16, 64, 256, 1024)
    tile_shape = (128, 256)        # bm, bn: the GPU's tile

    def describe(self) -> tuple[str, int]:
        return f"host {platform.machine() or 'cpu'}", os.cpu_count() or 1

    def copy_bytes_per_s(self) -> float:
        source = np.full(COPY_BYTES, 0x5A, np.uint8)  # the bytes do not change a copy's speed
        target = np.empty_like(source)
        return COPY_BYTES / seconds_per_call(lambda: np.copyto(target, source), time.perf_counter)

    def copy_call(self):
        """``(launch, finish, bytes)``: one peer copy of ``bytes`` bytes and the wait for it."""
        source = np.full(COPY_BYTES, 0x5A, np.uint8)
        target = np.empty_like(source)
        return (lambda: np.copyto(target, source)), (lambda: None), COPY_BYTES

    def peer_bytes_per_s(self, copy_bytes_per_s: float) -> tuple[float, str]:
        # The host heap is MPI shared memory: a peer's buffer is mapped into this process
        # and a store there is the same memory copy as a local one.
        return copy_bytes_per_s, "the local copy (the host heap is shared memory: a peer copy is a local copy)"

    def launch_s(self) -> float:
        a, b = np.ones((1, 8), np.float32), np.ones((8, 8), np.float32)
        out = np.empty((1, 8), np.float32)
        return seconds_per_call(lambda: np.matmul(a, b, out=out), time.perf_counter)

    def kernel_s(self) -> float:
        return self.launch_s()  # the host runs a call as it issues it

    def copy_warp_bytes_per_s(self) -> float:
        # One process copies as one worker: the local copy is what one "warp" of it moves.
        return self.copy_bytes_per_s()

    def flag_s(self) -> float:
        flag = np.zeros(1, np.uint64)  # the host heap's flags are words of shared memory, stored then read
        seen = np.zeros(1, np.uint64)

        def handoff():
            flag[0] = 1
            seen[0] = flag[0]

        return seconds_per_call(handoff, time.perf_counter)

    fused_reductions = ((128, 256), (64, 128))  # up tiles' and relays' reductions (hidden), down tiles' (ffn)

    def fused_grids(self) -> tuple[int, ...]:
        return (1,)  # the host backend's fused layer runs its tasks one after another

    def fused_rounds(self, task: str, k: int, grid: int, together, release=None) -> list[FusedRound]:
        """A fused task of the host backend's kind, one tile's NumPy: an up tile's matmul of
        ``tile_shape`` over ``k`` and SwiGLU (and a copy of the accumulators, as ``h``, for
        ``up``), a down tile's matmul (and a copy of it, as ``y``, for ``down_y``), a relay's
        copy of ``tile_shape[0]`` rows of ``k``; one round after ``together()``, its time per
        call, its one worker at work and its start.
        ``release``: a device's (the host has none to wait on)."""
        bm, bn = self.tile_shape
        rng = np.random.default_rng(k)
        x = rng.standard_normal((bm, k), dtype=np.float32)
        w = rng.standard_normal((k, bn), dtype=np.float32)
        acc = np.empty((bm, bn), np.float32)
        kept = np.empty_like(acc)
        act = np.empty((bm, bn // 2), np.float32)
        landing = np.empty_like(x)

        def up(keep: bool):
            np.matmul(x, w, out=acc)
            if keep:
                np.copyto(kept, acc)
            gate, value = acc[:, :bn // 2], acc[:, bn // 2:]
            np.multiply(gate / (1.0 + np.exp(-gate)), value, out=act)

        def down(keep: bool):
            np.matmul(x, w, out=acc)
            if keep:
                np.copyto(kept, acc)

        calls = {"up": lambda: up(True), "up_act": lambda: up(False), "relay": lambda: np.copyto(landing, x),
                 "down": lambda: down(False), "down_y": lambda: down(True)}
        if release is not None:
            raise ProfileError("the host backend's fused tasks have no device to release them")
        together()
        start = time.monotonic_ns()
        return [FusedRound(seconds_per_call(calls[task], time.perf_counter), grid, start)]

    def expert_call_s(self, rows: int) -> float:
        experts, k, n = self.compute_shape
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((experts * rows, k), dtype=np.float32)
        w = rng.standard_normal((experts, k, n), dtype=np.float32)
        y = np.empty((experts * rows, n), np.float32)

        def call():
            for e in range(experts):
                np.matmul(x[e * rows:(e + 1) * rows], w[e], out=y[e * rows:(e + 1) * rows])

        return seconds_per_call(call, time.perf_counter)
