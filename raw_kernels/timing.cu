// Benchmark support: a kernel that holds its stream for a while, so that the host can
// enqueue a timed launch between two events before the device reaches them; the events
// then bracket device time only, not the host's submission latency.
//
//! kernels: hold_stream

#include "sync.cuh"

extern "C" __global__ void hold_stream(u64 duration_ns) {
    const u64 start = global_timer_ns();
    while (global_timer_ns() - start < duration_ns) __nanosleep(1000);
}
