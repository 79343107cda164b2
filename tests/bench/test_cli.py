"""``python -m ultraep.bench``: the listing, and GPU benches refused cleanly without a GPU."""

import subprocess
import sys

import pytest

import ultraep.bench as bench
from ultraep.runtime.group import gpu_count


def test_listing_names_every_benchmark_with_what_it_measures(capsys):
    assert bench.main([]) == 0  # the README's listing command
    listing = capsys.readouterr().out
    for name, entry in bench.BENCHMARKS.items():
        line = next(line for line in listing.splitlines() if line.split()[:1] == [name])
        assert entry.summary in line and ("[GPU]" in line) == entry.needs_gpu


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is present: the refusal path is not taken")
@pytest.mark.parametrize("name", [name for name, entry in bench.BENCHMARKS.items() if entry.needs_gpu])
def test_gpu_bench_without_gpu_exits_2_with_one_line(name):
    proc = subprocess.run([sys.executable, "-m", "ultraep.bench", name], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr


def test_gpu_bench_help_is_shown_without_gpu():
    proc = subprocess.run([sys.executable, "-m", "ultraep.bench", "dispatch", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "usage: python -m ultraep.bench dispatch" in proc.stdout


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a bench built."""


@pytest.mark.parametrize("name", list(bench.BENCHMARKS))
def test_every_option_has_help_and_no_repository_file_is_cited_that_is_missing(name, monkeypatch):
    import argparse
    import importlib
    import re
    from pathlib import Path

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    module = importlib.import_module(bench.BENCHMARKS[name].module)
    with pytest.raises(_Parsed) as parsed:
        module.build_parser().parse_args([]) if hasattr(module, "build_parser") else module.parse_args([])
    parser = parsed.value.args[0]
    bare = [action.option_strings for action in parser._actions if action.option_strings and not action.help]
    assert bare == [], f"{name}: options without help"
    root = Path(__file__).resolve().parents[2]
    for cited in re.findall(r"``([\w./-]+\.(?:md|cu|cuh|py|sh))``", parser.description + (module.__doc__ or "")):
        assert any((root / prefix / cited).exists() for prefix in ("", "ultraep", "raw_kernels")), cited
