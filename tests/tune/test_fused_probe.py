"""The machine profile's probe of the fused kernels (``tune.device.FusedBench``) without a
GPU: CuPy replaced by NumPy and each kernel by a stand-in that checks the set-up the probe
made (every parameter the source declares given, by name; the flags a task waits for
already hold the epoch; ``h`` kept or not) and stamps the task timeline as CTAs of a fixed
task time would, which the probe must read back as that time."""

import contextlib
import ctypes
import sys
import types

import numpy as np
import pytest

from ultraep.errors import ProfileError
from ultraep.runtime import kernels
from ultraep.tune import device
from ultraep.tune.device import FusedBench, kernel_parameters, ordered_arguments

TILE_NS, RELAY_NS = 50_000, 7_000
L2_BYTES = 1 << 20


class FakeArray(np.ndarray):
    """A NumPy array that answers CuPy's ``.data.ptr`` and ``.get()``."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.asarray(self)


def _wrap(array):
    return np.asarray(array).view(FakeArray)


fake_cupy = types.SimpleNamespace(
    zeros=lambda shape, dtype=float: _wrap(np.zeros(shape, dtype)),
    empty=lambda shape, dtype=float: _wrap(np.zeros(shape, dtype)),
    asarray=lambda array, dtype=None: _wrap(np.asarray(array, dtype)),
    arange=lambda *args, **kwargs: _wrap(np.arange(*args, **kwargs)),
    asnumpy=np.asarray,
    random=types.SimpleNamespace(default_rng=lambda seed: types.SimpleNamespace(
        random=lambda shape, dtype: _wrap(np.random.default_rng(seed).random(shape, dtype=dtype)))),
    cuda=types.SimpleNamespace(Device=lambda device=None: contextlib.nullcontext(),
                               get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None)))


class FakeMaps:
    def tiled(self, pointer, dims, box):
        return ("map", pointer, tuple(dims), tuple(box))


class FakeKernel:
    """Stamps every task of the launch: CTA ``i`` of the first ``grid - late`` runs tasks
    ``i, i + grid - late, ...`` back to back, each ``TILE_NS`` (a relay ``RELAY_NS``); the
    ``late`` others find an SM only as those end, and run the last tasks."""

    def __init__(self, name):
        self.name, self.launches, self.late = name, [], 0

    def __call__(self, grid, block, arguments, shared_mem):
        values = dict(zip(kernel_parameters("fused_moe.cu", self.name), arguments))
        self.launches.append(values)
        epoch, slots = int(values["epoch"]), int(values["spr"])
        mtiles = np.asarray(values["rank_mtile"])
        if self.name == "fused_down_combine":
            kind, tasks, task_ns = 3, slots * 16 * (int(values["hidden"]) // 256), TILE_NS
        elif int(values["ffn"]) == 0:  # relays only: every row flagged as arrived
            kind, tasks, task_ns = 1, int(mtiles[-1]), RELAY_NS
            heap = int(np.asarray(values["peer_bases"])[0])  # this process's heap base, as the kernel reads it
            rows = tasks * 128
            flags = (ctypes.c_uint64 * rows).from_address(heap + int(values["row_flag_offset"]))
            assert set(flags) == {epoch}
        else:  # up tiles only: no relay task, every M-tile's flag already set
            assert not mtiles.any() and np.all(np.asarray(values["tile_ready"]) == epoch)
            kind, tasks, task_ns = 2, slots * 16 * (int(values["ffn"]) // 128), TILE_NS
        assert int(values["tokens"]) == 0  # no send, no reduce
        trace = values["trace"]
        early = grid[0] - self.late
        for task in range(tasks):
            cta, wave = task % early, task // early
            if task >= tasks - self.late:  # a late CTA's one task, after every early one's
                cta, wave = early + tasks - 1 - task, -(-(tasks - self.late) // early)
            start = 10**6 + wave * task_ns + cta  # the CTAs start a few ns apart
            trace[task] = (start, start + task_ns, cta | kind << 32)


class FakeHold:
    """``hold_stream``: records each hold's nanoseconds."""

    def __init__(self):
        self.holds = []

    def __call__(self, grid, block, arguments):
        self.holds.append(int(arguments[0]))


@pytest.fixture
def fake_gpu(monkeypatch):
    made = {}

    def get_function(filename, name, **kwargs):
        if (filename, name) == ("timing.cu", "hold_stream"):
            return made.setdefault(name, FakeHold())
        assert filename == "fused_moe.cu"
        return made.setdefault(name, FakeKernel(name))

    monkeypatch.setattr(kernels, "get_function", get_function)
    import ultraep.compute.device

    monkeypatch.setattr(ultraep.compute.device, "_TensorMaps", FakeMaps)
    return made


@pytest.mark.parametrize("task", ["up", "up_act", "down", "down_y", "relay"])
def test_the_probe_reads_the_task_time_back(fake_gpu, task):
    barriers = []
    bench = FusedBench(fake_cupy, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES)
    for grid in (1, 7, 32):
        rounds = bench.rounds(grid, lambda: barriers.append(grid))
        # a tile: the tile phase's span over its waves (to the CTAs' few ns of stagger); a relay: its mean
        assert [r.seconds for r in rounds] == pytest.approx(
            [(RELAY_NS if task == "relay" else TILE_NS) * 1e-9] * device.FUSED_ROUNDS, rel=1e-3)
        assert [r.at_work for r in rounds] == [grid] * device.FUSED_ROUNDS  # every CTA from the start
        assert [r.start_ns for r in rounds] == [10**6] * device.FUSED_ROUNDS  # the first task's start
    assert barriers == [1] * 3 + [7] * 3 + [32] * 3  # a barrier before every round
    launches = fake_gpu["fused_down_combine" if task.startswith("down") else "fused_dispatch_up"].launches
    assert [int(v["epoch"]) for v in launches] == list(range(1, 11))  # a warm-up, then three rounds per grid
    assert fake_gpu["hold_stream"].holds == [device.FUSED_HOLD_NS] * 10  # each launch behind a hold
    if task.startswith("down"):  # y kept as a training forward's kernel B keeps it, or not
        assert isinstance(launches[-1]["y"], np.ndarray) == (task == "down_y")
        assert launches[-1]["y"] is not launches[-1]["out"]
    if task in ("up", "up_act"):
        assert isinstance(launches[-1]["h"], np.ndarray) == (task == "up")
        assert int(launches[-1]["ffn"]) == 2048 and int(launches[-1]["hidden"]) == 128
    if task == "relay":
        heap = bench.heap
        rows = bench.slots * device.FUSED_SLOT_ROWS
        start = int(launches[-1]["row_landing_offset"])
        assert heap[start:start + 4 * rows].view(np.int32).tolist() == list(range(rows))  # a landing row each
        assert np.all(bench.flags == 10)  # every row arrived in the last launch's epoch
    # at least FUSED_TILE_WAVES waves (128) on the largest grid, one slot's 256 tiles on a small one
    if task != "relay":
        assert bench.slots == 16 and bench.slots_for(132, device.FUSED_TILE_WAVES) == 66 \
            and bench.slots_for(1, device.FUSED_TILE_WAVES) == 1


@pytest.mark.parametrize("task", ["up", "down"])
@pytest.mark.parametrize("operand", ["weights", "rows"])
def test_every_launch_reads_operands_the_launches_before_it_left_alone(fake_gpu, task, operand):
    """Weights: a slot of k = 128 rows of 4096 columns is 1 MiB, a run reads a column block
    of it at least: the pool holds two L2s of column blocks (32 slots) besides two runs'
    slots. Rows: a slot of 2048 rows of k = 128 is 0.5 MiB, a run reads all of it: four
    slots hold two L2s. The launches walk through each pool."""
    if operand == "weights":
        name, slot_bytes, cold = ("w_down_map" if task == "down" else "w_up_map"), 128 * 4096 * 2, 32
    else:
        name, slot_bytes, cold = ("act_map" if task == "down" else "recv_map"), 2048 * 128 * 2, 4
    bench = FusedBench(fake_cupy, 0, task, 128, max_grid=2, l2_bytes=L2_BYTES)  # a slot's tiles: 128 waves of 2
    pool = bench.pools[name]
    assert device.FUSED_COLD_L2S * L2_BYTES == 2 * L2_BYTES and pool.slots == cold + 2 * bench.slots
    for grid in (1, 2) * 20:
        bench.rounds(grid, lambda: None)
    launches = fake_gpu["fused_down_combine" if task == "down" else "fused_dispatch_up"].launches
    start = pool.data.ctypes.data
    firsts = [(values[name][1] - start) // slot_bytes for values in launches]
    assert firsts[:4] == [0, 1, 2, 3]  # the warm-up, then one slot a run
    assert all(0 <= first <= pool.slots - 1 for first in firsts)
    dims = (4096, 128, 1) if operand == "weights" else (128, device.FUSED_SLOT_ROWS)
    assert all(values[name][2] == dims for values in launches)
    for i, first in enumerate(firsts):  # no slot again before the walk has been through the pool
        later = firsts[i + 1:]
        if first in later:
            assert later.index(first) >= pool.slots - 2 * bench.slots
    assert len(set(firsts)) == min(pool.slots, len(launches))  # 41 launches of one slot each: the walk wraps


@pytest.mark.parametrize("task", ["up", "down"])
def test_ctas_that_find_no_sm_until_the_others_end_are_not_at_work(fake_gpu, task):
    """Under MPS shares that overlap, some of a process's CTAs may start only as others end:
    the probe counts the SMs that started a task in the first half of the run."""
    bench = FusedBench(fake_cupy, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES)
    fake_gpu["fused_down_combine" if task == "down" else "fused_dispatch_up"].late = 8
    rounds = bench.rounds(32, lambda: None)
    assert [r.at_work for r in rounds] == [24] * device.FUSED_ROUNDS
    # the run's span holds the early CTAs' waves and the late ones' task: a tile's time over the
    # waves of the 24 at work (171 of 4096 tiles, the late ones' one more), not over 32 CTAs' 128
    assert [r.seconds for r in rounds] == pytest.approx([172 / 171 * TILE_NS * 1e-9] * device.FUSED_ROUNDS,
                                                        rel=1e-3)


def test_a_released_launch_waits_behind_the_hold_then_the_release(fake_gpu):
    """Where the sharers measure at once, kernel A's runs start on a device barrier of theirs
    (``release``, enqueued between the hold and the kernel), as a layer's kernel A starts
    when every rank leaves the token map's last barrier."""
    bench = FusedBench(fake_cupy, 0, "up", 128, max_grid=8, l2_bytes=L2_BYTES)
    hold, kernel = fake_gpu["hold_stream"], fake_gpu["fused_dispatch_up"]
    released = []
    bench.rounds(8, lambda: None, lambda: released.append((len(hold.holds), len(kernel.launches))))
    # after the warm-up (a hold and a launch, no release): each round's hold, its release, its kernel
    assert released == [(2 + i, 1 + i) for i in range(device.FUSED_ROUNDS)]
    assert len(kernel.launches) == 1 + device.FUSED_ROUNDS


def test_arguments_go_by_the_names_the_kernel_declares():
    names = kernel_parameters("fused_moe.cu", "fused_down_combine")
    assert names[:2] == ("act_map", "w_down_map") and names[-1] == "trace"
    values = {name: i for i, name in enumerate(names)}
    assert ordered_arguments("fused_moe.cu", "fused_down_combine", values) == tuple(range(len(names)))
    with pytest.raises(ProfileError, match=r"no value for \['trace'\].*no parameter \['traces'\]"):
        ordered_arguments("fused_moe.cu", "fused_down_combine",
                          {("traces" if name == "trace" else name): 0 for name in names})
    with pytest.raises(ProfileError, match="declares no kernel"):
        kernel_parameters("fused_moe.cu", "fused_nothing")


def test_a_task_s_buffers_go_back_to_the_driver_before_the_next_task_s_are_made(monkeypatch):
    """CuPy's pool keeps freed blocks for this process; ranks sharing a GPU probe at once, so
    the probe gives its blocks back to the driver before each new task's buffers and on
    ``close()`` (the 4-rank fused tests ran out of memory on an 80 GB GPU without it)."""
    events = []
    pool = types.SimpleNamespace(free_all_blocks=lambda: events.append("freed"))
    runtime = types.SimpleNamespace(getDeviceProperties=lambda _: {"name": b"fake", "l2CacheSize": L2_BYTES,
                                                                   "totalGlobalMem": 80 << 30})
    cp = types.SimpleNamespace(**{**vars(fake_cupy), "get_default_memory_pool": lambda: pool,
                                  "cuda": types.SimpleNamespace(**vars(fake_cupy.cuda), runtime=runtime)})
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(device, "usable_sms", lambda _: 8)

    def bench(cp, dev, task, k, max_grid, l2_bytes, memory_bytes):
        events.append(f"made {task} in {memory_bytes >> 30} GB")
        return types.SimpleNamespace(key=(task, k), rounds=lambda grid, together, release: [])

    monkeypatch.setattr(device, "FusedBench", bench)
    with device.DeviceProbe(0, sharing=4) as probe:
        for task, grid in (("up", 1), ("up", 8), ("down", 1), ("down", 8)):
            probe.fused_rounds(task, 128, grid, lambda: None)
        # a task's grids share its buffers, which take at most a quarter of 40 % of the GPU's memory
        assert events == ["freed", "made up in 8 GB", "freed", "made down in 8 GB"]
    assert events[-1] == "freed" and probe._fused is None


@pytest.mark.parametrize("task", ["up", "up_act", "down", "down_y", "relay"])
def test_a_task_s_buffer_bytes_are_what_it_makes(fake_gpu, monkeypatch, task):
    """The estimate that sizes a task's runs to its memory counts every buffer the probe
    makes (a change to one without the other fails here)."""
    made = []

    def counted(make):
        def allocate(shape, dtype=float):
            array = make(shape, dtype)
            made.append(array.nbytes)
            return array
        return allocate

    cp = types.SimpleNamespace(**{**vars(fake_cupy), "zeros": counted(fake_cupy.zeros),
                                  "empty": counted(fake_cupy.empty)})
    bench = FusedBench(cp, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES)
    assert bench.buffer_bytes(bench.slots, L2_BYTES) == pytest.approx(sum(made), rel=0.01)


@pytest.mark.parametrize("task", ["up", "down", "relay"])
def test_runs_that_do_not_fit_the_memory_have_fewer_waves_and_the_same_task_time(fake_gpu, task):
    full = FusedBench(fake_cupy, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES)
    memory = full.buffer_bytes(full.slots // 2, L2_BYTES)
    bench = FusedBench(fake_cupy, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES, memory_bytes=memory)
    assert bench.slots == full.slots // 2 and bench.buffer_bytes(bench.slots, L2_BYTES) <= memory
    rounds = bench.rounds(32, lambda: None)
    assert [r.seconds for r in rounds] == pytest.approx(
        [(RELAY_NS if task == "relay" else TILE_NS) * 1e-9] * device.FUSED_ROUNDS, rel=1e-3)
    tiny = FusedBench(fake_cupy, 0, task, 128, max_grid=32, l2_bytes=L2_BYTES, memory_bytes=1)
    assert tiny.slots == 1  # one slot at least: what does not fit then fails as out of memory, with its hint
