"""``python -m ultraep.tune profile [--out FILE] [--force]``: this machine's profile, from
the cache or measured now (progress on stderr), printed as a table."""

from __future__ import annotations

import argparse
import json
import sys

from ultraep.tune.profile import load_profile, stderr_progress


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m ultraep.tune", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    profile = commands.add_parser("profile", help="measure (once) and print this machine's profile")
    profile.add_argument("--out", metavar="FILE",
                         help="the profile's file (default: profile-<device>.json in $ULTRAEP_CACHE_DIR "
                              "or ~/.cache/ultraep)")
    profile.add_argument("--force", action="store_true", help="measure again even where a valid profile is cached")
    profile.add_argument("--backend", default="auto", choices=["auto", "device", "host"],
                         help="device: the GPU; host: NumPy on the CPU; auto: the GPU when there is one")
    profile.add_argument("--device", type=int, help="the GPU to measure (default: CuPy's current one)")
    profile.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    profile = load_profile(args.backend, device=args.device, path=args.out, force=args.force,
                           progress=stderr_progress)
    print(json.dumps(profile.to_json(), indent=2) if args.json else profile.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
