"""A rank's own SMs of a shared GPU: a CUDA green context on one of the device's SM groups.

Under an MPS daemon the ranks' kernels run at once, but the thread percentage caps how many
SMs a rank uses, not which: ranks' blocks land on the same SMs now and then, and a
persistent kernel (one CTA per SM, claiming tasks) runs late behind another rank's. Green
contexts give each rank a disjoint set: every rank splits the device's SMs into the same
equal groups (one call, the same on every rank of the device: the GPU test checks that no
rank's blocks wait for SMs another rank holds), takes the group of its local rank, makes a
green context on it and one of the context's streams the bottom of CuPy's stream stack on
its thread before any work. Only kernels on a green context's own streams
(``cuGreenCtxStreamCreate``) keep to its SMs -- measured on an H100, with and without MPS:
the null stream and a runtime-made stream ran on all 132 SMs even with the green context
current -- so every stream the library makes comes from :func:`new_stream`. MPS then runs
at 100 % per client: the green context, not the daemon, limits the SMs (NVIDIA: a thread
percentage below 100 overrides a green context's SMs).

:func:`enter` does this in a rank (``EPGroup`` calls it after choosing the device);
:func:`usable_sms` is the SM count every grid sizing reads; ``python -m
ultraep.runtime.sm_partition RANKS PERCENT`` (:func:`check`) tries the split, a green
context and a stream once, under the job's MPS daemon before its ranks start, and prints
the SMs a rank gets.

The driver is reached through ctypes (``libcuda.so.1``): a dozen calls and one struct, with
no package to install, on the same driver CuPy runs on.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref

from ultraep.errors import SMPartitionError

GREEN_VARIABLE = "ULTRAEP_GREEN_SMS"  # "<ranks>:<percent>" in every rank of an emulated job with green contexts
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")  # set by mpiexec
RESOURCE_TYPE_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
SPLIT_IGNORE_COSCHEDULING = 1  # CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING
GREEN_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM: required by cuGreenCtxCreate
STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: required by cuGreenCtxStreamCreate
MIN_DRIVER_VERSION = 12040  # green contexts came with CUDA 12.4


class _SMResource(ctypes.Structure):  # CUdevSmResource
    _fields_ = [("sm_count", ctypes.c_uint), ("min_partition_size", ctypes.c_uint),
                ("coscheduled_alignment", ctypes.c_uint)]


class _DevResource(ctypes.Structure):  # CUdevResource (RESOURCE_ABI_VERSION 1): 4 + 92 + a 48-byte union
    _fields_ = [("type", ctypes.c_int), ("_internal", ctypes.c_ubyte * 92), ("sm", _SMResource),
                ("_union_rest", ctypes.c_ubyte * (48 - ctypes.sizeof(_SMResource)))]


_driver: ctypes.CDLL | None = None
_green: dict[int, ctypes.c_void_p] = {}  # device -> this rank's green context (lives as long as the process)
_rank_sms: dict[int, int] = {}  # device -> SMs of this rank's green context on it


def _call(name: str, *args) -> None:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise SMPartitionError(f"the CUDA driver library could not be loaded: {exc}") from exc
    function = getattr(_driver, name, None)
    if function is None:
        raise SMPartitionError(f"the CUDA driver has no {name}: green contexts need a driver for CUDA 12.4 or later")
    code = function(*args)
    if code != 0:
        text = ctypes.c_char_p()
        _driver.cuGetErrorString(code, ctypes.byref(text))
        raise SMPartitionError(f"{name} failed with CUDA error {code}"
                               + (f" ({text.value.decode()})" if text.value else ""))


def group_size(total: int, ranks: int, percent: int, unit: int, smallest: int) -> int:
    """SMs per group: ``percent`` % of ``total`` (the nearest count: 12 % of 132 is 16), at
    most an even split, in whole ``unit``s, at least ``smallest``."""
    unit = max(1, unit)
    return max(min(round(total * percent / 100), total // ranks) // unit * unit, smallest)


def split(ordinal: int, ranks: int, percent: int) -> tuple[list[_DevResource], int]:
    """The device's SMs in ``ranks`` disjoint equal groups of about ``percent`` % each (whole
    co-scheduling units, at least the device's smallest partition), and the device's SM count."""
    version = ctypes.c_int()
    _call("cuInit", 0)
    _call("cuDriverGetVersion", ctypes.byref(version))
    if version.value < MIN_DRIVER_VERSION:
        raise SMPartitionError(f"the driver is CUDA {version.value}; green contexts need {MIN_DRIVER_VERSION}")
    device = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(device), ordinal)
    whole = _DevResource()
    _call("cuDeviceGetDevResource", device, ctypes.byref(whole), RESOURCE_TYPE_SM)
    total = whole.sm.sm_count
    for flags in (0, SPLIT_IGNORE_COSCHEDULING):  # keep the GPCs' co-scheduling where the counts allow
        coscheduled = flags == 0
        wanted = group_size(total, ranks, percent, whole.sm.coscheduled_alignment if coscheduled else 1,
                            whole.sm.min_partition_size if coscheduled else 1)
        groups = (_DevResource * ranks)()
        count = ctypes.c_uint(ranks)
        remaining = _DevResource()
        _call("cuDevSmResourceSplitByCount", groups, ctypes.byref(count), ctypes.byref(whole),
              ctypes.byref(remaining), flags, wanted)
        if count.value == ranks:
            return list(groups), total
    raise SMPartitionError(f"the device's {total} SMs split into only {count.value} groups of {wanted} SMs, "
                           f"not {ranks}")


def _green_context(ordinal: int, group: _DevResource) -> ctypes.c_void_p:
    """A green context on ``group`` of device ``ordinal``'s SMs."""
    description = ctypes.c_void_p()
    _call("cuDevResourceGenerateDesc", ctypes.byref(description), ctypes.byref(group), 1)
    device, green = ctypes.c_int(), ctypes.c_void_p()
    _call("cuDeviceGet", ctypes.byref(device), ordinal)
    _call("cuGreenCtxCreate", ctypes.byref(green), description, device, GREEN_DEFAULT_STREAM)
    return green


def _green_stream(green: ctypes.c_void_p, priority: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _call("cuGreenCtxStreamCreate", ctypes.byref(handle), green, STREAM_NON_BLOCKING, priority)
    return handle


def _destroy_stream(handle: ctypes.c_void_p) -> None:
    """Release a green stream whose CuPy view is gone (at exit the driver may be gone first:
    nothing to report then)."""
    if _driver is not None:
        _driver.cuStreamDestroy_v2(handle)  # cuda.h: cuStreamDestroy is this symbol


def enter(device: int, rank: int, ranks: int, percent: int) -> int:
    """Give this process group ``rank`` of :func:`split`'s SMs: a green context on it, and one
    of its streams the bottom of CuPy's stream stack on this thread; its SM count. Once per
    device: a second call (a sub-group's EPGroup) keeps the first's."""
    if device in _rank_sms:
        return _rank_sms[device]
    groups, _ = split(device, ranks, percent)
    if not 0 <= rank < ranks:
        raise SMPartitionError(f"local rank {rank} has no group of its own among {ranks}")
    _green[device] = _green_context(device, groups[rank])
    _rank_sms[device] = int(groups[rank].sm.sm_count)
    # entered, never left: every `with stream:` block returns to it (Stream.use() would be
    # undone by the first one, which returns to the null stream and all the SMs)
    new_stream(device).__enter__()
    return _rank_sms[device]


def new_stream(device: int | None = None, *, priority: int | None = None):
    """A non-blocking CuPy stream whose kernels run on this process's SMs: a stream of its
    green context where it has one (released with its CuPy view), else ``cupy.cuda.Stream``."""
    import cupy

    device = cupy.cuda.Device().id if device is None else device
    if device not in _green:
        return cupy.cuda.Stream(non_blocking=True, priority=priority)
    handle = _green_stream(_green[device], priority or 0)
    view = cupy.cuda.ExternalStream(handle.value, device)
    weakref.finalize(view, _destroy_stream, handle)
    return view


def local_rank_of_job(environ=os.environ) -> int | None:
    """This process's local rank as its MPI launcher numbered it (every rank of the job is
    started with one environment), None if the launcher set none."""
    rank = next((environ[v] for v in LOCAL_RANK_VARIABLES if v in environ), None)
    return int(rank) if rank is not None and rank.isdigit() else None


def enter_from_environment(device: int, local_rank: int) -> int | None:
    """In a rank of an emulated job with green contexts (``$ULTRAEP_GREEN_SMS``): :func:`enter`
    its group, by its local rank in the job (``local_rank``, the group's, where the launcher
    named none); None outside one."""
    setting = os.environ.get(GREEN_VARIABLE)
    if not setting:
        return None
    launched = local_rank_of_job()
    rank = local_rank if launched is None else launched
    try:
        ranks, percent = (int(part) for part in setting.split(":"))
    except ValueError:
        raise SMPartitionError(f"{GREEN_VARIABLE}={setting!r}: expected RANKS:PERCENT") from None
    try:
        return enter(device, rank, ranks, percent)
    except SMPartitionError as exc:
        raise SMPartitionError(f"local rank {rank}: its own SMs of GPU {device} ({GREEN_VARIABLE}={setting}): "
                               f"{exc}") from exc


def usable_sms(device: int) -> int:
    """The SMs this process's kernels on ``device`` run on: its green context's, else the
    device's (under an MPS thread percentage the device reports the share's)."""
    if device in _rank_sms:
        return _rank_sms[device]
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


def check(ranks: int, percent: int) -> tuple[list[int], int]:
    """What :func:`enter` needs, tried on the first visible device (the one the ranks share):
    the split, and a green context with a stream on its first group, both released again;
    the SMs of each group and of the device."""
    groups, total = split(0, ranks, percent)
    green = _green_context(0, groups[0])
    try:
        _destroy_stream(_green_stream(green, 0))
    finally:
        _driver.cuGreenCtxDestroy(green)
    return [int(group.sm.sm_count) for group in groups], total


def main(argv: list[str] | None = None) -> int:
    """``python -m ultraep.runtime.sm_partition RANKS PERCENT``: print the SMs each of RANKS
    ranks gets and the device's (exit 0), or why they cannot have green contexts (exit 1)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not all(arg.isdigit() for arg in args):
        print("usage: python -m ultraep.runtime.sm_partition RANKS PERCENT", file=sys.stderr)
        return 2
    ranks, percent = int(args[0]), int(args[1])
    try:
        sms, total = check(ranks, percent)
    except SMPartitionError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(*sms, total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
