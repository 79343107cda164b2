"""Arrays on either backend for the multi-rank checks: the backend's array module, copies
to and from NumPy (BF16 crosses to the GPU as its bits), and BF16 from numbers."""

from __future__ import annotations

import numpy as np

from ultraep.runtime.dtypes import BFLOAT16


def arrays(backend: str):
    """``(xp, host, to_backend)``: the backend's array module, a copy to NumPy (BF16 kept),
    and a copy from NumPy."""
    if backend == "device":
        import cupy as xp

        def host(array):
            array = xp.asnumpy(array)
            return array.view(BFLOAT16) if array.dtype == np.int16 else array
    else:
        xp, host = np, np.asarray

    def to_backend(array):
        if array.dtype == BFLOAT16:
            return xp.asarray(array.view(np.int16)).view(BFLOAT16)
        return xp.asarray(array)

    return xp, host, to_backend


def bf16(values):
    return np.asarray(values, dtype=np.float32).astype(BFLOAT16)
