"""Every error the library raises on purpose, under one base class.

A framework catches :class:`UltraEPError` to tell the library's refusals (bad input,
ranks that disagree, a wait that timed out) from its own bugs. Each class also derives
from the built-in exception a caller would expect (``ValueError`` for bad input,
``TimeoutError`` for a wait), so ``except ValueError`` keeps working. This module
imports nothing from the package, so every layer can raise these.
"""

from __future__ import annotations


class UltraEPError(Exception):
    """Base of every error ultraep raises on purpose.

    ``on_every_rank``: raised alike on every rank of the group (a collective check's verdict,
    whatever its class), so a ``with`` block left on it tears down collectively instead of
    publishing a lone failure to the peers."""

    on_every_rank = False


class CollectiveError(UltraEPError, ValueError):
    """A check failed on at least one rank; every rank raises this with each rank's reason."""

    on_every_rank = True


def everywhere(error: UltraEPError) -> UltraEPError:
    """``error``, of another class, carrying a collective check's verdict: marked as raised on
    every rank (:attr:`UltraEPError.on_every_rank`)."""
    error.on_every_rank = True
    return error


class GroupMismatchError(CollectiveError):
    """Ranks of one group passed values that must agree but do not."""


class LaunchError(UltraEPError, RuntimeError):
    """No usable ``mpiexec`` was found, or the launched job failed."""


class MPSUnavailable(LaunchError):
    """An MPS control daemon could not be started here."""


class SMPartitionError(LaunchError):
    """A rank of an emulated job could not get SMs of its own through a green context; the reason."""


class ClosedError(UltraEPError, RuntimeError):
    """An object (heap, transfer engine, dispatcher, balancer) or a view of its memory
    used after its ``close()``; the message names the object."""


class HeapError(UltraEPError, RuntimeError):
    """The symmetric heap cannot serve the request (closed, out of space, broken by a timeout)."""


class HeapFullError(HeapError, CollectiveError):
    """An allocation the heap has no room for, refused on every rank alike (it is both a
    HeapError and a CollectiveError: no rank's failure is its own)."""


class WaitTimeout(UltraEPError, TimeoutError):
    """A bounded wait (host or device) did not see what it waited for; the message names it."""


class RankFailedError(UltraEPError, RuntimeError):
    """A rank of the group failed alone (an exception of its own inside a ``with`` block), so
    the group gives up its collectives; the message names the rank and its exception."""


class BarrierTimeout(WaitTimeout):
    """A heap barrier did not see a peer's flag in time."""


class TransferTimeout(WaitTimeout):
    """A relay waited too long for a chunk of an expert's weights."""


class DispatchError(UltraEPError, ValueError):
    """Bad input to dispatch/combine, or a routing the set-up bounds cannot hold."""


class GroupedGemmError(UltraEPError, ValueError):
    """Bad input to a grouped GEMM (shapes, dtypes, layout, expert offsets)."""


class BalancerError(UltraEPError, ValueError):
    """Bad input to the Balancer."""


class StaleHandleError(BalancerError):
    """A handle whose ring slot has been reused by a later micro-batch of its layer."""


class ProfileError(UltraEPError, ValueError):
    """Bad input to the machine profile or the replica cost model (``ultraep.tune``), or a
    measurement of the profile that came out wrong."""


class MoELayerError(UltraEPError, ValueError):
    """Bad input to an MoE layer (set-up, weights, a context used twice)."""


class FusedDeadlock(UltraEPError, RuntimeError):
    """A fused-layer task order or interleaving in which a task waits for one that cannot
    run (``ultraep.compute.fused.forward.check_order`` / ``simulate``)."""


__all__ = ["BalancerError", "BarrierTimeout", "ClosedError", "CollectiveError", "DispatchError", "FusedDeadlock",
           "GroupMismatchError", "GroupedGemmError", "HeapError", "HeapFullError", "LaunchError", "MoELayerError",
           "MPSUnavailable", "ProfileError", "RankFailedError", "SMPartitionError", "StaleHandleError",
           "TransferTimeout", "UltraEPError", "WaitTimeout", "everywhere"]
