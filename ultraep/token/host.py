"""Host backend of the ``Dispatcher``: the device's protocol run with NumPy over MPI shared memory.

The same steps as the CUDA kernels, in the same heap tensors, so the host backend tests the
protocol itself (count exchange, one send per destination rank into landing rows, rows
expanded by the receiver, slot rows sent back for a fixed-order sum), not a shortcut:

1. token map: stable key positions of the (token, slot) pairs by expert and of each
   token's first slot per destination rank (:func:`~ultraep.token.reference.route_keys`);
2. publish this source's counts into row ``rank`` of every peer's count table, barrier;
3. row bases by prefix sums over the table (:func:`~ultraep.token.reference.plan_rows`);
4. each token written once into each destination rank's landing rows, each pair's gate,
   landing row and origin into its receive row there, barrier;
5. the receiver copies landing rows into the expert-major receive buffer.

With ``expert_input=True`` step 4 writes each (token, slot) pair's row straight into its
row of the destination rank's ``expert_in`` (the row step 5 would fill) and step 5 goes.

Combine sends each expert output row back into its source's slot rows, barrier, and the
source sums; from ``expert_out`` (``expert_output=True``) the source reads its rows on the
experts' ranks after a barrier instead, and a second barrier frees them.

Bad input is checked on the host and raised on every rank before anything is written.
"""

from __future__ import annotations

import numpy as np

from ultraep.errors import DispatchError, everywhere
from ultraep.runtime.dlpack import import_tensor
from ultraep.runtime.dtypes import BFLOAT16, bf16_typed
from ultraep.runtime.group import EPGroup
from ultraep.token import reference as ref
from ultraep.token.base import (DispatchHandle, DispatchResult, TokenBuffers, TokenConfig, bad_input_message,
                                check_rows, check_tokens, first_bad_item, import_inputs,
                                raise_if_any, too_many_rows_message)


class HostDispatcher:
    """The :class:`~ultraep.token.base.TokenBackend` in NumPy; barriers are the heap's."""

    def __init__(self, group: EPGroup, config: TokenConfig, buffers: TokenBuffers):
        self.group, self.config, self.buffers = group, config, buffers
        self.heap = buffers.heap
        self.dispatches = 0  # the handles' serials

    def _barrier(self) -> None:
        self.heap.barrier(self.config.timeout_s)

    def release_counts(self) -> None:
        """Barrier once this rank has read its count table: a caller with no later barrier in
        the call (the fused layer) must, or a peer's next publish could overtake the read."""
        self._barrier()

    def _import(self, array, name: str, writable: bool = False):
        if array is None:
            return None
        imported = import_tensor(array, name=name, device=None, writable=writable)
        if name in ("expert_ids", "weights") or self.config.dtype != BFLOAT16:
            return imported
        return bf16_typed(imported)  # bf16 rows that arrived as their bits: copied as bits, as the kernels do

    def dispatch(self, x, expert_ids, weights, out) -> DispatchResult:
        d, b, me = self.config, self.buffers, self.config.rank
        (x, expert_ids, weights, out), failed = import_inputs(
            self._import, {"x": (x, False), "expert_ids": (expert_ids, False), "weights": (weights, False),
                           "out": (out, True)})
        check_tokens(self.group, d, x, expert_ids, weights, failed)
        check_rows(self.group, d, {"out": (out, d.max_recv_rows)},
                   expert_in=("out", b.expert_in.local) if d.expert_input else None)
        m = self.token_map(x, expert_ids, weights)
        top_k, dest, rows, sends = d.top_k, m["pair_rank"], m["pair_row"], m["sends"]
        for r in range(d.size):
            pairs = dest == r
            if d.expert_input:  # each pair straight into its final row there
                b.expert_in.peer(r)[rows[pairs]] = x[np.flatnonzero(pairs) // top_k]
            else:               # each token once into its landing row there
                once = np.flatnonzero(sends & pairs)
                b.landing.peer(r)[me * d.max_tokens + m["send_pos"][once]] = x[once // top_k]
            b.row_weight.peer(r)[rows[pairs]] = m["gates"].ravel()[pairs]
            b.row_landing.peer(r)[rows[pairs]] = m["landing_row"][pairs]
            b.row_origin.peer(r)[rows[pairs]] = m["origin"][pairs]
        self._barrier()
        if d.expert_input:
            return self.received(b.expert_in.local, m)
        recv_x = np.zeros((d.max_recv_rows, d.hidden), dtype=d.dtype) if out is None else out
        recv_x[:int(m["offsets"][-1])] = b.landing.local[b.row_landing.local[:int(m["offsets"][-1])]]
        return self.received(recv_x, m)

    def token_map(self, x, expert_ids, weights) -> dict:
        """Steps 1-3 of dispatch (checked input): the token map, the count exchange and its
        barrier, the row plan; raises on every rank for bad values or too many rows. Returns
        the map; what sends the tokens then (dispatch, or the fused layer) follows it."""
        d, b, me = self.config, self.buffers, self.config.rank
        bad = first_bad_item(expert_ids, weights, d.num_experts)
        raise_if_any(self.group, d, None if bad is None else DispatchError(bad_input_message(me, *bad, d.num_experts)),
                     "dispatch input check")
        ids = np.asarray(expert_ids, dtype=np.int64)
        gates = np.asarray(weights).astype(np.float32)
        tokens, top_k = ids.shape
        E, R, T_max = d.num_experts, d.size, d.max_tokens

        keys = ref.route_keys(ids, d.experts_per_rank, E)
        positions, totals = ref.stable_key_positions(keys, E + R)
        pair_pos, send_pos = positions[:tokens * top_k], positions[tokens * top_k:]
        for peer in range(R):
            row = b.count_table.peer(peer)[me]
            row[:E + R] = totals
            row[E + R:] = 0
        self._barrier()
        table = b.count_table.local[:, :E].copy()
        base, counts, offsets, rank_totals = ref.plan_rows(table, d.experts_per_rank, me)
        too_many = np.flatnonzero(rank_totals > d.max_recv_rows)
        if too_many.size:  # every rank sees the same table, so every rank raises here
            r = int(too_many[0])
            raise everywhere(DispatchError(too_many_rows_message(table, d.experts_per_rank, r, int(rank_totals[r]),
                                                                 d.max_recv_rows)))
        first_slot = ref.first_slot_of_rank(ids, d.experts_per_rank)
        return {"ids": ids, "gates": gates, "tokens": tokens, "table": table, "totals": totals, "counts": counts,
                "offsets": offsets, "send_pos": send_pos, "first_slot": first_slot,
                "pair_rank": (ids // d.experts_per_rank).ravel(), "pair_row": ref.pair_rows(base, ids, pair_pos),
                "landing_row": me * T_max + send_pos.reshape(tokens, top_k)[np.arange(tokens)[:, None],
                                                                             first_slot].ravel(),
                "origin": me * T_max * top_k + np.arange(tokens * top_k), "sends": keys[1] >= 0}

    def received(self, recv_x, m: dict) -> DispatchResult:
        """The result of a dispatch whose rows and row metadata have landed (every rank's
        sends done: after the barrier that follows them)."""
        d, b = self.config, self.buffers
        total = int(m["offsets"][-1])
        state = {"row_landing": b.row_landing.local[:total].copy(), "row_origin": b.row_origin.local[:total].copy(),
                 "row_weight": b.row_weight.local[:total].copy(), "num_rows": total,
                 "send_rows": [(r, np.flatnonzero(m["sends"] & (m["pair_rank"] == r))) for r in range(d.size)],
                 "send_pos": m["send_pos"], "totals": m["totals"], "pair_rank": m["pair_rank"],
                 "pair_row": m["pair_row"]}
        recv_w = np.zeros(d.max_recv_rows, dtype=np.float32)
        recv_w[:total] = state["row_weight"]
        self.dispatches += 1
        handle = DispatchHandle(d.dispatcher_id, m["tokens"], m["gates"], m["ids"], state, serial=self.dispatches)
        return DispatchResult(recv_x, recv_w, m["counts"].astype(np.int32), m["offsets"].astype(np.int32), handle)

    def _send_back(self, rows, handle: DispatchHandle):
        """Barrier (sources ready), then each received row into its origin slot at the source, barrier."""
        d, b, s = self.config, self.buffers, handle.state
        self._barrier()
        origin = s["row_origin"]
        slots_per_rank = d.slots_per_rank
        for r in range(d.size):
            mine = np.flatnonzero(origin // slots_per_rank == r)
            b.slot_rows.peer(r)[origin[mine] % slots_per_rank] = rows[mine]
        self._barrier()

    def expert_output(self):
        return self.buffers.expert_out.local

    def expert_input(self):
        return self.buffers.expert_in.local

    def _pull(self, handle: DispatchHandle):
        """Barrier (every expert output written), each slot's row read on its expert's rank, barrier."""
        d, s = self.config, handle.state
        self._barrier()
        slots = np.empty((handle.tokens * d.top_k, d.hidden), dtype=d.dtype)
        for r in range(d.size):
            mine = np.flatnonzero(s["pair_rank"] == r)
            slots[mine] = self.buffers.expert_out.peer(r)[s["pair_row"][mine]]
        self._barrier()
        return slots

    def combine(self, y, handle: DispatchHandle, weighted: bool, out):
        d = self.config
        name = "y" if weighted else "grad_recv"
        (y, out), failed = import_inputs(self._import, {name: (y, False), "out": (out, True)}, handle,
                                         dispatcher_id=d.dispatcher_id)
        check_rows(self.group, d, {name: (y, d.max_recv_rows), "out": (out, 0 if failed else handle.tokens)},
                   expert_out=(name, self.buffers.expert_out.local) if d.expert_output else None, failed=failed,
                   handle=handle)
        T, K = handle.tokens, d.top_k
        if d.expert_output:
            slots = self._pull(handle).reshape(T, K, d.hidden)
        else:
            self._send_back(y[:handle.state["num_rows"]], handle)
            slots = self.buffers.slot_rows.local[:T * K].reshape(T, K, d.hidden)
        result = ref.slot_sum(slots, handle.weights if weighted else None, d.dtype)
        if out is None:
            return result
        out[...] = result
        return out

    def combine_backward(self, grad_out, y, handle: DispatchHandle, out):
        d, b, me = self.config, self.buffers, self.config.rank
        (grad_out, y, out), failed = import_inputs(
            self._import, {"grad_out": (grad_out, False), "y": (y, False), "out": (out, True)}, handle,
            dispatcher_id=d.dispatcher_id)
        check_rows(self.group, d, {"grad_out": (grad_out, 0 if failed else handle.tokens), "y": (y, d.max_recv_rows),
                                   "out": (out, d.max_recv_rows)}, failed=failed, handle=handle)
        s = handle.state
        T_max, K = d.max_tokens, d.top_k
        self._barrier()  # landing rows are free on every rank
        for r, once in s["send_rows"]:
            b.landing.peer(r)[me * T_max + s["send_pos"][once]] = grad_out[once // K]
        self._barrier()
        total = s["num_rows"]
        arrived = b.landing.local[s["row_landing"]]
        gate_grads = ref.lane_dot(arrived, y[:total])  # before grad_y is written: out may be y itself
        grad_y = np.zeros((d.max_recv_rows, d.hidden), dtype=d.dtype) if out is None else out
        grad_y[:total] = ref.weighted_rows(s["row_weight"], arrived).astype(d.dtype)
        origin, slots_per_rank = s["row_origin"], d.slots_per_rank
        for r in range(d.size):
            mine = np.flatnonzero(origin // slots_per_rank == r)
            b.slot_grad_w.peer(r)[origin[mine] % slots_per_rank] = gate_grads[mine]
        self._barrier()
        grad_w = b.slot_grad_w.local[:handle.tokens * K].reshape(handle.tokens, K).copy()
        return grad_y, grad_w

    def check(self) -> None:
        """The host backend raises at once; nothing is deferred."""

    def close(self) -> None:
        """Nothing is queued; the heap is the Dispatcher's to close."""
