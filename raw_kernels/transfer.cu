// Data-plane kernels: weight sync by persistent tile streaming (with relay forwarding)
// and deterministic gradient reduction. The task lists are compiled on the host by
// ultraep/transfer/schedule.py, whose docstring defines every field.
//
//! kernels: weight_sync, reduce_grads<float>, reduce_grads<__nv_bfloat16>

#include <cuda_bf16.h>

typedef unsigned long long u64;
typedef long long i64;

#define SYNC_THREADS 512
#define VECTORS_PER_THREAD 4   // 512 threads x 4 x 16 B = 32 KiB: the largest tile
#define FLAG_WRITER_BITS 16

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

// One tile held in registers: each thread its 16-byte vectors plus at most one tail byte.
struct TileRegs {
    uint4 v[VECTORS_PER_THREAD];
    unsigned char tail;
};

__device__ __forceinline__ void load_tile(TileRegs& r, const unsigned char* src, i64 nbytes) {
    const i64 vectors = nbytes / 16;
#pragma unroll
    for (int k = 0; k < VECTORS_PER_THREAD; ++k) {
        const i64 v = threadIdx.x + static_cast<i64>(k) * SYNC_THREADS;
        if (v < vectors) r.v[k] = __ldcg(reinterpret_cast<const uint4*>(src) + v);  // L2: relays read fresh data
    }
    const i64 tail = vectors * 16 + threadIdx.x;
    if (tail < nbytes) r.tail = __ldcg(src + tail);
}

__device__ __forceinline__ void store_tile(const TileRegs& r, unsigned char* dst, i64 nbytes) {
    const i64 vectors = nbytes / 16;
#pragma unroll
    for (int k = 0; k < VECTORS_PER_THREAD; ++k) {
        const i64 v = threadIdx.x + static_cast<i64>(k) * SYNC_THREADS;
        if (v < vectors) reinterpret_cast<uint4*>(dst)[v] = r.v[k];
    }
    const i64 tail = vectors * 16 + threadIdx.x;
    if (tail < nbytes) dst[tail] = r.tail;
}

struct SyncArgs {
    const i64* tiles;        // [T, 3]: tensor, byte offset, nbytes
    const i64* dests;        // [D, 3]: rank, slot heap offset, flag slot of chunk 0
    const u64* src_ptrs;     // source table: master tensors, then local replica-slot tensors
    const u64* slot_offsets; // [tensors]: offset of each tensor inside a replica slot
    const u64* peer_bases;
};

// Loads tile k of the source and stores the previous one to every destination, so the
// loads of one tile are in flight while the stores of the last one drain.
__device__ __forceinline__ void stream_tile(const SyncArgs& a, const i64* task, i64 k, TileRegs& store_regs,
                                            TileRegs& load_regs, i64 prev_k) {
    if (k < task[3]) {
        const i64* tile = a.tiles + 3 * k;
        load_tile(load_regs, reinterpret_cast<const unsigned char*>(a.src_ptrs[task[0] + tile[0]] + tile[1]), tile[2]);
    }
    if (prev_k >= task[2]) {
        const i64* tile = a.tiles + 3 * prev_k;
        for (i64 d = task[4]; d < task[5]; ++d) {
            const i64* dest = a.dests + 3 * d;
            unsigned char* dst = reinterpret_cast<unsigned char*>(a.peer_bases[dest[0]] + dest[1] + a.slot_offsets[tile[0]] + tile[1]);
            store_tile(store_regs, dst, tile[2]);
        }
    }
}

// Persistent weight sync. Blocks pull tasks (one chunk of one source each) in list order
// from *next_task, streaming the chunk's tiles through two register buffers (every thread
// stores exactly the bytes it loaded, so no exchange through shared memory is needed) to
// every destination; then one system fence and the chunk flag at each destination. A
// relay task first waits (with a timeout) for its own chunk flag. On a timeout the kernel
// records (1, flag slot, expected epoch, seen) in status and stops.
extern "C" __global__ void __launch_bounds__(SYNC_THREADS)
weight_sync(const i64* tasks, int num_tasks, const i64* tiles, const i64* dests, const u64* src_ptrs,
            const u64* slot_offsets, const u64* peer_bases, int rank, u64 epoch, int* next_task, u64 timeout_ns,
            u64* status) {
    __shared__ int task_ids[2];  // current and prefetched task index
    __shared__ int abort_flag;
    const SyncArgs a{tiles, dests, src_ptrs, slot_offsets, peer_bases};
    const int tid = threadIdx.x;
    if (tid == 0) task_ids[1] = atomicAdd(next_task, 1);
    for (;;) {
        __syncthreads();  // everyone is done with the previous task's shared state
        if (tid == 0) {
            task_ids[0] = task_ids[1];
            abort_flag = 0;
            if (task_ids[0] < num_tasks) task_ids[1] = atomicAdd(next_task, 1);  // fetched while we copy
        }
        __syncthreads();
        const int t = task_ids[0];
        if (t >= num_tasks) return;
        const i64* task = tasks + 7 * static_cast<i64>(t);
        const i64 wait_slot = task[6];
        if (wait_slot >= 0) {
            if (tid == 0) {
                const u64* flag = reinterpret_cast<const u64*>(peer_bases[rank]) + wait_slot;
                const u64 start = global_timer_ns();
                u64 seen;
                while (((seen = load_acquire_sys(flag)) >> FLAG_WRITER_BITS) < epoch) {
                    if (global_timer_ns() - start > timeout_ns) {
                        if (atomicCAS(reinterpret_cast<u64*>(status), 0ull, 1ull) == 0ull) {
                            status[1] = static_cast<u64>(wait_slot);
                            status[2] = epoch;
                            status[3] = seen;
                        }
                        abort_flag = 1;
                        break;
                    }
                    __nanosleep(200);
                }
                __threadfence();
            }
            __syncthreads();
            if (abort_flag) return;
        }
        TileRegs even, odd;
        const i64 first = task[2], last = task[3];
        for (i64 k = first; k <= last; k += 2) {  // unrolled by two: the buffers swap roles
            stream_tile(a, task, k, odd, even, k - 1);
            if (k + 1 <= last) stream_tile(a, task, k + 1, even, odd, k);
        }
        __threadfence_system();  // this chunk's stores are visible system-wide before its flags
        __syncthreads();
        if (tid == 0) {
            for (i64 d = task[4]; d < task[5]; ++d) {
                const i64* dest = dests + 3 * d;
                u64* flag = reinterpret_cast<u64*>(peer_bases[dest[0]]) + dest[2] + task[1];
                store_release_sys(flag, (epoch << FLAG_WRITER_BITS) | static_cast<u64>(rank));
            }
        }
    }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Gradient reduction, one task per block iteration (static assignment: the arithmetic
// order per element is fixed by the task, not by scheduling): master tile in fp32, plus
// each replica's tile in replica order, rounded once. Plain adds: no FMA can contract them.
template <typename T>
__global__ void reduce_grads(const i64* tasks, int num_tasks, const i64* srcs, const u64* dst_ptrs,
                             const u64* peer_bases) {
    for (int t = blockIdx.x; t < num_tasks; t += gridDim.x) {
        const i64* task = tasks + 5 * static_cast<i64>(t);
        T* dst = reinterpret_cast<T*>(dst_ptrs[task[0]] + task[1]);
        const i64 count = task[2] / static_cast<i64>(sizeof(T));
        for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
            float acc = to_float(dst[i]);
            for (i64 s = task[3]; s < task[4]; ++s) {
                const T* src = reinterpret_cast<const T*>(peer_bases[srcs[2 * s]] + srcs[2 * s + 1]);
                acc = __fadd_rn(acc, to_float(__ldcg(src + i)));
            }
            dst[i] = from_float<T>(acc);
        }
    }
}
