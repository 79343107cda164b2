"""What the fused layer's multi-rank checks share (tests/compute/fused/mpi): the problem
sizes and each rank's master weights."""

from __future__ import annotations

import numpy as np

from tests.support.backend_arrays import bf16

POISON = np.int16(0x7FC1)  # a BF16 NaN; as two halves of an FP32 word, an FP32 NaN too
M, S, K = 4, 2, 4  # masters and replica slots per rank, top-k


def sizes(backend: str) -> tuple[int, int, int]:
    """(hidden, ffn, tokens): on the device partial column blocks and M-tiles."""
    return (272, 144, 300) if backend == "device" else (48, 24, 40)


def masters(rank: int, hidden: int, ffn: int):
    """Rank ``rank``'s ``w_up [M, H, 2F]`` and ``w_down [M, F, H]``, BF16, seeded by the rank."""
    rng = np.random.default_rng((rank, 5))
    return (bf16(rng.standard_normal((M, hidden, 2 * ffn)) / np.sqrt(hidden)),
            bf16(rng.standard_normal((M, ffn, hidden)) / np.sqrt(ffn)))
