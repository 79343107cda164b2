"""The tuning layer: what this machine's operations cost, and the choices made from it.

It owns

* the machine profile (:mod:`ultraep.tune.profile`): copy and peer-copy bandwidth, the
  cost of a launch and the expert compute's time per call at a few sizes, measured once
  per device by short micro-benchmarks (``host.py`` / ``device.py``) and cached as
  versioned JSON (``python -m ultraep.tune profile`` prints it);
* cost-aware replication (:mod:`ultraep.tune.replicas`): ``min_replica_tokens="auto"``,
  the smallest replica whose tokens save more time than its weight copy costs.

It sits above ``compute`` (whose grouped GEMM it measures) and ``runtime``, and below
``integration``, which resolves ``"auto"`` through it.
"""

from ultraep.tune.profile import (PROFILE_VERSION, ComputeCurve, MachineProfile, load_profile, measure_profile,
                                  profile_path, read_profile, write_profile)
from ultraep.tune.replicas import NEVER, agreed_min_replica_tokens, min_replica_tokens_for

__all__ = ["NEVER", "PROFILE_VERSION", "ComputeCurve", "MachineProfile", "agreed_min_replica_tokens", "load_profile",
           "measure_profile", "min_replica_tokens_for", "profile_path", "read_profile", "write_profile"]
