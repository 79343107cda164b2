"""``WeightTransfer``: the data plane of one EP group, a thin object over the kernels.

Set up once per EP group with the layout and the expert's tensor spec: ``S`` weight slots
and ``S`` gradient slots per rank in the symmetric heap (shared by all layers; no
optimizer state) plus the chunk flags. Per layer the framework registers its master
weights and gradients (they stay in the framework's memory). Per micro-batch and layer:

* :meth:`weight_sync` copies each replicated master into its replica slots (relay trees
  for hot experts) and, by default, ends with a heap barrier so every replica is complete
  before token dispatch; :meth:`restore` re-runs it for a saved plan in backward;
* :meth:`reduce_grads` adds every replica's gradient into its master's gradient in
  replica order, fp32 accumulation, deterministic, after a barrier that says all replica
  gradients are written, and before one that frees the slots for the next layer.

On the GPU everything is enqueued on CuPy's current stream (the caller's; see
``runtime.dlpack.caller_stream``): each transfer first compiles its plan's task tables on
the device (``device_schedule``) into tables allocated here once, so with a plan already
on the device (the planner's CuPy backend) no call allocates or waits for the device.
Those tables and the kernels' counters are shared by every call of one engine, as the
replica slots are: its transfers must be ordered on one stream (or by events), never run
concurrently on two. :meth:`synchronize` waits and reports device-side timeouts and
refused plans (a plan whose placement breaks the layout is refused by every rank). On the
CPU backend the NumPy executor runs the schedule ``compile_schedule`` makes per call.
"""

from __future__ import annotations

import numpy as np

from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.heap import HeapRequirements, SymmetricHeap
from ultraep.transfer.device_schedule import DeviceSchedule
from ultraep.transfer.executor import TransferTimeout, chunk_timeout_message, run_grad_tasks, run_weight_tasks
from ultraep.transfer.schedule import HeapPlacement, Schedule, TileGeometry, compile_schedule, placement_error
from ultraep.transfer.spec import ExpertSpec

DEFAULT_TILE_BYTES = 32 << 10  # best a multiple of PIECE_BYTES: a shorter piece takes a whole warp turn
MAX_BLOCKS = 1 << 20         # the kernels' int32 task or piece slot plus the grid stride must not overflow
SYNC_THREADS = 256           # transfer.cu SYNC_THREADS: eight copying warps
SYNC_BLOCKS_PER_SM = 4       # transfer.cu SYNC_MIN_BLOCKS: its registers let this many blocks share an SM
PIECE_BYTES = 2048           # piece_copy.cuh PIECE_BYTES: what one warp copies at a time
MAX_TENSORS_PER_EXPERT = 8     # MAX_TENSORS in transfer.cu
MAX_REPLICAS_PER_EXPERT = 128  # MAX_DESTS in transfer.cu
_STATUS_FIELDS = 4


def grid_error(blocks: int | None) -> str | None:
    """Why a requested grid (``blocks``; None: the engine's) cannot be launched, or None."""
    return None if blocks is None or 0 < blocks <= MAX_BLOCKS else f"blocks must be in [1, {MAX_BLOCKS}], got {blocks}"


class WeightTransfer:
    @staticmethod
    def heap_requirements(layout, spec: ExpertSpec, *, tile_bytes: int = DEFAULT_TILE_BYTES,
                          chunk_tiles: int = 4) -> HeapRequirements:
        """What an engine of this layout, spec and tiling allocates in its heap: ``S``
        weight and ``S`` gradient slots (one idle slot when ``S`` is 0, so offsets stay
        defined) and a chunk flag per slot and chunk."""
        slots = max(layout.redundant_slots, 1)
        chunks = TileGeometry(spec, tile_bytes, chunk_tiles).num_chunks
        return HeapRequirements.of(
            tensors=[("transfer.replica_weights", (slots, spec.weight_slot_bytes), np.uint8),
                     ("transfer.replica_grads", (slots, spec.grad_slot_bytes), np.uint8)],
            signals=[("transfer.chunk_flags", slots * chunks)])

    def __init__(self, heap: SymmetricHeap, layout, spec: ExpertSpec, *, tile_bytes: int = DEFAULT_TILE_BYTES,
                 chunk_tiles: int = 4, relay_threshold: int = 3, relay_count: int = 2, blocks: int | None = None,
                 timeout_s: float = 30.0):
        group = heap.group
        error = None
        if layout.num_ranks != heap.size:
            error = f"layout has {layout.num_ranks} ranks but the heap's group has {heap.size}"
        elif tile_bytes <= 0 or tile_bytes % 256:
            error = f"tile_bytes must be a positive multiple of 256, got {tile_bytes}"
        elif len(spec.weights) > MAX_TENSORS_PER_EXPERT:
            error = f"an expert may have at most {MAX_TENSORS_PER_EXPERT} tensors, the spec has {len(spec.weights)}"
        elif layout.max_instances - 1 > MAX_REPLICAS_PER_EXPERT:
            error = f"layout allows {layout.max_instances - 1} replicas per expert; the kernel handles {MAX_REPLICAS_PER_EXPERT}"
        elif relay_threshold < 1 or relay_count < 1:
            error = f"relay_threshold and relay_count must be >= 1, got {relay_threshold}, {relay_count}"
        elif (bad_grid := grid_error(blocks)) is not None:
            error = bad_grid
        elif heap.backend == "device" and spec.grad_dtype.name not in ("bfloat16", "float32"):
            error = f"the GPU gradient reduction supports float32 and bfloat16 gradients, not {spec.grad_dtype}"
        group.raise_if_any(error, "WeightTransfer set-up")
        group.agree((repr(layout), spec.key(), tile_bytes, chunk_tiles, relay_threshold, relay_count),
                    "WeightTransfer set-up (layout, expert spec, tiling, relay options)")
        self.heap, self.group, self.layout, self.spec = heap, group, layout, spec
        self.rank = heap.rank
        self.geometry = TileGeometry(spec, tile_bytes, chunk_tiles)
        self.relay_threshold, self.relay_count = relay_threshold, relay_count
        self.timeout_s = timeout_s
        buffers = heap.allocate(self.heap_requirements(layout, spec, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles))
        self._weights, self._grads = buffers["transfer.replica_weights"], buffers["transfer.replica_grads"]
        self._flags = buffers["transfer.chunk_flags"]
        self.placement = HeapPlacement(self._weights.offset, self._grads.offset, self._flags.first_slot)
        self._layers: dict = {}
        self._epoch = 0
        self.gpu = heap.backend == "device"
        if self.gpu:
            import cupy
            from ultraep.runtime.kernels import get_function
            self._sync_kernel = get_function("transfer.cu", "weight_sync", group=group)
            name = "reduce_grads<__nv_bfloat16>" if spec.grad_dtype.name == "bfloat16" else "reduce_grads<float>"
            self._reduce_kernel = get_function("transfer.cu", name, group=group)
            self._status = cupy.zeros(_STATUS_FIELDS, dtype=np.uint64)
            props = cupy.cuda.runtime.getDeviceProperties(heap.device)
            first_tiles = np.searchsorted([t for t, _, _ in self.geometry.tiles], np.arange(len(spec.weights)))
            self._tensor_table = cupy.asarray(np.array(
                [(first, w.nbytes, off) for first, w, off in zip(first_tiles, spec.weights, spec.weight_offsets)],
                dtype=np.int64))
            # the same bound on every rank (the smallest GPU's), so a grid is refused by all or none
            self.max_sync_blocks = min(group.allgather(SYNC_BLOCKS_PER_SM * props["multiProcessorCount"]))
            group.raise_if_any(self._sync_grid_error(blocks), "WeightTransfer set-up")
            self.blocks = blocks or self.max_sync_blocks
            # Replica-slot tensor pointers follow the masters in every layer's source table.
            self._slot_ptrs = [int(self._weights.local[s].data.ptr) + off
                               for s in range(layout.redundant_slots) for off in spec.weight_offsets]
        else:
            self.blocks = blocks or 1
        self.device_schedule = DeviceSchedule(layout, spec, self.geometry, self.placement, self.rank,
                                              relay_threshold=relay_threshold, relay_count=relay_count,
                                              group=group) if self.gpu else None
        if self.gpu:
            tasks = len(self.device_schedule.weight_tasks)
            chunk_bytes = self.geometry.chunk_tiles * tile_bytes
            pieces = tasks * self.geometry.chunk_tiles * -(-tile_bytes // PIECE_BYTES)
            # the kernel's int32 chunk byte counts and piece grid (tasks x tiles x pieces) indices
            group.raise_if_any(None if chunk_bytes < 2**31 and pieces < 2**30 else
                               f"{tasks} weight tasks x {self.geometry.chunk_tiles} tiles of {tile_bytes} bytes per "
                               "chunk overflow the kernel's int32 chunk byte count or piece slot index; use fewer "
                               "or smaller tiles per chunk", "WeightTransfer set-up")
            # bytes of each task's chunk stored so far: zero between launches (the chunk's
            # finishing warp resets it; after a timeout, synchronize() does)
            self._sync_done = cupy.zeros(tasks, dtype=np.int32)

    # -- buffers the framework computes with ------------------------------------------
    def replica_weights(self, slot: int) -> list:
        """Typed views (DLPack-exportable) of redundant slot ``slot``'s weight tensors."""
        return self._slot_views(self._weights, slot, self.spec.weights, self.spec.weight_offsets)

    def replica_grads(self, slot: int) -> list:
        return self._slot_views(self._grads, slot, self.spec.grads, self.spec.grad_offsets)

    def _slot_views(self, buffer, slot: int, tensors, offsets) -> list:
        if not 0 <= slot < self.layout.redundant_slots:
            raise IndexError(f"redundant slot {slot} outside [0, {self.layout.redundant_slots})")
        base = buffer.offset + slot * buffer.shape[1]
        return [self.heap.view(self.rank, base + off, t.shape, t.dtype) for t, off in zip(tensors, offsets)]

    # -- per-layer registration ----------------------------------------------------------
    def register_layer(self, layer: int, weights, grads) -> None:
        """Collective. ``weights[m][t]`` / ``grads[m][t]``: tensor ``t`` of this rank's ``m``-th master."""
        error, entry = None, None
        try:
            entry = self._import_layer(layer, weights, grads)
        except (ValueError, TypeError) as exc:
            error = exc
        self.group.raise_if_any(error, f"register_layer({layer})")
        self.group.agree(layer, "registered layer id")
        self._layers[layer] = entry

    def _import_layer(self, layer, weights, grads):
        M, device = self.layout.experts_per_rank, self.heap.device if self.gpu else None
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
        if self.gpu:
            import cupy
            src_table = cupy.asarray(np.array([int(w.data.ptr) for w in sources] + self._slot_ptrs, dtype=np.uint64))
            dst_table = cupy.asarray(np.array([int(g.data.ptr) for g in grad_views], dtype=np.uint64))
            return {"sources": src_table, "grads": dst_table, "keep": (sources, grad_views)}
        slot_views = [v.reshape(-1).view(np.uint8) for s in range(self.layout.redundant_slots)
                      for v in self.replica_weights(s)]
        return {"sources": [w.reshape(-1).view(np.uint8) for w in sources] + slot_views,
                "grads": [g.reshape(-1) for g in grad_views]}

    # -- schedules -----------------------------------------------------------------------
    def schedule(self, plan) -> Schedule:
        """This rank's tasks for ``plan``, compiled on the host by the NumPy reference (what
        the CPU backend runs; on the GPU it reads a device plan back, so it is for
        inspection only: the transfers compile on the device)."""
        self._check_plan(plan)
        return compile_schedule(plan.to_numpy() if hasattr(plan, "to_numpy") else plan, self.spec, self.geometry,
                                self.placement, self.rank, relay_threshold=self.relay_threshold,
                                relay_count=self.relay_count)

    def _host_schedule(self, plan, what: str) -> Schedule:
        """The CPU backend's schedule, once every rank found the plan's placement sound
        (the same error on every rank otherwise; nothing is written)."""
        host_plan = plan.to_numpy() if hasattr(plan, "to_numpy") else plan
        self.group.raise_if_any(placement_error(self.layout, host_plan.log_to_phys, host_plan.replica_count), what)
        return self.schedule(host_plan)

    def _check_plan(self, plan) -> None:
        if plan.layout != self.layout:
            raise ValueError(f"plan is for {plan.layout}, this WeightTransfer was set up for {self.layout}")

    def _layer(self, layer):
        entry = self._layers.get(layer)
        if entry is None:
            raise ValueError(f"layer {layer} has no registered master weights/gradients (call register_layer first)")
        return entry

    # -- transfers -----------------------------------------------------------------------
    def weight_sync(self, layer: int, plan, *, blocks: int | None = None, barrier: bool = True) -> None:
        """Fill every replica slot of ``plan`` with its master's weights (collective). With
        ``barrier=False`` no rank may read a replica before a later heap barrier: only the
        chunks relays forward are flagged (schedule.py, ``publish``)."""
        entry = self._layer(layer)
        self._check_plan(plan)
        if (bad_grid := self._sync_grid_error(blocks)) is not None:
            raise ValueError(bad_grid)
        self._epoch += 1
        if self.gpu:
            self.device_schedule.compile_weights(plan)
            self._launch_sync(entry, self.device_schedule, blocks or self.blocks)
        else:
            run_weight_tasks(self._host_schedule(plan, "weight_sync"), self.heap, entry["sources"],
                             self.spec.weight_offsets, self._epoch, self.timeout_s)
        if barrier:
            self.heap.barrier(self.timeout_s, wait=not self.gpu)

    def _sync_grid_error(self, blocks: int | None) -> str | None:
        """grid_error, and on the GPU no more blocks than are resident at once: a relay's
        warps wait for chunks that its peers' blocks copy, so every block must be running
        (other work on the GPU that takes SMs the whole time can still starve them)."""
        if (error := grid_error(blocks)) is not None or not self.gpu or blocks is None or blocks <= self.max_sync_blocks:
            return error
        return (f"blocks must be at most {self.max_sync_blocks} for weight_sync on this GPU ({SYNC_BLOCKS_PER_SM} "
                f"resident per SM), got {blocks}")

    restore = weight_sync  # backward: the same transfer for the micro-batch's saved plan

    def _launch_sync(self, entry, tables: DeviceSchedule, blocks: int) -> None:
        self._sync_kernel((blocks,), (SYNC_THREADS,), (
            tables.weight_tasks, tables.weight_task_count, np.int32(len(tables.weight_tasks)),
            np.int32(self.geometry.chunk_tiles), self._tensor_table, np.int32(len(self.spec.weights)),
            np.int64(self.geometry.tile_bytes), tables.dests, np.int32(len(tables.dests)),
            entry["sources"], np.int32(len(entry["sources"])), self.heap.peer_bases, np.int32(self.heap.size),
            np.int32(self.rank), np.uint64(self._epoch), self._sync_done, np.uint64(int(self.timeout_s * 1e9)),
            self._status))

    def reduce_grads(self, layer: int, plan, *, blocks: int | None = None) -> None:
        """Masters += replica gradients in replica order (collective; barriers on both sides)."""
        entry = self._layer(layer)
        self._check_plan(plan)
        if (bad_grid := grid_error(blocks)) is not None:
            raise ValueError(bad_grid)
        self.heap.barrier(self.timeout_s, wait=not self.gpu)  # every replica gradient is written
        if self.gpu:
            tables = self.device_schedule
            tables.compile_grads(plan)
            self._reduce_kernel((blocks or self.blocks,), (256,), (
                tables.grad_tasks, tables.grad_task_count, tables.grad_srcs, entry["grads"], self.heap.peer_bases))
        else:
            run_grad_tasks(self._host_schedule(plan, "reduce_grads"), self.heap, entry["grads"], self.spec.grad_dtype)
        self.heap.barrier(self.timeout_s, wait=not self.gpu)  # replica gradient slots are free again

    def synchronize(self) -> None:
        """Wait for the enqueued transfers; raise if a device-side wait timed out or a plan
        was refused (its transfers were skipped). After a timeout, weight syncs do nothing on
        this rank until this call has reported it."""
        if not self.gpu:
            return
        self.heap.check_barriers()
        failed, slot, expected, seen = (int(v) for v in self._status.get())
        if failed:  # weight syncs since the timeout did nothing (transfer.cu): start again from zero counts
            self._sync_done.fill(0)
            self._status.fill(0)
            raise TransferTimeout(chunk_timeout_message(self.rank, slot, expected, seen, self.timeout_s))
        refused = self.device_schedule.take_error()
        if refused is not None:
            raise ValueError(refused)

    def close(self) -> None:
        """Drop the layer registrations; the heap (owned by the caller) stays open."""
        self._layers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
