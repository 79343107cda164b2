"""sync.cuh's mbarrier wait: a phase that never completes is named in a message and traps
instead of hanging (GPU; the trap spoils the CUDA context, so it runs in a subprocess)."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

PROGRAM = textwrap.dedent('''
    import cupy
    from ultraep.runtime.kernels import inline_local_includes, kernel_source

    source = inline_local_includes(kernel_source("sync.cuh")) + r"""
    extern "C" __global__ void wait_forever(int arrivals) {
        __shared__ u64 bar;
        if (threadIdx.x == 0) mbarrier_init(&bar, 2);
        __syncthreads();
        if (threadIdx.x < arrivals) mbarrier_arrive(&bar);
        mbarrier_wait(&bar, 0, "the test's second arrival");
    }
    """
    options = ("--std=c++17", "-DMBARRIER_TIMEOUT_NS=20000000ull")
    kernel = cupy.RawModule(code=source, options=options).get_function("wait_forever")
    kernel((1,), (32,), (cupy.int32(2),))  # both arrivals: completes
    cupy.cuda.Device().synchronize()
    print("completed phase: OK", flush=True)
    kernel((1,), (32,), (cupy.int32(1),))  # one of two arrivals: times out
    cupy.cuda.Device().synchronize()
''')


@pytest.mark.traps
def test_a_phase_that_never_completes_is_reported_and_traps():
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert "completed phase: OK" in result.stdout, result.stdout + result.stderr
    assert result.returncode != 0, "the kernel waiting for an arrival that never comes did not fail"
    lines = [line for line in result.stdout.splitlines() if "waited over" in line]
    want = "ultraep: block 0 warp 0 waited over 20 ms for the test's second arrival (mbarrier phase parity 0)"
    assert lines == [want], result.stdout
