// Padding-free grouped BF16 GEMM over expert-major rows: forward, dgrad and wgrad, FP32
// accumulation, BF16 or FP32 output. ultraep/compute/device.py launches them.
//
//   forward  Y[rows_e]  = X[rows_e] @ W_e          x [M, K], w [E, K, N], y  [M, N]
//   dgrad    dX[rows_e] = dY[rows_e] @ W_e^T       dy [M, N], w [E, K, N], dx [M, K]
//   wgrad    dW_e       = X[rows_e]^T @ dY[rows_e] x [M, K], dy [M, N],   dw [E, K, N]
//
// rows_e = [offsets[e], offsets[e+1]), read on the device. Every block loads the offsets,
// checks them (first 0, non-decreasing, last within the M rows) and, from the same values,
// reaches the same verdict: on a bad array no block writes anything and block 0 records
// the first bad entry in `status` for the host. Then each block builds the prefix of tiles
// per expert in shared memory and walks the tiles t = blockIdx.x, + gridDim.x, ... of one
// fixed order: expert, then n-tile, then m-tile (consecutive blocks share a weight slice).
//
// Tiles never straddle experts: a forward/dgrad tile starts at its expert's first row plus
// a multiple of GG_BM, and rows past the expert's end are loaded as zeros and not stored.
// A wgrad tile reduces over its expert's rows in GG_BK steps from the expert's first row,
// rows past the end counting as zeros (an empty expert's dW_e is all zeros).
//
// Determinism: every output element is one K-sum (forward: over K, dgrad: over N, wgrad:
// over the expert's rows) in GG_BK chunks in ascending order, each chunk two m16n8k16 MMAs
// in ascending k, with no split-K and no atomics. A row's forward/dgrad result depends only
// on its own row and the weights, never on which rows share its tile or where the expert
// starts; a wgrad result depends only on the expert's rows, not on where they start.
//
// Block tile GG_BM x GG_BN x GG_BK, eight warps of 64 x 32, operands staged by cp.async
// through a GG_STAGES-deep ring of shared-memory tiles (16-byte chunks XOR-swizzled so
// ldmatrix reads are free of bank conflicts), fragments by ldmatrix (.trans where the
// operand's reduction dimension is not the contiguous one), mma.sync BF16 -> FP32.
//
//! kernels: grouped_mm_forward<__nv_bfloat16>, grouped_mm_forward<float>
//! kernels: grouped_mm_dgrad<__nv_bfloat16>, grouped_mm_dgrad<float>
//! kernels: grouped_mm_wgrad<__nv_bfloat16>, grouped_mm_wgrad<float>

#include <cuda_bf16.h>

#define GG_BM 128
#define GG_BN 128
#define GG_BK 32
#define GG_STAGES 4
#define GG_THREADS 256
#define GG_BLOCKS_PER_SM 2
#define GG_MAX_EXPERTS 1024
// K and N must be multiples of this (rows of whole 16-byte chunks for cp.async).
#define GG_ALIGN_ELEMENTS 8
#define GG_TILE_BYTES (GG_BM * GG_BK * 2)
#define GG_SMEM_BYTES (GG_STAGES * 2 * GG_TILE_BYTES)

// status[0] codes (ultraep/compute/grouped_gemm.py words them); status[1..3] = index, value, rows.
#define GG_OK 0
#define GG_FIRST_OFFSET_NOT_ZERO 1
#define GG_OFFSETS_DECREASE 2
#define GG_OFFSETS_PAST_ROWS 3

#define GG_FORWARD 0
#define GG_DGRAD 1
#define GG_WGRAD 2

#define WARP 32
#define FULL_MASK 0xffffffffu

typedef __nv_bfloat16 bf16;

static_assert(GG_BM == GG_BN, "A and B stage tiles share one size");
static_assert(GG_BM == 128 && GG_BN == 128 && GG_BK == 32 && GG_THREADS == 256,
              "the warp layout, loaders and swizzles below are written for 128 x 128 x 32 with 8 warps");

// -- PTX wrappers ------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; src_bytes = 0 fills the chunk with zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// -- Shared-memory tiles -------------------------------------------------------------------
// A stage tile is ROWS x COLS bf16 with COLS contiguous: 128 x 32 ("wide" rows of 4 chunks)
// or 32 x 128 (rows of 16 chunks). Chunks are placed in 128-byte lines of 8 with the chunk
// index XORed by a row-dependent value, so the 8 row addresses of one ldmatrix (8
// consecutive rows, one chunk column) fall in 8 different bank groups.

template <int COLS>
__device__ __forceinline__ unsigned chunk_offset(int row, int chunk) {
    if constexpr (COLS == 32) {
        const int line = row >> 1;
        return (line * 8 + ((((row & 1) << 2) | chunk) ^ (line & 7))) * 16;
    } else {
        static_assert(COLS == 128, "tiles are 128 x 32 or 32 x 128");
        return ((row * 2 + (chunk >> 3)) * 8 + ((chunk & 7) ^ (row & 7))) * 16;
    }
}

// Stage rows [row0, row0 + ROWS) x columns [col0, col0 + COLS) of a row-major matrix with
// leading dimension ld; rows at or past row_end and columns at or past col_end as zeros.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(unsigned tile, const bf16* g, int ld, int row0, int row_end, int col0,
                                          int col_end) {
    constexpr int CHUNKS_PER_ROW = COLS / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % GG_THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int j = 0; j < CHUNKS / GG_THREADS; ++j) {
        const int i = threadIdx.x + j * GG_THREADS;
        const int r = i / CHUNKS_PER_ROW, c = i % CHUNKS_PER_ROW;
        const int row = row0 + r, col = col0 + c * 8;
        const bool inside = row < row_end && col < col_end;
        const bf16* src = inside ? g + static_cast<long long>(row) * ld + col : g;
        cp_async_16(tile + chunk_offset<COLS>(r, c), src, inside ? 16 : 0);
    }
}

// -- The three problems as one tile engine -------------------------------------------------
// A is the [out rows x reduction] operand, B the [reduction x out cols] one. A_ROWS_BY_RED:
// A is stored [out row][reduction] (x, dy in forward/dgrad), else [reduction][out row]
// (x in wgrad). B_COLS_BY_RED: B is stored [out col][reduction] (w in dgrad), else
// [reduction][out col] (w in forward, dy in wgrad).

template <int MODE>
struct Layout {
    static constexpr bool A_ROWS_BY_RED = MODE != GG_WGRAD;
    static constexpr bool B_COLS_BY_RED = MODE == GG_DGRAD;
};

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

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <typename OutT>
__device__ __forceinline__ void store_fragment(OutT* out, int row, int row_end, int col, int cols, float v0,
                                               float v1) {
    if (row >= row_end || col >= cols) return;  // cols is a multiple of 8 and col even: col + 1 < cols too
    OutT* p = out + static_cast<long long>(row) * cols + col;
    if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    } else {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
    }
}

// a, b as in the table at the top (forward: x, w; dgrad: dy, w; wgrad: x, dy).
template <int MODE, typename OutT>
__device__ __forceinline__ void grouped_mm(const bf16* a, const bf16* b, const void* offsets, int offsets_are_64bit,
                                           int experts, long long rows, int K, int N, OutT* out, long long* status) {
    extern __shared__ __align__(128) unsigned char stages[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    __shared__ int tile_start[GG_MAX_EXPERTS + 1];
    using L = Layout<MODE>;
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;

    // Offsets: loaded and checked by every block alike. Values in [0, rows] fit an int (the
    // host keeps rows below 2^31), so the tile arithmetic below is 32-bit.
    bool bad = false;
    for (int i = tid; i <= experts; i += GG_THREADS) {
        const long long v = offset_at(offsets, offsets_are_64bit, i);
        bad |= v < 0 || v > rows;
        off[i] = static_cast<int>(v);
    }
    __syncthreads();
    for (int i = tid; i <= experts; i += GG_THREADS) bad |= i == 0 ? off[0] != 0 : off[i] < off[i - 1];
    if (__syncthreads_or(bad)) {
        if (blockIdx.x == 0 && tid == 0) report_offsets(offsets, offsets_are_64bit, experts, rows, status);
        return;
    }

    // Output columns, reduction length (forward/dgrad) and tiles per expert.
    const int out_cols = MODE == GG_DGRAD ? K : N;
    const int n_tiles = ceil_div(out_cols, GG_BN);
    const int wgrad_m_tiles = ceil_div(K, GG_BM);
    if constexpr (MODE != GG_WGRAD) {
        if (warp == 0) {  // exclusive prefix of m-tiles x n-tiles over the experts
            const int per_lane = (experts + WARP - 1) / WARP;
            const int first = min(lane * per_lane, experts), last = min(first + per_lane, experts);
            int sum = 0;
            for (int e = first; e < last; ++e) sum += ceil_div(off[e + 1] - off[e], GG_BM) * n_tiles;
            int inclusive = sum;
#pragma unroll
            for (int d = 1; d < WARP; d *= 2) {
                const int v = __shfl_up_sync(FULL_MASK, inclusive, d);
                if (lane >= d) inclusive += v;
            }
            int running = inclusive - sum;
            for (int e = first; e < last; ++e) {
                tile_start[e] = running;
                running += ceil_div(off[e + 1] - off[e], GG_BM) * n_tiles;
            }
            if (lane == WARP - 1) tile_start[experts] = inclusive;
        }
        __syncthreads();
    }
    int tiles;
    if constexpr (MODE == GG_WGRAD) tiles = experts * wgrad_m_tiles * n_tiles;
    else tiles = tile_start[experts];

    const unsigned stage0 = smem_u32(stages);
    const int warp_m = (warp & 1) * 64, warp_n = (warp >> 1) * 32;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        // Which expert, m-tile and n-tile (m fastest).
        int e, local, m_tiles;
        if constexpr (MODE == GG_WGRAD) {
            m_tiles = wgrad_m_tiles;
            e = tile / (m_tiles * n_tiles);
            local = tile - e * m_tiles * n_tiles;
        } else {
            int lo = 0, hi = experts - 1;  // the last expert whose first tile is <= tile
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
            }
            e = lo;
            m_tiles = ceil_div(off[e + 1] - off[e], GG_BM);
            local = tile - tile_start[e];
        }
        const int m_tile = local % m_tiles, n_tile = local / m_tiles;
        const int col0 = n_tile * GG_BN;
        // Output rows [row0, row_end) of `out`; the reduction runs over [red0, red_end).
        int row0, row_end, red0, red_end;
        if constexpr (MODE == GG_WGRAD) {
            row0 = m_tile * GG_BM, row_end = K;
            red0 = off[e], red_end = off[e + 1];
        } else {
            row0 = off[e] + m_tile * GG_BM, row_end = off[e + 1];
            red0 = 0, red_end = MODE == GG_FORWARD ? K : N;
        }
        const int k_tiles = ceil_div(red_end - red0, GG_BK);
        const bf16* b_tile = MODE == GG_WGRAD ? b : b + static_cast<long long>(e) * K * N;

        auto load_stage = [&](int kt) {
            const unsigned sa = stage0 + (kt % GG_STAGES) * 2 * GG_TILE_BYTES, sb = sa + GG_TILE_BYTES;
            const int r = red0 + kt * GG_BK;
            if constexpr (MODE == GG_FORWARD) {
                load_tile<GG_BM, GG_BK>(sa, a, K, row0, row_end, r, K);
                load_tile<GG_BK, GG_BN>(sb, b_tile, N, r, K, col0, N);
            } else if constexpr (MODE == GG_DGRAD) {
                load_tile<GG_BM, GG_BK>(sa, a, N, row0, row_end, r, N);
                load_tile<GG_BN, GG_BK>(sb, b_tile, N, col0, K, r, N);
            } else {
                load_tile<GG_BK, GG_BM>(sa, a, K, r, red_end, row0, K);
                load_tile<GG_BK, GG_BN>(sb, b_tile, N, r, red_end, col0, N);
            }
        };

        float acc[4][4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

        // Pipeline: GG_STAGES - 1 chunks in flight; one commit group per chunk (empty past the end).
#pragma unroll
        for (int s = 0; s < GG_STAGES - 1; ++s) {
            if (s < k_tiles) load_stage(s);
            cp_async_commit();
        }
        for (int kt = 0; kt < k_tiles; ++kt) {
            cp_async_wait<GG_STAGES - 2>();
            __syncthreads();  // chunk kt visible to all; every warp is done with chunk kt - 1
            if (kt + GG_STAGES - 1 < k_tiles) load_stage(kt + GG_STAGES - 1);
            cp_async_commit();

            const unsigned sa = stage0 + (kt % GG_STAGES) * 2 * GG_TILE_BYTES, sb = sa + GG_TILE_BYTES;
#pragma unroll
            for (int ks = 0; ks < GG_BK / 16; ++ks) {
                unsigned fa[4][4], fb[4][2];
#pragma unroll
                for (int mi = 0; mi < 4; ++mi) {
                    const int m = warp_m + mi * 16;
                    if constexpr (L::A_ROWS_BY_RED) {  // [m][k]: lanes 0-15 rows, lanes 16-31 the upper 8 k
                        ldmatrix_x4(fa[mi], sa + chunk_offset<GG_BK>(m + (lane & 15), ks * 2 + (lane >> 4)));
                    } else {                 // [k][m]: matrices (k lo, m lo), (k lo, m hi), (k hi, m lo), (k hi, m hi)
                        const int q = lane >> 3;
                        ldmatrix_x4_trans(fa[mi], sa + chunk_offset<GG_BM>(ks * 16 + (lane & 7) + ((q >> 1) << 3),
                                                                           (m >> 3) + (q & 1)));
                    }
                }
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int n = warp_n + p * 16, q = lane >> 3;
                    unsigned r[4];
                    if constexpr (L::B_COLS_BY_RED) {  // [n][k]: matrices (n lo, k lo), (n lo, k hi), (n hi, k lo), (n hi, k hi)
                        ldmatrix_x4(r, sb + chunk_offset<GG_BK>(n + (lane & 7) + ((q >> 1) << 3), ks * 2 + (q & 1)));
                    } else {                 // [k][n]: the same four matrices, stored transposed
                        ldmatrix_x4_trans(r, sb + chunk_offset<GG_BN>(ks * 16 + (lane & 7) + ((q & 1) << 3),
                                                                      (n >> 3) + (q >> 1)));
                    }
                    fb[2 * p][0] = r[0], fb[2 * p][1] = r[1], fb[2 * p + 1][0] = r[2], fb[2 * p + 1][1] = r[3];
                }
#pragma unroll
                for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], fa[mi], fb[ni][0], fb[ni][1]);
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next tile's prologue overwrites stages other warps may still read

        // Epilogue straight from the accumulators: rows past the expert (or K) are not stored.
        OutT* out_tile = MODE == GG_WGRAD ? out + static_cast<long long>(e) * K * N : out;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int row = row0 + warp_m + mi * 16 + g;
                const int col = col0 + warp_n + ni * 8 + 2 * t;
                store_fragment(out_tile, row, row_end, col, out_cols, acc[mi][ni][0], acc[mi][ni][1]);
                store_fragment(out_tile, row + 8, row_end, col, out_cols, acc[mi][ni][2], acc[mi][ni][3]);
            }
    }
}

template <typename OutT>
__global__ void __launch_bounds__(GG_THREADS, GG_BLOCKS_PER_SM)
grouped_mm_forward(const bf16* x, const bf16* w, const void* offsets, int offsets_are_64bit, int experts,
                   long long rows, int K, int N, OutT* y, long long* status) {
    grouped_mm<GG_FORWARD, OutT>(x, w, offsets, offsets_are_64bit, experts, rows, K, N, y, status);
}

template <typename OutT>
__global__ void __launch_bounds__(GG_THREADS, GG_BLOCKS_PER_SM)
grouped_mm_dgrad(const bf16* dy, const bf16* w, const void* offsets, int offsets_are_64bit, int experts,
                 long long rows, int K, int N, OutT* dx, long long* status) {
    grouped_mm<GG_DGRAD, OutT>(dy, w, offsets, offsets_are_64bit, experts, rows, K, N, dx, status);
}

template <typename OutT>
__global__ void __launch_bounds__(GG_THREADS, GG_BLOCKS_PER_SM)
grouped_mm_wgrad(const bf16* x, const bf16* dy, const void* offsets, int offsets_are_64bit, int experts,
                 long long rows, int K, int N, OutT* dw, long long* status) {
    grouped_mm<GG_WGRAD, OutT>(x, dy, offsets, offsets_are_64bit, experts, rows, K, N, dw, status);
}

template __global__ void grouped_mm_forward<bf16>(const bf16*, const bf16*, const void*, int, int, long long, int,
                                                  int, bf16*, long long*);
template __global__ void grouped_mm_forward<float>(const bf16*, const bf16*, const void*, int, int, long long, int,
                                                   int, float*, long long*);
template __global__ void grouped_mm_dgrad<bf16>(const bf16*, const bf16*, const void*, int, int, long long, int, int,
                                                bf16*, long long*);
template __global__ void grouped_mm_dgrad<float>(const bf16*, const bf16*, const void*, int, int, long long, int,
                                                 int, float*, long long*);
template __global__ void grouped_mm_wgrad<bf16>(const bf16*, const bf16*, const void*, int, int, long long, int, int,
                                                bf16*, long long*);
template __global__ void grouped_mm_wgrad<float>(const bf16*, const bf16*, const void*, int, int, long long, int,
                                                 int, float*, long long*);
