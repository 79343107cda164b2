"""Assertions shared by the multi-rank test scripts (``tests/<area>/mpi/*_check.py``).

The scripts run as ``mpiexec -n N python -m mpi4py tests/<area>/mpi/<name>_check.py ...``
(the tests launch them through ``ultraep.runtime.launch``); each puts the repository root on
``sys.path`` first, so this module imports as ``tests.support.mpi_checks`` from anywhere. A
failed check raises AssertionError naming the rank: the job ends with it in its output.
"""

from __future__ import annotations

from typing import Callable


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def expect(fn: Callable[[], object], error_type: type[BaseException] | tuple[type[BaseException], ...],
           *fragments: str) -> str:
    """Call ``fn``: it must raise ``error_type`` (a class or a tuple of them) with every one of
    ``fragments`` in its message. Returns the message."""
    try:
        fn()
    except error_type as exc:
        message = str(exc)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"rank {_rank()}: the error {message!r} lacks {missing}"
        return message
    types = error_type if isinstance(error_type, tuple) else (error_type,)
    raise AssertionError(f"rank {_rank()}: expected {' or '.join(t.__name__ for t in types)} with {list(fragments)}")
