"""scripts/exp_rn_ulps.py: its blocks cover exp_rn's inputs once each, a block's worst is
found where it is, and bad options are refused (the full run takes minutes: not here)."""

import numpy as np
import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def ulps():
    return load_script("exp_rn_ulps")


def test_blocks_cover_every_input_from_the_lower_to_the_upper_clamp_once(ulps):
    covered = sorted(ulps.blocks(20))
    assert all(lo < hi for lo, hi in covered)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]) if a[1] != 0x80000000 and b[0] != 0x80000000)
    bits = lambda v: int(np.float32(v).view(np.uint32))  # noqa: E731
    positive = [block for block in covered if block[0] < 0x80000000]
    negative = [block for block in covered if block[0] >= 0x80000000]
    assert positive[0][0] == 0 and positive[-1][1] == bits(88.75) + 1
    assert negative[0][0] == bits(-0.0) and negative[-1][1] == bits(-86.0) + 1
    assert sum(hi - lo for lo, hi in covered) == bits(88.75) + 1 + bits(-86.0) - bits(-0.0) + 1


def test_a_block_reports_its_worst_input(ulps):
    worst = np.float32(37.77864074707031)  # exp_rn's worst, 1.0137 ulp
    at = int(worst.view(np.uint32))
    error, x = ulps.worst_in((at - 2048, at + 2048))
    assert x == worst and 1.01 < error < 1.02


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--block-bits", "30"]])
def test_bad_options_are_refused(ulps, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ulps.main(argv)
    assert exit_info.value.code == 2 and "--workers" in capsys.readouterr().err
