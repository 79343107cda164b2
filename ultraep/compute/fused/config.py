"""The fused kernels' configuration (``raw_kernels/fused_moe.cu``): what a caller may set,
what the search (:mod:`ultraep.tune.search`) chooses, and the schedule of one per token
bucket a fused ``MoELayer`` runs with.

The grid is a launch parameter; every other knob is an ``#ifndef``-guarded ``#define`` of
the kernel source, so a configuration whose knobs differ from the source's defaults is a
module variant of its own (``-D`` options, compiled once and cached, see
:func:`ultraep.runtime.kernels.load_module`). No knob changes a result bit: tasks are
claimed in one fixed order whatever their size and whichever CTA runs them, each GEMM
element is one sum in ascending reduction order, and a reduce adds a token's slots one by
one in slot order (``ultraep.compute.fused.forward``'s simulation runs several configurations,
different ones per rank included, and compares bit for bit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import numpy as np

from ultraep.errors import MoELayerError
from ultraep.runtime.kernels import kernel_constant

KERNELS = "fused_moe.cu"
BUCKET_TOKENS = 4096
# Of kernel A's CTAs, the share that sends first by default (FusedConfig.send_ctas): all of them. Share 0 (every
# CTA adaptive) ran the forward faster at 8192 tokens on an H200 and slower on an H100 (docs/benchmarks.md,
# moe-fused), and the tune model prices it as all sending first: no default beats this one everywhere yet.
SEND_SHARE = 1.0


def share_of_ctas(ctas, share: float = SEND_SHARE):
    """``share`` of ``ctas`` CTAs (an int or an array of them), rounded, at most ``ctas`` and
    at least one unless ``share`` is 0: the senders FusedConfig resolves ``send_ctas=None``
    to, with ``share`` :data:`SEND_SHARE`."""
    ctas = np.asarray(ctas)
    return np.minimum(ctas, np.maximum(int(share > 0), np.round(ctas * share))).astype(ctas.dtype)
# (knob, the kernel's macro, largest value accepted): an unroll is a register array per lane
DEFINES = (("send_tokens", "FM_SEND_TOKENS", 1 << 16), ("reduce_tokens", "FM_REDUCE_TOKENS", 1 << 16),
           ("copy_unroll", "FM_UNROLL", 8), ("reduce_unroll", "FM_REDUCE_UNROLL", 16))


def bucket(tokens: int) -> int:
    """The bucket of ``tokens`` per rank: 1 for 1..4096 tokens, 2 for 4097..8192, ..."""
    return max(1, -(-int(tokens) // BUCKET_TOKENS))


@dataclass(frozen=True)
class FusedConfig:
    """One configuration of the fused kernels (the forward's: ``fused_dispatch_up`` and
    ``fused_down_combine``).

    * ``ctas``: the persistent grid, one CTA per SM (the stage ring fills an SM's shared
      memory); at most the CTAs resident at once, i.e. the SMs this process may use (under
      MPS its share). Fewer leave SMs to other work; any number is correct.
    * ``send_tokens``: tokens per send task of kernel A (``FM_SEND_TOKENS``): a warp per
      token; smaller tasks spread the sends over more CTAs, larger ones pay fewer claims.
    * ``reduce_tokens``: tokens per reduce task of kernel B, every output column
      (``FM_REDUCE_TOKENS``): the same trade for the slot-order sums after the down tiles.
    * ``copy_unroll``: 16-byte loads a lane keeps in flight in a row copy (send and relay,
      ``FM_UNROLL``, at most 8).
    * ``reduce_unroll``: slot rows a lane loads at once in a reduce (``FM_REDUCE_UNROLL``,
      at most 16).
    * ``send_ctas``: the CTAs of kernel A (and the backward's C) that claim the sends before
      anything else, a launch argument; the others take an up tile once its rows are there
      and send meanwhile, so the GEMM runs beside the exchange (0: every CTA so). None:
      :data:`SEND_SHARE` of ``ctas``; set to the number resolved, at most ``ctas``.

    The defaults are the kernel source's constants; ``ctas`` has none (the device's).
    """

    ctas: int
    send_tokens: int = kernel_constant(KERNELS, "FM_SEND_TOKENS")
    reduce_tokens: int = kernel_constant(KERNELS, "FM_REDUCE_TOKENS")
    copy_unroll: int = kernel_constant(KERNELS, "FM_UNROLL")
    reduce_unroll: int = kernel_constant(KERNELS, "FM_REDUCE_UNROLL")
    send_ctas: int | None = None  # an int once constructed (None resolves to SEND_SHARE of ctas)

    def __post_init__(self):
        for knob in fields(self):
            value = getattr(self, knob.name)
            if knob.name == "send_ctas":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                    raise MoELayerError(f"FusedConfig.send_ctas must be an integer >= 0 or None, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MoELayerError(f"FusedConfig.{knob.name} must be a positive integer, got {value!r}")
        for name, _, most in DEFINES:
            if getattr(self, name) > most:
                raise MoELayerError(f"FusedConfig.{name} must be at most {most}, got {getattr(self, name)}")
        senders = int(share_of_ctas(self.ctas)) if self.send_ctas is None else min(self.ctas, self.send_ctas)
        object.__setattr__(self, "send_ctas", senders)  # frozen: resolved once, compared by value

    def check_resident(self, resident: int) -> None:
        """Raise MoELayerError unless the grid fits the ``resident`` CTAs (SMs) at once."""
        if self.ctas > resident:
            raise MoELayerError(f"FusedConfig.ctas {self.ctas} exceeds the {resident} CTAs this process can keep "
                                f"resident at once (one per SM it may use); a persistent grid must fit")

    def defines(self) -> tuple:
        """The ``-D`` defines of this configuration's module variant: the knobs that differ
        from the source's defaults (the defaults' variant is the plain module)."""
        return tuple((macro, getattr(self, name)) for name, macro, _ in DEFINES
                     if getattr(self, name) != kernel_constant(KERNELS, macro))

    def __str__(self) -> str:
        return (f"ctas={self.ctas} senders={self.send_ctas} send={self.send_tokens} reduce={self.reduce_tokens} "
                f"unroll={self.copy_unroll}/{self.reduce_unroll}")

    @classmethod
    def parse(cls, text: str) -> FusedConfig:
        """The configuration ``str()`` wrote (as a ``tune validate --json`` keeps it); one
        without ``senders=`` (written before the knob) ran with every CTA sending first."""
        match = re.fullmatch(r"ctas=(\d+)(?: senders=(\d+))? send=(\d+) reduce=(\d+) unroll=(\d+)/(\d+)",
                             text.strip())
        if match is None:
            raise MoELayerError(f"not a fused configuration (ctas=C senders=N send=S reduce=R unroll=U/V): {text!r}")
        ctas, senders, *rest = (None if v is None else int(v) for v in match.groups())
        return cls(ctas, *rest, send_ctas=ctas if senders is None else senders)


@dataclass(frozen=True)
class FusedSchedule:
    """The configuration a fused layer runs a call of ``tokens`` tokens with:
    ``configs[b - 1]`` for token bucket ``b`` (:func:`bucket`), the last for every larger
    bucket. One configuration: every call's."""

    configs: tuple[FusedConfig, ...]

    def __post_init__(self):
        if not self.configs or not all(isinstance(c, FusedConfig) for c in self.configs):
            raise MoELayerError(f"FusedSchedule needs FusedConfigs, got {self.configs!r}")

    def for_tokens(self, tokens: int) -> FusedConfig:
        return self.configs[min(bucket(tokens), len(self.configs)) - 1]

    def check_resident(self, resident: int) -> None:
        for config in self.configs:
            config.check_resident(resident)
