"""Analysis tools, beside the library and never on its runtime path: nothing under
``ultraep.runtime``, ``planner``, ``transfer``, ``token`` or ``integration`` imports them.

* ``bound``     -- proven lower bounds of the optimal max rank load (``lower_bound``) and
  of the replicas any plan needs to reach a load (``min_replicas_bound``), by MILP/LP
  with SciPy's HiGHS.
* ``baselines`` -- the policies the planner is compared with: no balancing, the
  force-balanced ideal, and EPLB.
* ``traces``    -- seeded synthetic load traces (Zipf, log-normal, drifting hotspot,
  domain switches, per-layer skew); the trace file format itself is
  :mod:`ultraep.integration.traces`.
* ``plots``     -- per-rank load plots of Balancer records and of ``bench plan`` replays.

SciPy and matplotlib are the optional extra ``analysis`` (``pip install ultraep[analysis]``),
imported only when a solver runs or a plot is drawn.
"""
