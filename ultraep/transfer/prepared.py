"""A weight sync prepared by a transfer backend: what both backends return and the engine
(and through it the Balancer, which captures a device sync in its update's CUDA graph) launches."""

from __future__ import annotations

from typing import Callable, NamedTuple


class PreparedSync(NamedTuple):
    """A weight sync checked, agreed on and counted, not yet enqueued: ``launch()``, called
    once, enqueues it on the current stream -- at once, or inside a CUDA graph capture,
    whose every replay is then one sync (the device numbers its syncs itself). ``key``:
    every argument of the launches (pointers, grid, values), so a graph holding them is
    replayed only for an equal key; None where they cannot be captured (the host, whose
    syncs run in ``launch``; a sync closed by a heap barrier, numbered on the host)."""

    launch: Callable[[], None]
    key: tuple | None
