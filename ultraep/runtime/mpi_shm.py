"""CPU transport of the symmetric heap: NumPy arrays over an MPI shared-memory window.

Every rank allocates its segment with ``MPI.Win.Allocate_shared`` and maps every peer's
segment with ``Shared_query``, so a peer write is a plain NumPy store. The barrier is the
same flag protocol the GPU runs (each rank stores its epoch into every peer's pad, then
polls its own pad) with ``Win.Sync`` as the memory fence, and the same timeout report.
"""

from __future__ import annotations

import os
import time
import weakref

import numpy as np

from ultraep.runtime.group import EPGroup
from ultraep.errors import BarrierTimeout, GroupMismatchError, RankFailedError, WaitTimeout
from ultraep.runtime.heap import SymmetricHeap, _abandoned, close_refused, flag_epoch, refusal_cause


SHM_DIR = "/dev/shm"


def shm_space_error(nbytes: int) -> str | None:
    """Why ``nbytes`` of MPI shared memory cannot be had, or None: the segments live in
    /dev/shm, and touching a page past a full tmpfs kills the process with SIGBUS instead
    of failing the allocation."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm: the MPI keeps its segments elsewhere
        return None
    free = stat.f_bavail * stat.f_frsize
    if free >= nbytes:
        return None
    return (f"the CPU heap needs {nbytes / 2**20:.0f} MiB of shared memory on this node (every rank's segment), "
            f"but {SHM_DIR} has {free / 2**20:.0f} MiB free: enlarge it (docker: --shm-size) or ask for a smaller heap")


class HostHeap(SymmetricHeap):
    backend = "host"

    def __init__(self, group: EPGroup, nbytes: int):
        super().__init__(group, nbytes)
        from mpi4py import MPI

        comm = group.comm
        if not isinstance(comm, MPI.Comm):
            raise TypeError("the host heap needs an mpi4py communicator (MPI shared memory)")
        self._shm_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=group.rank)
        local_error = None
        if self._shm_comm.Get_size() != group.size:
            local_error = (f"CPU heap needs every rank on one node; only {self._shm_comm.Get_size()} of "
                           f"{group.size} share memory with rank {group.rank}")
        else:
            local_error = shm_space_error(group.size * self.total_bytes)
        try:
            group.raise_if_any(local_error, "CPU symmetric heap")
        except ValueError:
            self._shm_comm.Free()
            raise
        self._win = MPI.Win.Allocate_shared(self.total_bytes, 1, comm=self._shm_comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)  # passive epoch for Win.Sync fences; never unlocked until close
        self._segments = []
        for r in range(self.size):
            buf, _ = self._win.Shared_query(r)  # shm ranks follow group ranks (key above)
            self._segments.append(np.frombuffer(buf, dtype=np.uint8, count=self.total_bytes))
        self._segments[self.rank][:] = 0
        self._win.Sync()
        self._shm_comm.Barrier()
        self._mapped = True

    def view(self, rank: int, offset: int, shape: tuple, dtype: np.dtype):
        self._check_open("view")
        self._check_rank(rank)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self._segments[rank][offset:offset + nbytes].view(dtype).reshape(shape)

    def fence(self) -> None:
        """Memory fence for host stores into (and loads from) peers' segments."""
        self._win.Sync()

    def _device_barrier(self, flag: int, timeout_s: float, wait: bool) -> None:
        self._win.Sync()  # this rank's earlier stores land before its flags
        for peer in range(self.size):
            self.view(peer, 0, (self.size,), np.dtype(np.uint64))[self.rank] = flag
        epoch, refused = flag_epoch(flag), None
        mine = self.view(self.rank, 0, (self.size,), np.dtype(np.uint64))
        deadline = time.monotonic() + timeout_s
        for peer in range(self.size):
            while flag_epoch(seen := int(mine[peer])) < epoch:
                self.group.check_peers(f"{self.backend} heap barrier")
                if time.monotonic() > deadline:
                    raise BarrierTimeout(self._timeout_message(peer, epoch, seen, timeout_s))
                time.sleep(20e-6)
                self._win.Sync()
            if refused is None and refusal_cause(seen, epoch):
                refused = peer, seen  # an arrival all the same: wait for the others like the device does
        self._win.Sync()  # peers' stores before their flags are visible to this rank's reads
        if refused is not None:
            raise RankFailedError(self._refusal_message(refused[0], epoch, refused[1]))

    def _abandon(self) -> None:
        self._segments = []
        _abandoned.append((self._win, self._shm_comm))  # Win.Free is collective

    def _release(self, timeout_s: float) -> None:
        # Every view's base chain ends at its segment array: one alive means a view is.
        segments, self._segments = [weakref.ref(s) for s in self._segments], []
        self._win.Unlock_all()
        try:
            self.group.barrier(timeout_s, what=self._close_step())  # no peer still touches its segment
        except (WaitTimeout, RankFailedError, GroupMismatchError) as exc:
            _abandoned.append((self._win, self._shm_comm))  # Win.Free is collective: it would hang
            raise close_refused(exc, "shared segment left allocated") from exc
        if self._keep_for_views(any(s() is not None for s in segments)):
            _abandoned.append((self._win, self._shm_comm))  # unmapping would leave those views dangling
            return
        self._win.Free()
        self._shm_comm.Free()
