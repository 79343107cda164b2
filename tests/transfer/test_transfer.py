"""Data plane across 4 ranks: weight sync (with and without relay), gradient reduction,
empty plans, repeatability, bad input and a relay whose master never sends -- host backend
in CI, CUDA IPC on a GPU; and the host's kernel constants: read from the kernels, never
restated."""

import ast
from pathlib import Path

import pytest

from tests.conftest import BACKENDS, assert_all_ranks_ok, run_ranks
from ultraep.bench import weight_sync as weight_sync_bench
from ultraep.runtime.kernels import kernel_constants
from ultraep.transfer import engine

RANKS = 4


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check, grad_dtype", [("sync", "float32"), ("relay", "float32"), ("relay-grids", "float32"),
                                               ("pipeline", "float32"),
                                               ("grads", "float32"),
                                               ("grads", "bfloat16"), ("empty", "float32"), ("repeat", "float32"),
                                               ("bad-input", "float32"), ("relay-timeout", "float32")])
def test_transfer_across_ranks(backend, check, grad_dtype):
    out = run_ranks(RANKS, "transfer/mpi/transfer_check.py", backend, check, grad_dtype, timeout=240)
    assert_all_ranks_ok(out, RANKS, check)
    if check == "relay":
        assert "until their relay" in out


KERNELS = ("transfer.cu", "schedule.cu", "bench_copy.cu")
HOST_MODULES = sorted(Path(engine.__file__).parent.glob("*.py")) + [Path(weight_sync_bench.__file__)]


def test_engine_limits_are_the_kernels():
    transfer = kernel_constants("transfer.cu")
    assert engine.MAX_TENSORS_PER_EXPERT == transfer["MAX_TENSORS"]
    assert engine.MAX_REPLICAS_PER_EXPERT == transfer["MAX_DESTS"]
    assert engine.DEFAULT_TILE_BYTES % transfer["PIECE_BYTES"] == 0


def test_the_kernels_keep_the_contracts_the_host_relies_on():
    """What the host cannot read as a number: the shape of the launch and of the status."""
    transfer = kernel_constants("transfer.cu")
    # start-up: each thread of a block copies one entry of the destination and peer tables
    assert transfer["SYNC_THREADS"] == 32 * transfer["SYNC_WARPS"] == transfer["DEST_CACHED"]
    assert transfer["STATUS_WORDS"] == 4, "DeviceTransfer.synchronize unpacks (timed out, slot, expected, seen)"
    assert transfer["REDUCE_THREADS"] % 32 == 0 and kernel_constants("schedule.cu")["COMPILE_THREADS"] % 32 == 0


@pytest.mark.parametrize("module", HOST_MODULES, ids=[m.name for m in HOST_MODULES])
def test_no_host_module_restates_a_kernel_constant(module):
    """A module-level integer literal (or arithmetic of literals) under a kernel constant's
    name, or one ending in it like FANOUT_COPY_MAX_DESTS, is a copy that a kernel edit would
    leave behind."""
    names = set().union(*(kernel_constants(k) for k in KERNELS))
    literal = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and all(isinstance(n, literal) for n in ast.walk(node.value)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assert not any(target.id == n or target.id.endswith("_" + n) for n in names), \
                        (f"{module.name}:{node.lineno} {target.id} restates a kernel constant: "
                         "read it with kernel_constant")
