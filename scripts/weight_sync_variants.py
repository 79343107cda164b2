"""Prototype sweep for issue 4 (weight-sync bandwidth), one process on one GPU: fan-out
copies of one 37.7 MB expert to f destination buffers by several kernels
(scripts/weight_sync_variants.cu) and by the current ``weight_sync``, each timed like the
bench (one CUDA-graph replay, ``graph_ms``) against a d2d copy of the same HBM traffic.
Destinations are plain allocations of this process (the bench's are CUDA IPC mappings of
the same HBM). Writes $OUT/variants.json; prints a table per fan-out.

Findings (H200, 29 Nov 2026; vs d2d at fan-out 1/2/4/8, best grid of each):
- weight_sync as in 9ad259a (loader, storer, counting warp; contiguous block shares):
  0.74/0.76/0.80/0.82; with its counting off 0.82/0.82/0.86/0.86.
- A bare bulk kernel (one loader lane, one storing lane, read lag 1, no tasks, no
  signalling), pieces taken in turn by the blocks: 0.93-0.95/0.91-0.92/0.92/0.90-0.92;
  with contiguous block shares 0.93/0.88/0.89/0.89-0.91; a bulk store per destination
  lane 0.93/0.89-0.91/0.92-0.95/0.92-0.93. So the copy engine can reach ~0.92, and the
  task structure and signalling cost the rest.
- Register copies (a warp loads 4 KiB, stores it to every destination): 0.98/0.90-0.92/
  0.86-0.87/0.85-0.86; one warp job per (piece, destination) 0.96/0.89/0.88/0.87; all
  warps copying one window to one destination at a time (source re-read from L2)
  0.95/0.89/0.81/0.78 (ncu: the L2 re-reads reach HBM again as the window grows).
- Three rewrites of weight_sync on the bare kernel's pattern (pieces in turn; storing
  warps that count their own landed pieces: 16cd50c, 88261bb, a02bb9c; all GPU tests
  passed) timed the same as 9ad259a within the run-to-run spread: 0.73-0.76/0.75-0.77/
  0.77-0.81/0.79-0.84 in the bench. Measured inside them: more storing warps per block
  helped while each waited for its own piece's writes (1 -> 4 warps: 39.7 -> 29.2 us at
  fan-out 1); without atomics, fences and flags 25.7/35.6/54.2/94.3 us (0.83/0.84/0.88/
  0.87) against 29.2/39.6/58.8/99.2 with them; dropping fence.acq_rel.sys alone saved
  ~2 us at fan-out 1 (single GPU only: peers on other GPUs need it); holding counts until
  8 pieces were pending saved ~2 us at fan-out 1-2 but delays relays' chunk flags; the
  gap left to the bare kernel (~2.5 us at fan-out 1) is the task look-ups and start-up.
  9ad259a's kernel was kept: no rewrite was faster, and it publishes chunks promptly.
- c17c1bd counts and flags only the chunks a relay forwards (task column ``publish``):
  weight_sync 25.7-26.0/35.6-35.9/54.9-55.6/94.5-95.0 us (0.82-0.84/0.83-0.84/0.85-0.87/
  0.87) against 29.2-29.5/39.1-39.2/59.1-59.4/99.6-100.2 us with every chunk published
  (``weight_sync+publish``, the kernel as before) in the same runs: 3.3-3.5/3.3-3.4/
  3.8-4.2/4.6-5.7 us saved. Left to the bare bulk kernel (pieces in turn): 3.1-3.4/
  2.5-3.1/3.9-4.4/4.4-6.4 us; to the bare kernel with contiguous shares: 2.6-2.7/
  2.0-2.4/1.7-2.6/1.0-2.0 us (three runs).
- Tried on top of it, both within noise or worse, so not kept (``WS_VARIANTS`` compares
  a working-tree kernel with another transfer.cu in one run): destinations looked up once
  per source instead of once per chunk (26.1 -> 25.7, 35.6 -> 35.7, 55.0 -> 54.9,
  94.4 -> 95.0 us); the bare kernel's order in weight_sync (whole tiles in turn, the
  leftover slots in contiguous unit shares): 26.4/36.9/56.0/95.3 us against 26.0/35.6/
  55.1/95.0 (bench 0.81/0.80/0.83/0.85 against 0.84/0.84/0.84/0.86).
- 2026-12-01 (``hybrid_fanout``: bulk loads, each piece's f x bytes split between bulk
  stores and lanes storing from shared memory through registers, 2-8 storing warps): no
  split beat the bulk engine alone (f=1: 0.93 for every split, 0.91-0.93 with lanes only;
  f=8: 0.90-0.93 for all), so the engine is not the limit. An L2 evict_first policy on the
  bulk stores: +1-2 % at f=4/8 and -1-3 % at f=2 in the bare kernel, within noise in
  weight_sync; a read lag of 2: 1-2 % slower. weight_sync now takes whole tiles in turn
  with one round trip of table reads at start-up: 24.9/35.2/53.4/94.0 us (0.86/0.85/0.89/
  0.89 of d2d) against 26.8/36.6-36.8/57.1/95.8-96.6 before; the bare kernel 22.7-23.6/
  32.9-34.0/51.3-53.1/89.1-91.2 (a per-block %globaltimer stamp script, removed with the
  bulk kernel in b2ccae8, put most of the gap in start-up).
- 2026-12-01, ninth session: bare register copies (4 KiB warp pieces, streaming stores,
  fan-out unrolled at compile time) reached 1.00-1.02 of d2d at fan-out 1 and 0.90-0.94
  at 2-8, against 0.95 / 0.90-0.93 for the bare bulk kernel; weight_sync was rewritten on
  that pattern (b2ccae8): 23.4-23.7/34.4-34.5/54.1-54.3/93.8-95.2 us (0.91-0.92/0.87-0.88/
  0.88/0.88 of d2d). Its block shape (WS_VARIANTS copies with SYNC_WARPS 4/16/32): 4 warps
  level with 8, 16 warps 3-6 % and 32 warps 10-12 % slower.
- 2026-12-01, tenth session (scratch kernels, not kept; docs/benchmarks.md has the tables):
  pure writes (memset, a write-only kernel into 8 buffers) and pure reads ran at 1.01-1.08
  of d2d, so mixing one read among f writes is what costs; a bulk L2 prefetch of each warp's
  next piece made a bare 2 KiB copy 1.04/0.96-0.98/0.91-0.95/0.87-0.91; run-time divisions
  (8 per piece) cost it 5 % at fan-out 1. weight_sync with both (47014d6, WS_VARIANTS
  against dfa1a82's kernel): 0.94-0.95/0.92-0.93/0.90-0.93/0.87-0.88 against 0.90-0.92/
  0.87-0.88/0.87-0.89/0.88-0.89; its 4 KiB variant with the prefetch was 3-15 % slower.
- 2026-12-01, eleventh session (scratch kernels, not kept; docs/benchmarks.md has the tables):
  at fan-out 8 the same writes with loads that hit L2 ran at 1.12-1.13 of d2d and the copy
  from HBM at 0.85-0.91 whatever the prefetch pattern, so one HBM read among eight writes
  sets the pace; the bench now times the task-free pattern beside the sync (bare_vs_d2d).
"""
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import cupy
from cupy.cuda import runtime

sys.path.insert(0, os.getcwd())
from ultraep.bench.timing import graph_ms  # noqa: E402
from ultraep.runtime.kernels import inline_local_includes  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
T0 = time.time()
HID, FFN, TILE, CT = 4096, 1536, 32 << 10, 4
E = 2 * FFN * HID * 2 + HID * FFN * 2
FAN = [int(x) for x in os.environ.get("FANOUTS", "1 2 4 8").split()]
REPEATS = 20
rng = cupy.random.default_rng(0)
src = rng.integers(0, 255, size=E, dtype=cupy.uint8)
WB = 4096  # flag area before the expert in each destination (for weight_sync)
bufs = [cupy.zeros(WB + E, cupy.uint8) for _ in range(9)]
scratch = cupy.zeros(9 * E + 64, cupy.uint8)
done = cupy.zeros(1 << 16, np.int32)
stream = lambda: cupy.cuda.get_current_stream().ptr  # noqa: E731

names = ["reg_fanout<8, 0>", "reg_fanout<8, 1>", "reg_fanout<4, 0>", "split_fanout<8, 0, 0>", "split_fanout<8, 1, 0>",
         "split_fanout<8, 1, 8>", "split_fanout<8, 1, 4>", "split_fanout<16, 1, 0>", "bulk_fanout<0, 0>",
         "bulk_fanout<0, 1>", "bulk_fanout<1, 0>", "hybrid_fanout<0>", "hybrid_fanout<1>"]
mod = cupy.RawModule(code=inline_local_includes(Path("scripts/weight_sync_variants.cu")), options=("--std=c++17",),
                     name_expressions=names)
mod.compile()
fn = {n: mod.get_function(n) for n in names}
for n in names:
    if n.startswith(("bulk", "hybrid")):
        fn[n].max_dynamic_shared_size_bytes = 200 << 10
ws_src = inline_local_includes(Path("raw_kernels/transfer.cu"))
ws = {"weight_sync": ws_src}
# other transfer.cu files with the same kernel signature, "label=path,label=path" (their
# includes are looked up beside them, then in raw_kernels/)
for entry in filter(None, os.environ.get("WS_VARIANTS", "").split(",")):
    label, path = entry.split("=")
    ws[label] = inline_local_includes(Path(path))
ws_fn = {}
for k, code in ws.items():
    ws_fn[k] = cupy.RawModule(code=code, options=("--std=c++17",)).get_function("weight_sync")
print(f"compiled in {time.time() - T0:.1f}s", flush=True)


def guard(what, limit=5.0):
    ev = cupy.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.done:
        if time.time() - t0 > limit:
            print(f"HANG during {what}", flush=True)
            os._exit(3)
        time.sleep(0.0005)


def ws_tables(f, publish):
    ntiles = [-(-(2 * FFN * HID * 2) // TILE), -(-(HID * FFN * 2) // TILE)]
    NT = sum(ntiles)
    NCH = -(-NT // CT)
    tasks = np.array([(0, c, c * CT, min(c * CT + CT, NT), 0, f, -1, publish) for c in range(NCH)], np.int64)
    dests = np.array([(r, WB, 0) for r in range(1, f + 1)], np.int64)
    sizes = [2 * FFN * HID * 2, HID * FFN * 2]
    ttab = np.array([(0, sizes[0], 0), (ntiles[0], sizes[1], sizes[0])], np.int64)
    srcs = np.array([src.data.ptr, src.data.ptr + sizes[0]], np.uint64)
    peer = np.array([b.data.ptr for b in bufs], np.uint64)
    return [cupy.asarray(a) for a in (tasks, np.array([NCH], np.int32), ttab, dests, srcs, peer)], NCH


def make(kind, f, cfg):
    """A launch closure for variant ``kind`` at fan-out f; cfg = (threads, blocks, extra).
    A weight_sync kind ending in ``+publish`` counts and flags every chunk (as if every
    destination relayed it); cfg's extra is unused for weight_sync (256-thread blocks)."""
    dsts = cupy.asarray(np.array([b.data.ptr + WB for b in bufs[1:f + 1]], np.uint64))
    threads, blocks, extra = cfg
    publish = kind.endswith("+publish")
    kind = kind.removesuffix("+publish")
    if kind in ws_fn:
        (tasks, cnt, ttab, dests, srcs, peer), nch = ws_tables(f, int(publish))
        wdone = cupy.zeros(nch, np.int32)
        status = cupy.zeros(4, np.uint64)
        args = (tasks, cnt, np.int32(nch), np.int32(CT), ttab, np.int32(2), np.int64(TILE), dests, np.int32(f), srcs,
                np.int32(2), peer, np.int32(9), np.int32(0), np.uint64(1), wdone, np.uint64(10**10), status)
        k = ws_fn[kind]
        SIGNALS[0] = (nch, wdone, status, publish)
        return lambda: k((blocks,), (threads,), args), dsts
    k = fn[kind]
    if kind.startswith("reg"):
        return lambda: k((blocks,), (threads,), (src, dsts, np.int64(E // 16), np.int32(f))), dsts
    if kind.startswith("split"):
        return lambda: k((blocks,), (threads,), (src, dsts, np.int64(E // 16), np.int32(f), np.int64(extra), done)), dsts
    if kind.startswith("hybrid"):
        stages, piece, tma_share = extra
        return lambda: k((blocks,), (threads,), (src, dsts, np.int64(E), np.int32(f), np.int32(piece), np.int32(stages),
                                                 np.int32(tma_share)), shared_mem=stages * piece), dsts
    stages, piece = extra
    return lambda: k((blocks,), (64,), (src, dsts, np.int64(E), np.int32(f), np.int32(piece), np.int32(stages)),
                     shared_mem=stages * piece), dsts


SIGNALS = [None]  # (chunks, done counters, status) of the last weight_sync launch made


def check(launch, f, kind):
    """Every destination equals the source; for weight_sync also every chunk flag is set
    (epoch 1, rank 0) where its task publishes and untouched where not, the counters are
    back at zero and no timeout was recorded."""
    for b in bufs[1:f + 1]:
        b.fill(0xA5)
    launch()
    guard("check")
    ok = all(bool(cupy.array_equal(b[WB:], src)) for b in bufs[1:f + 1])
    if kind.removesuffix("+publish") in ws_fn:
        nch, wdone, status, publish = SIGNALS[0]
        flag = np.uint64(1 << 16) if publish else np.uint64(0xA5A5A5A5A5A5A5A5)
        ok &= all(bool((b[:nch * 8].view(np.uint64) == flag).all()) for b in bufs[1:f + 1])
        ok &= not bool(wdone.any()) and not bool(status.any())
    return ok


K16, K32 = 16 << 10, 32 << 10
VARIANTS = [  # (label, kernel, [(threads, blocks, extra)]); earlier runs in the module docstring
    ("reg_interleaved_u8", "reg_fanout<8, 0>", [(256, 528, 0)]),
    ("bulk_interleaved", "bulk_fanout<0, 0>", [(64, 132, (6, K32)), (64, 396, (4, K16))]),
    ("bulk_contig", "bulk_fanout<0, 1>", [(64, 132, (6, K32))]),
    ("hybrid_all_bulk", "hybrid_fanout<0>", [(128, 132, (6, K32, 256))]),
    ("hybrid_bulk_evict_first", "hybrid_fanout<1>", [(128, 132, (6, K32, 256))]),
    ("hybrid_3/4_bulk_w2", "hybrid_fanout<0>", [(128, 132, (6, K32, 192))]),
    ("hybrid_1/2_bulk_w2", "hybrid_fanout<0>", [(128, 132, (6, K32, 128))]),
    ("hybrid_1/2_bulk_w4", "hybrid_fanout<0>", [(192, 132, (6, K32, 128))]),
    ("hybrid_1/4_bulk_w4", "hybrid_fanout<0>", [(192, 132, (6, K32, 64))]),
    ("hybrid_no_bulk_w4", "hybrid_fanout<0>", [(192, 132, (6, K32, 0))]),
    ("hybrid_no_bulk_w8", "hybrid_fanout<0>", [(320, 132, (6, K32, 0))]),
    ("weight_sync", "weight_sync", [(256, 264, None), (256, 396, None), (256, 528, None)]),
    ("weight_sync_publish_all", "weight_sync+publish", [(256, 264, None), (256, 396, None), (256, 528, None)]),
] + [(label, label, [(256, 396, None), (256, 528, None)]) for label in ws if label != "weight_sync"]
VARIANTS = [v for v in VARIANTS if v[1].removesuffix("+publish") in ws or not v[1].startswith("weight_sync")]
if os.environ.get("VARIANTS"):  # a comma-separated subset of the labels
    VARIANTS = [v for v in VARIANTS if v[0] in os.environ["VARIANTS"].split(",")]

if os.environ.get("NCU_MODE"):  # one launch of each variant's first config, for ncu's counters
    for f in FAN:
        for label, kind, cfgs in VARIANTS:
            launch, _ = make(kind, f, cfgs[0])
            launch()
            guard(label)
        half = (1 + f) * E // 2
        runtime.memcpyAsync(scratch.data.ptr + half, scratch.data.ptr, half, runtime.memcpyDeviceToDevice, stream())
        guard("d2d")
    sys.exit(0)

results = {"base": {}, "rows": []}
for f in FAN:
    traffic = (1 + f) * E
    half = traffic // 2
    d2d = graph_ms(lambda: runtime.memcpyAsync(scratch.data.ptr + half, scratch.data.ptr, half,
                                               runtime.memcpyDeviceToDevice, stream()), REPEATS)
    d2d2 = graph_ms(lambda: runtime.memcpyAsync(scratch.data.ptr + half, scratch.data.ptr, half,
                                                runtime.memcpyDeviceToDevice, stream()), REPEATS)
    copies = [(b.data.ptr + WB, src.data.ptr, E) for b in bufs[1:f + 1]]
    memcpy = graph_ms(lambda: [runtime.memcpyAsync(d, s, n, runtime.memcpyDeviceToDevice, stream()) for d, s, n in copies], REPEATS)
    memset = graph_ms(lambda: runtime.memsetAsync(scratch.data.ptr, 7, f * E, stream()), REPEATS)
    one = cupy.asarray(np.array([scratch.data.ptr + half], np.uint64))
    regcopy = graph_ms(lambda: fn["reg_fanout<8, 0>"]((264,), (512,), (scratch, one, np.int64(half // 16), np.int32(1))), REPEATS)
    base = dict(d2d=d2d, d2d_again=d2d2, memcpy_per_replica=memcpy, memset=memset, regcopy_same_traffic=regcopy)
    results["base"][f] = base
    print(f"\n== f={f}: d2d {d2d*1e3:.1f}/{d2d2*1e3:.1f} us ({traffic/d2d/1e6:.0f} GB/s), memcpy/replica {memcpy*1e3:.1f} us, "
          f"memset {memset*1e3:.1f} us ({f*E/memset/1e6:.0f} GB/s), register copy same traffic {regcopy*1e3:.1f} us "
          f"(vs d2d {d2d/regcopy:.3f})", flush=True)
    for label, kind, cfgs in VARIANTS:
        best = None
        for i, cfg in enumerate(cfgs):
            launch, _ = make(kind, f, cfg)
            ok = check(launch, f, kind) if i == 0 or kind.removesuffix("+publish") in ws_fn else None
            t = graph_ms(launch, REPEATS)
            row = dict(f=f, variant=label, cfg=str(cfg), ms=t, vs_d2d=d2d / t, vs_memcpy=memcpy / t, ok=ok)
            results["rows"].append(row)
            if best is None or t < best["ms"]:
                best = row
            if ok is False:
                print(f"   CHECK FAILED {label} {cfg}", flush=True)
        print(f"  {label:26s} best {best['cfg']:22s} {best['ms']*1e3:7.1f} us  vs_d2d {best['vs_d2d']:.3f}  "
              f"vs_memcpy {best['vs_memcpy']:.2f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    json.dump(results, open(OUT / "variants.json", "w"), indent=1)
print(f"done in {time.time() - T0:.0f}s")
