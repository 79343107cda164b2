"""NCCL baselines for the benchmarks: the same bytes moved by ``torch.distributed`` over NCCL,
timed beside ultraep's own transfers in the same run.

:class:`NcclBaseline` opens a ``torch.distributed`` NCCL process group over the ranks of an
:class:`~ultraep.runtime.group.EPGroup` (rendezvous address and port from rank 0 through
the group's own allgather) and times ``batch_isend_irecv`` of a list of ``(src, dst,
bytes)`` transfers and ``all_to_all_single`` of a ``[src][dst]`` byte matrix. Times are
the whole group's window per call (:func:`~ultraep.bench.timing.group_window_ms`).

NCCL refuses two ranks on one GPU, and torch is not a dependency of the package: before
any NCCL call every rank reports what it has, and all ranks agree on one verdict
(:func:`skip_reason`). When the baseline cannot run, every measurement returns ``None``
and :attr:`NcclBaseline.reason` says why ("not run (4 ranks share one GPU)"), which the
benchmarks print in place of the figure. torch is imported only here, only when asked.
"""

from __future__ import annotations

import datetime
import os
import socket

from ultraep.bench.timing import group_window_ms
from ultraep.runtime.group import gpu_identity, most_ranks_on_one_gpu

# NVLink multicast (NVLS) can put a shared host's GPUs out of service; none of the
# operations timed here needs it. Forced off before NCCL reads its environment.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
INIT_TIMEOUT_S = 120


def skip_reason(identities: list, local_errors: list) -> str | None:
    """Why the NCCL baseline cannot run, or ``None``: the same answer on every rank.

    ``identities[r]`` is rank r's GPU as ``(host, PCI bus id)`` (``None``: no GPU);
    ``local_errors[r]`` what rank r could not do (e.g. import torch), or ``None``.
    """
    without_gpu = [r for r, identity in enumerate(identities) if identity is None]
    if without_gpu:
        return f"not run (rank {without_gpu[0]} has no GPU)"
    most = most_ranks_on_one_gpu(identities)
    if most > 1:
        return f"not run ({most} ranks share one GPU)"
    failed = [(r, error) for r, error in enumerate(local_errors) if error is not None]
    if failed:
        return f"not run (rank {failed[0][0]}: {failed[0][1]})"
    return None


def _local_state(group):
    """This rank's ``(GPU identity, error)``; imports torch only where a GPU exists."""
    identity = gpu_identity(group)
    if identity is None:
        return None, None
    try:
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()):
            return identity, f"torch {torch.__version__} has no CUDA/NCCL here"
    except ImportError as exc:
        return identity, f"torch is not importable ({exc})"
    return identity, None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class NcclBaseline:
    """Collective: a torch.distributed NCCL group over ``group``'s ranks, or the reason it
    was not run. Use as a context manager (closing is collective too)."""

    def __init__(self, group):
        self.group = group
        identity, error = _local_state(group)
        states = group.allgather((identity, error))
        self.reason = skip_reason([s[0] for s in states], [s[1] for s in states])
        if self.reason is not None:
            return
        import torch
        import torch.distributed as dist

        os.environ.update(MULTICAST_OFF)
        address = "127.0.0.1" if group.all_on_one_host else socket.gethostbyname(group.hostname)
        address, port = group.allgather((address, _free_port() if group.rank == 0 else None))[0]
        self.device = torch.device("cuda", group.device)
        torch.cuda.set_device(self.device)
        dist.init_process_group("nccl", init_method=f"tcp://{address}:{port}", rank=group.rank,
                                world_size=group.size, timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
                                device_id=self.device)
        # Every rank takes part in a first collective, so later point-to-point batches in
        # which some ranks have nothing to do find the communicator set up.
        dist.barrier(device_ids=[group.device])

    @property
    def runs(self) -> bool:
        return self.reason is None

    def _time(self, call, repeats: int) -> float:
        import torch

        return group_window_ms(self.group, call, repeats, torch.cuda.synchronize)

    def batch_isend_irecv_ms(self, transfers, repeats: int) -> float | None:
        """ms per call of one ``batch_isend_irecv`` of every ``(src, dst, nbytes)`` transfer
        (a rank posts its sends and receives; a rank with neither only joins the timing)."""
        if not self.runs:
            return None
        import torch
        import torch.distributed as dist

        me = self.group.rank
        ops = []
        for src, dst, nbytes in transfers:
            if src == dst:
                raise ValueError(f"transfer {src} -> {dst}: a rank does not send to itself")
            if me in (src, dst):
                buffer = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.isend, buffer, dst) if me == src else dist.P2POp(dist.irecv, buffer, src))

        def call():
            if ops:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

        return self._time(call, repeats)

    def all_to_all_single_ms(self, byte_matrix, repeats: int) -> float | None:
        """ms per call of ``all_to_all_single`` where rank s sends ``byte_matrix[s][d]`` bytes to rank d."""
        if not self.runs:
            return None
        import torch
        import torch.distributed as dist

        me, size = self.group.rank, self.group.size
        if len(byte_matrix) != size or any(len(row) != size for row in byte_matrix):
            raise ValueError(f"byte_matrix must be {size} x {size}")
        send = [int(byte_matrix[me][d]) for d in range(size)]
        receive = [int(byte_matrix[s][me]) for s in range(size)]
        source = torch.empty(sum(send), dtype=torch.uint8, device=self.device)
        target = torch.empty(sum(receive), dtype=torch.uint8, device=self.device)
        return self._time(lambda: dist.all_to_all_single(target, source, receive, send), repeats)

    def close(self) -> None:
        if self.runs:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
