// Benchmark support: a kernel that holds its stream for a while, so that the host can
// enqueue a timed launch between two events before the device reaches them; the events
// then bracket device time only, not the host's submission latency. And a stamp of the
// device's clock as the stream reaches it: launched before a call whose kernels stamp their
// tasks, it shows how long the call's host path kept the device from its first task.
//
//! kernels: hold_stream, stamp_clock

#include "sync.cuh"

extern "C" __global__ void hold_stream(u64 duration_ns) {
    const u64 start = global_timer_ns();
    while (global_timer_ns() - start < duration_ns) __nanosleep(1000);
}

extern "C" __global__ void stamp_clock(u64* clock_ns) { *clock_ns = global_timer_ns(); }
