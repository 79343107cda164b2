"""Plan agreement: every rank of a transfer must hold the same plan for the same layer.

What a transfer reads of a plan (``log_to_phys``, ``replica_count``) and its layer are
hashed by :func:`plan_hash`. The host backend compares the hashes with a host collective
before any work. On the device, :class:`DevicePlanAgreement` launches ``raw_kernels/
agree.cu`` on the caller's stream instead: each rank hashes its plan on the device,
publishes the hash into every peer's signal pad and compares all of them, and the transfer
compiles the plan the kernel hands on -- the caller's, or, when the ranks disagree or a peer
does not answer within the timeout, one without replicas, whose transfer writes nothing. A
weight sync runs the agreement inside the sync's one launch instead, beside its compile and
before its copy (:meth:`DevicePlanAgreement.beside_compile`; two launches fewer), the copy
reading the verdict and writing nothing after a refusal; where ranks share a GPU the
agreement kernel runs just before that launch (one launch fewer), so no sync grid holds
SMs while it waits for its peers (:class:`~ultraep.transfer.device.DeviceTransfer`). Every
rank sees every hash, so all refuse alike; the failure is recorded on the device and raised by
:meth:`DevicePlanAgreement.check` (the engine's ``synchronize``). Until then every later
transfer writes nothing too, so nothing is computed on a refused placement.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ultraep.errors import GroupMismatchError, WaitTimeout
from ultraep.runtime.heap import HeapRequirements
from ultraep.runtime.kernels import kernel_constants

KERNEL = "agree.cu"
_C = kernel_constants(KERNEL)
AGREE_THREADS, SLOTS_PER_RANK = _C["AGREE_THREADS"], _C["AGREE_SLOTS_PER_RANK"]
STATUS_KIND, STATUS_CALL, STATUS_OP, STATUS_LAYER, STATUS_WAITED, STATUS_SEEN, STATUS_HASHES = (
    _C[name] for name in ("STATUS_KIND", "STATUS_CALL", "STATUS_OP", "STATUS_LAYER", "STATUS_WAITED",
                          "STATUS_SEEN", "STATUS_HASHES"))
AGREE_MISMATCH, AGREE_TIMEOUT = _C["AGREE_MISMATCH"], _C["AGREE_TIMEOUT"]
OPERATIONS = ("weight_sync", "reduce_grads")  # the op codes the kernel records
WHAT = "(layer, hash of the plan's log_to_phys and replica_count)"
SIGNALS = "transfer.plan_agreement"
_U64 = np.uint64


def _mix64(z: np.ndarray) -> np.ndarray:
    """The kernel's mix64 on uint64 arrays (wrapping arithmetic)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def plan_hash(layer: int, log_to_phys, replica_count) -> int:
    """The 64-bit hash ``agree_plan`` computes on the device, on the host (NumPy arrays):
    the mixed layer plus, for each word of ``log_to_phys`` then ``replica_count`` (as int32),
    the mix of its position (from 1) and value, summed modulo 2**64. Columns of
    ``log_to_phys`` past an expert's instance count count as -1 (no transfer reads them).
    The mix is a bijection, so plans that differ in one word a transfer reads always hash
    apart; more differences collide only by chance."""
    log_to_phys = np.asarray(log_to_phys).astype(np.int32)
    replica_count = np.ascontiguousarray(replica_count, dtype=np.int32)
    used = np.arange(log_to_phys.shape[1])[None, :] < replica_count[:, None]
    words = np.concatenate([np.where(used, log_to_phys, -1).astype(np.int32).ravel(), replica_count.ravel()])
    positions = np.arange(1, words.size + 1, dtype=_U64)
    mixed = _mix64((positions << _U64(32)) | words.view(np.uint32).astype(_U64))
    layer_word = _mix64(np.array([layer & 0xFFFFFFFFFFFFFFFF], dtype=_U64))
    return (int(mixed.sum(dtype=_U64)) + int(layer_word[0])) % 2**64


def disagreement_message(what: str, hashes: list[int]) -> str:
    """Which ranks passed which hash, as the host's agreement words it."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(hashes):
        groups.setdefault(value, []).append(rank)
    detail = "; ".join(f"ranks {ranks}: {value:#018x}" for value, ranks in groups.items())
    return f"ranks disagree on {what} {WHAT}: {detail}"


class AgreedPlacement(NamedTuple):
    """What a device transfer compiles in place of the caller's plan, once ``launch()`` has
    enqueued the agreement that writes it (the transfer's first launch)."""

    log_to_phys: object
    replica_count: object
    launch: Callable[[], None]


class AgreementBesideCompile(NamedTuple):
    """A weight sync's agreement, to run in the sync's one launch (transfer.cu's
    ``agree_compile_and_sync_weights``, whose copy reads the verdict): the plan's device
    arrays and the agreement's kernel arguments; ``launch_before()`` enqueues it as a
    kernel of its own instead, leaving the verdict for that launch (``agreed_before``)."""

    log_to_phys: object
    replica_count: object
    arguments: tuple
    launch_before: Callable[[], None]


class DevicePlanAgreement:
    """The device side of the agreement for one engine; see the module docstring.

    ``signals``: the engine's block of :meth:`heap_requirements`; ``timeout_s`` bounds the
    wait for each peer's hash."""

    @staticmethod
    def heap_requirements(layout) -> HeapRequirements:
        """Per rank: the call it published last and two hash slots (by parity) per peer."""
        return HeapRequirements.of(signals=[(SIGNALS, SLOTS_PER_RANK * layout.num_ranks)])

    def __init__(self, heap, layout, signals, timeout_s: float):
        import cupy

        from ultraep.runtime.kernels import get_function

        self.heap, self.layout, self.timeout_s = heap, layout, timeout_s
        self._pad = signals.offset
        E, K = layout.num_experts, layout.max_instances
        self._kernel = get_function(KERNEL, "agree_plan", group=heap.group)
        self._staged = (cupy.empty((E, K), np.int32), cupy.empty(E, np.int32))  # a NumPy plan's arrays
        self._gated_count = cupy.empty(E, np.int32)
        self._hashes = cupy.empty(heap.size, _U64)
        self._status = cupy.zeros(STATUS_HASHES + heap.size, _U64)
        self._calls = cupy.zeros(1, _U64)  # transfers agreed so far, counted by the kernel
        self._broken: str | None = None

    def agreed(self, what: str, layer: int, plan) -> AgreedPlacement:
        """The agreement on ``plan`` for a ``what`` (an entry of OPERATIONS) of ``layer``, to
        enqueue with the placement's ``launch`` before the transfer compiles that placement.
        Raises (on this rank alone) for a plan the kernel cannot read, or after a reported
        timeout."""
        log_to_phys, replica_count, arguments = self._arguments(what, layer, plan)
        arguments += (self._gated_count,)
        return AgreedPlacement(log_to_phys, self._gated_count,
                               lambda: self._kernel((1,), (AGREE_THREADS,), arguments))

    def beside_compile(self, what: str, layer: int, plan) -> AgreementBesideCompile:
        """The agreement of :meth:`agreed`, not launched: the weight sync's launch runs it
        (or its ``launch_before``, which writes no gated placement)."""
        log_to_phys, replica_count, arguments = self._arguments(what, layer, plan)
        alone = arguments + (np.uintp(0),)
        return AgreementBesideCompile(log_to_phys, replica_count, arguments,
                                      lambda: self._kernel((1,), (AGREE_THREADS,), alone))

    def _arguments(self, what: str, layer: int, plan) -> tuple:
        """``(log_to_phys, replica_count, arguments)``: the plan's device arrays (a NumPy
        plan staged) and agree_plan's arguments but ``gated_count``; the checks of :meth:`agreed`."""
        import cupy

        if self._broken is not None:
            raise WaitTimeout(f"rank {self.heap.rank}: {what}({layer}): the transfer engine is unusable after an "
                              f"earlier plan agreement timeout ({self._broken}); close it")
        E, K = self.layout.num_experts, self.layout.max_instances
        log_to_phys, replica_count = plan.log_to_phys, plan.replica_count
        if isinstance(replica_count, np.ndarray):
            stream = cupy.cuda.get_current_stream()
            for staged, host in zip(self._staged, (log_to_phys, replica_count)):
                staged.set(np.ascontiguousarray(host, dtype=np.int32), stream=stream)
            log_to_phys, replica_count = self._staged
        for name, array, shape in (("log_to_phys", log_to_phys, (E, K)), ("replica_count", replica_count, (E,))):
            if not isinstance(array, cupy.ndarray) or array.dtype != np.int32 or array.shape != shape \
                    or not array.flags.c_contiguous:
                raise ValueError(f"plan.{name}: expected a contiguous int32 array of shape {shape} (NumPy or CuPy), "
                                 f"got {type(array).__name__} {getattr(array, 'dtype', '')} "
                                 f"{getattr(array, 'shape', '')}")
        heap = self.heap
        return log_to_phys, replica_count, (
            log_to_phys, replica_count, np.int32(E), np.int32(K), np.int32(OPERATIONS.index(what)),
            _U64(layer & 0xFFFFFFFFFFFFFFFF), heap.peer_bases, np.int32(heap.rank), np.int32(heap.size),
            _U64(self._pad), self._calls, _U64(int(self.timeout_s * 1e9)), self._hashes, self._status)

    def check(self) -> None:
        """Wait for the device; raise the first disagreement or timeout since the last check
        (the same disagreement on every rank; a timeout names the rank waited for)."""
        import cupy

        cupy.cuda.Device(self.heap.device).synchronize()  # whichever stream the transfers ran on
        status = [int(v) for v in self._status.get()]
        kind = status[STATUS_KIND]
        if not kind:
            return
        self._status.fill(0)
        rank, call, layer = self.heap.rank, status[STATUS_CALL], status[STATUS_LAYER]
        what = f"{OPERATIONS[status[STATUS_OP]]}({layer - 2**64 if layer >= 2**63 else layer})"  # the signed layer
        after = "it and every transfer after it until this report wrote nothing"
        if kind == AGREE_MISMATCH:
            message = disagreement_message(what, status[STATUS_HASHES:])
            raise GroupMismatchError(f"{message} (device check of transfer #{call}; {after})")
        waited, seen = status[STATUS_WAITED], status[STATUS_SEEN]
        self._broken = (f"rank {rank}: {what} plan agreement timed out after {self.timeout_s:g} s waiting for rank "
                        f"{waited}: it had published its plan hash up to transfer #{seen}, expected #{call}; {after}")
        raise WaitTimeout(self._broken)
