"""The EP group: which processes balance experts together, and which GPU each one uses.

Wraps an mpi4py communicator, or any object offering ``allgather`` of Python objects and
``rank``/``size`` (attributes or ``Get_rank()``/``Get_size()``), so a framework can pass
its own process group. Every collective check here gathers the local verdicts first and
then decides identically on every rank, so bad input raises on all ranks instead of
leaving the healthy ones waiting in the next collective.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from typing import Any, Sequence

from ultraep.errors import CollectiveError, GroupMismatchError


def _rank_and_size(comm: Any) -> tuple[int, int]:
    for rank_name, size_name in (("Get_rank", "Get_size"), ("rank", "size")):
        rank, size = getattr(comm, rank_name, None), getattr(comm, size_name, None)
        if rank is None or size is None:
            continue
        rank = rank() if callable(rank) else rank
        size = size() if callable(size) else size
        return int(rank), int(size)
    raise TypeError(
        "an EP group needs an mpi4py communicator or an object with allgather(obj) and "
        f"rank/size (attributes or Get_rank()/Get_size()); got {type(comm).__name__}"
    )


def gpu_count() -> int:
    """Number of visible CUDA devices; 0 where CuPy or a driver is missing."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver or no device: the CPU backend serves
        return 0


class EPGroup:
    """Ranks of one expert-parallel group.

    ``comm`` defaults to ``MPI.COMM_WORLD``. ``device`` overrides the GPU choice
    (``local_rank % device_count``); ``use_gpu=False`` keeps the group on the CPU even
    where a GPU exists.
    """

    def __init__(self, comm: Any = None, *, device: int | None = None, use_gpu: bool = True):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if not callable(getattr(comm, "allgather", None)):
            raise TypeError(f"an EP group needs allgather(obj); {type(comm).__name__} has none")
        self.comm = comm
        self.rank, self.size = _rank_and_size(comm)
        self.hostname = socket.gethostname()
        hosts = self.allgather(self.hostname)
        self.local_rank = sum(1 for h in hosts[: self.rank] if h == self.hostname)
        self.local_size = sum(1 for h in hosts if h == self.hostname)
        self.all_on_one_host = len(set(hosts)) == 1
        self.device: int | None = None
        if use_gpu:
            count = gpu_count()
            if device is not None:
                if not 0 <= device < max(count, 1) or count == 0:
                    raise ValueError(f"rank {self.rank}: device {device} requested but {count} GPU(s) visible")
                self.device = device
            elif count:
                self.device = self.local_rank % count
            if self.device is not None:
                import cupy
                cupy.cuda.Device(self.device).use()

    @property
    def has_gpu(self) -> bool:
        return self.device is not None

    def allgather(self, obj: Any) -> list:
        return list(self.comm.allgather(obj))

    def barrier(self, timeout_s: float | None = None) -> None:
        """Host barrier: the communicator's own where it has one.

        With ``timeout_s`` (mpi4py communicators) raises :class:`TimeoutError` when not
        every rank arrives in time -- e.g. a teardown while one rank is failing alone.
        """
        if timeout_s is not None and callable(getattr(self.comm, "Ibarrier", None)):
            request = self.comm.Ibarrier()
            deadline = time.monotonic() + timeout_s
            while not request.Test():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: not every rank reached the barrier within {timeout_s:g} s")
                time.sleep(1e-3)
        elif callable(getattr(self.comm, "Barrier", None)):
            self.comm.Barrier()
        else:
            self.allgather(None)

    def split(self, color: int, key: int | None = None) -> "EPGroup":
        """Sub-group of the ranks that pass the same ``color`` (EP groups inside a larger job)."""
        if not callable(getattr(self.comm, "Split", None)):
            raise TypeError(f"{type(self.comm).__name__} has no Split; pass the sub-group's communicator directly")
        sub = self.comm.Split(color, self.rank if key is None else key)
        return EPGroup(sub, device=self.device, use_gpu=self.device is not None)

    def agree(self, value: Any, what: str) -> Any:
        """Return ``value`` if every rank passed an equal one, else raise on every rank."""
        values = self.allgather(value)
        if any(v != values[0] for v in values[1:]):
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(repr(v), []).append(r)
            detail = "; ".join(f"ranks {ranks}: {v}" for v, ranks in groups.items())
            raise GroupMismatchError(f"ranks disagree on {what}: {detail}")
        return values[0]

    def raise_if_any(self, local_error: BaseException | str | None, what: str) -> None:
        """Collective error check: if any rank failed, raise the same CollectiveError on every
        rank, naming each failed rank and its reason (the local exception is the cause)."""
        message = None if local_error is None else str(local_error)
        errors = self.allgather(message)
        failed = [(r, m) for r, m in enumerate(errors) if m is not None]
        if not failed:
            return
        detail = "; ".join(f"rank {r}: {m.removeprefix(f'rank {r}: ')}" for r, m in failed)  # named once
        error = CollectiveError(f"{what} failed on {len(failed)} of {self.size} rank(s): {detail}")
        raise error from (local_error if isinstance(local_error, BaseException) else None)

    def __repr__(self) -> str:
        gpu = f"cuda:{self.device}" if self.device is not None else "cpu"
        return f"EPGroup(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, device={gpu})"


def pid_tag() -> tuple[str, int]:
    """(hostname, pid): unique per process, used to refuse two ranks in one process."""
    return socket.gethostname(), os.getpid()


def check_distinct_processes(group: EPGroup) -> None:
    tags: Sequence[tuple[str, int]] = group.allgather(pid_tag())
    if len(set(tags)) != len(tags):
        raise ValueError(f"two ranks of one group live in one process {tags}: CUDA IPC cannot open its own handle")


def gpu_identity(group):
    """This rank's GPU as ``(host, PCI bus id)``, ``None`` without one: equal for ranks sharing a GPU."""
    if not group.has_gpu:
        return None
    import cupy

    return group.hostname, cupy.cuda.Device(group.device).pci_bus_id


def most_ranks_on_one_gpu(identities: list) -> int:
    """The largest number of ranks whose ``identities`` (see :func:`gpu_identity`) are one GPU."""
    return max(Counter(i for i in identities if i is not None).values(), default=0)
