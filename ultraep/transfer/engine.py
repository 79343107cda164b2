"""``WeightTransfer``: the data plane of one EP group, a thin object over its backend.

Set up once per EP group with the layout and the expert's tensor spec: ``S`` weight slots
and ``S`` gradient slots per rank in the symmetric heap (shared by all layers; no
optimizer state) plus the chunk flags. Per layer the framework registers its master
weights and gradients (they stay in the framework's memory). Per micro-batch and layer:

* :meth:`~WeightTransfer.weight_sync` copies each replicated master into its replica slots
  (relay trees for hot experts) and, by default, ends with a heap barrier so every replica
  is complete before token dispatch; :meth:`~WeightTransfer.restore` re-runs it for a saved
  plan in backward. With ``barrier=False`` on the device, the senders flag every chunk at
  its destination instead, and a reader enqueues :meth:`~WeightTransfer.wait_replica`
  for the slots it is about to use: each slot's compute waits for its own chunks only;
* :meth:`~WeightTransfer.reduce_grads` adds every replica's gradient into its master's
  gradient in replica order, fp32 accumulation, deterministic, after a barrier that says
  all replica gradients are written (on the device the plan agreement, which waits for
  every rank), and before one that frees the slots for the next layer.

The replica gradient slots start at zero and ``reduce_grads`` zeroes the slots the plan
fills once every master has read them, so a micro-batch that writes no gradient for a
replica adds zeros, never an earlier micro-batch's gradients (and the zeroing stays off
the forward path). Write only the slots the plan fills: the others are neither read nor
zeroed, which keeps a plan with few replicas from paying for all ``S`` slots.

Arguments are agreed before any rank can raise alone. Each transfer compares a hash of its
layer and of the plan's placement (``log_to_phys``, ``replica_count``) across ranks
(:mod:`ultraep.transfer.agreement`), so a plan or layer that differs on one rank is refused
on every rank. On the host that is a host collective, with the layer and grid checked
collectively too, before any work. On the device the plan stays on the device: a kernel
compares the hashes through the heap's signal pads, a refused transfer writes nothing, and
:meth:`~WeightTransfer.synchronize` raises the disagreement on every rank. A rank's local
refusal there (a layer it never registered, a bad grid) leaves its peers' waits to end with
a device-side timeout naming it, and a placement that breaks the layout is refused by
every rank's device compiler.

The engine checks its arguments (collectively) and holds what both backends share; the
work is done by the backend of the heap, chosen once: :class:`~ultraep.transfer.host.HostTransfer`
(NumPy over the host heap) or :class:`~ultraep.transfer.device.DeviceTransfer` (the kernels).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ultraep.errors import ClosedError
from ultraep.planner.layout import ExpertLayout
from ultraep.planner.plan import Plan
from ultraep.runtime.backend import DEVICE
from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.dtypes import is_int
from ultraep.runtime.heap import HeapRequirements, SymmetricHeap, timeout_error
from ultraep.runtime.kernels import kernel_constant
from ultraep.transfer.agreement import SIGNALS as AGREEMENT_SIGNALS
from ultraep.transfer.agreement import WHAT as AGREED_WHAT
from ultraep.transfer.agreement import DevicePlanAgreement, plan_hash
from ultraep.transfer.host import HostTransfer
from ultraep.transfer.prepared import PreparedSync
from ultraep.transfer.schedule import HeapPlacement, Schedule, TileGeometry, compile_schedule, host_plan
from ultraep.transfer.slot_copy import FilledSlotCopy
from ultraep.transfer.spec import ExpertSpec

DEFAULT_TILE_BYTES = 32 << 10  # best a multiple of the kernels' PIECE_BYTES: a shorter piece takes a whole warp turn
MAX_BLOCKS = 1 << 20           # the kernels' int32 task or piece slot plus the grid stride must not overflow
MAX_TENSORS_PER_EXPERT = kernel_constant("transfer.cu", "MAX_TENSORS")
MAX_REPLICAS_PER_EXPERT = kernel_constant("transfer.cu", "MAX_DESTS")  # destinations of one source


def grid_error(blocks: int | None) -> str | None:
    """Why a requested grid (``blocks``; None: the backend's) cannot be launched, or None."""
    if blocks is None or (is_int(blocks) and 0 < blocks <= MAX_BLOCKS):
        return None
    return f"blocks must be in [1, {MAX_BLOCKS}] (an int), got {blocks!r}"


class TransferBackend(Protocol):
    """What :class:`WeightTransfer` asks of its backend (HostTransfer, DeviceTransfer).

    Constructed collectively with ``(heap, layout, spec, geometry, placement,
    replica_weights, *, relay_threshold, relay_count, blocks, timeout_s)``; ``blocks``
    (None: the backend's default grid) has passed :func:`grid_error`. An ``entry`` is what
    :meth:`import_layer` made of one layer's masters."""

    device: int | None  # where master tensors must live (None: host memory)
    agrees_in_sync: bool  # a weight sync runs the device's plan agreement itself (an AgreementBesideCompile)

    @staticmethod
    def setup_error(spec: ExpertSpec) -> str | None:
        """Why this backend cannot transfer experts of ``spec``, or None (checked on every rank)."""

    def sync_grid_error(self, blocks: int | None) -> str | None:
        """Why this backend cannot run a weight sync on ``blocks`` beyond :func:`grid_error`."""

    def import_layer(self, weights: list, grads: list) -> object:
        """The layer's entry from its imported masters: ``weights[m * T + t]``, ``grads[m * T + t]``."""

    syncs: int  # weight syncs prepared so far: the last one's epoch

    def prepare_sync(self, entry, plan, blocks: int | None, flag_every_chunk: bool) -> PreparedSync:
        """Collective once launched: this rank's share of filling every replica slot of
        ``plan``, counted now and launched by the result (see :class:`PreparedSync`).
        ``flag_every_chunk`` (device): publish each chunk's flag at its destination, for the
        device's ``wait_slots(plan, first_slot, count, epoch, layer)``; the host flags only
        what relays forward, and its syncs have finished when ``launch`` returns."""

    def run_weight_tasks(self, entry, tables, blocks: int | None) -> None:
        """The copies of a compiled weight sync alone (what ``weight_sync`` ends with)."""

    def reduce_grads(self, entry, plan, blocks: int | None) -> None:
        """Collective: this rank's masters += their replicas' gradients, in replica order."""

    def run_grad_tasks(self, entry, tables, blocks: int | None) -> None:
        """The reduction of a compiled gradient schedule alone (what ``reduce_grads`` ends with)."""

    def barrier(self) -> None:
        """A heap barrier in the backend's order of work."""

    def synchronize(self) -> None:
        """Wait for the enqueued work; raise what it found (timeouts, refused plans)."""


def _backend_class(backend: str) -> type:
    """The implementation for a heap backend (``"host"`` or ``"device"``)."""
    if backend == DEVICE:
        from ultraep.transfer.device import DeviceTransfer  # imports CuPy: only where chosen

        return DeviceTransfer
    return HostTransfer


class WeightTransfer:
    """Replica buffers of one EP group and the transfers that fill and drain them.

    ``heap``: the group's symmetric heap (its backend picks the implementation);
    ``layout``: the EP layout plans are made for; ``spec``: one expert's tensors.
    ``tile_bytes`` (a multiple of 256) and ``chunk_tiles`` cut each expert into tiles and
    chunks (one task, one chunk flag per chunk); an expert with more than
    ``relay_threshold`` replicas is sent to ``relay_count`` relays that forward each chunk
    to the rest; ``blocks`` is the default grid (None: the backend's); ``timeout_s`` bounds
    every wait. Construction, :meth:`register_layer` and every transfer are collective.

    On the device every call is enqueued on the current stream and returns at once;
    :meth:`synchronize` waits and reports what went wrong. On the host each call has
    finished when it returns.
    """

    @staticmethod
    def heap_requirements(layout: ExpertLayout, spec: ExpertSpec, *, tile_bytes: int = DEFAULT_TILE_BYTES,
                          chunk_tiles: int = 4) -> HeapRequirements:
        """What an engine of this layout, spec and tiling allocates in its heap: ``S``
        weight and ``S`` gradient slots (one idle slot when ``S`` is 0, so offsets stay
        defined), a chunk flag per slot and chunk, and the device's plan-agreement flags."""
        slots = max(layout.redundant_slots, 1)
        chunks = TileGeometry(spec, tile_bytes, chunk_tiles).num_chunks
        return HeapRequirements.of(
            tensors=[("transfer.replica_weights", (slots, spec.weight_slot_bytes), np.uint8),
                     ("transfer.replica_grads", (slots, spec.grad_slot_bytes), np.uint8)],
            signals=[("transfer.chunk_flags", slots * chunks)]) + DevicePlanAgreement.heap_requirements(layout)

    def __init__(self, heap: SymmetricHeap, layout: ExpertLayout, spec: ExpertSpec, *,
                 tile_bytes: int = DEFAULT_TILE_BYTES,
                 chunk_tiles: int = 4, relay_threshold: int = 3, relay_count: int = 2, blocks: int | None = None,
                 timeout_s: float = 30.0):
        group = heap.group
        implementation = _backend_class(heap.backend)
        error = None
        counts = (("tile_bytes", tile_bytes), ("chunk_tiles", chunk_tiles), ("relay_threshold", relay_threshold),
                  ("relay_count", relay_count))
        # every check a string, never a raise: a rank raising alone would leave its peers in the collective
        if not isinstance(layout, ExpertLayout):
            error = f"layout must be an ExpertLayout, got {type(layout).__name__}"
        elif not isinstance(spec, ExpertSpec):
            error = f"spec must be an ExpertSpec, got {type(spec).__name__}"
        elif (wrong := next((n for n, v in counts if not is_int(v)),
                            None)) is not None:
            error = f"{wrong} must be an int, got {dict(counts)[wrong]!r}"
        elif layout.num_ranks != heap.size:
            error = f"layout has {layout.num_ranks} ranks but the heap's group has {heap.size}"
        elif tile_bytes <= 0 or tile_bytes % 256:
            error = f"tile_bytes must be a positive multiple of 256, got {tile_bytes}"
        elif chunk_tiles < 1:
            error = f"chunk_tiles must be positive, got {chunk_tiles}"
        elif len(spec.weights) > MAX_TENSORS_PER_EXPERT:
            error = f"an expert may have at most {MAX_TENSORS_PER_EXPERT} tensors, the spec has {len(spec.weights)}"
        elif layout.max_instances - 1 > MAX_REPLICAS_PER_EXPERT:
            error = (f"layout allows {layout.max_instances - 1} replicas per expert; "
                     f"the kernel handles {MAX_REPLICAS_PER_EXPERT}")
        elif relay_threshold < 1 or relay_count < 1:
            error = f"relay_threshold and relay_count must be >= 1, got {relay_threshold}, {relay_count}"
        else:
            error = grid_error(blocks) or timeout_error(timeout_s) or implementation.setup_error(spec)
        group.raise_if_any(error, "WeightTransfer set-up")
        group.agree((repr(layout), spec.key(), tile_bytes, chunk_tiles, relay_threshold, relay_count, float(timeout_s)),
                    "WeightTransfer set-up (layout, expert spec, tiling, relay options, timeout_s)")
        self.heap, self.group, self.layout, self.spec = heap, group, layout, spec
        self.rank = heap.rank
        self.serial = group.next_serial("WeightTransfer")  # in its calls' names: ranks on two engines mismatch
        self.geometry = TileGeometry(spec, tile_bytes, chunk_tiles)
        self.relay_threshold, self.relay_count = relay_threshold, relay_count
        self.timeout_s = timeout_s
        buffers = heap.allocate(self.heap_requirements(layout, spec, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles))
        self._weights, self._grads = buffers["transfer.replica_weights"], buffers["transfer.replica_grads"]
        flags = buffers["transfer.chunk_flags"]
        self.placement = HeapPlacement(self._weights.offset, self._grads.offset, flags.first_slot)
        self.impl: TransferBackend = implementation(
            heap, layout, spec, self.geometry, self.placement, self._weights, relay_threshold=relay_threshold,
            relay_count=relay_count, blocks=blocks, timeout_s=timeout_s)
        self._agreement = (DevicePlanAgreement(heap, layout, buffers[AGREEMENT_SIGNALS], timeout_s)
                           if self.impl.device is not None else None)
        S = layout.redundant_slots
        self._views = {name: [self._views_of(buffer, slot, tensors, offsets) for slot in range(S)]
                       for name, buffer, tensors, offsets in (
                           ("weights", self._weights, spec.weights, spec.weight_offsets),
                           ("grads", self._grads, spec.grads, spec.grad_offsets))}
        # reduce_grads zeroes the gradient slots it read: those the plan fills, not all S
        self._zero_read_grads = FilledSlotCopy([(None, self._grads.local)], S, device=self.impl.device)
        self._layers: dict = {}
        self._flagged_epoch: int | None = None  # the last sync's epoch if its chunks were flagged (device)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}: the WeightTransfer is closed")

    # -- buffers the framework computes with ------------------------------------------
    def replica_weights(self, slot: int) -> list:
        """Typed views (DLPack-exportable) of redundant slot ``slot``'s weight tensors."""
        return self._slot_views("weights", slot)

    def replica_grads(self, slot: int) -> list:
        """Typed views (DLPack-exportable) of redundant slot ``slot``'s gradient tensors."""
        return self._slot_views("grads", slot)

    def replica_bytes(self, kind: str, tensor: int) -> Any:
        """uint8 ``[S, nbytes]`` view of tensor ``tensor`` of every redundant slot's weights
        (``kind="weights"``) or gradients (``"grads"``): what a :class:`FilledSlotCopy` moves."""
        self._check_open()
        slots = {"weights": (self._weights, self.spec.weights, self.spec.weight_offsets),
                 "grads": (self._grads, self.spec.grads, self.spec.grad_offsets)}
        if kind not in slots:
            raise ValueError(f"kind must be 'weights' or 'grads', got {kind!r}")
        buffer, tensors, offsets = slots[kind]
        offset = offsets[tensor]
        return buffer.local[:self.layout.redundant_slots, offset:offset + tensors[tensor].nbytes]

    def replica_entries(self, plan: Plan) -> Any:
        """``int32[S]``: the plan's ``phys_to_log`` entries of this rank's redundant slots
        (``-1``: empty), a view on the plan's device (what :class:`FilledSlotCopy` reads)."""
        first = self.rank * self.layout.slots_per_rank + self.layout.experts_per_rank
        return plan.phys_to_log[first:first + self.layout.redundant_slots]

    def _slot_views(self, kind: str, slot: int) -> list:
        self._check_open()
        S = self.layout.redundant_slots
        if not is_int(slot) or not 0 <= slot < S:
            raise IndexError(f"rank {self.rank}: redundant slot {slot!r} is not an int in [0, {S})")
        self.heap._check_open(f"replica slot {slot}")  # the cached views die with the heap
        return list(self._views[kind][slot])

    def _views_of(self, buffer, slot: int, tensors, offsets) -> list:
        base = buffer.offset + slot * buffer.shape[1]
        return [self.heap.view(self.rank, base + off, t.shape, t.dtype) for t, off in zip(tensors, offsets)]

    # -- per-layer registration ----------------------------------------------------------
    def register_layer(self, layer: int, weights: list[list[Any]], grads: list[list[Any]]) -> None:
        """Collective. ``weights[m][t]`` / ``grads[m][t]``: tensor ``t`` of this rank's ``m``-th master."""
        self._check_open()
        error, entry = None, None
        try:
            if not is_int(layer):
                raise TypeError(f"layer must be an int, got {layer!r}")
            entry = self._import_layer(layer, weights, grads)
        except (ValueError, TypeError) as exc:
            error = exc
        self.group.raise_if_any(error, f"register_layer({layer})", call="register_layer")
        self.group.agree(layer, "registered layer id")
        self._layers[layer] = entry

    def registered(self, layer: int) -> bool:
        """Whether :meth:`register_layer` has registered ``layer`` on this rank."""
        return layer in self._layers

    def _import_layer(self, layer, weights, grads):
        M, device = self.layout.experts_per_rank, self.impl.device
        for what, tensors in (("weights", weights), ("grads", grads)):
            if len(tensors) != M or any(len(per_expert) != len(self.spec.weights) for per_expert in tensors):
                raise ValueError(f"layer {layer} {what}: expected {M} masters x {len(self.spec.weights)} tensors")
        sources, grad_views = [], []
        for m in range(M):
            for t, (w_spec, g_spec) in enumerate(zip(self.spec.weights, self.spec.grads)):
                w = import_tensor(weights[m][t], name=f"layer {layer} master {m} weight {w_spec.name!r}", device=device,
                                  dtype=w_spec.dtype)
                g = import_tensor(grads[m][t], name=f"layer {layer} master {m} grad {g_spec.name!r}", device=device,
                                  dtype=g_spec.dtype, writable=True)
                for tensor, spec, what in ((w, w_spec, "weight"), (g, g_spec, "grad")):
                    if tuple(tensor.shape) != spec.shape:
                        raise ValueError(f"layer {layer} master {m} {what} {spec.name!r}: shape {tuple(tensor.shape)}, "
                                         f"expected {spec.shape}")
                sources.append(w)
                grad_views.append(g)
        return self.impl.import_layer(sources, grad_views)

    # -- schedules -----------------------------------------------------------------------
    def schedule(self, plan: Plan) -> Schedule:
        """This rank's tasks for ``plan``, compiled on the host by the NumPy reference (what
        the host backend runs; the device backend compiles its own on the device, so there
        this reads a device plan back and is for inspection only)."""
        self._check_open()
        self._check_plan(plan)
        return compile_schedule(host_plan(plan), self.spec, self.geometry, self.placement, self.rank,
                                relay_threshold=self.relay_threshold, relay_count=self.relay_count)

    def _check_plan(self, plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan (from plan_placement or a Balancer), got {type(plan).__name__}")
        if plan.layout != self.layout:
            raise ValueError(f"plan is for {plan.layout}, this WeightTransfer was set up for {self.layout}")

    def _checked(self, what: str, layer: int, plan, blocks: int | None, grid_check) -> tuple:
        """The layer's entry and the plan to transfer, once ``layer``, ``plan`` and ``blocks``
        passed on this rank and, on the host, on every rank, with the same plan everywhere
        (else ValueError). On the device the plan returned is the agreement kernel's
        (:mod:`ultraep.transfer.agreement`): ``plan`` where the ranks agree, else one whose
        transfer writes nothing; for a weight sync, the agreement to run with its launch (in it,
        or just before it where ranks share a GPU)."""
        if self._closed and self._agreement is None:  # the host's peers learn it in this call's own check
            self.group.refuse_closed(ClosedError(f"rank {self.rank}: the WeightTransfer is closed"),
                                     f"{what}({layer})", call=f"{what} of WeightTransfer #{self.serial}")
        self._check_open()
        self.heap._check_open(f"WeightTransfer.{what}")  # its replica slots and peer table are gone
        error, entry, fingerprint = None, None, None
        try:
            entry = self._layers.get(layer)
            if entry is None:
                raise ValueError(f"layer {layer} has no registered master weights/gradients on rank {self.rank} "
                                 "(call register_layer first)")
            self._check_plan(plan)
            if (bad_grid := grid_check(blocks)) is not None:
                raise ValueError(bad_grid)
            if self._agreement is not None:  # the device answers a lone refusal with a timeout, not a host wait
                if what == "weight_sync" and self.impl.agrees_in_sync:  # with the sync's one launch
                    return entry, self._agreement.beside_compile(what, layer, plan)
                return entry, self._agreement.agreed(what, layer, plan)
            numpy_plan = host_plan(plan)
            fingerprint = f"{plan_hash(layer, numpy_plan.log_to_phys, numpy_plan.replica_count):#018x}"
        except (ValueError, TypeError, AttributeError) as exc:
            error = ValueError(str(exc)) if isinstance(exc, AttributeError) else exc
            if self._agreement is not None:
                raise error from None
        self.group.raise_if_any(error, f"{what}({layer})", call=f"{what} of WeightTransfer #{self.serial}")
        self.group.agree((layer, fingerprint), f"{what} of WeightTransfer #{self.serial} {AGREED_WHAT}")
        return entry, plan

    # -- transfers -----------------------------------------------------------------------
    def weight_sync(self, layer: int, plan: Plan, *, blocks: int | None = None, barrier: bool = True) -> None:
        """Fill every replica slot of ``plan`` with its master's weights (collective).

        ``barrier=False``: no heap barrier closes the sync. On the device every chunk's
        flag is then published at its destination, and a rank reads a replica slot after
        :meth:`wait_replica` for it (on the reading stream). On the host (synchronous, and
        flagging only the chunks relays forward) a later heap barrier must order them."""
        self.prepare_weight_sync(layer, plan, blocks=blocks, barrier=barrier).launch()

    def prepare_weight_sync(self, layer: int, plan: Plan, *, blocks: int | None = None,
                            barrier: bool = True) -> PreparedSync:
        """:meth:`weight_sync` checked, agreed on and counted now, enqueued by the result's
        ``launch()`` (:class:`PreparedSync`), which must be called once, before any other
        transfer is prepared: e.g. inside the CUDA graph capture of the launches that write
        ``plan`` (the Balancer's update). :meth:`wait_replica` waits for this sync from now on."""
        entry, plan = self._checked("weight_sync", layer, plan, blocks, self.sync_grid_error)
        sync = self.impl.prepare_sync(entry, plan, blocks, not barrier)
        self._flagged_epoch = None if barrier or self.impl.device is None else self.impl.syncs
        if not barrier:
            return sync

        def sync_and_barrier() -> None:
            sync.launch()
            self.impl.barrier()
        return PreparedSync(sync_and_barrier, None)

    def sync_grid_error(self, blocks: int | None) -> str | None:
        """Why a weight sync cannot run on ``blocks`` (None: the default grid), or None;
        the same answer on every rank."""
        return grid_error(blocks) or self.impl.sync_grid_error(blocks)

    def wait_replica(self, layer: int, plan: Plan, slots: range) -> None:
        """Make the current stream wait (bounded by ``timeout_s``; :meth:`synchronize`
        reports a timeout naming the slot and layer) until the last weight sync, run for
        ``plan`` of ``layer`` without a barrier, has landed every chunk of this rank's
        replica slots ``slots`` that the plan fills. Nothing to wait for after a sync
        that ended with a barrier, nor on the host."""
        self._check_open()
        if not (isinstance(slots, range) and slots.step == 1 and 0 <= slots.start <= slots.stop
                <= self.layout.redundant_slots):
            raise IndexError(f"replica slots must be a range within [0, {self.layout.redundant_slots}), got {slots!r}")
        if self._flagged_epoch is not None and len(slots):
            self.impl.wait_slots(plan, slots.start, len(slots), self._flagged_epoch, layer)

    restore = weight_sync  # backward: the same transfer for the micro-batch's saved plan

    def reduce_grads(self, layer: int, plan: Plan, *, blocks: int | None = None) -> None:
        """Masters += replica gradients in replica order (collective; barriers on both sides,
        the first being the plan agreement on the device)."""
        entry, agreed = self._checked("reduce_grads", layer, plan, blocks, grid_error)
        if self._agreement is None:  # on the device the agreement kernel is this barrier: it waits for every rank
            self.impl.barrier()  # every replica gradient is written
        self.impl.reduce_grads(entry, agreed, blocks)
        self.impl.barrier()  # replica gradient slots are free again
        self._zero_read_grads(self.replica_entries(plan))  # every master has read them: none is added twice

    def synchronize(self) -> None:
        """Wait for the enqueued transfers; raise if a wait timed out or a plan was refused
        (its transfers were skipped; on the device a plan whose placement breaks the layout,
        or that differs across ranks, is refused by every rank). After a relay's timeout or a
        disagreement, transfers do nothing on this rank until this call has reported it."""
        self._check_open()
        if self._agreement is not None:
            self._agreement.check()  # the cause first: a refused plan is why later transfers did nothing
        self.impl.synchronize()

    def close(self) -> None:
        """Drop the layer registrations; the heap (owned by the caller) stays open. Any later
        call raises :class:`~ultraep.errors.ClosedError`."""
        self._closed = True
        self._layers.clear()
        self._views, self._zero_read_grads = {}, None  # views of the heap: closing it must not find them held

    def __enter__(self) -> WeightTransfer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
