"""The machine profile on the host backend (what CI can measure): the micro-benchmarks,
the cache and its directory, and what happens to a cached file of another version,
another device, or one that cannot be read."""

import dataclasses
import json

import pytest

from tests.conftest import assert_all_ranks_ok, run_ranks
from ultraep.errors import ProfileError
from ultraep.tune import PROFILE_VERSION, MachineProfile, load_profile, profile_path, read_profile, write_profile
from ultraep.tune.__main__ import main as tune_main
from ultraep.tune import host
from ultraep.tune.host import HostProbe
from ultraep.tune.profile import CACHE_VARIABLE, FUSED_TASKS, unsteady_compute


@pytest.fixture(autouse=True)
def small_host_probe(monkeypatch, tmp_path):
    """A quick host profile (small matrices, three sizes) cached under the test's directory."""
    monkeypatch.setattr(HostProbe, "compute_shape", (2, 64, 64))
    monkeypatch.setattr(HostProbe, "rows_per_expert", (4, 32, 256))
    monkeypatch.setattr(host, "BATCH_S", 0.002)
    monkeypatch.setattr(host, "COPY_BYTES", 1 << 20)
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))


def measured(lines=None) -> MachineProfile:
    return load_profile("host", progress=None if lines is None else lines.append)


def test_host_profile_is_measured_cached_and_reused(tmp_path):
    lines = []
    profile = measured(lines)
    name, cores = HostProbe().describe()
    assert profile.identity() == ("host", name, 100, cores, "")  # the host runs no kernel
    assert profile.version == PROFILE_VERSION
    assert profile.copy_bytes_per_s > 1e7 and profile.peer_bytes_per_s == profile.copy_bytes_per_s
    assert "shared memory" in profile.peer_method
    assert 0 < profile.launch_s < 1e-2
    assert profile.copy_warp_bytes_per_s > 1e7 and 0 < profile.flag_s < 1e-3 and 0 < profile.kernel_s < 1e-2
    fused = profile.fused
    assert fused.grids == (1,) and fused.sharing == 1 and profile.shared_fused is None
    assert (fused.up_k, fused.down_k) == HostProbe.fused_reductions
    assert all(v > 0 for task in FUSED_TASKS for row in getattr(fused, task) for v in row)
    assert float(fused.up_tile_s(fused.up_k[0], 1)) == pytest.approx(fused.up[0][0])
    assert profile.fused_costs(4) is fused  # no measurement with 4 processes at once: this one's own
    curve = profile.compute
    assert curve.rows_per_expert == (4, 32, 256) and (curve.experts, curve.k, curve.n) == (2, 64, 64)
    assert all(s > 0 for s in curve.seconds)
    path = profile_path(name)
    assert path.parent == tmp_path / "cache" and path.name.startswith("profile-host-") and path.is_file()
    assert any("no machine profile" in line for line in lines)
    assert any("expert compute, 256 rows" in line for line in lines)
    again = []
    assert measured(again) == profile and again == []  # from the cache, silently
    forced = load_profile("host", force=True)
    assert forced.measured_at >= profile.measured_at and read_profile(path) == forced


def test_an_explicit_path_overrides_the_cache_directory(tmp_path):
    target = tmp_path / "elsewhere" / "mine.json"
    profile = load_profile("host", path=target)
    assert read_profile(target) == profile
    assert not (tmp_path / "cache").exists()


def _rewrite(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_text("{ not json"), "not JSON"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "cannot use"),
    (lambda p: p.write_text(json.dumps([1, 2])), "not a machine profile"),
    (lambda p: _rewrite(p, copy_bytes_per_s="fast"), "copy_bytes_per_s"),
    (lambda p: _rewrite(p, launch_s=-1.0), "launch_s"),
    (lambda p: _rewrite(p, sm_count=None), "sm_count"),
    (lambda p: _rewrite(p, compute={"kernel": "k"}), "bad or missing field"),
    (lambda p: _rewrite(p, fused={"grids": [1]}), "bad or missing field"),
    (lambda p: _rewrite(p, fused=dict(json.loads(p.read_text())["fused"], grids=[2, 1])), "grids must rise"),
    (lambda p: _rewrite(p, flag_s=0.0), "flag_s"),
    (lambda p: _rewrite(p, version=PROFILE_VERSION + 1), f"format version {PROFILE_VERSION + 1}"),
])
def test_an_unusable_cache_file_says_why_and_is_measured_again(damage, reason):
    first = measured()
    path = profile_path(first.device)
    damage(path)
    lines = []
    second = measured(lines)
    assert any(reason in line and "measuring it again" in line and str(path) in line for line in lines), lines
    assert read_profile(path) == second and second.measured_at >= first.measured_at


def test_a_profile_of_another_device_or_share_is_measured_again():
    first = measured()
    path = profile_path(first.device)
    _rewrite(path, device="some other machine")
    lines = []
    assert measured(lines).device == first.device
    assert any("some other machine" in line and "measuring it again" in line for line in lines), lines
    _rewrite(path, sm_share=25)
    lines = []
    assert measured(lines).sm_share == 100 and any("25 %" in line for line in lines), lines
    _rewrite(path, sm_count=first.sm_count + 1)  # as a green context's SMs against the thread percentage's
    lines = []
    assert measured(lines).sm_count == first.sm_count
    assert any(f"{first.sm_count + 1} at work" in line and "measuring it again" in line for line in lines), lines


def test_a_profile_measured_with_other_kernel_sources_is_measured_again():
    """Its tile and copy times were taken with kernels this library no longer has."""
    first = measured()
    path = profile_path(first.device)
    _rewrite(path, kernels="0123456789abcdef")
    lines = []
    again = measured(lines)
    assert again.kernels == "" and read_profile(path) == again
    assert any("other kernel sources (0123456789abcdef, these: -" in line and "measuring it again" in line
               for line in lines), lines
    _rewrite(path, kernels="not hex")
    lines = []
    measured(lines)
    assert any("kernels must be a hex digest" in line for line in lines), lines


def test_an_mps_share_has_its_own_cache_file(monkeypatch):
    monkeypatch.setenv("ULTRAEP_EP_EMULATION", "mps:25")
    profile = measured()
    assert profile.sm_share == 25
    assert profile_path(profile.device, 25).is_file() and not profile_path(profile.device).exists()


def test_an_unwritable_cache_is_reported_not_raised(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_VARIABLE, str(blocker / "cache"))
    lines = []
    assert measured(lines).backend == "host"
    assert any("could not write the machine profile" in line for line in lines), lines


def test_round_trip_and_refusals():
    profile = measured()
    assert MachineProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    shared_fused = dataclasses.replace(profile.fused, sharing=4)
    shared = dataclasses.replace(profile, shared_copy_bytes_per_s=3e9, shared_by=4, shared_fused=shared_fused)
    assert MachineProfile.from_json(json.loads(json.dumps(shared.to_json()))) == shared
    assert shared.gpu_copy_bytes_per_s(4) == 3e9 and shared.gpu_copy_bytes_per_s(2) == profile.peer_bytes_per_s
    assert shared.fused_costs(4) is shared_fused and shared.fused_costs(2) is profile.fused
    data = profile.to_json()
    data["compute"] = dict(data["compute"], rows_per_expert=[32, 4, 256])
    with pytest.raises(ProfileError, match="rows_per_expert must rise"):
        MachineProfile.from_json(data)
    data["compute"] = dict(data["compute"], rows_per_expert=[4, 32, 256], seconds=[1.0, 0.0, 2.0])
    with pytest.raises(ProfileError, match="one positive time per size"):
        MachineProfile.from_json(data)
    with pytest.raises(ProfileError, match="backend must be"):
        load_profile("tpu")


def test_write_is_atomic_and_leaves_no_partial_file(tmp_path):
    profile = measured()
    target = write_profile(profile, tmp_path / "p" / "profile.json")
    assert [p.name for p in target.parent.iterdir()] == ["profile.json"]


def test_cli_prints_a_table(tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert tune_main(["profile", "--backend", "host", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "machine profile: host" in printed.out and "rows/expert" in printed.out and "peer copy" in printed.out
    assert "[tune] measuring a machine profile" in printed.err
    assert tune_main(["profile", "--backend", "host", "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    assert MachineProfile.from_json(json.loads(printed.out)) == read_profile(out) and printed.err == ""


@pytest.mark.parametrize("argv,fragment", [
    (["profile", "--backend", "host", "--device", "0"], "--backend host measures the CPU"),
    (["search", "--profile", "p.json", "--device", "1"], "--profile FILE is used as it is"),
    (["profile", "--device", "-1"], "an int >= 0"),
])
def test_a_gpu_named_where_none_is_measured_is_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune_main(argv)
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.mpi
@pytest.mark.parametrize("failure", ["error", "memory", "copy-memory"])
def test_a_rank_failing_in_the_shared_probe_is_said_on_every_rank(tmp_path, failure):
    """Any failure names the rank and its reason on every rank; running out of GPU memory
    also says how to avoid it (the probe's buffers, in every process sharing the GPU)."""
    out = run_ranks(3, "tune/mpi/shared_failure_check.py", str(tmp_path), failure, timeout=240)
    assert_all_ranks_ok(out, 3, "shared-failure")


def test_fused_costs_are_lines_in_k_and_linear_between_grids():
    from ultraep.tune import FusedCosts

    costs = FusedCosts(grids=(1, 8), sharing=2, up_k=(1000, 2000), down_k=(500, 1500),
                       up=((10e-6, 20e-6), (15e-6, 30e-6)), up_act=((5e-6, 5e-6), (8e-6, 8e-6)),
                       relay=((1e-6, 2e-6), (2e-6, 4e-6)), down=((4e-6, 4e-6), (6e-6, 6e-6)))
    assert float(costs.up_tile_s(1500, 1)) == pytest.approx(12.5e-6)  # halfway between the reductions
    assert float(costs.up_tile_s(3000, 8)) == pytest.approx(40e-6)  # the line extended
    assert costs.up_tile_s(2000, [1, 4.5, 8]).tolist() == pytest.approx([15e-6, 22.5e-6, 30e-6])
    assert float(costs.up_tile_s(2000, 20)) == pytest.approx(30e-6)  # beyond the grids: the last one's
    assert float(costs.up_tile_s(1000, 1, keeps_h=False)) == pytest.approx(5e-6)
    assert float(costs.relay_task_s(1000, 8)) == pytest.approx(2e-6)
    assert float(costs.down_tile_s(1000, 1)) == pytest.approx(5e-6)
    # the down tiles storing y: where not measured, those without stand for them, and the table says so
    assert costs.down_y is None and "not measured" in costs.down_y_note
    assert costs.down_y_note in "\n".join(costs.table("GPU"))
    storing = dataclasses.replace(costs, down_y=((5e-6, 5e-6), (7e-6, 7e-6)))
    assert float(storing.down_tile_s(1000, 1)) == pytest.approx(6e-6) and storing.down_y_note is None
    assert float(storing.down_tile_s(1000, 1, keeps_y=False)) == pytest.approx(5e-6)
    with pytest.raises(ProfileError, match="down_y needs one positive time"):
        dataclasses.replace(costs, down_y=((5e-6,), (7e-6, 7e-6)))
    # a line through noise may cross zero short of the reductions measured: never below the
    # shortest one's time in proportion, never beyond the longest below its time
    noisy = dataclasses.replace(costs, down=((1e-6, 1e-6), (9e-6, 9e-6)))
    assert float(noisy.down_tile_s(100, 1)) == pytest.approx(100 * 1e-6 / 500)
    falling = dataclasses.replace(costs, down=((9e-6, 9e-6), (8e-6, 8e-6)))
    assert float(falling.down_tile_s(3000, 1)) == pytest.approx(8e-6)
    assert float(falling.down_tile_s(1000, 1)) == pytest.approx(8.5e-6)  # between them: the line
    with pytest.raises(ProfileError, match="one positive time per reduction"):
        dataclasses.replace(costs, relay=((1e-6,), (2e-6, 4e-6)))
    with pytest.raises(ProfileError, match="up_k must rise"):
        dataclasses.replace(costs, up_k=(2000, 1000))


def test_shared_fused_costs_are_the_slowest_process():
    from ultraep.tune.profile import fused_costs

    # per grid, the CTAs at work of three rounds: one process lacks CTAs in a round, then the other;
    # of the down tiles, one process lacks two in two rounds
    one = {"up": [[1.0, 2.0]], "up_act": [[1.0, 1.0]], "relay": [[3.0, 3.0]], "down": [[2.0, 2.0]],
           "down_y": [[2.5, 2.0]], "ctas_at_work": [[1, 1, 1], [3, 4, 4]],
           "down_ctas_at_work": [[1, 1, 1], [4, 4, 4]]}
    other = {"up": [[1.5, 1.0]], "up_act": [[1.0, 4.0]], "relay": [[1.0, 1.0]], "down": [[2.0, 5.0]],
             "down_y": [[2.0, 6.0]], "ctas_at_work": [[1, 1, 1], [4, 3, 4]],
             "down_ctas_at_work": [[1, 1, 1], [2, 4, 2]]}
    costs = fused_costs([one, other], (1, 4), (64,), (32,))
    assert costs.sharing == 2 and costs.up == ((1.5, 2.0),) and costs.up_act == ((1.0, 4.0),)
    assert costs.relay == ((3.0, 3.0),) and costs.down == ((2.0, 5.0),) and costs.down_y == ((2.5, 6.0),)
    # each process's median round has all 4 at work; the group's median round lacks one
    assert costs.ctas_at_work == (1.0, 3.0) and costs.relays_on_store_warps
    assert costs.down_ctas_at_work == (1.0, 2.0) and costs.down_at_work_note is None


def test_kernel_a_tasks_are_released_together_and_each_kernel_counts_its_own_ctas_at_work():
    """measure_fused: kernel A's tasks (up tiles, relays) run behind the sharers' release,
    kernel B's down tiles without (a layer's kernel B starts as its rank's kernel A ends); the
    up tiles' rounds count kernel A's CTAs at work, the down tiles' kernel B's; every round's
    start is kept (how far apart the sharers started)."""
    from ultraep.tune.host import FusedRound
    from ultraep.tune.profile import measure_fused

    class Probe:
        fused_reductions = ((64,), (32,))
        calls = []

        def fused_rounds(self, task, k, grid, together, release=None):
            together()
            self.calls.append((task, release))
            at_work = grid - 1 if task.startswith("down") and grid > 1 else grid
            return [FusedRound(1e-6, at_work, 100 * len(self.calls) + i) for i in range(2)]

    release = object()
    tables = measure_fused(Probe(), (1, 4), together=lambda: None, release=release)
    assert [(task, r is release) for task, r in Probe.calls] == [
        ("up", True), ("up", True), ("up_act", True), ("up_act", True), ("relay", True), ("relay", True),
        ("down", False), ("down", False), ("down_y", False), ("down_y", False)]
    assert tables["ctas_at_work"] == [[1] * 4, [4] * 4] and tables["down_ctas_at_work"] == [[1] * 4, [3] * 4]
    assert tables["starts"]["down"] == [700, 701, 800, 801]
    with pytest.raises(ProfileError, match="no device to release"):
        HostProbe().fused_rounds("up", 64, 1, lambda: None, release=lambda: None)


def test_ctas_at_work_scale_the_grid_between_measured_ones():
    from ultraep.tune import FusedCosts

    table = ((1e-6,) * 4,)
    costs = FusedCosts(grids=(1, 16, 24, 32), sharing=4, up_k=(64,), down_k=(32,), up=table, up_act=table,
                       relay=table, down=table, ctas_at_work=(1.0, 16.0, 24.0, 24.0))
    assert costs.working_ctas([1, 16, 20, 24, 28, 32]).tolist() == pytest.approx([1, 16, 20, 24, 28 * 0.875, 24])
    assert dataclasses.replace(costs, ctas_at_work=None).working_ctas([5, 32]).tolist() == [5, 32]
    # kernel B's: the down tiles' own where measured (version 8), else kernel A's, and the table says so
    table = "\n".join(costs.table("GPU"))
    assert "up CTAs at work" in table and "kernel A's stand for them" in table
    assert costs.working_down_ctas([28, 32]).tolist() == pytest.approx([24.5, 24])
    own = dataclasses.replace(costs, down_ctas_at_work=(1.0, 16.0, 24.0, 32.0))
    assert own.working_down_ctas([28, 32]).tolist() == [28, 32] and own.working_ctas([32]).tolist() == [24]
    assert own.down_at_work_note is None and "down CTAs at work" in "\n".join(own.table("GPU"))
    for name in ("ctas_at_work", "down_ctas_at_work"):
        with pytest.raises(ProfileError, match=f"{name} needs one count per grid"):
            dataclasses.replace(costs, **{name: (1.0, 16.0, 25.0, 24.0)})
        with pytest.raises(ProfileError, match=f"{name} needs one count per grid"):
            dataclasses.replace(costs, **{name: (1.0, 16.0)})


def test_a_profile_stored_beside_measurements_may_be_of_an_older_version():
    profile = measured()
    data = json.loads(json.dumps(profile.to_json()))
    old = dict(data, version=5, fused={k: v for k, v in data["fused"].items()
                                       if k not in ("ctas_at_work", "relays_on_store_warps")})
    with pytest.raises(ProfileError, match="format version 5"):
        MachineProfile.from_json(old)
    stored = MachineProfile.from_json(old, stored=True)
    assert stored.version == 5 and stored.fused.ctas_at_work is None and not stored.fused.relays_on_store_warps
    with pytest.raises(ProfileError, match="format version 3.*stored beside measurements"):
        MachineProfile.from_json(dict(old, version=3), stored=True)


@pytest.mark.parametrize("version", [6, 7])
def test_a_version_6_or_7_profile_is_read_beside_measurements_with_its_ctas_at_work_but_never_cached(version):
    """Versions 6 and 7 have this version's fields but the down tiles' CTAs at work (one count
    stood for both kernels); 6's sharers' runs were too short to overlap."""
    data = json.loads(json.dumps(measured().to_json()))
    at_work = [max(1.0, g - 1.0) for g in data["fused"]["grids"]]
    fused = {k: v for k, v in data["fused"].items() if k != "down_ctas_at_work"}
    old = dict(data, version=version, fused=dict(fused, ctas_at_work=at_work))
    with pytest.raises(ProfileError, match=f"format version {version}"):
        MachineProfile.from_json(old)
    stored = MachineProfile.from_json(old, stored=True)
    assert stored.version == version and list(stored.fused.ctas_at_work) == at_work
    assert stored.fused.relays_on_store_warps and stored.fused.down_ctas_at_work is None
    assert list(stored.fused.working_down_ctas(stored.fused.grids)) == at_work
    assert "kernel A's stand for them" in stored.fused.down_at_work_note
    with pytest.raises(ProfileError, match="bad or missing field: 'down_ctas_at_work'"):
        MachineProfile.from_json(dict(old, version=PROFILE_VERSION))


def test_a_version_8_profile_is_read_beside_measurements_without_down_tiles_storing_y():
    data = json.loads(json.dumps(measured().to_json()))
    assert data["fused"]["down_y"] is not None  # this version measures them
    fused = {k: v for k, v in data["fused"].items() if k != "down_y"}
    old = dict(data, version=8, fused=fused)
    with pytest.raises(ProfileError, match="format version 8"):
        MachineProfile.from_json(old)
    stored = MachineProfile.from_json(old, stored=True)
    assert stored.fused.down_y is None and "before version 9" in stored.fused.down_y_note
    with pytest.raises(ProfileError, match="bad or missing field: 'down_y'"):
        MachineProfile.from_json(dict(old, version=PROFILE_VERSION))


def test_a_version_9_profile_is_read_beside_measurements_without_the_copy_kernels_residency():
    """Version 10 measures the Dispatcher's copy kernels' resident blocks per SM (0 on the
    host, which has none); a version 9 profile is read with none, and the model takes the
    threads' bound for it."""
    data = json.loads(json.dumps(measured().to_json()))
    assert data["dispatch_blocks_per_sm"] == 0 and "copy blocks          -" in measured().table()
    old = dict({k: v for k, v in data.items() if k != "dispatch_blocks_per_sm"}, version=9)
    with pytest.raises(ProfileError, match="format version 9"):
        MachineProfile.from_json(old)
    assert MachineProfile.from_json(old, stored=True).dispatch_blocks_per_sm == 0
    with pytest.raises(ProfileError, match="bad or missing field: 'dispatch_blocks_per_sm'"):
        MachineProfile.from_json(dict(old, version=PROFILE_VERSION))
    with pytest.raises(ProfileError, match="dispatch_blocks_per_sm must be a non-negative integer"):
        MachineProfile.from_json(dict(data, dispatch_blocks_per_sm=-1))


def test_a_version_10_profile_is_read_beside_measurements_without_a_kernel_digest():
    data = json.loads(json.dumps(measured().to_json()))
    old = dict({k: v for k, v in data.items() if k != "kernels"}, version=10)
    with pytest.raises(ProfileError, match="format version 10"):
        MachineProfile.from_json(old)
    assert MachineProfile.from_json(old, stored=True).kernels == ""
    with pytest.raises(ProfileError, match="bad or missing field: 'kernels'"):
        MachineProfile.from_json(dict(old, version=PROFILE_VERSION))


def test_the_weight_sync_s_times_round_trip_and_an_older_profile_has_none():
    """Version 12 keeps the three syncs rank 0 timed (where ranks share a GPU; else none: the
    model estimates the sync's rates); a version 11 profile stored beside measurements is read
    without them; three positive times or the file is refused."""
    from ultraep.tune.profile import SyncTimes

    sync = SyncTimes(sharing=4, fanout=3, expert_bytes=37748736, times_s=(2.665e-3, 2.939e-3, 0.088e-3))
    timed = dataclasses.replace(measured(), sync=sync)
    data = json.loads(json.dumps(timed.to_json()))
    assert MachineProfile.from_json(data) == timed
    assert ("weight sync      2.665 ms one expert of 37.7 MB at fan-out 1 on one block; 2.939 ms at 3 on one "
            "block, 0.088 ms on every resident one (4 ranks on the GPU)") in timed.table()
    assert "weight sync          -" in measured().table()
    old = dict(data, version=11)
    with pytest.raises(ProfileError, match="format version 11"):
        MachineProfile.from_json(old)
    assert MachineProfile.from_json(old, stored=True).sync is None
    with pytest.raises(ProfileError, match="three positive times"):
        MachineProfile.from_json(dict(data, sync=dict(data["sync"], times_s=[1e-3, 0.0, 1e-3])))
    with pytest.raises(ProfileError, match="fanout must be a positive integer"):
        MachineProfile.from_json(dict(data, sync=dict(data["sync"], fanout=0)))


def test_unsteady_compute_names_the_sizes():
    assert unsteady_compute((4, 32, 256), (1e-6, 2e-6, 9e-6)) is None
    assert unsteady_compute((4, 32, 256), (1e-6, 0.95e-6, 9e-6)) is None  # weight-bound: flat within noise
    reason = unsteady_compute((4, 32, 256), (5e-6, 2e-6, 9e-6))
    assert "2.0 us at 32 rows per expert but 5.0 us at 4" in reason


@pytest.mark.parametrize("busy_runs", [1, 2])
def test_a_compute_curve_measured_under_load_is_measured_again_and_never_cached(monkeypatch, busy_runs):
    calls = []
    steady = {4: 1e-6, 32: 2e-6, 256: 9e-6}

    def expert_call_s(self, rows):
        calls.append(rows)
        busy = len(calls) <= 3 * busy_runs and rows == 4  # another process ran during the smallest size
        return 5e-6 if busy else steady[rows]

    monkeypatch.setattr(HostProbe, "expert_call_s", expert_call_s)
    lines = []
    profile = measured(lines)
    assert calls == [4, 32, 256, 4, 32, 256]
    assert any("more rows measured faster than fewer" in line for line in lines)
    path = profile_path(HostProbe().describe()[0])
    if busy_runs == 1:
        assert profile.compute.seconds == (1e-6, 2e-6, 9e-6) and path.is_file()
    else:
        assert any("the machine seems busy; this profile is used but not cached" in line for line in lines)
        assert not path.exists()


@pytest.mark.parametrize("content", [b"notes\n", b"{\"format\": \"something else\"}", b"\xff\xfe"])
def test_a_given_file_that_is_not_a_profile_is_never_overwritten(tmp_path, content):
    """``tune profile --out FILE``: a file there that is not a machine profile stays as it
    was (refused before measuring, exit 2); a profile there, of any machine, is replaced."""
    target = tmp_path / "notes.txt"
    target.write_bytes(content)
    with pytest.raises(ProfileError, match="is not a machine profile: it is not overwritten"):
        load_profile("host", path=target)
    assert tune_main(["profile", "--backend", "host", "--out", str(target)]) == 2
    assert target.read_bytes() == content
    profile = load_profile("host", path=tmp_path / "mine.json")
    _rewrite(tmp_path / "mine.json", device="some other machine")
    assert load_profile("host", path=tmp_path / "mine.json").device == profile.device
    (tmp_path / "empty").write_bytes(b"")  # as mktemp leaves it
    assert load_profile("host", path=tmp_path / "empty") == read_profile(tmp_path / "empty")


def test_the_device_probe_names_kernel_sources_that_exist():
    """The GPU profile's digest covers the kernels its measurements launch (a name that is
    not a source would fail every GPU profile)."""
    from ultraep.runtime.kernels import sources_digest
    from ultraep.tune.device import FUSED_KERNELS, DeviceProbe

    assert FUSED_KERNELS in DeviceProbe.kernel_sources and "grouped_gemm.cu" in DeviceProbe.kernel_sources
    assert len(sources_digest(DeviceProbe.kernel_sources)) == 16
