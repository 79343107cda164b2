"""The device planner's contract with its kernels, checked on the host (no GPU needed):
every launch constant and limit comes from the kernel sources, the shared-memory size is
the kernel's carve-up, and layouts the kernel cannot take are refused by name."""

import re
from types import SimpleNamespace

import pytest

from ultraep.planner import DevicePlanner, ExpertLayout, quota
from ultraep.planner import device
from ultraep.planner.device import MAX_SHARED_BYTES, launch_shared_bytes, plan_shared_bytes
from ultraep.runtime.kernels import declared_kernels, kernel_constants, kernel_source

PLANNER = kernel_constants("planner.cu")
REROUTE = kernel_constants("reroute.cu")


@pytest.mark.parametrize("host, kernel_file, name", [
    (quota.PROBES_PER_ROUND, "planner.cu", "PROBES"), (quota.NEAR_PROBES, "planner.cu", "NEAR_PROBES"),
    (quota.NEAR_SHIFT, "planner.cu", "NEAR_SHIFT"), (quota.NEAR_GAP_SHIFT, "planner.cu", "NEAR_GAP_SHIFT"),
    (device.PLAN_CLUSTER, "planner.cu", "CLUSTER"), (device.PLAN_PROBE_WARPS, "planner.cu", "PROBE_WARPS"),
    (device.PLAN_THREADS, "planner.cu", "THREADS"), (device.PROBES, "planner.cu", "PROBES"),
    (device.MOVE_INTS, "planner.cu", "MOVE_INTS"), (device.MAX_CHUNKS, "planner.cu", "MAX_CHUNKS"),
    (device.MAX_DOMAIN, "planner.cu", "MAX_DOMAIN"), (device.MAX_SLOTS, "planner.cu", "MAX_SLOTS"),
    (device.REROUTE_CHUNK, "reroute.cu", "CHUNK"), (device.REROUTE_COUNTERS, "reroute.cu", "ASSIGN_COUNTERS"),
])
def test_host_constants_are_the_kernels(host, kernel_file, name):
    assert host == kernel_constants(kernel_file)[name]


def test_kernel_limits_follow_from_its_fields():
    assert PLANNER["THREADS"] == 32 * PLANNER["WARPS"]
    assert PLANNER["PROBES"] == 32  # the round decision reads one probe per lane
    assert PLANNER["MAX_DOMAIN"] == 32 * PLANNER["MAX_CHUNKS"] <= 128  # packed keys hold the rank in 7 bits
    assert PLANNER["MAX_SLOTS"] == 1 << PLANNER["MOVE_FIELD_BITS"]
    assert REROUTE["ASSIGN_COUNTERS"] == 1 + REROUTE["CHUNK"] // 32


@pytest.mark.parametrize("domain", [1, 31, 32, 33, 64, 65, 128])
def test_the_kernel_instance_chosen_is_declared(domain):
    planner = DevicePlanner(ExpertLayout(domain, domain, 2))
    assert planner.kernel_name in declared_kernels(kernel_source("planner.cu"))
    chunks = int(re.search(r"<(\d+)>", planner.kernel_name).group(1))
    assert 32 * chunks >= domain and (chunks == 1 or 16 * chunks < domain)


def kernel_carve_up_bytes(layout):
    """Bytes of planner.cu's BlockShared, read from the kernel text: DomainShared's members
    (type and [count] comment), the 16-byte alignment, then each ``cursor += count``."""
    source = kernel_source("planner.cu").read_text()
    t = SimpleNamespace(R=layout.num_ranks, E=layout.num_experts, S=layout.redundant_slots, D=layout.domain_size,
                        K=layout.max_instances, M=layout.experts_per_rank)
    t.DM = t.D * t.M
    t.share = -(-t.DM // PLANNER["CLUSTER"])
    t.move_ints = (PLANNER["MOVE_INTS"] * t.S * t.D + 3) & ~3
    names = dict(PLANNER, t=t, D=t.D, M=t.M)
    ints_of = {"int": 1, "int2": 2, "int4": 4}
    front_struct = re.search(r"struct DomainShared \{(.*?)\n\};", source, re.S).group(1)
    front = sum(ints_of[kind] * eval(count.replace("*", " * "), names)
                for kind, count in re.findall(r"^\s+(int\d?)\* \w+;\s+// \[([^\]]+)\]", front_struct, re.M))
    carve = re.search(r"BlockShared\(int4\* base, const BlockTask& t\)(.*?)\n    \}", source, re.S).group(1)
    rest = sum(eval(count, names) for count in re.findall(r"cursor \+= ([^;]+);", carve))
    return 4 * (front + (-front & 3) + rest)


@pytest.mark.parametrize("layout", [ExpertLayout(64, 128, 2), ExpertLayout(64, 256, 2), ExpertLayout(72, 576, 2),
                                    ExpertLayout(64, 256, 2, 8), ExpertLayout(6, 18, 3, 3, 2),
                                    ExpertLayout(2, 1200, 256, 2, 2), ExpertLayout(5, 5, 1, 5, 3)])
def test_shared_bytes_are_the_kernels_carve_up(layout):
    assert plan_shared_bytes(layout) == kernel_carve_up_bytes(layout)


@pytest.mark.parametrize("layout, problem", [
    (ExpertLayout(256, 256, 2), "domains of up to 128 ranks"),
    (ExpertLayout(2, 1200, 300, 2, 2), "up to 256 redundant slots"),  # a move's slot field has 8 bits
    (ExpertLayout(128, 1024, 2), "bytes of shared memory"),
])
def test_layouts_the_kernel_cannot_take_are_refused_by_name(layout, problem):
    with pytest.raises(ValueError, match=problem):
        launch_shared_bytes(layout)
    with pytest.raises(ValueError, match=problem):
        DevicePlanner(layout)


@pytest.mark.parametrize("layout", [ExpertLayout(64, 128, 2), ExpertLayout(64, 256, 2), ExpertLayout(72, 576, 2),
                                    ExpertLayout(2, 1200, 256, 2, 2), ExpertLayout(64, 256, 2, 8)])
def test_anchor_and_edge_layouts_fit(layout):
    assert 0 < launch_shared_bytes(layout) <= MAX_SHARED_BYTES
