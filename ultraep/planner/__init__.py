"""The control plane: expert layout, the exact-load quota planner (NumPy reference and
CuPy kernel) and reroute. Baselines, lower bounds and synthetic traces are in
:mod:`ultraep.analysis`."""

from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan
from ultraep.planner.quota import plan_placement
from ultraep.planner.reroute import reroute

__all__ = ["ExpertLayout", "Plan", "plan_placement", "reroute"]
