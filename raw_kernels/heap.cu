// Symmetric-heap kernels: the cross-rank barrier and the peer copy.
//
// Flags live in each rank's signal pad at the start of its heap; peer_bases[r] is rank
// r's heap base mapped into this process. Stores that publish a flag are system-scope
// releases, loads that wait on one are system-scope acquires, so data written into a
// peer's heap before a flag is visible to the peer once it has seen the flag.
//
//! kernels: symmetric_barrier, copy_bytes

#include "sync.cuh"

// One block. Thread t publishes `flag` (epoch and refusal causes, sync.cuh) into slot `rank`
// of peer t's pad, then waits until slot t of this rank's own pad reaches the epoch. A wait
// that outlasts timeout_ns, or a peer that refused this epoch, is recorded in status[0..3]
// (wait_peer_flags); a timed-out wait gives up instead of hanging.
extern "C" __global__ void symmetric_barrier(const u64* peer_bases, int rank, int world, u64 pad_offset,
                                             u64 flag, u64 timeout_ns, u64* status) {
    __threadfence_system();  // earlier kernels' peer stores complete before any flag is published
    __syncthreads();
    for (int peer = threadIdx.x; peer < world; peer += blockDim.x) {
        u64* slot = reinterpret_cast<u64*>(peer_bases[peer] + pad_offset) + rank;
        store_release_sys(slot, flag);
    }
    wait_peer_flags(reinterpret_cast<const u64*>(peer_bases[rank] + pad_offset), world, flag & BARRIER_EPOCH_MASK,
                    timeout_ns, status, 256);
    __syncthreads();
}

// Grid-stride copy of whole V-sized vectors, four loads in flight per thread, then the
// remaining (< sizeof(V)) bytes.
template <typename V>
__device__ __forceinline__ void copy_vectors(const unsigned char* src, unsigned char* dst, u64 n) {
    const u64 vectors = n / sizeof(V);
    const V* s = reinterpret_cast<const V*>(src);
    V* d = reinterpret_cast<V*>(dst);
    const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
    const u64 thread = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
    u64 i = thread;
    for (; i + 3 * stride < vectors; i += 4 * stride) {
        V a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = e;
    }
    for (; i < vectors; i += stride) d[i] = s[i];
    const u64 tail = vectors * sizeof(V) + thread;
    if (tail < n) dst[tail] = src[tail];
}

// dst[0..n) = src[0..n); dst may be in a peer's heap. 16-byte accesses when both ends are
// 16-byte aligned (heap and CuPy allocations are 256-byte aligned), else 4-byte, else bytes.
extern "C" __global__ void copy_bytes(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, u64 n) {
    const u64 alignment = reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst);
    if ((alignment & 15) == 0) {
        copy_vectors<uint4>(src, dst, n);
    } else if ((alignment & 3) == 0) {
        copy_vectors<unsigned int>(src, dst, n);
    } else {
        copy_vectors<unsigned char>(src, dst, n);
    }
}
