"""``min_replica_tokens="auto"`` in the Balancer across ranks, run under mpiexec by
tests/tune/test_balancer_auto.py.

Usage: python -m mpi4py balancer_auto.py {host|device} {agree|measure|bad-input} DIR

* agree: every rank has its own cache directory holding a synthetic profile of its own
  device with a different peer bandwidth, so the ranks' own values differ; every rank must
  end up with the largest, and plan with it;
* measure: one shared, empty cache directory: the profile is measured, cached, and the
  ranks agree;
* bad-input: a min_replica_tokens that is neither an int >= 0 nor "auto" is refused on
  every rank.
"""

import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.errors import CollectiveError
from ultraep.integration import Balancer
from ultraep.planner import ExpertLayout
from ultraep.runtime.group import EPGroup
from ultraep.runtime.kernels import sources_digest
from ultraep.transfer import ExpertSpec
from ultraep.tune import (ComputeCurve, FusedCosts, MachineProfile, min_replica_tokens_for, profile_path, read_profile,
                          write_profile)
from ultraep.tune.profile import CACHE_VARIABLE, make_probe, sm_share

backend, check, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
group = EPGroup(MPI.COMM_WORLD, use_gpu=backend == "device")
R, me = group.size, group.rank
LAYOUT = ExpertLayout(R, 2 * R, 2)
SPEC = ExpertSpec([("w_in", (64, 32), "float32"), ("w_out", (32, 64), "float32")], grad_dtype="float32")
ELEMENTS = 2 * 64 * 32


def synthetic_profile(rank: int) -> MachineProfile:
    """This rank's device, a roofline compute (flat to 32 rows), a peer bandwidth of its own."""
    probe = make_probe(backend, group.device)
    name, sms = probe.describe()
    rows = (8, 32, 128, 512)
    curve = ComputeCurve(kernel="synthetic", dtype="float32", experts=1, k=64, n=32, rows_per_expert=rows,
                         seconds=tuple(1e-7 * max(32, m) for m in rows))
    peer = 2e9 * (1 + rank)
    return MachineProfile(backend=backend, device=name, sm_count=sms, sm_share=sm_share(), copy_bytes_per_s=peer,
                          copy_method="synthetic", peer_bytes_per_s=peer, peer_method="synthetic", launch_s=1e-6,
                          compute=curve, kernel_s=1e-6, copy_warp_bytes_per_s=peer, flag_s=1e-6,
                          fused=FusedCosts(grids=(1,), sharing=1, up_k=(64,), down_k=(32,), up=((1e-6,),),
                                           up_act=((1e-6,),), relay=((1e-6,),), down=((1e-6,),)),
                          kernels=sources_digest(probe.kernel_sources))  # else the cache measures it again


def balancer(min_replica_tokens):
    return Balancer(group, LAYOUT, SPEC, num_layers=1, backend=backend, min_replica_tokens=min_replica_tokens)


if check == "agree":
    os.environ[CACHE_VARIABLE] = str(root / f"rank{me}")
    mine = synthetic_profile(me)
    write_profile(mine, profile_path(mine.device, mine.sm_share))
    expected = max(min_replica_tokens_for(SPEC.weight_slot_bytes, synthetic_profile(r), weight_elements=ELEMENTS)
                   for r in range(R))
    own = min_replica_tokens_for(SPEC.weight_slot_bytes, mine, weight_elements=ELEMENTS)
    assert len({min_replica_tokens_for(SPEC.weight_slot_bytes, synthetic_profile(r), weight_elements=ELEMENTS)
                for r in range(R)}) == R, "the synthetic profiles must give every rank a value of its own"
    with balancer("auto") as bal:
        assert bal.min_replica_tokens == expected, (bal.min_replica_tokens, expected, own)
        assert read_profile(profile_path(mine.device, mine.sm_share)) == mine  # read from the cache, not measured
        # the hottest expert's excess is well above the threshold: the plan replicates, never below it
        loads = np.full(LAYOUT.num_experts, 8, np.int32)
        loads[0] = 8 + 4 * expected
        handle = bal.update(0, local_loads=loads)
        plan = bal.plan(handle)
        plan.validate(min_replica_tokens=expected)
        replica_count = plan.replica_count.get() if hasattr(plan.replica_count, "get") else plan.replica_count
        assert int(replica_count[0]) > 1, "the hot expert got no replica"
    with balancer(5) as bal:
        assert bal.min_replica_tokens == 5
elif check == "measure":
    os.environ[CACHE_VARIABLE] = str(root / "shared")
    with balancer("auto") as bal:
        values = group.allgather(bal.min_replica_tokens)
        assert len(set(values)) == 1 and values[0] >= 1, values
        files = sorted((root / "shared").glob("profile-*.json"))
        assert len(files) >= 1 and read_profile(files[0]).backend == backend, files
        profile = read_profile(files[0])
        own = min_replica_tokens_for(SPEC.weight_slot_bytes, profile, weight_elements=ELEMENTS)
        assert values[0] >= own
elif check == "bad-input":
    for bad in ("fast", -1, 2.5, None):
        try:
            balancer(bad)
        except CollectiveError as exc:  # every rank's reason, said once for all
            assert str(exc).count("min_replica_tokens must be an int >= 0 and below 2**31 or 'auto'") == 1, str(exc)
            assert f"failed on {R} of {R} rank(s)" in str(exc), str(exc)
        else:
            raise AssertionError(f"min_replica_tokens={bad!r} was accepted")
else:
    raise SystemExit(f"unknown check {check!r}")
print(f"[{check}] rank {me} OK", flush=True)
