"""Each rank of an emulated job with green contexts runs on SMs of its own
(tests/runtime/test_sm_partition.py): its green stream stays CuPy's current one through
`with stream:` blocks and a second EPGroup; with every rank's blocks spinning at once, one
block per SM, a rank's first wave starts together (no block waits for an SM another rank
holds), its second wave only after the first ends, and its blocks ran on no more SMs than its
group has."""

import cupy
import numpy as np
from mpi4py import MPI

from ultraep.runtime.group import EPGroup
from ultraep.runtime.sm_partition import new_stream, usable_sms

SPIN_NS = 50_000_000
ONE_BLOCK_PER_SM = 150 * 1024  # dynamic shared memory: more than half an SM's, so one block fits
SOURCE = r"""
extern "C" __global__ void spin(unsigned long long* started, unsigned* sm, unsigned long long ns) {
    extern __shared__ unsigned char held[];
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    if (threadIdx.x == 0) {
        started[blockIdx.x] = t0;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm[blockIdx.x]));
        held[0] = 1;
    }
}
"""
POISON = np.iinfo(np.uint64).max

comm = MPI.COMM_WORLD
group = EPGroup(comm)
sms = usable_sms(group.device)
device_sms = cupy.cuda.runtime.getDeviceProperties(group.device)["multiProcessorCount"]
assert sms * comm.size <= device_sms, f"rank {comm.rank}: {sms} SMs each for {comm.size} ranks of {device_sms}"
green = cupy.cuda.get_current_stream()
assert isinstance(green, cupy.cuda.ExternalStream) and green.ptr, f"rank {comm.rank}: current stream {green}"
with cupy.cuda.Stream(non_blocking=True):  # a block on another stream returns to the rank's own
    pass
EPGroup(comm).close()  # a second group enters no second context
assert cupy.cuda.get_current_stream() == green and usable_sms(group.device) == sms, f"rank {comm.rank}: the " \
    f"current stream is {cupy.cuda.get_current_stream()}, not the green context's {green}"
kernel = cupy.RawKernel(SOURCE, "spin")
kernel.max_dynamic_shared_size_bytes = ONE_BLOCK_PER_SM
kernel.compile()  # before the barriers: every rank launches at once


def block_starts(blocks: int, stream) -> tuple[np.ndarray, set]:
    started = cupy.full(blocks, POISON, dtype=np.uint64)  # poisoned: a block that never ran
    sm = cupy.full(blocks, 0xFFFFFFFF, dtype=np.uint32)
    comm.Barrier()
    kernel((blocks,), (32,), (started, sm, np.uint64(SPIN_NS)), shared_mem=ONE_BLOCK_PER_SM, stream=stream)
    stream.synchronize()
    starts = cupy.asnumpy(started)
    assert (starts != POISON).all(), f"rank {comm.rank}: a block did not run"
    return np.sort(starts.astype(np.int64)), set(cupy.asnumpy(sm).tolist())


# %smid is the SM's number within what MPS gives the client, so it shows how many SMs a rank
# used, not whether two ranks' SMs are the same: the start times show that.
for name, stream in (("current", green), ("new_stream", new_stream())):
    one_wave, _ = block_starts(sms, stream)
    spread = one_wave[-1] - one_wave[0]
    assert spread < SPIN_NS // 2, f"rank {comm.rank} ({name}): its {sms} blocks started {spread / 1e6:.1f} ms apart"
    two_waves, used = block_starts(2 * sms, stream)
    assert len(used) <= sms, f"rank {comm.rank} ({name}): {2 * sms} blocks ran on {len(used)} SMs, not {sms}"
    gap = two_waves[sms] - two_waves[0]
    assert gap >= 0.9 * SPIN_NS, f"rank {comm.rank} ({name}): block {sms} started {gap / 1e6:.1f} ms after the first"
print(f"[sm_partition] rank {comm.rank} OK ({sms} of {device_sms} SMs)", flush=True)
