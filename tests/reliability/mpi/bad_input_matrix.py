"""The bad-input matrix: every public entry point fed bad input from a table, run under
``mpiexec`` on the CPU backend by tests/reliability/test_bad_input_matrix.py.

Usage: ``mpiexec -n R python -m mpi4py bad_input_matrix.py [ENTRY ...]`` (default: every
table). Each case is one call with one bad argument, run with the bad input on every rank
(``all``) and, where the call is collective, on the last rank only (``one``); a local call
(no rank of its own: a layout, a plan, a grouped GEMM) runs once (``local``). A case
expects either an error of the documented type whose message names the cause (and, on
every rank, the rank at fault) or a correct result, compared with the same call on clean
input. Each observed outcome is classified:

* ``ok``      -- as expected;
* ``crash``   -- an exception the library did not raise on purpose (IndexError, AttributeError...);
* ``hang``    -- a rank gave up waiting for another (a timeout, a peer's failure) instead of
  the refusal; a case with no outcome within ``DEADLINE_S`` ends the job naming it;
* ``unclear`` -- a refusal of the wrong type, or whose message lacks the cause or the rank;
* ``silent``  -- a result where an error was due, or a result that differs from the clean run;
* ``xfail``   -- a known bug (the case names it), still failing; ``xpass`` when it no longer does.

Rank 0 prints every case that is not ``ok`` (an ``xfail`` with its bug) and a summary table (counts per
entry point and class); every rank prints ``[matrix] rank <r> OK <n> cases`` only when
nothing but ``ok`` and ``xfail`` was seen.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support

from ultraep import (Balancer, BalancerError, ClosedError, CollectiveError, DispatchError,  # noqa: E402
                     Dispatcher, EPGroup, ExpertLayout, ExpertSpec, GroupedGemmError, GroupMismatchError,
                     MoELayer, MoELayerError, Plan, RankFailedError, StaleHandleError, UltraEPError,
                     WeightTransfer, open_heap, plan_placement, reroute)
from ultraep.compute import grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad  # noqa: E402
from ultraep.runtime.dtypes import BFLOAT16  # noqa: E402
from ultraep.runtime.heap import HeapRequirements  # noqa: E402
from ultraep.token.torch_autograd import TokenRoute  # noqa: E402

TIMEOUT_S = 8.0     # every library wait in the matrix: a rank left alone gives up after this
DEADLINE_S = 60.0   # a case with no outcome by then is a hang the library did not bound
VERBOSE = bool(os.environ.get("MATRIX_VERBOSE"))  # every case named as it starts

WORLD = MPI.COMM_WORLD
HARNESS = WORLD.Dup()  # the harness's own exchanges never interleave with the library's
ME, R = WORLD.Get_rank(), WORLD.Get_size()
ODD = R - 1  # the rank that differs in a one-rank case
BOTH, ALL, LOCAL = ("all", "one"), ("all",), ("local",)


# -- expectations -----------------------------------------------------------------------------
@dataclass
class Raises:
    """An error of ``kind`` on every rank, its message holding ``fragments`` and naming the rank
    at fault (``rank=False``: a call that has no rank, e.g. a local check). ``peers``: the
    kind the other ranks raise where only one rank was bad, if not ``kind`` (e.g. a failure
    the bad rank publishes before a collective it cannot enter), with ``peer_fragments``
    in its message if not ``fragments`` (a peer that timed out knows who, not why)."""

    kind: type | tuple
    fragments: tuple = ()
    rank: bool = True
    peers: type | tuple | None = None
    peer_fragments: tuple | None = None

    def __init__(self, kind, *fragments, rank=True, peers=None, peer_fragments=None):
        self.kind, self.fragments, self.rank, self.peers = kind, fragments, rank, peers
        self.peer_fragments = peer_fragments


@dataclass
class Returns:
    """A result equal to the clean call's (``same``), or one ``check`` accepts."""

    check: Callable[[Any], bool] | None = None


@dataclass
class Case:
    entry: str
    name: str
    call: Callable[[bool], Any]  # call(bad): bad says whether this rank passes the bad input
    expect: Raises | Returns
    scopes: tuple = BOTH
    xfail: str | None = None     # the bug, while it is one


CASES: list[Case] = []


def case(entry, name, call, expect, scopes=BOTH, xfail=None):
    CASES.append(Case(entry, name, call, expect, scopes, xfail))


# -- the environment: a group and lazily built, reused objects ---------------------------------
LAYOUT = ExpertLayout(R, 2 * R, 2)
SPEC = ExpertSpec([("w", (4, 8), "float32")])
M = LAYOUT.experts_per_rank
H, F, TOKENS, TOP_K = 64, 32, 8, 2


class Env:
    """The objects the cases share. ``reset`` drops them all (without a collective close: a
    case may have left the group refusing collectives) and starts on a fresh communicator."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.group = EPGroup(WORLD.Dup(), use_gpu=False, timeout_s=TIMEOUT_S)
        self._cache: dict = {}

    def get(self, name, build):
        if name not in self._cache:
            self._cache[name] = build()
        return self._cache[name]


env = Env()


def hot_plan(expert: int = 0) -> Plan:
    loads = np.ones((R, LAYOUT.num_experts), np.int32)
    loads[:, expert] = 1000  # replicated into the redundant slots
    return plan_placement(loads, LAYOUT, min_replica_tokens=1)


def masters():
    return [[np.full((4, 8), ME * M + m + 1, dtype=np.float32)] for m in range(M)]


def zeros_grads():
    return [[np.zeros((4, 8), np.float32)] for _ in range(M)]


def heap():
    """A heap for the allocation cases (room for many small tensors)."""
    return env.get("heap", lambda: open_heap(env.group, 1 << 20, backend="host"))


def closed_heap():
    def build():
        h = open_heap(env.group, 1 << 16, backend="host")
        tensor, signals = h.alloc("t", (R, 4), np.float32), h.alloc_signals("s", 2)
        kept = tensor.local
        kept[...] = ME + 1.0
        h.close()
        return h, tensor, signals, kept
    return env.get("closed_heap", build)


def engine():
    """A WeightTransfer with layer 0 registered, in a heap of its own."""
    def build():
        h = open_heap(env.group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="host")
        e = WeightTransfer(h, LAYOUT, SPEC, timeout_s=TIMEOUT_S)
        e.master_grads = zeros_grads()  # the harness's handle on layer 0's gradients
        e.register_layer(0, masters(), e.master_grads)
        return e
    return env.get("engine", build)


def closed_engine():
    def build():
        h = open_heap(env.group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="host")
        e = WeightTransfer(h, LAYOUT, SPEC, timeout_s=TIMEOUT_S)
        e.register_layer(0, masters(), zeros_grads())
        e.close()
        return e
    return env.get("closed_engine", build)


def balancer(name="balancer"):
    """A Balancer (host backend, its own heap) with layer 0 registered and one micro-batch synced."""
    def build():
        b = Balancer(env.group, LAYOUT, SPEC, num_layers=2, min_replica_tokens=1, backend="host",
                     timeout_s=TIMEOUT_S)
        b.register_layer(0, masters(), zeros_grads())
        b.register_layer(1, masters(), zeros_grads())
        return b
    return env.get(name, build)


def fresh_handle(b=None, layer=0):
    """A handle of a new micro-batch of ``layer``, synced (the replica buffers hold it)."""
    b = b or balancer()
    handle = b.update(layer, local_loads=hot_plan(0).loads[ME])
    b.weight_sync(handle)
    return handle


def closed_balancer():
    def build():
        b = Balancer(env.group, LAYOUT, SPEC, num_layers=1, min_replica_tokens=1, backend="host",
                     timeout_s=TIMEOUT_S)
        b.register_layer(0, masters(), zeros_grads())
        handle = fresh_handle(b)
        views = b.replica_weights(handle)
        b.close()
        return b, handle, views
    return env.get("closed_balancer", build)


def dispatcher(expert_output=False):
    name = "dispatcher_eo" if expert_output else "dispatcher"
    return env.get(name, lambda: Dispatcher(env.group, hidden=16, dtype="float32", top_k=TOP_K,
                                            num_experts=2 * R, max_tokens=TOKENS, backend="host",
                                            timeout_s=TIMEOUT_S, expert_output=expert_output))


def tokens(seed=0):
    """x, ids, gates of this rank's micro-batch (every expert on every rank used)."""
    rng = np.random.default_rng(100 * seed + ME)
    x = rng.standard_normal((TOKENS, 16)).astype(np.float32)
    ids = np.stack([(np.arange(TOKENS) + k) % (2 * R) for k in range(TOP_K)], axis=1).astype(np.int64)
    gates = rng.random((TOKENS, TOP_K)).astype(np.float32) + 0.5
    return x, ids, gates


def closed_dispatcher():
    def build():
        d = Dispatcher(env.group, hidden=16, dtype="float32", top_k=TOP_K, num_experts=2 * R, max_tokens=TOKENS,
                       backend="host", timeout_s=TIMEOUT_S)
        d.close()
        return d
    return env.get("closed_dispatcher", build)


def moe_layer(balanced=False):
    def build():
        bal = None
        if balanced:
            bal = Balancer(env.group, LAYOUT, MoELayer.expert_spec(H, F), num_layers=1, min_replica_tokens=1,
                           backend="host", timeout_s=TIMEOUT_S)
        layer = MoELayer(env.group, hidden=H, ffn=F, num_experts=2 * R, top_k=TOP_K, max_tokens=TOKENS,
                         balancer=bal, backend="host", timeout_s=TIMEOUT_S)
        rng = np.random.default_rng(7 + ME)
        layer.load_weights((rng.standard_normal((M, H, 2 * F)) / 8).astype(BFLOAT16),
                           (rng.standard_normal((M, F, H)) / 8).astype(BFLOAT16))
        return layer
    return env.get("moe_balanced" if balanced else "moe", build)


def moe_tokens(seed=0):
    rng = np.random.default_rng(200 * seed + ME)
    x = rng.standard_normal((TOKENS, H)).astype(BFLOAT16)
    ids = np.stack([(np.arange(TOKENS) * 3 + k) % (2 * R) for k in range(TOP_K)], axis=1).astype(np.int64)
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % (2 * R), ids[:, 1])
    gates = rng.random((TOKENS, TOP_K)).astype(np.float32)
    return x, ids, gates


def bf16(shape, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) / 4).astype(BFLOAT16)


def noncontiguous(array):
    """The same values, every other column of a twice-as-wide array (not C-contiguous)."""
    wide = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
    wide[..., ::2] = array
    return wide[..., ::2]


def readonly(array):
    array = array.copy()
    array.flags.writeable = False
    return array


def pick(bad, worse, good):
    return worse if bad else good


# -- EPGroup ---------------------------------------------------------------------------------------
def new_group(**kwargs):
    return EPGroup(WORLD.Dup(), use_gpu=False, **kwargs)


for value in (0, -1.0, math.nan, math.inf, "10", True):
    case("EPGroup", f"timeout_s={value!r}", lambda bad, v=value: new_group(timeout_s=pick(bad, v, TIMEOUT_S)),
         Raises(CollectiveError, "EP group creation", "timeout_s must be a positive, finite number"))
case("EPGroup", "timeout_s differs", lambda bad: new_group(timeout_s=pick(bad, 5.0, TIMEOUT_S)),
     Raises(GroupMismatchError, "ranks disagree on EP group timeout_s"), scopes=("one",))
case("EPGroup", "comm without allgather", lambda bad: EPGroup(object() if bad else None),
     Raises(TypeError, "allgather", rank=False), scopes=ALL)
case("EPGroup", "device on a CPU-only rank", lambda bad: EPGroup(WORLD.Dup(), device=pick(bad, 3, None)),
     Raises(CollectiveError, "EP group creation", "device 3 requested"))
# A refused timeout travels in the group's collective itself: every rank raises it, naming the rank.
for value in (0, -2, math.nan, "1"):
    case("EPGroup", f"barrier(timeout_s={value!r})",
         lambda bad, v=value: env.group.barrier(timeout_s=pick(bad, v, 1.0)),
         Raises(CollectiveError, "timeout_s must be a positive"))
case("EPGroup", "allgather(timeout_s=0)", lambda bad: env.group.allgather(ME, timeout_s=pick(bad, 0, 1.0)),
     Raises(CollectiveError, "timeout_s must be a positive"))
case("EPGroup", "agree on differing values", lambda bad: env.group.agree(pick(bad, "b", "a"), "the test value"),
     Raises(GroupMismatchError, "ranks disagree on the test value"), scopes=("one",))
case("EPGroup", "raise_if_any", lambda bad: env.group.raise_if_any(pick(bad, f"rank {ME}: broken", None), "check"),
     Raises(CollectiveError, "check failed on", "broken"))


# -- open_heap / SymmetricHeap ------------------------------------------------------------------------
for value in (0, -4096, 1.5, "4096", True, None):
    case("open_heap", f"size={value!r}", lambda bad, v=value: open_heap(env.group, pick(bad, v, 4096), backend="host"),
         Raises(CollectiveError, "symmetric heap creation", "heap size must be"))
case("open_heap", "size differs", lambda bad: open_heap(env.group, pick(bad, 8192, 4096), backend="host"),
     Raises(GroupMismatchError, "ranks disagree on symmetric heap size"), scopes=("one",))
for value in ("gpu", "device", None):
    case("open_heap", f"backend={value!r}",
         lambda bad, v=value: open_heap(env.group, 4096, backend=pick(bad, v, "host")),
         Raises(CollectiveError, "symmetric heap backend"))
case("open_heap", "group a communicator", lambda bad: open_heap(WORLD if bad else env.group, 4096, backend="host"),
     Raises(TypeError, "EPGroup", rank=False), scopes=ALL)
case("open_heap", "too many signal flags",
     lambda bad: open_heap(env.group, HeapRequirements.of(signals=[("s", pick(bad, 1 << 20, 4))]), backend="host"),
     Raises(CollectiveError, "signal flags"))
_allocs = iter(range(10**6))
for name, shape, dtype, text in (("shape (0, 4)", (0, 4), np.float32, "every dimension must be a positive int"),
                                 ("shape (-1,)", (-1,), np.float32, "every dimension must be a positive int"),
                                 ("shape (4, 2.5)", (4, 2.5), np.float32, "every dimension must be a positive int"),
                                 ("shape 'x'", "x", np.float32, "every dimension must be a positive int"),
                                 ("dtype 'nope'", (4,), "nope", "dtype"),
                                 ("dtype object", (4,), object, "dtype"),
                                 ("out of space", (1 << 30,), np.float32, "heap out of space")):
    kind = CollectiveError if "space" not in text else UltraEPError
    case("SymmetricHeap", f"alloc {name}",
         lambda bad, s=shape, d=dtype: heap().alloc(f"a{next(_allocs)}", pick(bad, s, (4,)), pick(bad, d, np.float32)),
         Raises(kind, text), scopes=ALL if "space" in text else BOTH)
case("SymmetricHeap", "alloc shape differs",
     lambda bad: heap().alloc(f"a{next(_allocs)}", pick(bad, (8,), (4,)), np.float32),
     Raises(GroupMismatchError, "ranks disagree on heap allocation request"), scopes=("one",))
case("SymmetricHeap", "alloc a name twice", lambda bad: [heap().alloc(n, (4,), np.float32) for n in
                                                         (("dup", "dup") if bad else (f"a{next(_allocs)}",))],
     Raises(CollectiveError, "already allocated"), scopes=ALL)
for value in (0, -1, "2", 2.0):
    case("SymmetricHeap", f"alloc_signals count={value!r}",
         lambda bad, v=value: heap().alloc_signals(f"s{next(_allocs)}", pick(bad, v, 1)),
         Raises(CollectiveError, "signal count must be a positive int"))
# The heap barrier is flags in the heap, not a group collective: a refusing rank still signals,
# its flag carrying the cause, so its peers raise that cause at once (well within their timeout).
for value in (0, -1, math.inf):
    case("SymmetricHeap", f"barrier(timeout_s={value!r})", lambda bad, v=value: heap().barrier(pick(bad, v, 1.0)),
         Raises(ValueError, "heap barrier", "timeout_s must be a positive", peers=RankFailedError))
for name, value in (("out of range", R), ("a float", 1.0)):
    case("SymmetricHeap", f"peer(rank {name})", lambda bad, v=value: heap().alloc(f"a{next(_allocs)}", (4,),
                                                                                   np.float32).peer(pick(bad, v, 0)),
         Raises(IndexError, f"rank must be an int in [0, {R}) (the group's ranks), got {value!r}", rank=False),
         scopes=ALL)
case("SymmetricHeap", "alloc a name not a str", lambda bad: heap().alloc(pick(bad, 5, f"a{next(_allocs)}"), (4,),
                                                                           np.float32),
     Raises(CollectiveError, "a heap tensor's name must be a str"), scopes=ALL)
case("SymmetricHeap", ".local after close", lambda bad: closed_heap()[1].local,
     Raises(ClosedError, "tensor 't'", "closed"), scopes=LOCAL)
case("SymmetricHeap", ".peer() after close", lambda bad: closed_heap()[1].peer(0),
     Raises(ClosedError, "tensor 't'", "closed"), scopes=LOCAL)
case("SymmetricHeap", "signals after close", lambda bad: closed_heap()[2].local,
     Raises(ClosedError, "signal block 's'", "closed"), scopes=LOCAL)
case("SymmetricHeap", "barrier after close", lambda bad: closed_heap()[0].barrier(), Raises(ClosedError, "closed"),
     scopes=LOCAL)
case("SymmetricHeap", "alloc after close", lambda bad: closed_heap()[0].alloc("x", (4,), np.float32),
     Raises(ClosedError, "closed"), scopes=LOCAL)
case("SymmetricHeap", "close twice", lambda bad: closed_heap()[0].close(), Returns(), scopes=LOCAL)
case("SymmetricHeap", "a view kept across close stays readable", lambda bad: float(closed_heap()[3].sum()),
     Returns(lambda total: total == 4 * R * (ME + 1.0)), scopes=LOCAL)
case("SymmetricHeap", "DLPack export after close", lambda bad: closed_heap()[1].__dlpack__(),
     Raises(ClosedError, "closed"), scopes=LOCAL)


# -- ExpertLayout / plan_placement / Plan.validate / reroute (local) ---------------------------------
for args, text in (((0, 4, 1), "num_ranks must be >= 1"), (("2", 4, 1), "num_ranks must be an integer"),
                   ((True, 4, 1), "num_ranks must be an integer"), ((2, 4.0, 1), "num_experts must be an integer"),
                   ((2, 5, 1), "must be divisible by num_ranks"), ((2, 4, -1), "redundant_slots must be >= 0"),
                   ((4, 8, 1, 3), "domain_size (3) must divide num_ranks"), ((4, 8, 1, 2, 3), "cannot exceed"),
                   ((4, 8, 1, 2, 0), "max_instances must be >= 1"), ((2, 2**32, 1), "must fit in int32"),
                   ((2, 4, None), "redundant_slots must be an integer")):
    case("ExpertLayout", f"ExpertLayout{args}", lambda bad, a=args: ExpertLayout(*a),
         Raises(ValueError, text, rank=False),
         scopes=LOCAL)
case("ExpertLayout", "setattr", lambda bad: setattr(LAYOUT, "num_ranks", 3), Raises(AttributeError, "immutable",
                                                                                   rank=False), scopes=LOCAL)

PLAN_LAYOUT = ExpertLayout(2, 4, 1)
CLEAN_LOADS = np.array([[5, 1, 2, 3], [7, 1, 0, 2]], np.int32)


def planned(loads, **options):
    plan = plan_placement(loads, PLAN_LAYOUT, backend="host", **options)
    return plan.log_to_phys, plan.quota, plan.split_prefix, plan.rank_load


for name, loads, text in (("shape (4, 2)", CLEAN_LOADS.T.copy(), "loads must have shape"),
                          ("1-D", CLEAN_LOADS.ravel(), "loads must have shape"),
                          ("float", CLEAN_LOADS.astype(np.float64), "integer dtype"),
                          ("NaN", np.where(CLEAN_LOADS == 0, np.nan, CLEAN_LOADS), "NaN"),
                          ("inf", np.where(CLEAN_LOADS == 0, np.inf, CLEAN_LOADS), "integer dtype"),
                          ("negative", CLEAN_LOADS - 3, "non-negative"),
                          ("uint64 2**63", CLEAN_LOADS.astype(np.uint64) + np.uint64(2**63),
                           "a load of 9223372036854775"),
                          ("int64 total 2**31", np.full((2, 4), 2**28 + 1, np.int64), "total load"),
                          ("bool", CLEAN_LOADS > 1, "integer dtype"),
                          ("strings", CLEAN_LOADS.astype(str), "integer dtype"),
                          ("None", None, "loads must have shape")):
    case("plan_placement", f"loads {name}", lambda bad, lo=loads: planned(lo), Raises(ValueError, text, rank=False),
         scopes=LOCAL)
for name, options, text in (("backend='gpu'", {"backend": "gpu"}, "backend must be one of"),
                            ("min_replica_tokens=-1", {"min_replica_tokens": -1}, "min_replica_tokens"),
                            ("min_replica_tokens='auto'", {"min_replica_tokens": "auto"}, "min_replica_tokens_for"),
                            ("min_replica_tokens=1.5", {"min_replica_tokens": 1.5}, "min_replica_tokens"),
                            ("target_imbalance=0.5", {"target_imbalance": 0.5}, "target_imbalance"),
                            ("target_imbalance=nan", {"target_imbalance": math.nan}, "target_imbalance"),
                            ("tau_tolerance=-1", {"tau_tolerance": -1}, "tau_tolerance"),
                            ("fit_first='yes'", {"fit_first": "yes"}, "fit_first"),
                            ("unknown option", {"speed": 3}, "speed")):
    backend = options.pop("backend", "host")
    case("plan_placement", name, lambda bad, o=options, b=backend:
         plan_placement(CLEAN_LOADS, PLAN_LAYOUT, backend=b, **o), Raises((ValueError, TypeError), text, rank=False),
         scopes=LOCAL)
case("plan_placement", "layout is a tuple", lambda bad: plan_placement(CLEAN_LOADS, (2, 4, 1), backend="host"),
     Raises(ValueError, "layout must be an ExpertLayout", rank=False), scopes=LOCAL)
case("plan_placement", "out of another layout", lambda bad: plan_placement(
    CLEAN_LOADS, PLAN_LAYOUT, backend="host", out=hot_plan()), Raises(ValueError, "another layout", rank=False),
    scopes=LOCAL)
for name, out, error, text in (
        ("out a string", "x", TypeError, "out must be a Plan from the planner's empty_plan, got str"),
        ("out a dict", {}, TypeError, "got dict"),
        ("out with a read-only quota", "read-only quota", ValueError, "out.quota: array is read-only")):
    case("plan_placement", name, lambda bad, o=out: plan_placement(
        CLEAN_LOADS, PLAN_LAYOUT, backend="host", out=read_only_quota_plan() if o == "read-only quota" else o),
        Raises(error, text, rank=False), scopes=LOCAL)
for name, variant in (("int64 loads", CLEAN_LOADS.astype(np.int64)), ("uint8 loads", CLEAN_LOADS.astype(np.uint8)),
                      ("list loads", CLEAN_LOADS.tolist()), ("Fortran-order loads", np.asfortranarray(CLEAN_LOADS))):
    case("plan_placement", name, lambda bad, v=variant: planned(v if bad else CLEAN_LOADS), Returns(), scopes=LOCAL)


def read_only(array):
    array.setflags(write=False)
    return array


def read_only_quota_plan():
    plan = plan_placement(CLEAN_LOADS, PLAN_LAYOUT, backend="host")
    read_only(plan.quota)
    return plan


def broken_plan(edit):
    plan = plan_placement(CLEAN_LOADS, PLAN_LAYOUT, backend="host")
    edit(plan)
    return plan.validate()


for name, edit, text in (
        ("quota changed", lambda p: p.quota.__setitem__((0, 0), p.quota[0, 0] + 1), "quotas do not sum"),
        ("negative quota", lambda p: p.quota.__setitem__((1, 0), -1), "quota"),
        ("master moved", lambda p: p.log_to_phys.__setitem__((0, 0), 1), "log_to_phys"),
        ("replica_count 0", lambda p: p.replica_count.__setitem__(0, 0), "replica_count out of [1, K]"),
        ("phys_to_log wrong", lambda p: p.phys_to_log.__setitem__(0, 3), "master slot holds the wrong expert"),
        ("split_prefix decreasing", lambda p: p.split_prefix.__setitem__((0, 0, 0), p.split_prefix[0, 0, 0] + 50),
         "split"),
        ("rank_load wrong", lambda p: p.rank_load.__setitem__(0, p.rank_load[0] + 1), "rank_load"),
        ("loads of another shape", lambda p: setattr(p, "loads", p.loads[:1]), "loads has shape"),
        ("quota of another dtype", lambda p: setattr(p, "quota", p.quota.astype(np.int64)), "quota has dtype")):
    case("Plan.validate", name, lambda bad, e=edit: broken_plan(e), Raises(AssertionError, text, rank=False),
         scopes=LOCAL)
case("Plan.validate", "clean plan", lambda bad: broken_plan(lambda p: None), Returns(), scopes=LOCAL)

REROUTE_PLAN = plan_placement(CLEAN_LOADS, PLAN_LAYOUT, backend="host")
CLEAN_IDS = np.repeat(np.arange(4), CLEAN_LOADS[0]).astype(np.int64).reshape(-1, 1)
for name, args, error, text in (
        ("plan 'plan'", (CLEAN_IDS, "plan", 0), TypeError, "plan must be a Plan"),
        ("plan None", (CLEAN_IDS, None, 0), TypeError, "plan must be a Plan"),
        ("rank -1", (CLEAN_IDS, REROUTE_PLAN, -1), ValueError, "rank must be an integer in [0, 2)"),
        ("rank 2", (CLEAN_IDS, REROUTE_PLAN, 2), ValueError, "rank must be an integer in [0, 2)"),
        ("rank True", (CLEAN_IDS, REROUTE_PLAN, True), ValueError, "rank must be an integer"),
        ("rank '0'", (CLEAN_IDS, REROUTE_PLAN, "0"), ValueError, "rank must be an integer"),
        ("float ids", (CLEAN_IDS.astype(np.float32), REROUTE_PLAN, 0), ValueError, "integer dtype"),
        ("id 4", (np.where(CLEAN_IDS == 3, 4, CLEAN_IDS), REROUTE_PLAN, 0), ValueError, "must lie in [0, 4)"),
        ("id -1", (np.where(CLEAN_IDS == 3, -1, CLEAN_IDS), REROUTE_PLAN, 0), ValueError, "must lie in [0, 4)"),
        ("more tokens than planned", (np.vstack([CLEAN_IDS, [[0]]]), REROUTE_PLAN, 0), ValueError,
         "more tokens to an expert than loads[0]"),
        ("out of the wrong dtype", (CLEAN_IDS, REROUTE_PLAN, 0, np.zeros(CLEAN_IDS.shape, np.int64)), ValueError,
         f"out must be an int32 array of shape {CLEAN_IDS.shape}, got int64"),
        ("out read-only", (CLEAN_IDS, REROUTE_PLAN, 0, read_only(np.zeros(CLEAN_IDS.shape, np.int32))), ValueError,
         "out: array is read-only"),
        ("out a list", (CLEAN_IDS, REROUTE_PLAN, 0, [[0]] * len(CLEAN_IDS)), TypeError,
         f"out must be an int32 array of shape {CLEAN_IDS.shape}, got list"),
        ("out a string", (CLEAN_IDS, REROUTE_PLAN, 0, "out"), TypeError, "got str")):
    case("reroute", name, lambda bad, a=args: reroute(*a[:3], **({"out": a[3]} if len(a) > 3 else {})),
         Raises(error, text, rank=False), scopes=LOCAL)
def rerouted_into(strided: bool):
    """reroute into a fresh out: a column of a wider array (the host writes it by index) or a plain one."""
    out = np.zeros((CLEAN_IDS.shape[0], 2), np.int32)[:, :1] if strided else np.zeros(CLEAN_IDS.shape, np.int32)
    return reroute(CLEAN_IDS, REROUTE_PLAN, 0, out=out).ravel()


case("reroute", "a strided out", rerouted_into, Returns(), scopes=LOCAL)
for name, variant in (("int32 ids", CLEAN_IDS.astype(np.int32)), ("uint16 ids", CLEAN_IDS.astype(np.uint16)),
                      ("ids as a 1-D list", CLEAN_IDS.ravel().tolist())):
    case("reroute", name, lambda bad, v=variant: np.asarray(reroute(v if bad else CLEAN_IDS, REROUTE_PLAN, 0)).ravel(),
         Returns(), scopes=LOCAL)


# -- ExpertSpec / WeightTransfer ----------------------------------------------------------------------
for name, args, text in ((("no tensors"), ([],), "at least one tensor"),
                         ("entry not a tuple", (["w"],), "entries are (name, shape, dtype)"),
                         ("five fields", ([("w", (4,), "float32", "x", "y")],), "entries are"),
                         ("zero dimension", ([("w", (4, 0), "float32")],), "every dimension must be a positive int"),
                         ("dimension 8.7", ([("w", (4, 8.7), "float32")],), "every dimension must be a positive int"),
                         ("dimension True", ([("w", (4, True), "float32")],), "every dimension must be a positive int"),
                         ("shape None", ([("w", None, "float32")],), "every dimension must be a positive int"),
                         ("dtype None", ([("w", (4,), None)],), "expert tensor 'w' dtype is None"),
                         ("gradient dtype None", ([("w", (4,), "float32")], None), "gradient dtype is None"),
                         ("names repeat", ([("w", (4,), "float32"), ("w", (2,), "float32")],), "names repeat"),
                         ("dtype 'nope'", ([("w", (4,), "nope")],), "dtype"),
                         ("int gradients", ([("w", (4,), "float32")], "int32"), "gradient dtype must be a float"),
                         ("FP8 gradients", ([("w", (4,), "float32")], "float8_e4m3fn"), "is not supported"),
                         ("scale of a float32 weight", ([("w", (128, 128), "float32"),
                                                         ("s", (1, 1), "float32", "w")],), "only FP8 weights"),
                         ("transposed scale", ([("w", (256, 128), "float8_e4m3fn"),
                                                ("s", (1, 2), "float32", "w")],), "not one value per square block")):
    case("ExpertSpec", name, lambda bad, a=args: ExpertSpec(*a), Raises(ValueError, text, rank=False), scopes=LOCAL)


def new_engine(**kwargs):
    """A WeightTransfer in a heap with no room for a second: only a refused set-up may be asked for."""
    with open_heap(env.group, WeightTransfer.heap_requirements(LAYOUT, SPEC), backend="host") as h:
        WeightTransfer(h, kwargs.pop("layout", LAYOUT), kwargs.pop("spec", SPEC), **{"timeout_s": TIMEOUT_S, **kwargs})


for name, kwargs, text in (("layout of 2R ranks", {"layout": ExpertLayout(2 * R, 4 * R, 1)}, "ranks but the heap"),
                           ("tile_bytes=100", {"tile_bytes": 100}, "tile_bytes must be a positive multiple of 256"),
                           ("tile_bytes='4096'", {"tile_bytes": "4096"}, "tile_bytes"),
                           ("relay_threshold=0", {"relay_threshold": 0}, "relay_threshold and relay_count"),
                           ("relay_count=-1", {"relay_count": -1}, "relay_threshold and relay_count"),
                           ("timeout_s=0", {"timeout_s": 0}, "timeout_s must be a positive"),
                           ("timeout_s=nan", {"timeout_s": math.nan}, "timeout_s must be a positive"),
                           ("blocks=0", {"blocks": 0}, "blocks"),
                           ("layout a tuple", {"layout": (R, 2 * R, 2)}, "layout"),
                           ("chunk_tiles=0", {"chunk_tiles": 0}, "chunk_tiles"),
                           ("spec a list", {"spec": [("w", (4, 8), "float32")]}, "spec must be an ExpertSpec")):
    case("WeightTransfer", f"set-up {name}", lambda bad, k=kwargs: new_engine(**(k if bad else {})),
         Raises(CollectiveError, "WeightTransfer set-up", text))
case("WeightTransfer", "set-up timeout_s differs", lambda bad: new_engine(timeout_s=pick(bad, 5.0, TIMEOUT_S)),
     Raises(GroupMismatchError, "ranks disagree on WeightTransfer set-up"), scopes=("one",))
for name, weights, grads, text in (
        ("one master short", lambda: masters()[:-1], zeros_grads, "expected"),
        ("weight of another shape", lambda: [[np.zeros((8, 4), np.float32)] for _ in range(M)], zeros_grads, "shape"),
        ("weight of another dtype", lambda: [[np.zeros((4, 8), np.float64)] for _ in range(M)], zeros_grads, "dtype"),
        ("weight not a tensor", lambda: [["w"] for _ in range(M)], zeros_grads, "is not a tensor"),
        ("non-contiguous weight", lambda: [[noncontiguous(np.ones((4, 8), np.float32))] for _ in range(M)],
         zeros_grads, "not C-contiguous"),
        ("read-only gradient", masters, lambda: [[readonly(np.zeros((4, 8), np.float32))] for _ in range(M)],
         "read-only")):
    case("WeightTransfer", f"register_layer {name}",
         lambda bad, w=weights, g=grads: engine().register_layer(5, w() if bad else masters(), g() if bad else
                                                                  zeros_grads()),
         Raises(CollectiveError, "register_layer(5)", text))
for value in ("0", 1.5, None):
    case("WeightTransfer", f"register_layer layer={value!r}", lambda bad, v=value: engine().register_layer(
        pick(bad, v, 5), masters(), zeros_grads()), Raises(CollectiveError, "register_layer(", "layer must be an int"))
case("WeightTransfer", "register_layer ids differ", lambda bad: engine().register_layer(pick(bad, 7, 6), masters(),
                                                                                        zeros_grads()),
     Raises(GroupMismatchError, "registered layer id"), scopes=("one",))
for call in ("weight_sync", "reduce_grads", "restore"):
    for name, layer, plan, kwargs, text in (
            ("an unregistered layer", 9, hot_plan, {}, "layer 9 has no registered master"),
            ("a plan of another layout", 0, lambda: REROUTE_PLAN, {}, "plan is for ExpertLayout(num_ranks=2"),
            ("plan 'plan'", 0, lambda: "plan", {}, "plan must be a Plan"),
            ("blocks=0", 0, hot_plan, {"blocks": 0}, "blocks")):
        case("WeightTransfer", f"{call} {name}", lambda bad, c=call, lay=layer, p=plan, k=kwargs:
             getattr(engine(), c)(lay if bad else 0, p() if bad else hot_plan(), **(k if bad else {})),
             Raises(CollectiveError, f"{call.replace('restore', 'weight_sync')}(", text))
    case("WeightTransfer", f"{call} plan differs",
         lambda bad, c=call: getattr(engine(), c)(0, hot_plan(pick(bad, 1, 0))),
         Raises(GroupMismatchError, "ranks disagree on", "hash of the plan"), scopes=("one",))
    case("WeightTransfer", f"{call} after close", lambda bad, c=call: getattr(closed_engine(), c)(0, hot_plan()),
         Raises(ClosedError, "WeightTransfer is closed"), scopes=LOCAL)
for value in (-1, 2, "0"):
    case("WeightTransfer", f"replica_weights({value!r})", lambda bad, v=value: engine().replica_weights(v),
         Raises((IndexError, TypeError), "slot"), scopes=LOCAL)
case("WeightTransfer", "replica_grads(2)", lambda bad: engine().replica_grads(2), Raises(IndexError, "slot"),
     scopes=LOCAL)
case("WeightTransfer", "wait_replica(slots=range(0, 9))", lambda bad: engine().wait_replica(0, hot_plan(), range(9)),
     Raises(IndexError, "replica slots must be a range"), scopes=LOCAL)
case("WeightTransfer", "replica_weights after close", lambda bad: closed_engine().replica_weights(0),
     Raises(ClosedError, "WeightTransfer is closed"), scopes=LOCAL)
case("WeightTransfer", "gradients not added twice", lambda bad: stale_gradient_sums(),
     Returns(lambda sums: sums[0] == sums[1]), scopes=ALL)


def stale_gradient_sums():
    """A micro-batch that writes no replica gradient adds nothing (reduce_grads zeroes the slots)."""
    e, plan = engine(), hot_plan()
    e.weight_sync(0, plan)
    for slot in range(LAYOUT.redundant_slots):
        e.replica_grads(slot)[0][...] = 1.0
    e.reduce_grads(0, plan)
    first = [float(g[0].sum()) for g in e.master_grads]
    e.reduce_grads(0, plan)  # a micro-batch that wrote no replica gradient
    return first, [float(g[0].sum()) for g in e.master_grads]


# -- Balancer -------------------------------------------------------------------------------------------
def new_balancer(**kwargs):
    args = {"layout": LAYOUT, "spec": SPEC, "num_layers": 1, "min_replica_tokens": 1, "backend": "host",
            "timeout_s": TIMEOUT_S, **kwargs}
    b = Balancer(env.group, args.pop("layout"), args.pop("spec"), **args)
    value = b.min_replica_tokens
    b.close()
    return value


for name, kwargs, text in (
        ("layout a tuple", {"layout": (R, 2 * R, 2)}, "layout must be an ExpertLayout"),
        ("layout of 2R ranks", {"layout": ExpertLayout(2 * R, 4 * R, 1)}, "ranks, the group"),
        ("spec a list", {"spec": [("w", (4, 8), "float32")]}, "spec must be an ExpertSpec"),
        ("num_layers=0", {"num_layers": 0}, "num_layers must be an int >= 1"),
        ("num_layers=1.0", {"num_layers": 1.0}, "num_layers must be an int"),
        ("max_in_flight=0", {"max_in_flight": 0}, "max_in_flight must be an int >= 1"),
        ("min_replica_tokens=-1", {"min_replica_tokens": -1}, "min_replica_tokens must be an int >= 0"),
        ("min_replica_tokens='fast'", {"min_replica_tokens": "fast"}, "or 'auto'"),
        ("min_replica_tokens=nan", {"min_replica_tokens": math.nan}, "min_replica_tokens"),
        ("history=-1", {"history": -1}, "history must be an int >= 0"),
        ("heap a dict", {"heap": {}}, "heap must be a SymmetricHeap"),
        ("backend='gpu'", {"backend": "gpu"}, "backend must be one of"),
        ("timeout_s=0", {"timeout_s": 0}, "timeout_s must be a positive"),
        ("timeout_s='8'", {"timeout_s": "8"}, "timeout_s"),
        ("transfer_options tile_bytes=100", {"transfer_options": {"tile_bytes": 100}}, "tile_bytes"),
        ("transfer_options unknown", {"transfer_options": {"speed": 1}}, "speed"),
        ("transfer_options a list", {"transfer_options": [("tile_bytes", 256)]}, "transfer_options")):
    case("Balancer", f"set-up {name}", lambda bad, k=kwargs: new_balancer(**(k if bad else {})),
         Raises(CollectiveError, text))
case("Balancer", "set-up timeout_s differs", lambda bad: new_balancer(timeout_s=pick(bad, 5.0, TIMEOUT_S)),
     Raises(GroupMismatchError, "ranks disagree on WeightTransfer set-up"), scopes=("one",))
case("Balancer", "set-up min_replica_tokens differs", lambda bad: new_balancer(min_replica_tokens=pick(bad, 2, 1)),
     Raises(GroupMismatchError, "ranks disagree on Balancer set-up"), scopes=("one",))
case("Balancer", "set-up heap of the wrong backend contradicted",
     lambda bad: new_balancer(heap=heap(), backend=pick(bad, "device", "auto")),
     Raises(CollectiveError, "contradicts the heap's backend"))


case("Balancer", "set-up min_replica_tokens='auto'", lambda bad: new_balancer(min_replica_tokens="auto"),
     Returns(lambda value: isinstance(value, int) and value >= 0), scopes=ALL)
case("Balancer", "set-up 'auto' on one rank", lambda bad: new_balancer(min_replica_tokens=pick(bad, "auto", 1)),
     Raises(GroupMismatchError, "ranks disagree on Balancer set-up"), scopes=("one",))

HOT_IDS = np.repeat(np.arange(2 * R), [60] + [4] * (2 * R - 1)).reshape(-1, 2).astype(np.int64)
HOT_LOADS = np.bincount(HOT_IDS.ravel(), minlength=2 * R).astype(np.int32)


def plan_of(handle, b=None):
    plan = (b or balancer()).plan(handle)
    return plan.log_to_phys.copy(), plan.quota.copy(), plan.split_prefix.copy()


def update(bad, bad_kwargs, layer=0):
    b = balancer()
    clean = {"topk_ids": HOT_IDS} if "topk_ids" in bad_kwargs else {"local_loads": HOT_LOADS}
    kwargs = bad_kwargs if bad else clean
    return plan_of(b.update(kwargs.pop("layer", layer), **{k: v for k, v in kwargs.items()}), b)


BIG = np.array([2**62] + [1] * (2 * R - 1), np.int64)
for name, kwargs, text in (
        ("ids float", {"topk_ids": HOT_IDS.astype(np.float32)}, "expected an integer dtype"),
        ("ids 99", {"topk_ids": np.where(HOT_IDS == 1, 99, HOT_IDS)}, "99"),
        ("ids -1", {"topk_ids": np.where(HOT_IDS == 1, -1, HOT_IDS)}, "-1"),
        ("ids uint64 2**63", {"topk_ids": np.where(HOT_IDS == 1, np.uint64(2**63), HOT_IDS.astype(np.uint64))},
         "9223372036854775808"),
        ("ids a string", {"topk_ids": "ids"}, "is not a tensor"),
        ("ids non-contiguous", {"topk_ids": noncontiguous(HOT_IDS)}, "not C-contiguous"),
        ("loads shape (E+1,)", {"local_loads": np.append(HOT_LOADS, 1)}, "local_loads: expected integer shape"),
        ("loads 2-D", {"local_loads": HOT_LOADS.reshape(1, -1)}, "local_loads: expected integer shape"),
        ("loads float", {"local_loads": HOT_LOADS.astype(np.float64)}, "local_loads: expected integer"),
        ("loads inf", {"local_loads": np.where(HOT_LOADS > 10, np.inf, HOT_LOADS)}, "local_loads: expected integer"),
        ("loads NaN", {"local_loads": np.where(HOT_LOADS > 10, np.nan, HOT_LOADS)}, "local_loads: expected integer"),
        ("loads negative", {"local_loads": HOT_LOADS - 10}, "non-negative"),
        ("loads 2**40", {"local_loads": BIG >> 22}, "below 2**31"),
        ("loads uint64 2**63", {"local_loads": (BIG.astype(np.uint64) * np.uint64(2))}, "9223372036854775808"),
        ("both ids and loads", {"topk_ids": HOT_IDS, "local_loads": HOT_LOADS}, "exactly one of"),
        ("neither ids nor loads", {}, "exactly one of"),
        ("layer 5", {"layer": 5, "local_loads": HOT_LOADS}, "layer must be an int in [0, 2)"),
        ("layer -1", {"layer": -1, "local_loads": HOT_LOADS}, "layer must be an int"),
        ("layer '0'", {"layer": "0", "local_loads": HOT_LOADS}, "layer must be an int")):
    case("Balancer", f"update {name}", lambda bad, k=kwargs: update(bad, dict(k)), Raises(BalancerError, text))
case("Balancer", "update layers differ", lambda bad: update(True, {"layer": pick(bad, 1, 0), "local_loads": HOT_LOADS}),
     Raises(GroupMismatchError, "ranks disagree on update"), scopes=("one",))
case("Balancer", "update top-k width differs",
     lambda bad: update(True, {"topk_ids": HOT_IDS.reshape(-1, 4) if bad else HOT_IDS}),
     Raises(GroupMismatchError, "ranks disagree on update"), scopes=("one",))
for name, kwargs in (("ids int32", {"topk_ids": HOT_IDS.astype(np.int32)}),
                     ("ids uint8", {"topk_ids": HOT_IDS.astype(np.uint8)}),
                     ("ids 3-D", {"topk_ids": HOT_IDS.reshape(2, -1, 2)}),
                     ("ids one token per row", {"topk_ids": HOT_IDS.reshape(-1, 1)}),
                     ("loads int64", {"local_loads": HOT_LOADS.astype(np.int64)}),
                     ("loads uint16", {"local_loads": HOT_LOADS.astype(np.uint16)})):
    case("Balancer", f"update {name}", lambda bad, k=kwargs: update(bad, dict(k)), Returns(),
         scopes=ALL if "per row" in name else BOTH)  # the top-k width must agree


def stale_handle():
    """A handle whose ring slot (max_in_flight=1) the next update of its layer reuses."""
    return balancer().update(0, local_loads=HOT_LOADS)


def foreign_handle():
    other = balancer("other")
    return other.update(0, local_loads=HOT_LOADS)


HANDLES = {"a stale handle": (stale_handle, StaleHandleError, "is stale"),  # the peers: BalancerError
           "a foreign handle": (foreign_handle, BalancerError, "expected a BalanceHandle from this Balancer"),
           "handle 'h'": (lambda: "h", BalancerError, "expected a BalanceHandle")}
for call in ("weight_sync", "restore", "reduce_grads", "reroute", "replica_weights", "replica_grads",
             "wait_replica", "plan", "local_experts"):
    collective = call in ("weight_sync", "restore", "reduce_grads", "reroute")
    for name, (make, kind, text) in HANDLES.items():
        def handle_call(bad, c=call, mk=make):
            b = balancer()
            wrong = mk()  # on every rank: it may take collectives
            good = b.update(0, local_loads=HOT_LOADS)
            b.weight_sync(good)
            getattr(b, c)(wrong if bad else good, *((HOT_IDS,) if c == "reroute" else ()))
        case("Balancer", f"{call} with {name}", handle_call, Raises(kind, text, rank=collective, peers=BalancerError),
             scopes=BOTH if collective else LOCAL)
    case("Balancer", f"{call} after close", lambda bad, c=call: getattr(closed_balancer()[0], c)(
        closed_balancer()[1], *((HOT_IDS,) if c == "reroute" else ())),
         Raises(ClosedError, "Balancer is closed"), scopes=LOCAL)
for value in (-1, 2, True, "0", 1.0):
    case("Balancer", f"wait_replica slot={value!r}", lambda bad, v=value: balancer().wait_replica(fresh_handle(), v),
         Raises(BalancerError, "slot must be None or an int in [0, 2)", rank=False), scopes=LOCAL)
for value in (0, -3, "all"):
    case("Balancer", f"weight_sync blocks={value!r}",
         lambda bad, v=value: balancer().weight_sync(balancer().update(0, local_loads=HOT_LOADS),
                                                     blocks=pick(bad, v, None)),
         Raises(BalancerError, "blocks"))
HOT_LOADS_IDS = np.repeat(np.arange(2 * R), hot_plan(0).loads[ME]).reshape(-1, 1).astype(np.int64)  # fresh_handle's
case("Balancer", "reroute ids beyond the update", lambda bad: balancer().reroute(
    fresh_handle(), np.vstack([HOT_IDS, HOT_IDS]) if bad else HOT_LOADS_IDS), Raises(BalancerError, "reroute"))
case("Balancer", "reroute float ids", lambda bad: balancer().reroute(
    fresh_handle(), HOT_LOADS_IDS.astype(np.float64) if bad else HOT_LOADS_IDS), Raises(BalancerError, "integer dtype"))


def reduce_unsynced(bad):
    b = balancer()
    unsynced = b.update(1, local_loads=HOT_LOADS)
    synced = fresh_handle(b)
    b.reduce_grads(unsynced if bad else synced)


case("Balancer", "reduce_grads before its sync", reduce_unsynced,
     Raises(BalancerError, "the shared replica buffers hold"))
case("Balancer", "replica_weights before its sync", lambda bad: balancer().replica_weights(
    balancer().update(1, local_loads=HOT_LOADS)),
     Raises(BalancerError, "call weight_sync/restore with this handle first"),
     scopes=LOCAL)
case("Balancer", "replica views kept across close stay readable",
     lambda bad: float(sum(float(np.asarray(t).sum()) for slot in closed_balancer()[2] for t in slot)),
     Returns(lambda total: math.isfinite(total)), scopes=LOCAL)
for name, call in (("register_layer layer 2",
                    lambda b, bad: b.register_layer(pick(bad, 2, 1), masters(), zeros_grads())),
                   ("register_layer one master short",
                    lambda b, bad: b.register_layer(1, masters()[:-1] if bad else masters(), zeros_grads()))):
    case("Balancer", name, lambda bad, c=call: c(balancer(), bad), Raises(CollectiveError, "register_layer"))
for call in ("stats", "check", "save_trace"):
    case("Balancer", f"{call} after close", lambda bad, c=call: getattr(closed_balancer()[0], c)(
        *(("t.npz",) if c == "save_trace" else ())), Raises(ClosedError, "Balancer is closed"), scopes=LOCAL)
case("Balancer", "register_layer after close", lambda bad: closed_balancer()[0].register_layer(0, masters(),
                                                                                              zeros_grads()),
     Raises(ClosedError, "register_layer", "Balancer is closed"), scopes=ALL)


def unchecked_update(bad):
    """sync_checks=False: a rank with a bad id raises at once, naming itself; its peers give up
    their bounded wait for its loads within the Balancer's timeout, naming it."""
    b = env.get("unchecked_balancer", lambda: Balancer(env.group, LAYOUT, SPEC, num_layers=1, min_replica_tokens=1,
                                                      backend="host", timeout_s=1.0, sync_checks=False))
    b.update(0, np.where(HOT_IDS == 1, 99, HOT_IDS) if bad else HOT_IDS)


case("Balancer", "update id 99 with sync_checks=False", unchecked_update,
     Raises(BalancerError, "99", peers=TimeoutError, peer_fragments=()), scopes=("one",))
case("Balancer", "save_trace without record_trace", lambda bad: balancer().save_trace(tempfile.mkdtemp() + "/t.npz"),
     Raises(BalancerError, "record_trace=True", rank=False), scopes=LOCAL)


# -- Dispatcher ------------------------------------------------------------------------------------------
def new_dispatcher(**kwargs):
    args = {"hidden": 16, "dtype": "float32", "top_k": TOP_K, "num_experts": 2 * R, "max_tokens": TOKENS,
            "backend": "host", "timeout_s": TIMEOUT_S, **kwargs}
    with Dispatcher(env.group, **args):
        pass


for name, kwargs, text in (("hidden=0", {"hidden": 0}, "hidden must be a positive int"),
                           ("hidden=3", {"hidden": 3}, "rows must be a multiple of"),
                           ("hidden='16'", {"hidden": "16"}, "hidden must be a positive int"),
                           ("dtype int32", {"dtype": "int32"}, "must be a float type"),
                           ("dtype 'nope'", {"dtype": "nope"}, "dtype"),
                           ("top_k=0", {"top_k": 0}, "top_k must be a positive int"),
                           ("top_k=64", {"top_k": 64}, "top_k must be <="),
                           ("num_experts=2R+1", {"num_experts": 2 * R + 1}, "not divisible by the group size"),
                           ("max_tokens=0", {"max_tokens": 0}, "max_tokens must be a positive int"),
                           ("max_tokens=2**30", {"max_tokens": 2**30}, "must fit in int32"),
                           ("experts_per_rank=3", {"experts_per_rank": 3}, "experts_per_rank (3)"),
                           ("max_recv_rows=0", {"max_recv_rows": 0}, "max_recv_rows must be a positive int"),
                           ("timeout_s=0", {"timeout_s": 0}, "timeout_s must be a positive"),
                           ("timeout_s=inf", {"timeout_s": math.inf}, "timeout_s must be a positive"),
                           ("backend='gpu'", {"backend": "gpu"}, "backend must be one of"),
                           ("backend an array", {"backend": np.arange(3)}, "backend must be one of"),
                           ("backend='device'", {"backend": "device"}, "needs a GPU"),
                           ("experts_per_rank=2.0", {"experts_per_rank": 2.0}, "experts_per_rank must be a positive"),
                           ("experts_per_rank='2'", {"experts_per_rank": "2"}, "experts_per_rank must be a positive"),
                           ("experts_per_rank an array", {"experts_per_rank": np.arange(3)},
                            "experts_per_rank must be a positive int"),
                           ("sync_checks='no'", {"sync_checks": "no"}, "sync_checks must be True or False"),
                           ("sync_checks an array", {"sync_checks": np.arange(3)}, "sync_checks must be True or False"),
                           ("expert_output=None", {"expert_output": None}, "expert_output must be True or False"),
                           ("expert_input an array", {"expert_input": np.arange(3)}, "expert_input must be True"),
                           ("heap a string", {"heap": "heap"}, "heap must be an ultraep SymmetricHeap")):
    case("Dispatcher", f"set-up {name}", lambda bad, k=kwargs: new_dispatcher(**(k if bad else {})),
         Raises(CollectiveError, "Dispatcher", text))
case("Dispatcher", "set-up group a communicator", lambda bad: Dispatcher(
    WORLD if bad else None, hidden=16, dtype="float32", top_k=TOP_K, num_experts=2 * R, max_tokens=TOKENS),
     Raises(TypeError, "Dispatcher needs an ultraep EPGroup", rank=False), scopes=ALL)
for name, kwargs, text in (("hidden='16'", {"hidden": "16"}, "hidden must be a positive int"),
                           ("dtype 'nope'", {"dtype": "nope"}, "dispatcher dtype 'nope'"),
                           ("expert_output an array", {"expert_output": np.arange(3)}, "expert_output must be True")):
    case("Dispatcher", f"heap_requirements {name}", lambda bad, k=kwargs: Dispatcher.heap_requirements(
        R, **{"hidden": 16, "dtype": "float32", "top_k": TOP_K, "num_experts": 2 * R, "max_tokens": TOKENS, **k}),
         Raises(DispatchError, text, rank=False), scopes=LOCAL)
case("Dispatcher", "set-up timeout_s differs", lambda bad: new_dispatcher(timeout_s=pick(bad, 5.0, TIMEOUT_S)),
     Raises(GroupMismatchError, "ranks disagree on Dispatcher set-up"), scopes=("one",))
case("Dispatcher", "set-up max_tokens differs", lambda bad: new_dispatcher(max_tokens=pick(bad, 2 * TOKENS, TOKENS)),
     Raises(GroupMismatchError, "ranks disagree on Dispatcher set-up"), scopes=("one",))
case("Dispatcher", "set-up heap of another backend", lambda bad: new_dispatcher(heap=heap(), backend=pick(
    bad, "device", "auto")), Raises(CollectiveError, "contradicts the given heap"))


def dispatch(bad, x=None, ids=None, gates=None, out=None, expert_output=False):
    cx, cids, cgates = tokens()
    args = (x, ids, gates) if bad else (None, None, None)
    x, ids, gates = (c if a is None else None if isinstance(a, str) and a == "NONE" else a
                     for a, c in zip(args, (cx, cids, cgates)))
    result = dispatcher(expert_output).dispatch(x, ids, gates, **({"out": out} if bad and out is not None else {}))
    return result.x[:result.num_rows].copy(), result.offsets.copy()


X, IDS, GATES = tokens()
for name, kwargs, text in (
        ("x of hidden 8", {"x": X[:, :8].copy()}, "x: expected shape"),
        ("x 1-D", {"x": X.ravel()}, "x: expected shape"),
        ("x float64", {"x": X.astype(np.float64)}, "x: expected dtype float32"),
        ("x too many tokens",
         {"x": np.vstack([X, X]), "ids": np.vstack([IDS, IDS]), "gates": np.vstack([GATES, GATES])},
         "exceed the set-up bound max_tokens"),
        ("x a string", {"x": "x"}, "is not a tensor"),
        ("x non-contiguous", {"x": noncontiguous(X)}, "not C-contiguous"),
        ("x masked", {"x": np.ma.masked_array(X, mask=X > 0)}, "x: a masked array"),
        ("ids of top-k 3", {"ids": np.hstack([IDS, IDS[:, :1]])}, "expert_ids: expected integer shape"),
        ("ids float", {"ids": IDS.astype(np.float32)}, "expert_ids: expected integer shape"),
        ("ids fewer tokens", {"ids": IDS[:-1]}, "expert_ids: expected integer shape"),
        ("id 2R", {"ids": np.where(IDS == 1, 2 * R, IDS)}, f"expert id {2 * R}"),
        ("id -1", {"ids": np.where(IDS == 1, -1, IDS)}, "expert id -1"),
        ("gates int", {"gates": GATES.astype(np.int32)}, "weights: expected float shape"),
        ("gates of another shape", {"gates": GATES[:, :1].copy()}, "weights: expected float shape"),
        ("gate NaN", {"gates": np.where(IDS == 1, np.nan, GATES).astype(np.float32)}, "not finite"),
        ("gate inf", {"gates": np.where(IDS == 1, np.inf, GATES).astype(np.float32)}, "not finite"),
        ("gate -inf", {"gates": np.where(IDS == 1, -np.inf, GATES).astype(np.float32)}, "not finite"),
        ("gate 1e300 float64", {"gates": np.where(IDS == 1, 1e300, GATES.astype(np.float64))}, "too large for float32"),
        ("x None", {"x": "NONE"}, "x: expected an array, got None"),
        ("ids None", {"ids": "NONE"}, "expert_ids: expected an array, got None"),
        ("gates None", {"gates": "NONE"}, "weights: expected an array, got None"),
        ("out of the wrong shape", {"out": np.zeros((3, 16), np.float32)}, "out: expected shape"),
        ("out read-only", {"out": readonly(np.zeros((R * TOKENS * TOP_K, 16), np.float32))}, "read-only")):
    case("Dispatcher", f"dispatch {name}", lambda bad, k=kwargs: dispatch(bad, **k),
         Raises(CollectiveError, "input check", text))
case("Dispatcher", "dispatch receive bound", lambda bad: Dispatcher(
    env.group, hidden=16, dtype="float32", top_k=TOP_K, num_experts=2 * R, max_tokens=TOKENS, backend="host",
    timeout_s=TIMEOUT_S, max_recv_rows=TOKENS).dispatch(X, np.zeros_like(IDS), GATES),
     Raises(DispatchError, "rank 0 would receive", "max_recv_rows", rank=False), scopes=ALL)


for name, layout, text in (("layout of 2R ranks", ExpertLayout(2 * R, 4 * R, 1), "ranks"),
                           ("layout a tuple", (R, 2 * R, 2), "ExpertLayout")):
    case("Dispatcher", f"for_layout {name}", lambda bad, lay=layout: Dispatcher.for_layout(
        env.group, lay if bad else LAYOUT, hidden=16, dtype="float32", top_k=TOP_K, max_tokens=TOKENS, backend="host",
        timeout_s=TIMEOUT_S).close(), Raises(CollectiveError, text))


def unchecked_dispatch(bad):
    """sync_checks=False: a rank with a bad id raises at once, naming itself; its peers give up
    their bounded wait for it within the Dispatcher's timeout, naming it."""
    d = env.get("unchecked", lambda: Dispatcher(env.group, hidden=16, dtype="float32", top_k=TOP_K,
                                                num_experts=2 * R, max_tokens=TOKENS, backend="host",
                                                timeout_s=1.0, sync_checks=False))
    d.dispatch(X, np.where(IDS == 1, 99, IDS) if bad else IDS, GATES)


case("Dispatcher", "dispatch id 99 with sync_checks=False", unchecked_dispatch,
     Raises(DispatchError, "expert id 99", peers=TimeoutError, peer_fragments=("waiting for rank",)), scopes=("one",))
for name, kwargs in (("ids int32", {"ids": IDS.astype(np.int32)}), ("ids uint8", {"ids": IDS.astype(np.uint8)}),
                     ("gates float64", {"gates": GATES.astype(np.float64)}),
                     ("no tokens", {"x": X[:0], "ids": IDS[:0], "gates": GATES[:0]})):
    case("Dispatcher", f"dispatch {name}", lambda bad, k=kwargs: dispatch(bad, **k),
         Returns() if name != "no tokens" else Returns(lambda r: r[1].shape == (3,)))


def combine_call(bad, what, y=None, handle=None, out=None, expert_output=False):
    d = dispatcher(expert_output)
    received = d.dispatch(*tokens())
    rows = d.expert_output() if expert_output else received.x * 2
    if expert_output:
        rows[...] = received.x * 2
    clean_y = rows
    y = clean_y if not bad or y is None else (y(rows) if callable(y) else y)
    wrong = handle() if handle else None  # on every rank: it may take collectives
    handle = wrong if bad and handle else received.handle
    kwargs = {"out": out} if bad and out is not None else {}
    if what == "combine":
        return d.combine(y, handle, **kwargs)
    if what == "dispatch_backward":
        return d.dispatch_backward(y, handle, **kwargs)
    grad_out = np.ones((TOKENS, 16), np.float32)
    return d.combine_backward(grad_out, y, handle, **kwargs)


def other_handle():
    return dispatcher(True).dispatch(*tokens()).handle


for what in ("combine", "dispatch_backward", "combine_backward"):
    for name, kwargs, text in (
            ("rows of hidden 8", {"y": lambda r: r[:, :8].copy()}, "expected shape"),
            ("rows float64", {"y": lambda r: r.astype(np.float64)}, "expected dtype float32"),
            ("rows short", {"y": lambda r: r[:-1].copy()}, "expected shape"),
            ("rows a string", {"y": "y"}, "is not a tensor"),
            ("rows None", {"y": lambda r: None}, "expected an array, got None"),
            ("a handle of another Dispatcher", {"handle": other_handle}, "handle comes from another Dispatcher"),
            ("handle None", {"handle": lambda: None}, "handle"),
            ("out of the wrong shape", {"out": np.zeros((1, 16), np.float32)}, "out: expected shape")):
        case("Dispatcher", f"{what} {name}", lambda bad, w=what, k=kwargs: combine_call(bad, w, **k),
             Raises(CollectiveError, "token path input check", text))


def later_handle():
    """The handle of the next dispatch of the same Dispatcher: valid, but another micro-batch's."""
    return dispatcher().dispatch(*tokens(1)).handle


for what in ("combine", "dispatch_backward", "combine_backward"):
    case("Dispatcher", f"{what} with another micro-batch's handle", lambda bad, w=what: combine_call(
        bad, w, handle=later_handle), Raises(GroupMismatchError, "token path input check", "the handle of dispatch #"),
         scopes=("one",))
case("Dispatcher", "expert_output() not set up", lambda bad: dispatcher().expert_output(),
     Raises(DispatchError, "set up without expert_output=True", rank=False), scopes=LOCAL)


def traffic_of(bad, handle):
    """traffic (a local call) of ``handle()``, made on every rank (it may take collectives)."""
    wrong, clean = handle(), dispatcher().dispatch(*tokens()).handle
    return dispatcher().traffic(wrong if bad else clean)


for name, handle, text in (("None", lambda: None, "handle: expected the DispatchHandle"),
                           ("of another Dispatcher", other_handle, "handle comes from another Dispatcher")):
    case("Dispatcher", f"traffic of a handle {name}", lambda bad, h=handle: traffic_of(bad, h),
         Raises(DispatchError, text, rank=False), scopes=ALL)
case("TokenRoute", "dispatcher a string", lambda bad: TokenRoute(pick(bad, "d", dispatcher())),
     Raises(DispatchError, "dispatcher must be an ultraep Dispatcher", rank=False), scopes=LOCAL)
case("TokenRoute", "combine before dispatch", lambda bad: TokenRoute(dispatcher()).combine(X, GATES),
     Raises(DispatchError, "needs a dispatch first", rank=False), scopes=LOCAL)


def combine_backward_into_y(bad):
    """combine_backward with out=y (the rows' own buffer reused for their gradient)."""
    d = dispatcher()
    received = d.dispatch(*tokens())
    y = received.x * 2
    grad_out = np.random.default_rng(30 + ME).standard_normal((TOKENS, 16)).astype(np.float32)
    grad_y, grad_w = d.combine_backward(grad_out, y, received.handle, **({"out": y} if bad else {}))
    return grad_y.copy(), grad_w.copy()


case("Dispatcher", "combine_backward with out=y", combine_backward_into_y, Returns())
for what in ("combine", "dispatch_backward"):
    case("Dispatcher", f"{what} with expert_output and rows elsewhere",
         lambda bad, w=what: combine_call(bad, w, y=lambda r: r.copy(), expert_output=True),
         Raises(CollectiveError, "pass Dispatcher.expert_output()"))
case("Dispatcher", "combine with expert_output, rows in place",
     lambda bad: combine_call(False, "combine", expert_output=bad), Returns(), scopes=ALL)
for what in ("dispatch", "expert_output"):
    case("Dispatcher", f"{what} after close", lambda bad, w=what: getattr(closed_dispatcher(), w)(
        *((X, IDS, GATES) if w == "dispatch" else ())), Raises(ClosedError, "Dispatcher is closed"), scopes=LOCAL)
case("Dispatcher", "close twice", lambda bad: closed_dispatcher().close(), Returns(), scopes=LOCAL)


def views_kept_across_close():
    """A dispatch's result and the expert_output rows, taken before the Dispatcher's close."""
    def build():
        d = Dispatcher(env.group, hidden=16, dtype="float32", top_k=TOP_K, num_experts=2 * R, max_tokens=TOKENS,
                       backend="host", timeout_s=TIMEOUT_S, expert_output=True)
        received = d.dispatch(*tokens())
        rows = d.expert_output()
        rows[...] = 2.0
        d.close()
        return received, rows
    return env.get("dispatch_views", build)


case("Dispatcher", "a dispatch result read after close",
     lambda bad: float(np.asarray(views_kept_across_close()[0].x[:views_kept_across_close()[0].num_rows]).sum()),
     Returns(lambda total: math.isfinite(total)), scopes=LOCAL)
case("Dispatcher", "expert_output rows read after close", lambda bad: float(views_kept_across_close()[1].sum()),
     Returns(lambda total: total == 2.0 * views_kept_across_close()[1].size), scopes=LOCAL)


# -- grouped_mm / dgrad / wgrad (local) --------------------------------------------------------------
GX, GW, GDY = bf16((24, 32), 1), bf16((3, 32, 16), 2), bf16((24, 16), 3)
OFFSETS = np.array([0, 10, 10, 24], np.int64)
for name, call, text in (
        ("x float32", lambda: grouped_mm(GX.astype(np.float32), GW, OFFSETS), "x must be bfloat16"),
        ("w float16", lambda: grouped_mm(GX, GW.astype(np.float16), OFFSETS), "w must be bfloat16"),
        ("x 1-D", lambda: grouped_mm(GX.ravel(), GW, OFFSETS), "x must have 2 dimensions"),
        ("w 2-D", lambda: grouped_mm(GX, GW[0], OFFSETS), "w must have 3 dimensions"),
        ("x columns != K", lambda: grouped_mm(bf16((24, 48)), GW, OFFSETS), "does not match w"),
        ("K not a multiple of 8", lambda: grouped_mm(bf16((24, 12)), bf16((3, 12, 16)), OFFSETS), "multiples of"),
        ("offsets float", lambda: grouped_mm(GX, GW, OFFSETS.astype(np.float64)), "offsets must be int32 or int64"),
        ("offsets 2-D", lambda: grouped_mm(GX, GW, OFFSETS.reshape(2, 2)), "offsets must have 1 dimensions"),
        ("offsets too short", lambda: grouped_mm(GX, GW, OFFSETS[:-1]), "E + 1 = 4 entries"),
        ("offsets[0] != 0", lambda: grouped_mm(GX, GW, OFFSETS + 1), "offsets[0] is 1"),
        ("offsets decrease", lambda: grouped_mm(GX, GW, np.array([0, 12, 10, 24])), "must not decrease"),
        ("offsets past the rows", lambda: grouped_mm(GX, GW, np.array([0, 10, 10, 25])), "past the 24 rows"),
        ("offsets negative", lambda: grouped_mm(GX, GW, np.array([0, -1, 10, 24])), "must not decrease"),
        ("offsets uint64 huge", lambda: grouped_mm(GX, GW, np.array([0, 10, 10, 2**63], np.uint64)), "int32 or int64"),
        ("offsets a list with a float", lambda: grouped_mm(GX, GW, [0, 10.5, 10, 24]), "got 10.5 (float) at index 1"),
        ("offsets a list of strings", lambda: grouped_mm(GX, GW, ["0", "10", "10", "24"]), "got '0' (str)"),
        ("offsets a list of bools", lambda: grouped_mm(GX, GW, [False, True, True, True]), "got False (bool)"),
        ("offsets a list with None", lambda: grouped_mm(GX, GW, [0, None, 10, 24]), "got None"),
        ("offsets a ragged list", lambda: grouped_mm(GX, GW, [0, [10], 10, 24]), "got [10] (list)"),
        ("offsets a list past int64", lambda: grouped_mm(GX, GW, [0, 10, 10, 2**64]), "does not fit in int64"),
        ("wgrad offsets a tuple of strings", lambda: grouped_mm_wgrad(GX, GDY, ("0",)), "got '0' (str)"),
        ("x None", lambda: grouped_mm(None, GW, OFFSETS), "x: NoneType is not a tensor"),
        ("w a list", lambda: grouped_mm(GX, GW.tolist(), OFFSETS), "w: list is not a tensor"),
        ("out a list", lambda: grouped_mm(GX, GW, OFFSETS, out=np.zeros((24, 16), np.float32).tolist()),
         "out: list is not a tensor"),
        ("out in x's memory", lambda: (lambda x: grouped_mm(x, GW, OFFSETS, out=x.reshape(48, 16)[:24]))(GX.copy()),
         "forward: out shares memory with x"),
        ("dgrad out in dy's memory",
         lambda: (lambda buf: grouped_mm_dgrad(buf.reshape(48, 16)[:24], GW, OFFSETS, out=buf))(bf16((24, 32))),
         "dgrad: out shares memory with dy"),
        ("wgrad out in x's memory",
         lambda: (lambda buf: grouped_mm_wgrad(buf.reshape(48, 32)[:24], GDY, OFFSETS, out=buf))(bf16((3, 32, 16))),
         "wgrad: out shares memory with x"),
        ("x a string", lambda: grouped_mm("x", GW, OFFSETS), "not a tensor"),
        ("x non-contiguous", lambda: grouped_mm(noncontiguous(GX), GW, OFFSETS), "not C-contiguous"),
        ("w masked", lambda: grouped_mm(GX, np.ma.masked_array(GW), OFFSETS), "w: a masked array"),
        ("out of the wrong shape", lambda: grouped_mm(GX, GW, OFFSETS, out=np.zeros((24, 8), np.float32)),
         "out must have shape (24, 16)"),
        ("out int32", lambda: grouped_mm(GX, GW, OFFSETS, out=np.zeros((24, 16), np.int32)), "bfloat16 or float32"),
        ("out read-only", lambda: grouped_mm(GX, GW, OFFSETS, out=readonly(np.zeros((24, 16), np.float32))),
         "read-only"),
        ("dgrad dy columns != N", lambda: grouped_mm_dgrad(GX, GW, OFFSETS), "does not match w"),
        ("dgrad offsets past the rows", lambda: grouped_mm_dgrad(GDY, GW, np.array([0, 30, 30, 30])), "past"),
        ("wgrad rows differ", lambda: grouped_mm_wgrad(GX, GDY[:-1], OFFSETS), "x has 24 rows but dy has 23"),
        ("wgrad offsets empty", lambda: grouped_mm_wgrad(GX, GDY, np.zeros(0, np.int64)), "empty"),
        ("wgrad offsets decrease", lambda: grouped_mm_wgrad(GX, GDY, np.array([0, 12, 10, 24])), "must not decrease"),
        ("wgrad out of the wrong shape",
         lambda: grouped_mm_wgrad(GX, GDY, OFFSETS, out=np.zeros((2, 32, 16), np.float32)), "out must have shape")):
    case("grouped_mm", name, lambda bad, c=call: c(), Raises(GroupedGemmError, text, rank=False), scopes=LOCAL)
for name, call in (("offsets int32", lambda o: grouped_mm(GX, GW, o.astype(np.int32))),
                   ("offsets a list", lambda o: grouped_mm(GX, GW, o.tolist())),
                   ("float32 out",
                    lambda o: grouped_mm(GX, GW, o, out=np.zeros((24, 16), np.float32)).astype(BFLOAT16)),
                   ("dgrad offsets int32", lambda o: grouped_mm_dgrad(GDY, GW, o.astype(np.int32))),
                   ("wgrad offsets a tuple", lambda o: grouped_mm_wgrad(GX, GDY, tuple(o.tolist())))):
    clean = {"dgrad": lambda o: grouped_mm_dgrad(GDY, GW, o), "wgrad": lambda o: grouped_mm_wgrad(GX, GDY, o)}.get(
        name.split()[0], lambda o: grouped_mm(GX, GW, o))
    case("grouped_mm", name, lambda bad, c=call, cl=clean: np.asarray((c if bad else cl)(OFFSETS)).view(np.int16),
         Returns(), scopes=LOCAL)


# -- MoELayer ----------------------------------------------------------------------------------------------
def new_layer(**kwargs):
    args = {"hidden": H, "ffn": F, "num_experts": 2 * R, "top_k": TOP_K, "max_tokens": TOKENS, "backend": "host",
            "timeout_s": TIMEOUT_S, **kwargs}
    with MoELayer(env.group, **args):
        pass


def spec_balancer(spec):
    return env.get(f"spec_balancer {spec!r}", lambda: Balancer(env.group, LAYOUT, spec, num_layers=1,
                                                                min_replica_tokens=1, backend="host",
                                                                timeout_s=TIMEOUT_S))


for name, kwargs, text in (("hidden=0", {"hidden": 0}, "hidden must be an int >= 1"),
                           ("ffn=12", {"ffn": 12}, "must be multiples of"),
                           ("ffn=32.0", {"ffn": 32.0}, "ffn must be an int"),
                           ("num_experts=2R+1", {"num_experts": 2 * R + 1}, "must be a multiple of the group size"),
                           ("top_k=0", {"top_k": 0}, "top_k must be an int >= 1"),
                           ("max_tokens=-1", {"max_tokens": -1}, "max_tokens must be an int >= 1"),
                           ("layer=-1", {"layer": -1}, "layer must be an int >= 0"),
                           ("balancer a dict", {"balancer": {}}, "balancer must be an ultraep.Balancer"),
                           ("balancer of another spec", {"balancer": "SPEC"}, "is not the layer's"),
                           ("layer beyond the balancer", {"balancer": "LAYER", "layer": 3}, "num_layers"),
                           ("backend='gpu'", {"backend": "gpu"}, "backend")):
    def make(bad, k=kwargs):
        k = dict(k)
        if k.get("balancer") in ("SPEC", "LAYER"):  # built on every rank: a Balancer is collective
            k["balancer"] = spec_balancer(SPEC if k["balancer"] == "SPEC" else MoELayer.expert_spec(H, F))
        new_layer(**(k if bad else {}))
    case("MoELayer", f"set-up {name}", make, Raises((MoELayerError, CollectiveError), text))
case("MoELayer", "set-up hidden differs", lambda bad: new_layer(hidden=pick(bad, 2 * H, H)),
     Raises(GroupMismatchError, "ranks disagree on MoELayer set-up"), scopes=("one",))

W_UP, W_DOWN = bf16((M, H, 2 * F), 11), bf16((M, F, H), 12)
for name, up, down, text in (("w_up of another shape", W_UP[:, :, :F].copy(), W_DOWN, "w_up: expected shape"),
                             ("w_down float32", W_UP, W_DOWN.astype(np.float32), "w_down: expected bfloat16"),
                             ("w_up a string", "w", W_DOWN, "is not a tensor"),
                             ("w_down non-contiguous", W_UP, noncontiguous(W_DOWN), "not C-contiguous")):
    case("MoELayer", f"load_weights {name}", lambda bad, u=up, d=down: moe_layer().load_weights(
        u if bad else W_UP, d if bad else W_DOWN), Raises(MoELayerError, "load_weights", text))


def forward(bad, balanced=False, x=None, ids=None, gates=None):
    layer = moe_layer(balanced)
    cx, cids, cgates = moe_tokens()
    if bad:
        cx, cids, cgates = (c if a is None else a for a, c in zip((x, ids, gates), (cx, cids, cgates)))
    y, ctx = layer.forward(cx, cids, cgates)
    return np.asarray(y).view(np.int16).copy()


MX, MIDS, MGATES = moe_tokens()
for balanced in (False, True):
    tag = "balanced " if balanced else ""
    for name, kwargs, kinds, text in (
            ("x of hidden 32", {"x": MX[:, :32].copy()}, CollectiveError, "x: expected shape"),
            ("x float32", {"x": MX.astype(np.float32)}, CollectiveError, "x: expected dtype"),
            ("x a list", {"x": [[0.0] * H] * TOKENS}, MoELayerError, "not a tensor"),
            ("ids 99", {"ids": np.where(MIDS == 1, 99, MIDS)}, (CollectiveError, BalancerError), "99"),
            ("ids float", {"ids": MIDS.astype(np.float32)}, (CollectiveError, BalancerError), "integer"),
            ("gate NaN", {"gates": np.where(MIDS == 1, np.nan, MGATES).astype(np.float32)}, CollectiveError,
             "not finite"),
            ("too many tokens", {"x": np.vstack([MX, MX]), "ids": np.vstack([MIDS, MIDS]),
                                 "gates": np.vstack([MGATES, MGATES])}, CollectiveError, "max_tokens")):
        case("MoELayer", f"{tag}forward {name}", lambda bad, b=balanced, k=kwargs: forward(bad, b, **k),
             Raises(kinds, text))
    case("MoELayer", f"{tag}forward ids int32", lambda bad, b=balanced: forward(bad, b, ids=MIDS.astype(np.int32)),
         Returns())


def backward(bad, balanced=False, ctx=None, dy=None, twice=False):
    layer = moe_layer(balanced)
    y, real = layer.forward(*moe_tokens())
    clean_dy = bf16((TOKENS, H), 20 + ME)
    if twice:  # on every rank: the bad ranks pass a context already used, the others a fresh one
        layer.backward(real, clean_dy)
        used, (_, real) = real, layer.forward(*moe_tokens())
        ctx = lambda: used  # noqa: E731
    dx, dgates = layer.backward(ctx() if bad and ctx else real, dy if bad and dy is not None else clean_dy)
    return np.asarray(dx).view(np.int16).copy(), np.asarray(dgates).copy()


for balanced in (False, True):
    tag = "balanced " if balanced else ""
    for name, kwargs, text in (("ctx None", {"ctx": lambda: None}, "backward needs the context forward returned"),
                               ("a context used twice", {"twice": True}, "has run already"),
                               ("dy of another shape", {"dy": bf16((TOKENS - 1, H))}, "dy: expected bfloat16"),
                               ("dy float32", {"dy": np.ones((TOKENS, H), np.float32)}, "dy: expected bfloat16"),
                               ("dy a string", {"dy": "dy"}, "not a tensor")):
        case("MoELayer", f"{tag}backward {name}", lambda bad, b=balanced, k=kwargs: backward(bad, b, **k),
             Raises(MoELayerError, "backward input", text))


def closed_layer():
    def build():
        layer = MoELayer(env.group, hidden=H, ffn=F, num_experts=2 * R, top_k=TOP_K, max_tokens=TOKENS,
                         backend="host", timeout_s=TIMEOUT_S)
        layer.close()
        return layer
    return env.get("closed_layer", build)


for name, call in (("forward", lambda layer: layer.forward(MX, MIDS, MGATES)),
                   ("load_weights", lambda layer: layer.load_weights(W_UP, W_DOWN)),
                   ("zero_grads", lambda layer: layer.zero_grads())):
    case("MoELayer", f"{name} after close", lambda bad, c=call: c(closed_layer()),
         Raises(ClosedError, "MoELayer is closed"), scopes=LOCAL)


# -- the runner -------------------------------------------------------------------------------------
def names_rank(message: str, rank: int) -> bool:
    """Whether ``message`` names ``rank``, or says that every rank failed (each said so)."""
    return bool(re.search(rf"\brank {rank}\b", message) or re.search(rf"\branks \[[^\]]*\b{rank}\b", message)
                or re.search(r"failed on (\d+) of \1 rank\(s\)", message))


CRASHES = (AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError, RecursionError, NameError,
           UnboundLocalError, MemoryError, SystemError, BufferError)


def classify(c: Case, scope: str, bad: bool, outcome, clean) -> tuple[str, str]:
    """(class, detail) of this rank's ``outcome`` (("raised", exc) or ("returned", value))."""
    how, value = outcome
    expect = c.expect
    if isinstance(expect, Returns):
        if how == "raised":
            return error_class(value, expected=()), f"{type(value).__name__}: {value}"
        fine = expect.check(value) if expect.check else same(value, clean)
        return ("ok", "") if fine else ("silent", f"got {short(value)}, clean run gave {short(clean)}")
    if how == "returned":
        return "silent", f"returned {short(value)} where {kind_name(expect.kind)} was due"
    peer = scope == "one" and not bad and expect.peers is not None
    kind = expect.peers if peer else expect.kind
    fragments = expect.peer_fragments if peer and expect.peer_fragments is not None else expect.fragments
    message = str(value)
    if not isinstance(value, kind):
        return error_class(value, expected=kind), f"{type(value).__name__} (wanted {kind_name(kind)}): {message}"
    missing = [f for f in fragments if f not in message]
    if missing:
        return "unclear", f"{type(value).__name__} lacks {missing}: {message}"
    if (twice := re.search(r"\brank (\d+): rank \1\b", message)) is not None:
        return "unclear", f"{type(value).__name__} names {twice.group(0)!r}: {message}"
    if expect.rank and scope != "local":
        culprit = ODD if scope == "one" else ME
        if not names_rank(message, culprit):
            return "unclear", f"{type(value).__name__} does not name rank {culprit}: {message}"
    return "ok", ""


def error_class(exc: BaseException, expected) -> str:
    if isinstance(exc, (RankFailedError, TimeoutError)):
        return "hang"
    if isinstance(exc, CRASHES) and not (expected and isinstance(exc, expected)):
        return "crash"
    if isinstance(exc, (UltraEPError, ValueError, TypeError, AssertionError)):
        return "unclear"
    return "crash"


def kind_name(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def short(value) -> str:
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if a is None or b is None or isinstance(a, (int, float, str, bool)):
        return a == b
    return True  # objects (a heap, a Balancer) returned by a constructor that should succeed


class Watchdog:
    """Ends the job, naming the case, when a case has no outcome within ``DEADLINE_S``."""

    def __init__(self):
        self.case, self.deadline = "", math.inf
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, name: str) -> None:
        self.case, self.deadline = name, time.monotonic() + DEADLINE_S

    def disarm(self) -> None:
        self.deadline = math.inf

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            if time.monotonic() > self.deadline:
                print(f"[matrix] rank {ME}: HANG: {self.case} has no outcome after {DEADLINE_S:g} s", flush=True)
                faulthandler.dump_traceback(sys.stdout)
                os._exit(124)


def attempt(call, bad):
    try:
        return "returned", call(bad)
    except Exception as exc:  # every exception is an outcome to classify
        return "raised", exc


def run(entries: list[str]) -> int:
    if unknown := sorted(set(entries) - {c.entry for c in CASES}):
        if ME == 0:
            print(f"bad_input_matrix.py: no cases for {', '.join(unknown)}; the entries are "
                  f"{', '.join(dict.fromkeys(c.entry for c in CASES))}", flush=True)
        return 1
    watchdog = Watchdog()
    tally: dict[str, dict[str, int]] = {}
    bad_lines, total = [], 0
    start = time.monotonic()
    for c in CASES:
        if entries and c.entry not in entries:
            continue
        for scope in c.scopes:
            total += 1
            label = f"{c.entry}: {c.name} [{scope}]"
            if VERBOSE:
                print(f"[matrix] rank {ME}: {label}", flush=True)
            watchdog.arm(label)
            clean = None
            if isinstance(c.expect, Returns) and c.expect.check is None:
                how, clean = attempt(c.call, False)
                if how == "raised":
                    clean = f"the clean call raised {type(clean).__name__}: {clean}"
            bad = scope != "one" or ME == ODD
            outcome = attempt(c.call, bad)
            verdict, detail = classify(c, scope, bad, outcome, clean)
            watchdog.disarm()
            verdicts = HARNESS.allgather((verdict, detail))
            worst = next((v for v, _ in verdicts if v != "ok"), "ok")
            if c.xfail:
                worst = "xfail" if worst != "ok" else "xpass"
            tally.setdefault(c.entry, {}).setdefault(worst, 0)
            tally[c.entry][worst] += 1
            if worst == "xfail":
                bad_lines.append(f"{'XFAIL':8s} {label}: {c.xfail}")
            elif worst != "ok":
                for r, (v, d) in enumerate(verdicts):
                    if v != "ok" or worst == "xpass":
                        bad_lines.append(f"{worst.upper():8s} {label}: rank {r}: {v} {d}")
            broken = HARNESS.allgather(env.group._broken is not None or verdict != "ok")
            if any(broken):
                env.reset()  # a fresh group and fresh objects: the old may refuse collectives or be half-used
    seconds = time.monotonic() - start
    if ME == 0:
        for line in bad_lines:
            print(line, flush=True)
        print_summary(tally, total, seconds)
    failed = sum(n for per in tally.values() for v, n in per.items() if v not in ("ok", "xfail"))
    HARNESS.Barrier()  # the verdict lines after rank 0's table, never inside it
    if not failed:
        print(f"[matrix] rank {ME} OK {total} cases", flush=True)
    return failed


CLASSES = ("ok", "xfail", "crash", "hang", "unclear", "silent", "xpass")


def print_summary(tally, total, seconds) -> None:
    width = max(len(e) for e in tally) + 2
    print(f"[matrix] {total} cases on {R} ranks in {seconds:.1f} s", flush=True)
    print(f"{'entry point':{width}s}" + "".join(f"{c:>8s}" for c in CLASSES) + f"{'total':>8s}")
    for entry, per in tally.items():
        print(f"{entry:{width}s}" + "".join(f"{per.get(c, 0):8d}" for c in CLASSES) + f"{sum(per.values()):8d}")
    sums = {c: sum(per.get(c, 0) for per in tally.values()) for c in CLASSES}
    print(f"{'all':{width}s}" + "".join(f"{sums[c]:8d}" for c in CLASSES) + f"{total:8d}", flush=True)


# == the integration layer's public API, audited for non-library errors (one block, to ease merging) ==
# Balancer set-up: every argument checked with the others, so a bad one raises on every rank, not
# a NumPy/Python error on the bad rank while its peers wait in the next collective.
for name, kwargs, text in (("timeout_s=None", {"timeout_s": None}, "timeout_s must be a positive"),
                           ("timeout_s='abc'", {"timeout_s": "abc"}, "timeout_s must be a positive"),
                           ("sync_checks an array", {"sync_checks": np.arange(3)}, "sync_checks must be a bool"),
                           ("record_trace an array", {"record_trace": np.arange(3)}, "record_trace must be a bool"),
                           ("min_replica_tokens=2**31", {"min_replica_tokens": 2**31}, "below 2**31"),
                           ("history=2**63", {"history": 2**63}, "history must be an int >= 0 and below")):
    case("Balancer", f"set-up {name}", lambda bad, k=kwargs: new_balancer(**(k if bad else {})),
         Raises(CollectiveError, "Balancer set-up", text))
case("Balancer", "set-up group None", lambda bad: Balancer(None, LAYOUT, SPEC, num_layers=1),
     Raises(BalancerError, "group must be an ultraep.EPGroup", rank=False), scopes=LOCAL)


# Balancer calls: a handle altered by hand names no ring slot of another layer (it indexed one, or
# raised IndexError); flags and paths of the wrong type, an out that is no tensor, loads whose sum
# overflows the planner's int32 quotas: BalancerError, not a NumPy/Python error.
def altered(**fields):
    return lambda: dataclasses.replace(balancer().update(0, local_loads=HOT_LOADS), **fields)


for name, make in (("layer 5", altered(layer=5)), ("layer -1", altered(layer=-1)), ("slot 7", altered(slot=7)),
                   ("layer '0'", altered(layer="0"))):
    case("Balancer", f"weight_sync with a handle of {name}", lambda bad, mk=make: balancer().weight_sync(
        mk() if bad else balancer().update(0, local_loads=HOT_LOADS)),
         Raises(BalancerError, "expected a BalanceHandle from this Balancer"))
    case("Balancer", f"plan with a handle of {name}", lambda bad, mk=make: balancer().plan(mk()),
         Raises(BalancerError, "expected a BalanceHandle from this Balancer", rank=False), scopes=LOCAL)
case("Balancer", "replica_weights wait an array",
     lambda bad: balancer().replica_weights(fresh_handle(), wait=np.arange(2)),
     Raises(BalancerError, "wait must be a bool", rank=False), scopes=LOCAL)
for name, out, text in (("a list", [[0, 0]] * len(HOT_LOADS_IDS), "out: list is not a tensor"),
                        ("non-contiguous", noncontiguous(np.zeros(HOT_LOADS_IDS.shape, np.int32)), "not C-contiguous")):
    case("Balancer", f"reroute out {name}", lambda bad, o=out: balancer().reroute(
        fresh_handle(), HOT_LOADS_IDS, out=o if bad else np.zeros(HOT_LOADS_IDS.shape, np.int32)),
         Raises(BalancerError, text))
case("Balancer", "update loads totalling 2**32", lambda bad: update(bad, {"local_loads": np.full(2 * R, 2**31 - 1)}),
     Raises(BalancerError, "must total below 2**31"))
case("Balancer", "update loads of the ranks totalling 2**31",
     lambda bad: update(bad, {"local_loads": np.array([2**31 // R] + [0] * (2 * R - 1))}),
     Raises(BalancerError, "total load (2147483648) must be below 2**31"), scopes=ALL)
case("Balancer", "update ids uint64 2**63 named as such",
     lambda bad: update(bad, {"topk_ids": np.where(HOT_IDS == 1, np.uint64(2**63), HOT_IDS.astype(np.uint64))}),
     Raises(BalancerError, "the first is 9223372036854775808"))


def traced(layers, name="traced"):
    """A recording Balancer (``name``'s, reused) after an update of each of ``layers``."""
    b = env.get(name, lambda: Balancer(env.group, LAYOUT, SPEC, num_layers=2, min_replica_tokens=1,
                                            backend="host", timeout_s=TIMEOUT_S, record_trace=True))
    for layer in layers:
        b.update(layer, local_loads=HOT_LOADS)
    return b


case("Balancer", "save_trace path None", lambda bad: traced([0, 1]).save_trace(None),
     Raises(BalancerError, "path must be a str or os.PathLike", rank=False), scopes=LOCAL)
case("Balancer", "save_trace of layers updated unevenly", lambda bad: traced([0, 1, 0], "uneven").save_trace(
    tempfile.mkdtemp() + "/t.npz"), Raises(BalancerError, "save_trace", "updates per layer so far", rank=False),
     scopes=LOCAL)


# MoELayer: flags of the wrong type, a second layer on a Balancer layer another open layer holds
# (it silently replaced that layer's registered masters), a context passed to another layer's
# backward (refused only deep inside, after marking the context used).
for name, value in (("an array", np.arange(3)), ("'yes'", "yes")):
    case("MoELayer", f"set-up fused {name}", lambda bad, v=value: new_layer(fused=pick(bad, v, False)),
         Raises(MoELayerError, "MoELayer set-up", "fused must be a bool"))
for name, value in (("1", 1), ("'beside'", "beside")):
    case("MoELayer", f"set-up sync_beside {name}", lambda bad, v=value: new_layer(sync_beside=pick(bad, v, "auto")),
         Raises(MoELayerError, "MoELayer set-up", "sync_beside must be a bool or 'auto'"))
case("MoELayer", "set-up group None", lambda bad: MoELayer(None, hidden=H, ffn=F, num_experts=2 * R, top_k=TOP_K,
                                                          max_tokens=TOKENS),
     Raises(MoELayerError, "group must be an ultraep.EPGroup", rank=False), scopes=LOCAL)
case("MoELayer", "set-up backend an array beside a balancer",
     lambda bad: new_layer(balancer=spec_balancer(MoELayer.expert_spec(H, F)), backend=np.array(["host", "device"])),
     Raises(MoELayerError, "contradicts the balancer's backend"), scopes=ALL)
case("MoELayer", "set-up on the balancer layer of an open layer",
     lambda bad: new_layer(balancer=moe_layer(True).balancer, layer=0),
     Raises(MoELayerError, "belongs to another open MoELayer"), scopes=ALL)


def after_closed_layer():
    """A layer on the Balancer layer of one that was closed (free again): it balances."""
    bal = Balancer(env.group, LAYOUT, MoELayer.expert_spec(H, F), num_layers=1, min_replica_tokens=1,
                   backend="host", timeout_s=TIMEOUT_S)
    with bal:
        new_layer(balancer=bal, layer=0)
        with MoELayer(env.group, hidden=H, ffn=F, num_experts=2 * R, top_k=TOP_K, max_tokens=TOKENS, balancer=bal,
                      backend="host", timeout_s=TIMEOUT_S) as layer:
            return layer.balancing


case("MoELayer", "set-up on the balancer layer of a closed layer", lambda bad: after_closed_layer(),
     Returns(lambda balancing: balancing is True), scopes=ALL)
case("MoELayer", "forward backward an array", lambda bad: moe_layer().forward(
    MX, MIDS, MGATES, backward=np.arange(2) if bad else True) and None,
     Raises(MoELayerError, "backward must be a bool"))


def foreign_context(bad, balanced):
    """backward of one layer given a context of the other (the bad ranks); the context's own layer
    then runs its backward: the refusal left it unused."""
    layer, other = moe_layer(balanced), moe_layer(not balanced)
    _, own = layer.forward(*moe_tokens())
    _, foreign = other.forward(*moe_tokens())
    dy = bf16((TOKENS, H), 20 + ME)
    try:
        layer.backward(foreign if bad else own, dy)
    finally:
        other.backward(foreign, dy)


def other_micro_batch(bad, balanced):
    """Two forwards; the bad ranks' backward gets the first one's context, the others' the
    second's (balanced: the first is stale, its ring slot holds the second's plan); then the
    contexts the refusal left unused run their backwards."""
    layer = moe_layer(balanced)
    _, first = layer.forward(*moe_tokens())
    _, second = layer.forward(*moe_tokens(1))
    dy = bf16((TOKENS, H), 20 + ME)
    try:
        layer.backward(first if bad else second, dy)
    finally:
        layer.backward(second, dy)
        if not balanced:
            layer.backward(first, dy)


case("MoELayer", "backward with another micro-batch's context", lambda bad: other_micro_batch(bad, False),
     Raises(MoELayerError, "ranks disagree on MoELayer.backward input", "the handle of dispatch #"), scopes=("one",))
case("MoELayer", "balanced backward with a stale context", lambda bad: other_micro_batch(bad, True),
     Raises(MoELayerError, "MoELayer.backward input", "is stale"))
case("MoELayer", "set-up top_k > num_experts", lambda bad: new_layer(top_k=pick(bad, 2 * R + 1, TOP_K)),
     Raises((MoELayerError, CollectiveError), "exceeds num_experts"))

for balanced in (False, True):
    case("MoELayer", f"{'balanced ' if balanced else ''}backward with another layer's context",
         lambda bad, b=balanced: foreign_context(bad, b),
         Raises(MoELayerError, "comes from another MoELayer's forward"))


if __name__ == "__main__":
    os.environ.setdefault("ULTRAEP_CACHE_DIR", tempfile.mkdtemp(prefix="ultraep-matrix-"))
    sys.exit(1 if run(sys.argv[1:]) else 0)
