// Data-plane kernels: weight sync by persistent tile streaming (with relay forwarding)
// and deterministic gradient reduction. The task lists and their lengths are compiled on
// the device by schedule.cu; ultraep/transfer/schedule.py (its NumPy reference) defines
// every field.
//
//! kernels: weight_sync, reduce_grads<float>, reduce_grads<__nv_bfloat16>

#include <cuda_bf16.h>

#include "sync.cuh"

typedef long long i64;

#define SYNC_THREADS 512
#define VECTORS_PER_THREAD 4   // 512 threads x 4 x 16 B = 32 KiB: the largest tile
#define FLAG_WRITER_BITS 16

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

#define MAX_TENSORS 8   // tensors per expert (host-checked)
#define MAX_DESTS 128    // destinations of one source: replicas of an expert within a domain (host-checked)

// Everything a block needs about its current task, staged in shared memory so the tile
// loop issues no dependent global loads besides the data itself.
struct TaskState {
    i64 task[7];
    u64 src[MAX_TENSORS];                 // this source's tensor base pointers
    unsigned char* dst[MAX_DESTS];        // destination replica-slot bases (peer pointers)
    i64 flag[MAX_DESTS];                  // signal-pad slot of each destination's chunk 0
    i64 first_tile[MAX_TENSORS + 1];      // expert tile index where each tensor starts
    i64 tensor_bytes[MAX_TENSORS];
    i64 slot_offset[MAX_TENSORS];         // where each tensor starts inside a replica slot
    int abort;
};

// Tile k of the expert: its tensor, byte offset and size, from the per-tensor table.
__device__ __forceinline__ void locate_tile(const TaskState& s, int num_tensors, i64 tile_bytes, i64 k,
                                            int& tensor, i64& offset, i64& nbytes) {
    tensor = 0;
    for (int t = 1; t < num_tensors; ++t) tensor += k >= s.first_tile[t];
    offset = (k - s.first_tile[tensor]) * tile_bytes;
    nbytes = min(tile_bytes, s.tensor_bytes[tensor] - offset);
}

// Loads tile k and stores tile prev_k (loaded one step earlier) to every destination, so
// one tile's loads are in flight while the previous tile's stores drain.
__device__ __forceinline__ void stream_tile(const TaskState& s, int num_tensors, i64 tile_bytes, i64 k,
                                            TileRegs& store_regs, TileRegs& load_regs, i64 prev_k) {
    int tensor;
    i64 offset, nbytes;
    if (k < s.task[3]) {
        locate_tile(s, num_tensors, tile_bytes, k, tensor, offset, nbytes);
        load_tile(load_regs, reinterpret_cast<const unsigned char*>(s.src[tensor] + offset), nbytes);
    }
    if (prev_k >= s.task[2]) {
        locate_tile(s, num_tensors, tile_bytes, prev_k, tensor, offset, nbytes);
        const i64 within_slot = s.slot_offset[tensor] + offset;
        const int num_dests = static_cast<int>(s.task[5] - s.task[4]);
        for (int d = 0; d < num_dests; ++d) store_tile(store_regs, s.dst[d] + within_slot, nbytes);
    }
}

// Persistent weight sync. Blocks pull tasks (one chunk of one source each) in list order
// from *next_task, streaming the chunk's tiles through two register buffers (every thread
// stores exactly the bytes it loaded, so no exchange through shared memory is needed) to
// every destination; then one system fence and the chunk flag at each destination. A
// relay task first waits (with a timeout) for its own chunk flag. On a timeout the kernel
// records (1, flag slot, expected epoch, seen) in status and stops.
extern "C" __global__ void __launch_bounds__(SYNC_THREADS)
weight_sync(const i64* tasks, const int* task_count, const i64* tensor_table, int num_tensors, i64 tile_bytes,
            const i64* dests, const u64* src_ptrs, const u64* peer_bases, int rank, u64 epoch, int* next_task,
            u64 timeout_ns, u64* status) {
    __shared__ TaskState s;
    __shared__ int task_ids[2];  // current and prefetched task index
    const int num_tasks = *task_count;  // written on the device by the schedule compiler
    const int tid = threadIdx.x;
    if (tid < num_tensors) {
        s.first_tile[tid] = tensor_table[3 * tid];
        s.tensor_bytes[tid] = tensor_table[3 * tid + 1];
        s.slot_offset[tid] = tensor_table[3 * tid + 2];
    }
    if (tid == 0) task_ids[1] = atomicAdd(next_task, 1);
    for (;;) {
        __syncthreads();  // everyone is done with the previous task's shared state
        if (tid == 0) {
            task_ids[0] = task_ids[1];
            s.abort = 0;
            if (task_ids[0] < num_tasks) task_ids[1] = atomicAdd(next_task, 1);  // fetched while we copy
        }
        __syncthreads();
        const int t = task_ids[0];
        if (t >= num_tasks) return;
        if (tid < 7) s.task[tid] = tasks[7 * static_cast<i64>(t) + tid];
        __syncthreads();
        if (tid < num_tensors) s.src[tid] = src_ptrs[s.task[0] + tid];
        for (i64 d = s.task[4] + tid; d < s.task[5]; d += SYNC_THREADS) {
            const i64* dest = dests + 3 * d;
            s.dst[d - s.task[4]] = reinterpret_cast<unsigned char*>(peer_bases[dest[0]] + dest[1]);
            s.flag[d - s.task[4]] = dest[2];
        }
        const i64 wait_slot = s.task[6];
        if (wait_slot >= 0 && tid == 0) {
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
                    s.abort = 1;
                    break;
                }
                __nanosleep(200);
            }
            __threadfence();
        }
        __syncthreads();
        if (s.abort) return;
        TileRegs even, odd;
        const i64 first = s.task[2], last = s.task[3];
        for (i64 k = first; k <= last; k += 2) {  // unrolled by two: the buffers swap roles
            stream_tile(s, num_tensors, tile_bytes, k, odd, even, k - 1);
            if (k + 1 <= last) stream_tile(s, num_tensors, tile_bytes, k + 1, even, odd, k);
        }
        __threadfence_system();  // this chunk's stores are visible system-wide before its flags
        __syncthreads();
        if (tid == 0) {
            const int num_dests = static_cast<int>(s.task[5] - s.task[4]);
            for (int d = 0; d < num_dests; ++d) {
                u64* flag = reinterpret_cast<u64*>(peer_bases[dests[3 * (s.task[4] + d)]]) + s.flag[d] + s.task[1];
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
__global__ void reduce_grads(const i64* tasks, const int* task_count, const i64* srcs, const u64* dst_ptrs,
                             const u64* peer_bases) {
    const int num_tasks = *task_count;  // written on the device by the schedule compiler
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
