"""The benchmarks' progress lines and their --quiet, tables, and the commit a run records."""

import logging
import subprocess

import pytest

from ultraep.bench import report
from ultraep.bench.report import HOST_QUICK_TOKENS, Progress, RowStream, host_size_note
from ultraep.tune.profile import PROGRESS_LOGGER, stderr_progress


@pytest.fixture
def tune_level():
    logger = logging.getLogger(PROGRESS_LOGGER)
    level = logger.level
    yield
    logger.setLevel(level)


def test_progress_prints_its_lines_and_the_tuner_its_own(capsys, tune_level):
    Progress("demo", enabled=True)("step one")
    stderr_progress("measuring a machine profile")
    err = capsys.readouterr().err
    assert "[bench demo]" in err and "step one" in err
    assert "[tune] measuring a machine profile" in err


def test_quiet_silences_the_bench_and_the_tuner_on_every_rank(capsys, tune_level):
    Progress("demo", enabled=False, quiet=True)  # a rank that does not print still silences the tuner
    Progress("demo", enabled=True, quiet=True)("step one")
    stderr_progress("measuring a machine profile")
    logging.getLogger(PROGRESS_LOGGER).warning("a warning still shows")
    err = capsys.readouterr().err
    assert "step one" not in err and "measuring" not in err
    assert "a warning still shows" in err


def test_a_gpu_sized_run_on_the_host_says_it_takes_minutes(capsys):
    progress = Progress("demo", enabled=True)
    host_size_note(progress, True, HOST_QUICK_TOKENS)
    host_size_note(progress, False, 8192)
    assert capsys.readouterr().err == ""
    host_size_note(progress, True, 8192)
    assert "host backend (NumPy) at 8192 tokens per rank: minutes per row" in capsys.readouterr().err


def test_a_row_stream_prints_its_header_with_the_first_row(capsys):
    """The set-up's progress lines (stderr) land above the table, not between header and rows."""
    with RowStream(["case", "ms"], "title") as table:
        Progress("x")("setting up")
        assert capsys.readouterr().out == ""
        table.add({"case": "a", "ms": 1.5})
        table.add({"case": "b", "ms": 2.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "title" and lines[2].split() == ["case", "ms"] and lines[4].split() == ["a", "1.5000"]
    assert lines[5].split() == ["b", "2.0000"] and set(lines[-1]) == {"-"} and len(lines) == 7
    with RowStream(["case"], "empty"):
        pass
    assert capsys.readouterr().out.splitlines()[0] == "empty"  # a table of no rows still shows what it was


def test_the_commit_recorded_says_when_the_tree_differs_from_it(tmp_path, monkeypatch):
    """On the GPU machine a stale .git travels with a newer tree: its HEAD alone would name
    code that did not run."""
    monkeypatch.delenv("ULTRAEP_GIT_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.cu").write_text("v1\n")
    git("add", "kernel.cu")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "v1")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked: not the code that runs\n")
    assert report.git_commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("v2\n")
    assert report.git_commit(tmp_path) == f"{head} + uncommitted changes to 1 file"
    monkeypatch.setenv("ULTRAEP_GIT_COMMIT", "abc1234")
    assert report.git_commit(tmp_path) == "abc1234"
    assert report.git_commit(tmp_path / "not-a-repo") == "abc1234"
    monkeypatch.delenv("ULTRAEP_GIT_COMMIT")
    assert report.git_commit(tmp_path / "not-a-repo") is None
