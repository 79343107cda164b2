"""The machine profile measured on the GPU: plausible figures for every quantity (the fused
kernels' tasks among them), a compute curve that is weight-bound at a few rows per expert,
the cost model's threshold between a decode-sized and a prefill-sized expert load, and the
shared probe's kernel A runs started together by the sharers' device barrier."""

import numpy as np
import pytest

from tests.conftest import assert_all_ranks_ok, requires_gpu, run_ranks
from ultraep.transfer import ExpertSpec
from ultraep.tune import load_profile, min_replica_tokens_for, read_profile
from ultraep.tune.replicas import expert_weight_elements

pytestmark = [pytest.mark.gpu, requires_gpu]


def test_device_profile_is_plausible_and_cached(tmp_path):
    import cupy

    path = tmp_path / "profile.json"
    lines = []
    profile = load_profile("device", path=path, force=True, progress=lines.append)
    print("\n" + profile.table())
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    assert profile.backend == "device" and profile.sm_count == properties["multiProcessorCount"]
    assert read_profile(path) == profile and any("expert compute" in line for line in lines)
    assert 2e11 < profile.copy_bytes_per_s < 1e13, profile.copy_bytes_per_s  # bytes copied, not read + written
    assert 1e10 < profile.peer_bytes_per_s < 1e13, profile.peer_bytes_per_s
    assert "copy_bytes" in profile.peer_method
    assert 2e-7 < profile.launch_s < 1e-4, profile.launch_s
    # a warp alone moves far less than the whole GPU, and a flag handoff is microseconds at most
    assert 1e8 < profile.copy_warp_bytes_per_s < profile.peer_bytes_per_s / 64, profile.copy_warp_bytes_per_s
    assert 1e-9 <= profile.flag_s < 2e-5, profile.flag_s
    assert 1e-7 < profile.kernel_s < profile.launch_s * 2, (profile.kernel_s, profile.launch_s)
    # the Dispatcher's copy kernels: 256 threads a block, their registers allow fewer than 2048 / 256
    # (ptxas: 40-48 registers a thread for sm_90, 5 blocks: the model's figure for older profiles)
    assert 1 <= profile.dispatch_blocks_per_sm <= 8, profile.dispatch_blocks_per_sm
    fused = profile.fused  # the fused kernels run on synthetic rows: a 128 x 256 tile at 0.2 .. 10 TFLOPS per SM
    assert fused.sharing == 1 and fused.grids[0] == 1 and fused.grids[-1] == profile.sm_count
    for k in fused.up_k:
        tile = fused.up_tile_s(k, fused.grids)
        assert np.all(0.2e12 < 2.0 * 128 * 256 * k / tile) and np.all(2.0 * 128 * 256 * k / tile < 10e12), tile
        # keeping h stores twice the bytes of act alone and more: never cheaper
        assert np.all(tile >= fused.up_tile_s(k, fused.grids, keeps_h=False) * 0.98)
        relay = fused.relay_task_s(k, fused.grids)  # 128 rows of 2 k bytes: 0.1 .. 100 GB/s a CTA
        assert np.all(0.1e9 < 128 * 2 * k / relay) and np.all(128 * 2 * k / relay < 100e9), relay
    # one process alone on the GPU: every CTA finds its SM at once
    for at_work in (fused.ctas_at_work, fused.down_ctas_at_work):
        assert all(0.95 * g <= v <= g for v, g in zip(at_work, fused.grids)), at_work
    assert fused.relays_on_store_warps
    assert fused.down_y is not None and fused.down_y_note is None
    for k in fused.down_k:
        tile = fused.down_tile_s(k, fused.grids)
        assert np.all(0.2e12 < 2.0 * 128 * 256 * k / tile) and np.all(2.0 * 128 * 256 * k / tile < 10e12), tile
        # storing y too stores each tile twice: never cheaper
        assert np.all(tile >= fused.down_tile_s(k, fused.grids, keeps_y=False) * 0.98)
    curve = profile.compute
    seconds = dict(zip(curve.rows_per_expert, curve.seconds))
    assert seconds[32] < 1.5 * seconds[8], seconds  # weight-bound: 4x the rows, about the same time
    assert seconds[8192] > 4 * seconds[512], seconds  # compute-bound: time grows with the rows
    assert max(curve.tflops()) > 50, curve.tflops()
    assert load_profile("device", path=path) == profile  # reused


def test_threshold_sits_between_decode_and_prefill(tmp_path):
    """hidden 2048, ffn 1024, bf16: a decode step (64 tokens x top-8 per rank, 8 experts per
    rank: 64 rows an expert on average) cannot spare a replica that many tokens; a prefill
    step (8192 rows an expert) can."""
    profile = load_profile("device", path=tmp_path / "profile.json")
    spec = ExpertSpec([("w_in", (2048, 1024), "bfloat16"), ("w_out", (1024, 2048), "bfloat16")])
    threshold = min_replica_tokens_for(spec.weight_slot_bytes, profile, weight_elements=expert_weight_elements(spec))
    print(f"\nmin_replica_tokens='auto' for {spec}: {threshold}")
    assert 128 < threshold < 4096, threshold


def run_emulated(ranks: int, script: str, tag: str) -> None:
    """``tests/tune/mpi/<script>`` on ``ranks`` ranks of this GPU under a private MPS daemon,
    100 / ranks % of the SMs each; every rank must say ``[tag] rank N OK``."""
    from ultraep.errors import MPSUnavailable
    from ultraep.runtime.mps import start_emulation

    percent = 100 // ranks
    try:
        daemon = start_emulation(ranks, percent)
    except MPSUnavailable as exc:
        pytest.skip(f"no MPS daemon: {exc}")
    with daemon:
        out = run_ranks(ranks, f"tune/mpi/{script}", timeout=600, env=daemon.client_environment(percent))
    print(out)
    assert_all_ranks_ok(out, ranks, tag)


@pytest.mark.mpi
def test_sharers_kernel_a_runs_start_together_on_a_device_barrier():
    """Two ranks of one GPU under MPS (time-sliced ranks would take turns, never start together)."""
    run_emulated(2, "shared_probe_check.py", "shared-probe")


@pytest.mark.mpi
def test_the_weight_sync_timed_by_rank_0_gives_rates_the_model_meets():
    """Four ranks of one GPU under MPS at 25 % each (tests/tune/mpi/sync_rates_check.py)."""
    run_emulated(4, "sync_rates_check.py", "sync-rates")
