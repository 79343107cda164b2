"""The control plane: expert layout, the exact-load quota planner (NumPy reference and
CuPy kernel), reroute, baselines, lower bounds and load traces."""

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan
from ultraep.planner.quota import plan_placement
from ultraep.planner.reroute import reroute
from ultraep.planner import baselines, bound, traces  # noqa: F401  (bound imports SciPy lazily)

__all__ = ["ExpertLayout", "Plan", "plan_placement", "reroute"]
