"""The token path's semantics in NumPy: the sequential reference and the shared arithmetic.

Two things live here, kept apart on purpose:

* :func:`sequential_dispatch` / :func:`sequential_combine` / the backward pair -- a
  single-process reference that sees every rank's input and builds each receive buffer
  directly from the definition (for each destination expert, for each source rank, that
  source's (token, slot) pairs in token-then-slot order). It shares no routing code with
  the executors, so the tests compare two independent derivations.
* The arithmetic every executor must reproduce bit for bit, written once:
  :func:`stable_key_positions` (the deterministic token map: the position of each item
  among the earlier items with the same key), :func:`plan_rows` (destination row bases
  from the gathered count table), :func:`pair_rows` (each pair's row from both),
  :func:`slot_sum` (the fixed-order, fp32 top-k sum of
  combine), :func:`lane_dot` (the fixed-order fp32 dot product of the gate gradient,
  in the order the GPU's warps compute it) and :func:`weighted_rows` (rows times their
  gates). Each FP32 operand and result is flushed as the device's -ftz arithmetic flushes
  it (:func:`~ultraep.runtime.dtypes.flush_subnormals`).

Expert id -> rank is ``e // experts_per_rank``; local index ``e % experts_per_rank``
(physical slot ids of an :class:`~ultraep.planner.layout.ExpertLayout` map the same way
with ``experts_per_rank = layout.slots_per_rank``).
"""

from __future__ import annotations

import numpy as np

from ultraep.runtime.dtypes import flush_subnormals
from ultraep.runtime.kernels import kernel_constant

# The kernels' lanes per warp and row vector size fix the order of the warp-order dot.
WARP = kernel_constant("dispatch.cu", "WARP")
VECTOR_BYTES = kernel_constant("dispatch.cu", "VECTOR_BYTES")


def as_float32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32, copy=False)


def fp32_operand(a: np.ndarray) -> np.ndarray:
    """``a`` as the device's FP32 arithmetic reads it: widened to fp32, subnormals flushed."""
    return flush_subnormals(as_float32(a))


def weighted_rows(weights: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``weights[i] * rows[i]`` in fp32 (``weights`` [n], ``rows`` [n, H]), one rounding and
    the device's flush."""
    return flush_subnormals(np.multiply(fp32_operand(weights)[:, None], fp32_operand(rows), dtype=np.float32))


def stable_key_positions(keys: np.ndarray, num_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """For each item, how many earlier items carry the same key; and the count per key.

    ``keys`` is int[n] in ``[-1, num_keys)``; ``-1`` items are skipped (position -1).
    Equivalent to a stable sort by key followed by ranks within each key's run -- the
    unique, atomics-free address of UniEP's global token map.
    """
    keys = np.asarray(keys, dtype=np.int64).ravel()
    counts = np.bincount(keys[keys >= 0], minlength=num_keys).astype(np.int64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    run_start = np.searchsorted(sorted_keys, sorted_keys, side="left")
    positions = np.empty_like(keys)
    positions[order] = np.arange(keys.size) - run_start
    positions[keys < 0] = -1
    return positions, counts


def route_keys(expert_ids: np.ndarray, experts_per_rank: int, num_experts: int) -> np.ndarray:
    """The two key sets of one source's token map, as int64[2, T*K].

    Row 0: the destination expert of every (token, slot). Row 1: ``num_experts + rank``
    on the first slot of each token that goes to ``rank`` (the single send of that token
    to that rank), ``-1`` on the token's later slots for the same rank.
    """
    ids = np.asarray(expert_ids, dtype=np.int64)
    tokens, top_k = ids.shape
    ranks = ids // experts_per_rank
    first = np.ones_like(ranks, dtype=bool)
    for k in range(1, top_k):
        first[:, k] = np.all(ranks[:, :k] != ranks[:, k:k + 1], axis=1)
    send_keys = np.where(first, num_experts + ranks, -1)
    return np.stack([ids.ravel(), send_keys.ravel()])


def first_slot_of_rank(expert_ids: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """For each (token, slot), the token's first slot that goes to the same rank."""
    ranks = np.asarray(expert_ids, dtype=np.int64) // experts_per_rank
    same = ranks[:, :, None] == ranks[:, None, :]          # [T, k, k']
    return np.argmax(same, axis=2)                           # the lowest k' with the same rank


def plan_rows(count_table: np.ndarray, experts_per_rank: int, me: int):
    """Row bases from the gathered ``count_table`` (int[R, E]: pairs source ``s`` sends to expert ``e``).

    Returns ``(base, expert_counts, expert_offsets, rank_totals)``: ``base[e]`` is the first
    row on rank ``e // experts_per_rank`` of the pairs that source ``me`` sends to ``e``;
    ``expert_counts``/``expert_offsets`` describe this rank's receive buffer (offsets has
    one more entry, the total); ``rank_totals[r]`` the rows rank ``r`` receives.
    """
    table = np.asarray(count_table, dtype=np.int64)
    ranks = table.shape[0]
    per_expert = table.sum(axis=0).reshape(ranks, experts_per_rank)
    expert_start = np.cumsum(per_expert, axis=1) - per_expert     # within the destination rank
    below_me = table[:me].sum(axis=0).reshape(ranks, experts_per_rank)
    base = (expert_start + below_me).ravel()
    counts = per_expert[me]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return base, counts, offsets, per_expert.sum(axis=1)


def pair_rows(base: np.ndarray, expert_ids: np.ndarray, pair_positions: np.ndarray) -> np.ndarray:
    """The receive row of each of source ``me``'s (token, slot) pairs on its expert's rank, int[T*K].

    Pair (t, k) to expert e lands in row ``base[e] + pair_positions[t*K + k]``: ``base[e]``
    (:func:`plan_rows` of the gathered count table) is the rows of the experts before e on
    e's rank plus the pairs to e of every source below ``me``; the position
    (:func:`stable_key_positions` keyed by expert) is the pairs to e among this source's
    earlier pairs in token-then-slot order. Dispatch's metadata, a push into ``expert_in``
    and a pull from ``expert_out`` all address rows by it.
    """
    return np.asarray(base)[np.asarray(expert_ids, dtype=np.int64).ravel()] + np.asarray(pair_positions)


def slot_sum(slots: np.ndarray, weights: np.ndarray | None, out_dtype) -> np.ndarray:
    """``sum_k weights[t, k] * slots[t, k]`` in slot order k = 0, 1, ..., fp32 throughout.

    ``slots`` is [T, K, H]. Each product is rounded to fp32 before it is added (the GPU
    uses ``__fmul_rn``/``__fadd_rn`` so no fused multiply-add changes a bit). Without
    ``weights`` the slots are summed unweighted (the gradient of dispatch).
    """
    tokens, top_k, hidden = slots.shape
    acc = np.zeros((tokens, hidden), dtype=np.float32)
    for k in range(top_k):
        term = fp32_operand(slots[:, k]) if weights is None else weighted_rows(weights[:, k], slots[:, k])
        acc = flush_subnormals(np.add(acc, term, dtype=np.float32))
    return acc.astype(out_dtype)


def lane_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise fp32 dot products ``sum_h a[i, h] * b[i, h]`` in the GPU warp's order.

    Element ``h`` belongs to lane ``(h // V) % 32`` with ``V = 16 // itemsize`` elements
    per 16-byte vector; each lane adds its products in increasing ``h``, then the 32 lane
    sums meet in an xor butterfly (16, 8, 4, 2, 1). fp32 addition commutes exactly, so
    every lane ends with the same value, which is the result.
    """
    vec = VECTOR_BYTES // np.dtype(a.dtype).itemsize
    rows, hidden = a.shape
    chunk = WARP * vec
    padded = -(-hidden // chunk) * chunk
    products = np.zeros((rows, padded), dtype=np.float32)   # +0.0 padding never changes a sum that starts at +0.0
    products[:, :hidden] = flush_subnormals(np.multiply(fp32_operand(a), fp32_operand(b), dtype=np.float32))
    products = products.reshape(rows, padded // chunk, WARP, vec)
    lanes = np.zeros((rows, WARP), dtype=np.float32)
    for i in range(products.shape[1]):
        for j in range(vec):
            lanes = flush_subnormals(np.add(lanes, products[:, i, :, j], dtype=np.float32))
    lane_ids = np.arange(WARP)
    offset = WARP // 2
    while offset:  # the xor butterfly of grad_rows
        lanes = flush_subnormals(np.add(lanes, lanes[:, lane_ids ^ offset], dtype=np.float32))
        offset //= 2
    return lanes[:, 0].copy()


# -- the sequential single-process reference -------------------------------------------

def sequential_rows(expert_ids_per_rank, experts_per_rank: int):
    """Receive-buffer layout from the definition, for every rank at once.

    Returns ``(rows, sources, counts)``: ``rows[s]`` int[T_s, K] is the receive row of each
    (token, slot) of source ``s`` on its destination rank; ``sources[r]`` is the list of
    ``(s, t, k)`` in rank ``r``'s receive order; ``counts[r]`` its rows per local expert.
    """
    ranks = len(expert_ids_per_rank)
    rows = [np.full(np.shape(ids), -1, dtype=np.int64) for ids in expert_ids_per_rank]
    sources, counts = [], []
    for r in range(ranks):
        order, per_expert = [], []
        for j in range(experts_per_rank):
            e = r * experts_per_rank + j
            before = len(order)
            for s, ids in enumerate(expert_ids_per_rank):
                flat = np.asarray(ids).ravel()
                for i in np.flatnonzero(flat == e):
                    t, k = divmod(int(i), np.shape(ids)[1])
                    rows[s][t, k] = len(order)
                    order.append((s, t, k))
            per_expert.append(len(order) - before)
        sources.append(order)
        counts.append(np.asarray(per_expert, dtype=np.int64))
    return rows, sources, counts


def sequential_dispatch(xs, expert_ids, weights, experts_per_rank: int):
    """Per destination rank: (received tokens, received gates, expert counts), from the definition."""
    _, sources, counts = sequential_rows(expert_ids, experts_per_rank)
    hidden = xs[0].shape[1]
    out = []
    for r, order in enumerate(sources):
        recv_x = np.empty((len(order), hidden), dtype=xs[0].dtype)
        recv_w = np.empty(len(order), dtype=np.float32)
        for row, (s, t, k) in enumerate(order):
            recv_x[row] = xs[s][t]
            recv_w[row] = weights[s][t, k]
        out.append((recv_x, recv_w, counts[r]))
    return out


def _gather_slots(ys, expert_ids, experts_per_rank):
    """Per source: [T, K, H] -- each slot's expert output fetched from its destination rank."""
    rows, _, _ = sequential_rows(expert_ids, experts_per_rank)
    gathered = []
    for s, ids in enumerate(expert_ids):
        ids = np.asarray(ids, dtype=np.int64)
        dest = ids // experts_per_rank
        slots = np.empty(ids.shape + (ys[0].shape[1],), dtype=ys[0].dtype)
        for t in range(ids.shape[0]):
            for k in range(ids.shape[1]):
                slots[t, k] = ys[dest[t, k]][rows[s][t, k]]
        gathered.append(slots)
    return gathered


def sequential_combine(ys, expert_ids, weights, experts_per_rank: int, *, weighted: bool = True):
    """Per source rank: ``sum_k w[t,k] * y[row(t,k)]`` in slot order, fp32, cast to y's dtype."""
    slots = _gather_slots(ys, expert_ids, experts_per_rank)
    return [slot_sum(sl, np.asarray(w) if weighted else None, ys[0].dtype) for sl, w in zip(slots, weights)]


def sequential_combine_backward(grad_outs, ys, expert_ids, weights, experts_per_rank: int):
    """Gradients of combine: per destination rank ``grad_y`` (gate times the token's output
    gradient, cast to the data dtype) and per source ``grad_w`` = lane_dot(grad_out[t], y[row])."""
    _, sources, _ = sequential_rows(expert_ids, experts_per_rank)
    grad_ys = []
    for r, order in enumerate(sources):
        g = np.stack([grad_outs[s][t] for s, t, _ in order]) if order else np.empty((0, ys[r].shape[1]), ys[r].dtype)
        w = np.asarray([weights[s][t, k] for s, t, k in order], dtype=np.float32)
        grad_ys.append(weighted_rows(w, g).astype(ys[r].dtype))
    slots = _gather_slots(ys, expert_ids, experts_per_rank)
    grad_ws = []
    for s, sl in enumerate(slots):
        tokens, top_k, hidden = sl.shape
        g = np.repeat(grad_outs[s], top_k, axis=0)
        grad_ws.append(lane_dot(g, sl.reshape(tokens * top_k, hidden)).reshape(tokens, top_k))
    return grad_ys, grad_ws
