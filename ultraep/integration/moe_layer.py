"""``MoELayer``: a whole expert-parallel MoE layer -- dispatch, SwiGLU experts on the
grouped GEMM, combine -- optionally balanced by a :class:`~ultraep.integration.Balancer`,
in two calls a framework makes per micro-batch.

    layer = MoELayer(group, hidden=H, ffn=F, num_experts=E, top_k=K, max_tokens=T,
                     balancer=balancer, layer=0)         # balancer: None for plain EP
    layer.load_weights(w_up, w_down)                     # this rank's masters
    y, ctx = layer.forward(x, topk_ids, gates)           # x [T, H] bf16, ids/gates [T, K]
    dx, d_gates = layer.backward(ctx, dy)                # grads += into layer.grad_up/down

Experts are SwiGLU MLPs: ``act = silu(x @ w_up[:, :F]) * (x @ w_up[:, F:])``,
``y = act @ w_down``; BF16 weights and activations, FP32 accumulation and FP32 weight
gradients. The layer owns this rank's ``M`` masters as stacked tensors
(``w_up [M, H, 2F]``, ``w_down [M, F, H]`` and their gradients ``grad_up``, ``grad_down``;
DLPack-exportable, so a framework wraps them zero-copy as its parameters; read-only
attributes: written in place, never rebound).

Data flow of one micro-batch (the Dispatcher's receive buffer is expert-major: rows of
local slot ``j`` are ``offsets[j]:offsets[j + 1]``, masters ``j < M`` then replica slots):

* forward: when the layer balances (:attr:`MoELayer.balancing`), ``update`` ->
  ``weight_sync`` (on a stream of the layer's own, so the copies run beside reroute and
  dispatch, where each rank has its own GPU; in series on the caller's where ranks share
  one -- ``sync_beside`` --, started by the update right behind its plan) -> ``reroute``;
  ``dispatch``; then the
  weights of the replica slots the plan fills are copied behind the masters in the layer's
  stacked weights once they have landed (``FilledSlotCopy``: an empty slot gets no rows, so
  nothing reads its stale copy; the fused path copies them before its first kernel), so the
  whole receive buffer runs as one grouped GEMM per projection over ``M + S`` experts ->
  ``grouped_mm`` (up, FP32 out) -> SwiGLU (BF16) -> ``grouped_mm`` (down) -> ``combine``;
* backward: the layer's own copy of the replica weights serves it (``restore``, on the
  sync's stream, only where another forward of this layer has overwritten that copy and
  the Balancer's slots hold another plan's weights); ``combine_backward`` (row gradients
  and the gates' gradients) -> dgrad and wgrad of down -> SwiGLU backward -> dgrad and
  wgrad of up -> masters' gradients ``+=`` their rows' part, filled replica slots'
  gradients into the Balancer's replica gradient slots -> ``reduce_grads`` ->
  ``dispatch_backward`` (the input gradient).

Placement invariance: every step of a row's forward output and input gradient is a
function of that row alone (the grouped GEMM sums each element in one fixed order
whatever other rows share its tile, SwiGLU is elementwise, combine and dispatch_backward
sum in slot order), and a replica's weights are the master's bits. So the balanced
layer's outputs, input gradients and gate gradients are bitwise those of the unbalanced
one; a master's weight gradient differs only in being summed per instance, the partial
sums added in replica order (deterministic run to run).

SwiGLU's rounding is stated in ``raw_kernels/swiglu.cu``; :func:`swiglu` and
:func:`swiglu_backward` here are its NumPy reference and the host backend.

``fused=True`` runs the forward as UniEP's two persistent kernels (``raw_kernels/fused_moe.cu``:
dispatch + up-projection with SwiGLU in the epilogue, down-projection + combine), whose
task semantics :mod:`ultraep.compute.fused.forward` states in NumPy and runs on the host
backend; the outputs are bitwise the sequential path's. It keeps what the backward needs
as the sequential path does (the up tiles' FP32 sums ``h``, ``act``, the expert outputs
``y``); its backward runs the exchange of gradients and both dgrads as two persistent
kernels too (``raw_kernels/fused_moe_backward.cu``,
semantics in :mod:`ultraep.compute.fused.backward`), bitwise the sequential backward;
the weight gradients stay on the grouped wgrad.

The layer's own work runs on the caller's stream (``stream=``, else a torch input's
current stream, else CuPy's). The fused kernels replace the inside of :meth:`forward` and
:meth:`backward` (``fused=True``); the calls and the context stay.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ultraep.errors import BalancerError, ClosedError, CollectiveError, MoELayerError, everywhere
from ultraep.integration.balancer import BalanceHandle, Balancer, sync_beside_pays
from ultraep.integration.stats import DevicePhaseRecorder, HostPhaseRecorder
from ultraep.runtime.dlpack import caller_stream, external_stream, import_tensor
from ultraep.runtime import dtypes
from ultraep.runtime.dtypes import flush_subnormals, is_bool, is_int
from ultraep.runtime.group import EPGroup
from ultraep.runtime.kernels import kernel_constant
from ultraep.runtime.sm_partition import new_stream, usable_sms
from ultraep.token import Dispatcher
from ultraep.token.base import DispatchResult, check_tokens
from ultraep.transfer import ExpertSpec
from ultraep.transfer.slot_copy import FilledSlotCopy

if TYPE_CHECKING:  # imported where used: the fused kernels' package loads the grouped GEMM's
    from ultraep.compute.fused.config import FusedConfig, FusedSchedule

# ultraep.compute and the bf16 type (ml_dtypes) are imported at first use, so that the
# public API's import loads no optional package.
KERNELS = "swiglu.cu"
GEMM_KERNELS = "grouped_gemm.cu"
WEIGHT_NAMES = ("w_up", "w_down")


def expert_spec(hidden: int, ffn: int) -> ExpertSpec:
    """The expert of :class:`MoELayer` for a Balancer: ``w_up [H, 2F]``, ``w_down [F, H]``
    in BF16, FP32 gradients."""
    return ExpertSpec([("w_up", (hidden, 2 * ffn), "bfloat16"), ("w_down", (ffn, hidden), "bfloat16")],
                      grad_dtype="float32")


def can_replicate(balancer: Balancer, max_expert_load: int) -> bool:
    """Whether a plan of ``balancer`` can make any replica when no expert gets more than
    ``max_expert_load`` tokens in a call: both planners (``planner/quota.py``'s
    ``DomainOracle``, ``raw_kernels/planner.cu``) give a replica at least
    ``max(min_replica_tokens, 1)`` of its expert's tokens, in a free redundant slot, as a
    second instance at least."""
    layout = balancer.layout
    return (layout.redundant_slots > 0 and layout.max_instances > 1
            and max_expert_load >= max(balancer.min_replica_tokens, 1))


# -- SwiGLU: NumPy reference (the host backend) and the CUDA kernels ----------------------------
# exp_rn's FP32 constants, raw_kernels/swiglu.cuh's (a CPU test compares them).
EXP_INPUT_MIN, EXP_INPUT_MAX = np.float32("-86.0"), np.float32("88.75")
EXP_LOG2E = np.float32("1.442695")
EXP_ROUNDING_SHIFT = np.float32("12582912.0")
EXP_LN2_HI, EXP_LN2_LO = np.float32("0.69314575"), np.float32("1.4286068e-06")
EXP_P = tuple(np.float32(c) for c in ("0.49999994", "0.16666521", "0.04166839", "0.00836871", "0.0013814613"))


def fma32(a, b, c) -> np.ndarray:
    """``a * b + c`` of FP32 operands rounded once to FP32, as the device's ``__fmaf_rn``: in
    FP64 the product is exact (48 significant bits) and the sum's rounding error exact too
    (Knuth's two-sum); an inexact sum is rounded to odd (its last bit set, toward the exact
    value), which the rounding to FP32 then takes correctly -- a plain FP64 sum rounded twice
    could land on an FP32 tie and round the wrong way."""
    p = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    s = p + c
    t = s - p
    error = (p - (s - t)) + (c - t)
    bits = s.view(np.int64)
    with np.errstate(invalid="ignore"):  # NaN operands: the sum is NaN whatever its last bit
        even_and_inexact = (error != 0) & (bits & 1 == 0)
        toward = np.where((error > 0) == (s > 0), np.int64(1), np.int64(-1))  # away from 0 or back
    return np.where(even_and_inexact, bits + toward, bits).view(np.float64).astype(np.float32)


def exp_rn(x: np.ndarray) -> np.ndarray:
    """``exp(x)`` of FP32 ``x``, bit for bit ``raw_kernels/swiglu.cuh``'s ``exp_rn``: the
    same FP32 operations in the same order (NumPy's FP32 add and multiply are IEEE, rounded
    to nearest, never contracted; every constant is an FP32 scalar so nothing widens; the
    device's explicit FMAs are fma32)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"exp_rn takes float32, got {x.dtype}")
    clamped = np.minimum(np.maximum(x, EXP_INPUT_MIN), EXP_INPUT_MAX)  # NaN stays NaN, as on the device
    shifted = fma32(clamped, EXP_LOG2E, EXP_ROUNDING_SHIFT)
    k = shifted - EXP_ROUNDING_SHIFT
    r = fma32(-k, EXP_LN2_LO, fma32(-k, EXP_LN2_HI, clamped))
    poly = fma32(EXP_P[4], r, EXP_P[3])
    for coefficient in reversed(EXP_P[:3]):
        poly = fma32(poly, r, coefficient)
    exp_r = np.float32(1) + fma32(r * r, poly, r)
    # 2^(k-1) from exponent bits, in int32 where the device has unsigned: the same bits, and the
    # difference cannot wrap (NumPy warns when a scalar's does). A NaN's scale is anything: NaN.
    k_bits = shifted.view(np.int32) - EXP_ROUNDING_SHIFT.view(np.int32)
    half_scale = ((k_bits + np.int32(126)) << np.int32(23)).view(np.float32)
    with np.errstate(over="ignore"):  # exp(x) past FP32's range is inf, as on the device
        result = (exp_r * half_scale) * np.float32(2)
    return np.where(x < EXP_INPUT_MIN, np.float32(0), result)


def _sigmoid(a: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-a))`` in FP32 as ``raw_kernels/swiglu.cuh``'s ``sigmoid_rn`` (exp_rn
    never meets a subnormal that changes its result; a subnormal quotient is flushed), but
    for a NaN ``a``: NaN here, a number there. Only swiglu and swiglu_backward use it, whose
    every result multiplies it by ``a``, so is NaN on both."""
    return flush_subnormals(np.float32(1) / (np.float32(1) + exp_rn(-a)))


def swiglu(h: np.ndarray, rows: int) -> np.ndarray:
    """``act [len(h), F]`` BF16 from ``h [., 2F]`` FP32 (gate | up) over the first ``rows`` rows
    (the rest zero), rounded as ``raw_kernels/swiglu.cu`` states."""
    ffn = h.shape[1] // 2
    act = np.zeros((h.shape[0], ffn), dtype=dtypes.BFLOAT16)
    a, b = flush_subnormals(h[:rows, :ffn]), flush_subnormals(h[:rows, ffn:])
    act[:rows] = flush_subnormals(flush_subnormals(a * _sigmoid(a)) * b).astype(dtypes.BFLOAT16)
    return act


def swiglu_backward(h: np.ndarray, d_act: np.ndarray, rows: int) -> np.ndarray:
    """``dh [len(h), 2F]`` BF16 (d gate | d up) from ``h`` and ``d_act [., F]`` BF16 over the
    first ``rows`` rows (the rest zero)."""
    ffn = h.shape[1] // 2
    dh = np.zeros(h.shape, dtype=dtypes.BFLOAT16)
    f = flush_subnormals
    a, b = f(h[:rows, :ffn]), f(h[:rows, ffn:])
    g = f(d_act[:rows].astype(np.float32))
    s = _sigmoid(a)
    slope = f(s * f(np.float32(1) + f(a * f(np.float32(1) - s))))
    dh[:rows, :ffn] = f(f(g * b) * slope).astype(dtypes.BFLOAT16)
    dh[:rows, ffn:] = f(g * f(a * s)).astype(dtypes.BFLOAT16)
    return dh


class _DeviceSwiGLU:
    """``raw_kernels/swiglu.cu`` on the current stream; the row count stays on the device."""

    def __init__(self, device: int, group: EPGroup | None = None):
        import cupy

        from ultraep.runtime.kernels import get_function

        self.cp = cupy
        # With a group (collective), local rank 0 compiles into the disk cache first.
        self.forward_kernel = get_function(KERNELS, "swiglu_forward", group=group)
        self.backward_kernel = get_function(KERNELS, "swiglu_backward", group=group)
        self.threads = kernel_constant(KERNELS, "SWIGLU_THREADS")
        sms = usable_sms(device)
        self.blocks = sms * kernel_constant(KERNELS, "SWIGLU_BLOCKS_PER_SM")

    def forward(self, h, offsets, act) -> None:
        ffn = act.shape[1]
        self.forward_kernel((self.blocks,), (self.threads,), (
            h, offsets, np.int32(offsets.shape[0] - 1), np.int64(h.shape[0]), np.int32(ffn), act))

    def backward(self, h, d_act, offsets, dh) -> None:
        ffn = d_act.shape[1]
        self.backward_kernel((self.blocks,), (self.threads,), (
            h, d_act, offsets, np.int32(offsets.shape[0] - 1), np.int64(h.shape[0]), np.int32(ffn), dh))


@dataclass
class MoEContext:
    """What :meth:`MoELayer.backward` needs of one forward (used once)."""

    handle: BalanceHandle | None  # the Balancer's plan of this micro-batch, or None
    received: DispatchResult      # receive buffer, offsets and the Dispatcher's handle
    h: Any                        # up-projection, FP32 [max_recv_rows, 2F]
    act: Any                      # SwiGLU output, BF16 [max_recv_rows, F]
    y: Any                        # expert outputs, BF16 [max_recv_rows, H]
    generation: int               # which forward last filled the layer's replica weights
    tokens: int                   # this rank's tokens in the forward
    tile_plan: Any = None         # fused: this forward's TilePlan (every rank's tile geometry, this rank's order)
    done: bool = False
    for_backward: bool = True     # False: the forward ran with backward=False (nothing kept for one)
    layer_id: int = -1            # MoELayer.id of the layer whose forward made it


def _raise_everywhere(group: EPGroup, error: BaseException | None, what: str, **agree) -> None:
    """Collective: every rank raises MoELayerError naming each failing rank's error (or,
    given ``agree=value``, where the ranks' values differ)."""
    try:
        group.raise_if_any(error, what, **agree)
    except CollectiveError as collective:
        raise everywhere(MoELayerError(str(collective))) from error


def _open_fused_heap(group: EPGroup, common: dict, slots: dict, layer: int):
    """Collective: a heap with room for the Dispatcher's tensors and the fused layer's flags."""
    from ultraep.compute.fused.forward import heap_requirements
    from ultraep.runtime import open_heap

    settings = {k: v for k, v in common.items() if k not in ("timeout_s", "sync_checks", "heap", "backend")}
    token = Dispatcher.heap_requirements(group.size, **slots, **settings)
    rows = dict((name, shape) for name, shape, _ in token.tensors)["token.row_weight"][0]
    spr = slots.get("experts_per_rank", slots["num_experts"] // group.size)
    return open_heap(group, token + heap_requirements(hidden=common["hidden"], max_recv_rows=rows,
                                                      slots_per_rank=spr, layer=layer), backend=common["backend"])


def _fused_schedule(layer: "MoELayer", fused_config) -> FusedSchedule:
    """Collective: the fused kernels' configuration per token bucket (``MoELayer``'s
    ``fused_config``), every grid checked against the CTAs resident on every rank."""
    from ultraep.compute.fused.config import FusedConfig, FusedSchedule
    from ultraep.tune.search import agreed_fused_schedule

    error, schedule, d = None, None, layer.dispatcher.config
    try:
        if fused_config is None:  # tuned on the device; the host runs one worker: nothing to tune
            fused_config = "tuned" if layer.backend == "device" else "constants"
        if isinstance(fused_config, FusedConfig):
            schedule = FusedSchedule((fused_config,))
        elif not isinstance(fused_config, str) or fused_config not in ("tuned", "constants"):
            raise MoELayerError(f"fused_config must be None, 'tuned', 'constants' or a FusedConfig, "
                                f"got {fused_config!r}")
        elif fused_config == "constants":  # the source's task sizes on every resident CTA (one worker on the host)
            schedule = FusedSchedule((FusedConfig(1 if layer.backend == "host" else _resident_ctas(layer)),))
    except MoELayerError as exc:
        error = exc
    try:  # one schedule on every rank: the kernel variants are loaded collectively
        layer.group.raise_if_any(error, "MoELayer fused_config", agree=repr(fused_config))
    except CollectiveError as collective:
        raise everywhere(MoELayerError(str(collective))) from error
    if schedule is None:
        schedule = agreed_fused_schedule(layer.group, layer.backend, max_tokens=d.max_tokens, hidden=layer.hidden,
                                         ffn=layer.ffn, top_k=layer.top_k, experts=d.experts_per_rank * d.size)
    if layer.backend == "device":
        try:
            schedule.check_resident(_resident_ctas(layer))
        except MoELayerError as exc:
            error = exc
        _raise_everywhere(layer.group, error, "MoELayer fused_config")
    return schedule


def _resident_ctas(layer: "MoELayer") -> int:
    from ultraep.compute.fused.device import resident_ctas
    return resident_ctas(layer.group.device)


def _fused_forward(layer: "MoELayer", heap, timeout_s: float, fused_config):
    """The fused forward of ``layer`` on its backend, its flags allocated in ``heap``."""
    from ultraep.compute.fused.forward import HEAP_PREFIX, heap_requirements

    d = layer.dispatcher.config
    requirements = heap_requirements(hidden=layer.hidden, max_recv_rows=d.max_recv_rows,
                                     slots_per_rank=d.experts_per_rank, layer=layer.layer)
    prefix = f"{HEAP_PREFIX}{layer.layer}."
    flags = {name.removeprefix(prefix): tensor for name, tensor in heap.allocate(requirements).items()}
    schedule = _fused_schedule(layer, fused_config)
    if layer.backend == "device":
        import cupy

        from ultraep.compute.fused.device import DeviceFusedForward
        with cupy.cuda.Device(layer.group.device):
            return DeviceFusedForward(layer.group, layer.dispatcher, flags, hidden=layer.hidden, ffn=layer.ffn,
                                      timeout_s=timeout_s, schedule=schedule)
    from ultraep.compute.fused.host import HostFusedForward
    return HostFusedForward(layer.group, layer.dispatcher, flags, ffn=layer.ffn, timeout_s=timeout_s,
                            activation=swiglu, schedule=schedule)


def _bits(array):
    """The 16-bit pattern of a BF16 array (copies between BF16 buffers never convert values)."""
    return array.view(np.int16)


def _slot_bytes(stacked, first: int):
    """uint8 ``[slots, bytes]`` of the experts ``first:`` of a stacked ``[experts, ...]`` array."""
    tail = stacked[first:]
    return tail.view(np.uint8).reshape(tail.shape[0], -1)


class _WgradScratch:
    """The replica slots' weight gradients ``[S, ...]`` (FP32) a backward computes (the
    masters' are added into ``grad_up`` / ``grad_down`` by the GEMM itself): kept, since a
    replica-slot copy reads them through fixed pointers, and shared by every layer of one
    shape on one device, so ``L`` layers hold one set. A backward on another stream than
    the previous user's waits for that use's end (an event)."""

    _shared = weakref.WeakValueDictionary()  # (device, slots, hidden, ffn) -> scratch; layers hold it

    @classmethod
    def of(cls, layer: "MoELayer") -> "_WgradScratch":
        key = (layer.device, layer.slots, layer.hidden, layer.ffn)
        scratch = cls._shared.get(key)
        if scratch is None:
            scratch = cls._shared[key] = cls(layer.xp, *key[1:], on_device=layer.device is not None)
        return scratch

    def __init__(self, xp, slots: int, hidden: int, ffn: int, *, on_device: bool):
        self.up = xp.empty((slots, hidden, 2 * ffn), np.float32)
        self.down = xp.empty((slots, ffn, hidden), np.float32)
        self._xp, self._done, self._done_on = xp, None, None
        if on_device:
            self._done = xp.cuda.Event(disable_timing=True)

    def acquire(self) -> None:
        """The current stream's later work waits for the last user's (device)."""
        if self._done is not None and self._done_on is not None:
            stream = self._xp.cuda.get_current_stream()
            if stream.ptr != self._done_on:
                stream.wait_event(self._done)

    def release(self) -> None:
        """The current stream's work so far is the last use."""
        if self._done is not None:
            stream = self._xp.cuda.get_current_stream()
            self._done.record(stream)
            self._done_on = stream.ptr


class _OwnBuffer:
    """An array the layer set up and keeps writing (its masters' weights and gradients; the
    Balancer adds the replicas' gradients into the arrays registered with it), exported as a
    read-only attribute: rebinding the name would leave the layer writing the old array,
    silently (a fresh ``grad_up`` would miss the replicas' parts)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_own_{name}"

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        return self if layer is None else getattr(layer, self.slot)

    def __set__(self, layer: Any, value: Any) -> None:
        raise MoELayerError(f"MoELayer.{self.name} is the layer's own array and cannot be replaced: write into it "
                            f"in place ({self.name}[...] = ...; zero_grads() zeroes the gradients)")


class MoELayer:
    """One MoE layer of this rank (module docstring). Collective: every rank constructs it
    with the same arguments and makes the same calls in the same order.

    ``balancer``: a :class:`Balancer` built with ``MoELayer.expert_spec(hidden, ffn)`` over a
    layout of ``num_experts`` experts on this group; the layer registers its masters as
    the Balancer's virtual layer ``layer`` (when it balances, below) and shares its
    backend. Without one, tokens go to the masters. ``heap``: a symmetric heap for the
    Dispatcher (see :meth:`Dispatcher.heap_requirements`; with ``fused``, set up with
    ``expert_output=True``, plus :func:`ultraep.compute.fused.forward.heap_requirements`), else
    it opens its own.
    ``fused``: the forward as the fused persistent kernels (module docstring). ``fused_config``
    (with ``fused``): ``"tuned"``, the model's best :class:`~ultraep.compute.fused.config.FusedConfig`
    per 4096-token bucket up to ``max_tokens`` (``ultraep.tune.search``, from rank 0's machine
    profile, measured once and cached: the first fused layer on a machine measures it);
    ``"constants"``, the kernel source's task sizes on every resident CTA; a ``FusedConfig``
    for every call; None (default): tuned on the device, the constants on the host (one
    worker: nothing to tune). The fused backward runs on the forward's CTAs for its tokens,
    with the source's task sizes. No choice changes a result bit.
    ``max_recv_rows``, ``timeout_s``, ``sync_checks``: the Dispatcher's.
    ``sync_beside`` (GPU, when the layer balances): True runs the Balancer's ``weight_sync``
    and ``restore`` on a stream of the layer's own, beside reroute, dispatch and the masters'
    compute; False on the caller's stream, in series with them (the forward's sync started by
    ``update(weight_sync=True)``, behind the plan); ``"auto"`` (default) beside
    where every rank has a GPU of its own, in series where ranks share one
    (:func:`~ultraep.integration.sync_beside_pays`: under MPS the stream beside slows every
    launch of the layer's). No choice changes a result bit.

    ``topk_ids``: a token's ``K`` ids are distinct experts (as a router's top-k), so an expert
    gets at most ``group.size * max_tokens`` tokens a call. Where that is below the
    smallest replica the Balancer may make (``max(min_replica_tokens, 1)``, e.g. decode
    under ``min_replica_tokens="auto"``), or its layout has no room for a replica, no plan
    could ever replicate: the layer then does not balance (:attr:`balancing` is False,
    decided at set-up) and runs as the unbalanced layer, never calling the Balancer --
    the same bits, without its per-call cost.
    """

    expert_spec = staticmethod(expert_spec)
    _next_id = 0
    # (Balancer.id, layer) -> the open MoELayer registered there: a second would replace its masters
    _balancer_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    w_up, w_down, grad_up, grad_down = _OwnBuffer(), _OwnBuffer(), _OwnBuffer(), _OwnBuffer()

    def __init__(self, group: EPGroup, *, hidden: int, ffn: int, num_experts: int, top_k: int, max_tokens: int,
                 balancer: Balancer | None = None, layer: int = 0, max_recv_rows: int | None = None,
                 backend: str = "auto", heap: Any = None, timeout_s: float = 30.0, sync_checks: bool = True,
                 fused: bool = False, fused_config: FusedConfig | str | None = None, sync_beside: bool | str = "auto"):
        if not isinstance(group, EPGroup):  # no collective can report it: this rank's own error
            raise MoELayerError(f"group must be an ultraep.EPGroup, got {type(group).__name__}")
        error = None
        try:
            self._check_set_up(group, hidden, ffn, num_experts, top_k, max_tokens, balancer, layer, backend)
            if not is_bool(fused):
                raise MoELayerError(f"fused must be a bool, got {fused!r}")
            if not (is_bool(sync_beside) or (isinstance(sync_beside, str) and sync_beside == "auto")):
                raise MoELayerError(f"sync_beside must be a bool or 'auto', got {sync_beside!r}")
            if fused_config is not None and not fused:
                raise MoELayerError("fused_config is set but fused=False: it configures the fused kernels")
        except MoELayerError as exc:
            error = exc
        _raise_everywhere(group, error, "MoELayer set-up")
        beside_pays = sync_beside_pays(group)  # collective: every rank asks, whatever it passed
        group.agree((int(hidden), int(ffn), int(num_experts), int(top_k), int(max_tokens), balancer is not None,
                     int(layer), bool(fused)),
                    "MoELayer set-up (hidden, ffn, num_experts, top_k, max_tokens, balanced, layer, fused)")
        self.group, self.balancer, self.layer = group, balancer, int(layer)
        self.hidden, self.ffn, self.num_experts, self.top_k = int(hidden), int(ffn), int(num_experts), int(top_k)
        self.experts_per_rank = self.num_experts // group.size
        # An expert's load in a call is at most group.size * max_tokens (a token's K ids are distinct experts).
        # Agreed values only: every rank decides alike, so none skips a collective another runs.
        self._balancing = balancer is not None and can_replicate(balancer, group.size * int(max_tokens))
        self.slots = balancer.layout.redundant_slots if self._balancing else 0
        common = dict(hidden=self.hidden, dtype="bfloat16", top_k=self.top_k, max_tokens=max_tokens,
                      max_recv_rows=max_recv_rows, timeout_s=timeout_s, sync_checks=sync_checks, heap=heap,
                      backend=balancer.backend if balancer is not None else backend)
        slots = dict(num_experts=self.num_experts) if not self._balancing else \
            dict(num_experts=balancer.layout.num_physical, experts_per_rank=balancer.layout.slots_per_rank)
        self._fused, self._fused_bwd, self._owned_heap = None, None, None
        self._recording = False  # record_timeline's: the backward launcher, made later, takes it at its making
        self._phase_recorders: dict | None = None  # record_phases': direction -> its phase recorder
        self._phase_recorder = None  # the running call's, if it records
        if fused:
            common["expert_output"] = True
            if heap is None:
                common["heap"] = self._owned_heap = _open_fused_heap(group, common, slots, self.layer)
        try:
            self.dispatcher = Dispatcher(group, **slots, **common)
        except BaseException as exc:
            if self._owned_heap is not None:  # a lone failure is published, not waited out
                self._owned_heap.close_failing(exc)
            raise
        self.backend = self.dispatcher.backend
        self.device = group.device if self.backend == "device" else None
        self._closed = False
        try:
            if fused:
                self._fused = _fused_forward(self, self.dispatcher.heap, timeout_s, fused_config)
            self._swiglu = self._load_swiglu()  # collective: before the allocation, whose failure on one rank
            allocation_error = None             # the others must meet in the next collective, not in this one
            try:
                self._allocate()
            except Exception as exc:  # e.g. MemoryError, on every rank alike or not: every rank is told
                allocation_error = exc
            _raise_everywhere(group, allocation_error, "MoELayer weights and buffers")
            if self._balancing:
                M = self.experts_per_rank
                balancer.register_layer(self.layer, [[self._w_up[m], self._w_down[m]] for m in range(M)],
                                        [[self.grad_up[m], self.grad_down[m]] for m in range(M)])
        except BaseException as exc:
            self._closed = True
            self._give_up(exc)  # a lone failure is published to the peers, not waited out
            raise
        self.id = MoELayer._next_id
        MoELayer._next_id += 1
        if self._balancing:
            MoELayer._balancer_layers[(balancer.id, self.layer)] = self
        self._generation = 0  # forwards that filled the replica part of the stacked weights
        self._weight_copy = self._grad_copy = self._wgrad = None  # made at first use
        # the replica weights' transfers run beside dispatch (GPU; the Balancer orders the streams by events),
        # else (None) on the caller's stream
        self._sync_stream = None
        if isinstance(sync_beside, str):  # "auto"
            sync_beside = beside_pays
        if self.device is not None and self._balancing and sync_beside:
            with self.xp.cuda.Device(self.device):
                self._sync_stream = new_stream(self.device)

    @property
    def sync_beside(self) -> bool:
        """Whether the layer's ``weight_sync`` and ``restore`` run on a stream of its own,
        beside its kernels (``sync_beside`` resolved; False where the layer does not balance)."""
        return self._sync_stream is not None

    @property
    def balancing(self) -> bool:
        """Whether the layer balances: it has a Balancer whose plans can make a replica for
        its calls (class docstring); False: tokens go to the masters."""
        return self._balancing

    @staticmethod
    def _check_set_up(group, hidden, ffn, num_experts, top_k, max_tokens, balancer, layer, backend) -> None:
        for name, value, low in (("hidden", hidden, 1), ("ffn", ffn, 1), ("num_experts", num_experts, 1),
                                 ("top_k", top_k, 1), ("max_tokens", max_tokens, 1), ("layer", layer, 0)):
            if not is_int(value) or value < low:
                raise MoELayerError(f"{name} must be an int >= {low}, got {value!r}")
        if num_experts % group.size:
            raise MoELayerError(f"num_experts ({num_experts}) must be a multiple of the group size ({group.size})")
        if top_k > num_experts:
            raise MoELayerError(f"top_k ({top_k}) exceeds num_experts ({num_experts}): a token's top-k experts are "
                                "distinct experts")
        align = kernel_constant(GEMM_KERNELS, "GG_ALIGN_ELEMENTS")
        if hidden % align or ffn % align:
            raise MoELayerError(f"hidden ({hidden}) and ffn ({ffn}) must be multiples of {align} (the grouped GEMM's "
                                "rows are whole 16-byte chunks)")
        if balancer is None:
            return
        if not isinstance(balancer, Balancer):
            raise MoELayerError(f"balancer must be an ultraep.Balancer, got {type(balancer).__name__}")
        if balancer.layout.num_experts != num_experts or balancer.layout.num_ranks != group.size:
            raise MoELayerError(f"the balancer's layout has {balancer.layout.num_experts} experts on "
                                f"{balancer.layout.num_ranks} ranks, the layer {num_experts} on {group.size}")
        if balancer.spec.key() != expert_spec(hidden, ffn).key():
            raise MoELayerError(f"the balancer's expert spec {balancer.spec!r} is not the layer's "
                                f"{expert_spec(hidden, ffn)!r} (build it with MoELayer.expert_spec(hidden, ffn))")
        if layer >= balancer.num_layers:
            raise MoELayerError(f"layer must be an int in [0, {balancer.num_layers}) (the balancer's num_layers), "
                                f"got {layer!r}")
        balancing = can_replicate(balancer, group.size * int(max_tokens))  # as __init__ decides
        if balancing and (balancer.id, int(layer)) in MoELayer._balancer_layers:
            raise MoELayerError(f"layer {layer} of the balancer belongs to another open MoELayer (registering this "
                                "one's masters there would replace its): pass another layer, or close that one first")
        if not isinstance(backend, str) or backend not in ("auto", balancer.backend):
            raise MoELayerError(f"backend={backend!r} contradicts the balancer's backend {balancer.backend!r}")

    def _load_swiglu(self) -> _DeviceSwiGLU | None:
        """The device's SwiGLU kernels (collective: local rank 0 compiles them first), None on the host."""
        if self.device is None:
            return None
        import cupy

        with cupy.cuda.Device(self.device):
            return _DeviceSwiGLU(self.device, self.group)

    def _allocate(self) -> None:
        """Stacked weights of the masters and, behind them, copies of the replica slots (this
        rank's alone: no collective)."""
        M, S, H, F = self.experts_per_rank, self.slots, self.hidden, self.ffn
        if self.device is None:
            self.xp, weight_dtype = np, dtypes.BFLOAT16
        else:
            import cupy

            self.xp, weight_dtype = cupy, dtypes.cupy_dtype(dtypes.BFLOAT16)
        with self._on_device():
            self._w_up = self.xp.zeros((M + S, H, 2 * F), dtype=weight_dtype)
            self._w_down = self.xp.zeros((M + S, F, H), dtype=weight_dtype)
            self._own_grad_up = self.xp.zeros((M, H, 2 * F), dtype=np.float32)
            self._own_grad_down = self.xp.zeros((M, F, H), dtype=np.float32)
        self._own_w_up, self._own_w_down = self._w_up[:M], self._w_down[:M]

    # -- streams --------------------------------------------------------------------------
    def _on_device(self):
        if self.device is None:
            return contextlib.nullcontext()
        return self.xp.cuda.Device(self.device)

    @contextlib.contextmanager
    def _on_stream(self, stream, tensor):
        """The caller's stream as CuPy's current one: ``stream``, else ``tensor``'s framework's."""
        if self.device is None:
            yield
            return
        cupy = self.xp
        with cupy.cuda.Device(self.device):
            if stream is None:
                with caller_stream(tensor):
                    yield
            elif type(stream).__module__.startswith("cupy"):
                with stream:
                    yield
            else:
                raw = cupy.cuda.ExternalStream(stream, self.device) if isinstance(stream, int) else \
                    external_stream(cupy, stream, self.device)
                with raw:
                    yield

    # -- weights ----------------------------------------------------------------------------
    def _check_open(self, collective: str | None = None) -> None:
        """ClosedError once closed; in a ``collective`` call after entering one collective
        (EPGroup.refuse_closed), so that peers still calling it raise at once -- a layer on a
        caller's heap closes without a collective of its own."""
        if not self._closed:
            return
        error = ClosedError(f"rank {self.group.rank}: the MoELayer is closed")
        if collective is not None:
            self.group.refuse_closed(error, f"MoELayer.{collective} on a closed MoELayer")
        raise error

    def load_weights(self, w_up: Any, w_down: Any) -> None:
        """Copy this rank's masters in: ``w_up [M, H, 2F]``, ``w_down [M, F, H]`` BF16 (torch,
        JAX, CuPy or NumPy). Collective: bad input raises on every rank, nothing copied."""
        self._check_open("load_weights")
        error, arrays = None, None
        try:
            arrays = [self._import_weight(name, tensor, target)
                      for name, tensor, target in (("w_up", w_up, self.w_up), ("w_down", w_down, self.w_down))]
        except MoELayerError as exc:
            error = exc
        _raise_everywhere(self.group, error, "MoELayer.load_weights")
        with self._on_stream(None, w_up):
            for array, target in zip(arrays, (self.w_up, self.w_down)):
                _bits(target)[...] = _bits(self.xp.asarray(array))

    def _import(self, name: str, tensor):
        try:
            array = import_tensor(tensor, name=name, device=self.device)
        except ValueError as exc:
            raise MoELayerError(str(exc)) from None
        return array if name in ("topk_ids", "gates") else dtypes.bf16_typed(array)  # bf16 as its bits: bits

    def _raise(self, error: BaseException | None, what: str, **agree) -> None:
        """On every rank with ``sync_checks`` (the Dispatcher's), else this rank's own."""
        if self.dispatcher.sync_checks:
            _raise_everywhere(self.group, error, what, **agree)
        elif error is not None:
            raise error

    def _import_weight(self, name, tensor, target):
        from ultraep.compute.checks import is_bf16

        array = self._import(name, tensor)
        if tuple(array.shape) != tuple(target.shape):
            raise MoELayerError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(array.shape)}")
        if not is_bf16(array.dtype):
            raise MoELayerError(f"{name}: expected bfloat16, got {np.dtype(array.dtype)}")
        return array

    def zero_grads(self) -> None:
        """Set ``grad_up`` and ``grad_down`` to zero (backward adds into them)."""
        self._check_open()
        with self._on_device():
            self.grad_up.fill(0)
            self.grad_down.fill(0)

    def _fill_replicas(self, handle: BalanceHandle) -> None:
        """Copy the replica slots' weights (as synced for ``handle``) behind the masters, on
        the current stream once it has waited for every slot -- only the slots the plan
        fills: an empty slot gets no rows, so no GEMM reads its weights."""
        transfer = self.balancer.transfer
        if self._weight_copy is None:
            M = self.experts_per_rank
            self._weight_copy = FilledSlotCopy(
                [(transfer.replica_bytes("weights", t), _slot_bytes(w, M)) for t, w in enumerate((self._w_up,
                                                                                                  self._w_down))],
                self.slots, device=self.device)
        self.balancer.wait_replica(handle)
        self._weight_copy(transfer.replica_entries(self.balancer.plan(handle)))

    # -- the layer ----------------------------------------------------------------------------
    def forward(self, x: Any, topk_ids: Any, gates: Any, *, stream: Any = None,
                backward: bool = True) -> tuple[Any, MoEContext]:
        """Collective. ``x [T, H]`` BF16, ``topk_ids [T, K]`` logical expert ids, ``gates [T, K]``
        float32; returns ``(y [T, H] BF16, ctx)``: the gate-weighted sum of each token's K
        experts (slot order, FP32 accumulation) and the context for :meth:`backward`.
        ``backward=False``: none will follow (inference); the fused forward then keeps
        neither ``h`` nor the expert outputs (less time and memory) and the context refuses
        :meth:`backward`."""
        from ultraep.compute import grouped_mm

        self._check_open("forward")
        error, arrays = None, None
        try:
            if not is_bool(backward):
                raise MoELayerError(f"forward: backward must be a bool, got {backward!r}")
            backward = bool(backward)
            arrays = [self._import(name, tensor) for name, tensor in (("x", x), ("topk_ids", topk_ids),
                                                                      ("gates", gates))]
        except MoELayerError as exc:
            error = exc
        self._raise(error, "MoELayer.forward input")
        check_tokens(self.group, self.dispatcher.config, *arrays)  # before the Balancer plans anything
        tokens = arrays[0].shape[0]
        with self._on_stream(stream, x), self._recording_phases("forward"):
            handle, ids = None, topk_ids
            if self._balancing:
                # in series, the update starts the sync right behind its plan (inside its CUDA graph)
                handle = self.balancer.update(self.layer, topk_ids, stream=stream,
                                              weight_sync=self._sync_stream is None)
                self._mark("update")
                self.balancer.weight_sync(handle, stream=self._sync_stream)
                self._mark("weight_sync")
                ids = self.balancer.reroute(handle, stream=stream)  # the update rerouted topk_ids already
                self._mark("reroute")
                self._generation += 1
            if self._fused is not None:
                if handle is not None:  # kernel A's up tiles read every slot's weights from its start
                    self._fill_replicas(handle)
                    self._mark("replicas")
                routed = arrays[1] if handle is None else self._import("topk_ids", ids)  # rerouted: the plan's ids
                out, received, act, h, y, tile_plan = self._fused.forward(
                    arrays[0], routed, arrays[2], self._w_up, self._w_down, keep=backward)
                self._mark("fused")
                return out, MoEContext(handle, received, h, act, y, self._generation, tokens, tile_plan=tile_plan,
                                       for_backward=backward, layer_id=self.id)
            received = self.dispatcher.dispatch(x, ids, gates)
            self._mark("dispatch")
            if handle is not None:  # the sync ran beside dispatch; the GEMMs read the replicas
                self._fill_replicas(handle)
                self._mark("replicas")
            offsets, xp = received.offsets, self.xp
            rows = received.x.shape[0]
            h = grouped_mm(received.x, self._w_up, offsets, out=xp.empty((rows, 2 * self.ffn), np.float32))
            self._mark("up")
            act = self._swiglu_forward(h, offsets)
            self._mark("swiglu")
            y = grouped_mm(act, self._w_down, offsets)
            self._mark("down")
            out = self.dispatcher.combine(y, received.handle)
            self._mark("combine")
        return out, MoEContext(handle, received, h, act, y, self._generation, tokens, for_backward=backward,
                               layer_id=self.id)

    def backward(self, ctx: MoEContext, dy: Any, *, stream: Any = None) -> tuple[Any, Any]:
        """Collective. ``dy [T, H]`` (the output's gradient); returns ``(dx [T, H] BF16,
        d_gates [T, K] float32)`` and adds the weight gradients into ``grad_up`` /
        ``grad_down`` (this rank's rows by the grouped wgrad's own adds, which flush subnormal
        sums to zero as the GPU's memory adds; replicas' through ``reduce_grads``).
        Each context once; a layer's micro-batches in any order its Balancer's ring allows."""
        from ultraep.compute import grouped_mm_dgrad
        from ultraep.compute.checks import is_bf16

        self._check_open("backward")
        error = None
        try:
            if not isinstance(ctx, MoEContext):
                raise MoELayerError(f"backward needs the context forward returned, got {type(ctx).__name__}")
            if ctx.layer_id != self.id:
                raise MoELayerError("this context comes from another MoELayer's forward: pass it to that layer's "
                                    "backward")
            if ctx.done:
                raise MoELayerError("this context's backward has run already (its gradients were added once)")
            if not ctx.for_backward:
                raise MoELayerError("this context's forward ran with backward=False: it kept nothing for a backward")
            if ctx.handle is not None:
                self.balancer.holds_replicas(ctx.handle)  # StaleHandleError once the layer's plan ring has wrapped
            grad = self._import("dy", dy)
            if tuple(grad.shape) != (ctx.tokens, self.hidden) or not is_bf16(grad.dtype):
                raise MoELayerError(f"dy: expected bfloat16 [{ctx.tokens}, {self.hidden}] (the forward's tokens), "
                                    f"got {np.dtype(grad.dtype)} {list(grad.shape)}")
        except (MoELayerError, BalancerError, ClosedError) as exc:
            error = exc
        # before any restore or launch; every rank passes the same micro-batch's context
        micro_batch = ctx.received.handle.micro_batch if error is None else None
        self._raise(error, "MoELayer.backward input", agree=micro_batch)
        ctx.done = True
        received, offsets = ctx.received, ctx.received.offsets
        with self._on_stream(stream, dy), self._recording_phases("backward"):
            replica_entries = self._replica_grads(ctx)
            self._mark("replica_grads")
            fused = self._fused_backward()
            if fused is not None:  # the gradients' exchange and both dgrads in two persistent kernels
                self._refill_replicas(ctx)
                self._mark("refill")
                dx, d_gates, grad_y, dh = fused.backward(grad, received, ctx.tile_plan, ctx.h, ctx.y, self._w_up,
                                                         self._w_down)
                self._mark("fused")
            else:
                grad_y, d_gates = self.dispatcher.combine_backward(dy, ctx.y, received.handle)
                self._mark("combine_backward")
                self._refill_replicas(ctx)  # a restore ran beside combine_backward; the dgrads read the replicas
                self._mark("refill")
                d_act = grouped_mm_dgrad(grad_y, self._w_down, offsets)
                self._mark("dgrad_down")
                dh = self._swiglu_backward(ctx.h, d_act, offsets)
                self._mark("swiglu_backward")
                d_recv = grouped_mm_dgrad(dh, self._w_up, offsets)
                self._mark("dgrad_up")
            wgrad = self._wgrad_scratch()
            wgrad.acquire()
            self._weight_grads(ctx.act, grad_y, received.x, dh, offsets, wgrad)
            if ctx.handle is not None:  # the replica slots' gradients: only those the plan fills are read
                self._grad_copy(replica_entries)
                self._mark("grad_copy")
                self.balancer.reduce_grads(ctx.handle, stream=stream)
                self._mark("reduce_grads")
            wgrad.release()
            if fused is None:
                dx = self.dispatcher.dispatch_backward(d_recv, received.handle)
                self._mark("dispatch_backward")
        return dx, d_gates

    def _weight_grads(self, act, grad_y, x, dh, offsets, wgrad: _WgradScratch) -> None:
        """A backward's weight gradients: this rank's experts' added into ``grad_up`` /
        ``grad_down`` by the grouped wgrad itself, the replica slots' into ``wgrad`` (they wait
        there for ``reduce_grads``)."""
        from ultraep.compute import grouped_mm_wgrad

        grouped_mm_wgrad(act, grad_y, offsets, out=wgrad.down, add_to=self.grad_down)
        self._mark("wgrad_down")
        grouped_mm_wgrad(x, dh, offsets, out=wgrad.up, add_to=self.grad_up)
        self._mark("wgrad_up")

    def _fused_backward(self):
        """The fused backward over the fused forward's flags (made at the first backward), or None."""
        if self._fused is None or self._fused_bwd is not None:
            return self._fused_bwd
        if self.backend == "device":
            from ultraep.compute.fused.device import DeviceFusedBackward
            self._fused_bwd = DeviceFusedBackward(self._fused)
        else:
            from ultraep.compute.fused.host import HostFusedBackward
            self._fused_bwd = HostFusedBackward(self._fused, activation=swiglu_backward)
        self._fused_bwd.record_timeline(self._recording)
        return self._fused_bwd

    def _wgrad_scratch(self) -> _WgradScratch:
        if self._wgrad is None:
            self._wgrad = _WgradScratch.of(self)
        return self._wgrad

    def _replica_grads(self, ctx: MoEContext):
        """The plan's entries of this rank's replica slots, once the Balancer's replica
        gradient slots hold ``ctx``'s (None when the forward did not balance). The layer's
        copy of the replica weights serves the backward; only where another forward of this
        layer has overwritten it, and the Balancer's slots hold another handle's weights,
        are they restored (on the layer's sync stream) for the refill."""
        if ctx.handle is None:
            return None
        if ctx.generation != self._generation and not self.balancer.holds_replicas(ctx.handle):
            self.balancer.restore(ctx.handle, stream=self._sync_stream)
        self.balancer.replica_grads(ctx.handle)
        transfer = self.balancer.transfer
        if self._grad_copy is None:
            wgrad = self._wgrad_scratch()
            self._grad_copy = FilledSlotCopy(
                [(_slot_bytes(g, 0), transfer.replica_bytes("grads", t)) for t, g in enumerate((wgrad.up, wgrad.down))],
                self.slots, device=self.device)
        return transfer.replica_entries(self.balancer.plan(ctx.handle))

    def _refill_replicas(self, ctx: MoEContext) -> None:
        """Refill the layer's copy of the replica weights (waiting for them) when another
        forward of this layer has overwritten it since ``ctx``'s."""
        if ctx.handle is not None and ctx.generation != self._generation:
            self._fill_replicas(ctx.handle)
            self._generation += 1
            ctx.generation = self._generation

    def _swiglu_forward(self, h, offsets):
        if self._swiglu is None:
            return swiglu(h, int(offsets[-1]))
        act = self.xp.empty((h.shape[0], self.ffn), dtype=self._w_up.dtype)
        self._swiglu.forward(h, offsets, act)
        return act

    def _swiglu_backward(self, h, d_act, offsets):
        if self._swiglu is None:
            return swiglu_backward(h, d_act, int(offsets[-1]))
        dh = self.xp.empty(h.shape, dtype=self._w_up.dtype)
        self._swiglu.backward(h, self.xp.asarray(d_act), offsets, dh)
        return dh

    def record_phases(self, enable: bool = True) -> None:
        """Whether later forwards and backwards record how long each of their steps takes on
        this rank's stream (update, weight_sync, reroute, dispatch, replicas, up, swiglu, down,
        combine; backward: replica_grads, combine_backward, refill, dgrad_down,
        swiglu_backward, dgrad_up, wgrad_down, wgrad_up, grad_copy, reduce_grads,
        dispatch_backward; a fused layer's kernels as one step, fused), read by
        :meth:`phases`. A step's time is its stream's from the step before it to its own end:
        a step that waits for peers or for a sync on another stream counts the wait. Off by
        default (an event per step); turning it off drops the calls not yet read."""
        self._check_open()
        if not is_bool(enable):
            raise MoELayerError(f"record_phases: enable must be a bool, got {enable!r}")
        if not enable:
            self._phase_recorders = None
        elif self._phase_recorders is None:
            recorder = HostPhaseRecorder if self.device is None else DevicePhaseRecorder
            self._phase_recorders = {d: recorder() for d in ("forward", "backward")}

    def phases(self, direction: str = "forward") -> list[dict]:
        """The recorded ``direction`` ("forward" or "backward") calls since recording began or
        since the last read, oldest first, each ``{step: ms}`` in the steps' order; waits for
        the device. Empty without :meth:`record_phases`."""
        self._check_open()
        if direction not in ("forward", "backward"):
            raise MoELayerError(f"phases: direction must be 'forward' or 'backward', got {direction!r}")
        if self._phase_recorders is None:
            return []
        with self._on_device():
            return self._phase_recorders[direction].take()

    @contextlib.contextmanager
    def _recording_phases(self, direction: str):
        """Within: :meth:`_mark` records into ``direction``'s recorder (if recording)."""
        self._phase_recorder = None if self._phase_recorders is None else self._phase_recorders[direction]
        if self._phase_recorder is not None:
            self._phase_recorder.begin()
        try:
            yield
        finally:
            self._phase_recorder = None

    def _mark(self, step: str) -> None:
        if self._phase_recorder is not None:
            self._phase_recorder.mark(step)

    def record_timeline(self, enable: bool = True) -> None:
        """A fused layer: whether later forwards and backwards record when and where each
        task ran (:meth:`timeline`)."""
        self._fused_only("record_timeline").record_timeline(enable)
        self._recording = bool(enable)
        if self._fused_bwd is not None:
            self._fused_bwd.record_timeline(enable)

    def timeline(self, direction: str = "forward") -> list:
        """A fused layer: the last recorded forward's (``direction="forward"``) or backward's
        (``"backward"``) tasks on this rank as (kind, start ns, end ns, SM id -- 0 on the
        host), by start; the forward's kinds send, relay, up, down, reduce, the backward's
        send, relay, dgrad_down, dgrad_up, reduce. Empty before any recorded call."""
        fused = self._fused_only("timeline")
        if direction == "forward":
            return fused.timeline()
        if direction == "backward":
            return [] if self._fused_bwd is None else self._fused_bwd.timeline()
        raise MoELayerError(f"timeline: direction must be 'forward' or 'backward', got {direction!r}")

    def _fused_only(self, what: str):
        self._check_open()
        if self._fused is None:
            raise MoELayerError(f"{what}: the layer was set up without fused=True")
        return self._fused

    def check(self) -> None:
        """Wait for queued work; raise deferred device errors of the Dispatcher, the grouped
        GEMM and the Balancer."""
        self._check_open()
        self.dispatcher.check()
        fused = self._fused_bwd or self._fused  # the backward's check: its opening barrier, then the kernels'
        if fused is not None:
            fused.check()
        if self.device is not None:
            from ultraep.compute import check_errors
            check_errors()
        if self.balancer is not None:
            self.balancer.check()

    def close(self) -> None:
        """Collective: close the Dispatcher (the Balancer is the caller's and stays open)."""
        if self._closed:
            return
        self._release()
        self.dispatcher.close()
        if self._owned_heap is not None:
            self._owned_heap.close()

    def _release(self) -> None:
        """Closed: the Balancer's layer is free for another MoELayer."""
        self._closed = True
        self._weight_copy = self._grad_copy = None  # they hold views of the Balancer's heap
        if self._balancing and MoELayer._balancer_layers.get((self.balancer.id, self.layer)) is self:
            del MoELayer._balancer_layers[(self.balancer.id, self.layer)]

    def __enter__(self) -> MoELayer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        self._release()
        self._give_up(exc)

    def _give_up(self, exc: BaseException) -> None:
        """On the way out of ``exc``: the Dispatcher and an own heap closed failing (a lone
        failure published to the peers, nothing waiting for them)."""
        self.dispatcher.__exit__(type(exc), exc, exc.__traceback__)
        if self._owned_heap is not None:
            self._owned_heap.close_failing(exc)
