"""Device backend of the ``Dispatcher``: the token path as ``raw_kernels/dispatch.cu`` kernels.

Everything runs on the caller's stream with no host round trip: the token map (stable
key positions by warp-sequential segments and prefix sums), the count exchange through
every peer's count table plus a device barrier (``heap.cu``'s ``symmetric_barrier`` on this
dispatcher's own signal slots), the row plan, one send per (token, destination rank),
and the receiver's expansion (with ``expert_input``: one store per (token, slot) straight
into its row of the destination's ``expert_in``, no expansion). Output sizes are bounded
at set-up (``max_recv_rows``); the rows in use are ``offsets[-1]`` on the device.

Errors the device finds (bad expert ids, non-finite gates, a routing over the receive bound)
travel with the count table, so every rank reaches the same verdict and skips the data
movement; a device wait that times out records (site, rank, expected, seen). With
``sync_checks`` each call then synchronises and raises on every rank; otherwise
:meth:`DeviceDispatcher.check` does.
"""

from __future__ import annotations

import numpy as np

from ultraep.errors import DispatchError, everywhere
from ultraep.runtime.dlpack import caller_stream, import_tensor
from ultraep.runtime.dtypes import BFLOAT16
from ultraep.runtime.group import EPGroup
from ultraep.runtime.kernels import get_function, kernel_constant
from ultraep.runtime.sm_partition import usable_sms
from ultraep.token.base import (KERNELS, DispatchHandle, DispatchResult, TokenBuffers, TokenConfig,
                                bad_input_message, check_rows, check_tokens, import_inputs,
                                too_many_rows_message)

# Launch choices: the kernels take any block of whole warps (up to CUDA's 1024 threads)
# and the segment length as an argument.
THREADS = 256
SEGMENT_ITEMS = 256          # items per warp segment of the token map
MAX_BLOCK_THREADS = 1024
WARP = kernel_constant(KERNELS, "WARP")
VECTOR_BYTES = kernel_constant(KERNELS, "VECTOR_BYTES")
NO_BAD_ITEM = kernel_constant(KERNELS, "NO_BAD_ITEM")
OUTCOME_BAD_INPUT = kernel_constant(KERNELS, "OUTCOME_BAD_INPUT")
OUTCOME_TOO_MANY_ROWS = kernel_constant(KERNELS, "OUTCOME_TOO_MANY_ROWS")
BARRIER_SITES = ("counts", "tokens", "combine-ready", "combine-rows", "grad-ready", "grad-tokens", "grad-rows",
                 "expert-rows-written", "expert-rows-read", "counts-read")
POINTER_BYTES = 8


def _template_type(dtype: np.dtype) -> str:
    names = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half"}
    if BFLOAT16 is not None:
        names[BFLOAT16] = "__nv_bfloat16"
    if dtype not in names:
        raise ValueError(f"the CUDA token path supports bfloat16, float16 and float32, not {dtype}")
    return names[dtype]


def _blocks(threads_needed: int) -> int:
    return max(1, -(-threads_needed // THREADS))


def _whole_warps(threads: int) -> int:
    return max(WARP, -(-threads // WARP) * WARP)


def grid_error(grid: int | None, max_grid: int) -> str | None:
    """Why the copy kernels cannot run on ``grid`` blocks when ``max_grid`` are resident at
    once, or None (None: the default grid)."""
    if grid is None or grid <= max_grid:
        return None
    return f"grid must be at most the {max_grid} blocks of {THREADS} threads resident at once on this GPU, got {grid}"


class DeviceDispatcher:
    """The :class:`~ultraep.token.base.TokenBackend` in CUDA kernels, on the caller's stream."""

    def __init__(self, group: EPGroup, config: TokenConfig, buffers: TokenBuffers):
        import cupy

        self.cp, self.group, self.config, self.buffers = cupy, group, config, buffers
        self.dispatches = 0  # the handles' serials
        d = config
        element = _template_type(d.dtype)
        self.k = {name: get_function(KERNELS, name, group=group)
                  for name in ("route_keys", "count_segments", "scan_segments", "rank_segments", "publish_counts",
                               "plan_rows", "send_tokens", "send_pairs", "expand_rows", "send_rows")}
        self.k["reduce_slots"] = get_function(KERNELS, f"reduce_slots<{element}>", group=group)
        self.k["grad_rows"] = get_function(KERNELS, f"grad_rows<{element}>", group=group)
        self.k["pull_slots"] = get_function(KERNELS, f"pull_slots<{element}>", group=group)
        self.barrier_kernel = get_function("heap.cu", "symmetric_barrier", group=group)
        self.heap = buffers.heap
        self.epoch = 0
        self.barrier_status = cupy.zeros((len(BARRIER_SITES), 4), dtype=np.uint64)
        self.num_keys = d.num_experts + d.size
        max_items = 2 * d.max_tokens * d.top_k
        self.keys = cupy.empty(max_items, dtype=np.int32)
        self.positions = cupy.empty(max_items, dtype=np.int32)
        self.seg_counts = cupy.empty(-(-max_items // SEGMENT_ITEMS) * self.num_keys, dtype=np.int32)
        self.totals = cupy.empty(self.num_keys, dtype=np.int32)
        self.first_bad = cupy.empty(1, dtype=np.int32)
        self.base = cupy.empty(d.num_experts, dtype=np.int32)
        self.counts = cupy.empty(d.experts_per_rank, dtype=np.int32)
        self.offsets = cupy.empty(d.experts_per_rank + 1, dtype=np.int32)
        self.outcome = cupy.zeros(4, dtype=np.int32)
        self.unreported_dispatch = False
        self.local = {name: getattr(buffers, name).local for name in
                      ("count_table", "landing", "row_weight", "row_landing", "row_origin", "slot_rows", "slot_grad_w")
                      + (("expert_out",) if d.expert_output else ()) + (("expert_in",) if d.expert_input else ())}
        properties = cupy.cuda.runtime.getDeviceProperties(group.device)
        sms = usable_sms(group.device)
        # the same bound on every rank (the smallest GPU's), so a grid is refused by all or none
        self.max_grid = min(group.allgather(sms * (properties["maxThreadsPerMultiProcessor"] // THREADS),
                                            what="Dispatcher set-up (resident copy blocks)"))
        group.raise_if_any(grid_error(d.grid, self.max_grid), "Dispatcher set-up")
        self.grid = d.grid or 2 * sms  # persistent copy kernels; default: two resident blocks per SM
        self.row_vecs = d.row_bytes // VECTOR_BYTES

    # -- helpers ----------------------------------------------------------------------------
    def _import(self, array, name: str, writable: bool = False):
        if array is None:
            return None
        return import_tensor(array, name=name, device=self.group.device, writable=writable)

    def _output(self, out, shape):
        return self.cp.empty(shape, dtype=self.config.dtype) if out is None else out

    def _barrier(self, site: str) -> None:
        """All ranks' earlier stores into peers' heaps are visible once this returns on the device."""
        self.epoch += 1
        d = self.config
        self.barrier_kernel((1,), (min(MAX_BLOCK_THREADS, _whole_warps(d.size)),),
                            (self.heap.peer_bases, np.int32(d.rank), np.int32(d.size),
                             np.uint64(self.buffers.sync.offset),
                             np.uint64(self.epoch), np.uint64(int(d.timeout_s * 1e9)),
                             self.barrier_status[BARRIER_SITES.index(site)]))

    def release_counts(self) -> None:
        """Barrier (on the stream) once this rank's count table has been read: a caller with no
        later barrier in the call (the fused layer) must, or a peer's next publish could
        overtake the read."""
        self._barrier("counts-read")

    def _send_tokens(self, x, state: dict, with_meta: bool) -> None:
        d, b = self.config, self.buffers
        self.k["send_tokens"]((self.grid,), (THREADS,), (
            x, np.int32(state["tokens"]), np.int32(d.top_k), np.int32(self.row_vecs), state["ids"], state["gates"],
            state["positions"], state["base"], self.heap.peer_bases, np.uint64(b.landing.offset),
            np.uint64(b.row_weight.offset), np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset),
            np.int32(d.rank), np.int32(d.experts_per_rank), np.int32(d.max_tokens), np.int32(with_meta),
            state["outcome"]))

    def _send_pairs(self, x, state: dict) -> None:
        """Each (token, slot) into its row of its destination's expert_in, with its metadata."""
        d, b = self.config, self.buffers
        self.k["send_pairs"]((self.grid,), (THREADS,), (
            x, np.int32(state["tokens"]), np.int32(d.top_k), np.int32(self.row_vecs), state["ids"], state["gates"],
            state["positions"], state["base"], self.heap.peer_bases, np.uint64(b.expert_in.offset),
            np.uint64(b.row_weight.offset), np.uint64(b.row_landing.offset), np.uint64(b.row_origin.offset),
            np.int32(d.rank), np.int32(d.experts_per_rank), np.int32(d.max_tokens), state["outcome"]))

    def _finish(self) -> None:
        if self.config.sync_checks:
            self.check()

    # -- the token path -------------------------------------------------------------------
    def dispatch(self, x, expert_ids, weights, out) -> DispatchResult:
        with caller_stream(x):
            (x, ids, gates, out), failed = import_inputs(
                self._import, {"x": (x, False), "expert_ids": (expert_ids, False), "weights": (weights, False),
                               "out": (out, True)})
            check_tokens(self.group, self.config, x, ids, gates, failed)
            d = self.config
            check_rows(self.group, d, {"out": (out, d.max_recv_rows)},
                       expert_in=("out", self.local["expert_in"]) if d.expert_input else None)
            x, state = self.token_map(x, ids, gates)
            if d.expert_input:
                self._send_pairs(x, state)
                self._barrier("tokens")
                return self.received(self.local["expert_in"], state)
            recv = self._output(out, (d.max_recv_rows, d.hidden))
            self._send_tokens(x, state, with_meta=True)
            self._barrier("tokens")
            self.k["expand_rows"]((self.grid,), (THREADS,), (
                self.local["landing"], self.local["row_landing"], state["offsets"][-1:], np.int32(self.row_vecs), recv,
                state["outcome"]))
            return self.received(recv, state)

    def token_map(self, x, ids, gates):
        """Steps 1-3 of dispatch on the current stream (checked device arrays): the token map,
        the count exchange and its barrier, the row plan. Returns ``(x contiguous, state)``;
        what sends the tokens then (dispatch, or the fused layer's kernel) follows it, and
        :meth:`received` ends it. Until then the state's map and plan are this Dispatcher's
        own buffers, which the sends only read: their copies for the handle are queued behind
        the sends, where the host launches them while the device works."""
        cp, d = self.cp, self.config
        tokens, top_k = ids.shape
        n = tokens * top_k
        ids = cp.ascontiguousarray(ids.astype(np.int64, copy=False))
        gates = cp.ascontiguousarray(gates.astype(np.float32, copy=False))
        x = cp.ascontiguousarray(x)

        # Token map: stable positions of the items by expert and by single send per rank.
        self.first_bad.fill(NO_BAD_ITEM)
        self.k["route_keys"]((_blocks(n),), (THREADS,), (
            ids, gates, np.int32(n), np.int32(top_k), np.int32(d.num_experts), np.int32(d.experts_per_rank),
            self.keys, self.first_bad))
        items = 2 * n
        segments = -(-items // SEGMENT_ITEMS)
        segment_args = (self.keys, np.int32(items), np.int32(SEGMENT_ITEMS), np.int32(self.num_keys),
                        self.seg_counts)
        self.k["count_segments"]((_blocks(segments * WARP),), (THREADS,), segment_args)
        self.k["scan_segments"]((self.num_keys,), (THREADS,), (
            self.seg_counts, np.int32(segments), np.int32(self.num_keys), self.totals))
        self.k["rank_segments"]((_blocks(segments * WARP),), (THREADS,), segment_args + (self.positions,))

        # Count table on every rank, then the row plan every rank agrees on.
        b = self.buffers
        self.k["publish_counts"]((1,), (THREADS,), (
            self.heap.peer_bases, np.uint64(b.count_table.offset), np.int32(d.rank), np.int32(d.size),
            np.int32(d.num_experts), self.totals, self.first_bad, ids, gates, np.int32(top_k)))
        self._barrier("counts")
        self.k["plan_rows"]((1,), (min(MAX_BLOCK_THREADS, _whole_warps(d.size)),), (
            self.local["count_table"], np.int32(d.size), np.int32(d.num_experts), np.int32(d.experts_per_rank),
            np.int32(d.rank), np.int32(d.max_recv_rows), self.base, self.counts, self.offsets, self.outcome))

        state = {"tokens": tokens, "ids": ids, "gates": gates, "positions": self.positions[:items],
                 "base": self.base, "outcome": self.outcome, "offsets": self.offsets, "totals": self.totals}
        return x, state

    def received(self, recv, state: dict) -> DispatchResult:
        """The result of a dispatch whose rows and row metadata have landed (on the stream)."""
        d = self.config
        for name in ("positions", "base", "outcome", "offsets", "totals"):  # the next token map overwrites them
            state[name] = state[name].copy()
        for name in ("row_landing", "row_origin", "row_weight"):
            state[name] = self.local[name].copy()
        self.unreported_dispatch = True
        self._finish()
        self.dispatches += 1
        handle = DispatchHandle(d.dispatcher_id, state["tokens"], state["gates"], state["ids"], state,
                                serial=self.dispatches)
        return DispatchResult(recv, state["row_weight"].copy(), self.counts.copy(), state["offsets"], handle)

    def expert_output(self):
        return self.local["expert_out"]

    def expert_input(self):
        return self.local["expert_in"]

    def combine(self, y, handle: DispatchHandle, weighted: bool, out):
        d = self.config
        name = "y" if weighted else "grad_recv"
        with caller_stream(y):
            (y, out), failed = import_inputs(self._import, {name: (y, False), "out": (out, True)}, handle,
                                             dispatcher_id=d.dispatcher_id)
            check_rows(self.group, d, {name: (y, d.max_recv_rows), "out": (out, 0 if failed else handle.tokens)},
                       expert_out=(name, self.local["expert_out"]) if d.expert_output else None, failed=failed,
                       handle=handle)
            s = handle.state
            result = self._output(out, (handle.tokens, d.hidden))
            gates = s["gates"] if weighted else np.uint64(0)
            if d.expert_output:
                self._pull(handle, gates, result)
                self._finish()
                return result
            self._barrier("combine-ready")  # every source's slot rows are free again
            self.k["send_rows"]((self.grid,), (THREADS,), (
                self.cp.ascontiguousarray(y), s["row_origin"], s["offsets"][-1:], np.int32(self.row_vecs),
                self.heap.peer_bases, np.uint64(self.buffers.slot_rows.offset), np.int32(d.slots_per_rank),
                s["outcome"]))
            self._barrier("combine-rows")
            self.k["reduce_slots"]((self.grid,), (THREADS,), (
                self.local["slot_rows"], gates, np.int32(handle.tokens), np.int32(d.top_k), np.int32(self.row_vecs),
                result))
            self._finish()
        return result

    def _pull(self, handle: DispatchHandle, gates, result) -> None:
        """Sum each token's slot rows read from the experts' ranks' expert_out; the heap rows
        are rewritten only once every rank has read its own."""
        d, s = self.config, handle.state
        self._barrier("expert-rows-written")
        self.k["pull_slots"]((self.grid,), (THREADS,), (
            self.heap.peer_bases, np.uint64(self.buffers.expert_out.offset), s["ids"], s["positions"], s["base"],
            gates, np.int32(handle.tokens), np.int32(d.top_k), np.int32(d.experts_per_rank), np.int32(self.row_vecs),
            result, s["outcome"]), shared_mem=THREADS * POINTER_BYTES)
        self._barrier("expert-rows-read")

    def combine_backward(self, grad_out, y, handle: DispatchHandle, out):
        cp, d = self.cp, self.config
        with caller_stream(grad_out):
            (grad_out, y, out), failed = import_inputs(
                self._import, {"grad_out": (grad_out, False), "y": (y, False), "out": (out, True)}, handle,
                dispatcher_id=d.dispatcher_id)
            check_rows(self.group, d, {"grad_out": (grad_out, 0 if failed else handle.tokens),
                                       "y": (y, d.max_recv_rows), "out": (out, d.max_recv_rows)}, failed=failed,
                       handle=handle)
            s = handle.state
            grad_y = self._output(out, (d.max_recv_rows, d.hidden))
            self._barrier("grad-ready")     # every rank's landing rows are free again
            self._send_tokens(cp.ascontiguousarray(grad_out), s, with_meta=False)
            self._barrier("grad-tokens")
            self.k["grad_rows"]((self.grid,), (THREADS,), (
                self.local["landing"], s["row_landing"], s["row_weight"], cp.ascontiguousarray(y), s["row_origin"],
                s["offsets"][-1:], np.int32(self.row_vecs), grad_y, self.heap.peer_bases,
                np.uint64(self.buffers.slot_grad_w.offset), np.int32(d.slots_per_rank), s["outcome"]))
            self._barrier("grad-rows")
            grad_w = self.local["slot_grad_w"][:handle.tokens * d.top_k].reshape(handle.tokens, d.top_k).copy()
            self._finish()
        return grad_y, grad_w

    # -- errors -----------------------------------------------------------------------------
    def check(self) -> None:
        """Synchronise; raise a timed-out wait, or the latest dispatch's refusal (the same on every rank)."""
        d = self.config
        self.cp.cuda.get_current_stream().synchronize()
        status = self.barrier_status.get()
        for site, (failed, waited, expected, seen) in zip(BARRIER_SITES, status):
            if failed:
                self.barrier_status.fill(0)
                raise DispatchError(f"rank {d.rank}: token path wait '{site}' timed out after {d.timeout_s:g} s "
                                    f"waiting for rank {int(waited)} (flag expected >= {int(expected)}, "
                                    f"saw {int(seen)})")
        if not self.unreported_dispatch:
            return
        self.unreported_dispatch = False
        code, who, rows = (int(v) for v in self.outcome.get()[:3])
        if code == OUTCOME_BAD_INPUT:
            table = self.local["count_table"].get()
            records = table[:, d.num_experts + d.size:]
            failed = [bad_input_message(s, *map(int, rec), d.num_experts) for s, rec in enumerate(records) if rec[0]]
            raise everywhere(DispatchError(f"dispatch input check failed on {len(failed)} of {d.size} rank(s): "
                                           + "; ".join(failed)))
        if code == OUTCOME_TOO_MANY_ROWS:
            table = self.local["count_table"].get()[:, :d.num_experts]
            raise everywhere(DispatchError(too_many_rows_message(table, d.experts_per_rank, who, rows,
                                                                 d.max_recv_rows)))

    def close(self) -> None:
        """Let queued work finish and drop the views of the heap (so closing it frees it); the
        heap is the Dispatcher's to close."""
        self.cp.cuda.get_current_stream().synchronize()
        self.local = {}
