"""The one backend pattern of the library.

Every component with work to do per micro-batch (planner, weight transfer, token path,
balancer) comes in two implementations behind one interface:

* ``host``   -- NumPy: the reference every kernel is tested against bit for bit, and the
  CPU backend (ranks share memory through MPI shared-memory windows);
* ``device`` -- CuPy and the CUDA kernels of ``raw_kernels/`` (ranks map each other's
  memory through CUDA IPC).

The choice is made once, from the group's device (``"auto"``), agreed by every rank, and
the public object holds the chosen implementation; nothing branches on the backend per
call. Implementations live in ``host.py`` / ``device.py`` of their package, with the
class names ``Host<Component>`` / ``Device<Component>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ultraep.runtime.group import EPGroup

Backend = Literal["host", "device"]
HOST: Backend = "host"
DEVICE: Backend = "device"
CHOICES = ("auto", HOST, DEVICE)


def backend_error(requested: object, *, has_device: bool) -> str | None:
    """Why ``requested`` cannot be used where a device is (or is not) present, or None."""
    if not isinstance(requested, str) or requested not in CHOICES:  # an array would compare elementwise
        return f"backend must be one of {', '.join(map(repr, CHOICES))}, got {requested!r}"
    if requested == DEVICE and not has_device:
        return "backend 'device' needs a GPU and CuPy, and this rank has none"
    return None


def choose_backend(group: "EPGroup", requested: str = "auto", what: str = "backend") -> Backend:
    """Collective: ``host`` or ``device`` for ``requested``, the same on every rank.

    A bad value on any rank raises the same error on every rank (before any rank can go
    on alone into a collective), and so do ranks that would choose differently."""
    group.raise_if_any(backend_error(requested, has_device=group.has_gpu), what)
    chosen: Backend = (DEVICE if group.has_gpu else HOST) if requested == "auto" else requested  # type: ignore[assignment]
    return group.agree(chosen, what)
