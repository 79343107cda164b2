"""The performance model on a synthetic H200-like profile: each phase's limits where they
must bind (the warps of a small grid, the shared bandwidth of a large one, GEMM waves over
the CTAs, the reduce tail), the problem's derived quantities, and refusals."""

import dataclasses

import numpy as np
import pytest

from tests.tune.synthetic import fused_like, h200_like
from ultraep.errors import ProfileError
from ultraep.planner import ExpertLayout, Plan
from ultraep.tune import model
from ultraep.tune.device import COPY_THREADS, DISPATCH_POINTER_BYTES
from ultraep.tune.model import (COPY_LOADS_IN_FLIGHT, DISPATCH_BLOCKS_UNMEASURED, DISPATCH_THREADS, DISPATCH_UNROLL,
                                FM_BM, FM_DOWN_COLS, FM_UP_COLS, L2_TRIP_FRACTION, MEMORY_CHANNELS, PIECE_BYTES,
                                ROW_ROUND_FRACTION, ROW_STORE_FRACTION, SYNC_MIN_BLOCKS, SYNC_WARPS,
                                TOKEN_MAP_SEGMENT_ITEMS, WARP_THREADS, Problem, SyncProblem, _loaded_unit_s,
                                _round_trip_s, _task_rounds_s, combine_s,
                                dispatch_blocks_per_sm, dispatch_s, fused_down_s, fused_up_s, fused_windows, join,
                                predict, pull_s, sms_bound_peer_copy, solved_sync_rates, token_map_trips,
                                weight_sync_s)
from ultraep.tune.profile import SyncTimes

PROFILE = h200_like()
PROBLEM = Problem(tokens=4096, hidden=4096, ffn=1536, top_k=8, experts=64, ranks=4)
EXPERT = 3 * 4096 * 1536 * 2
# a quarter of the H200 under MPS as the probe measured it (h200_sync_fanouts_325ac3e.json)
MEASURED_SHARE = dataclasses.replace(h200_like(sm_share=25, peer_bytes_per_s=1.375e12), copy_warp_bytes_per_s=2.97e9,
                                     shared_by=4, shared_copy_bytes_per_s=2.0e12)


def test_problem_derived_quantities_and_refusals():
    assert PROBLEM.rows.tolist() == [2048] * 16 and PROBLEM.m_tiles() == 16 * (2048 // FM_BM)
    assert Problem(64, 64, 64, 1, 8, 4).crossings == pytest.approx(1.0)  # one expert: one rank
    assert Problem(64, 64, 64, 8, 8, 4).crossings == pytest.approx(4.0)  # every expert: every rank
    assert 1.0 < PROBLEM.crossings < 4.0
    skewed = Problem(4096, 4096, 1536, 8, 64, 4, slot_rows=(5000, 1, 0) + (0,) * 13, sends_per_token=2.0)
    assert skewed.m_tiles() == -(-5000 // FM_BM) + 1 and skewed.crossings == 2.0
    with pytest.raises(ProfileError, match="do not divide"):
        Problem(64, 64, 64, 2, 10, 4)
    with pytest.raises(ProfileError, match="top_k"):
        Problem(64, 64, 64, 9, 8, 4)
    with pytest.raises(ProfileError, match="tokens must be a positive integer"):
        Problem(0, 64, 64, 2, 8, 4)
    with pytest.raises(ProfileError, match="slot_rows"):
        Problem(64, 64, 64, 2, 8, 4, slot_rows=(-1,))
    with pytest.raises(ProfileError, match="keeps_h"):
        Problem(64, 64, 64, 2, 8, 4, keeps_h=1)


# the weight sync as the profile timed it on an H100 (4 ranks, green contexts of 32 SMs a rank)
TIMED_SHARE = dataclasses.replace(MEASURED_SHARE, sm_count=32, sync=SyncTimes(
    sharing=4, fanout=3, expert_bytes=EXPERT, times_s=(2.665e-3, 2.939e-3, 0.088e-3)))
TIMED_SYNC = model.sync_rates(TIMED_SHARE)


def _pieces_s(profile, sync, blocks):
    """The warps' part of a sync: less the kernel and its round trips outside the pieces."""
    serial_s = model.SYNC_SERIAL_ROUND_TRIPS * _round_trip_s(profile)
    return weight_sync_s(profile, sync, blocks) - profile.kernel_s - serial_s


def test_weight_sync_one_block_waits_on_its_latency_then_on_its_sm():
    """One block: every piece of a warp at its latency joined with the SM's pipe -- fan-out 1
    near the latency alone, fan-out 7's stores 8 bytes moved a byte loaded, nearer the pipe."""
    pieces = -(-EXPERT // PIECE_BYTES)
    for fanout in (1, 7):
        pipe = SYNC_WARPS * PIECE_BYTES * (1 + fanout) / TIMED_SYNC.sm_bytes_per_s
        path = SYNC_WARPS * PIECE_BYTES * (1 + model.SYNC_STORE_WEIGHT * fanout) / TIMED_SYNC.path_bytes_per_s
        piece = (TIMED_SYNC.piece_s ** 4 + pipe ** 4 + path ** 4) ** 0.25
        tail = model.SYNC_TAIL_PIECES * piece
        assert float(_pieces_s(TIMED_SHARE, SyncProblem(EXPERT, (fanout,)), 1)) == pytest.approx(
            pieces / SYNC_WARPS * piece + tail)
    one, seven = (float(_pieces_s(TIMED_SHARE, SyncProblem(EXPERT, (f,)), 1)) for f in (1, 7))
    assert one == pytest.approx(pieces / SYNC_WARPS * TIMED_SYNC.piece_s, rel=0.02)
    assert 1.5 * one < seven < 8 * one


def test_claimed_pieces_leave_no_sawtooth_past_the_sms():
    """Warps claim their pieces, so a block past a multiple of the SMs adds its warps' rate
    rather than a second wait on its SM: k SMs' worth of blocks and one more take about as long,
    at fan-outs 1 and 7 (the fixed-share kernel measured +93 % at 18 blocks on 16 SMs), and up
    to the SMs every block more is faster."""
    sms = TIMED_SHARE.usable_sms
    for fanout in (1, 7):
        times = weight_sync_s(TIMED_SHARE, SyncProblem(EXPERT, (fanout,)), np.arange(1, SYNC_MIN_BLOCKS * sms + 1))
        assert np.all(np.diff(times[:sms]) < 0)
        for k in range(1, SYNC_MIN_BLOCKS):
            assert times[k * sms] < 1.03 * times[k * sms - 1]


def test_the_path_binds_as_the_sms_fill_and_is_shared_by_the_busy_ones():
    """A narrower path makes full grids slower, a lone block hardly: each busy SM's share of it
    shrinks as SMs join."""
    narrow = dataclasses.replace(TIMED_SYNC, path_bytes_per_s=0.5e12)
    sms, pieces, full = TIMED_SHARE.usable_sms, -(-EXPERT // PIECE_BYTES), SYNC_MIN_BLOCKS * TIMED_SHARE.usable_sms

    def warps_s(rates, blocks):
        return float(model._sync_warps_s(rates, sms, pieces, blocks, 7.0))

    assert warps_s(narrow, 1) < 1.01 * warps_s(TIMED_SYNC, 1)
    assert warps_s(narrow, full) > 1.5 * warps_s(TIMED_SYNC, full)
    assert warps_s(narrow, full) >= EXPERT * (1 + model.SYNC_STORE_WEIGHT * 7) / narrow.path_bytes_per_s


def test_the_profile_s_sync_times_pin_the_rates_the_model_meets():
    """The rates are solved from the three syncs the profile timed, and the model meets them;
    the model's own times under those rates give the same rates back; with fan-out 1 alone (2
    ranks) the SM's pipe keeps its estimate. Memoised per profile."""
    full = SYNC_MIN_BLOCKS * TIMED_SHARE.usable_sms
    points = ((1, 1), (3, 1), (3, full))
    for (fanout, blocks), t in zip(points, TIMED_SHARE.sync.times_s):
        assert float(weight_sync_s(TIMED_SHARE, SyncProblem(EXPERT, (fanout,)), blocks)) == pytest.approx(t, rel=1e-4)
    times = [float(weight_sync_s(TIMED_SHARE, SyncProblem(EXPERT, (f,)), b)) for f, b in points]
    again = solved_sync_rates(TIMED_SHARE, EXPERT, 3, times)
    for solved, known in zip(dataclasses.astuple(again), dataclasses.astuple(TIMED_SYNC)):
        assert solved == pytest.approx(known, rel=1e-3)
    two = dataclasses.replace(TIMED_SHARE, sync=SyncTimes(sharing=2, fanout=1, expert_bytes=EXPERT,
                                                          times_s=(times[0], times[0], times[2] / 2)))
    rates = model.sync_rates(two)
    assert rates.sm_bytes_per_s == model.estimated_sync_rates(TIMED_SHARE).sm_bytes_per_s
    assert rates.piece_s == pytest.approx(TIMED_SYNC.piece_s, rel=0.05)
    assert model.sync_rates(two) is rates


def test_an_untimed_profile_estimates_the_rates_from_its_copies():
    """No sync timed (one process, the host, a profile before version 12): the latency in
    round trips, the SM's pipe and the path as fractions of the peer copy."""
    rates = model.sync_rates(MEASURED_SHARE)
    assert rates == model.estimated_sync_rates(MEASURED_SHARE)
    assert rates.piece_s == pytest.approx(_round_trip_s(MEASURED_SHARE) * model.SYNC_ESTIMATE_LATENCY_ROUNDS)
    assert sms_bound_peer_copy(MEASURED_SHARE)
    assert rates.sm_bytes_per_s == pytest.approx(
        model.SYNC_ESTIMATE_SM_FRACTION * 2 * MEASURED_SHARE.peer_bytes_per_s / MEASURED_SHARE.usable_sms)
    assert rates.path_bytes_per_s == pytest.approx(
        model.SYNC_ESTIMATE_PATH_FRACTION * (1 + model.SYNC_STORE_WEIGHT) * MEASURED_SHARE.peer_bytes_per_s)
    # where the memory bounds the peer copy (a whole GPU), an SM copies what one probe block does
    assert not sms_bound_peer_copy(PROFILE)
    assert model.sync_rates(PROFILE).sm_bytes_per_s == pytest.approx(
        model.SYNC_ESTIMATE_SM_FRACTION * 2 * PROFILE.copy_warp_bytes_per_s * COPY_THREADS / WARP_THREADS)


def test_weight_sync_ranks_copying_at_once_share_the_memory():
    """The memory moves every copying rank's bytes at its shared rate at most: four ranks of a
    whole GPU copying at once take at least their bytes over it."""
    sync, shared = SyncProblem(EXPERT, (3,)), SyncProblem(EXPERT, (3,), ranks_copying=4)
    copied = EXPERT * (1 + 3) / 2
    grid = SYNC_MIN_BLOCKS * PROFILE.usable_sms
    assert float(weight_sync_s(PROFILE, shared, grid)) >= 4 * copied / PROFILE.gpu_copy_bytes_per_s(4)
    assert float(weight_sync_s(PROFILE, shared, grid)) > float(weight_sync_s(PROFILE, sync, grid))
    assert float(weight_sync_s(PROFILE, SyncProblem(EXPERT, ()), grid)) == PROFILE.kernel_s


def test_weight_sync_blocks_beyond_residency_find_nothing_left():
    """A block past those resident starts once another has ended, when the claimed pieces are
    gone: the call lasts what the resident grid's does."""
    resident = SYNC_MIN_BLOCKS * TIMED_SHARE.usable_sms
    sync = SyncProblem(EXPERT, (1,))
    assert float(weight_sync_s(TIMED_SHARE, sync, resident + 5)) == float(weight_sync_s(TIMED_SHARE, sync, resident))


def test_sync_problem_from_a_plan():
    from ultraep.tune.sync_timing import single_expert_plan

    layout = ExpertLayout(4, 4, 1, max_instances=4)
    plan = single_expert_plan(layout, 3)
    assert isinstance(plan, Plan)
    assert SyncProblem.from_replica_count(plan.replica_count, 1, 1000, ranks_per_gpu=4) == SyncProblem(1000, (3,), 1)
    # two experts a rank: rank 1 sends 2 + 1 replicas, rank 0 one; both copy at once on a shared GPU
    counts = np.array([2, 1, 3, 2, 1, 1])
    assert SyncProblem.from_replica_count(counts, 2, 10, ranks_per_gpu=3) == SyncProblem(10, (2, 1), 2)


def test_the_dispatch_block_is_the_dispatchers():
    from ultraep.token.device import POINTER_BYTES, THREADS

    assert (DISPATCH_THREADS, DISPATCH_POINTER_BYTES) == (THREADS, POINTER_BYTES)


def test_dispatch_and_combine_scale_with_the_bytes_once_bandwidth_binds():
    grids = np.array([33, 132, 264, 1056])
    small, large = dispatch_s(PROFILE, PROBLEM, grids), combine_s(PROFILE, PROBLEM, grids)
    assert np.all(np.diff(small) <= 0) and np.all(np.diff(large) <= 0)
    wide = Problem(4096, 8192, 1536, 8, 64, 4)
    assert 1.6 < float(dispatch_s(PROFILE, wide, 1056)) / float(dispatch_s(PROFILE, PROBLEM, 1056)) < 2.05
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    assert float(combine_s(PROFILE, shared, 1056)) > 2.5 * float(combine_s(PROFILE, PROBLEM, 1056))


def test_fused_phases_count_measured_tiles_in_waves_over_the_ctas():
    costs = PROFILE.fused
    up_tiles = PROBLEM.m_tiles() * -(-PROBLEM.ffn // FM_UP_COLS)
    half, full = fused_up_s(PROFILE, PROBLEM, np.array([66, 132]), 16)
    tile_half, tile_full = costs.up_tile_s(PROBLEM.hidden, [66, 132])
    assert tile_half < tile_full  # the profile's tiles slow down as more CTAs run them
    assert np.ceil(up_tiles / 66) * tile_half < half < np.ceil(up_tiles / 66) * tile_half * 1.2
    assert np.ceil(up_tiles / 132) * tile_full < full
    # an up tile that keeps h costs more than one that stores act alone
    inference = dataclasses.replace(PROBLEM, keeps_h=False)
    assert float(fused_up_s(PROFILE, inference, 132, 16)) < float(full)
    down_tiles = PROBLEM.m_tiles() * (PROBLEM.hidden // FM_DOWN_COLS)
    down = float(fused_down_s(PROFILE, PROBLEM, 132, 16))
    assert down > np.ceil(down_tiles / 132) * float(costs.down_tile_s(PROBLEM.ffn, 132)) + PROFILE.kernel_s
    # a reduce task of many tokens is the tail after the last tile; tasks of few fit the idle CTAs
    assert float(fused_down_s(PROFILE, PROBLEM, 132, 4096)) > float(fused_down_s(PROFILE, PROBLEM, 132, 16))
    # small send tasks leave task warps idle, many claims cost: the send size moves kernel A at one CTA
    assert float(fused_up_s(PROFILE, PROBLEM, 1, 4)) > float(fused_up_s(PROFILE, PROBLEM, 1, 16))


def test_fewer_senders_send_longer_while_the_others_run_tiles():
    """Every CTA a sender: the sends, then the tiles (the default). Fewer: the sends take
    longer on them alone, the others run tiles meanwhile -- a gain where the sends are
    bandwidth-bound (many CTAs at once), a loss where one sender is latency-bound; never
    below the tiles' work spread over every CTA."""
    every = float(fused_up_s(PROFILE, PROBLEM, 132, 16))
    assert every == float(fused_up_s(PROFILE, PROBLEM, 132, 16, senders=132))
    up_tiles = PROBLEM.m_tiles() * -(-PROBLEM.ffn // FM_UP_COLS)
    spread = up_tiles / 132 * float(PROFILE.fused.up_tile_s(PROBLEM.hidden, 132))
    fewer = {senders: float(fused_up_s(PROFILE, PROBLEM, 132, 16, senders=senders)) for senders in (66, 16, 1)}
    assert all(spread < t for t in fewer.values())
    assert fewer[16] < every < fewer[1]


def test_send_and_reduce_tasks_are_whole_rounds_over_the_ctas():
    """A CTA runs whole tasks: 32 tasks on 28 CTAs take two task times, not 32 / 28 of one;
    a round binds at the bandwidth on its share of the traffic, a partial last round moves
    little and takes its task's time."""
    task = 100e-6
    assert _task_rounds_s(32.0, 28.0, task, 0.0) == pytest.approx(2 * task)
    assert _task_rounds_s(28.0, 28.0, task, 0.0) == pytest.approx(task)
    assert _task_rounds_s(256.0, 32.0, task, 0.0) == pytest.approx(8 * task)
    assert _task_rounds_s(32.0, 28.0, 1e-9, 1e-3) == pytest.approx(1e-3, rel=1e-4)  # the bandwidth's alone
    assert _task_rounds_s(32.0, 28.0, task, 1e-3) == pytest.approx(
        float(join(28 / 32 * 1e-3, task) + join(4 / 32 * 1e-3, task)))
    # kernel B's tail on 28 CTAs at work against 32: 32 reduce tasks of 128 tokens (4096 a
    # rank) take a second round, whatever the last wave's few idle CTAs hold
    problem = dataclasses.replace(PROBLEM, ranks_per_gpu=1)
    down_tiles = problem.m_tiles() * -(-problem.hidden // FM_DOWN_COLS)
    tile = float(PROFILE.fused.down_tile_s(problem.ffn, 32))
    tails = [float(fused_down_s(PROFILE, problem, 32, 128, w)) - np.ceil(down_tiles / w) * tile
             for w in (28, 32)]
    assert tails[0] > 1.5 * tails[1]


def test_fused_kernels_use_the_costs_measured_with_as_many_sharers():
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    quarter = h200_like(sm_share=25)
    slower = dataclasses.replace(quarter.fused, sharing=4, up=tuple(tuple(2 * v for v in row)
                                                                    for row in quarter.fused.up))
    measured = dataclasses.replace(quarter, shared_fused=slower, shared_by=4)
    alone, together = (float(fused_up_s(p, shared, 33, 16)) for p in (quarter, measured))
    tiles = np.ceil(PROBLEM.m_tiles() * -(-PROBLEM.ffn // FM_UP_COLS) / 33)
    assert together - alone == pytest.approx(tiles * float(quarter.fused.up_tile_s(4096, 33)), rel=1e-6)
    # measured with another number of sharers: this process's own
    assert float(fused_up_s(measured, dataclasses.replace(shared, ranks_per_gpu=2), 33, 16)) == pytest.approx(
        float(fused_up_s(quarter, dataclasses.replace(shared, ranks_per_gpu=2), 33, 16)))


def test_fused_windows_hold_the_spread_of_the_ranks_kernel_a():
    light = Problem(4096, 4096, 1536, 8, 64, 4, slot_rows=(2000,) * 16)
    heavy = Problem(4096, 4096, 1536, 8, 64, 4, slot_rows=(2100,) * 16)  # 17 M-tiles a slot, not 16
    ctas = np.array([33, 132])
    windows = fused_windows(PROFILE, [light, heavy], ctas, 16, 16)
    up = {p: fused_up_s(PROFILE, p, ctas, 16) for p in (light, heavy)}
    down = {p: fused_down_s(PROFILE, p, ctas, 16) for p in (light, heavy)}
    assert np.all(up[heavy] > up[light]) and windows["up"] == pytest.approx(up[heavy])
    assert windows["forward"] == pytest.approx(up[heavy] + down[heavy])
    # kernel B's window opens when the light rank's kernel A ends
    assert windows["down"] == pytest.approx(down[heavy] + up[heavy] - up[light])
    alone = fused_windows(PROFILE, [heavy], ctas, 16, 16)
    assert alone["down"] == pytest.approx(down[heavy]) and alone["forward"] == pytest.approx(up[heavy] + down[heavy])


def test_relays_on_the_store_warps_run_beside_the_tiles():
    """Since profile version 6 the relays run on every CTA's store warps: the tiles start as
    the sends end and the relays cost nothing unless all of them outlast the tiles; before,
    they were claimed tasks between the sends and the tiles."""
    claimed = dataclasses.replace(PROFILE, fused=dataclasses.replace(PROFILE.fused, relays_on_store_warps=False))
    ctas = np.array([8, 33, 132])
    beside, before = fused_up_s(PROFILE, PROBLEM, ctas, 16), fused_up_s(claimed, PROBLEM, ctas, 16)
    relay = PROFILE.fused.relay_task_s(PROBLEM.hidden, ctas)
    assert np.all(before - beside > 0.8 * PROBLEM.m_tiles() * relay / ctas)  # the relays' share of the CTAs
    tile = PROFILE.fused.up_tile_s(PROBLEM.hidden, ctas)
    tiles = np.ceil(PROBLEM.m_tiles() * (PROBLEM.ffn // FM_UP_COLS) / ctas) * tile
    assert np.all(beside - tiles > PROFILE.kernel_s)  # the sends before the tiles
    # relays far slower than the tiles bound the kernel: all of them on the store warps, then the
    # tiles of the last M-tile group (8 M-tiles of 12 column blocks)
    slow = dataclasses.replace(PROFILE.fused, relay=tuple(tuple(v * 1e3 for v in row) for row in PROFILE.fused.relay))
    bound = float(fused_up_s(dataclasses.replace(PROFILE, fused=slow), PROBLEM, 132, 16))
    relays = float(slow.relay_task_s(PROBLEM.hidden, 132)) * PROBLEM.m_tiles() / 132
    last_group = np.ceil(8 * (PROBLEM.ffn // FM_UP_COLS) / 132) * float(tile[-1])
    assert bound == pytest.approx(PROFILE.kernel_s + relays + last_group, rel=1e-6)


def test_a_rank_with_fewer_ctas_at_work_runs_its_waves_on_those():
    """The profile's CTAs at work (the unluckiest sharer's): the tiles keep their cost at the
    grid, their waves run over the CTAs at work; the default is that rank's, whom the group
    waits for; ``working`` sets it (every CTA, for the ranks that kept theirs)."""
    quarter = h200_like(sm_share=25)
    grids = quarter.fused.grids
    lacking = dataclasses.replace(quarter.fused, sharing=4,
                                  ctas_at_work=tuple(float(min(g, 24)) for g in grids))
    profile = dataclasses.replace(quarter, shared_fused=lacking, shared_by=4)
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    ctas = np.array([16, 21, 33])  # measured grids of 33 SMs: ..., 17, 21, 25, 29, 33
    assert lacking.working_ctas(ctas).tolist() == [16, 21, 24]
    lagging, kept = fused_up_s(profile, shared, ctas, 16), fused_up_s(profile, shared, ctas, 16, ctas)
    assert lagging[:2] == pytest.approx(kept[:2]) and lagging[2] > kept[2]
    tile = float(lacking.up_tile_s(4096, 33))
    waves = np.ceil(shared.m_tiles() * (shared.ffn // FM_UP_COLS) / np.array([24, 33]))
    assert lagging[2] - kept[2] == pytest.approx((waves[0] - waves[1]) * tile, rel=0.05)
    assert float(fused_down_s(profile, shared, 33, 16)) > float(fused_down_s(profile, shared, 33, 16, 33))
    # the group's windows: each rank lags in turn, the median of the turns; one rank: that rank lagging
    windows = fused_windows(profile, [shared, shared], ctas, 16, 16)
    down_lagging, down_kept = fused_down_s(profile, shared, ctas, 16), fused_down_s(profile, shared, ctas, 16, ctas)
    assert windows["up"] == pytest.approx(lagging)
    assert windows["forward"] == pytest.approx(lagging + down_lagging)
    assert windows["down"] == pytest.approx(lagging + down_lagging - kept)
    alone = fused_windows(profile, [shared], ctas, 16, 16)
    assert alone["up"] == pytest.approx(lagging) and alone["down"] == pytest.approx(down_lagging)
    assert float(down_kept[2]) < float(down_lagging[2])


def test_kernel_b_runs_its_waves_over_its_own_ctas_at_work():
    """Since profile version 8 the down tiles' CTAs at work are measured apart: kernel B's
    waves run over those, kernel A's over the up tiles'; the lagging rank's kernel B may keep
    every CTA while its kernel A lacks some (before, kernel A's stood for both)."""
    quarter = h200_like(sm_share=25)
    grids = quarter.fused.grids
    costs = dataclasses.replace(quarter.fused, sharing=4, ctas_at_work=tuple(float(min(g, 24)) for g in grids),
                                down_ctas_at_work=tuple(float(min(g, 30)) for g in grids))
    profile = dataclasses.replace(quarter, shared_fused=costs, shared_by=4)
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    ctas = np.array([16, 33])
    assert float(fused_down_s(profile, shared, 33, 16)) == pytest.approx(float(fused_down_s(profile, shared, 33, 16,
                                                                                              30)))
    assert float(fused_up_s(profile, shared, 33, 16)) == pytest.approx(float(fused_up_s(profile, shared, 33, 16, 24)))
    full = dataclasses.replace(profile, shared_fused=dataclasses.replace(costs, down_ctas_at_work=tuple(
        float(g) for g in grids)))
    windows = fused_windows(full, [shared, shared], ctas, 16, 16)
    up_lagging, up_kept = fused_up_s(full, shared, ctas, 16), fused_up_s(full, shared, ctas, 16, ctas)
    down = fused_down_s(full, shared, ctas, 16, ctas)
    assert windows["up"] == pytest.approx(up_lagging) and windows["forward"] == pytest.approx(up_lagging + down)
    assert windows["down"] == pytest.approx(up_lagging - up_kept + down)  # the lag of kernel A, then all of B


def test_predict_broadcasts_each_phase_over_its_own_knobs():
    configs = {"sync_blocks": np.array([64, 528]).reshape(2, 1, 1), "dispatch_grid": np.array([264]).reshape(1, 1, 1),
               "ctas": np.array([66, 99, 132]).reshape(1, 3, 1), "send_tokens": np.array([16]),
               "reduce_tokens": np.array([8, 16, 32, 64]).reshape(1, 1, 4)}
    phases = predict(PROFILE, PROBLEM, SyncProblem(EXPERT, (2,)), configs)
    assert phases["weight_sync"].shape == (2, 1, 1) and phases["fused_down"].shape == (1, 3, 4)
    assert sum(phases.values()).shape == (2, 3, 4)
    assert np.all(predict(PROFILE, PROBLEM, None, configs)["weight_sync"] == 0)
    assert float(phases["fused_up"][0, 2, 0]) == pytest.approx(float(fused_up_s(PROFILE, PROBLEM, 132, 16)))


def test_join_lies_between_the_larger_limit_and_their_sum():
    a, b = np.array([1.0, 1.0, 1.0]), np.array([0.0, 1.0, 10.0])
    joined = join(a, b)
    assert np.all(joined >= np.maximum(a, b)) and np.all(joined <= a + b) and joined[0] == 1.0


def test_dispatch_kernels_wait_for_what_they_read_on_small_grids_and_for_the_bandwidth_on_resident_ones():
    """Per grid: a warp per unit, 8 warps a block, a round trip (heap.cu's copy round at the
    per-warp rate) per UNROLL 16-byte vectors a lane loads: a received row waits for one row's
    loads, a token reduced or pulled for its top_k rows', a token sent for one row's loads or,
    where they take longer, its stores to each of its ranks -- 8 KB rows: 4 rounds a row, 32 a
    token summed -- a row's round ROW_ROUND_FRACTION of it, a row stored ROW_STORE_FRACTION,
    and before them its dependent index loads from L2 (2 a token sent or pulled, 1 a row
    expanded, 2 a row sent back, none a token reduced). One block's 8 warps hardly queue at the
    memory: within 4 % of their round trips; nothing moves once the bandwidth binds, and more
    blocks never cost more than a ragged end's rounds."""
    trip = WARP_THREADS * 16 * COPY_LOADS_IN_FLIGHT / PROFILE.copy_warp_bytes_per_s
    row_rounds, sum_rounds = 4, PROBLEM.row_bytes // (16 * WARP_THREADS) * PROBLEM.top_k // DISPATCH_UNROLL
    assert (DISPATCH_UNROLL, sum_rounds) == (4, 32)
    warps, recv = DISPATCH_THREADS // WARP_THREADS, float(PROBLEM.rows.sum())
    tokens_a_warp, rows_a_warp = np.ceil(PROBLEM.tokens / warps), np.ceil(recv / warps)
    row, index = row_rounds * ROW_ROUND_FRACTION, L2_TRIP_FRACTION
    sent = row_rounds * max(ROW_ROUND_FRACTION, PROBLEM.crossings * ROW_STORE_FRACTION)  # its stores bind
    assert sent > 1.5 * row
    assert float(dispatch_s(PROFILE, PROBLEM, 1)) == pytest.approx(
        (tokens_a_warp * (sent + 2 * index) + rows_a_warp * (row + index) + token_map_trips(PROBLEM)) * trip, rel=0.04)
    assert float(combine_s(PROFILE, PROBLEM, 1)) == pytest.approx(
        (rows_a_warp * (row + 2 * index) + tokens_a_warp * sum_rounds) * trip, rel=0.03)
    assert float(pull_s(PROFILE, PROBLEM, 1)) == pytest.approx(tokens_a_warp * (sum_rounds + 2 * index) * trip,
                                                               rel=0.03)
    # a token stored to one rank waits for its loads, to four for its stores: its sends take
    # 4 x ROW_STORE_FRACTION / ROW_ROUND_FRACTION as long on one block
    one, every = (dataclasses.replace(PROBLEM, sends_per_token=sends) for sends in (1.0, 4.0))
    sends_gap = tokens_a_warp * row_rounds * (4 * ROW_STORE_FRACTION - ROW_ROUND_FRACTION) * trip
    assert float(dispatch_s(PROFILE, every, 1) - dispatch_s(PROFILE, one, 1)) == pytest.approx(sends_gap, rel=0.03)
    resident = dispatch_blocks_per_sm(PROFILE) * PROFILE.sm_count
    assert float(dispatch_s(PROFILE, every, resident)) > 1.1 * float(dispatch_s(PROFILE, one, resident))
    grids = np.arange(1, resident + 1)
    for phase in (dispatch_s, combine_s, pull_s):
        times = phase(PROFILE, PROBLEM, grids)
        assert np.all(np.diff(times) <= 0.005 * times[1:]) and times[0] > 20 * times[-1]
    copied = PROBLEM.tokens * (1 + PROBLEM.crossings) / 2 * PROBLEM.row_bytes + recv * PROBLEM.row_bytes
    times = dispatch_s(PROFILE, PROBLEM, grids)
    assert times[-1] < 1.2 * copied / PROFILE.peer_bytes_per_s + 21 * PROFILE.kernel_s + 0.1e-3
    # the pull reads a token's rows where they lie: the combine's reduction without its sends
    assert float(pull_s(PROFILE, PROBLEM, resident)) < 0.5 * float(combine_s(PROFILE, PROBLEM, resident))


def test_a_round_trip_stretches_as_the_warps_waiting_on_the_memory_queue_at_its_channels(monkeypatch):
    """Mean value analysis of the warps over MEMORY_CHANNELS channels: one warp takes the
    profile's round trip; as many as the bandwidth moves in one round trip take 1.8 times it
    (the two bounds alone say one: the channels' queues grow as requests collide,
    long before the memory is busy); many take what the bandwidth gives them, within 2 %.
    One channel serving the whole bandwidth would keep the knee sharp."""
    trip, rate, copied = _round_trip_s(PROFILE), PROFILE.peer_bytes_per_s, 2048.0
    meet = round(trip * rate / copied)  # warps whose rounds the bandwidth moves in a round trip
    assert MEMORY_CHANNELS == 192
    alone, met, crowd = _loaded_unit_s(PROFILE, [1, meet, 50 * meet], 1, 0, copied, rate)
    assert alone == pytest.approx(trip) and met > 1.7 * trip
    assert crowd == pytest.approx(50 * meet * copied / rate, rel=0.02)
    monkeypatch.setattr(model, "MEMORY_CHANNELS", 1)
    model._unit_cycles.cache_clear()
    try:
        assert float(_loaded_unit_s(PROFILE, [meet], 1, 0, copied, rate)[0]) < 1.2 * trip
    finally:
        monkeypatch.undo()
        model._unit_cycles.cache_clear()


def test_an_even_division_still_ends_in_a_drain():
    """4096 tokens on 512 blocks (a token a warp) cost what they cost on 511 (8 warps with a
    second token): the warps do not run in lockstep, so an even division still ends with a
    unit's worth of drain; where the round trips cost nothing, the same."""
    whole, ragged = pull_s(PROFILE, PROBLEM, np.array([512, 511]))
    assert ragged == pytest.approx(whole, rel=0.02)
    no_trips = dataclasses.replace(PROFILE, copy_warp_bytes_per_s=1e12)
    assert float(pull_s(no_trips, PROBLEM, 511)) == pytest.approx(float(pull_s(no_trips, PROBLEM, 512)), rel=0.02)


def test_the_token_map_costs_its_dependent_round_trips():
    """Before the sends, the token map's small kernels each wait on a chain of loads: a
    segment's 8 chunks of 32 items twice over (count, rank: the keys, then the key's count),
    and plan_rows one table load per (expert of a rank, source rank), each after the store
    of the running sum before it -- 115 round trips at 64 experts and 4 ranks, a fixed cost
    whatever the grid. Twice the experts add 64 of plan_rows' loads and nothing else moves."""
    from ultraep.token.device import SEGMENT_ITEMS

    assert TOKEN_MAP_SEGMENT_ITEMS == SEGMENT_ITEMS
    trip = WARP_THREADS * 16 * COPY_LOADS_IN_FLIGHT / PROFILE.copy_warp_bytes_per_s
    assert token_map_trips(PROBLEM) == 1 + 2 * 2 * 8 + 2 + 2 + (16 * 4 + 4) + 10 == 115
    routed = dataclasses.replace(PROBLEM, slot_rows=tuple(PROBLEM.rows), sends_per_token=PROBLEM.crossings)
    more = dataclasses.replace(routed, experts=128)  # the same rows received, the same sends
    assert token_map_trips(more) == 115 + 64
    grids = np.array([1, 33, 264])  # (joined with the host's launches: a little more where the device binds less)
    assert dispatch_s(PROFILE, more, grids) - dispatch_s(PROFILE, routed, grids) == pytest.approx(
        np.full(3, 64 * trip), rel=0.01)


def test_dispatch_blocks_beyond_the_measured_residency_run_in_waves():
    """The copy kernels' registers leave room for fewer blocks than their threads would
    (profile version 10 measures it; before, the 5 of their 40-48 registers, not the threads'
    8): a grid past that runs its blocks with a unit in two waves; blocks without one cost
    nothing."""
    memory_free = dataclasses.replace(PROFILE, peer_bytes_per_s=1e18)  # the warps alone bind
    assert dispatch_blocks_per_sm(dataclasses.replace(PROFILE, dispatch_blocks_per_sm=0)) == \
        DISPATCH_BLOCKS_UNMEASURED == 5
    six = dataclasses.replace(memory_free, dispatch_blocks_per_sm=6)
    assert dispatch_blocks_per_sm(six) == 6
    large = Problem(32768, 4096, 1536, 8, 64, 4)
    resident = 6 * PROFILE.sm_count
    fixed = 2 * PROFILE.flag_s + 3 * PROFILE.kernel_s
    at, past = (float(pull_s(six, large, grid)) - fixed for grid in (resident, resident + 1))
    assert past == pytest.approx(2 * at, rel=1e-3)  # 6 tokens a warp either way, in two waves past it
    assert float(pull_s(dataclasses.replace(six, dispatch_blocks_per_sm=8), large, resident + 1)) < 0.6 * past
    # 4096 tokens need 512 blocks: no block past the residency has a unit
    assert float(pull_s(six, PROBLEM, resident + 1)) == float(pull_s(six, PROBLEM, 8 * PROFILE.sm_count))


def test_the_blocks_a_rank_finds_no_sm_for_run_alone_after_every_rank_s():
    """Ranks sharing a GPU under MPS shares that overlap: the rank with the fewest SMs at
    work (kernel A's CTAs at work, measured with every rank at once) has as many SMs' worth
    of blocks at work; its others start when every block at work ends and run their units
    then, so a grid that one rank cannot place costs at least one more block's units. Between
    the last grid measured with every CTA at work (21) and the first with fewer (24 of 25) the
    other ranks hold no more SMs than at 25: that rank has 24, not the measured fraction's
    21.6 at 22 SMs' worth."""
    quarter = dataclasses.replace(h200_like(sm_share=25), dispatch_blocks_per_sm=5,
                                  shared_copy_bytes_per_s=2e12, shared_by=4)
    grids = quarter.fused.grids
    lagging = dataclasses.replace(quarter, shared_fused=dataclasses.replace(
        fused_like(quarter.sm_count, sharing=4), ctas_at_work=tuple(float(min(g, 24)) for g in grids)))
    placed = dataclasses.replace(lagging, shared_fused=dataclasses.replace(lagging.shared_fused, ctas_at_work=None))
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    assert grids[-4:] == (21, 25, 29, 33)  # every CTA at work up to 21, 24 from 25 on
    fits = np.arange(1, 5 * 24 + 1)
    for phase in (dispatch_s, combine_s, pull_s):
        assert np.array_equal(phase(lagging, shared, fits), phase(placed, shared, fits))  # up to 24 SMs' worth
        assert np.all(phase(lagging, shared, fits[-1] + 5) > phase(placed, shared, fits[-1] + 5))
    full = 5 * quarter.sm_count  # every rank's share: 24 SMs' worth at work, 45 blocks late
    units = np.floor(4096 / (full * 8)) * 32 * _round_trip_s(quarter)  # a late warp's whole units, alone
    lag = float(pull_s(lagging, shared, full)) - float(pull_s(placed, shared, full))
    assert units <= lag < 1.5 * units


def test_ranks_sharing_a_gpu_share_the_rate_measured_for_them():
    shared = Problem(4096, 4096, 1536, 8, 64, 4, ranks_per_gpu=4)
    quarter = h200_like(sm_share=25, peer_bytes_per_s=1.2e12)  # one rank on its 33 SMs
    assert quarter.usable_sms == quarter.sm_count == 33  # the device reports the share's SMs
    alone = float(combine_s(quarter, shared, 264))
    measured = dataclasses.replace(quarter, shared_copy_bytes_per_s=2.4e12, shared_by=4)
    # four ranks together move twice what one moves alone: each takes half as long as at 4x
    assert float(combine_s(measured, shared, 264)) == pytest.approx(alone / 2, rel=0.05)
    # a rate measured for another number of sharers is not used
    assert float(combine_s(dataclasses.replace(measured, shared_by=2), shared, 264)) == alone
    # never faster than the rank's own SMs copy
    fast = dataclasses.replace(quarter, shared_copy_bytes_per_s=100e12, shared_by=4)
    recv = float(shared.rows.sum())
    copied = recv * shared.row_bytes + shared.tokens * (shared.top_k + 1) * shared.row_bytes / 2
    assert float(combine_s(fast, shared, 264)) > copied / quarter.peer_bytes_per_s
