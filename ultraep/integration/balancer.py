"""``Balancer``: the planner and the data plane behind one object a framework drives,
layer by layer and micro-batch by micro-batch.

Set up once per EP group (layout, number of virtual layers, the expert tensor spec,
``min_replica_tokens`` -- or ``"auto"``, the cost model of :mod:`ultraep.tune.replicas`
on the machine profile, resolved once and kept as ``min_replica_tokens`` --
``max_in_flight`` micro-batches), in its own symmetric heap or in
one the process shares with other components (sized from
:meth:`Balancer.heap_requirements` plus theirs). Per layer the framework registers its
master weights and gradients. Per micro-batch and layer:

* :meth:`Balancer.update` counts this rank's load row, writes it into row ``rank`` of
  every peer's gathered load matrix in the symmetric heap with a flag behind it, waits for
  every peer's flag and plans from the gathered matrix -- on the GPU in two launches (the
  gather, the plan; one CUDA graph launch once the ring slot has seen the shapes twice)
  with no heap barrier and no host round trip, into the preallocated buffers of a ring
  slot. It returns a :class:`BalanceHandle`. With ``weight_sync=True`` it also starts the
  plan's weight sync right behind the plan (inside that graph launch).
* :meth:`weight_sync` fills the replica slots, on a stream of the caller's choice, and
  returns a :class:`ReplicaSync`; :meth:`wait_replica` (or ``ReplicaSync.wait``) makes
  a compute stream wait for one replica slot's own chunks before the compute that reads
  it, so dispatch and the masters' compute run while the replicas arrive.
  :meth:`reroute` maps logical top-k ids to physical slots for any dispatcher (``update``
  already did so for the ids it counted: ``reroute(handle)`` returns that);
  :meth:`replica_weights` / :meth:`replica_grads` expose the shared replica buffers
  (DLPack-exportable) for the expert compute.
* Backward: :meth:`restore` refills the replicas from the handle's own plan (wait for
  them as after ``weight_sync``) and :meth:`reduce_grads` adds replica gradients into
  the masters.

Pipelines: every virtual layer has a ring of ``max_in_flight`` plan slots; a handle names
its layer, its micro-batch number (the layer's update counter) and its slot, so the
backward of micro-batch ``i`` finds the plan of its own forward while later forwards
are in flight. A handle whose slot was reused raises :class:`StaleHandleError`.

Order: replica buffers are shared by all layers, so the handle passed to
:meth:`replica_weights` / :meth:`wait_replica` must be the last one synced or restored;
the replica gradient slots hold one handle's gradients at a time, from
:meth:`replica_grads` (any handle synced once: the replica weights need not be there any
more, e.g. where the framework kept its own copy) to its :meth:`reduce_grads`. Streams are
ordered by events the Balancer records, never by a host wait: every stage that reads a
plan waits for the update that made it; a sync waits for the previous transfer and for
every stream that waited for the replica slots since the previous sync (their compute
reads them), then for every rank (the transfer's plan agreement, which waits for every
rank's plan hash, is that barrier), so no peer overwrites a replica slot that a rank still
reads; the update that reuses a ring slot waits for every stream that read its plan. The
weight sync itself ends with no barrier: the senders publish each chunk's flag at its
destination (system-scope release after the chunk's bytes), and ``wait_replica`` enqueues
a bounded device-side wait for the slot's flags (acquire). The gathered-load buffer is
double-buffered because a peer may already write the next update's row while this rank
still copies the previous one out.

Checks: ``sync_checks=True`` (default) checks every call collectively -- the same error
on every rank: bad ids, dtypes, devices, ranks passing different layers or top-k widths,
stale handles -- in one host allgather per call (the error check and the agreement on the
call's arguments travel together; ``update`` stages its counted row first, so on the GPU
that also covers bad top-k ids, at the cost of one device read, and publishes it only once
every rank agreed). An agreement cannot ride on the next call instead: a disagreement
would then be found after the peers' kernels had already exchanged rows or weights for
different layers. ``False`` makes no host collective at all and checks locally only;
:meth:`check` reports deferred device errors (ids out of range are then not counted, and
reroute gives them slot ``-1``).

Metrics: :meth:`stats` (imbalance before/after, replicas, bytes moved, stage times, a
liveness counter of load gathers the device completed), :meth:`save_trace` (the planner's
trace format) and :func:`~ultraep.analysis.plots.plot_rank_loads`.

Backends: the heap's backend picks, once, the implementation of what differs --
:class:`~ultraep.integration.host.HostBalancer` (NumPy, every stage synchronous) or
:class:`~ultraep.integration.device.DeviceBalancer` (CuPy and ``raw_kernels/balancer.cu``).
Both implement :class:`BalancerBackend`: a ring slot's state (plan buffers, pinned
mirrors, stage clock), the caller's stream and marks that order streams (none on the
host), counting the load row, the update (publish, gather, plan: each backend numbers
its updates, which pick the gathered matrix), reroute, a record's host arrays,
synchronisation and the deferred device checks. Everything else, the collective checks
included, is here.

Device hot path: everything runs on the caller's streams (CuPy's current stream, the stream
of a torch ``topk_ids``, or ``stream=``), and once every ring slot has seen the largest
top-k batch, ``update``, ``weight_sync``, ``wait_replica``, ``reroute``, ``restore`` and
``reduce_grads`` allocate no device memory and, with ``sync_checks=False``, never wait for
the device nor for the other ranks:

* ``update`` counts the ids (int32 or int64) -- each chunk's counts kept for reroute --,
  publishes the row and gathers the peers' in one launch (``raw_kernels/balancer.cu``),
  plans into the ring slot's own plan buffers and reroutes the ids into the slot's routed
  output (reroute's assign kernel: ``reroute(handle)`` then does no device work); the
  arrays a record needs are copied to pinned host memory on a side stream;
* ``weight_sync`` / ``restore`` / ``reduce_grads`` compile the plan's transfer tasks on
  the device (``transfer.device_schedule``) into tables allocated once, and launch the
  transfer behind the device-side plan agreement (which orders it after every rank's
  earlier work);
* ``wait_replica`` is one small kernel per call;
* ``reroute`` with ids writes into the ring slot's output and count workspace, which (as
  the update's routed output) are reallocated only when a batch larger than any the slot
  has seen arrives;
* with ``cuda_graphs`` (the default), a ring slot's launch sequences -- update's gather,
  plan and assign, the record's copies, reroute's two kernels -- are captured as CUDA graphs the
  second time in a row the slot sees the same shapes, and replayed from then on (a new
  token count or id dtype runs eagerly once and is captured again): one graph launch each
  instead of the launches and their Python, at the cost of copying the ids into a buffer
  of the Balancer's first (``integration.device.LaunchGraphs``). The bits are the same.

The host waits for the device only where it must read device results: an ``update``
whose ring slot still holds a micro-batch whose record has not reached host memory (the
device is a whole ring behind) waits for it, and ``stats``, ``save_trace`` and ``check``
synchronise. ``sync_checks=True`` adds one host allgather per call and, for top-k ids,
one device read per ``update``. :meth:`stats` counts the hot path's waits
(``host_waits``, ``host_wait_ms``): with none, a layer whose host runs ahead of its
device pays only the device work below, not the calls' host time.

"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ultraep.errors import (BalancerError, ClosedError, CollectiveError, GroupMismatchError, StaleHandleError,
                            everywhere)
from ultraep.integration.host import HostBalancer
from ultraep.integration.stats import BalancerStats, plan_record
from ultraep.integration.traces import TraceRecorder
from ultraep.planner import ExpertLayout, Plan
from ultraep.planner.plan import INT32_LIMIT
from ultraep.runtime import open_heap
from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.dtypes import is_bool, is_int
from ultraep.runtime.group import EPGroup, ranks_per_gpu, timeout_error
from ultraep.runtime.heap import HeapBacked, HeapRequirements, SymmetricHeap
from ultraep.transfer import ExpertSpec, WeightTransfer
from ultraep.tune.replicas import agreed_min_replica_tokens

if TYPE_CHECKING:
    from pathlib import Path

DEFAULT_HISTORY = 4096
GATHER_BUFFERS = 2  # see "Order" in the module docstring
_NO_AGREEMENT = object()
TILING_OPTIONS = ("tile_bytes", "chunk_tiles")  # the transfer options that size the heap
TRANSFER_OPTIONS = TILING_OPTIONS + ("relay_threshold", "relay_count", "blocks")  # what transfer_options may set


@dataclass(frozen=True)
class BalanceHandle:
    """One (virtual layer, micro-batch) plan: ``step`` counts the layer's updates."""

    balancer_id: int
    layer: int
    step: int
    slot: int


class ReplicaSync:
    """A weight sync or restore in flight: :meth:`wait` makes a stream wait for one replica
    slot (or all) before the expert compute that reads it. ``event``: this rank's launches
    on the sync's stream are done (its sends, not its arrivals; ``None`` on the host, where
    the call returns after the transfer)."""

    def __init__(self, balancer: Balancer, handle: BalanceHandle, event: Any):
        self.balancer, self.handle, self.event = balancer, handle, event

    def wait(self, slot: int | None = None, *, stream: Any = None) -> None:
        """:meth:`Balancer.wait_replica` for this sync's handle."""
        self.balancer.wait_replica(self.handle, slot, stream=stream)


class BalancerBackend(Protocol):
    """What differs per backend (``Backends`` in the module docstring); ``slot`` is the
    backend's state of one ring slot, from :meth:`new_slot`."""

    device: int | None  # the GPU tensors are imported onto; None on the host
    host_waits: int  # times the per-micro-batch calls blocked the host on the device
    host_wait_s: float  # and for how long in all

    def new_slot(self): ...
    def stream(self, stream, tensor=None): ...
    def current(self): ...
    def mark(self, what): ...
    def mark_on(self, stream, what): ...
    def follow(self, *marks) -> None: ...
    def check_ids(self, ids) -> None: ...
    def check_loads(self, loads) -> None: ...
    def count(self, source, *, from_ids: bool) -> None: ...
    def discard(self) -> None: ...
    def update(self, slot, source, *, from_ids: bool, then=None) -> Plan: ...
    def planned(self, slot): ...
    def routed(self, slot): ...
    def reroute(self, slot, ids, plan: Plan, out): ...
    def host_arrays(self, slot, plan: Plan) -> dict: ...
    def synchronize(self) -> int: ...
    def check(self) -> None: ...


def sync_beside_pays(group: EPGroup) -> bool:
    """Whether ``weight_sync`` on a stream of its own, beside dispatch and the compute, pays
    (collective): where every rank has a GPU to itself. Where ranks share a GPU (MPS), work
    queued on a second stream behind a wait slows each launch on the layer's stream by about
    1 us (``bench stream-wait``), which costs more than the sync beside hides."""
    return ranks_per_gpu(group) <= 1


def _backend_class(heap: SymmetricHeap) -> type:
    if heap.backend == "device":
        from ultraep.integration.device import DeviceBalancer
        return DeviceBalancer
    return HostBalancer


class _RingSlot:
    """The plan of one in-flight micro-batch of one layer, and what it has done."""

    def __init__(self, backend: BalancerBackend):
        self.step = -1
        self.harvested = True  # its record is in the history (or it never held a plan)
        self.plan: Plan | None = None
        self.counted_ids = False  # its update counted top-k ids (and rerouted them), not a load row
        self.syncs = self.reductions = 0
        # (the end event of the weight sync its update started,) until weight_sync takes that sync: the
        # event alone, as a ReplicaSync (which holds the Balancer) would make a cycle of Balancer and ring
        self.started_sync: tuple | None = None
        self.state = backend.new_slot()  # the backend's buffers and stage clock
        self.clock = self.state.clock
        self.users: dict = {}  # stream -> mark after its last use of the plan buffers


def _record(layout: ExpertLayout, spec: ExpertSpec, layer: int, step: int, arrays: dict, syncs: int, reductions: int,
            times_ms: dict):
    """A micro-batch's record from its plan's host arrays, transfers and stage times."""
    record = plan_record(layout, layer, step, arrays["loads"], arrays["phys_to_log"], arrays["rank_load"])
    record.weight_bytes = syncs * record.replicas * spec.weight_slot_bytes
    record.weight_syncs = syncs
    record.grad_bytes = reductions * record.replicas * spec.grad_slot_bytes
    record.times_ms = times_ms
    record.liveness = arrays["liveness"]
    return record


def _gather_requirements(layout: ExpertLayout) -> HeapRequirements:
    return HeapRequirements.of(tensors=[("balancer.gathered_loads",
                                         (GATHER_BUFFERS, layout.num_ranks, layout.num_experts), np.int32)],
                               signals=[("balancer.gather_flags", layout.num_ranks)])


class Balancer(HeapBacked):
    """Load gathering, planning and the data plane of one EP group, driven per layer and
    micro-batch (module docstring). Collective: every rank constructs it with the same
    arguments. ``heap``: an open symmetric heap with room for :meth:`heap_requirements`
    (shared with other components, and left open by :meth:`close`); without one the
    Balancer opens, and closes, its own. ``cuda_graphs`` (GPU): replay each ring slot's
    fixed launches as CUDA graphs ("Device hot path" in the module docstring); ``False``
    launches every kernel itself, with the same results."""

    _next_id = 0

    @staticmethod
    def heap_requirements(layout: ExpertLayout, spec: ExpertSpec, *,
                          transfer_options: dict | None = None) -> HeapRequirements:
        """What a Balancer of ``layout`` and ``spec`` allocates in its heap: the gathered
        load matrices and the weight transfer's replica slots and flags (its tiling from
        ``transfer_options``, as passed to the constructor)."""
        options = transfer_options or {}
        tiling = {name: options[name] for name in TILING_OPTIONS if name in options}
        return _gather_requirements(layout) + WeightTransfer.heap_requirements(layout, spec, **tiling)

    def __init__(self, group: EPGroup, layout: ExpertLayout, spec: ExpertSpec, *, num_layers: int,
                 min_replica_tokens: int | str = 1024, max_in_flight: int = 1, backend: str = "auto",
                 heap: SymmetricHeap | None = None, sync_checks: bool = True, record_trace: bool = False,
                 timeout_s: float = 30.0, history: int = DEFAULT_HISTORY, transfer_options: dict | None = None,
                 cuda_graphs: bool = True):
        if not isinstance(group, EPGroup):  # no collective can report it: this rank's own error
            raise BalancerError(f"group must be an ultraep.EPGroup, got {type(group).__name__}")
        error, requirements = None, None
        try:
            if not isinstance(layout, ExpertLayout):
                raise BalancerError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
            if layout.num_ranks != group.size:
                raise BalancerError(f"layout has {layout.num_ranks} ranks, the group {group.size}")
            if not isinstance(spec, ExpertSpec):
                raise BalancerError(f"spec must be an ExpertSpec, got {type(spec).__name__}")
            # upper bounds (powers of two): the planners take min_replica_tokens as int32, history is a deque's maxlen
            for name, value, low, high in (("num_layers", num_layers, 1, None),
                                           ("max_in_flight", max_in_flight, 1, None),
                                           ("min_replica_tokens", min_replica_tokens, 0, INT32_LIMIT),
                                           ("history", history, 0, sys.maxsize + 1)):
                if name == "min_replica_tokens" and isinstance(value, str) and value == "auto":
                    continue  # resolved once the heap's backend is known
                if not is_int(value) or value < low or (high is not None and value >= high):
                    below = "" if high is None else f" and below 2**{high.bit_length() - 1}"
                    hint = " or 'auto'" if name == "min_replica_tokens" else ""
                    raise BalancerError(f"{name} must be an int >= {low}{below}{hint}, got {value!r}")
            if (bad_timeout := timeout_error(timeout_s)) is not None:
                raise BalancerError(bad_timeout)
            for name, value in (("sync_checks", sync_checks), ("record_trace", record_trace),
                                ("cuda_graphs", cuda_graphs)):
                if not is_bool(value):
                    raise BalancerError(f"{name} must be a bool, got {value!r}")
            if heap is not None:
                if not isinstance(heap, SymmetricHeap):
                    raise BalancerError(f"heap must be a SymmetricHeap (ultraep.runtime.open_heap), "
                                        f"got {type(heap).__name__}")
                if (heap.rank, heap.size) != (group.rank, group.size):
                    raise BalancerError(f"the heap is rank {heap.rank} of {heap.size}, the group's "
                                        f"rank {group.rank} of {group.size}")
                if backend not in ("auto", heap.backend):
                    raise BalancerError(f"backend={backend!r} contradicts the heap's backend {heap.backend!r}")
            if transfer_options is not None and (not isinstance(transfer_options, dict)
                                                 or not set(transfer_options) <= set(TRANSFER_OPTIONS)):
                raise BalancerError(f"transfer_options must be a dict of {', '.join(TRANSFER_OPTIONS)}, "
                                    f"got {transfer_options!r}")
            try:
                requirements = self.heap_requirements(layout, spec, transfer_options=transfer_options)
            except ValueError as exc:  # e.g. a tiling the transfer cannot cut
                raise BalancerError(f"transfer_options: {exc}") from None
        except BalancerError as exc:
            error = exc
        group.raise_if_any(error, "Balancer set-up")
        group.agree((repr(layout), spec.key(), int(num_layers), str(min_replica_tokens), int(max_in_flight),
                     bool(sync_checks), heap is None), "Balancer set-up (layout, expert spec, num_layers, "
                    "min_replica_tokens, max_in_flight, sync_checks, own heap)")
        self.group, self.layout, self.spec = group, layout, spec
        self.rank = group.rank
        self.serial = group.next_serial("Balancer")  # in its checks' names: ranks on two Balancers mismatch
        self.num_layers, self.max_in_flight = int(num_layers), int(max_in_flight)
        self.sync_checks, self.timeout_s = bool(sync_checks), float(timeout_s)
        self._owns_heap = heap is None
        self.heap = open_heap(group, requirements, backend=backend) if heap is None else heap
        self.backend = self.heap.backend
        try:
            # "auto": the cost model's value from the machine profile, the same on every rank
            self.min_replica_tokens = (agreed_min_replica_tokens(group, spec, backend=self.backend)
                                       if isinstance(min_replica_tokens, str) else int(min_replica_tokens))
            gather = self.heap.allocate(_gather_requirements(layout))
            self.transfer = WeightTransfer(self.heap, layout, spec, timeout_s=timeout_s, **(transfer_options or {}))
            self._impl: BalancerBackend = _backend_class(self.heap)(
                self.heap, layout, gather["balancer.gathered_loads"], gather["balancer.gather_flags"],
                min_replica_tokens=self.min_replica_tokens, timeout_s=self.timeout_s, sync_checks=self.sync_checks,
                cuda_graphs=bool(cuda_graphs))
            self._rings = [[_RingSlot(self._impl) for _ in range(self.max_in_flight)]
                           for _ in range(self.num_layers)]
        except BaseException as exc:
            self._give_up(exc)  # a lone failure is published to the peers, not waited out
            raise
        self.device = self._impl.device
        self.id = Balancer._next_id
        Balancer._next_id += 1
        self._steps = [0] * self.num_layers
        self._updates = 0
        self._weights_owner: BalanceHandle | None = None
        self._grads_owner: BalanceHandle | None = None  # replica_grads until its reduce_grads
        self._transferred = None  # mark after the last transfer (they share the engine's tables)
        self._readers: dict = {}  # stream pointer -> stream that waited for the replica slots since the last sync
        self._history: deque = deque(maxlen=int(history))
        self.recorder = TraceRecorder(layout.num_ranks, layout.num_experts,
                                      {"source": "ultraep.Balancer"}) if record_trace else None
        self._closed = False

    # -- checks ---------------------------------------------------------------------------
    def _collective(self, error, what: str, agreed=_NO_AGREEMENT) -> None:
        """Raise the same error on every rank (``sync_checks``), else this rank's own. The
        error check and the agreement on ``agreed`` share one host allgather."""
        if self.sync_checks:
            try:
                self.group.raise_if_any(error, what, call=f"{what} of Balancer #{self.serial}",
                                        **({} if agreed is _NO_AGREEMENT else {"agree": agreed}))
            except GroupMismatchError:
                raise
            except ValueError as collective:  # keep the local kind (e.g. StaleHandleError) where there is one
                kind = type(error) if isinstance(error, (BalancerError, ClosedError)) else BalancerError
                raise everywhere(kind(str(collective))) from error
        elif error is not None:
            raise error

    def _check_layer(self, layer) -> int:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise BalancerError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}: the Balancer is closed")

    def _issued(self, handle) -> bool:
        """Whether ``handle`` is one this Balancer's :meth:`update` could have returned (a
        handle built or altered by hand must not index another layer's ring slot)."""
        if not isinstance(handle, BalanceHandle) or handle.balancer_id != self.id:
            return False
        fields = (handle.layer, handle.step, handle.slot)
        return (all(isinstance(v, int) and not isinstance(v, bool) for v in fields)
                and 0 <= handle.layer < self.num_layers and 0 <= handle.step
                and handle.slot == handle.step % self.max_in_flight)

    def _entry(self, handle) -> _RingSlot:
        """The ring slot of a live ``handle`` (raises BalancerError/StaleHandleError, or
        ClosedError after close)."""
        self._check_open()
        if not self._issued(handle):
            raise BalancerError(f"expected a BalanceHandle from this Balancer, got {handle!r}")
        entry = self._rings[handle.layer][handle.slot]
        if entry.step != handle.step:
            raise StaleHandleError(
                f"handle of layer {handle.layer}, micro-batch {handle.step} is stale: its ring slot {handle.slot} "
                f"now holds micro-batch {entry.step} (max_in_flight={self.max_in_flight}; finish a micro-batch's "
                "backward before its layer's ring wraps, or raise max_in_flight)")
        return entry

    # -- set-up per layer -------------------------------------------------------------------
    def register_layer(self, layer: int, weights: list[list[Any]], grads: list[list[Any]]) -> None:
        """Collective. ``weights[m][t]`` / ``grads[m][t]``: tensor ``t`` of this rank's ``m``-th master."""
        error = None
        try:
            self._check_open()
            layer = self._check_layer(layer)
        except (BalancerError, ClosedError) as exc:
            error = exc
        try:
            self.group.raise_if_any(error, "register_layer")
        except CollectiveError as collective:  # closed: the kind every other call raises then
            if isinstance(error, ClosedError):
                raise everywhere(ClosedError(str(collective))) from error
            raise
        self.transfer.register_layer(layer, weights, grads)

    # -- per micro-batch ----------------------------------------------------------------------
    def update(self, layer: int, topk_ids: Any = None, *, local_loads: Any = None,
               stream: Any = None, weight_sync: bool = False) -> BalanceHandle:
        """Collective: gather the exact load of ``layer`` for this micro-batch and plan it.

        Pass this rank's ``topk_ids`` (integer ``[T, K]``, or any shape whose last axis is the
        top-k width ``K``, the same on every rank -- flat ids count as one token's; ids in
        ``[0, E)``) or its ``local_loads`` (``int32[E]``, tokens per logical expert). Ranks may
        pass different token counts but must pass the same layer in the same order, and order
        their updates on one stream (or by events). Given ``topk_ids``, the update also
        reroutes them: ``reroute(handle)`` returns that.

        ``weight_sync=True``: the update also starts the new plan's weight sync right
        behind the plan, in series on the update's stream with the default grid -- on the
        GPU inside the update's own CUDA graph, so the sync starts when the plan exists,
        not when the host gets to a second call. :meth:`weight_sync` then returns that
        sync (and launches nothing); its time counts as the update's in the stage times.
        MoELayer does so whenever its sync runs in series.
        """
        error, agreed, source, entry = None, None, None, None
        from_ids = local_loads is None
        with self._impl.stream(stream, topk_ids if topk_ids is not None else local_loads):
            try:
                self._check_open()
                layer = self._check_layer(layer)
                if (topk_ids is None) == (local_loads is None):
                    raise BalancerError("update needs exactly one of topk_ids and local_loads")
                if not is_bool(weight_sync):
                    raise BalancerError(f"weight_sync must be a bool, got {weight_sync!r}")
                if weight_sync and not self.transfer.registered(layer):
                    raise BalancerError(f"update(weight_sync=True): layer {layer} has no registered master weights on "
                                        f"rank {self.rank} (call register_layer first)")
                source = self._import_ids(topk_ids) if from_ids else self._import_loads(local_loads)
                # the last dimension (top-k) is a model constant; the token count may differ per rank
                agreed = (layer, self._steps[layer], "topk_ids" if from_ids else "local_loads",
                          tuple(source.shape[-1:]), bool(weight_sync))
                entry = self._rings[layer][self._steps[layer] % self.max_in_flight]
                self._harvest(entry, layer)
                self._impl.follow(*entry.users.values())  # the plan buffers' last readers, on their streams
                entry.users.clear()
                entry.clock.reset()
                entry.clock.start("update")
                if self.sync_checks:
                    self._impl.count(source, from_ids=from_ids)  # staged: nothing is published before the check
            except (BalancerError, ClosedError) as exc:
                error = exc
            if self.sync_checks:
                try:
                    self._collective(error, "update (layer, micro-batch, input kind, top-k width, weight_sync; "
                                     "top-k ids)", agreed=agreed)
                except BaseException:
                    self._impl.discard()
                    raise  # the old plan stays live
            elif error is not None:
                raise error
            return self._update(layer, entry, source, from_ids, bool(weight_sync))

    def _import(self, tensor, name: str, writable: bool = False):
        try:
            return import_tensor(tensor, name=name, device=self.device, writable=writable)
        except ValueError as exc:
            raise BalancerError(str(exc)) from None

    def _import_ids(self, topk_ids):
        ids = self._import(topk_ids, "topk_ids")
        if np.dtype(ids.dtype).kind not in "iu":
            raise BalancerError(f"topk_ids: expected an integer dtype, got {ids.dtype}")
        self._impl.check_ids(ids)
        return ids

    def _import_loads(self, local_loads):
        loads = self._import(local_loads, "local_loads")
        E = self.layout.num_experts
        if tuple(loads.shape) != (E,) or np.dtype(loads.dtype).kind not in "iu":
            raise BalancerError(f"local_loads: expected integer shape ({E},), got {loads.dtype} {tuple(loads.shape)}")
        self._impl.check_loads(loads)
        return loads

    def _update(self, layer: int, entry: _RingSlot, source, from_ids: bool, weight_sync: bool) -> BalanceHandle:
        step = self._steps[layer]
        handle = BalanceHandle(self.id, layer, step, step % self.max_in_flight)
        then = None
        if weight_sync:
            self._impl.follow(*self._replica_reads())  # before the sync's agreement, as in weight_sync

            def then(plan):  # the backend's update launches it behind the plan
                return self.transfer.prepare_weight_sync(layer, plan, barrier=self.device is None)
        # with sync_checks the row was counted (and checked) before the collective: publish it
        try:
            entry.plan = self._impl.update(entry.state, None if self.sync_checks else source, from_ids=from_ids,
                                           then=then)
        except ValueError as exc:  # the gathered rows' total (the same matrix on every rank) overflows the quotas
            raise BalancerError(f"rank {self.rank}: update of layer {layer}: {exc}") from None
        entry.step, entry.syncs, entry.reductions, entry.harvested = step, 0, 0, False
        entry.counted_ids = from_ids
        entry.started_sync = None
        if weight_sync:
            planned = self._impl.planned(entry.state)
            entry.started_sync = (None if planned is None else planned.event,)
            self._synced(handle, entry)
        self._steps[layer] += 1
        self._updates += 1
        return handle

    def _collective_entry(self, handle, what: str, grads: bool = False, blocks: int | None = None) -> _RingSlot:
        """The live entry of ``handle`` (and, with ``grads``, the replica gradient slots may
        hold its gradients; a sync's grid ``blocks`` fits), checked on every rank and the
        handle agreed, in one collective."""
        error, entry = None, None
        try:
            self._check_open()
            entry = self._entry(handle)
            if grads:
                error = self._grads_error(handle, entry, what)
            if (bad_grid := self.transfer.sync_grid_error(blocks)) is not None:
                error = BalancerError(f"rank {self.rank}: {what}: {bad_grid}")
        except (BalancerError, ClosedError) as exc:
            error = exc
        key = (handle.layer, handle.step) if isinstance(handle, BalanceHandle) else None
        self._collective(error, what, agreed=key)
        return entry

    def _used(self, entry: _RingSlot, what: str) -> None:
        """The current stream has enqueued work that reads the entry's plan buffers: the
        update that next rewrites them (on the updates' stream) waits for it."""
        planned, current = self._impl.planned(entry.state), self._impl.current()
        if planned is not None and current.ptr != planned.stream:  # the updates' own stream is in order
            entry.users[current.ptr] = self._impl.mark(("plan use", id(entry), what))

    def weight_sync(self, handle: BalanceHandle, *, stream: Any = None, blocks: int | None = None) -> ReplicaSync:
        """Collective: fill the replica slots from the handle's plan, on ``stream`` (else
        the current one), so that dispatch and the masters' compute can run beside it.

        The sync waits (on its stream) for the plan and for every stream that waited for
        the replica slots since the last sync, then for all ranks (the plan agreement: no
        peer overwrites a slot that a rank still reads), and ends with no barrier: each chunk
        is flagged at its destination. Before the expert compute reads a replica slot,
        make its stream wait for that slot's own chunks: :meth:`wait_replica` (or the
        returned :class:`ReplicaSync`'s ``wait``); :meth:`replica_weights` waits for all
        by default. ``blocks``: the copy kernel's grid (default: as many as are resident).

        Beside kernels that wait for peers (dispatch), a relay (an expert with more than
        ``relay_threshold`` replicas) can wait only for chunks whose senders' blocks get
        SMs: there, pass ``blocks`` well below the resident bound, or a ``relay_threshold``
        (``transfer_options``) of at least ``layout.max_instances - 1`` so no sync waits.

        A handle whose :meth:`update` started its sync (``weight_sync=True``) gets that sync,
        once: it ran on the update's stream and the default grid, whatever ``stream`` and
        ``blocks`` say here (a later call syncs again)."""
        return self._sync(handle, "weight_sync", stream, blocks)

    def restore(self, handle: BalanceHandle, *, stream: Any = None, blocks: int | None = None) -> ReplicaSync:
        """Backward: the same transfer for the micro-batch's own plan (other layers have
        since overwritten the shared replica slots); wait for its slots as after
        :meth:`weight_sync`."""
        return self._sync(handle, "restore", stream, blocks)

    def _sync(self, handle, stage: str, stream, blocks):
        entry = self._collective_entry(handle, stage, blocks=blocks)
        if stage == "weight_sync" and entry.started_sync is not None:
            (done,), entry.started_sync = entry.started_sync, None
            return ReplicaSync(self, handle, done)
        impl = self._impl
        with impl.stream(stream):
            impl.follow(impl.planned(entry.state), *self._replica_reads())
            entry.clock.start(stage)
            self.transfer.weight_sync(handle.layer, entry.plan, blocks=blocks, barrier=self.device is None)
            done = entry.clock.stop(stage)
            self._synced(handle, entry)
        return ReplicaSync(self, handle, done)

    def _replica_reads(self) -> tuple:
        """Marks a sync's stream must follow: the last transfer, and this rank's reads of the
        replica slots since, wherever they were enqueued. Peers are about to write the slots,
        so every rank must be done reading them: the transfer's plan agreement waits for
        every rank, so it is that barrier."""
        readers = [self._impl.mark_on(reader, "replica reads") for reader in self._readers.values()]
        return (self._transferred, *readers)

    def _synced(self, handle: BalanceHandle, entry: _RingSlot) -> None:
        """A sync of ``handle`` is enqueued on the current stream: later transfers follow it
        (not the replica reads it followed)."""
        self._readers.clear()
        self._transferred = self._impl.mark("transfer")
        self._used(entry, "transfer")
        entry.syncs += 1
        self._weights_owner = handle

    def wait_replica(self, handle: BalanceHandle, slot: int | None = None, *, stream: Any = None) -> None:
        """Make ``stream`` (else the current one) wait, on the device, until replica slot
        ``slot`` of this rank (``None``: every slot) holds the weights the handle's sync
        or restore brought -- each slot's own chunks, not the whole sync. A slot the plan
        leaves empty has nothing to wait for. Local (no collective), returns at once; a
        wait that outlasts ``timeout_s`` gives up and :meth:`check` raises
        :class:`~ultraep.errors.TransferTimeout` naming the slot and layer. On the host the
        sync has finished when it returns: nothing is left to wait for.

        Enqueue the compute that reads the slot on this stream (or behind it) before the
        next :meth:`weight_sync` or :meth:`restore`: that sync waits for it."""
        S = self.layout.redundant_slots
        if slot is not None and (not is_int(slot) or not 0 <= slot < S):
            raise BalancerError(f"slot must be None or an int in [0, {S}), got {slot!r}")
        entry = self._check_live_owner(handle, "wait_replica")
        slots = range(S) if slot is None else range(int(slot), int(slot) + 1)
        with self._impl.stream(stream):
            self._impl.follow(self._impl.planned(entry.state))  # the wait reads which slots the plan fills
            self.transfer.wait_replica(handle.layer, entry.plan, slots)
            reader = self._impl.current()
            if reader is not None:
                self._readers[reader.ptr] = reader
            self._used(entry, "wait")

    def reroute(self, handle: BalanceHandle, topk_ids: Any = None, *, out: Any = None, stream: Any = None) -> Any:
        """Physical slot ids (int32, shaped like the ids) for this rank's tokens: feed them to
        any dispatcher over ``layout.num_physical`` experts.

        Without ``topk_ids``: the reroute of the ids the handle's :meth:`update` counted,
        which that update already computed (on the GPU, in its own launch: no device work
        here, and ``stream``, else the current one, only waits for the update). A handle
        whose update got ``local_loads`` has none: :class:`~ultraep.errors.BalancerError`.
        With ``topk_ids``: they must be the ids (or ids with the same per-expert counts)
        passed to :meth:`update`, rerouted here (into ``out`` when given).

        On the GPU the result is, unless ``out`` is given, a view of the handle's ring-slot
        buffer: without ids, written by the update and valid until the update that reuses
        the ring slot (the handle is stale from then); with ids, valid until the next
        ``reroute`` with ids of a handle in the same slot."""
        error, slots = None, None
        with self._impl.stream(stream, topk_ids):
            try:
                self._check_open()
                entry = self._entry(handle)
                if topk_ids is None:
                    if out is not None:
                        raise BalancerError(f"rank {self.rank}: reroute: out needs topk_ids (without them reroute "
                                            "returns the update's own result)")
                    if not entry.counted_ids:
                        raise BalancerError(f"rank {self.rank}: reroute without topk_ids returns the reroute of the "
                                            f"ids update counted, but layer {handle.layer}, micro-batch "
                                            f"{handle.step} was updated from local_loads: pass topk_ids")
                else:
                    ids = self._import_ids(topk_ids)
                    if out is not None:
                        out = self._import(out, "out", writable=True)
                self._impl.follow(self._impl.planned(entry.state))
                entry.clock.start("reroute")
                try:
                    slots = (self._impl.routed(entry.state) if topk_ids is None
                             else self._impl.reroute(entry.state, ids, entry.plan, out))
                except ValueError as exc:  # e.g. the NumPy path names ids the plan has no room for
                    raise BalancerError(f"rank {self.rank}: reroute: {exc}") from None
                finally:
                    entry.clock.stop("reroute")
                self._used(entry, "reroute")
            except (BalancerError, ClosedError) as exc:
                error = exc
        self._collective(error, "reroute")
        return slots

    def reduce_grads(self, handle: BalanceHandle, *, stream: Any = None) -> Any:
        """Collective: masters' gradients += their replicas' (replica order, fp32 accumulation).
        The replica gradient slots must hold this handle's gradients, written on this
        stream or on one that waited for the replicas (:meth:`wait_replica`). Returns a
        completion event (``None`` on the CPU backend)."""
        entry = self._collective_entry(handle, "reduce_grads", grads=True)
        impl = self._impl
        with impl.stream(stream):
            writers = [impl.mark_on(writer, "replica reads") for writer in self._readers.values()]
            impl.follow(impl.planned(entry.state), self._transferred, *writers)
            entry.clock.start("reduce_grads")
            self.transfer.reduce_grads(handle.layer, entry.plan)
            done = entry.clock.stop("reduce_grads")
            self._transferred = impl.mark("transfer")
            self._used(entry, "transfer")
        entry.reductions += 1
        self._grads_owner = None
        return done

    # -- buffers for the expert compute ----------------------------------------------------
    def _owner_error(self, handle, what: str):
        if handle == self._weights_owner:
            return None
        owner = self._weights_owner
        held = "nothing" if owner is None else f"layer {owner.layer}, micro-batch {owner.step}"
        return BalancerError(f"rank {self.rank}: {what}: the shared replica buffers hold {held}, not layer "
                             f"{handle.layer}, micro-batch {handle.step}; call weight_sync/restore with this "
                             "handle first")

    def _grads_error(self, handle, entry: _RingSlot, what: str):
        """Why ``handle``'s gradients may not go to the replica gradient slots now, or None:
        its replicas were never synced (nothing computed their gradients), or the slots hold
        another handle's gradients that no reduce_grads has added yet."""
        if entry.syncs == 0:
            return BalancerError(f"rank {self.rank}: {what}: the shared replica buffers hold no weights of layer "
                                 f"{handle.layer}, micro-batch {handle.step} yet; call weight_sync/restore with this "
                                 "handle first")
        owner = self._grads_owner
        if owner is not None and owner != handle:
            return BalancerError(f"rank {self.rank}: {what}: the replica gradient slots hold layer {owner.layer}, "
                                 f"micro-batch {owner.step}'s gradients, not yet added: call reduce_grads with that "
                                 "handle first")
        return None

    def holds_replicas(self, handle: BalanceHandle) -> bool:
        """Whether the replica weight slots hold ``handle``'s weights (its weight_sync or
        restore was the last): what :meth:`replica_weights` and :meth:`wait_replica` need."""
        self._entry(handle)
        return handle == self._weights_owner

    def replica_weights(self, handle: BalanceHandle, *, wait: bool = True, stream: Any = None) -> list:
        """``[slot][tensor]`` views of this rank's replica weight slots (DLPack-exportable;
        read only). Which expert a slot holds: :meth:`local_experts`. With ``wait`` (the
        default) ``stream`` (else the current one) first waits for every slot
        (:meth:`wait_replica`); pass ``wait=False`` to wait per slot instead."""
        self._check_live_owner(handle, "replica_weights")
        if not is_bool(wait):
            raise BalancerError(f"replica_weights: wait must be a bool, got {wait!r}")
        if wait:
            self.wait_replica(handle, stream=stream)
        return [self.transfer.replica_weights(s) for s in range(self.layout.redundant_slots)]

    def replica_grads(self, handle: BalanceHandle) -> list:
        """``[slot][tensor]`` views of this rank's replica gradient slots, which now hold
        ``handle``'s gradients until its :meth:`reduce_grads`: write each replica's full
        gradient here before that, which adds every slot the plan fills (write no other
        slot: it is neither read nor zeroed). They start at zero and ``reduce_grads``
        zeroes the slots it read, so a replica that served no rows adds nothing and no
        gradient is added twice. The handle must have been synced once (its replica
        weights need not be in the slots any more)."""
        error = self._grads_error(handle, self._entry(handle), "replica_grads")
        if error is not None:
            raise error
        self._grads_owner = handle
        return [self.transfer.replica_grads(s) for s in range(self.layout.redundant_slots)]

    def _check_live_owner(self, handle, what: str) -> _RingSlot:
        entry = self._entry(handle)
        error = self._owner_error(handle, what)
        if error is not None:
            raise error
        return entry

    def local_experts(self, handle: BalanceHandle) -> Any:
        """``int32[M + S]``: the logical expert in each of this rank's physical slots (masters,
        then replica slots; ``-1`` empty) -- a view of the plan's ``phys_to_log``."""
        plan = self._entry(handle).plan
        P = self.layout.slots_per_rank
        return plan.phys_to_log[self.rank * P:(self.rank + 1) * P]

    def plan(self, handle: BalanceHandle) -> Plan:
        """The handle's plan (``phys_to_log``, ``log_to_phys``, ``replica_count``, ...)."""
        return self._entry(handle).plan

    # -- metrics -------------------------------------------------------------------------------
    def _host_arrays(self, entry: _RingSlot) -> dict:
        """Host copies of what a record needs (``loads``, ``phys_to_log``, ``rank_load``, ``liveness``)."""
        return self._impl.host_arrays(entry.state, entry.plan)

    def _harvest(self, entry: _RingSlot, layer: int) -> None:
        """Move what a ring slot's record needs into the history (and the trace) before the
        slot is reused; the record itself is built when :meth:`stats` reads it (off the
        update's path)."""
        if entry.harvested:
            return
        entry.harvested = True
        arrays = {name: np.array(value) if name != "liveness" else value  # the slot's mirrors are rewritten
                  for name, value in self._host_arrays(entry).items()}
        self._history.append(partial(_record, self.layout, self.spec, layer, entry.step, arrays, entry.syncs,
                                     entry.reductions, entry.clock.times()))
        if self.recorder is not None:
            self.recorder.record(entry.step, layer, arrays["loads"])

    def _live_record(self, layer: int, entry: _RingSlot):
        return _record(self.layout, self.spec, layer, entry.step, self._host_arrays(entry), entry.syncs,
                       entry.reductions, entry.clock.times())

    def _live_entries(self):
        """(layer, ring slot) of every live plan, each layer's oldest first."""
        for layer, ring in enumerate(self._rings):
            for entry in sorted(ring, key=lambda e: e.step):
                if not entry.harvested:
                    yield layer, entry

    def stats(self) -> BalancerStats:
        """Records of the finished micro-batches (the last ``history``) and of the ring's
        live ones; synchronises the device on the GPU."""
        self._check_open()
        liveness = self._impl.synchronize()
        self._history = deque((item() if isinstance(item, partial) else item for item in self._history),
                              maxlen=self._history.maxlen)
        live = [self._live_record(layer, entry) for layer, entry in self._live_entries()]
        return BalancerStats(records=list(self._history) + live, updates=self._updates, liveness=liveness,
                             host_waits=self._impl.host_waits, host_wait_ms=1e3 * self._impl.host_wait_s)

    def save_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write every micro-batch so far (finished and live) as a planner trace (``.npz``)."""
        self._check_open()
        if self.recorder is None:
            raise BalancerError("the Balancer was created without record_trace=True")
        if not isinstance(path, (str, os.PathLike)):
            raise BalancerError(f"save_trace: path must be a str or os.PathLike, got {type(path).__name__}")
        self._impl.synchronize()
        for layer, entry in self._live_entries():  # live slots reach the recorder only when reused
            self.recorder.record(entry.step, layer, self._host_arrays(entry)["loads"])
        try:
            return self.recorder.save(path)
        except ValueError as exc:  # a trace is a full (micro-batch, layer) grid
            raise BalancerError(f"save_trace: {exc} (updates per layer so far: {self._steps})") from None

    def check(self) -> None:
        """Wait for queued work; raise deferred device errors (bad ids, timed-out waits)."""
        self._check_open()
        self._impl.check()
        self.transfer.synchronize()

    # -- teardown ----------------------------------------------------------------------------
    def _close_parts(self) -> None:  # HeapBacked.close: the replica buffers, then an own heap
        self.transfer.close()
