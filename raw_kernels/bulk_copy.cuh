// Hopper bulk copy engine (cp.async.bulk, PTX ISA 8.0, sm_90) between global and shared
// memory, completed through mbarriers (sync.cuh) or bulk groups. Used by the weight-sync
// prototypes in scripts/weight_sync_variants.cu (transfer.cu's kernel before the register
// copies of 2026-12-01 was built on it).
#pragma once

#include "sync.cuh"

// Arrive once on `bar` and expect `bytes` from the bulk engine: the phase completes when
// both happened.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, unsigned bytes, u64* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(smem_dst)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* smem_src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(shared_address(smem_src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {  // all but N groups have read shared memory
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_done() {  // all but N groups have written global memory
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
