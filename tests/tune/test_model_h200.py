"""A regression check of the fused kernels' model against measurements: measured on the H200
(4 ranks under the MPS emulation, 25 % of the SMs each: 32 SMs a rank) at commit 405138f with
the reverts of e9279ab reapplied, by ``python -m ultraep.tune validate --emulate-ep --ranks 4
--phase fused-forward --tokens 4096`` (hidden 4096, ffn 1536, top-8 of 64 experts, seed 0),
send and reduce tasks of 16 tokens. The profile is the one that run measured
(``h200_mps25_profile.json``); the ranks' routing is the sweep's (its slots' rows and sends
per token, recomputed from its seed). The group's windows in ms: kernel A, kernel B, the
forward."""

from pathlib import Path

import numpy as np

import json
from ultraep.tune.model import Problem, fused_windows
from ultraep.tune.profile import PROFILE_VERSION, MachineProfile

# measured by profile version 4, whose fields version 5 keeps (version 5's probe reads its
# weights from HBM, where version 4's found them in L2): read as today's format
PROFILE = MachineProfile.from_json(dict(json.loads(Path(__file__).with_name("h200_mps25_profile.json").read_text()),
                                        version=PROFILE_VERSION))
RANK_SLOT_ROWS = [
    [2036, 2142, 2046, 2030, 2029, 1979, 2079, 2074, 2075, 2042, 2030, 2042, 2024, 2005, 2043, 2079],
    [2054, 2070, 2046, 2058, 1949, 2064, 2084, 2040, 2061, 2018, 2061, 2106, 2010, 2007, 2066, 2040],
    [1991, 2079, 1981, 1964, 2017, 2089, 2112, 2051, 2030, 1983, 2102, 2091, 2063, 2017, 2102, 2030],
    [2021, 2082, 2109, 2015, 2051, 2048, 2019, 1946, 2061, 2104, 2057, 2055, 2066, 2061, 2042, 2144]]
RANK_SENDS = [3.658203, 3.662842, 3.658936, 3.666992]
# (ctas, kernel A, kernel B, forward), send = reduce = 16 tokens
MEASURED_MS = [(1, 201.753, 102.304, 301.493), (4, 50.962, 28.167, 76.559), (6, 32.99, 17.266, 49.986),
               (9, 22.675, 11.96, 34.028), (11, 18.813, 9.909, 28.169), (14, 15.008, 7.852, 22.424),
               (16, 13.227, 6.886, 19.812), (19, 11.282, 5.946, 16.805), (22, 9.97, 5.151, 14.785),
               (24, 9.252, 4.866, 13.742), (27, 8.845, 4.823, 12.815), (29, 9.24, 5.375, 12.921),
               (32, 9.545, 6.604, 13.458)]


def errors_pct():
    problems = [Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4, slot_rows=tuple(rows), sends_per_token=sends)
                for rows, sends in zip(RANK_SLOT_ROWS, RANK_SENDS)]
    measured = np.asarray(MEASURED_MS)
    windows = fused_windows(PROFILE, problems, measured[:, 0], 16, 16)
    return {name: (windows[name] * 1e3 / measured[:, i + 1] - 1) * 100
            for i, name in enumerate(("up", "down", "forward"))}, measured[:, 0]


def test_kernel_a_within_five_percent_where_every_rank_keeps_its_grid():
    """Up to 24 CTAs a rank (96 of the GPU's SMs) no rank lagged; beyond, one rank's kernel A
    ran as if on fewer CTAs in some calls, which the model does not predict."""
    errors, ctas = errors_pct()
    resident = ctas <= 24
    assert np.mean(np.abs(errors["up"][resident])) <= 5.0
    assert np.mean(np.abs(errors["forward"][resident])) <= 6.0


def test_kernel_b_gap_stays_what_it_was():
    """Kernel B is predicted short by about a tenth up to 24 CTAs (down tiles dearer in the
    layer than in the probe); a guard against it growing, not a bound the issue accepts."""
    errors, ctas = errors_pct()
    resident = ctas <= 24
    assert np.all(errors["down"][resident] < 0)
    assert np.mean(np.abs(errors["down"][resident])) <= 12.0
