"""Benchmark output shared by every benchmark: fixed-width tables and JSON with run metadata."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ultraep.runtime.dtypes import is_bool
from ultraep.tune.profile import PROGRESS_LOGGER

_REPO_ROOT = Path(__file__).resolve().parents[2]


def format_value(value) -> str:
    if value is None:
        return "-"
    if is_bool(value):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "nan"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.4f}"
    return str(value)


def print_table(rows: list[dict], columns: list[str], title: str, file=None) -> None:
    """Print ``rows`` as a fixed-width table of ``columns`` (missing cells print ``-``)."""
    file = file or sys.stdout
    cells = [[format_value(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    # Text columns (the first one, typically a name) align left, numbers right.
    left = [all(not _numeric(row.get(column)) for row in rows) for column in columns]

    def line(values):
        return "  ".join(v.ljust(w) if l else v.rjust(w) for v, w, l in zip(values, widths, left)).rstrip()

    rule = "-" * len(line(columns))
    print(title, file=file)
    print(rule, file=file)
    print(line(columns), file=file)
    print(rule, file=file)
    for values in cells:
        print(line(values), file=file)
    print(rule, file=file)


class RowStream:
    """A table printed row by row as the rows are measured: title and header with the first
    row (the progress lines of the set-up on stderr come before the table, not inside it),
    each row when :meth:`add` gets it, the closing rule from :meth:`close` (or the ``with``
    block).

    Widths are fixed by the header (at least ``min_width``), since later rows are unknown;
    a longer value widens its own line only. Numbers align right, text left.
    """

    def __init__(self, columns: list[str], title: str, *, file=None, min_width: int = 9, enabled: bool = True):
        self.columns, self.file, self.enabled = columns, file or sys.stdout, enabled
        self.widths = [max(len(column), min_width) for column in columns]
        self.rule = "-" * (sum(self.widths) + 2 * (len(columns) - 1))
        header = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, self.widths)))
        self._head = [title, self.rule, header, self.rule]  # printed once, before the first row

    def _print(self, *lines: str) -> None:
        if self.enabled:
            lines, self._head = self._head + list(lines), []
            for line in lines:
                print(line.rstrip(), file=self.file, flush=True)

    def add(self, row: dict) -> None:
        values = [row.get(column) for column in self.columns]
        self._print("  ".join(format_value(v).rjust(w) if _numeric(v) else format_value(v).ljust(w)
                              for v, w in zip(values, self.widths)))

    def note(self, text: str) -> None:
        """A line of text in place of a row (a row not measured, and why)."""
        self._print(text)

    def close(self) -> None:
        self._print(self.rule)

    def __enter__(self) -> RowStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


HOST_QUICK_TOKENS = 1024  # tokens per rank the host backend runs a row of in seconds


def host_size_note(progress: "Progress", on_host: bool, tokens: int) -> None:
    """On the host backend at a GPU's problem size, say before the first long step that it
    takes minutes, and where the sizes that take seconds are."""
    if on_host and tokens > HOST_QUICK_TOKENS:
        progress(f"host backend (NumPy) at {tokens} tokens per rank: minutes per row on a CPU; the README's CPU "
                 "sizes (e.g. --tokens 256 --hidden 128) take seconds")


class Progress:
    """Progress lines on stderr, ``[bench NAME] 12.3 s: message``, from the rank that prints.
    ``quiet``: none, on any rank -- neither these nor the tuner's (the ``ultraep.tune`` logger's
    ``[tune]`` lines while a machine profile is measured)."""

    def __init__(self, name: str, *, enabled: bool = True, quiet: bool = False):
        self.name, self.enabled, self.start = name, enabled and not quiet, time.perf_counter()
        if quiet:
            logging.getLogger(PROGRESS_LOGGER).setLevel(logging.WARNING)

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[bench {self.name}] {time.perf_counter() - self.start:.1f} s: {message}", file=sys.stderr,
                  flush=True)


def _numeric(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not is_bool(value)


def device_name() -> str:
    """The GPU's name when CuPy sees one, else ``"cpu"``."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cpu"
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "cpu"


def git_commit(root: Path = _REPO_ROOT) -> str | None:
    """HEAD of the checkout, or ``$ULTRAEP_GIT_COMMIT`` where the tree travelled without .git.
    Where the tracked files differ from HEAD (edits not committed, or a stale .git that
    travelled with a newer tree: the GPU machine's copy), it says so: the commit alone would
    name code that did not run."""
    if os.environ.get("ULTRAEP_GIT_COMMIT"):
        return os.environ["ULTRAEP_GIT_COMMIT"]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    head = (git("rev-parse", "HEAD") or "").strip()
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    if changed is None:
        return f"{head} (whether the tree differs: unknown)"
    files = len(changed.splitlines())
    return head if files == 0 else f"{head} + uncommitted changes to {files} file{'s' if files > 1 else ''}"


def run_command() -> str:
    """The command line that ran this process: ``python -m PACKAGE ...`` where a package's
    ``__main__`` runs (``ultraep.bench``, ``ultraep.tune``: the package's own name, as
    ``python -m mpi4py -m`` runs it too), else the script and its arguments."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.endswith(".__main__"):
        return " ".join([Path(sys.executable).name, "-m", spec.name.removesuffix(".__main__")] + sys.argv[1:])
    return " ".join(sys.argv)


def run_metadata() -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": device_name(),
        "git_commit": git_commit(),
        "command": run_command(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def _jsonable(value):
    """Plain JSON values: NumPy scalars/arrays converted, NaN and infinities as null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if is_bool(value):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(path, payload: dict) -> Path:
    """Write ``{"meta": run_metadata(), **payload}`` to ``path`` as strict JSON (NaN -> null)."""
    if "meta" in payload:
        raise ValueError("payload must not have a 'meta' key: write_json adds it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_jsonable({"meta": run_metadata(), **payload}), fh, indent=1, allow_nan=False)
        fh.write("\n")
    return path
