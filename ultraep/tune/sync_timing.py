"""Timing one expert's weight sync (``WeightTransfer.weight_sync``) at chosen grids: what
``tune validate --phase weight-sync`` sweeps, and the three syncs the machine profile times
(:class:`~ultraep.tune.profile.SyncTimes`) for the model to solve its sync rates from.

On the GPU rank 0 alone times the sync's kernel as CUDA-graph replays (below the relay
threshold only its tasks copy and none waits on a flag); on the host every rank times the
whole call (a group window)."""

from __future__ import annotations

import numpy as np

PROFILE_SYNC_SHAPE = (4096, 1536)  # (hidden, ffn) of the expert the profile times: 37.7 MB in BF16
PROFILE_SYNC_REPEATS = 10


class SyncTimer:
    """One registered layer of one expert (``spec``) over ``layout``'s ranks on a heap of its
    own, whose sync of a plan (:meth:`prepare`, collective) is timed at a grid (:meth:`ms`);
    ``close()`` (or ``with``) gives the heap back."""

    def __init__(self, group, backend: str, xp, synchronize, spec, layout, seed: int = 0):
        from ultraep.runtime import open_heap
        from ultraep.transfer import WeightTransfer

        self.group, self.backend, self.synchronize = group, backend, synchronize
        self._heap = open_heap(group, 2 * (spec.weight_slot_bytes + spec.grad_slot_bytes), backend=backend)
        try:
            self.engine = WeightTransfer(self._heap, layout, spec, relay_threshold=group.size)
            rng = np.random.default_rng(seed + group.rank)
            weights = [[xp.asarray(rng.standard_normal(t.shape, dtype=np.float32)).astype(t.dtype)
                        for t in spec.weights]]
            self.engine.register_layer(0, weights, [[xp.zeros(t.shape, t.dtype) for t in spec.grads]])
        except BaseException:
            self.close()
            raise

    @property
    def timing(self) -> bool:
        """Whether this rank times (rank 0 on the GPU, every rank on the host)."""
        return self.backend != "device" or self.group.rank == 0

    def max_blocks(self, default: int) -> int:
        """The most blocks a sync may run on (the device's resident bound; ``default`` on the host)."""
        return getattr(self.engine.impl, "max_sync_blocks", default)

    def prepare(self, plan) -> None:
        """Sync ``plan`` once (collective): compiles its device schedule and checks its replicas."""
        self.engine.weight_sync(0, plan)
        self.engine.synchronize()

    def ms(self, plan, blocks: int, repeats: int) -> float | None:
        """``plan``'s sync on ``blocks`` blocks, in ms (None where the GPU's sync could not be
        captured in a CUDA graph); on the host collective, on the GPU rank 0's alone."""
        from ultraep.bench.timing import graph_ms, group_window_ms

        if self.backend != "device":
            return group_window_ms(self.group, lambda: self.engine.weight_sync(0, plan, blocks=blocks), repeats,
                                   self.synchronize)
        impl, entry = self.engine.impl, self.engine._layers[0]
        return graph_ms(lambda: impl.run_weight_tasks(entry, impl.tables, blocks), repeats)

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
        heap, self._heap = self._heap, None
        if heap is not None:
            heap.close()

    def __enter__(self) -> SyncTimer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def one_expert(hidden: int, ffn: int, ranks: int, grad_dtype: str = "bfloat16"):
    """A BF16 SwiGLU expert of ``hidden`` x ``ffn`` (``grad_dtype`` gradients) and a layout
    of one expert per rank, as the weight-sync sweeps and ``bench weight-sync`` sync."""
    from ultraep.planner import ExpertLayout
    from ultraep.transfer import ExpertSpec

    spec = ExpertSpec([("fc1", (2 * ffn, hidden), "bfloat16"), ("fc2", (hidden, ffn), "bfloat16")],
                      grad_dtype=grad_dtype)
    return spec, ExpertLayout(ranks, ranks, 1, max_instances=min(ranks, 16))


def single_expert_plan(layout, fanout: int):
    """Expert 0 (rank 0's master) replicated on ranks 1..fanout; every other expert alone."""
    from ultraep.planner import Plan

    R, E, K = layout.num_ranks, layout.num_experts, layout.max_instances
    log_to_phys = np.full((E, K), -1, np.int32)
    for e in range(E):
        log_to_phys[e, 0] = layout.master_slot(e)
    for i in range(1, fanout + 1):
        log_to_phys[0, i] = layout.physical_slot(i, layout.experts_per_rank)
    loads = np.full((R, E), 64, np.int32)
    split = np.zeros((R, E, K), np.int64)
    split[:, :, 0] = loads
    split[:, 0, : fanout + 1] = loads[:, :1] // (fanout + 1)
    split[:, 0, 0] += loads[:, 0] - split[:, 0, : fanout + 1].sum(axis=1)
    return Plan.from_split(layout, loads, log_to_phys, split)


def profile_sync_times(group, xp, synchronize, grid: int) -> tuple[int, int, tuple[float, float, float] | None]:
    """Collective, on the GPU: rank 0's sync of a :data:`PROFILE_SYNC_SHAPE` expert replicated
    on ranks 1..F (F the widest fan-out, up to 7) at fan-out 1 on one block, at F on one block
    and at F on ``grid`` blocks, in seconds; (expert bytes, F, times), times None where a sync
    could not be captured."""
    spec, layout = one_expert(*PROFILE_SYNC_SHAPE, group.size)
    fanout = min(group.size - 1, 7)
    times = []
    with SyncTimer(group, "device", xp, synchronize, spec, layout) as timer:
        for fan, blocks in ((1, 1), (fanout, 1), (fanout, min(grid, timer.max_blocks(grid)))):
            plan = single_expert_plan(layout, fan)
            timer.prepare(plan)
            group.barrier(what="machine profile: the weight sync timed by rank 0 alone")
            times.append(timer.ms(plan, blocks, PROFILE_SYNC_REPEATS) if timer.timing else 0.0)
    measured = group.allgather(times, what="machine profile: rank 0's weight sync times")[0]
    if any(t is None for t in measured):
        return spec.weight_slot_bytes, fanout, None
    return spec.weight_slot_bytes, fanout, tuple(t * 1e-3 for t in measured)
