"""The machine profile's shared probe of the fused kernels on ranks sharing one GPU, run
under mpiexec by tests/tune/test_profile_gpu.py.

Usage: python -m mpi4py shared_probe_check.py (the ranks under an MPS daemon)

Every rank measures the fused tasks at once on a few CTAs (``measure_fused``, as
``measure_shared`` does, on grids of 1 and 8), kernel A's tasks released by the sharers'
device barrier (``sharers_barrier``): every released round's first task starts on every
rank within RELEASED_WITHIN_NS of the others' (the barrier's flags cross in microseconds;
the host barrier alone leaves the ranks 0.1-2 ms apart, which is printed for comparison);
the down tiles, not released, count kernel B's own CTAs at work; the heap closes.
"""

import sys
import traceback

import numpy as np
from mpi4py import MPI

from ultraep.runtime.group import EPGroup
from ultraep.tune.device import DeviceProbe
from ultraep.tune.profile import RELEASED_TASKS, fused_costs, measure_fused
from ultraep.tune.replicas import RELEASE_TIMEOUT_S, sharers_barrier

GRIDS = (1, 8)
RELEASED_WITHIN_NS = 50_000

group = EPGroup(MPI.COMM_WORLD, use_gpu=True)
try:
    class SmallProbe(DeviceProbe):
        """The GPU's probe with buffers for GRIDS only (the largest grid sizes them)."""

        def fused_grids(self):
            return GRIDS

    probe = SmallProbe(group.device)
    places = group.allgather((group.hostname, group.device))
    with sharers_barrier(group, places) as heap:
        tables = measure_fused(probe, GRIDS, together=lambda: group.barrier(60.0, what="shared probe check: a round"),
                               release=lambda: heap.barrier(RELEASE_TIMEOUT_S, wait=False))
        heap.check_barriers()
    gathered = group.allgather(tables)
    for task in tables["starts"]:
        apart = np.ptp([t["starts"][task] for t in gathered], axis=0)  # [round]
        print(f"[shared-probe] rank {group.rank}: {task} runs' starts apart, us: {np.round(apart / 1e3, 1).tolist()}",
              flush=True)
        if task in RELEASED_TASKS:
            assert np.all(apart < RELEASED_WITHIN_NS), (task, apart)
    costs = fused_costs(gathered, GRIDS, *probe.fused_reductions)
    assert costs.sharing == group.size and costs.down_ctas_at_work is not None and costs.down_at_work_note is None
    for at_work in (costs.ctas_at_work, costs.down_ctas_at_work):  # two processes' 16 CTAs: every one finds its SM
        assert all(0.75 * g <= v <= g for v, g in zip(at_work, GRIDS)), at_work
    print(f"[shared-probe] rank {group.rank}: CTAs at work up {costs.ctas_at_work}, down {costs.down_ctas_at_work}",
          flush=True)
except Exception:
    traceback.print_exc()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
print(f"[shared-probe] rank {group.rank} OK", flush=True)
