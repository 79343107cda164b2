"""GPU transport of the symmetric heap: one raw ``cudaMalloc`` per rank, peers mapped
through CUDA IPC.

The allocation bypasses CuPy's memory pool (``cupy.cuda.Memory`` calls ``cudaMalloc``)
because an IPC handle always maps the whole underlying allocation. Handles travel over
the group's ``allgather``; every rank opens every peer's handle but never its own (it
uses its local pointer), and keeps a device ``uint64`` table of peer base pointers for
kernels. Several ranks may share one GPU (Default compute mode).
"""

from __future__ import annotations

import weakref

import numpy as np

from ultraep.runtime.dtypes import cupy_dtype
from ultraep.runtime.group import EPGroup, check_distinct_processes
from ultraep.errors import BarrierTimeout, GroupMismatchError, RankFailedError, WaitTimeout
from ultraep.runtime.heap import SymmetricHeap, _abandoned, close_refused, flag_constant
from ultraep.runtime.kernels import get_function

_STATUS_FIELDS = 4  # failed flag, waited rank, expected epoch, value seen


class _Mapping:
    """The owner every view of one rank's heap memory holds (a weak reference to it tells
    close() whether a view is still alive)."""

    __slots__ = ("memory", "__weakref__")

    def __init__(self, memory=None):
        self.memory = memory  # the local allocation: its last holder frees it


class DeviceHeap(SymmetricHeap):
    backend = "device"

    def __init__(self, group: EPGroup, nbytes: int):
        super().__init__(group, nbytes)
        import cupy
        from cupy.cuda import runtime

        error = None
        if not group.has_gpu:
            error = f"rank {group.rank} has no GPU"
        elif not group.all_on_one_host:
            error = "CUDA IPC heap needs every rank of the group on one host"
        group.raise_if_any(error, "CUDA IPC symmetric heap")
        check_distinct_processes(group)
        self.device = group.device
        with cupy.cuda.Device(self.device):
            mode = runtime.getDeviceProperties(self.device)["computeMode"]
            if mode != 0 and group.local_size > 1:  # 0: cudaComputeModeDefault
                raise RuntimeError(f"GPU {self.device} is not in Default compute mode ({mode}); ranks cannot share it")
            self._memory = cupy.cuda.Memory(self.total_bytes)  # raw cudaMalloc, never the pool
            runtime.memset(self._memory.ptr, 0, self.total_bytes)  # signal pads start at zero
            runtime.deviceSynchronize()
            handle = runtime.ipcGetMemHandle(self._memory.ptr)
            infos = group.allgather((self.total_bytes, handle))
            self._bases: list[int] = []
            self._opened: list[int] = []
            try:
                for peer, (peer_bytes, peer_handle) in enumerate(infos):
                    if peer_bytes != self.total_bytes:
                        raise RuntimeError(f"rank {peer} heap is {peer_bytes} bytes, "
                                           f"rank {self.rank} expects {self.total_bytes}")
                    if peer == self.rank:
                        self._bases.append(self._memory.ptr)  # never open one's own handle
                    else:
                        ptr = runtime.ipcOpenMemHandle(peer_handle)
                        self._opened.append(ptr)
                        self._bases.append(ptr)
            except Exception:
                self._close_peers()
                raise
            self._owners = [_Mapping(self._memory if peer == self.rank else None) for peer in range(self.size)]
            # Device table of peer base pointers: what every heap kernel indexes.
            self.peer_bases = cupy.asarray(np.array(self._bases, dtype=np.uint64))
            self._status = cupy.zeros(_STATUS_FIELDS, dtype=np.uint64)
            self._last_timeout_s = 0.0
            self._barrier_kernel = get_function("heap.cu", "symmetric_barrier", group=group)
        self._mapped = True

    def base_pointer(self, rank: int) -> int:
        return self._bases[rank]

    def view(self, rank: int, offset: int, shape: tuple, dtype: np.dtype):
        import cupy

        self._check_open("view")
        self._check_rank(rank)
        dtype = cupy_dtype(dtype)  # FP8 where CuPy cannot hold it: the same bytes as uint8
        nbytes = int(np.prod(shape)) * dtype.itemsize
        memory = cupy.cuda.UnownedMemory(self._bases[rank] + offset, nbytes, self._owners[rank],
                                         device_id=self.device)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def _device_barrier(self, flag: int, timeout_s: float, wait: bool) -> None:
        threads = min(1024, max(32, -(-self.size // 32) * 32))
        # The status word is only cleared once reported, so a timeout of an unchecked
        # (wait=False) barrier survives until check_barriers() reads it.
        self._barrier_kernel((1,), (threads,), (self.peer_bases, np.int32(self.rank), np.int32(self.size),
                                                np.uint64(0), np.uint64(flag), np.uint64(int(timeout_s * 1e9)),
                                                self._status))
        self._last_timeout_s = timeout_s
        if wait:
            self.check_barriers()

    def check_barriers(self) -> None:
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        failed, waited, expected, seen = (int(v) for v in self._status.get())
        if failed:
            self._status.fill(0)
            if failed == flag_constant("PEER_WAIT_REFUSED"):
                raise RankFailedError(self._refusal_message(waited, expected, seen))
            raise BarrierTimeout(self._timeout_message(waited, expected, seen, self._last_timeout_s))

    def _close_peers(self) -> None:
        from cupy.cuda import runtime

        for ptr in self._opened:
            runtime.ipcCloseMemHandle(ptr)
        self._opened = []

    def _abandon(self) -> None:
        # Queued kernels may still use the mappings and the peer table: keep all of it.
        _abandoned.append((self._memory, self._opened, self._owners, self.peer_bases))
        self._memory, self._opened, self._owners, self.peer_bases = None, [], [], None

    def _release(self, timeout_s: float) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.deviceSynchronize()
            owners, self._owners = [weakref.ref(o) for o in self._owners], []
            self.peer_bases = None
            try:
                self.group.barrier(timeout_s, what=self._close_step())  # every rank is here
            except (WaitTimeout, RankFailedError, GroupMismatchError) as exc:  # peers elsewhere may still map it
                self._close_peers()
                _abandoned.append(self._memory)  # a peer may still map it: never free
                raise close_refused(exc, "device allocation left in place") from exc
            if self._keep_for_views(any(o() is not None for o in owners)):
                _abandoned.append((self._memory, self._opened))  # views of it, here or on a peer, stay mapped
                self._opened = []
                self._memory = None
                return
            self._close_peers()
            self.group.barrier(timeout_s, what=self._close_step(": peers unmapped"))  # before it is freed
            self._memory = None  # cudaFree
