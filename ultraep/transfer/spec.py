"""One expert's tensors and how they pack into a replica slot.

A replica slot holds every tensor of one expert back to back, each starting on a
256-byte boundary, so one tile never straddles two tensors and 16-byte vector access is
always aligned. Weights and gradients have their own slots (gradients may be fp32 while
weights are bf16).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ultraep.runtime.dtypes import resolve_dtype

SLOT_ALIGN = 256


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: np.dtype

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ExpertSpec:
    """``tensors``: ``[(name, shape, weight_dtype), ...]`` for one expert, e.g.
    ``[("fc1", (2 * ffn, hidden), "bfloat16"), ("fc2", (hidden, ffn), "bfloat16")]``;
    ``grad_dtype``: dtype of every gradient tensor (``"float32"`` or ``"bfloat16"``)."""

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int], Any]], grad_dtype: Any = "float32"):
        parsed = []
        for entry in tensors:
            try:
                name, shape, dtype = entry
            except (TypeError, ValueError):
                raise ValueError(f"expert tensor spec entries are (name, shape, dtype), got {entry!r}") from None
            shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(f"expert tensor {name!r}: every dimension must be positive, got {shape}")
            parsed.append(TensorSpec(str(name), shape, resolve_dtype(dtype, what=f"expert tensor {name!r} dtype")))
        if not parsed:
            raise ValueError("an expert needs at least one tensor")
        if len({t.name for t in parsed}) != len(parsed):
            raise ValueError(f"expert tensor names repeat: {[t.name for t in parsed]}")
        grad = resolve_dtype(grad_dtype, what="gradient dtype")
        if grad.kind != "f" and grad.name != "bfloat16":
            raise ValueError(f"gradient dtype must be a float type, got {grad}")
        self.weights = tuple(parsed)
        self.grads = tuple(TensorSpec(t.name, t.shape, grad) for t in parsed)
        self.grad_dtype = grad
        self.weight_offsets, self.weight_slot_bytes = _pack(self.weights)
        self.grad_offsets, self.grad_slot_bytes = _pack(self.grads)

    def key(self) -> tuple:
        """Comparable across ranks (``group.agree``)."""
        return tuple((t.name, t.shape, t.dtype.name) for t in self.weights) + (self.grad_dtype.name,)

    def __repr__(self) -> str:
        return (f"ExpertSpec({[(t.name, t.shape, t.dtype.name) for t in self.weights]}, "
                f"grad_dtype={self.grad_dtype.name})")


def _pack(tensors) -> tuple[tuple[int, ...], int]:
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += -(-t.nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return tuple(offsets), cursor
