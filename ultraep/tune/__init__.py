"""The tuning layer: what this machine's operations cost, and the choices made from it.

It owns

* the machine profile (:mod:`ultraep.tune.profile`): copy and peer-copy bandwidth, one
  warp's copy rate, the cost of a launch and of a flag handoff, the expert compute's time
  per call at a few sizes, the fused kernels' tasks run in the kernels themselves, the
  Dispatcher's resident copy blocks and, where ranks share a GPU, what they reach together,
  measured once per device and SM share by short micro-benchmarks (``host.py`` /
  ``device.py``) and cached as versioned JSON (``python -m ultraep.tune profile`` prints it);
* cost-aware replication (:mod:`ultraep.tune.replicas`): ``min_replica_tokens="auto"``,
  the smallest replica whose tokens save more time than its weight copy costs;
* the performance model (:mod:`ultraep.tune.model`) of weight sync, dispatch/combine and
  the fused kernels, vectorised over configurations, and the search over their knobs
  (:mod:`ultraep.tune.search`), memoised per token bucket, which chooses the fused
  kernels' configuration (:class:`ultraep.compute.fused.config.FusedConfig`,
  ``MoELayer(fused_config=)``) -- imported where used, so that the balancer's import of
  this package stays cheap; ``python -m ultraep.tune validate`` holds the model to
  measurements (:mod:`ultraep.tune.validate`, a benchmark tool above the layers it
  measures).

It sits above ``compute`` (whose grouped GEMM and fused kernels it measures) and
``runtime``, and models the ``transfer`` and ``token`` kernels from the profile without
importing them; ``integration`` resolves ``"auto"`` through it.
"""

from ultraep.tune.profile import (PROFILE_VERSION, ComputeCurve, FusedCosts, MachineProfile, load_profile,
                                  measure_profile, profile_path, read_profile, write_profile)
from ultraep.tune.replicas import NEVER, agreed_min_replica_tokens, min_replica_tokens_for

__all__ = ["NEVER", "PROFILE_VERSION", "ComputeCurve", "FusedCosts", "MachineProfile", "agreed_min_replica_tokens",
           "load_profile", "measure_profile", "min_replica_tokens_for", "profile_path", "read_profile", "write_profile"]
