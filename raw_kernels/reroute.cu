//! kernels: reroute_count<int>, reroute_count<long long>, reroute_assign<int>, reroute_assign<long long>
// Reroute on the GPU, bitwise equal to ultraep/planner/reroute.py: the k-th occurrence of
// logical expert e among one rank's top-k ids (row-major order) goes to the first
// instance i with split_prefix[rank, e, i] > k.
//
// The ids are cut into chunks of CHUNK entries, one block each.
// reroute_count:  per-chunk occurrence counts of every expert (counts[chunk][E]; gather_loads
//   in balancer.cu writes the same table for the ids an update counts).
// reroute_assign: an entry's ordinal = occurrences in earlier chunks + in earlier warps of
//   its chunk + in earlier lanes of its warp (__match_any_sync), then an upper-bound scan
//   over the expert's few instances. Integer counts only: no order-dependent result.
// Ids outside [0, E) and occurrences beyond the plan's load get slot -1. Both kernels read
// int32 or int64 ids as they are (no converted copy on the hot path).

// CHUNK (reroute_chunks.cuh): ids per block, = blockDim.x of both kernels
#include "reroute_chunks.cuh"

#define FULL_MASK 0xffffffffu
#define WARPS (CHUNK / 32)
#define ASSIGN_COUNTERS (1 + WARPS)  // shared ints per expert of reroute_assign: before_chunk, warp_counts

template <typename Id>
__global__ void __launch_bounds__(CHUNK)
reroute_count(const Id* __restrict__ ids, long long n, int E, int* __restrict__ counts) {
    extern __shared__ int histogram[];  // [E]
    for (int e = threadIdx.x; e < E; e += blockDim.x) histogram[e] = 0;
    __syncthreads();
    const long long i = (long long)blockIdx.x * CHUNK + threadIdx.x;
    if (i < n) {
        const Id e = ids[i];
        if (e >= 0 && e < E) atomicAdd(&histogram[(int)e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[(long long)blockIdx.x * E + e] = histogram[e];
}

template <typename Id>
__global__ void __launch_bounds__(CHUNK)
reroute_assign(const Id* __restrict__ ids, long long n, int E, int K, const int* __restrict__ counts,
               const int* __restrict__ prefix, const int* __restrict__ log_to_phys,
               const int* __restrict__ replica_count, int* __restrict__ out) {
    extern __shared__ int shared[];
    int* before_chunk = shared;      // [E]      occurrences in earlier chunks
    int* warp_counts = shared + E;   // [WARPS][E]  occurrences in each warp of this chunk
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    for (int e = tid; e < E; e += blockDim.x) {
        int sum = 0;
        for (int chunk = 0; chunk < (int)blockIdx.x; ++chunk) sum += counts[(long long)chunk * E + e];
        before_chunk[e] = sum;
    }
    for (int j = tid; j < WARPS * E; j += blockDim.x) warp_counts[j] = 0;
    __syncthreads();
    const long long i = (long long)blockIdx.x * CHUNK + tid;
    const Id id = i < n ? ids[i] : -1;
    const bool valid = id >= 0 && id < E;
    const int e = valid ? (int)id : -1;
    const unsigned peers = __match_any_sync(FULL_MASK, valid ? e : -1);
    if (valid && lane == __ffs(peers) - 1) warp_counts[warp * E + e] = __popc(peers);
    __syncthreads();
    if (i >= n) return;
    int slot = -1;
    if (valid) {
        int ordinal = before_chunk[e] + __popc(peers & ((1u << lane) - 1u));
        for (int w = 0; w < warp; ++w) ordinal += warp_counts[w * E + e];
        const int instances = replica_count[e];
        for (int inst = 0; inst < instances; ++inst)
            if (prefix[(long long)e * K + inst] > ordinal) { slot = log_to_phys[(long long)e * K + inst]; break; }
    }
    out[i] = slot;
}
