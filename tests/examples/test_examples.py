"""The README's snippets and the demo run as written.

Each ```python block of README.md names, in the prose just above it, the file under
``examples/`` it is: the file is a docstring followed by exactly the block's text, and the
file is run here (on 4 ranks where it uses MPI), so a snippet that breaks fails a test.
"""

import ast
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ultraep.runtime.launch import run_mpi

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NAMED = re.compile(r"examples/(\w+\.py)")
RANKS = 4


def readme_snippets() -> list[tuple[str, str]]:
    """(example file name, code) of every ```python block in README.md, in order."""
    text = (ROOT / "README.md").read_text()
    snippets, previous_end = [], 0
    for match in FENCE.finditer(text):
        names = NAMED.findall(text[previous_end:match.start()])
        assert names, f"README.md: the python block at offset {match.start()} names no examples/*.py above it"
        snippets.append((names[-1], match.group(1)))
        previous_end = match.end()
    return snippets


def snippet_body(path: Path) -> str:
    """The example's text after its module docstring (what the README must show)."""
    source = path.read_text()
    tree = ast.parse(source)
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), f"{path.name}: no docstring"
    return "".join(source.splitlines(keepends=True)[first.end_lineno:])


def run_example(name: str, *args: str, timeout: float = 180) -> str:
    path = EXAMPLES / name
    if "mpi4py" in path.read_text():
        return run_mpi(RANKS, [str(path), *args], timeout=timeout).stdout
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_readme_has_its_snippets():
    assert [name for name, _ in readme_snippets()] == ["heap_exchange.py", "planner_step.py", "layer_step.py",
                                                       "moe_layer_step.py"]


@pytest.mark.parametrize("name, code", readme_snippets(), ids=[name for name, _ in readme_snippets()])
def test_readme_snippet_is_its_example(name, code):
    assert snippet_body(EXAMPLES / name) == code, f"README.md's snippet and examples/{name} differ"


@pytest.mark.mpi
def test_heap_exchange_example():
    out = run_example("heap_exchange.py", timeout=120)
    for rank in range(RANKS):
        expected = [1000 * peer + rank for peer in range(RANKS)]
        assert re.search(rf"rank {rank}/{RANKS} \((host|device)\): received {re.escape(str(expected))}", out), out


def test_planner_step_example():
    out = run_example("planner_step.py")
    before, after = map(float, re.search(r"busiest rank / mean: ([\d.]+) -> ([\d.]+)", out).groups())
    assert after < 1.05 < before, out


@pytest.mark.mpi
def test_layer_step_example():
    out = run_example("layer_step.py")
    for rank in range(RANKS):
        line = re.search(rf"rank {rank}: rows per rank \[([^\]]*)\] unbalanced, \[([^\]]*)\] balanced", out)
        assert line, out
        before, after = ([int(v) for v in group.split(",")] for group in line.groups())
        assert sum(before) == sum(after) and max(after) < max(before), out


@pytest.mark.mpi
def test_moe_layer_step_example():
    out = run_example("moe_layer_step.py")
    for rank in range(RANKS):
        line = re.search(rf"rank {rank}: rows per rank \[([^\]]*)\] balanced, \|grad_up\| ([\d.e+]+)", out)
        assert line, out
        rows = [int(v) for v in line.group(1).split(",")]
        assert sum(rows) == RANKS * 256 * 2 and max(rows) <= 1.01 * sum(rows) / RANKS, out
        assert float(line.group(2)) > 0, out


@pytest.mark.mpi
@pytest.mark.parametrize("name, args, reason", [
    ("balanced_layer.py", ["--micro-batches", "0"], "argument --micro-batches: expected an int >= 1, got '0'"),
    ("cupy_framework.py", ["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
])
def test_an_example_refuses_a_bad_option_once(name, args, reason):
    """Rank 0 says why with the usage, every rank exits 2, no MPI_Abort (was: once per rank)."""
    done = run_mpi(RANKS, [str(EXAMPLES / name), *args], timeout=120, check=False)
    assert done.returncode == 2, done.stdout
    assert done.stdout.count(reason) == 1 and done.stdout.count("usage:") == 1, done.stdout
    assert "Abort" not in done.stdout and "Traceback" not in done.stdout, done.stdout


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.mpi
def test_balanced_layer_demo(tmp_path):
    """``make demo``'s layer: balancing flattens every micro-batch, changes no output, and
    the figure has its labelled axes and legend."""
    figure = tmp_path / "demo_layer.png"
    out = run_example("balanced_layer.py", "--out", str(figure), "--micro-batches", "2", "--tokens", "256")
    for rank in range(RANKS):
        assert f"rank {rank}/{RANKS}: balanced_layer OK" in out, out
    ratios = re.findall(r"micro-batch \d: unbalanced .* max/mean ([\d.]+)  ->  balanced .* max/mean ([\d.]+)", out)
    assert len(ratios) == 2 and all(float(a) < float(b) for b, a in ratios), out
    assert "outputs and input gradients bitwise equal to the unbalanced layer" in out, out
    drawn = re.search(r"figure .*: (\d+) panels, (\d+)x(\d+) pixels, x label 'rank', "
                      r"y label 'rows computed \(token, expert pairs\)', legend \[(.*)\]", out)
    assert drawn, out
    panels, width, height, legend = drawn.groups()
    assert int(panels) == 2
    assert {"'unbalanced'", "'balanced'", "'mean (ideal)'"} <= set(legend.split(", ")), legend
    assert png_size(figure) == (int(width), int(height))
    import matplotlib.image

    pixels = matplotlib.image.imread(figure)
    assert pixels.shape[:2] == (int(height), int(width)) and pixels[..., :3].std() > 0.05, "a blank figure"
