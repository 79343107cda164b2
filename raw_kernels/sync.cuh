// Cross-rank signalling primitives shared by the heap and data-plane kernels. A flag that
// publishes data is stored with system-scope release semantics; a wait loads it with
// system-scope acquire semantics and gives up after a timeout read from %globaltimer.
#pragma once

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
