"""scripts/gemm_tile_stamps.py: the figures it derives from a launch's tile stamps (CPU), and
one real run on a GPU."""

import numpy as np
import pytest

from tests.conftest import requires_gpu
from tests.support.scripts import load_script


def test_figures_of_two_blocks_tiles():
    """Block (SM) 0 runs a full tile then a 40-row one, SM 1 one 100-row tile; times in ns."""
    script = load_script("gemm_tile_stamps")
    #                 mma_start, mma_end, handed_on, sm, rows, k_steps
    stamps = np.array([[0, 1000, 1100, 0, 128, 10],
                       [1300, 2300, 2400, 0, 40, 10],
                       [0, 2000, 2100, 1, 100, 20]])
    f = script.summarise(stamps, 128)
    assert f["tiles"] == 3 and f["sms"] == 2 and f["span_us"] == pytest.approx(2.4)
    assert f["busy"] == pytest.approx((1100 + 1100 + 2100) / (2400 * 2))
    assert f["gap_ns"] == 200  # SM 0: hand-on at 1100, next MMAs at 1300
    kinds = f["kinds"]
    assert kinds["full"] == {"tiles": 1, "mma_us": 1.0, "ns_per_k_step": 100.0, "hand_on_ns": 100.0}
    assert kinds["over half"]["ns_per_k_step"] == 100.0 and kinds["half or less"]["tiles"] == 1


def test_figures_print_with_one_tile_a_block(capsys):
    script = load_script("gemm_tile_stamps")
    f = script.summarise(np.array([[0, 1000, 1100, 0, 128, 10], [0, 900, 1000, 1, 128, 10]]), 128)
    assert f["gap_ns"] is None
    script.print_figures(dict(f, case="c", sizes="exact", op="forward", plain_ms=0.1, stamped_ms=0.1))
    assert "gap -" in capsys.readouterr().out


def test_the_fields_are_the_kernels_stamps_in_order():
    from ultraep.compute.checks import KERNELS
    from ultraep.runtime.kernels import kernel_source

    text = kernel_source(KERNELS).read_text()
    enum = text[text.index("enum TileStamp {"):].split("}")[0]
    names = [name.strip().removeprefix("STAMP_").lower() for name in enum.split("{")[1].split(",")][:-1]
    assert tuple(names) == load_script("gemm_tile_stamps").FIELDS


@pytest.mark.gpu
@requires_gpu
def test_one_case_runs(tmp_path, capsys):
    import json

    path = tmp_path / "stamps.json"
    assert load_script("gemm_tile_stamps").main(["--cases", "32x256", "--sizes", "uniform", "--ops", "forward",
                                                 "--repeats", "2", "--json", str(path)]) == 0
    (figures,) = json.loads(path.read_text())
    assert figures["tiles"] > 0 and figures["sms"] > 0 and 0 < figures["busy"] <= 1
    assert sum(k["tiles"] for k in figures["kinds"].values()) == figures["tiles"]
    assert "ns a k-step" in capsys.readouterr().out
