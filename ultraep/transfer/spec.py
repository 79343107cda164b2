"""One expert's tensors and how they pack into a replica slot.

A replica slot holds every tensor of one expert back to back, each starting on a
256-byte boundary, so one tile never straddles two tensors and 16-byte vector access is
always aligned. Weights and gradients have their own slots (gradients may be fp32 while
weights are bf16 or FP8).

FP8 weights (``float8_e4m3fn``, ``float8_e5m2``) travel with their scales, DeepSeek-V3
style: a scale is one more tensor of the expert, float32, one value per square block of
its weight (e.g. ``fc1`` ``[2 * ffn, hidden]`` with ``fc1_scale``
``[2 * ffn / 128, hidden / 128]``), named by a fourth field ``scales=<weight name>``
of its entry. It is synced and restored with the weights, byte for byte. An FP8 weight
without a scale entry is moved as it is (its scale, e.g. one per tensor, is the
framework's to keep). Gradients stay
parallel to the weights: a scale has a gradient slot of ``grad_dtype`` like every tensor
(scales are derived from the weights, not trained: the framework passes zeros there and
the reduction keeps them zero); gradients are never FP8.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ultraep.runtime.dtypes import is_fp8, resolve_dtype
from ultraep.runtime.heap import positive_shape

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
    an FP8 weight's scale is an entry ``(name, shape, "float32", weight_name)``, e.g.
    ``("fc1_scale", (2 * ffn // 128, hidden // 128), "float32", "fc1")``;
    ``grad_dtype``: dtype of every gradient tensor (``"float32"`` or ``"bfloat16"``)."""

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int], Any] | tuple[str, Sequence[int], Any, str]],
                 grad_dtype: Any = "float32"):
        parsed, scale_of = [], {}
        for entry in tensors:
            try:
                name, shape, dtype, *scaled = entry
            except (TypeError, ValueError):
                raise ValueError(f"expert tensor spec entries are (name, shape, dtype), got {entry!r}") from None
            if len(scaled) > 1:
                raise ValueError(f"expert tensor spec entries are (name, shape, dtype[, scaled weight]), got {entry!r}")
            shape = positive_shape(shape, f"expert tensor {name!r}")
            parsed.append(TensorSpec(str(name), shape, resolve_dtype(dtype, what=f"expert tensor {name!r} dtype")))
            if scaled:
                scale_of[str(name)] = str(scaled[0])
        if not parsed:
            raise ValueError("an expert needs at least one tensor")
        if len({t.name for t in parsed}) != len(parsed):
            raise ValueError(f"expert tensor names repeat: {[t.name for t in parsed]}")
        _check_scales(parsed, scale_of)
        grad = resolve_dtype(grad_dtype, what="gradient dtype")
        if is_fp8(grad):
            raise ValueError(f"gradient dtype {grad} is not supported: FP8 training keeps bfloat16 or float32 "
                             "gradients (the reduction accumulates in fp32 and rounds once to the gradient dtype)")
        if grad.kind != "f" and grad.name != "bfloat16":
            raise ValueError(f"gradient dtype must be a float type, got {grad}")
        self.weights = tuple(parsed)
        self.scale_of = scale_of  # scale tensor name -> the FP8 weight it scales
        self.grads = tuple(TensorSpec(t.name, t.shape, grad) for t in parsed)
        self.grad_dtype = grad
        self.weight_offsets, self.weight_slot_bytes = _pack(self.weights)
        self.grad_offsets, self.grad_slot_bytes = _pack(self.grads)

    def key(self) -> tuple:
        """Comparable across ranks (``group.agree``)."""
        return tuple(self._entries()) + (self.grad_dtype.name,)

    def __repr__(self) -> str:
        return f"ExpertSpec({self._entries()}, grad_dtype={self.grad_dtype.name})"

    def _entries(self) -> list:
        return [(t.name, t.shape, t.dtype.name) + ((self.scale_of[t.name],) if t.name in self.scale_of else ())
                for t in self.weights]


def _check_scales(tensors, scale_of: dict) -> None:
    """Each scale is float32, scales one FP8 weight of the expert (one scale per weight) and
    holds one value per square block of it: ``ceil(weight dim / b)`` along every dimension
    for one block edge ``b`` (128 in DeepSeek-V3), so a transposed scale is refused."""
    by_name = {t.name: t for t in tensors}
    for scale_name, weight_name in scale_of.items():
        scale, weight = by_name[scale_name], by_name.get(weight_name)
        where = f"expert tensor {scale_name!r} (the scale of {weight_name!r})"
        if weight is None or weight_name in scale_of:
            raise ValueError(f"{where}: the expert has no weight tensor {weight_name!r} to scale")
        if not is_fp8(weight.dtype):
            raise ValueError(f"{where}: only FP8 weights (float8_e4m3fn, float8_e5m2) have scales, "
                             f"{weight_name!r} is {weight.dtype}")
        if scale.dtype != np.float32:
            raise ValueError(f"{where}: scales are float32, got {scale.dtype}")
        if len(scale.shape) != len(weight.shape) or _square_block(weight.shape, scale.shape) is None:
            raise ValueError(f"{where}: shape {scale.shape} is not one value per square block of the weight's "
                             f"{weight.shape} (for 128 x 128 blocks it is "
                             f"{tuple(-(-d // 128) for d in weight.shape)})")
    scaled = list(scale_of.values())
    if len(set(scaled)) != len(scaled):
        raise ValueError(f"an FP8 weight has more than one scale tensor: {scale_of}")


def _square_block(weight_shape, scale_shape) -> int | None:
    """The smallest block edge ``b`` with ``scale == ceil(weight / b)`` in every dimension, or None.

    ``ceil(w / b) == s`` holds for ``w / s <= b < w / (s - 1)``: intersect those ranges."""
    lowest = max(-(-w // s) for w, s in zip(weight_shape, scale_shape))
    highest = min((-(-w // (s - 1)) - 1 for w, s in zip(weight_shape, scale_shape) if s > 1), default=lowest)
    return lowest if lowest <= highest else None


def _pack(tensors) -> tuple[tuple[int, ...], int]:
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += -(-t.nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return tuple(offsets), cursor
