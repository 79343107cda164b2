//! kernels: gather_loads<int>, gather_loads<long long>
// Balancer kernels (ultraep/integration/device.py); NumPy reference: ultraep/integration/host.py.
//
// gather_loads: the load gather of one update in one launch, with no heap barrier.
//   Counting (ids != nullptr): how many of this rank's top-k ids name each logical expert,
//   added into `counts`. One block per chunk of CHUNK ids (reroute_chunks.cuh), so each
//   block's histogram is its chunk's complete count: with `chunk_counts` != nullptr it is
//   also written there, row blockIdx.x of counts[chunk][E] (every entry, zeros too) --
//   reroute_count's table, which reroute_assign (reroute.cu) reads for the same ids. Integer
//   counts only, so the atomics cannot change the result. Ids outside [0, E) are not
//   counted; bad[0] counts them and bad[1] keeps the smallest flat index of one
//   (atomicMin), so the host can name it after a single read (`bad` accumulates until the
//   host resets it). With ids == nullptr and loads != nullptr, block 0 adds the caller's
//   row `loads` instead. Shared memory: E ints (the histogram).
//   Publishing (publish != 0; a launch may only count, and a later one-block launch with
//   neither ids nor loads publish what was counted): the last block to finish counting
//   numbers this update's epoch `gathers` + 1 (every rank publishes once per update, in
//   stream order, so the number is the same on every rank; kept here, not passed in, so
//   that a captured CUDA graph numbers its replays too) and uses gathered matrix
//   (epoch - 1) % buffers of the `buffers` that follow each other from `matrix_offset`
//   (same heap offset on every rank): it writes the row into row `rank` of every peer's
//   matrix, zeroes `counts` and `arrived` for the next update, and releases flag `rank`
//   of the gather's flag block in every peer's pad with the epoch. It then waits
//   (acquire) for every peer's flag of this epoch -- each peer's row is then in this
//   rank's matrix -- copies the matrix to `out` (what the planner reads), and counts the
//   gather in `gathers`. A wait that outlasts timeout_ns records (1, peer, expected, seen)
//   in status and gives up (the gather still counts); the host reports it.
//   `counts`, `arrived` and `gathers` must be zero before the first launch.

#include "sync.cuh"
#include "reroute_chunks.cuh"

#define GATHER_THREADS 256

template <typename Id>
__global__ void __launch_bounds__(GATHER_THREADS)
gather_loads(const Id* __restrict__ ids, long long n, const int* __restrict__ loads, int E, int* counts,
             int* __restrict__ chunk_counts, u64* __restrict__ bad, unsigned* arrived, int publish, const u64* __restrict__ peer_bases,
             u64 matrix_offset, u64 matrix_bytes, int buffers, long long flag_slot, int rank, int world,
             u64 timeout_ns, int* __restrict__ out, long long* gathers, u64* status) {
    extern __shared__ int histogram[];  // [E]
    __shared__ bool last;
    __shared__ u64 epoch_of_block;
    if (ids != nullptr) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) histogram[e] = 0;
        __syncthreads();
        const long long chunk_begin = (long long)blockIdx.x * CHUNK;
        const long long chunk_end = chunk_begin + CHUNK < n ? chunk_begin + CHUNK : n;
        for (long long i = chunk_begin + threadIdx.x; i < chunk_end; i += blockDim.x) {
            const long long e = (long long)ids[i];
            if (e >= 0 && e < E) {
                atomicAdd(&histogram[e], 1);
            } else {
                atomicAdd(&bad[0], 1ull);
                atomicMin(&bad[1], (u64)i);
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const int count = histogram[e];
            if (count) atomicAdd(&counts[e], count);
            if (chunk_counts != nullptr) chunk_counts[(long long)blockIdx.x * E + e] = count;
        }
    } else if (loads != nullptr && blockIdx.x == 0) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] += loads[e];
    }
    if (!publish) return;

    // The last block sees every block's counts: each fences its adds before arriving.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) epoch_of_block = static_cast<u64>(*gathers) + 1;  // the previous launch's count
    __syncthreads();
    const u64 epoch = epoch_of_block;
    const u64 matrix_at = matrix_offset + ((epoch - 1) % static_cast<u64>(buffers)) * matrix_bytes;
    const volatile int* total = counts;
    for (int i = threadIdx.x; i < world * E; i += blockDim.x) {
        const int peer = i / E, e = i % E;
        reinterpret_cast<int*>(peer_bases[peer] + matrix_at)[(long long)rank * E + e] = total[e];
    }
    __syncthreads();  // every thread has read the counts before any zeroes them
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
    if (threadIdx.x == 0) *arrived = 0;
    __threadfence_system();  // the row's stores, at every peer, before any flag
    __syncthreads();
    for (int peer = threadIdx.x; peer < world; peer += blockDim.x)
        store_release_sys(reinterpret_cast<u64*>(peer_bases[peer]) + flag_slot + rank, epoch);
    wait_peer_flags(reinterpret_cast<const u64*>(peer_bases[rank]) + flag_slot, world, epoch, timeout_ns, status, 128);
    __syncthreads();  // every peer's row has arrived (each thread acquired its peers' flags)
    const int* matrix = reinterpret_cast<const int*>(peer_bases[rank] + matrix_at);
    for (int i = threadIdx.x; i < world * E; i += blockDim.x) out[i] = matrix[i];
    if (threadIdx.x == 0) *gathers = static_cast<long long>(epoch);
}

template __global__ void gather_loads<int>(const int*, long long, const int*, int, int*, int*, u64*, unsigned*,
                                           int, const u64*, u64, u64, int, long long, int, int, u64, int*,
                                           long long*, u64*);
template __global__ void gather_loads<long long>(const long long*, long long, const int*, int, int*, int*, u64*,
                                                 unsigned*, int, const u64*, u64, u64, int, long long, int, int,
                                                 u64, int*, long long*, u64*);
