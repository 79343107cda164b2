// A warp's piece: PIECE_BYTES loaded once into registers and stored to every destination,
// the unit of the weight-sync copies (transfer.cu) and of their task-free reference
// (bench_copy.cu). A lane holds vectors lane + 32 u of its piece.
#pragma once

#include "sync.cuh"

typedef long long i64;

#define PIECE_VECS 4            // 16-byte vectors per lane in one piece
#define PIECE_BYTES (32 * 16 * PIECE_VECS)  // what a warp holds in registers and stores to every destination

// A whole piece (the lane's vectors lane + 32 u), stored to F destinations (F < 0: -F known
// only at run time). Streaming stores: the replicas are not read again by this kernel.
template <int F>
__device__ __forceinline__ void store_piece(unsigned char* const* dst, int num_dests, i64 within,
                                            const uint4 (&v)[PIECE_VECS], int lane) {
    const int count = F > 0 ? F : num_dests;
#pragma unroll(F > 0 ? F : 1)
    for (int d = 0; d < count; ++d) {
        uint4* out = reinterpret_cast<uint4*>(dst[d] + within) + lane;
#pragma unroll
        for (int u = 0; u < PIECE_VECS; ++u) __stcs(out + 32 * u, v[u]);
    }
}

// A whole piece into registers: the lane's vectors lane + 32 u.
__device__ __forceinline__ void load_piece(const unsigned char* src, uint4 (&v)[PIECE_VECS], int lane) {
    const uint4* in = reinterpret_cast<const uint4*>(src) + lane;
#pragma unroll
    for (int u = 0; u < PIECE_VECS; ++u) v[u] = __ldcs(in + 32 * u);
}

__device__ __forceinline__ void store_whole_piece(unsigned char* const* dst, int num_dests, i64 within,
                                                  const uint4 (&v)[PIECE_VECS], int lane) {
    switch (num_dests) {  // fan-outs up to 8 with their stores unrolled
        case 1: store_piece<1>(dst, 1, within, v, lane); break;
        case 2: store_piece<2>(dst, 2, within, v, lane); break;
        case 3: store_piece<3>(dst, 3, within, v, lane); break;
        case 4: store_piece<4>(dst, 4, within, v, lane); break;
        case 5: store_piece<5>(dst, 5, within, v, lane); break;
        case 6: store_piece<6>(dst, 6, within, v, lane); break;
        case 7: store_piece<7>(dst, 7, within, v, lane); break;
        case 8: store_piece<8>(dst, 8, within, v, lane); break;
        default: store_piece<-1>(dst, num_dests, within, v, lane);
    }
}

// A piece that is not whole (a tensor's short last piece) or not 16-byte aligned: vector by
// vector where aligned, then byte by byte.
__device__ void copy_partial_piece(const unsigned char* src, unsigned char* const* dst, int num_dests, i64 within,
                                   int nbytes, int lane) {
    const int vecs = (reinterpret_cast<u64>(src) | static_cast<u64>(within)) % 16 ? 0 : nbytes / 16;
    for (int i = lane; i < vecs; i += 32) {
        const uint4 v = __ldcs(reinterpret_cast<const uint4*>(src) + i);
        for (int d = 0; d < num_dests; ++d) __stcs(reinterpret_cast<uint4*>(dst[d] + within) + i, v);
    }
    for (int b = 16 * vecs + lane; b < nbytes; b += 32) {
        const unsigned char byte = __ldcs(src + b);
        for (int d = 0; d < num_dests; ++d) dst[d][within + b] = byte;
    }
}

// Starts bringing `bytes` (a multiple of 16, from a 16-byte aligned address) into L2: the SM's
// bulk-copy (TMA) unit fetches them, no registers wait for them.
__device__ __forceinline__ void prefetch_l2(const void* from, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(from), "r"(bytes) : "memory");
}

// Lane 0 prefetches a whole piece (if any: null for none).
__device__ __forceinline__ void prefetch_piece_l2(const unsigned char* piece, int lane) {
    if (lane == 0 && piece != nullptr && reinterpret_cast<u64>(piece) % 16 == 0) prefetch_l2(piece, PIECE_BYTES);
}
