"""``python -m ultraep.tune COMMAND``: this machine's profile, the search's choice for a
problem, and the model's validation against measurements.

* ``profile [--out FILE] [--force]``: the profile, from the cache or measured now
  (progress on stderr), printed as a table;
* ``search``: the best configuration the model finds for a problem, each phase's
  predicted time, and how long the search over the whole space took;
* ``validate --phase PHASE``: predicted against measured over a sweep
  (:mod:`ultraep.tune.validate`; ``validate --help``)."""

from __future__ import annotations

import argparse
import json
import sys

from ultraep.errors import ProfileError
from ultraep.runtime.launch import DefaultsHelpFormatter, non_negative_int, positive_int, refused
from ultraep.tune.profile import load_profile, read_profile, stderr_progress

SEARCH_RUNS = 5  # the search is timed this many times; the fastest is reported (the first pays NumPy's warm-up)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.tune", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    profile = commands.add_parser("profile", help="measure (once) and print this machine's profile",
                                  description="Measure (once; cached) and print this machine's profile.",
                                  formatter_class=DefaultsHelpFormatter)
    profile.add_argument("--out", metavar="FILE",
                         help="the profile's file (default: profile-<device>.json in $ULTRAEP_CACHE_DIR "
                              "or ~/.cache/ultraep)")
    profile.add_argument("--force", action="store_true", help="measure again even where a valid profile is cached")
    _add_machine_options(profile)
    profile.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    search = commands.add_parser("search", help="the model's best configuration for a problem, and the search's time",
                                 description="The model's best configuration for a problem (from this machine's "
                                             "profile, or --profile FILE), each phase's predicted time, and how long "
                                             "the search over every configuration took.",
                                 formatter_class=DefaultsHelpFormatter)
    search.add_argument("--profile", metavar="FILE", help="use this profile file (e.g. another machine's) as it is")
    _add_machine_options(search)
    search.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank")
    search.add_argument("--hidden", type=positive_int, default=4096, help="model width")
    search.add_argument("--ffn", type=positive_int, default=1536, help="expert FFN width")
    search.add_argument("--top-k", type=positive_int, default=8, help="experts per token")
    search.add_argument("--experts", type=positive_int, default=64, help="experts in all")
    search.add_argument("--ranks", type=positive_int, default=8, help="ranks of the EP group")
    search.add_argument("--ranks-per-gpu", type=positive_int, default=1,
                        help="ranks sharing one GPU's memory (the MPS emulation: all of them)")
    search.add_argument("--fanout", type=non_negative_int, default=0,
                        help="replicas of one expert the busiest rank syncs (0: no weight sync)")
    commands.add_parser("validate", add_help=False,
                        help="predicted against measured over a sweep (see: python -m ultraep.tune validate --help)")
    args = parser.parse_args(argv)
    if args.command == "search" and args.ranks_per_gpu > args.ranks:
        search.error(f"--ranks-per-gpu {args.ranks_per_gpu} exceeds --ranks {args.ranks}")
    if args.command == "search" and args.fanout > args.ranks - 1:
        search.error(f"--fanout {args.fanout}: at most {args.ranks - 1} replicas on {args.ranks} ranks")
    if args.device is not None:  # a GPU named where none is measured must not pass unnoticed
        command = profile if args.command == "profile" else search
        if getattr(args, "profile", None):
            command.error("--device names a GPU to measure; --profile FILE is used as it is")
        if args.backend == "host":
            command.error("--device names a GPU; --backend host measures the CPU")
        from ultraep.runtime.group import gpu_count

        if args.backend == "auto" and not gpu_count():
            command.error(f"--device {args.device}: this machine has no GPU (--backend auto measures the CPU)")
    return args


def _add_machine_options(parser) -> None:
    parser.add_argument("--backend", default="auto", choices=["auto", "device", "host"],
                        help="device: the GPU; host: NumPy on the CPU; auto: the GPU when there is one")
    parser.add_argument("--device", type=non_negative_int,
                        help="the GPU to measure (default: CuPy's current one; not with the host backend)")


def search_command(args) -> int:
    from ultraep.tune.model import Problem, SyncProblem
    from ultraep.tune.search import search

    try:
        problem = Problem(args.tokens, args.hidden, args.ffn, args.top_k, args.experts, args.ranks,
                          ranks_per_gpu=args.ranks_per_gpu)
    except ProfileError as exc:
        print(f"ultraep.tune search: {exc}", file=sys.stderr)
        return 2
    if args.profile:
        try:
            profile = read_profile(args.profile)
        except (OSError, ValueError) as exc:  # ProfileError is a ValueError
            print(f"ultraep.tune search: --profile {args.profile}: {exc}", file=sys.stderr)
            return 2
    elif refused(args, "ultraep.tune search"):  # --backend device without a GPU
        return 2
    else:
        profile = load_profile(args.backend, device=args.device, progress=stderr_progress)
    sync = SyncProblem(3 * args.hidden * args.ffn * problem.element_bytes, (args.fanout,)) if args.fanout else None
    results = [search(profile, problem, sync) for _ in range(SEARCH_RUNS)]
    fastest = min(result.seconds for result in results)
    result = results[-1]
    print(f"profile: {profile.device} ({profile.backend} backend, {profile.processors})")
    print(f"problem: {problem.tokens} tokens a rank, hidden {problem.hidden}, ffn {problem.ffn}, top-{problem.top_k} "
          f"of {problem.experts} experts, {problem.ranks} ranks ({problem.ranks_per_gpu} a GPU); "
          + (f"weight sync of a {sync.expert_bytes / 1e6:.1f} MB expert to {args.fanout} replicas" if sync else
             "no weight sync (--fanout 0)"))
    config = result.config
    print(f"best: weight-sync grid {config.sync_blocks if sync else '-'}, dispatch grid {config.dispatch_grid}, "
          f"fused {config.fused}")
    for phase, seconds in result.predicted.items():
        if sync or phase != "weight_sync":
            print(f"  {phase:12s} {seconds * 1e6:10.1f} us predicted")
    print(f"search: {result.evaluated} configurations in {fastest * 1e3:.2f} ms (fastest of {SEARCH_RUNS} runs, "
          f"first {results[0].seconds * 1e3:.2f} ms)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["validate"]:
        from ultraep.tune import validate

        return validate.main(argv[1:])
    args = parse_args(argv)
    if args.command == "search":
        return search_command(args)
    if refused(args, "ultraep.tune profile"):
        return 2
    try:
        profile = load_profile(args.backend, device=args.device, path=args.out, force=args.force,
                               progress=stderr_progress)
    except ProfileError as exc:
        print(f"ultraep.tune profile: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(profile.to_json(), indent=2) if args.json else profile.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
