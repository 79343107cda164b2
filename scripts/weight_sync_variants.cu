// Prototype kernels for issue 4 (scripts/weight_sync_variants.py): fan-out copies of one
// buffer to f destinations, without tasks or signalling, to find which access pattern
// moves HBM bytes fastest.
// raw_kernels/bulk_copy.cuh, inlined by runtime.kernels.inline_local_includes:
#include "bulk_copy.cuh"

typedef long long i64;

template <int LD> __device__ __forceinline__ uint4 load16(const uint4* p) {
    if (LD == 0) return __ldg(p);
    if (LD == 1) return __ldcg(p);
    return __ldcs(p);
}

// Warp pieces of 32 x U uint4. ORDER 0: grid-interleaved pieces; 1: each block a contiguous range.
// Every piece is loaded once and stored to every destination.
template <int U, int ORDER>
__global__ void reg_fanout(const uint4* src, const u64* dsts, i64 n16, int f) {
    const int lane = threadIdx.x % 32, wpb = blockDim.x / 32;
    const i64 pieces = (n16 + 32 * U - 1) / (32 * U);
    i64 first, last, step;
    if (ORDER == 0) { first = blockIdx.x * wpb + threadIdx.x / 32; last = pieces; step = (i64)gridDim.x * wpb; }
    else {
        const i64 share = pieces / gridDim.x, extra = pieces % gridDim.x;
        const i64 b0 = blockIdx.x * share + min((i64)blockIdx.x, extra);
        first = b0 + threadIdx.x / 32; last = b0 + share + ((i64)blockIdx.x < extra); step = wpb;
    }
    for (i64 p = first; p < last; p += step) {
        uint4 v[U];
        const i64 base = p * 32 * U + lane;
#pragma unroll
        for (int i = 0; i < U; ++i) if (base + 32 * i < n16) v[i] = __ldcg(src + base + 32 * i);
        for (int d = 0; d < f; ++d) {
            uint4* dst = reinterpret_cast<uint4*>(__ldg(dsts + d));
#pragma unroll
            for (int i = 0; i < U; ++i) if (base + 32 * i < n16) dst[base + 32 * i] = v[i];
        }
    }
}

// One job = one warp piece to one destination. WINDOW == 0: jobs piece-major (the f jobs of a
// piece run side by side, the source re-read from L1/L2); WINDOW > 0: windows of WINDOW pieces,
// destination-major inside (all warps write one destination's window at a time, reading the
// source window from L2 after the first destination). COUNT > 0: every COUNT jobs a warp fences
// once and adds its pending bytes to per-128-KiB chunk counters (the signalling's cost).
template <int U, int LD, int COUNT>
__global__ void split_fanout(const uint4* src, const u64* dsts, i64 n16, int f, i64 window, int* done) {
    const int lane = threadIdx.x % 32, wpb = blockDim.x / 32;
    const i64 pieces = (n16 + 32 * U - 1) / (32 * U), jobs = pieces * f;
    const i64 step = (i64)gridDim.x * wpb;
    int pending_chunk = -1, pending_bytes = 0, npending = 0;
    for (i64 j = blockIdx.x * wpb + threadIdx.x / 32; j < jobs; j += step) {
        i64 p; int d;
        if (window == 0) { p = j / f; d = static_cast<int>(j % f); }
        else {
            const i64 w = j / (window * f), r = j - w * window * f, wp = min(window, pieces - w * window);
            d = static_cast<int>(r / wp); p = w * window + r % wp;
        }
        uint4 v[U];
        const i64 base = p * 32 * U + lane;
#pragma unroll
        for (int i = 0; i < U; ++i) if (base + 32 * i < n16) v[i] = load16<LD>(src + base + 32 * i);
        uint4* dst = reinterpret_cast<uint4*>(__ldg(dsts + d));
#pragma unroll
        for (int i = 0; i < U; ++i) if (base + 32 * i < n16) dst[base + 32 * i] = v[i];
        if (COUNT) {
            if (lane == npending) { pending_chunk = static_cast<int>(p * 512 * U / (128 << 10)); pending_bytes = 512 * U; }
            if (++npending == COUNT) {
                __syncwarp();
                if (lane == 0) asm volatile("fence.acq_rel.gpu;" ::: "memory");
                __syncwarp();
                if (lane < COUNT) atomicAdd(done + pending_chunk, pending_bytes);
                npending = 0;
            }
        }
    }
    if (COUNT && npending) {
        __syncwarp();
        if (lane == 0) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        __syncwarp();
        if (lane < npending) atomicAdd(done + pending_chunk, pending_bytes);
    }
}

// -- bulk copy engine variant ---------------------------------------------------------------
// Warp 0 lane 0 loads pieces into stages; warp 1 stores them: SPREAD 0 lane 0 issues every
// destination's store, SPREAD 1 lane d issues destination d's (own bulk groups).
// ORDER 0: pieces interleaved over blocks; 1: contiguous block ranges.
template <int SPREAD, int ORDER>
__global__ void bulk_fanout(const char* src, const u64* dsts, i64 nbytes, int f, int piece, int stages) {
    extern __shared__ __align__(128) unsigned char stage_mem[];
    __shared__ u64 full[16], empty[16];
    if (threadIdx.x == 0) {
        for (int q = 0; q < stages; ++q) { mbarrier_init(&full[q], 1); mbarrier_init(&empty[q], 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const i64 pieces = (nbytes + piece - 1) / piece;
    i64 first, last, step;
    if (ORDER == 0) { first = blockIdx.x; last = pieces; step = gridDim.x; }
    else {
        const i64 share = pieces / gridDim.x, extra = pieces % gridDim.x;
        first = blockIdx.x * share + min((i64)blockIdx.x, extra); last = first + share + ((i64)blockIdx.x < extra); step = 1;
    }
    const int lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        int n = 0;
        for (i64 p = first; p < last; p += step, ++n) {
            const int s = n % stages;
            if (n >= stages) mbarrier_wait(&empty[s], (n / stages - 1) & 1, "a free stage");
            const unsigned bytes = static_cast<unsigned>(min((i64)piece, nbytes - p * piece));
            bulk_load(stage_mem + s * piece, src + p * piece, bytes, &full[s]);
        }
    } else if (threadIdx.x / 32 == 1) {
        int n = 0;
        for (i64 p = first; p < last; p += step, ++n) {
            const int s = n % stages;
            mbarrier_wait(&full[s], (n / stages) & 1, "a loaded stage");
            const unsigned bytes = static_cast<unsigned>(min((i64)piece, nbytes - p * piece));
            for (int d = SPREAD ? lane : 0; d < f && (SPREAD || lane == 0); d += SPREAD ? 32 : 1)
                bulk_store(reinterpret_cast<char*>(__ldg(dsts + d)) + p * piece, stage_mem + s * piece, bytes);
            bulk_commit();
            bulk_wait_read<1>();
            __syncwarp();
            if (lane == 0 && n >= 1) mbarrier_arrive(&empty[(n - 1) % stages]);
        }
        bulk_wait_done<0>();
    }
}

// -- bulk loads, stores split between the bulk engine and the lanes ------------------------
// Warp 0 lane 0 loads pieces into stages (bulk engine); warp 1 lane 0 bulk-stores the first
// tma_share/256 of the piece's f x bytes (destination-major); warps 2.. store the rest from
// shared memory through registers (ld.shared/st.global, 4 x 16 B in flight per lane). HINT 1:
// bulk stores with an L2 evict_first policy. Pieces interleaved over blocks.
__device__ __forceinline__ void bulk_store_evict_first(void* dst, const void* smem_src, unsigned bytes, u64 policy) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                 :: "l"(dst), "r"(shared_address(smem_src)), "r"(bytes), "l"(policy) : "memory");
}
// Bytes of a piece's f x bytes (destination-major) that the bulk engine stores.
__device__ __forceinline__ i64 bulk_part(int f, i64 bytes, int tma_share) { return (f * bytes * tma_share / 256) & ~15ll; }
template <int HINT>
__global__ void hybrid_fanout(const char* src, const u64* dsts, i64 nbytes, int f, int piece, int stages, int tma_share) {
    extern __shared__ __align__(128) unsigned char stage_mem[];
    __shared__ u64 full[16], empty[16];
    const int lsu_warps = blockDim.x / 32 - 2;
    if (threadIdx.x == 0) {
        for (int q = 0; q < stages; ++q) { mbarrier_init(&full[q], 1); mbarrier_init(&empty[q], 1 + lsu_warps); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const i64 pieces = (nbytes + piece - 1) / piece;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
        int n = 0;
        for (i64 p = blockIdx.x; p < pieces; p += gridDim.x, ++n) {
            const int s = n % stages;
            if (n >= stages) mbarrier_wait(&empty[s], (n / stages - 1) & 1, "a free stage");
            const unsigned bytes = static_cast<unsigned>(min((i64)piece, nbytes - p * piece));
            bulk_load(stage_mem + s * piece, src + p * piece, bytes, &full[s]);
        }
    } else if (warp == 1) {
        u64 policy = 0;
        if (HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        int n = 0;
        for (i64 p = blockIdx.x; p < pieces; p += gridDim.x, ++n) {
            const int s = n % stages;
            mbarrier_wait(&full[s], (n / stages) & 1, "a loaded stage");
            const i64 bytes = min((i64)piece, nbytes - p * piece), tma = bulk_part(f, bytes, tma_share);
            if (lane == 0) {
                for (int d = 0; d < f && d * bytes < tma; ++d) {
                    char* dst = reinterpret_cast<char*>(__ldg(dsts + d)) + p * piece;
                    const unsigned b = static_cast<unsigned>(min(bytes, tma - d * bytes));
                    if (HINT) bulk_store_evict_first(dst, stage_mem + s * piece, b, policy);
                    else bulk_store(dst, stage_mem + s * piece, b);
                }
                bulk_commit();
                bulk_wait_read<1>();
                if (n >= 1) mbarrier_arrive(&empty[(n - 1) % stages]);
            }
        }
        if (lane == 0) bulk_wait_done<0>();
    } else if (warp >= 2) {
        const int w = warp - 2;
        int n = 0;
        for (i64 p = blockIdx.x; p < pieces; p += gridDim.x, ++n) {
            const int s = n % stages;
            mbarrier_wait(&full[s], (n / stages) & 1, "a loaded stage");
            const i64 bytes = min((i64)piece, nbytes - p * piece), tma = bulk_part(f, bytes, tma_share);
            const uint4* stage = reinterpret_cast<const uint4*>(stage_mem + s * piece);
            for (int d = static_cast<int>(tma / bytes); d < f; ++d) {
                uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<char*>(__ldg(dsts + d)) + p * piece);
                const i64 lo = max((i64)0, tma - d * bytes) / 16, hi = bytes / 16;
                i64 i = lo + w * 128 + lane;
                for (; i + 96 < hi; i += lsu_warps * 128) {
                    const uint4 a = stage[i], b = stage[i + 32], c = stage[i + 64], e = stage[i + 96];
                    dst[i] = a; dst[i + 32] = b; dst[i + 64] = c; dst[i + 96] = e;
                }
                for (; i < hi; i += 32) dst[i] = stage[i];
            }
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[s]);
        }
    }
}

template __global__ void reg_fanout<8, 0>(const uint4*, const u64*, i64, int);
template __global__ void reg_fanout<8, 1>(const uint4*, const u64*, i64, int);
template __global__ void reg_fanout<4, 0>(const uint4*, const u64*, i64, int);
template __global__ void split_fanout<8, 0, 0>(const uint4*, const u64*, i64, int, i64, int*);
template __global__ void split_fanout<8, 1, 0>(const uint4*, const u64*, i64, int, i64, int*);
template __global__ void split_fanout<8, 1, 8>(const uint4*, const u64*, i64, int, i64, int*);
template __global__ void split_fanout<8, 1, 4>(const uint4*, const u64*, i64, int, i64, int*);
template __global__ void split_fanout<16, 1, 0>(const uint4*, const u64*, i64, int, i64, int*);
template __global__ void bulk_fanout<0, 0>(const char*, const u64*, i64, int, int, int);
template __global__ void bulk_fanout<0, 1>(const char*, const u64*, i64, int, int, int);
template __global__ void bulk_fanout<1, 0>(const char*, const u64*, i64, int, int, int);
template __global__ void hybrid_fanout<0>(const char*, const u64*, i64, int, int, int, int);
template __global__ void hybrid_fanout<1>(const char*, const u64*, i64, int, int, int, int);
