// Signalling primitives shared by the kernels. Cross-rank: a flag that publishes data is
// stored with system-scope release semantics; a wait loads it with system-scope acquire
// semantics and gives up after a timeout read from %globaltimer (the caller records it for
// the host). Within a kernel: shared-memory barriers (mbarrier), whose waits trap with a
// message naming what they waited for when a phase does not complete in time.
#pragma once

#ifndef __CUDACC_RTC__
#include <cstdio>  // device printf (NVRTC has it built in)
#endif

typedef unsigned long long u64;

__device__ __forceinline__ void store_release_sys(u64* addr, u64 value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ u64 load_acquire_sys(const u64* addr) {
    u64 value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// A heap barrier flag word: the epoch in the low BARRIER_EPOCH_BITS, then why this rank
// refuses this epoch and why it refused the one before (cause codes, 0: it did not). A rank
// that refuses a barrier (its own arguments are bad) still arrives, so every rank stays in
// step and its peers report the cause instead of timing out. A peer can be at most one
// barrier ahead of a waiter (it waits for everyone's arrival before it signals again), so a
// refusal overwritten by the next flag survives in that flag's previous-epoch field.
#define BARRIER_EPOCH_BITS 48
#define BARRIER_EPOCH_MASK ((1ull << BARRIER_EPOCH_BITS) - 1)
#define BARRIER_CAUSE_BITS 8
#define BARRIER_CAUSE_MASK ((1ull << BARRIER_CAUSE_BITS) - 1)
#define BARRIER_CAUSE_SHIFT BARRIER_EPOCH_BITS
#define BARRIER_PREV_CAUSE_SHIFT (BARRIER_EPOCH_BITS + BARRIER_CAUSE_BITS)
// status[0] of a failed wait_peer_flags
#define PEER_WAIT_TIMED_OUT 1
#define PEER_WAIT_REFUSED 2

// The block's threads wait, a peer per thread (grid-stride over the block), until each
// peer's flag own[peer] reaches `epoch`; the first wait that times out, or sees its peer
// refuse this epoch, records (PEER_WAIT_TIMED_OUT or PEER_WAIT_REFUSED, peer, epoch, flag
// seen) in status[0..3] for the host. A refusal counts as an arrival.
__device__ __forceinline__ void wait_peer_flags(const u64* own, int world, u64 epoch, u64 timeout_ns, u64* status,
                                                unsigned sleep_ns) {
    for (int peer = threadIdx.x; peer < world; peer += blockDim.x) {
        const u64 start = global_timer_ns();
        u64 seen, code = 0;
        while (((seen = load_acquire_sys(own + peer)) & BARRIER_EPOCH_MASK) < epoch) {
            if (global_timer_ns() - start > timeout_ns) {
                code = PEER_WAIT_TIMED_OUT;
                break;
            }
            __nanosleep(sleep_ns);
        }
        const u64 arrived = seen & BARRIER_EPOCH_MASK;
        const int shift = arrived == epoch ? BARRIER_CAUSE_SHIFT : BARRIER_PREV_CAUSE_SHIFT;
        if (code == 0 && arrived <= epoch + 1 && ((seen >> shift) & BARRIER_CAUSE_MASK) != 0) code = PEER_WAIT_REFUSED;
        if (code != 0 && atomicCAS(status, 0ull, code) == 0ull) {
            status[1] = static_cast<u64>(peer);
            status[2] = epoch;
            status[3] = seen;
        }
    }
}

// -- Shared-memory barriers (mbarrier, sm_90) ----------------------------------------------
// The 32-bit shared-window address that mbarrier and bulk-copy instructions take.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// A barrier whose phases complete after `arrivals` arrivals (and the bytes announced).
__device__ __forceinline__ void mbarrier_init(u64* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(shared_address(bar)) : "memory");
}
// `count` arrivals at once (a thread arriving for others that left theirs out).
__device__ __forceinline__ void mbarrier_arrive_count(u64* bar, unsigned count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(count) : "memory");
}

// Unless the caller knows a longer legitimate wait (a wait behind a peer's flag), a phase
// of a block's own mbarrier that does not complete within this time is a bug: the wait
// reports it and traps rather than hang (a time-sliced context is descheduled for
// milliseconds, not seconds).
#ifndef MBARRIER_TIMEOUT_NS  // a test compiles a shorter one
#define MBARRIER_TIMEOUT_NS 2000000000ull
#endif

// Out of line: code that never runs should not take instruction fetch from what does. One
// line per warp (its lowest waiting lane), not one per thread.
__device__ __noinline__ void mbarrier_timed_out(const char* what, unsigned parity, u64 timeout_ns) {
    if ((threadIdx.x & 31) == __ffs(__activemask()) - 1)
        printf("ultraep: block %d warp %d waited over %llu ms for %s (mbarrier phase parity %u)\n", (int)blockIdx.x,
               (int)(threadIdx.x / 32), timeout_ns / 1000000ull, what, parity);
    __trap();
}

// Whether the phase of parity `parity` of the mbarrier at shared-window address `bar` completed
// (the thread may be suspended a while first). CLUSTER_ACQUIRE: what other blocks of the
// cluster delivered through it (st.async, bulk copies) is visible afterwards.
template <bool CLUSTER_ACQUIRE>
__device__ __forceinline__ bool mbarrier_try_wait(unsigned bar, unsigned parity) {
    unsigned done;
    if (CLUSTER_ACQUIRE)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    else
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done;
}

// Waits for the phase of parity `parity` of barrier `bar`; `what` names it in the timeout's
// message.
template <bool CLUSTER_ACQUIRE = false>
__device__ __forceinline__ void mbarrier_wait(u64* bar, unsigned parity, const char* what,
                                              u64 timeout_ns = MBARRIER_TIMEOUT_NS) {
    const unsigned address = shared_address(bar);
    if (mbarrier_try_wait<CLUSTER_ACQUIRE>(address, parity)) return;
    const u64 start = global_timer_ns();
    while (!mbarrier_try_wait<CLUSTER_ACQUIRE>(address, parity))
        if (global_timer_ns() - start > timeout_ns) mbarrier_timed_out(what, parity, timeout_ns);
}
