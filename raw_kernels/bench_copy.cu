// Benchmark reference: the weight-sync copy pattern without its task tables. `nbytes` from
// one contiguous source to every destination, by the pieces of piece_copy.cuh: warp w of W
// takes pieces w, w + W, ..., prefetches its next whole piece into L2 and stores each piece
// to every destination, as weight_sync does, but with one pointer table instead of task
// rows, tensor look-ups and chunk flags. `python -m ultraep.bench weight-sync` times it
// beside the sync, into the same replica slots: what the device gives this copy pattern.
//
//! kernels: fanout_copy

#include "piece_copy.cuh"

#define COPY_WARPS 8        // warps per block the launcher uses (any number of whole warps works)
#define COPY_THREADS (32 * COPY_WARPS)
#define COPY_MAX_DESTS 128  // host-checked

// Destinations must be 16-byte aligned (host-checked); a source that is not is copied byte
// by byte. Blocks of whole warps, at most COPY_THREADS threads.
extern "C" __global__ void __launch_bounds__(COPY_THREADS, 4)
fanout_copy(const unsigned char* src, const u64* dest_ptrs, int num_dests, i64 nbytes) {
    __shared__ unsigned char* dst[COPY_MAX_DESTS];
    for (int d = threadIdx.x; d < num_dests; d += blockDim.x)
        dst[d] = reinterpret_cast<unsigned char*>(__ldg(dest_ptrs + d));
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const bool aligned = reinterpret_cast<u64>(src) % 16 == 0;
    const int block_warps = blockDim.x / 32;
    const i64 pieces = (nbytes + PIECE_BYTES - 1) / PIECE_BYTES, warps = static_cast<i64>(gridDim.x) * block_warps;
    for (i64 p = static_cast<i64>(blockIdx.x) * block_warps + threadIdx.x / 32; p < pieces; p += warps) {
        const i64 offset = p * PIECE_BYTES, next = offset + warps * PIECE_BYTES;
        prefetch_piece_l2(aligned && next + PIECE_BYTES <= nbytes ? src + next : nullptr, lane);
        const int length = static_cast<int>(min(static_cast<i64>(PIECE_BYTES), nbytes - offset));
        if (aligned && length == PIECE_BYTES) {
            uint4 v[PIECE_VECS];
            load_piece(src + offset, v, lane);
            store_whole_piece(dst, num_dests, offset, v, lane);
        } else {
            copy_partial_piece(src + offset, dst, num_dests, offset, length, lane);
        }
    }
}
