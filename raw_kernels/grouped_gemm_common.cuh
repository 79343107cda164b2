// What every grouped GEMM kernel shares: the input contract's limits, the bad-offsets
// codes the host words (ultraep/compute/checks.py), and the device-side reading of the
// expert offsets: loaded and checked by every block alike, then a prefix of tiles per
// expert that a persistent block walks in one fixed order.
#pragma once

#define GG_MAX_EXPERTS 1024
// K and N must be multiples of this: rows of whole 16-byte chunks (cp.async, and TMA's
// global strides).
#define GG_ALIGN_ELEMENTS 8

// status[0] codes (ultraep/compute/grouped_gemm.py words them); status[1..3] = index, value, rows.
#define GG_OK 0
#define GG_FIRST_OFFSET_NOT_ZERO 1
#define GG_OFFSETS_DECREASE 2
#define GG_OFFSETS_PAST_ROWS 3

#define WARP 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ long long offset_at(const void* offsets, int offsets_are_64bit, int i) {
    return offsets_are_64bit ? static_cast<const long long*>(offsets)[i] : static_cast<const int*>(offsets)[i];
}

// Block 0 records the first bad entry, read again from global memory at full width (the
// host checks status after the stream's work).
__device__ void report_offsets(const void* offsets, int offsets_are_64bit, int experts, long long rows,
                               long long* status) {
    long long code = GG_OK, index = 0, previous = 0;
    for (int i = 0; i <= experts && code == GG_OK; ++i) {
        const long long v = offset_at(offsets, offsets_are_64bit, i);
        if (i == 0 && v != 0) code = GG_FIRST_OFFSET_NOT_ZERO;
        else if (v < previous) code = GG_OFFSETS_DECREASE;
        else if (v > rows) code = GG_OFFSETS_PAST_ROWS;
        index = i, previous = v;
    }
    unsigned long long* word = reinterpret_cast<unsigned long long*>(status);
    if (code != GG_OK && atomicCAS(word, 0ull, static_cast<unsigned long long>(code)) == 0ull) {  // the first error is kept
        status[1] = index;
        status[2] = previous;
        status[3] = rows;
    }
}

// The offsets into shared `off` (all threads of the block call this). Every block reaches
// the same verdict from the same values: false on a bad array (block 0 has then recorded
// it), and the caller must write nothing. Values in [0, rows] fit an int (the host keeps
// rows below 2^31), so the tile arithmetic is 32-bit.
__device__ bool load_offsets(int* off, const void* offsets, int offsets_are_64bit, int experts, long long rows,
                             long long* status) {
    bool bad = false;
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) {
        const long long v = offset_at(offsets, offsets_are_64bit, i);
        bad |= v < 0 || v > rows;
        off[i] = static_cast<int>(v);
    }
    __syncthreads();
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) bad |= i == 0 ? off[0] != 0 : off[i] < off[i - 1];
    if (__syncthreads_or(bad)) {
        if (blockIdx.x == 0 && threadIdx.x == 0) report_offsets(offsets, offsets_are_64bit, experts, rows, status);
        return false;
    }
    return true;
}

// Warp 0: tile_start[e] = tiles of the experts before e (m-tiles of `block_rows` rows times
// `n_tiles`), tile_start[experts] = all tiles. The caller synchronises before reading it.
__device__ void tile_prefix(int* tile_start, const int* off, int experts, int block_rows, int n_tiles) {
    const int lane = threadIdx.x % WARP;
    const int per_lane = (experts + WARP - 1) / WARP;
    const int first = min(lane * per_lane, experts), last = min(first + per_lane, experts);
    int sum = 0;
    for (int e = first; e < last; ++e) sum += ceil_div(off[e + 1] - off[e], block_rows) * n_tiles;
    int inclusive = sum;
#pragma unroll
    for (int d = 1; d < WARP; d *= 2) {
        const int v = __shfl_up_sync(FULL_MASK, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    int running = inclusive - sum;
    for (int e = first; e < last; ++e) {
        tile_start[e] = running;
        running += ceil_div(off[e + 1] - off[e], block_rows) * n_tiles;
    }
    if (lane == WARP - 1) tile_start[experts] = inclusive;
}

// The expert that owns tile `tile`: the last e whose first tile is <= tile.
__device__ __forceinline__ int expert_of_tile(const int* tile_start, int experts, int tile) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    return lo;
}
