"""The EP group: which processes balance experts together, and which GPU each one uses.

Wraps an mpi4py communicator, or any object offering ``allgather`` of Python objects and
``rank``/``size`` (attributes or ``Get_rank()``/``Get_size()``), so a framework can pass
its own process group. Every collective check here gathers the local verdicts first and
then decides identically on every rank, so bad input raises on all ranks instead of
leaving the healthy ones waiting in the next collective.

On an mpi4py communicator every collective here is non-blocking MPI polled against a
deadline (the group's ``timeout_s``, or the call's): the waiting rank sleeps between polls,
and on expiry raises :class:`~ultraep.errors.WaitTimeout` naming the operation and the
ranks that had not reached it. Every collective carries its name (``what``), and ranks that
entered different ones -- a rank that took another branch, passed another micro-batch's
handle or closed an object the others still use -- raise
:class:`~ultraep.errors.GroupMismatchError` naming each rank's, on every rank, instead of
reading each other's payloads: every collective, the barrier included, opens with the same
fixed-size exchange of which call each rank entered, so no two ranks' calls are ever
different MPI collectives and the ranks stay in step. Where the ranks share one node they
also share a small status window (MPI shared memory): each rank's count of collectives entered, and the
failure a rank publishes (:meth:`EPGroup.notify_failure`) when it leaves a ``with`` block
on an exception of its own; a peer waiting for it then raises
:class:`~ultraep.errors.RankFailedError` with that exception at once. After a timeout or a
peer's failure the communicator is out of step (a collective is left pending), so the group
refuses further collectives.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import socket
import sys
import time
import weakref
from collections import Counter
from typing import Any, Sequence

import numpy as np

from ultraep.errors import ClosedError, CollectiveError, GroupMismatchError, RankFailedError, WaitTimeout, everywhere
from ultraep.runtime import sm_partition
from ultraep.runtime.dtypes import is_int

DEFAULT_TIMEOUT_S = 120.0
STATUS_SLOT_BYTES = 4096        # per rank: collectives entered, failure flag, message length, message
_STATUS_HEADER = 3              # int64 words before the message
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 2e-3  # a fast collective costs microseconds; a long wait, no core
# A rank's record of the collective it entered (EPGroup._gather_calls): what ranks compare,
# the name only to report (cut to 80 bytes), the digest of the whole name to decide.
_CALL = np.dtype([("size", "<i8"), ("refused", "<i8"), ("barrier", "<i8"), ("digest", "<u8"), ("name", "S80")])


def timeout_error(timeout_s) -> str | None:
    """Why ``timeout_s`` cannot bound a wait (it must be a positive, finite number of seconds), or None."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        return f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}"
    return None


def _mpi_comm(comm: Any):
    """The mpi4py module if ``comm`` is one of its communicators, else None (no import otherwise)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi if mpi is not None and isinstance(comm, mpi.Comm) else None


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


_NOTHING = object()  # raise_if_any without a value to agree on
# next_serial's counts per communicator: collectives pair up per communicator, so two EPGroups
# over one communicator must not hand out the same serial.
_SERIALS: dict = {}


def _comm_key(comm: Any) -> tuple:
    py2f = getattr(comm, "py2f", None)  # mpi4py: the same handle for every wrapper of one communicator
    return ("mpi", py2f()) if callable(py2f) else ("object", id(comm))


class EPGroup:
    """Ranks of one expert-parallel group.

    ``comm`` defaults to ``MPI.COMM_WORLD``. ``device`` overrides the GPU choice
    (``local_rank % device_count``); ``use_gpu=False`` keeps the group on the CPU even
    where a GPU exists. ``timeout_s`` bounds every host collective of the group (a call may
    pass its own); it must agree across ranks.
    """

    # Class-level defaults: a group built around a framework's allgather has no status window.
    _mpi: Any = None
    _status: list | None = None
    _broken: Exception | None = None
    _closed = False
    _owns_comm = False  # split() made the communicator: close() frees it
    timeout_s = DEFAULT_TIMEOUT_S

    def __init__(self, comm: Any = None, *, device: int | None = None, use_gpu: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if not callable(getattr(comm, "allgather", None)):
            raise TypeError(f"an EP group needs allgather(obj); {type(comm).__name__} has none")
        self.comm = comm
        self.rank, self.size = _rank_and_size(comm)
        self._mpi = _mpi_comm(comm)
        self._entered = 0         # collectives this rank has entered
        self._broken = None       # why the group refuses collectives
        self._pending: list = []  # abandoned requests and their buffers, kept alive
        self._status = None       # every rank's status slot (one node, MPI only)
        self._heaps: list = []    # weak references to the symmetric heaps opened over the group (close())
        self._serials = _SERIALS.setdefault(_comm_key(comm), Counter())  # next_serial's counts
        bad_argument = timeout_error(timeout_s)  # or a device this rank cannot use (below)
        self.timeout_s = DEFAULT_TIMEOUT_S if bad_argument else float(timeout_s)
        count = gpu_count() if use_gpu else 0
        if use_gpu and device is not None and (not is_int(device) or not 0 <= device < count):
            bad_argument = bad_argument or f"device {device!r} requested but {count} GPU(s) visible"
        self.hostname = socket.gethostname()
        if self._mpi is None:  # a framework's own allgather: not bounded here, so the timeout is unused
            if bad_argument:
                raise ValueError(bad_argument)
            hosts = self.allgather(self.hostname)
        else:
            hosts, errors = zip(*self.allgather((self.hostname, bad_argument), what="EP group creation"))
            self.raise_if_any(errors[self.rank], "EP group creation")
            self.agree(self.timeout_s, "EP group timeout_s")
        self.local_rank = sum(1 for h in hosts[: self.rank] if h == self.hostname)
        self.local_size = sum(1 for h in hosts if h == self.hostname)
        self.all_on_one_host = len(set(hosts)) == 1
        if self._mpi is not None and self.all_on_one_host:
            self._open_status()
        self.device: int | None = None
        if use_gpu:
            if device is not None:  # checked on every rank above
                self.device = int(device)
            elif count:
                self.device = self.local_rank % count
            if self.device is not None:
                import cupy
                cupy.cuda.Device(self.device).use()
                # under emulated EP with green contexts: from here on, this rank's own SMs
                sm_partition.enter_from_environment(self.device, self.local_rank)

    @property
    def has_gpu(self) -> bool:
        return self.device is not None

    # -- the status window ---------------------------------------------------------------
    def _open_status(self) -> None:
        mpi = self._mpi
        self._shm_comm = self.comm.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank)
        self._win = mpi.Win.Allocate_shared(STATUS_SLOT_BYTES, 1, comm=self._shm_comm)
        self._win.Lock_all(mpi.MODE_NOCHECK)  # passive epoch for Win.Sync; the window lives as long as the process
        slots = [np.frombuffer(self._win.Shared_query(r)[0], dtype=np.uint8, count=STATUS_SLOT_BYTES)
                 for r in range(self.size)]  # shm ranks follow group ranks (key above)
        slots[self.rank][:] = 0
        self._win.Sync()
        self.barrier(what="EP group status window")  # no rank reads a slot before its owner cleared it
        self._status = slots

    def _header(self, rank: int) -> np.ndarray:
        return self._status[rank][: 8 * _STATUS_HEADER].view(np.int64)

    def notify_failure(self, error: BaseException) -> bool:
        """Called by a ``with`` block left on ``error``: whether this rank must give up its
        collective teardown. A :class:`~ultraep.errors.CollectiveError` was raised on every
        rank alike, so the ranks tear down together. Any other error may be this rank's alone:
        it is published to the peers (their waits raise :class:`~ultraep.errors.RankFailedError`
        carrying it) and the group refuses further collectives."""
        if self._broken is not None:
            return True
        if getattr(error, "on_every_rank", False):  # a collective verdict, whatever its class
            return False
        text = str(error).removeprefix(f"rank {self.rank}: ")
        message = f"rank {self.rank} failed: {type(error).__name__}: {text}"
        self._broken = RankFailedError(message)
        if self._status is not None:
            encoded = message.encode("utf-8", "replace")[: STATUS_SLOT_BYTES - 8 * _STATUS_HEADER]
            self._status[self.rank][8 * _STATUS_HEADER:][: len(encoded)] = np.frombuffer(encoded, np.uint8)
            self._header(self.rank)[2] = len(encoded)
            self._win.Sync()  # the message before the flag
            self._header(self.rank)[1] = 1
            self._win.Sync()
        return True

    def check_peers(self, what: str) -> None:
        """Raise :class:`~ultraep.errors.RankFailedError` if a peer published a failure (for
        waits that poll: a peer that failed will never answer)."""
        if self._status is None:
            return
        self._win.Sync()
        failed = []
        for r in range(self.size):
            header = self._header(r)
            if r != self.rank and header[1]:
                failed.append(bytes(self._status[r][8 * _STATUS_HEADER:][: int(header[2])]).decode("utf-8", "replace"))
        if failed:
            self._broken = RankFailedError(f"rank {self.rank}: {what} given up: {'; '.join(failed)}")
            raise self._broken

    # -- bounded collectives -------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"rank {self.rank}: {what}: the EP group is closed")

    def _enter(self, what: str, timeout_s: float | None) -> tuple[float, str | None]:
        """The collective's timeout and this rank's refusal of its ``timeout_s`` (or None).
        A refused timeout is not raised here: the collective runs on the group's own
        timeout and carries the refusal, so every rank raises it, not only this one."""
        self._check_open(what)
        if self._broken is not None:
            raise type(self._broken)(f"rank {self.rank}: {what}: the group refuses collectives after an earlier "
                                     f"failure ({self._broken})")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        refusal = timeout_error(timeout)
        self._entered += 1
        if self._status is not None:
            self._header(self.rank)[0] = self._entered
        return (float(self.timeout_s) if refusal is not None else float(timeout)), refusal

    def _raise_refusals(self, refusals: list, what: str) -> None:
        """Every rank raises the same ValueError when any rank's argument was refused."""
        failed = [(r, m) for r, m in enumerate(refusals) if m is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
            raise CollectiveError(f"rank {self.rank}: {what}: {detail}")

    def _wait(self, request: Any, what: str, timeout_s: float, deadline: float, keep: tuple = (),
              spin: bool = False) -> None:
        """Poll ``request`` until done, sleeping between polls (``spin``: not); raise on a
        peer's failure or at ``deadline``."""
        pause = 0.0 if spin else _POLL_FIRST_S
        while not request.Test():
            try:
                self.check_peers(what)
                if time.monotonic() > deadline:
                    self._broken = WaitTimeout(self._timeout_message(what, timeout_s))
                    raise self._broken
            except Exception:
                self._pending.append((request, keep))  # MPI still owns the buffers
                raise
            if pause:
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)

    def _timeout_message(self, what: str, timeout_s: float) -> str:
        if self._status is None:
            where = "the ranks that had not reached it are unknown (no shared status window across hosts)"
        else:
            self._win.Sync()
            behind = [(r, int(self._header(r)[0])) for r in range(self.size) if self._header(r)[0] < self._entered]
            where = (f"rank(s) {[r for r, _ in behind]} had not reached it (this is collective #{self._entered} "
                     f"of the group; they entered {', '.join(f'#{n}' for _, n in behind)} last)"
                     if behind else "every rank reached it, but it did not complete")
        return f"rank {self.rank}: {what} timed out after {timeout_s:g} s: {where}"

    def allgather(self, obj: Any, *, what: str = "allgather", timeout_s: float | None = None,
                  call: str | None = None) -> list:
        """Every rank's ``obj``, in rank order (bounded on an mpi4py communicator); raises
        :class:`~ultraep.errors.GroupMismatchError` on every rank when the ranks are in
        different collectives: their ``call`` (default ``what``, which messages quote; a
        ``what`` naming an argument that may differ between ranks passes the call's bare name)
        differs."""
        call = what if call is None else call
        if self._mpi is None:
            self._check_open(what)
            names, values = zip(*self.comm.allgather((call, obj)))
            self._raise_mismatch(list(names), list(names))
            return list(values)
        timeout, refusal = self._enter(what, timeout_s)
        deadline = time.monotonic() + timeout
        payload = np.frombuffer(pickle.dumps((refusal, obj), protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        calls = self._gather_calls(what, call, payload.size, refusal, timeout, deadline, barrier=False)
        sizes = calls["size"]
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        gathered = np.empty(int(sizes.sum()), np.uint8)
        spec = [gathered, (sizes.tolist(), offsets.tolist()), self._mpi.BYTE]
        self._wait(self.comm.Iallgatherv(payload, spec), what, timeout, deadline, (payload, gathered))
        refusals, values = zip(*(pickle.loads(gathered[o:o + n]) for o, n in zip(offsets, sizes)))
        self._raise_refusals(list(refusals), what)
        return list(values)

    def _gather_calls(self, what: str, call: str, size: int, refusal: str | None, timeout: float,
                      deadline: float, *, barrier: bool, spin: bool = False) -> np.ndarray:
        """The first step of every collective: one fixed-size record a rank (:data:`_CALL`:
        its call's name, whether it is a barrier, a digest of both, its payload's size,
        whether it refused its timeout), so a barrier and an allgather are the same MPI
        collective here, and ranks in different calls all raise the mismatch at this step
        and stay in step. A barrier and an allgather of one name are different calls: the
        allgather's second step must not meet the barrier rank's next collective."""
        mine = np.zeros(1, _CALL)
        mine["size"], mine["refused"], mine["barrier"] = size, refusal is not None, barrier
        key = f"{'barrier' if barrier else 'allgather'}:{call}".encode()
        mine["digest"] = np.frombuffer(hashlib.blake2b(key, digest_size=8).digest(), np.uint64)
        mine["name"] = call.encode("utf-8", "replace")[:_CALL["name"].itemsize]
        calls = np.zeros(self.size, _CALL)
        self._wait(self.comm.Iallgather(mine.view(np.uint8), calls.view(np.uint8)), what, timeout, deadline,
                   (mine, calls), spin)
        names = [bytes(name).decode("utf-8", "replace") for name in calls["name"]]
        if len(set(names)) < len(set(calls["digest"].tolist())):  # one name, two kinds of call: say which
            names = [f"{name} ({'barrier' if barrier_ else 'allgather'})"
                     for name, barrier_ in zip(names, calls["barrier"])]
        self._raise_mismatch(list(calls["digest"]), names)
        return calls

    def _raise_mismatch(self, keys: list, names: list) -> None:
        """Every rank raises the same GroupMismatchError when the ranks entered different
        collectives (``keys``: each rank's call, or its digest; ``names``: what to report of
        it). They are still in step: each entered one collective, so a caller that handles
        the error may go on."""
        if any(key != keys[0] for key in keys[1:]):
            ranks: dict[tuple, list[int]] = {}
            for r, (key, name) in enumerate(zip(keys, names)):
                ranks.setdefault((key, name), []).append(r)
            detail = "; ".join(f"rank(s) {where} in {name!r}" for (_, name), where in ranks.items())
            raise GroupMismatchError(f"rank {self.rank}: the ranks entered different collective calls ({detail}): "
                                     f"they took different paths through the program (another micro-batch's "
                                     f"handle, another layer, or an object closed on some ranks only)")

    def barrier(self, timeout_s: float | None = None, *, what: str = "barrier", aligned: bool = False) -> None:
        """Host barrier, bounded on an mpi4py communicator (:class:`~ultraep.errors.WaitTimeout`
        when not every rank arrives in time), checked like every collective: a rank in another
        call raises the mismatch on every rank, not an MPI error. One MPI collective, the
        calls' records, which also say which ranks refused their ``timeout_s``. A waiting rank
        sleeps between polls, up to 2 ms, so the ranks leave up to that far apart; ``aligned``:
        it polls without sleeping (a core each while it waits), and they leave together -- for
        a call timed from its start on every rank."""
        if self._mpi is None:
            self.allgather(None, what=what)
            return
        timeout, refusal = self._enter(what, timeout_s)
        calls = self._gather_calls(what, what, 0, refusal, timeout, time.monotonic() + timeout, barrier=True,
                                   spin=aligned)
        elsewhere = "its timeout_s was refused (timeout_s must be a positive, finite number of seconds)"
        self._raise_refusals([refusal if r == self.rank else (elsewhere if calls["refused"][r] else None)
                              for r in range(self.size)], what)

    def split(self, color: int, key: int | None = None) -> "EPGroup":
        """Sub-group of the ranks that pass the same ``color`` (EP groups inside a larger job)."""
        self._check_open("split")  # its communicator may be freed (a split group's): no raw MPI error
        if not callable(getattr(self.comm, "Split", None)):
            raise TypeError(f"{type(self.comm).__name__} has no Split; pass the sub-group's communicator directly")
        sub = self.comm.Split(color, self.rank if key is None else key)
        group = EPGroup(sub, device=self.device, use_gpu=self.device is not None, timeout_s=self.timeout_s)
        group._owns_comm = True
        return group

    def track_heap(self, heap: Any) -> None:
        """Keep a weak reference to a symmetric heap opened over the group, which
        :meth:`close` closes if it is still open then."""
        self._heaps = [ref for ref in self._heaps if ref() is not None] + [weakref.ref(heap)]

    def next_serial(self, kind: str) -> int:
        """How many ``kind`` objects this rank made over the group before: objects made
        collectively, in the same order on every rank, get the same serial everywhere."""
        serial = self._serials[kind]
        self._serials[kind] += 1
        return serial

    def close(self) -> None:
        """Collective: free what the group holds -- its status window and node communicator
        (MPI, one host) and a communicator :meth:`split` made; the caller's communicator stays
        the caller's. Every later collective raises :class:`~ultraep.errors.ClosedError`.
        Close what runs over the group (heaps, Dispatchers, Balancers, layers) first; a
        symmetric heap still open is closed here, newest first, before the group's own parts
        (afterwards its collective free could not run, and its memory would stay mapped). A group
        that gave up after a timeout or a peer's failure keeps its MPI objects (freeing them
        is collective and would hang); the process's exit frees them."""
        if self._closed:
            return
        usable = self._broken is None
        if usable:
            for heap in [h for h in (ref() for ref in reversed(self._heaps)) if h is not None and h.is_open]:
                heap.close()  # collective: every rank opened the same heaps in the same order
            self.barrier(what="EP group close")  # no peer still reads a status slot or enters a collective
        self._closed = True
        if usable and self._status is not None:
            self._status = None
            self._win.Unlock_all()
            self._win.Free()
            self._shm_comm.Free()
        if usable and self._owns_comm:
            self.comm.Free()

    def __enter__(self) -> EPGroup:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        elif not self.notify_failure(exc):  # every rank raised it: they close together
            self.close()

    def agree(self, value: Any, what: str, *, timeout_s: float | None = None) -> Any:
        """Return ``value`` if every rank passed an equal one, else raise on every rank."""
        return _agreed(self.allgather(value, what=what, timeout_s=timeout_s), what)

    def raise_if_any(self, local_error: BaseException | str | None, what: str, *,
                     timeout_s: float | None = None, agree: Any = _NOTHING, call: str | None = None) -> None:
        """Collective error check: if any rank failed, raise the same CollectiveError on every
        rank, naming each failed rank and its reason (the local exception is the cause).
        With ``agree``, the same single allgather then checks it as :meth:`agree` does.
        ``call``: as :meth:`allgather`'s."""
        message = None if local_error is None else str(local_error)
        if agree is _NOTHING:
            errors, values = self.allgather(message, what=what, timeout_s=timeout_s, call=call), None
        else:
            pairs = self.allgather((message, agree), what=what, timeout_s=timeout_s, call=call)
            errors, values = [m for m, _ in pairs], [v for _, v in pairs]
        failed = [(r, m) for r, m in enumerate(errors) if m is not None]
        if failed:
            error = CollectiveError(f"{what} failed on {len(failed)} of {self.size} rank(s): "
                                    f"{failure_detail(failed, self.size)}")
            raise error from (local_error if isinstance(local_error, BaseException) else None)
        if values is not None:
            _agreed(values, what)

    def refuse_closed(self, error: ClosedError, what: str, *, call: str | None = None) -> None:
        """A collective call on an object closed on this rank: raise ``error`` after entering
        one collective with it, so that peers in the call's own check (``what``/``call``) raise
        CollectiveError naming this rank, or GroupMismatchError where their check is named
        otherwise, at once instead of waiting out their timeout. Ranks that all closed it
        raise ClosedError."""
        try:
            self.raise_if_any(error, what, call=call)
        except GroupMismatchError:
            raise
        except CollectiveError as every_rank:
            raise everywhere(ClosedError(str(every_rank))) from None
        raise error  # not reached: raise_if_any raised with this rank's error

    def __repr__(self) -> str:
        gpu = f"cuda:{self.device}" if self.device is not None else "cpu"
        return f"EPGroup(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, device={gpu})"


def failure_detail(failed: list[tuple[int, str]], size: int) -> str:
    """The ranks' reasons, each said once: alone where every rank of the group gave it, else
    after the ranks that gave it (a rank's own ``rank N: `` prefix dropped, it is named here)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, message in failed:
        ranks_of.setdefault(message.removeprefix(f"rank {rank}: "), []).append(rank)
    if len(ranks_of) == 1 and len(failed) == size > 1:
        return next(iter(ranks_of))
    return "; ".join(f"rank {ranks[0]}: {message}" if len(ranks) == 1 else f"ranks {ranks}: {message}"
                     for message, ranks in ranks_of.items())


def _agreed(values: list, what: str) -> Any:
    """The common value of ``values`` (one per rank), else GroupMismatchError naming who differs."""
    if any(v != values[0] for v in values[1:]):
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(repr(v), []).append(r)
        detail = "; ".join(f"ranks {ranks}: {v}" for v, ranks in groups.items())
        raise GroupMismatchError(f"ranks disagree on {what}: {detail}")
    return values[0]


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


def ranks_per_gpu(group) -> int:
    """The most ranks of ``group`` on one GPU, 0 without GPUs (collective)."""
    return most_ranks_on_one_gpu(group.allgather(gpu_identity(group), what="ranks per GPU"))
