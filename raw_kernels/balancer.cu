//! kernels: count_expert_loads<int>, count_expert_loads<long long>, publish_load_row
// Balancer kernels (ultraep/integration/device.py); NumPy reference: ultraep/integration/host.py.
//
// count_expert_loads: this rank's load row -- how many of its top-k ids name each logical
//   expert. Integer counts only, so the atomics cannot change the result. Ids outside
//   [0, E) are not counted; bad[0] counts them and bad[1] keeps the smallest flat index
//   of one (atomicMin), so the host can name it after a single read. `counts` must be
//   zeroed before the launch; `bad` accumulates until the host resets it.
// publish_load_row: block p copies the row into row `rank` of peer p's gathered load
//   matrix (same heap offset on every rank). The heap barrier that follows fences the
//   stores before it signals.

typedef unsigned long long u64;

template <typename Id>
__global__ void count_expert_loads(const Id* __restrict__ ids, long long n, int E, int* __restrict__ counts,
                                   u64* __restrict__ bad) {
    extern __shared__ int histogram[];  // [E]
    for (int e = threadIdx.x; e < E; e += blockDim.x) histogram[e] = 0;
    __syncthreads();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
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
        if (histogram[e]) atomicAdd(&counts[e], histogram[e]);
    }
}

template __global__ void count_expert_loads<int>(const int*, long long, int, int*, u64*);
template __global__ void count_expert_loads<long long>(const long long*, long long, int, int*, u64*);

extern "C" __global__ void publish_load_row(const int* __restrict__ counts, int E, const u64* __restrict__ peer_bases,
                                            u64 matrix_offset, int rank) {
    int* row = reinterpret_cast<int*>(peer_bases[blockIdx.x] + matrix_offset) + (long long)rank * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) row[e] = counts[e];
}
