"""``bench balancer --weight-dtype``: BF16 and FP8 experts (float32 scales per 128 x 128
block) side by side -- the FP8 masters and their fp16 compute copies, the replica check
counting a corrupted byte, and the rows end to end on the CPU backend (4 ranks) and on
one GPU (4 ranks)."""

import json

import numpy as np
import pytest

from tests.conftest import requires_gpu
from ultraep.bench import balancer as bench

HIDDEN, FFN = 256, 192  # FFN not a multiple of 128: the last block of each matrix is partial
FP8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_masters_carry_one_scale_per_block_and_dequantise_close_to_bf16(dtype):
    bf16, fp8 = (bench.expert_spec(HIDDEN, FFN, d) for d in ("bfloat16", dtype))
    assert [t.shape for t in fp8.weights] == [(HIDDEN, FFN), (FFN, HIDDEN), (2, 2), (2, 2)]
    assert fp8.scale_of == {"w_in_scale": "w_in", "w_out_scale": "w_out"}
    assert fp8.weight_slot_bytes < 0.55 * bf16.weight_slot_bytes  # half the bytes, scales beside
    wide = bench.fp16_weights(bf16, np)(bench.master_weights(bf16, 3, seed=0))
    fp8_masters = bench.master_weights(fp8, 3, seed=0)
    narrow = bench.fp16_weights(fp8, np)(fp8_masters)
    tolerance = 0.07 if dtype == "float8_e4m3fn" else 0.13  # 3 or 2 mantissa bits, plus bf16's rounding
    for a, b in zip(wide, narrow):
        assert a.dtype == b.dtype == np.float16 and a.shape == b.shape
        assert np.abs(b.astype(np.float32) - a).max() <= tolerance * np.abs(a).max()
    rebuilt = bench.master_weights(fp8, 3, seed=0)  # what another rank rebuilds to check a replica
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(rebuilt, fp8_masters))


class _Replicas:
    """The two Balancer calls the replica check makes: slot 0 holds expert 5, slot 1 is empty."""

    def __init__(self, spec, corrupt: bool):
        self.slots = [bench.master_weights(spec, 5, seed=0), [np.zeros(t.shape, t.dtype) for t in spec.weights]]
        if corrupt:
            self.slots[0][2].view(np.uint8)[0, 1] ^= 1  # one byte of w_in's scales

    def local_experts(self, handle):
        return np.array([0, 1, 5, -1], np.int32)  # 2 masters, then the replica slots

    def replica_weights(self, handle):
        return self.slots


@pytest.mark.parametrize("corrupt", [False, True])
def test_replica_check_counts_differing_bytes_scales_included(corrupt):
    spec = bench.expert_spec(HIDDEN, FFN, "float8_e4m3fn")
    assert bench.replica_diff(_Replicas(spec, corrupt), None, spec, 2, 0, np.asarray) == int(corrupt)


def run_rows(tmp_path, backend, ranks, *extra):
    out = tmp_path / "balancer.json"
    code = bench.main(["--backend", backend, "--ranks", str(ranks), "--experts", "16", "--tokens", "256",
                       "--top-k", "2", "--hidden", str(HIDDEN), "--ffn", str(FFN), "--initial-imbalance", "1.5",
                       "--min-replica-tokens", "16", "--repeats", "2", "--rounds", "2", "--quiet",
                       "--weight-dtype", *FP8, "bfloat16", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())["rows"]


def assert_fp8_rows(rows):
    """bf16 first (the ratios' base), replicas byte-identical, FP8 syncs half the bytes."""
    assert [row["weight_dtype"] for row in rows] == ["bfloat16", *FP8]
    assert [row["weights"] for row in rows] == ["bf16", "fp8e4m3", "fp8e5m2"]
    bf16 = rows[0]
    assert bf16["sync_vs_bf16"] == 1.0
    for row in rows:
        assert row["replicas_mean"] > 0 and row["replica_diff"] == 0
        assert row["sync_vs_bf16"] == pytest.approx(row["weight_sync_dev_ms"] / bf16["weight_sync_dev_ms"])
    for row in rows[1:]:
        assert 0.5 <= row["sync_MB"] / bf16["sync_MB"] < 0.53  # scales and 256-byte alignment add a little


@pytest.mark.mpi
def test_fp8_rows_beside_bf16_on_the_cpu_backend(tmp_path, capfd):
    assert_fp8_rows(run_rows(tmp_path, "host", 4))
    table = capfd.readouterr().out
    assert "sync_vs_bf16" in table and "replica_diff" in table and "fp8e5m2" in table


@pytest.mark.mpi
@pytest.mark.gpu
@requires_gpu
def test_fp8_rows_beside_bf16_on_the_gpu(tmp_path):
    """Replicas synced by the CUDA kernels over IPC byte-identical to the masters (4 ranks sharing the GPU:
    the bench's Zipf routing cannot reach its 1.5 imbalance on 2). The sync on the layer's stream: the
    default where ranks share a GPU (the update starts it) times it inside the update, no ratio."""
    assert_fp8_rows(run_rows(tmp_path, "device", 4, "--sync-stream", "layer"))


@pytest.mark.mpi
def test_sync_mb_is_one_sync_where_one_plan_syncs_every_call(tmp_path):
    """``--steps sync`` syncs the plan in place every call (the record sums them): the row
    still says what one sync moves, as the rows of a new plan a call do."""
    fresh = run_rows(tmp_path, "host", 4)
    again = run_rows(tmp_path, "host", 4, "--steps", "sync")
    assert [row["steps"] for row in again] == ["sync"] * 3
    assert [row["sync_MB"] for row in again] == pytest.approx([row["sync_MB"] for row in fresh])
