"""The test files of one share of the GPU test suite (``scripts/gpu_check.sh`` with
``GPU_SHARD=i/n``).

The GPU tests outlast one 10-minute call on the lent GPU. ``GPU_SHARD=i/n`` runs the i-th
(from 0) of n interleaved shares of the files that hold GPU tests, so that n calls run each
of them once.

    python scripts/gpu_shard.py i/n [PATHS...]   # one file a line; exit 2 on a bad share
"""

from __future__ import annotations

import subprocess
import sys


def parse_share(text: str) -> tuple[int, int]:
    """``"i/n"`` as (i, n) with 0 <= i < n; ValueError naming what is wrong."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"GPU_SHARD must be i/n with whole numbers i < n (e.g. 0/3), got {text!r}")
    index, count = int(parts[0]), int(parts[1])
    if not index < count:
        raise ValueError(f"GPU_SHARD {text!r}: the share index must be below the number of shares")
    return index, count


def test_files(node_ids) -> list[str]:
    """The files of pytest's collected node ids (``path::test``), each once, in path order."""
    return sorted({node.split("::", 1)[0] for node in node_ids if "::" in node})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        index, count = parse_share(argv[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    collected = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                                "-p", "no:cacheprovider", *(argv[1:] or ["tests"])], capture_output=True, text=True)
    if collected.returncode not in (0, 5):  # 5: nothing collected
        print(f"pytest could not collect the GPU tests:\n{collected.stdout}{collected.stderr}", file=sys.stderr)
        return 2
    files = test_files(collected.stdout.splitlines())
    chosen = files[index::count]
    if not chosen:
        print(f"GPU_SHARD {argv[0]}: {len(files)} file(s) hold GPU tests, none falls in this share", file=sys.stderr)
        return 2
    print("\n".join(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
