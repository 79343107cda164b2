"""Multi-rank Dispatcher check, run under mpiexec by tests/token/test_dispatch.py.

Usage: python -m mpi4py dispatch_check.py {host|device} {exact|push|bad-input|balanced|timeout|shared-heap}
       [dtype] [repeats]

``exact``: for every routing scenario, dispatch / combine / both backward functions
against the sequential single-process reference (every rank builds every rank's input
from one seed), bit for bit, with outputs poisoned first; the combined output of every
global token compared with a rank-count-free formula; ``repeats`` runs must give the same
bits. Prints the count of non-bitwise-equal elements and a digest of the combined
outputs (equal across rank counts), then "[exact] rank N OK".
``push``: for every routing scenario, a Dispatcher set up with ``expert_input=True`` (each
pair written straight into its row of the heap's receive buffer, poisoned first) against the
two-pass one on the same input: the receive buffer, gates, counts, offsets, every array the
handle keeps and every combine/backward result bit for bit (combine sent back and pulled);
prints "[push] rank N OK".
``bad-input``: each bad input raises on every rank, and the dispatcher still works after
(with and without ``expert_input``).
``balanced``: planner reroute into ``Dispatcher.for_layout``, bitwise equal to the plain path.
``timeout``: one rank never dispatches; the others' device waits time out naming it.
``shared-heap``: a Dispatcher and a WeightTransfer in one heap sized from their summed
requirements, both working; the heap is exactly big enough and outlives the dispatcher.
"""

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ultraep.runtime.dtypes import resolve_dtype
from ultraep.runtime.group import EPGroup, GroupMismatchError
from ultraep.token import DispatchError, Dispatcher
from ultraep.token import reference as ref
from ultraep.token.base import is_buffer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.support
from tests.support.mpi_checks import expect  # noqa: E402

BAD_INPUT = (DispatchError, ValueError)  # what a refused argument raises

backend, check = sys.argv[1], sys.argv[2]
DTYPE = resolve_dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
REPEATS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
group = EPGroup(MPI.COMM_WORLD, use_gpu=(backend == "device"))
R, me = group.size, group.rank
E, K, H, GLOBAL_TOKENS = 8, 4, 64, 96
MAX_TOKENS = GLOBAL_TOKENS
if backend == "device":
    import cupy as xp
else:
    xp = np


def host(a):
    if not hasattr(a, "get"):
        return np.asarray(a)
    if a.dtype.kind == "V":  # bf16 crosses as its bits
        return a.view(np.uint16).get().view(a.dtype)
    return a.get()


def device(a):
    a = np.asarray(a)
    if backend == "device" and a.dtype.kind == "V":
        return xp.asarray(a.view(np.uint16)).view(a.dtype)
    return xp.asarray(a)


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(host(a))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def poison(shape) -> np.ndarray:
    return np.full(int(np.prod(shape)) * DTYPE.itemsize, 0xA5, np.uint8).view(DTYPE).reshape(shape)


def written(buffer, rows):
    """``buffer`` (a Dispatcher's expert_output) poisoned, then holding ``rows`` in front."""
    as_bits = buffer.view(np.dtype(f"u{DTYPE.itemsize}"))
    as_bits[...] = device(bits(poison(buffer.shape)))
    as_bits[:len(rows)] = device(bits(rows))
    return buffer


def mismatches(got, want) -> int:
    got, want = bits(got), bits(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return int(np.count_nonzero(got != want))


def split_tokens(scenario: str, rng) -> list[int]:
    """Global tokens over ranks: the same global list, cut differently for each rank count."""
    if scenario == "empty-ranks" and R > 1:
        sizes = [0] * R
        sizes[R - 1] = GLOBAL_TOKENS // 2
        sizes[0] = GLOBAL_TOKENS - sizes[R - 1]
        return sizes
    cuts = np.sort(rng.integers(0, GLOBAL_TOKENS + 1, size=R - 1))
    return list(np.diff(np.concatenate([[0], cuts, [GLOBAL_TOKENS]])).astype(int))


def global_routing(scenario: str, rng) -> np.ndarray:
    """expert_ids[GLOBAL_TOKENS, K] for one scenario (a function of the seed only)."""
    if scenario == "one-expert":
        return np.full((GLOBAL_TOKENS, K), 5, dtype=np.int64)
    if scenario == "zero-token-experts":  # experts 1, 2, 6 never chosen
        pool = np.array([0, 3, 4, 5, 7])
        return np.stack([rng.permutation(pool)[:K] for _ in range(GLOBAL_TOKENS)])
    if scenario == "one-rank-topk":       # all K experts of a token on one rank of a 4-rank layout
        per = E // 4
        first = rng.integers(0, 4, size=(GLOBAL_TOKENS, 1)) * per
        return first + rng.integers(0, per, size=(GLOBAL_TOKENS, K))
    if scenario == "repeated-expert":     # the same expert twice in one token's top-k
        ids = rng.integers(0, E, size=(GLOBAL_TOKENS, K))
        ids[:, 2] = ids[:, 0]
        return ids
    return np.stack([rng.permutation(E)[:K] for _ in range(GLOBAL_TOKENS)])


SCENARIOS = ["uniform", "empty-ranks", "zero-token-experts", "one-expert", "one-rank-topk", "repeated-expert"]


def expert_fn(rows, experts) -> np.ndarray:
    """A row-wise expert stand-in: depends only on (row, expert), never on rank count."""
    scale = (1.0 + 0.125 * experts.astype(np.float32))[:, None]
    return (np.multiply(ref.as_float32(rows), scale, dtype=np.float32) - 0.5).astype(DTYPE)


def row_experts(counts) -> np.ndarray:
    return me * (E // R) + np.repeat(np.arange(len(counts)), counts)


def check_traffic(traffic, my_ids, experts_per_rank) -> None:
    """One send per (token, destination rank), counted by hand."""
    ranks = [set(int(e) // experts_per_rank for e in row) for row in my_ids]
    sends = sum(len(r) for r in ranks)
    sends_remote = sum(len(r - {me}) for r in ranks)
    pairs_remote = int(np.count_nonzero(np.asarray(my_ids) // experts_per_rank != me))
    want = (my_ids.size, pairs_remote, sends, sends_remote)
    assert (traffic.pairs, traffic.pairs_remote, traffic.sends, traffic.sends_remote) == want, (traffic, want)
    assert traffic.bytes_saved == (my_ids.size - sends) * H * DTYPE.itemsize


def scenario_inputs(seed: int, scenario: str):
    """The global tokens, ids and gates of a scenario, their cut over ranks, and each rank's share."""
    rng = np.random.default_rng(seed)
    sizes = split_tokens(scenario, np.random.default_rng(7 + R))
    gx = rng.standard_normal((GLOBAL_TOKENS, H)).astype(np.float32).astype(DTYPE)
    gids = global_routing(scenario, rng)
    gw = rng.random((GLOBAL_TOKENS, K)).astype(np.float32)
    cut = np.concatenate([[0], np.cumsum(sizes)])
    share = lambda a: [a[cut[r]:cut[r + 1]] for r in range(R)]  # noqa: E731
    return gx, gids, gw, cut, share(gx), share(gids), share(gw)


def exact() -> None:
    total_bad = 0
    digests = []
    for seed, scenario in enumerate(SCENARIOS):
        gx, gids, gw, cut, xs, ids, ws = scenario_inputs(seed, scenario)
        epr = E // R
        ref_recv = ref.sequential_dispatch(xs, ids, ws, epr)
        ref_rows = [len(rw) for _, rw, _ in ref_recv]
        ref_ys = [expert_fn(rx, r * epr + np.repeat(np.arange(epr), c)) for r, (rx, _, c) in enumerate(ref_recv)]
        grad_recv = [np.random.default_rng(100 + r).standard_normal((n, H)).astype(np.float32).astype(DTYPE)
                     for r, n in enumerate(ref_rows)]
        grad_outs = [np.random.default_rng(200 + r).standard_normal((len(x), H)).astype(np.float32).astype(DTYPE)
                     for r, x in enumerate(xs)]
        ref_out = ref.sequential_combine(ref_ys, ids, ws, epr)
        ref_gx = ref.sequential_combine(grad_recv, ids, ws, epr, weighted=False)
        ref_gy, ref_gw = ref.sequential_combine_backward(grad_outs, ref_ys, ids, ws, epr)
        # Rank-count-free formula for the combined output of every global token.
        slots = expert_fn(np.repeat(gx, K, axis=0), gids.ravel()).reshape(GLOBAL_TOKENS, K, H)
        formula = ref.slot_sum(slots, gw, DTYPE)[cut[me]:cut[me + 1]]

        n = ref_rows[me]
        rows_bound = R * MAX_TOKENS * K
        pad = lambda a: np.concatenate([a, np.zeros((rows_bound - len(a), H), DTYPE)])  # noqa: E731
        previous = None
        for pull in (False, True):  # expert outputs sent back to the sources, or read where they lie
            with Dispatcher(group, hidden=H, dtype=DTYPE, top_k=K, num_experts=E, max_tokens=MAX_TOKENS,
                            backend=backend, expert_output=pull) as disp:
                rows_of = (lambda a: written(disp.expert_output(), pad(a))) if pull else (lambda a: device(pad(a)))
                for run in range(REPEATS):
                    # Every output buffer starts poisoned: a row nobody wrote fails the comparison.
                    res = disp.dispatch(device(xs[me]), device(ids[me]), device(ws[me]),
                                        out=device(poison((rows_bound, H))))
                    got_x, got_w = host(res.x), host(res.weights)
                    bad = mismatches(got_x[:n], ref_recv[me][0]) + mismatches(got_w[:n], ref_recv[me][1])
                    bad += mismatches(got_x[n:], poison((rows_bound - n, H)))  # nothing written past the rows in use
                    assert np.array_equal(host(res.counts), ref_recv[me][2]), (host(res.counts), ref_recv[me][2])
                    assert res.num_rows == n and host(res.offsets)[-1] == n
                    if run == 0:
                        check_traffic(disp.traffic(res.handle), ids[me], E // R)
                    y = expert_fn(got_x[:n], row_experts(host(res.counts)))
                    out = disp.combine(rows_of(y), res.handle, out=device(poison((len(xs[me]), H))))
                    gx_got = disp.dispatch_backward(rows_of(grad_recv[me]), res.handle,
                                                    out=device(poison((len(xs[me]), H))))
                    gy, gwt = disp.combine_backward(device(grad_outs[me]), device(pad(y)), res.handle,
                                                    out=device(poison((rows_bound, H))))
                    bad += (mismatches(out, ref_out[me]) + mismatches(out, formula) + mismatches(gx_got, ref_gx[me])
                            + mismatches(host(gy)[:n], ref_gy[me]) + mismatches(gwt, ref_gw[me]))
                    outputs = [bits(o).tobytes() for o in (out, gx_got, host(gy)[:n], gwt, got_x[:n])]
                    if previous is not None:
                        assert outputs == previous, f"rank {me}: run {run} of {scenario} differs from run 0"
                    previous = outputs
                    total_bad += bad
        everything = group.allgather(bits(out).tobytes())
        digests.append(f"{scenario}={hashlib.sha256(b''.join(everything)).hexdigest()[:16]}")
    bad_all = sum(group.allgather(total_bad))
    print(f"rank {me}: non-bitwise-equal elements {total_bad} (all ranks {bad_all})", flush=True)
    if me == 0:
        print("digests " + " ".join(digests), flush=True)
        if os.environ.get("ULTRAEP_DIGESTS_FILE"):  # the launcher may splice other ranks' output into a line
            with open(os.environ["ULTRAEP_DIGESTS_FILE"], "w") as file:
                file.write(" ".join(digests))
    assert bad_all == 0, f"{bad_all} elements differ from the sequential reference"
    print(f"[exact] rank {me} OK", flush=True)


def state_mismatches(got, want, name: str) -> int:
    """Elements of a handle's state entry (arrays, lists of (rank, array), scalars) that differ."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"handle state {name}: {got} != {want}"
        return sum(state_mismatches(g, w, name) for g, w in zip(got, want))
    if hasattr(want, "shape") and want.shape != ():
        return mismatches(got, want)  # host() brings a device array over
    assert got == want, f"handle state {name}: {got} != {want}"
    return 0


def push() -> None:
    """``expert_input=True`` against the two-pass dispatch, bit for bit, every scenario."""
    total_bad = 0
    set_up = dict(hidden=H, dtype=DTYPE, top_k=K, num_experts=E, max_tokens=MAX_TOKENS, backend=backend)
    rows_bound = R * MAX_TOKENS * K
    with Dispatcher(group, **set_up) as two_pass, Dispatcher(group, **set_up, expert_input=True) as pushed, \
            Dispatcher(group, **set_up, expert_input=True, expert_output=True) as both:
        expect(two_pass.expert_input, BAD_INPUT, "set up without expert_input=True")
        for seed, scenario in enumerate(SCENARIOS):
            _, _, _, _, xs, ids, ws = scenario_inputs(seed, scenario)
            want = two_pass.dispatch(device(xs[me]), device(ids[me]), device(ws[me]),
                                     out=device(poison((rows_bound, H))))
            n = want.num_rows
            want_x = host(want.x)
            y = expert_fn(want_x[:n], row_experts(host(want.counts)))
            grad_out = np.random.default_rng(300 + me).standard_normal((len(xs[me]), H)).astype(np.float32)
            grad_out = grad_out.astype(DTYPE)
            pad = lambda a: np.concatenate([a, np.zeros((rows_bound - len(a), H), DTYPE)])  # noqa: E731
            want_out = host(two_pass.combine(device(pad(y)), want.handle))
            want_gx = host(two_pass.dispatch_backward(device(pad(y)), want.handle))
            want_gy, want_gw = (host(a) for a in two_pass.combine_backward(device(grad_out), device(pad(y)),
                                                                          want.handle))
            for disp in (pushed, both):
                # The heap's receive buffer and row metadata poisoned: a row nobody wrote shows.
                written(disp.expert_input(), np.empty((0, H), DTYPE))
                for name in ("row_weight", "row_landing", "row_origin"):
                    meta = getattr(disp._impl.buffers, name).local
                    meta.view(np.uint32)[...] = 0xA5A5A5A5
                got = disp.dispatch(device(xs[me]), device(ids[me]), device(ws[me]),
                                    out=disp.expert_input() if seed % 2 else None)
                assert is_buffer(got.x, disp.expert_input()), f"rank {me}: the result's x is not the heap's buffer"
                got_x = host(got.x)
                bad = (mismatches(got_x[:n], want_x[:n]) + mismatches(got_x[n:], poison((rows_bound - n, H)))
                       + mismatches(host(got.weights)[:n], host(want.weights)[:n])
                       + mismatches(got.counts, want.counts) + mismatches(got.offsets, want.offsets))
                assert got.num_rows == n
                assert sorted(got.handle.state) == sorted(want.handle.state)
                # per receive row: the device keeps the whole bound; rows past n were never written
                in_use = lambda k, a: host(a)[:n] if k in ("row_landing", "row_origin", "row_weight") else a  # noqa: E731
                bad += sum(state_mismatches(in_use(k, got.handle.state[k]), in_use(k, want.handle.state[k]), k)
                           for k in want.handle.state)
                rows = written(disp.expert_output(), pad(y)) if disp is both else device(pad(y))
                bad += mismatches(disp.combine(rows, got.handle), want_out)
                bad += mismatches(disp.dispatch_backward(rows, got.handle), want_gx)
                gy, gw = disp.combine_backward(device(grad_out), device(pad(y)), got.handle)
                bad += mismatches(host(gy)[:n], want_gy[:n]) + mismatches(gw, want_gw)
                total_bad += bad
        for disp in (two_pass, pushed, both):
            disp.check()
    bad_all = sum(group.allgather(total_bad))
    print(f"rank {me}: push non-bitwise-equal elements {total_bad} (all ranks {bad_all})", flush=True)
    assert bad_all == 0, f"{bad_all} elements of the push dispatch differ from the two-pass one"
    print(f"[push] rank {me} OK", flush=True)



def bad_input() -> None:
    T = 6
    rng = np.random.default_rng(3)
    x = rng.standard_normal((T, H)).astype(DTYPE)
    ids = rng.integers(0, E, size=(T, K))
    w = rng.random((T, K)).astype(np.float32)
    culprit = R - 1
    make = lambda **kw: Dispatcher(group, **{**dict(hidden=H, dtype=DTYPE, top_k=K, num_experts=E,  # noqa: E731
                                                   max_tokens=T, backend=backend), **kw})
    expect(lambda: make(hidden=3), BAD_INPUT, "rows must be a multiple of 16 bytes")
    expect(lambda: make(top_k=33), BAD_INPUT, "top_k must be <= 32")
    if R > 1:
        expect(lambda: make(num_experts=E + 1), BAD_INPUT, "not divisible by the group size")
        expect(lambda: make(hidden=H * 2 if me == culprit else H), BAD_INPUT, "ranks disagree on Dispatcher set-up")
    for push in (False, True):  # the same refusals whichever way the rows travel
        with Dispatcher(group, hidden=H, dtype=DTYPE, top_k=K, num_experts=E, max_tokens=T,
                        max_recv_rows=T * K, backend=backend, expert_input=push) as disp:
            bad_ids = ids.copy()
            if me == culprit:
                bad_ids[4, 1] = E + 3
            expect(lambda: disp.dispatch(device(x), device(bad_ids), device(w)), BAD_INPUT,
                   f"rank {culprit}: expert id {E + 3} at token 4, slot 1 is outside [0, {E})")
            negative = ids.copy()
            if me == culprit:
                negative[0, 0] = -1
            expect(lambda: disp.dispatch(device(x), device(negative), device(w)), BAD_INPUT,
                   "expert id -1 at token 0, slot 0")
            nan_w = w.copy()
            if me == 0:
                nan_w[2, 3] = np.nan
            expect(lambda: disp.dispatch(device(x), device(ids), device(nan_w)), BAD_INPUT,
                   "rank 0: gate weight at token 2, slot 3 is not finite")
            for infinite in (np.inf, -np.inf):  # refused like NaN, on the host and in the device's route_keys
                inf_w = w.copy()
                if me == culprit:
                    inf_w[1, 2] = infinite
                expect(lambda: disp.dispatch(device(x), device(ids), device(inf_w)), BAD_INPUT,
                       f"rank {culprit}: gate weight at token 1, slot 2 is not finite")
            big = np.concatenate([x, x]) if me == culprit else x
            big_ids = np.concatenate([ids, ids]) if me == culprit else ids
            big_w = np.concatenate([w, w]) if me == culprit else w
            expect(lambda: disp.dispatch(device(big), device(big_ids), device(big_w)), BAD_INPUT,
                   f"{2 * T} tokens exceed the set-up bound max_tokens={T}")
            narrow = x[:, : H // 2].copy() if me == culprit else x
            expect(lambda: disp.dispatch(device(narrow), device(ids), device(w)), BAD_INPUT,
                   f"expected shape [tokens, {H}]")
            other = x.astype(np.float64) if me == culprit else x
            expect(lambda: disp.dispatch(device(other), device(ids), device(w)), BAD_INPUT, "expected dtype")
            if R > 1:  # every rank sends every pair to rank 0: R*T*K rows > bound T*K
                expect(lambda: disp.dispatch(device(x), device(ids % (E // R)), device(w)), BAD_INPUT,
                       f"rank 0 would receive {R * T * K} rows, more than the set-up bound max_recv_rows={T * K}")
            # Still usable, and nothing was written where it should not be.
            own = me * (E // R) + ids % (E // R)
            res = disp.dispatch(device(x), device(own), device(w))
            want = ref.sequential_dispatch([x] * R, [r * (E // R) + ids % (E // R) for r in range(R)], [w] * R,
                                           E // R)[me]
            n = res.num_rows
            assert n == T * K and mismatches(host(res.x)[:n], want[0]) == 0
            out = disp.combine(res.x, res.handle)
            short = res.x[: T * K - 1]
            expect(lambda: disp.combine(short if me == culprit else res.x, res.handle), BAD_INPUT, "y: expected shape")
            assert out.shape == (T, H)
            expect(disp.expert_output, BAD_INPUT, "set up without expert_output=True")
            if push:
                elsewhere = device(np.zeros((T * K, H), DTYPE))
                expect(lambda: disp.dispatch(device(x), device(own), device(w),
                                             out=elsewhere if me == culprit else None), BAD_INPUT,
                       "set up with expert_input=True", "pass no out, or Dispatcher.expert_input()")
                assert is_buffer(disp.dispatch(device(x), device(own), device(w), out=disp.expert_input()).x,
                                 disp.expert_input())
            else:
                expect(disp.expert_input, BAD_INPUT, "set up without expert_input=True")
            disp.check()
    with make(max_recv_rows=T * K * R, expert_output=True) as disp:
        res = disp.dispatch(device(x), device(ids), device(w))
        mine = disp.expert_output()
        expect(lambda: disp.combine(res.x if me == culprit else mine, res.handle), BAD_INPUT,
               "pass Dispatcher.expert_output()")
        expect(lambda: disp.dispatch_backward(mine[1:] if me == culprit else mine, res.handle), BAD_INPUT,
               "expected shape")
        disp.combine(mine, res.handle)  # still usable
        # Another micro-batch's handle on one rank: every rank refuses, none moves rows by it.
        later = disp.dispatch(device(x), device(ids), device(w))
        expect(lambda: disp.combine(mine, res.handle if me == culprit else later.handle), GroupMismatchError,
               "ranks disagree on token path input check", f"ranks [{culprit}]: 'the handle of dispatch #")
        disp.combine(mine, later.handle)  # still usable
        disp.check()
    print(f"[bad-input] rank {me} OK", flush=True)


def balanced() -> None:
    """Planner reroute -> Dispatcher.for_layout: rows follow the plan's physical slots, the
    receive load evens out, and the combined output is bitwise the unbalanced path's
    (replicas compute their logical expert's function; the slot sum order is fixed)."""
    from ultraep.planner import ExpertLayout, plan_placement, reroute

    layout = ExpertLayout(R, E, 2)
    rng = np.random.default_rng(11)
    hot = 1.0 / (1 + np.arange(E)) ** 2
    gids = np.stack([rng.choice(E, size=K, replace=False, p=hot / hot.sum()) for _ in range(GLOBAL_TOKENS)])
    gx = rng.standard_normal((GLOBAL_TOKENS, H)).astype(np.float32).astype(DTYPE)
    gw = rng.random((GLOBAL_TOKENS, K)).astype(np.float32)
    cut = np.linspace(0, GLOBAL_TOKENS, R + 1).astype(int)
    ids = [gids[cut[r]:cut[r + 1]] for r in range(R)]
    loads = np.stack([np.bincount(i.ravel(), minlength=E) for i in ids]).astype(np.int32)
    plan = plan_placement(loads, layout, min_replica_tokens=1)
    phys = [reroute(i, plan, r) for r, i in enumerate(ids)]
    xs = [gx[cut[r]:cut[r + 1]] for r in range(R)]
    ws = [gw[cut[r]:cut[r + 1]] for r in range(R)]
    spr = layout.slots_per_rank
    ref_recv = ref.sequential_dispatch(xs, phys, ws, spr)[me]
    n = len(ref_recv[1])
    common = dict(hidden=H, dtype=DTYPE, top_k=K, max_tokens=MAX_TOKENS, backend=backend)
    outs, rows = {}, {}
    with Dispatcher.for_layout(group, layout, **common) as disp_balanced, \
            Dispatcher(group, num_experts=E, **common) as disp_plain:
        for name, disp, my_ids, to_logical in (("balanced", disp_balanced, phys[me], plan.phys_to_log),
                                              ("plain", disp_plain, ids[me], np.arange(E))):
            res = disp.dispatch(device(xs[me]), device(my_ids), device(ws[me]))
            counts = host(res.counts)
            rows[name] = res.num_rows
            got = host(res.x)[:rows[name]]
            slots = me * disp.experts_per_rank + np.repeat(np.arange(disp.experts_per_rank), counts)
            if name == "balanced":
                assert rows[name] == n and np.array_equal(counts, ref_recv[2])
                assert mismatches(got, ref_recv[0]) == 0
            y = np.zeros((disp.max_recv_rows, H), DTYPE)
            y[:rows[name]] = expert_fn(got, to_logical[slots])
            outs[name] = host(disp.combine(device(y), res.handle))
    bad = mismatches(outs["balanced"], outs["plain"])
    before, after = group.allgather(rows["plain"]), group.allgather(rows["balanced"])
    if me == 0:
        print(f"received rows per rank: plain {before}, balanced {after} "
              f"(plan imbalance {plan.imbalance_before:.3f} -> {plan.imbalance_after:.3f})", flush=True)
    assert bad == 0, f"rank {me}: {bad} elements of the balanced combine differ from the plain one"
    assert max(after) <= max(before), (before, after)
    print(f"[balanced] rank {me} OK", flush=True)


def timeout() -> None:
    """The last rank never dispatches: every other rank's wait times out naming it, none hangs."""
    late = R - 1
    x = np.ones((4, H), DTYPE)
    ids = np.zeros((4, K), np.int64)
    w = np.ones((4, K), np.float32)
    # sync_checks=False: the collective host checks would wait in MPI, which has no timeout.
    disp = Dispatcher(group, hidden=H, dtype=DTYPE, top_k=K, num_experts=E, max_tokens=4, backend=backend,
                      timeout_s=3.0, sync_checks=False)  # long enough that only the missing rank is late
    if me != late:
        try:
            disp.dispatch(device(x), device(ids), device(w))
            disp.check()
        except (DispatchError, TimeoutError) as exc:
            assert f"waiting for rank {late}" in str(exc), str(exc)
            print(f"rank {me} saw: {exc}", flush=True)
        else:
            raise AssertionError(f"rank {me}: dispatch returned although rank {late} never arrived")
    group.barrier()
    disp.close()
    print(f"[timeout] rank {me} OK", flush=True)


def shared_heap() -> None:
    """One heap for two components: ``WeightTransfer.heap_requirements + Dispatcher.heap_requirements``.
    The dispatcher runs bitwise against the reference between a weight sync and its check,
    a backend that contradicts the heap's is refused on every rank, the heap stays open
    after the dispatcher closes, and a heap one byte smaller cannot hold the dispatcher."""
    from ultraep.errors import HeapError
    from ultraep.planner import ExpertLayout, plan_placement
    from ultraep.runtime import open_heap
    from ultraep.runtime.heap import ALLOC_ALIGN
    from ultraep.transfer import ExpertSpec, WeightTransfer

    layout = ExpertLayout(R, E, 2)
    M = layout.experts_per_rank
    spec = ExpertSpec([("fc1", (2 * H, H), "bfloat16"), ("fc2", (H, 2 * H), "bfloat16")])
    T = 16  # slot_grad_w, the last tensor, is then T*K*4 bytes: whole alignment units, no padding
    setup = dict(hidden=H, dtype=DTYPE, top_k=K, num_experts=E, max_tokens=T)
    needs = WeightTransfer.heap_requirements(layout, spec) + Dispatcher.heap_requirements(R, **setup)
    _, shape, last_dtype = needs.tensors[-1]
    assert int(np.prod(shape)) * last_dtype.itemsize % ALLOC_ALIGN == 0, "one byte less would still fit"

    def master(e):
        rng = np.random.default_rng(1000 + e)
        return [rng.standard_normal(w.shape).astype(np.float32).astype(w.dtype) for w in spec.weights]

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((T, H)).astype(np.float32).astype(DTYPE) for _ in range(R)]
    ids = [np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(R)]
    ws = [rng.random((T, K)).astype(np.float32) for _ in range(R)]
    want = ref.sequential_dispatch(xs, ids, ws, E // R)[me]
    loads = np.zeros((R, E), np.int32)
    loads[:, 0] = 100  # expert 0 is hot: replicas of it fill redundant slots
    loads[:, 1:] = 1
    plan = plan_placement(loads, layout, min_replica_tokens=1)
    other = "device" if backend == "host" else "host"
    with open_heap(group, needs, backend=backend) as heap:
        expect(lambda: Dispatcher(group, **setup, heap=heap, backend=other), BAD_INPUT,
               f"backend={other!r} contradicts the given heap, a {backend!r} heap")
        with WeightTransfer(heap, layout, spec) as engine, Dispatcher(group, **setup, heap=heap) as disp:
            assert disp.backend == backend and disp.heap is heap
            engine.register_layer(0, [[device(w) for w in master(me * M + m)] for m in range(M)],
                                  [[xp.zeros(g.shape, g.dtype) for g in spec.grads] for _ in range(M)])
            engine.weight_sync(0, plan)
            res = disp.dispatch(device(xs[me]), device(ids[me]), device(ws[me]))
            n = res.num_rows
            bad = mismatches(host(res.x)[:n], want[0]) + mismatches(host(res.weights)[:n], want[1])
            out = disp.combine(res.x, res.handle)
            engine.synchronize()
            replicas = np.asarray(plan.phys_to_log).reshape(R, layout.slots_per_rank)[me, M:]
            for j, e in enumerate(replicas.tolist()):
                if e >= 0:
                    bad += sum(mismatches(got, w) for got, w in zip(engine.replica_weights(j), master(e)))
            assert bad == 0, f"rank {me}: {bad} elements differ in the shared heap"
            assert out.shape == (T, H)
            placed = sum(group.allgather(int((replicas >= 0).sum())))
            assert placed > 0, "the plan placed no replica: the weight sync moved nothing"
        heap.barrier()  # the dispatcher left the caller's heap open
    with open_heap(group, needs.data_bytes - 1, backend=backend) as small:
        with WeightTransfer(small, layout, spec):
            try:
                Dispatcher(group, **setup, heap=small)
            except HeapError as exc:
                assert "heap out of space: 'token.slot_grad_w'" in str(exc), str(exc)
            else:
                raise AssertionError(f"rank {me}: the dispatcher fit into a heap one byte short")
    print(f"[shared-heap] rank {me} OK", flush=True)


{"exact": exact, "push": push, "bad-input": bad_input, "balanced": balanced, "timeout": timeout,
 "shared-heap": shared_heap}[check]()
