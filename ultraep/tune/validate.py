"""``python -m ultraep.tune validate --phase PHASE``: the model's predictions against
measurements, over a sweep of the phase's knob.

* ``weight-sync``: one expert (``--hidden``, ``--ffn``, bf16, as ``bench weight-sync``) of
  rank 0 replicated to ``fan-out`` other ranks, over ``--configs`` grids (``blocks=``) from
  one to the engine's resident bound. On the GPU rank 0 times the sync's kernel alone as
  CUDA-graph replays (the schedule compiled before; as ``bench weight-sync``), what
  :func:`~ultraep.tune.model.weight_sync_s` models; on the host every rank times the whole
  collective call. Then the model's choice and the fastest measured grids are timed again
  together, per fan-out, as dispatch's are (below).
* ``dispatch``: ``Dispatcher.dispatch``, ``combine``, and the combine from
  ``expert_output`` (``pull``) of ``--tokens`` random top-k tokens per rank, over
  ``--configs`` values of ``Dispatcher(grid=)`` from one block to the resident bound
  (``Dispatcher.max_grid``), a Dispatcher per grid, timed as the group's window per call
  (``bench dispatch``). Then each operation's model choice and its fastest measured grids
  are timed again together, ``--retime-rounds`` rounds (:func:`retime_grids`), and the
  summary also sets the choice against the fastest of those. The host backend has no copy
  kernels: its sweep measures one configuration many times.
* ``fused-forward``: ``MoELayer(fused=True, fused_config=)`` over ``--configs``
  configurations (:class:`~ultraep.compute.fused.config.FusedConfig`: CTAs from one to every SM, for a few send
  and reduce task sizes, with today's constants and the search's choice among them; with
  ``--send-shares`` once per share of the CTAs sending first), a
  layer per configuration, ``--tokens`` random top-k tokens per rank over ``--experts``.
  From the layer's timeline (``%globaltimer``: one clock for ranks on one GPU; the median
  of ``--repeats`` forwards) the group's windows: kernel A (dispatch + up: first task's
  start on any rank to its last task's end on any rank), kernel B (down + combine), and
  the forward (kernel A's first start to kernel B's last end), against
  :func:`~ultraep.tune.model.fused_windows` of every rank's own routing -- kernel B's window
  opens at the first rank's end of A and its reduces wait for every rank's down tiles, so
  it holds the spread of the ranks' kernel A; the forward's rank of the model's choice is
  the tuned layer's. Each row also keeps every rank's own span (``rank_ms`` in the JSON)
  and, of kernel A, every rank's CTAs at work in the first half of its span
  (``rank_ctas_a``: distinct SMs its tasks started on; fewer than the grid means CTAs that
  found no SM free until late, as under MPS shares that overlap).
  The windows leave out each kernel's launch and table load before its first task, which
  the model charges (``kernel_s``). On the GPU each timed forward is enqueued behind a
  kernel that holds the stream (:data:`HOLD_NS`), so its kernels start as the device
  reaches them, as in a layer whose host runs ahead, and not when each rank's host gets
  to their launches: else the ranks' hosts, a few hundred microseconds apart after the
  barrier, start kernel A that far apart and every window holds that spread.

``--replay FILE.json`` (no GPU, no ranks): a fused-forward, dispatch or weight-sync sweep's
``--json`` predicted again by today's model from the profile and the problems the file keeps
(profile versions :data:`~ultraep.tune.profile.STORED_VERSIONS`; a dispatch sweep written
before it kept them: its routing drawn again from its command line's seed; a weight-sync
sweep: its expert and fan-outs from its command line), against the measurements it holds:
the same table and summary, for a model changed since the run.

For each problem (fan-out, or token count and op) the table lists every configuration's
predicted and measured time; the summary gives the mean absolute error, the share of
configurations within 5 % and the worst case, overall and per problem, and where the
model's choice (its fastest predicted configuration) ranks among the measured ones, with
its measured time over the best measured and against today's constant (the weight sync's
default grid, the Dispatcher's default grid, the fused kernels' every SM and source task
sizes). ``--plot`` draws predicted against measured; ``--json`` writes every row. Started
without ``mpiexec`` it relaunches itself on ``--ranks`` ranks (``--emulate-ep``: under MPS,
each rank a share of the SMs).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ultraep.runtime.launch import (DefaultsHelpFormatter, add_launch_options, job_ranks, multi_rank_main,
                                   non_negative_int, output_errors, positive_int, share)

PHASES = ("weight-sync", "dispatch", "fused-forward")
COLUMNS = ["problem", "config", "predicted_ms", "measured_ms", "error_pct"]
HOST_MODEL_BLOCKS_PER_CORE = 2  # the grid the model is given for the host backend, which has no copy kernels
RANK0_SWEEP_TIMEOUT_S = 600.0  # the other ranks wait while rank 0 times a whole weight-sync sweep alone
HOLD_NS = 10**7  # a timed fused forward waits behind a hold this long (doubled while the host needs longer)
MAX_HOLD_NS = 10**9  # a host that cannot enqueue one forward within a hold this long is stuck


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.tune validate", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_launch_options(parser, backend_help="device: the GPU; host: NumPy on the CPU (a smoke test of the sweep); "
                                            "auto: the GPU when there is one")
    parser.add_argument("--phase", choices=PHASES, help="what to sweep (required unless --replay)")
    parser.add_argument("--replay", metavar="FILE.json",
                        help="no sweep: predict a fused-forward, dispatch or weight-sync sweep's --json again "
                             "with today's model")
    parser.add_argument("--configs", type=positive_int, default=50, help="configurations per problem (and share)")
    parser.add_argument("--send-shares", type=share, nargs="+", default=None, metavar="SHARE",
                        help="fused-forward: each CTA count's share that sends first (FusedConfig.send_ctas; 0: "
                             "none, the others send while their next tile's rows are not there), the sweep once per "
                             "share (default: the source's SEND_SHARE)")
    parser.add_argument("--fanouts", type=positive_int, nargs="+", default=None,
                        help="weight-sync: replicas of the synced expert, one problem each (default: ranks - 1)")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[4096],
                        help="dispatch, fused-forward: tokens per rank, one problem each")
    parser.add_argument("--hidden", type=positive_int, default=4096, help="model width")
    parser.add_argument("--ffn", type=positive_int, default=1536, help="expert FFN width")
    parser.add_argument("--top-k", type=positive_int, default=8, help="dispatch, fused-forward: experts per token")
    parser.add_argument("--experts", type=positive_int, default=64,
                        help="dispatch, fused-forward: experts in all (divisible by the ranks)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per measurement")
    parser.add_argument("--retime-rounds", type=int, default=5, metavar="ROUNDS",
                        help="dispatch, weight-sync: rounds that time each operation's model choice and its fastest "
                             "measured grids again together (the median of each; 0: none)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the routing and the weights")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="write predicted against measured as a scatter plot")
    parser.add_argument("--json", metavar="FILE",
                        help="also write every row and the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.phase is None and args.replay is None:
        parser.error("give --phase PHASE to sweep, or --replay FILE.json to predict a saved sweep again")
    if args.phase is not None and args.replay is not None:
        parser.error("--replay predicts a saved sweep again, whose phase its file names: give --phase or --replay")
    if args.retime_rounds < 0:
        parser.error(f"--retime-rounds must be 0 (none) or more, got {args.retime_rounds}")
    if args.replay is None and (error := sweep_error(args, job_ranks(args))) is not None:
        parser.error(error)  # before the launch, not on every rank after a profile's measurement
    return args


def sweep_error(args, ranks: int) -> str | None:
    """Why ``args.phase``'s sweep cannot run on ``ranks`` ranks, or None."""
    if args.phase == "weight-sync":
        if ranks < 2:
            return "--phase weight-sync needs at least 2 ranks (a master and a replica)"
        if args.fanouts and max(args.fanouts) > ranks - 1:
            return f"--fanouts: at most {ranks - 1} replicas on {ranks} ranks"
    elif args.experts % ranks:
        return f"--experts {args.experts} does not divide over {ranks} ranks"
    elif args.top_k > args.experts:
        return f"--top-k {args.top_k} exceeds --experts {args.experts}"
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replay is not None:
        if errors := output_errors(args):  # its --json and --plot, before the replay (which needs no GPU)
            print("\n".join(f"ultraep.tune validate: {error}" for error in errors), file=sys.stderr)
            return 2
        try:
            return replay(args)
        except SystemExit as exc:  # a file it cannot replay: said as the other refusals are, exit 2
            if not isinstance(exc.code, str):
                raise
            print(f"ultraep.tune validate: {exc.code}", file=sys.stderr)
            return 2
    return multi_rank_main(argv, parse_args, run, nprocs=lambda a: a.ranks, command=["-m", "ultraep.tune", "validate"])


def spread(low: int, high: int, count: int) -> list[int]:
    """Up to ``count`` distinct integers evenly from ``low`` to ``high`` (both included)."""
    return [int(v) for v in np.unique(np.linspace(low, max(low, high), count).round().astype(np.int64))]


def sharers(group) -> int:
    """Ranks whose kernels share one GPU's memory (all of them under the MPS emulation); on
    the host backend the host's ranks (collective)."""
    from ultraep.runtime.group import ranks_per_gpu

    return ranks_per_gpu(group) or group.local_size


# -- weight sync -----------------------------------------------------------------------------

def weight_sync_problems(args, ranks: int) -> tuple:
    """The weight-sync sweep's expert (``ExpertSpec``), layout, and per fan-out its label,
    single-expert plan and :class:`~ultraep.tune.model.SyncProblem`: what the sweep times and
    what ``--replay`` predicts again. SystemExit for a sweep that cannot be run."""
    from ultraep.tune.model import SyncProblem
    from ultraep.tune.sync_timing import one_expert, single_expert_plan

    if (error := sweep_error(args, ranks)) is not None:  # a stored sweep's command line, replayed
        raise SystemExit(error)
    fanouts = args.fanouts or [ranks - 1]
    spec, layout = one_expert(args.hidden, args.ffn, ranks)
    problems = []
    for fanout in fanouts:
        plan = single_expert_plan(layout, fanout)
        sync = SyncProblem.from_replica_count(plan.replica_count, layout.experts_per_rank, spec.weight_slot_bytes)
        size = spec.weight_slot_bytes
        problems.append((f"fan-out {fanout}, " + (f"{size / 1e6:.1f} MB" if size >= 50_000 else f"{size / 1e3:.1f} kB"),
                         plan, sync))
    return spec, layout, problems


def sweep_weight_sync(group, backend, xp, synchronize, profile, args, progress) -> tuple[list[dict], dict]:
    import dataclasses

    from ultraep.tune.model import SYNC_MIN_BLOCKS, weight_sync_s
    from ultraep.tune.sync_timing import SyncTimer

    spec, layout, problems = weight_sync_problems(args, group.size)
    rows = []
    with SyncTimer(group, backend, xp, synchronize, spec, layout, args.seed) as timer:
        bound = timer.max_blocks(SYNC_MIN_BLOCKS * profile.sm_count)
        grids = spread(1, bound, args.configs)
        for problem, plan, sync in problems:
            timer.prepare(plan)  # every rank takes part
            predicted = weight_sync_s(profile, sync, np.asarray(grids))
            failed = []  # the grids whose sync could not be captured in a CUDA graph

            def time_sync(blocks, plan=plan, failed=failed):
                ms = None if failed else timer.ms(plan, blocks, args.repeats)
                if ms is None and not failed:
                    failed.append(blocks)
                return ms

            def time_grids(order, what, problem=problem, time_sync=time_sync):
                """{"sync": ms at each grid of ``order``}."""
                times = []
                for i, blocks in enumerate(order):
                    progress(f"weight sync, {problem}: {what} grid {blocks} ({i + 1}/{len(order)})")
                    times.append(time_sync(blocks))
                return {"sync": times}

            group.barrier(what="weight-sync sweep: every replica checked before rank 0 times alone")
            measured = time_grids(grids, "sweeping")["sync"] if timer.timing else []
            retimed = (retime_grids(grids, {"sync": predicted}, {"sync": measured}, time_grids, args.retime_rounds)
                       if timer.timing and not failed and args.retime_rounds and len(set(grids)) > 1 else {})
            error = f"the weight sync of grid {failed[0]} could not be captured in a CUDA graph" if failed else None
            group.raise_if_any(error, f"weight-sync sweep: rank 0 timing {len(grids)} grids",
                               timeout_s=RANK0_SWEEP_TIMEOUT_S)
            if group.rank == 0:
                rows += [{"phase": "weight-sync", "problem": problem, "config": f"blocks={blocks}", "knob": blocks,
                          "default": backend == "device" and blocks == bound, "predicted_ms": float(p) * 1e3,
                          "measured_ms": m,
                          **({"retimed_ms": retimed["sync"][blocks]} if blocks in retimed.get("sync", {}) else {})}
                         for blocks, p, m in zip(grids, predicted, measured)]
    return rows, {problem: dataclasses.asdict(sync) for problem, _, sync in problems}


# -- dispatch and combine --------------------------------------------------------------------

def routing_rng(seed: int, rank: int):
    """The generator of a rank's tokens in the dispatch and fused-forward sweeps (and of a
    replay drawing them again)."""
    return np.random.default_rng(seed * 1000 + rank)


def random_ids(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """Distinct uniformly random experts per token: :func:`random_tokens`' first draw."""
    return np.argsort(rng.random((tokens, experts), dtype=np.float32), axis=1)[:, :top_k].astype(np.int32)


def random_tokens(rng, tokens: int, hidden: int, experts: int, top_k: int):
    """The bits of bf16 tokens in [0.5, 2) (uint16), distinct uniformly random experts per
    token, and gates (NumPy)."""
    ids = random_ids(rng, tokens, experts, top_k)
    bits = rng.integers(0x3F00, 0x4000, size=(tokens, hidden), dtype=np.int32).astype(np.uint16)
    return bits, ids, rng.random((tokens, top_k), dtype=np.float32)


def busiest_problem(problems: list):
    """The group's busiest rank of every rank's :class:`~ultraep.tune.model.Problem`: the
    slots of the rank receiving the most rows (the group's window waits for it), the most
    sends per token of any rank."""
    import dataclasses

    most_rows = max(problems, key=lambda p: (int(p.rows.sum()), tuple(int(r) for r in p.rows)))
    return dataclasses.replace(most_rows, sends_per_token=max(p.crossings for p in problems))


def routed_problem(group, backend, xp, args, tokens: int, sharing: int):
    """``tokens`` random top-k tokens of this rank (``x`` BF16, ``ids``, ``gates`` on the
    backend), the Dispatcher's set-up for them, its default grid and resident bound, and the
    model's :class:`~ultraep.tune.model.Problem` of every rank under that routing (its
    slots' rows and its sends per token, from one dispatch), the group's busiest rank's
    (:func:`busiest_problem`) first."""
    from ultraep.runtime.dtypes import BFLOAT16
    from ultraep.token import Dispatcher
    from ultraep.tune.model import Problem

    R = group.size
    rng = routing_rng(args.seed, group.rank)
    bits, ids, gates = (xp.asarray(a) for a in random_tokens(rng, tokens, args.hidden, args.experts, args.top_k))
    data = (bits.view(BFLOAT16), ids, gates)
    set_up = dict(hidden=args.hidden, dtype="bfloat16", top_k=args.top_k, num_experts=args.experts,
                  max_tokens=tokens, backend=backend, sync_checks=False,
                  max_recv_rows=int(tokens * args.top_k * 1.15) + 1024)  # uniform routing: ~tokens * top_k a rank
    with Dispatcher(group, **set_up) as disp:  # today's grid, and the routing's loads for the model
        default, bound = disp.grid, disp.max_grid
        result = disp.dispatch(*data)
        disp.check()
        counts = np.asarray(result.counts.get() if hasattr(result.counts, "get") else result.counts, np.int64)
        sent = disp.traffic(result.handle)
    loads = group.allgather((tuple(int(c) for c in counts), sent.sends / tokens))
    problems = [Problem(tokens, args.hidden, args.ffn, args.top_k, args.experts, R, ranks_per_gpu=sharing,
                        slot_rows=rows, sends_per_token=sends) for rows, sends in loads]
    return data, set_up, default, bound, [busiest_problem(problems)] + problems


DISPATCH_OPERATIONS = ("dispatch", "combine", "pull")  # what --phase dispatch times


def dispatch_predicted_ms(profile, problem, operation: str, grids: list) -> np.ndarray:
    """The model's milliseconds of one of :data:`DISPATCH_OPERATIONS` at each of ``grids``
    (None: the host backend's configuration, which has no copy kernels: the model is given
    :data:`HOST_MODEL_BLOCKS_PER_CORE` blocks a core)."""
    from ultraep.tune import model

    knobs = np.asarray([HOST_MODEL_BLOCKS_PER_CORE * profile.sm_count if grid is None else grid for grid in grids])
    return 1e3 * {"dispatch": model.dispatch_s, "combine": model.combine_s,
                  "pull": model.pull_s}[operation](profile, problem, knobs)


def sweep_dispatch(group, backend, xp, synchronize, profile, args, progress) -> tuple[list[dict], dict]:
    """Each grid's Dispatcher: its dispatch, combine and pull timed as the group's window,
    against :func:`dispatch_predicted_ms` of the busiest rank's problem; every row keeps its
    ``shape`` and ``operation``, under which the second value returned keeps every rank's
    :class:`~ultraep.tune.model.Problem` (what ``--replay`` predicts from)."""
    import dataclasses

    from ultraep.bench.timing import group_window_ms
    from ultraep.token import Dispatcher

    sharing = sharers(group)
    rows, problems = [], {}
    for tokens in args.tokens:
        (x, ids, gates), set_up, default, bound, (problem, *rank_problems) = routed_problem(
            group, backend, xp, args, tokens, sharing)
        # every grid the GPU holds resident (the Dispatcher refuses more); on the host, which
        # has no copy kernels, one configuration (the Dispatcher's None) measured again and again
        grids = (sorted(set(spread(1, bound, args.configs - 1)) | {default}) if bound is not None
                 else [None] * args.configs)
        label = f"{tokens} tokens/rank, hidden {args.hidden}"
        problems[label] = [dataclasses.asdict(p) for p in rank_problems]
        # Each Dispatcher's heap views (its handles, expert_output) live in the function that
        # times it and die before the heap closes: a view alive at close keeps the heap for good.
        def send_and_combine(disp, into: dict):
            recv = xp.empty((disp.max_recv_rows, args.hidden), dtype=x.dtype)
            combined = xp.empty((tokens, args.hidden), dtype=x.dtype)
            result = disp.dispatch(x, ids, gates, out=recv)
            into["dispatch"].append(group_window_ms(group, lambda: disp.dispatch(x, ids, gates, out=recv),
                                                    args.repeats, synchronize))
            into["combine"].append(group_window_ms(
                group, lambda: disp.combine(recv, result.handle, out=combined), args.repeats, synchronize))
            disp.check()

        def pull(disp, into: dict):
            expert_out = disp.expert_output()  # the received rows stand in for the experts' outputs
            combined = xp.empty((tokens, args.hidden), dtype=x.dtype)
            result = disp.dispatch(x, ids, gates, out=expert_out)
            into["pull"].append(group_window_ms(
                group, lambda: disp.combine(expert_out, result.handle, out=combined), args.repeats, synchronize))
            disp.check()

        def time_grids(chosen: list, what: str) -> dict:
            """Every operation's ms at each grid of ``chosen``, in that order."""
            times = {operation: [] for operation in DISPATCH_OPERATIONS}
            for i, grid in enumerate(chosen):
                progress(f"dispatch, {label}: {what} grid {grid} ({i + 1}/{len(chosen)})")
                with Dispatcher(group, **set_up, grid=grid) as disp:
                    send_and_combine(disp, times)
                with Dispatcher(group, **set_up, grid=grid, expert_output=True) as disp:
                    pull(disp, times)
            return times

        measured = time_grids(grids, "sweeping")
        predicted = {op: dispatch_predicted_ms(profile, problem, op, grids) for op in DISPATCH_OPERATIONS}
        retimed = (retime_grids(grids, predicted, measured, time_grids, args.retime_rounds)
                   if bound is not None and args.retime_rounds else {})
        for op in DISPATCH_OPERATIONS:
            rows += [{"phase": "dispatch", "problem": f"{op}, {label}", "shape": label, "operation": op,
                      "config": f"grid={grid}", "knob": grid, "default": grid is not None and grid == default,
                      "predicted_ms": float(p), "measured_ms": m,
                      **({"retimed_ms": retimed[op][grid]} if grid in retimed.get(op, {}) else {})}
                     for grid, p, m in zip(grids, predicted[op], measured[op])]
    return rows, problems


RETIME_FASTEST = 3  # the sweep's fastest grids of an operation timed again beside the model's choice


def retime_grids(grids: list, predicted: dict, measured: dict, time_grids, rounds: int) -> dict:
    """Each operation's model choice and its RETIME_FASTEST fastest measured grids timed
    again in ``rounds`` rounds, each round over all of them (in turn reversed, so that none
    always runs first), the median per grid: the fastest of the sweep's single
    measurements is the luckiest of them, lower than a grid's time by about twice its noise,
    and a choice measured against it misses by that much where the curve is flat.
    {operation: {grid: ms}}."""
    operations = list(predicted)
    wanted = {}
    for op in operations:
        fastest = sorted(range(len(grids)), key=lambda i: measured[op][i])[:RETIME_FASTEST]
        wanted[op] = {grids[i] for i in fastest} | {grids[int(np.argmin(predicted[op]))]}
    chosen = sorted(set().union(*wanted.values()))
    samples = {op: {grid: [] for grid in chosen} for op in operations}
    for round_ in range(rounds):
        order = chosen if round_ % 2 == 0 else chosen[::-1]
        times = time_grids(order, f"re-timing (round {round_ + 1}/{rounds})")
        for op in operations:
            for grid, ms in zip(order, times[op]):
                samples[op][grid].append(ms)
    return {op: {grid: float(np.median(samples[op][grid])) for grid in wanted[op]} for op in operations}


# -- the fused forward -----------------------------------------------------------------------

FUSED_TASK_TOKENS = (16, 4, 32, 64)  # send = reduce task sizes swept (16: the source's); a module variant each
FUSED_KNOBS = ("ctas", "send_tokens", "reduce_tokens", "send_ctas")  # fused_windows' arguments, in order


def fused_configs(profile, problem, count: int, send_shares=None) -> list:
    """About ``count`` configurations of the fused kernels per share of ``send_shares``
    (default the source's :data:`~ultraep.compute.fused.config.SEND_SHARE` alone; a few more
    where the CTA counts do not divide evenly): CTA counts from one to every usable SM for
    each of the first ``count - 1`` of :data:`FUSED_TASK_TOKENS`, that share of them sending
    first, with today's constants (every SM, the source's sizes) and the search's choice for
    ``problem`` among them."""
    from ultraep.compute.fused.config import SEND_SHARE, FusedConfig, share_of_ctas
    from ultraep.tune.search import search

    sizes = FUSED_TASK_TOKENS[:max(1, count - 1)]
    ctas = spread(1, profile.usable_sms, -(-max(1, count - 1) // len(sizes)))
    shares = send_shares or [SEND_SHARE]
    configs = [FusedConfig(c, size, size, send_ctas=int(share_of_ctas(c, share)))
               for share in shares for size in sizes for c in ctas]
    # spread() of one count is the lowest CTA count alone: the constants are added apart
    configs += [FusedConfig(profile.usable_sms, send_ctas=int(share_of_ctas(profile.usable_sms, share)))
                for share in shares]
    configs.append(search(profile, problem).config.fused)
    return list(dict.fromkeys(configs))


FUSED_WINDOWS = (("kernel A (dispatch + up)", "up"), ("kernel B (down + combine)", "down"),
                 ("forward (A then B)", "forward"))  # a row's name and fused_windows' window


class StreamHold:
    """The GPU's current stream held for :attr:`hold_ns` by ``timing.cu``'s ``hold_stream``
    while the host enqueues a call behind it (:meth:`start`); :meth:`ended_early` then says
    whether the hold ended before the host was done, so that the call's first kernels
    waited for their launches after all."""

    def __init__(self, cp):
        from ultraep.runtime.kernels import get_function

        self.hold_ns = HOLD_NS
        self.kernel = get_function("timing.cu", "hold_stream")
        self.held = cp.cuda.Event()

    def start(self) -> None:
        self.kernel((1,), (1,), (np.uint64(self.hold_ns),))
        self.held.record()

    def ended_early(self) -> bool:
        return self.held.done


def kernel_spans_ns(moe, x, ids, gates, hold: StreamHold | None) -> list[int]:
    """One recorded fused forward of this rank, enqueued behind ``hold`` where there is one:
    the first task's start and the last task's end of kernel A, then of kernel B (ns, one
    clock for ranks on one GPU or host), the CTAs (distinct SMs, or host workers) that
    started a task of kernel A in its first half, those of kernel B in its first half, and
    1 if the hold ended before the forward was enqueued (else 0)."""
    from ultraep.compute.fused.forward import KERNEL_A, KERNEL_B

    if hold is not None:
        hold.start()
    moe.forward(x, ids, gates)
    late = int(hold is not None and hold.ended_early())
    tasks = moe.timeline()  # waits for the device
    spans, at_work = [], []
    for kinds in (KERNEL_A, KERNEL_B):
        mine = [(start, end, where) for kind, start, end, where in tasks if kind in kinds]
        first, last = (min(s for s, _, _ in mine), max(e for _, e, _ in mine)) if mine else (0, 0)
        spans += [first, last]
        at_work.append(len({where for start, _, where in mine if start < (first + last) / 2}))
    return spans + at_work + [late]


def timed_forwards(group, moe, x, ids, gates, hold: StreamHold | None, repeats: int) -> np.ndarray:
    """``repeats`` recorded forwards of every rank ([repeat, rank, kernel_spans_ns's values
    but the last]), a barrier before each; a forward that some rank's host enqueued after its
    hold ended does not count, and the hold doubles (collectively: every rank sees every
    rank's)."""
    forwards = []
    while len(forwards) < repeats:
        group.barrier(what="tune validate: fused forward")
        spans = np.asarray(group.allgather(kernel_spans_ns(moe, x, ids, gates, hold)), np.int64)
        if not spans[:, -1].any():
            forwards.append(spans[:, :-1])
            continue
        hold.hold_ns *= 2
        if hold.hold_ns > MAX_HOLD_NS:
            raise RuntimeError(f"tune validate: a rank's host took over {MAX_HOLD_NS / 1e9:.0f} s to enqueue one "
                               "fused forward (the hold before it had ended)")
    return np.asarray(forwards)


def sweep_fused(group, backend, xp, synchronize, profile, args, progress) -> tuple[list[dict], dict]:
    """Each configuration's fused layer (``MoELayer(fused=True, fused_config=)``): from its
    tasks' timeline, the group's window of kernel A (first task's start on any rank to its
    last task's end on any rank), of kernel B, and of the forward (kernel A's first start to
    kernel B's last end), the median of ``--repeats`` recorded forwards (each behind a
    :class:`StreamHold` on the GPU), against :func:`~ultraep.tune.model.fused_windows` of
    every rank's routing. Each row also keeps every rank's own span of the kernel
    (``rank_ms``, the medians): who was slowest; every rank's CTAs at work in kernel A's
    first half (``rank_ctas_a``, the medians), the fewest of any rank in a forward
    (``fewest_ctas_a``, the median forward's) against the profile's CTAs at work
    (``profile_ctas_a``, :meth:`~ultraep.tune.profile.FusedCosts.working_ctas`), the same of
    kernel B (``rank_ctas_b``, ``fewest_ctas_b``, ``profile_ctas_b``:
    :meth:`~ultraep.tune.profile.FusedCosts.working_down_ctas`); and its problem's
    ``shape``, under which the second value returned keeps every rank's
    :class:`~ultraep.tune.model.Problem` (what ``--replay`` predicts from)."""
    import dataclasses

    from ultraep.integration.moe_layer import MoELayer
    from ultraep.runtime.dtypes import BFLOAT16
    from ultraep.compute.fused.config import FusedConfig
    from ultraep.tune.model import fused_windows
    from ultraep.tune.search import search

    sharing = sharers(group)
    rng = np.random.default_rng(args.seed)
    weights = [xp.asarray(a.astype(np.float32).astype(BFLOAT16).view(np.int16)).view(BFLOAT16)
               for a in (rng.standard_normal((args.experts // group.size, args.hidden, 2 * args.ffn)) / 64,
                         rng.standard_normal((args.experts // group.size, args.ffn, args.hidden)) / 64)]
    hold = StreamHold(xp) if backend == "device" else None
    rows, problems = [], {}
    for tokens in args.tokens:
        (x, ids, gates), set_up, _, _, (problem, *rank_problems) = routed_problem(group, backend, xp, args, tokens,
                                                                                   sharing)
        configs = fused_configs(profile, problem, args.configs, args.send_shares)
        default, tuned = FusedConfig(profile.usable_sms), search(profile, problem).config.fused
        label = f"{tokens} tokens/rank, hidden {args.hidden}, ffn {args.ffn}"
        problems[label] = [dataclasses.asdict(p) for p in rank_problems]
        measured, per_rank, at_work, fewest = [], [], [], []
        for i, config in enumerate(configs):
            progress(f"fused forward, {label}: {config} ({i + 1}/{len(configs)})")
            with MoELayer(group, hidden=args.hidden, ffn=args.ffn, num_experts=args.experts, top_k=args.top_k,
                          max_tokens=tokens, max_recv_rows=set_up["max_recv_rows"], backend=backend,
                          sync_checks=False, fused=True, fused_config=config) as moe:
                moe.load_weights(*weights)
                moe.forward(x, ids, gates)  # warm-up
                moe.check()
                moe.record_timeline(True)
                spans = timed_forwards(group, moe, x, ids, gates, hold, args.repeats)  # [repeat, rank, 5]
                moe.check()
            windows = np.stack([spans[:, :, 1].max(1) - spans[:, :, 0].min(1),
                                spans[:, :, 3].max(1) - spans[:, :, 2].min(1),
                                spans[:, :, 3].max(1) - spans[:, :, 0].min(1)], axis=1) / 1e6
            own = np.stack([spans[:, :, 1] - spans[:, :, 0], spans[:, :, 3] - spans[:, :, 2],
                            spans[:, :, 3] - spans[:, :, 0]], axis=1) / 1e6  # [repeat, kernel, rank]
            measured.append(np.median(windows, axis=0))
            per_rank.append(np.median(own, axis=0))
            at_work.append(np.median(spans[:, :, 4:6], axis=0).T)  # [kernel, rank]
            fewest.append(np.median(spans[:, :, 4:6].min(axis=1), axis=0))  # [kernel]
        knobs = {name: np.asarray([getattr(c, name) for c in configs]) for name in FUSED_KNOBS}
        predicted = fused_windows(profile, rank_problems, *knobs.values())
        costs = profile.fused_costs(sharing)
        working = np.stack([costs.working_ctas(knobs["ctas"]), costs.working_down_ctas(knobs["ctas"])], axis=1)
        for i, (name, window) in enumerate(FUSED_WINDOWS):
            rows += [{"phase": "fused-forward", "problem": f"{name}, {label}", "shape": label, "window": window,
                      "config": str(config), "knob": str(config), "default": config == default,
                      "tuned": config == tuned, "predicted_ms": float(p) * 1e3, "measured_ms": float(m[i]),
                      "rank_ms": [float(v) for v in r[i]],
                      **{f"rank_ctas_{kernel}": [float(v) for v in ranks[j]] for j, kernel in enumerate("ab")},
                      **{f"fewest_ctas_{kernel}": float(few[j]) for j, kernel in enumerate("ab")},
                      **{f"profile_ctas_{kernel}": float(work[j]) for j, kernel in enumerate("ab")}}
                     for config, p, m, r, ranks, few, work in zip(configs, predicted[window], measured, per_rank,
                                                                  at_work, fewest, working)]
    return rows, problems


def sweep_command(document: dict, sweep: str, purpose: str):
    """The parsed arguments of the command line a ``--json`` document keeps (``meta.command``);
    SystemExit saying that ``sweep`` needs it ``purpose`` where it keeps none."""
    import shlex

    command = shlex.split(document.get("meta", {}).get("command", ""))
    if "validate" not in command:
        raise SystemExit(f"--replay: {sweep} needs its command line (meta.command) {purpose}")
    return parse_args(command[command.index("validate") + 1:])


def rebuilt_sync_problems(document: dict) -> dict:
    """The :class:`~ultraep.tune.model.SyncProblem` of each problem of a weight-sync sweep
    whose ``--json`` kept none (written before it did), by label: the expert and fan-outs of
    its command line, as :func:`weight_sync_problems` builds them."""
    import dataclasses

    args = sweep_command(document, "a weight-sync sweep without its problems", "to rebuild its expert")
    _, _, problems = weight_sync_problems(args, int(document["ranks"]))
    return {label: dataclasses.asdict(sync) for label, _, sync in problems}


def seeded_dispatch_problems(document: dict) -> dict:
    """Every rank's :class:`~ultraep.tune.model.Problem` of a dispatch sweep whose ``--json``
    kept none (written before it did), by shape: the routing the sweep drew, rank by rank
    (:func:`random_ids` from its command line's seed, as :func:`routed_problem` draws it),
    each rank's slots' rows and its sends per token (distinct ranks a token goes to) as the
    Dispatcher counts them. SystemExit where the document keeps no command line."""
    import dataclasses

    from ultraep.tune.model import Problem

    args = sweep_command(document, "a dispatch sweep without its ranks' problems", "to draw its routing again")
    ranks = int(document["ranks"])
    per_rank = args.experts // ranks
    problems = {}
    for tokens in args.tokens:
        ids = [random_ids(routing_rng(args.seed, rank), tokens, args.experts, args.top_k)
               for rank in range(ranks)]
        pairs = sum(np.bincount(i.ravel(), minlength=args.experts) for i in ids)
        problems[f"{tokens} tokens/rank, hidden {args.hidden}"] = [dataclasses.asdict(Problem(
            tokens, args.hidden, args.ffn, args.top_k, args.experts, ranks, ranks_per_gpu=ranks,
            slot_rows=tuple(int(c) for c in pairs[rank * per_rank:(rank + 1) * per_rank]),
            sends_per_token=float(np.mean([np.unique(row // per_rank).size for row in ids[rank]]))))
            for rank in range(ranks)]
    return problems


def from_fields(cls, fields: dict):
    """A problem dataclass from its fields as JSON keeps them (tuples as lists)."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def replay_rows(document: dict) -> tuple[list[dict], object]:
    """A fused-forward, dispatch or weight-sync sweep's rows (a ``--json`` document) predicted
    again by today's model from its profile and its problems, and that profile; SystemExit
    saying what a document it cannot replay lacks."""
    from ultraep.errors import ProfileError
    from ultraep.compute.fused.config import FusedConfig
    from ultraep.tune.model import Problem, SyncProblem, fused_windows, weight_sync_s
    from ultraep.tune.profile import MachineProfile

    phase = document.get("phase")
    if phase not in ("fused-forward", "dispatch", "weight-sync") or (
            phase == "fused-forward" and not document.get("problems")):
        raise SystemExit("--replay: not a fused-forward sweep's --json with its ranks' problems (written by tune "
                         "validate --phase fused-forward from this version on), nor a dispatch or weight-sync sweep's")
    try:
        profile = MachineProfile.from_json(document.get("profile"), stored=True)
    except ProfileError as exc:
        raise SystemExit(f"--replay: the file's profile cannot be read: {exc}") from None
    rows = [dict(row) for row in document["rows"]]
    if phase == "weight-sync":
        kept = document.get("problems") or rebuilt_sync_problems(document)
        for label, fields in kept.items():
            sync = from_fields(SyncProblem, fields)
            mine = [row for row in rows if row["problem"] == label]
            for row, seconds in zip(mine, weight_sync_s(profile, sync, np.asarray([row["knob"] for row in mine]))):
                row["predicted_ms"] = float(seconds) * 1e3
        return rows, profile
    kept = document.get("problems") or seeded_dispatch_problems(document)
    problems = {shape: [from_fields(Problem, p) for p in ranks] for shape, ranks in kept.items()}
    if phase == "dispatch":
        for row in rows:  # a sweep's rows before they kept these: "OPERATION, SHAPE"
            if "shape" not in row:
                row["operation"], row["shape"] = row["problem"].split(", ", 1)
        for shape, ranks in problems.items():
            for op in DISPATCH_OPERATIONS:
                mine = [row for row in rows if row["shape"] == shape and row["operation"] == op]
                predicted = dispatch_predicted_ms(profile, busiest_problem(ranks), op, [row["knob"] for row in mine])
                for row, ms in zip(mine, predicted):
                    row["predicted_ms"] = float(ms)
        return rows, profile
    for shape, ranks in problems.items():
        mine = [row for row in rows if row["shape"] == shape]
        configs = [FusedConfig.parse(row["config"]) for row in mine]
        predicted = fused_windows(profile, ranks, *(np.asarray([getattr(c, knob) for c in configs])
                                                    for knob in FUSED_KNOBS))
        for i, row in enumerate(mine):
            row["predicted_ms"] = float(predicted[row["window"]][i]) * 1e3
    return rows, profile


def replay(args) -> int:
    """``--replay``: the saved sweep's table and summary with today's predictions."""
    import json
    from pathlib import Path

    try:
        document = json.loads(Path(args.replay).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--replay: cannot read {args.replay}: {exc}") from None
    rows, profile = replay_rows(document)
    summary = summarise(rows)
    meta = document.get("meta", {})
    title = (f"tune validate --replay {args.replay}: measured {meta.get('date_utc', '?')} at "
             f"{meta.get('git_commit', '?')} ({document.get('ranks', '?')} ranks, {document.get('sharing', '?')}), "
             f"profile of {profile.device} version {profile.version}, predicted by today's model")
    report(rows, summary, title)
    if document["phase"] == "fused-forward":
        print_down_at_work_note(profile, document["problems"])
    if args.plot:
        plot(rows, summary, args.plot, title)
    if args.json:
        from ultraep.bench.report import write_json

        write_json(args.json, {**{k: v for k, v in document.items() if k != "meta"}, "replayed": args.replay,
                               "summary": summary, "rows": rows})
    return 0


# -- the report ------------------------------------------------------------------------------

WITHIN_PCT = 5.0  # issue 23's bound on the mean absolute error; the summary counts the rows within it


def summarise(rows: list[dict]) -> dict:
    """Adds ``error_pct`` to every row; the mean absolute error, the fraction of rows within
    :data:`WITHIN_PCT`, the worst row, and per problem its own mean and fraction, the model's
    choice's rank among the measured (1: the fastest measured) and its measured time over
    the fastest measured."""
    for row in rows:
        row["error_pct"] = 100.0 * (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
    errors = np.abs([row["error_pct"] for row in rows])
    worst = rows[int(np.argmax(errors))]
    problems = {}
    for problem in dict.fromkeys(row["problem"] for row in rows):
        mine = [row for row in rows if row["problem"] == problem]
        chosen = min(mine, key=lambda row: row["predicted_ms"])
        best = min(row["measured_ms"] for row in mine)
        faster = sum(row["measured_ms"] < chosen["measured_ms"] for row in mine)
        own = np.abs([row["error_pct"] for row in mine])
        problems[problem] = {"chosen": chosen["config"], "chosen_rank": 1 + faster, "configs": len(mine),
                             "chosen_over_best_pct": 100.0 * (chosen["measured_ms"] / best - 1),
                             "best_measured": min(mine, key=lambda row: row["measured_ms"])["config"],
                             "mean_abs_error_pct": float(own.mean()),
                             "within_fraction": float(np.mean(own <= WITHIN_PCT))}
        retimed = [row for row in mine if "retimed_ms" in row]
        if "retimed_ms" in chosen and len(retimed) > 1:  # the choice among the fastest, timed again together
            problems[problem]["chosen_over_best_retimed_pct"] = 100.0 * (
                chosen["retimed_ms"] / min(row["retimed_ms"] for row in retimed) - 1)
        default = next((row for row in mine if row.get("default")), None)
        if default is not None:  # today's constant: what a tuned configuration must at least match
            problems[problem].update(default=default["config"],
                                     chosen_vs_default_pct=100.0 * (chosen["measured_ms"] / default["measured_ms"] - 1))
    return {"configs": len(rows), "mean_abs_error_pct": float(errors.mean()),
            "within_fraction": float(np.mean(errors <= WITHIN_PCT)), "worst_error_pct": worst["error_pct"],
            "worst": f"{worst['problem']}, {worst['config']}", "problems": problems}


def report(rows: list[dict], summary: dict, title: str, file=None) -> None:
    from ultraep.bench.report import print_table

    file = file or sys.stdout
    print_table(rows, COLUMNS, title, file=file)
    print(f"mean absolute error {summary['mean_abs_error_pct']:.2f} % over {summary['configs']} configurations, "
          f"{100 * summary['within_fraction']:.0f} % of them within {WITHIN_PCT:g} %; "
          f"worst {summary['worst_error_pct']:+.2f} % ({summary['worst']})", file=file)
    for problem, s in summary["problems"].items():
        against_default = (f"; {s['chosen_vs_default_pct']:+.2f} % against today's {s['default']}"
                           if "default" in s else "")
        retimed = (f" ({s['chosen_over_best_retimed_pct']:.2f} % over the fastest when timed again beside them)"
                   if "chosen_over_best_retimed_pct" in s else "")
        swept = {row["config"] for row in rows if row["problem"] == problem}
        choice = (f"the model's choice {s['chosen']} ranks {s['chosen_rank']} of {s['configs']} measured, "
                  f"{s['chosen_over_best_pct']:.2f} % over the fastest measured ({s['best_measured']})"
                  f"{retimed}{against_default}" if len(swept) > 1 else
                  f"one configuration ({s['chosen']}) measured {s['configs']} times: nothing to choose among")
        print(f"{problem}: mean absolute error {s['mean_abs_error_pct']:.2f} %, {100 * s['within_fraction']:.0f} % "
              f"within {WITHIN_PCT:g} %; {choice}", file=file)


def print_down_at_work_note(profile, problems: dict) -> None:
    """Say where kernel B was predicted with kernel A's CTAs at work (a profile before
    version 8); ``problems``: a sweep's ranks' problems by shape, as its JSON keeps them."""
    note = profile.fused_costs(next(iter(problems.values()))[0]["ranks_per_gpu"]).down_at_work_note
    if note:
        print(note)


def ctas_at_work_lines(rows: list[dict]) -> list[str]:
    """Kernel A's and kernel B's CTAs at work by grid, measured (the fewest of any rank in a
    forward, the median forward; the median over the task sizes swept) against the profile's."""
    from ultraep.compute.fused.config import FusedConfig

    lines = []
    for kernel in "ab":
        grids = {}
        for row in rows:
            if row["window"] == "up":
                grids.setdefault(FusedConfig.parse(row["config"]).ctas, []).append(
                    (row[f"fewest_ctas_{kernel}"], row[f"profile_ctas_{kernel}"]))
        lines.append(f"kernel {kernel.upper()}'s CTAs at work, the fewest of any rank / the profile's, by CTAs a "
                     "rank: " + ", ".join(f"{ctas}: {np.median([m for m, _ in pairs]):g}/{pairs[0][1]:.1f}"
                                          for ctas, pairs in sorted(grids.items())))
    return lines


def plot(rows: list[dict], summary: dict, path: str, title: str):
    """Predicted against measured, one colour per problem, the diagonal and a +-5 % band;
    the closed figure is returned."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("--plot needs matplotlib: pip install ultraep[analysis]") from None
    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    for problem in dict.fromkeys(row["problem"] for row in rows):
        mine = [row for row in rows if row["problem"] == problem]
        ax.scatter([row["measured_ms"] for row in mine], [row["predicted_ms"] for row in mine], s=14, label=problem)
    values = [v for row in rows for v in (row["measured_ms"], row["predicted_ms"])]
    low, high = min(values) * 0.8, max(values) * 1.25
    line = np.geomspace(low, high, 50)
    ax.set_xscale("log")  # problems of different sizes lie decades apart
    ax.set_yscale("log")
    ax.plot(line, line, color="k", linewidth=0.8, label="predicted = measured")
    ax.fill_between(line, line * 0.95, line * 1.05, color="gray", alpha=0.2, label="within 5 %")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(title.replace(": ", ":\n", 1) + f"\nmean |error| {summary['mean_abs_error_pct']:.2f} %, worst "
                 f"{summary['worst_error_pct']:+.2f} %", fontsize=9)
    ax.grid(linewidth=0.4, alpha=0.5)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return fig


def run(args) -> int:
    from mpi4py import MPI

    from ultraep.bench.report import Progress, write_json
    from ultraep.bench.timing import array_backend
    from ultraep.runtime.group import EPGroup
    from ultraep.runtime.mps import sharing_label
    from ultraep.tune.replicas import group_profile

    group = EPGroup(MPI.COMM_WORLD)
    printing = group.rank == 0
    progress = Progress("tune validate", enabled=printing, quiet=args.quiet)  # --quiet: the profile's lines too
    backend, xp, synchronize, _ = array_backend(group, args.backend)
    # rank 0's profile on every rank: the swept knob values come from it, so every rank
    # sweeps the same list and posts the same collectives
    sync_times = None
    if backend == "device":  # the profile times the weight sync where the ranks share a GPU
        from ultraep.tune.sync_timing import profile_sync_times

        def sync_times(grid):
            return profile_sync_times(group, xp, synchronize, grid)

    profile = group_profile(group, backend, what="tune validate", shared=True, sync_times=sync_times)[0]
    sweep = {"weight-sync": sweep_weight_sync, "dispatch": sweep_dispatch, "fused-forward": sweep_fused}[args.phase]
    rows, problems = sweep(group, backend, xp, synchronize, profile, args, progress)
    sharing = sharing_label(group)  # collective
    if not printing:
        return 0
    summary = summarise(rows)
    title = (f"tune validate --phase {args.phase}: {group.size} ranks ({sharing}), {backend} backend, "
             f"profile of {profile.device} ({profile.processors})")
    report(rows, summary, title)
    if args.phase == "fused-forward":
        print("\n".join(ctas_at_work_lines(rows)))
        print_down_at_work_note(profile, problems)
    if args.plot:
        plot(rows, summary, args.plot, title)
    if args.json:
        write_json(args.json, {"benchmark": "tune-validate", "phase": args.phase, "ranks": group.size,
                               "backend": backend, "sharing": sharing, "profile": profile.to_json(),
                               "problems": problems, "summary": summary, "rows": rows})
    return 0
