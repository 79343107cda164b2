"""``python -m ultraep.bench balancer``: the exposed cost of balancing one MoE layer, as a
framework would run it, beside the layer itself, in one run.

Every rank routes ``tokens`` fp16 tokens top-k with Zipf-skewed experts tuned to each
initial rank imbalance (``--initial-imbalance``, ``ultraep.analysis.traces.zipf_topk``).
Experts are two matrices ``[hidden, ffn]`` and ``[ffn, hidden]`` stored in each
``--weight-dtype`` (one row each): bf16, or FP8 with DeepSeek-V3-style float32 scales, one
per 128 x 128 block, synced beside them; gradients fp32. The compute reads fp16 copies
(bf16 widened, FP8 times its block scale): the masters' made once, each replica's per call.
Two layers are timed, alternately, as group windows (first rank's start to the last
rank's end, host and device, per call; medians over ``--rounds`` rounds of
``--repeats`` calls):

* ``balanced_ms``: the whole balanced layer -- ``Balancer.update`` (a new plan every
  call), ``weight_sync`` (its tasks compiled on the device on the GPU) on a side stream
  beside dispatch or in series (``--sync-stream``), ``reroute``, dispatch, the masters'
  compute, then each replica slot's compute after ``wait_replica`` for that slot alone,
  combine;
* ``layer_ms``: the same layer with the plan and the replicas already in place
  (dispatch, compute, combine).

``--steps plan`` or ``sync`` leaves the sync or the update and reroute out of the balanced
layer, to tell their costs apart; ``--sync-at dispatch`` starts the sync once dispatch is
enqueued (it then runs beside the masters' compute instead of reroute and dispatch);
``--sync-stream layer`` enqueues the sync on the layer's own stream instead of a side stream,
in series with the layer's kernels (before reroute, or after dispatch), nothing beside them;
``update`` has the update start it in series (``update(weight_sync=True)``, inside the
update's CUDA graph); ``auto`` (default) is ``side`` where each rank has a GPU of its own, else ``layer``, as
``MoELayer``'s default (``side layer``: a row each).
``exposed_ms`` = balanced - in place (median of the rounds' differences): what balancing
adds to the layer. ``share_pct`` = exposed / layer. ``update_dev_ms``,
``weight_sync_dev_ms`` and ``reroute_dev_ms`` are the Balancer's own CUDA-event (CPU: wall)
stage times in the balanced layer, each rank's median over its calls, the slowest rank's
(a sync's copies run on the ranks that hold the replicated masters: the others' syncs
are the agreement and the compile alone): the parts, not additive (the sync runs beside
dispatch; in ``update`` rows the update's time includes it, and ``weight_sync_dev_ms`` is
empty). ``bal_host_ms`` is the
host's time inside the Balancer's calls of one balanced layer -- ``update_host_ms``,
``sync_host_ms``, ``reroute_host_ms`` and ``wait_host_ms`` (the per-slot waits) -- and
``call_host_ms`` the host's time to enqueue the whole balanced layer (medians).

Where the exposed time goes (GPU; events on the compute stream, medians over the calls
after each window's first): ``exposed_dev_ms`` is the same difference taken from the
device's period per layer (one layer's start to the next's), without the window's first
launch, which waits for the host; ``lead_dev_ms`` the compute stream's time from the
layer's start to dispatch's (update and reroute: serial), ``update_lead_dev_ms`` its
update part; ``d_dispatch_dev_ms``, ``d_masters_dev_ms``, ``d_replicas_dev_ms`` and
``d_combine_dev_ms`` what each phase of the layer takes longer balanced than in place (the sync beside it, the
per-slot waits); ``wait_dev_ms`` the compute stream's time in the per-slot waits
(replicas not landed yet); ``synced_dev_ms`` the layer's start to the end of the sync's
launches on its own stream; ``idle_dev_ms`` the compute stream's wait for the host between
one layer's end and the next's start; ``blocked_host_ms`` the host's time blocked on the
device inside the Balancer's calls per layer (``BalancerStats.host_wait_ms``, mean: an
update a whole ring of micro-batches ahead of its device waits there, harmless that far
ahead). Host-bound: ``idle_dev_ms`` above zero (or ``call_host_ms`` near
``balanced_ms``): the layer then pays the calls' host time. Device-bound (idle near
zero): ``exposed_dev_ms`` is about ``lead_dev_ms`` plus the ``d_*`` columns: what the
sync's grid takes from dispatch and the compute beside it (``--sync-blocks``
lists grids to compare, one row each; ``--relay-threshold`` relay trees, ``relays``
names a row's: ``>N: C``, experts with more than N replicas sent to C relays). On the
GPU the Balancer replays its fixed launches as CUDA graphs unless ``--no-cuda-graphs``.
``sync_vs_bf16`` is a row's ``weight_sync_dev_ms`` over the bf16 row's at the same
imbalance; ``sync_MB`` the weight bytes one sync moves (group total, mean).
``replica_diff``: bytes of this row's last synced replicas that differ from their masters
(any makes the bench exit 1).
Several ranks on one GPU run time-sliced, so both times include the other ranks' work,
unless ``--emulate-ep`` runs them under MPS with an SM share each; the title says which.
The receive buffer holds 1.25x the mean rows (balanced routing stays near the mean).
Started with one process, it relaunches itself on ``--ranks`` ranks under ``mpiexec``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import statistics
import sys
import time
from functools import partial

import numpy as np

from ultraep.bench.timing import group_window_ms
from ultraep.runtime.launch import (CPU_OR_GPU, DefaultsHelpFormatter, add_launch_options, imbalance_target,
                                   job_ranks, multi_rank_main, non_negative_int, positive_int, row_width)
from ultraep.runtime.sm_partition import new_stream

LAYERS = 4  # cycled, so a layer's ring slot is reused only after the other layers' updates, as in training
PHASE_NAMES = ("dispatch", "masters", "replicas", "combine")  # what LAYER_PHASES end, as the columns name them
DEVICE_COLUMNS = ["exposed_dev_ms", "update_lead_dev_ms", "lead_dev_ms", *(f"d_{name}_dev_ms" for name in PHASE_NAMES),
                  "wait_dev_ms", "synced_dev_ms", "idle_dev_ms"]
COLUMNS = ["weights", "steps", "sync_at", "sync_stream", "compute_priority", "sync_blocks", "relays", "imbalance",
           "imb_after", "replicas_mean", "exposed_ms", "layer_ms", "balanced_ms", "share_pct", *DEVICE_COLUMNS,
           "bal_host_ms", "update_host_ms", "sync_host_ms", "reroute_host_ms", "wait_host_ms", "blocked_host_ms",
           "call_host_ms", "update_dev_ms", "weight_sync_dev_ms", "sync_vs_bf16", "sync_MB", "reroute_dev_ms",
           "replica_diff"]
GPU_ONLY_COLUMNS = [*DEVICE_COLUMNS, "compute_priority", "sync_blocks"]  # empty or inert on the host
LAYER_PHASES = ("dispatched", "masters", "computed", "end")  # the stamps ending dispatch, the masters' compute,
# the replicas' and combine
HOST_PARTS = ("update", "sync", "reroute", "wait")  # the Balancer's calls of a balanced layer, timed on the host
BALANCER_STAGES = ("update", "weight_sync", "reroute")  # the Balancer's own stage clocks, the *_dev_ms columns
WEIGHT_DTYPES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2"}  # name -> table label
HIGHEST_PRIORITY = -1000  # CUDA clamps a stream priority to the device's range: this is its highest
SYNC_STREAMS = {"side": "on a side stream beside dispatch", "layer": "on the layer's stream, in series",
                "update": "started by the update (in its CUDA graph), in series",
                "auto": "beside where each rank has a GPU of its own, else started by the update (MoELayer's default)"}
BLOCK = 128  # edge of the square weight block one FP8 scale covers (DeepSeek-V3)


def resolved_sync_streams(group, streams: list, update_may_start: bool = True) -> list:
    """``streams`` with ``auto`` as MoELayer places the sync on this group, each once, in
    order (collective): beside where :func:`~ultraep.integration.sync_beside_pays`, else
    started by the update (in series on the layer's stream where ``update_may_start`` is
    False: the bench's options keep the update from starting it)."""
    from ultraep.integration import sync_beside_pays

    auto = "side" if sync_beside_pays(group) else "update" if update_may_start else "layer"
    return list(dict.fromkeys(auto if stream == "auto" else stream for stream in streams))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.bench balancer", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_launch_options(parser, backend_help=CPU_OR_GPU)
    parser.add_argument("--experts", type=positive_int, default=64,
                        help="logical experts in all (divisible by the ranks)")
    parser.add_argument("--slots", type=non_negative_int, default=2, help="redundant slots per rank")
    parser.add_argument("--tokens", type=positive_int, default=8192, help="tokens per rank")
    parser.add_argument("--top-k", type=positive_int, default=8, help="experts per token")
    parser.add_argument("--hidden", type=row_width, default=2048, help="model width (rows of w_in)")
    parser.add_argument("--ffn", type=row_width, default=1024, help="expert FFN width (columns of w_in)")
    parser.add_argument("--initial-imbalance", type=imbalance_target, nargs="+", default=[1.25, 1.5],
                        help="rank max/mean of the generated routing before balancing, one row each (with 4 "
                             "ranks and top-8 over 64 experts at most 1.5 is reachable)")
    parser.add_argument("--weight-dtype", nargs="+", choices=list(WEIGHT_DTYPES), default=["bfloat16"],
                        help="expert weight types, one row each per imbalance (FP8 with float32 scales per "
                             f"{BLOCK} x {BLOCK} block); list bfloat16 too for the sync_vs_bf16 ratio")
    parser.add_argument("--min-replica-tokens", type=non_negative_int, default=1024,
                        help="fewest tokens a replica may serve (the planner's min_replica_tokens)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per window (after one warm-up)")
    parser.add_argument("--rounds", type=positive_int, default=5,
                        help="windows of each layer, alternating balanced and in place (medians reported)")
    parser.add_argument("--sync-blocks", type=sync_grid, nargs="+", default=[None], metavar="BLOCKS",
                        help="grids of the weight sync beside dispatch, one row each: a block count, or 'all' "
                             "(the engine's default: every resident block)")
    parser.add_argument("--relay-threshold", type=positive_int, nargs="+", default=[None], metavar="N",
                        help="weight sync through relay trees for experts with more replicas than N, a row each "
                             "(default: WeightTransfer's)")
    parser.add_argument("--relay-count", type=positive_int, default=2, help="relays per tree with --relay-threshold")
    parser.add_argument("--steps", choices=["all", "plan", "sync"], default="all",
                        help="what the balanced layer does each call: all (update, weight_sync, reroute), plan "
                             "(update and reroute; the replicas of the same plan stay in place: the routing is the "
                             "same every call) or sync (weight_sync of the plan in place, and the per-slot waits)")
    parser.add_argument("--sync-at", choices=["plan", "dispatch"], default="plan",
                        help="where the balanced layer starts weight_sync: as soon as the plan exists (beside "
                             "reroute and dispatch), or once dispatch is enqueued (its stream then waits for dispatch, "
                             "a reader of the replica slots: the sync runs beside the masters' compute)")
    parser.add_argument("--sync-stream", choices=list(SYNC_STREAMS), nargs="+", default=["auto"],
                        help="where the balanced layer enqueues weight_sync: a side stream of its own, beside the "
                             "layer's kernels, the layer's stream, in series with them, started by the update "
                             "(update(weight_sync=True): in series, in the update's CUDA graph), or auto (as MoELayer: "
                             "side where each rank has a GPU of its own, else update, or layer where the options keep "
                             "the update from starting it); a row each")
    parser.add_argument("--compute-priority", choices=["default", "high"], default="default",
                        help="the stream the layers run on: the default priority, as the weight sync's side stream, "
                             "or the device's highest, so that the block scheduler serves the layer's kernels before "
                             "the sync's")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="the Balancer launches every kernel itself (default: its fixed launch sequences are "
                             "replayed as CUDA graphs)")
    parser.add_argument("--host-profile", metavar="DIR",
                        help="profile the Balancer's calls of the balanced layers on rank 0 with cProfile: one "
                             ".pstats and one .txt (top functions by own time) per row in DIR (the profiler "
                             "slows those calls: read the row's times from a run without it)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the routing and the weights")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="draw each rank's load per micro-batch, unbalanced and balanced, at the last "
                             "--initial-imbalance (ultraep.analysis.plots.plot_rank_loads)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    ranks = job_ranks(args)  # checked here, not on every rank after the launch
    if args.experts % ranks:
        parser.error(f"--experts {args.experts} must be divisible by the {ranks} ranks")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.relay_count != parser.get_default("relay_count") and args.relay_threshold == [None]:
        parser.error("--relay-count sizes the relay trees of --relay-threshold: give both")
    from ultraep.analysis.traces import zipf_loads

    for target in args.initial_imbalance:  # the routing each row draws (measure), refused before the launch
        try:
            zipf_loads(ranks, args.experts, args.top_k, args.tokens, target, args.seed)
        except ValueError as exc:
            parser.error(f"--initial-imbalance {target}: {exc}")
    if "update" in args.sync_stream and not update_may_start(args):
        parser.error("--sync-stream update: the update starts the sync, so it needs --steps all, --sync-at plan "
                     "and the engine's grid (--sync-blocks all)")
    return args


def update_may_start(args) -> bool:
    """Whether the bench's options let the update start the weight sync (``--sync-stream update``)."""
    return args.steps == "all" and args.sync_at == "plan" and args.sync_blocks == [None]


def sync_grid(text: str) -> int | None:
    """``--sync-blocks`` value: a positive block count, or ``all`` (None: the engine's grid)."""
    if text == "all":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive block count or 'all', got {text!r}") from None


def main(argv=None) -> int:
    return multi_rank_main(argv, parse_args, run, nprocs=lambda args: args.ranks,
                           command=["-m", "ultraep.bench", "balancer"])


def expert_spec(hidden: int, ffn: int, dtype: str):
    """``w_in`` and ``w_out`` in ``dtype``, then each FP8 weight's block scales."""
    from ultraep.runtime.dtypes import FP8_NAMES
    from ultraep.transfer import ExpertSpec

    matrices = [("w_in", (hidden, ffn)), ("w_out", (ffn, hidden))]
    scales = ([(f"{name}_scale", tuple(-(-d // BLOCK) for d in shape), "float32", name) for name, shape in matrices]
              if dtype in FP8_NAMES else [])
    return ExpertSpec([(name, shape, dtype) for name, shape in matrices] + scales, grad_dtype="float32")


def blockwise(scale, shape, xp):
    """Each block's scale repeated over the block's elements of a weight of ``shape``."""
    return xp.repeat(xp.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:shape[0], :shape[1]]


def master_weights(spec, expert: int, seed: int) -> list:
    """Expert ``expert``'s tensors on the host, seeded by the expert alone so any rank can
    rebuild a master to check its replicas: normal matrices rounded to bf16, or quantised
    to FP8 with the scale that maps each block's largest magnitude to the format's largest."""
    rng = np.random.default_rng((seed, 1, expert))
    matrices = [rng.standard_normal(t.shape, np.float32) / np.float32(np.sqrt(t.shape[0])) for t in spec.weights[:2]]
    dtype = spec.weights[0].dtype
    if not spec.scale_of:
        return [m.astype(dtype) for m in matrices]
    import ml_dtypes

    largest = np.float32(ml_dtypes.finfo(dtype).max)
    scales = []
    for m in matrices:
        rows, cols = (-(-d // BLOCK) for d in m.shape)
        padded = np.zeros((rows * BLOCK, cols * BLOCK), np.float32)
        padded[:m.shape[0], :m.shape[1]] = np.abs(m)
        scales.append(np.maximum(padded.reshape(rows, BLOCK, cols, BLOCK).max(axis=(1, 3)), 1e-12) / largest)
    return [np.clip(m / blockwise(s, m.shape, np), -largest, largest).astype(dtype)
            for m, s in zip(matrices, scales)] + scales


def fp16_weights(spec, xp):
    """The function from an expert's tensors (typed, or their bits as CuPy holds them) to the
    fp16 ``[w_in, w_out]`` the compute reads."""
    if not spec.scale_of:  # bf16: its bits are the upper half of a float32's
        return lambda weights: [(w.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
                                .astype(np.float16) for w in weights[:2]]
    values = xp.asarray(np.arange(256, dtype=np.uint8).view(spec.weights[0].dtype).astype(np.float32))  # per byte
    return lambda weights: [(values[w.view(np.uint8)] * blockwise(s, w.shape, xp)).astype(np.float16)
                            for w, s in zip(weights[:2], weights[2:])]


def replica_diff(balancer, handle, spec, masters_per_rank: int, seed: int, to_host) -> int:
    """Bytes of this rank's replica slots that differ from their masters after the sync."""
    experts = to_host(balancer.local_experts(handle))[masters_per_rank:].tolist()
    replicas = balancer.replica_weights(handle)
    return sum(int(np.count_nonzero(to_host(got).view(np.uint8) != want.view(np.uint8)))
               for slot, expert in enumerate(experts) if expert >= 0
               for got, want in zip(replicas[slot], master_weights(spec, expert, seed)))


class CallStamps:
    """CUDA events at fixed points of every call of one timed window (the warm-up call
    first), made once so that stamping allocates nothing; :meth:`read` takes the window's
    times once it has synchronised. ``points`` in call order, on the compute stream;
    ``side_points`` on another stream (read from ``begin``). ``cupy`` None (CPU): no stamps."""

    def __init__(self, cupy, calls: int, points: tuple, waits_per_call: int, side_points: tuple = ()):
        self.enabled, self.points, self.side_points, self.call = cupy is not None, points, side_points, -1
        if not self.enabled:
            return
        event = cupy.cuda.Event
        self._elapsed = cupy.cuda.get_elapsed_time
        self._events = {point: [event() for _ in range(calls)] for point in points + side_points}
        self._waits = [[(event(), event()) for _ in range(waits_per_call)] for _ in range(calls)]
        self._waited = [0] * calls

    def start_window(self) -> None:
        self.call = -1

    def next_call(self) -> None:
        self.call += 1
        if self.enabled:
            self._waited[self.call] = 0

    def stamp(self, point: str, stream=None) -> None:
        if self.enabled:
            self._events[point][self.call].record(stream)

    def wait(self, enqueue) -> None:
        """``enqueue()`` (a per-slot wait) between two stamps."""
        if not self.enabled:
            enqueue()
            return
        before, after = self._waits[self.call][self._waited[self.call]]
        before.record()
        enqueue()
        after.record()
        self._waited[self.call] += 1

    def read(self, times: dict) -> None:
        """Append this window's device times (ms) to ``times``' lists: ``period`` (a call's
        start to the next's), ``idle`` (the previous call's end to the start), ``wait`` (a
        call's per-slot waits), per point after ``begin`` the time from the point before it
        (the phase it ends), per side point the time from ``begin``. The warm-up call and
        the first timed one are left out: the device waited for the host to start them."""
        if not self.enabled:
            return
        elapsed, calls, events = self._elapsed, self.call + 1, self._events
        begin, end = events["begin"], events["end"]
        for i in range(2, calls):
            if i + 1 < calls:
                times["period"].append(elapsed(begin[i], begin[i + 1]))
            times["idle"].append(elapsed(end[i - 1], begin[i]))
            times["wait"].append(sum(elapsed(a, b) for a, b in self._waits[i][:self._waited[i]]))
            for before, point in zip(self.points, self.points[1:]):
                times[point].append(elapsed(events[before][i], events[point][i]))
            for point in self.side_points:
                times[point].append(elapsed(begin[i], events[point][i]))


def on_gpu(group, args) -> bool:
    return args.backend == "device" or (args.backend == "auto" and group.has_gpu)


def measure(group, target: float, dtype: str, sync_blocks: int | None, sync_stream: str, relay_threshold: int | None,
            args, progress):
    """The row of one initial imbalance, weight type, sync grid, sync stream and relay
    threshold (None: WeightTransfer's), and the Balancer's per-micro-batch records."""
    from ultraep.integration import Balancer
    from ultraep.planner import ExpertLayout
    from ultraep.analysis.traces import zipf_topk
    from ultraep.runtime.dtypes import cupy_dtype
    from ultraep.token import Dispatcher

    R, me, K, T, H = group.size, group.rank, args.top_k, args.tokens, args.hidden
    gpu = on_gpu(group, args)
    backend = "device" if gpu else "host"
    if gpu:
        import cupy as xp
        synchronize = xp.cuda.runtime.deviceSynchronize  # the weight sync's side stream too
        to_host, place = xp.asnumpy, (lambda w: xp.asarray(w.view(cupy_dtype(w.dtype))))
    else:
        xp, synchronize, to_host, place = np, (lambda: None), np.asarray, (lambda w: w)
    layout = ExpertLayout(R, args.experts, args.slots)
    M = layout.experts_per_rank
    spec = expert_spec(H, args.ffn, dtype)
    rng = np.random.default_rng((args.seed, me))
    ids = xp.asarray(zipf_topk(R, args.experts, K, T, target, args.seed)[me])
    x = xp.asarray(rng.standard_normal((T, H)).astype(np.float16))
    gates = xp.asarray(rng.random((T, K)).astype(np.float32))
    masters = [[place(w) for w in master_weights(spec, me * M + m, args.seed)] for m in range(M)]
    to_fp16 = fp16_weights(spec, xp)
    masters_fp16 = [to_fp16(weights) for weights in masters]  # the masters never change: converted once
    grads = [[xp.zeros(t.shape, np.float32) for t in spec.grads] for _ in range(M)]
    relays = None if relay_threshold is None else {"relay_threshold": relay_threshold, "relay_count": args.relay_count}
    with Balancer(group, layout, spec, num_layers=LAYERS, min_replica_tokens=args.min_replica_tokens,
                  backend=backend, sync_checks=False, cuda_graphs=not args.no_cuda_graphs,
                  transfer_options=relays) as balancer, \
            Dispatcher.for_layout(group, layout, hidden=H, dtype="float16", top_k=K, max_tokens=T, backend=backend,
                                  max_recv_rows=int(1.25 * T * K) + 1024, sync_checks=False) as dispatcher:
        for layer in range(LAYERS):
            balancer.register_layer(layer, masters, grads)
        profiler = cProfile.Profile() if args.host_profile and group.rank == 0 else None
        profiling = profiler.enable if profiler else (lambda: None)
        profiled = profiler.disable if profiler else (lambda: None)
        # the weight sync's own stream (None: the current one, the layer's)
        side = new_stream() if gpu and sync_stream == "side" else None
        compute = contextlib.nullcontext()  # the layers' stream: the current one, or one of the highest priority
        if gpu and args.compute_priority == "high":
            compute = new_stream(priority=HIGHEST_PRIORITY)
        state = {"calls": 0}
        host_ms = {part: [] for part in HOST_PARTS + ("call",)}  # per balanced layer: each call kind, all of it
        cupy = xp if gpu else None
        stamps = {"balanced": CallStamps(cupy, args.repeats + 1, ("begin", "planned", "routed") + LAYER_PHASES,
                                         args.slots, side_points=("synced",)),
                  "in_place": CallStamps(cupy, args.repeats + 1, ("begin",) + LAYER_PHASES, 0)}
        device_ms = {layer: {name: [] for name in ("period", "idle", "wait") + stamp.points[1:] + stamp.side_points}
                     for layer, stamp in stamps.items()}

        def experts(received, replicas, wait, stamp):
            """Masters first (their end stamped), then each replica slot once ``wait(slot)``
            lets its stream at it."""
            y = xp.zeros_like(received.x)
            for slot in range(M + args.slots):
                if slot == M:
                    stamp.stamp("masters")
                begin, end = offsets[slot], offsets[slot + 1]
                if end > begin:
                    if slot >= M:
                        wait(slot - M)
                    w_in, w_out = masters_fp16[slot] if slot < M else to_fp16(replicas[slot - M])
                    y[begin:end] = xp.maximum(received.x[begin:end] @ w_in, 0) @ w_out
            return y

        def moe_layer(stamp, wait, after_dispatch):
            """Dispatch, the experts on the replica slots ``after_dispatch()`` returns,
            combine: each phase's end stamped (``LAYER_PHASES``)."""
            received = dispatcher.dispatch(x, state["slots"], gates)
            replicas = after_dispatch()
            stamp.stamp("dispatched")
            y = experts(received, replicas, wait, stamp)
            stamp.stamp("computed")
            dispatcher.combine(y, received.handle)
            stamp.stamp("end")

        def balanced():
            started = time.perf_counter()
            stamp = stamps["balanced"]
            stamp.next_call()
            stamp.stamp("begin")
            layer = state["calls"] % LAYERS
            state["calls"] += 1
            spent = dict.fromkeys(HOST_PARTS, 0.0)

            def timed(part, call, *call_args):
                """``call(*call_args)``, its host time added to ``part``'s (and profiled)."""
                begin = time.perf_counter()
                profiling()
                result = call(*call_args)
                profiled()
                spent[part] += time.perf_counter() - begin
                return result

            planning, syncing = args.steps in ("all", "plan"), args.steps in ("all", "sync")
            update = partial(balancer.update, weight_sync=sync_stream == "update")
            handle = state["planned"] = timed("update", update, layer, ids) if planning else state["handle"]
            stamp.stamp("planned")
            syncs = []

            def start_sync():
                state["handle"] = handle
                syncs.append(timed("sync", partial(balancer.weight_sync, stream=side, blocks=sync_blocks), handle))
                stamp.stamp("synced", side)

            if syncing and args.sync_at == "plan":
                start_sync()
            if planning:
                state["slots"] = timed("reroute", balancer.reroute, handle)  # the update rerouted ids already
            stamp.stamp("routed")

            def after_dispatch():
                if not syncing:  # the replicas of the last sync: the routing is the same every call, so is the plan
                    stamp.stamp("synced", side)
                    return replicas_in_place
                if args.sync_at == "dispatch":
                    start_sync()
                return balancer.replica_weights(handle, wait=False)

            def wait(slot):
                if syncs:  # else nothing to wait for: the replicas of the last sync
                    timed("wait", stamp.wait, lambda: syncs[0].wait(slot))

            moe_layer(stamp, wait, after_dispatch)
            for part, seconds in spent.items():
                host_ms[part].append(1e3 * seconds)
            host_ms["call"].append(1e3 * (time.perf_counter() - started))

        def in_place():
            stamp = stamps["in_place"]
            stamp.next_call()
            stamp.stamp("begin")
            moe_layer(stamp, lambda slot: None, lambda: replicas_in_place)

        def window(layer: str, call) -> float:
            stamps[layer].start_window()

            def on_compute_stream():
                with compute:
                    call()

            # synchronised: the stamps are in
            window_ms = group_window_ms(group, on_compute_stream, args.repeats, synchronize)
            stamps[layer].read(device_ms[layer])
            return window_ms

        grid = "the engine's grid" if sync_blocks is None else f"{sync_blocks} blocks"
        progress(f"initial imbalance {target}, {dtype} weights, weight sync on {grid} {SYNC_STREAMS[sync_stream]}: "
                 "layers registered, timing "
                 "the balanced MoE layer "
                 f"and the same layer with its plan in place ({args.rounds} x {args.repeats} calls each)")
        handle = state["handle"] = balancer.update(0, ids)
        balancer.weight_sync(handle).wait()
        replicas_in_place = balancer.replica_weights(handle)
        state["slots"] = balancer.reroute(handle)
        state["calls"] = 1
        offsets = [int(v) for v in (dispatcher.dispatch(x, state["slots"], gates).offsets.tolist())]
        windows = {"balanced": [], "in_place": []}
        for _ in range(args.rounds):
            windows["balanced"].append(window("balanced", balanced))
            windows["in_place"].append(window("in_place", in_place))
        if args.steps == "plan":  # the check below reads the replicas of a live plan
            state["handle"] = state["planned"]
            balancer.weight_sync(state["handle"]).wait()
        synchronize()
        diff = sum(group.allgather(replica_diff(balancer, state["handle"], spec, M, args.seed, to_host)))
        dispatcher.check()
        balancer.check()
        stats = balancer.stats()
        summary = stats.summary()
    if profiler is not None:
        relayed = "" if relay_threshold is None else f"_relay{relay_threshold}x{args.relay_count}"
        write_host_profile(profiler, args.host_profile, f"{WEIGHT_DTYPES[dtype]}_imbalance{target:g}_sync"
                                                        f"{sync_blocks or 'all'}_{sync_stream}{relayed}")
    layer_ms, balanced_ms = (statistics.median(windows[k]) for k in ("in_place", "balanced"))
    exposed_ms = statistics.median(b - p for b, p in zip(windows["balanced"], windows["in_place"]))
    row = {"weights": WEIGHT_DTYPES[dtype], "weight_dtype": dtype, "steps": args.steps,
           "compute_priority": args.compute_priority, "sync_at": args.sync_at, "sync_stream": sync_stream,
           "sync_blocks": sync_blocks or "all",
           "relays": "default" if relay_threshold is None else f">{relay_threshold}: {args.relay_count}",
           "imbalance": float(stats.records[-1].imbalance_before), "imb_after": summary["imbalance_after_max"],
           "replicas_mean": summary["replicas_mean"], "exposed_ms": exposed_ms, "layer_ms": layer_ms,
           "balanced_ms": balanced_ms, "share_pct": 100.0 * exposed_ms / layer_ms,
           **device_breakdown(group, device_ms),
           **{f"{part}_host_ms": statistics.median(host_ms[part]) for part in HOST_PARTS},
           "bal_host_ms": statistics.median(map(sum, zip(*(host_ms[part] for part in HOST_PARTS)))),
           "blocked_host_ms": stats.host_wait_ms / stats.updates, "call_host_ms": statistics.median(host_ms["call"]),
           **slowest_stages(group, summary),
           "sync_MB": one_sync_mb(stats.records), "replica_diff": diff}
    if args.steps == "plan":
        row["synced_dev_ms"] = None  # no sync was stamped
    if sync_stream == "update":
        row["weight_sync_dev_ms"] = None  # the update's clock times its syncs (the setup's sync alone has its own)
    return row, stats.records


def one_sync_mb(records) -> float | None:
    """What one sync of a synced plan moves, group total, MB (mean over the plans). A record
    sums its plan's syncs: ``--steps sync`` syncs one plan every call."""
    synced = [r.weight_bytes / r.weight_syncs for r in records if r.weight_syncs]
    return statistics.mean(synced) / 1e6 if synced else None


def slowest_stages(group, summary: dict) -> dict:
    """``<stage>_dev_ms`` of :data:`BALANCER_STAGES`: the slowest rank's median (None where
    no rank timed the stage)."""
    gathered = group.allgather([summary.get(f"{stage}_ms_median") for stage in BALANCER_STAGES])
    return {f"{stage}_dev_ms": max((rank[i] for rank in gathered if rank[i] is not None), default=None)
            for i, stage in enumerate(BALANCER_STAGES)}


def write_host_profile(profiler, directory: str, label: str) -> None:
    """``label.pstats`` and ``label.txt`` (the top 40 functions by own time) in ``directory``."""
    import pstats
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(out / f"{label}.pstats")
    with open(out / f"{label}.txt", "w") as text:
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)


def device_breakdown(group, device_ms: dict) -> dict:
    """The stamps' columns (None on the CPU): ``exposed_dev_ms`` from the median periods
    and ``d_*_dev_ms``, each layer phase's median balanced minus in place, the ranks' mean
    (they keep one pace); the balanced layer's parts, each rank's median, the largest
    rank's (the group waits for it at dispatch)."""
    balanced, in_place = device_ms["balanced"], device_ms["in_place"]
    if not (balanced["period"] and in_place["period"]):
        group.allgather(None)
        return dict.fromkeys(DEVICE_COLUMNS)
    median = statistics.median
    deltas = [median(balanced["period"]) - median(in_place["period"])]
    deltas += [median(balanced[phase]) - median(in_place[phase]) for phase in LAYER_PHASES]
    lead = [planned + routed for planned, routed in zip(balanced["planned"], balanced["routed"])]
    parts = [median(balanced["planned"]), median(lead), median(balanced["wait"]), median(balanced["idle"]),
             median(balanced["synced"])]
    gathered = group.allgather((deltas, parts))
    if any(rank is None for rank in gathered):
        return dict.fromkeys(DEVICE_COLUMNS)
    delta_names = ("exposed_dev_ms",) + tuple(f"d_{phase}_dev_ms" for phase in PHASE_NAMES)
    part_names = ("update_lead_dev_ms", "lead_dev_ms", "wait_dev_ms", "idle_dev_ms", "synced_dev_ms")
    return {**{name: statistics.mean(rank[0][i] for rank in gathered) for i, name in enumerate(delta_names)},
            **{name: max(rank[1][i] for rank in gathered) for i, name in enumerate(part_names)}}


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.bench.report import Progress, RowStream, host_size_note, write_json
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label

    group = EPGroup(MPI.COMM_WORLD, use_gpu=args.backend != "host")
    sharing = sharing_label(group)
    args.sync_stream = resolved_sync_streams(group, args.sync_stream, update_may_start(args))
    printing = group.rank == 0
    progress = Progress("balancer", enabled=printing, quiet=args.quiet)
    host_size_note(progress, not on_gpu(group, args), args.tokens)
    launches = (f"Balancer launches {'eager' if args.no_cuda_graphs else 'in CUDA graphs'}" if on_gpu(group, args)
                else "Balancer on the host")
    title = (f"balancer exposed cost per MoE layer: {group.size} ranks ({sharing}), {args.experts} experts, "
             f"{args.slots} slots/rank, top-{args.top_k}, {args.tokens} tokens/rank, hidden {args.hidden}, "
             f"ffn {args.ffn}, fp16 tokens and compute, expert weights as listed, {launches}; exposed = balanced "
             f"layer (update, weight_sync {' or '.join(SYNC_STREAMS[s] for s in args.sync_stream)}, reroute, "
             "per-slot waits) - the same layer with its plan and replicas in place, group windows"
             + ("" if args.steps == "all" else f"; balanced layer's steps: {args.steps} alone"))
    rows = []
    dtypes = sorted(set(args.weight_dtype), key=list(WEIGHT_DTYPES).index)  # bf16 first: the ratios' base
    # the host's table leaves out GPU_ONLY_COLUMNS (the JSON keeps them)
    columns = COLUMNS if on_gpu(group, args) else [column for column in COLUMNS if column not in GPU_ONLY_COLUMNS]
    with RowStream(columns, title, enabled=printing) as table:
        for target in args.initial_imbalance:
            for sync_blocks, sync_stream, relay_threshold in itertools.product(args.sync_blocks, args.sync_stream,
                                                                                args.relay_threshold):
                bf16_sync_ms = None
                for dtype in dtypes:
                    row, records = measure(group, target, dtype, sync_blocks, sync_stream, relay_threshold, args,
                                           progress)
                    sync_ms = row["weight_sync_dev_ms"]
                    if dtype == "bfloat16":
                        bf16_sync_ms = sync_ms
                    row["sync_vs_bf16"] = sync_ms / bf16_sync_ms if sync_ms is not None and bf16_sync_ms else None
                    rows.append(row)
                    table.add(row)
    if printing:
        for row in rows:
            if not row["replicas_mean"]:
                print(f"{row['weights']}, imbalance {row['imbalance']:.3f}: no replica was made (none could serve "
                      f"--min-replica-tokens {args.min_replica_tokens} tokens): the balanced layer ran unbalanced, "
                      "exposed_ms is the Balancer's calls alone")
        if args.plot:
            from ultraep.analysis.plots import plot_rank_loads

            plot_rank_loads(records, args.plot, title=f"balancer bench, initial imbalance {args.initial_imbalance[-1]}")
            print(f"wrote {args.plot}")
        if args.json:
            write_json(args.json, {"benchmark": "balancer", "ranks": group.size, "sharing": sharing, "args": vars(args),
                                   "rows": rows})
    differing = [row["weights"] for row in rows if row["replica_diff"]]
    if differing and printing:
        print(f"balancer bench: replicas differ from their masters after weight sync ({', '.join(differing)} rows)",
              file=sys.stderr)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
