// Padding-free grouped BF16 GEMM, weight gradient (mma.sync; forward and dgrad are the
// Hopper kernels of grouped_gemm_sm90.cu), FP32 accumulation, BF16 or FP32 output.
// ultraep/compute/device.py launches it.
//
//   wgrad    dW_e       = X[rows_e]^T @ dY[rows_e] x [M, K], dy [M, N],   dw [E, K, N]
//
// rows_e = [offsets[e], offsets[e+1]), read and checked on the device by every block
// (grouped_gemm_common.cuh): on a bad array no block writes anything and block 0 records
// the first bad entry in `status` for the host. Each block walks the tiles t = blockIdx.x,
// + gridDim.x, ... of one fixed order: expert, then n-tile, then m-tile.
//
// A tile reduces over its expert's rows in GG_BK steps from the expert's first row, rows
// past the end counting as zeros (an empty expert's dW_e is all zeros).
//
// Determinism: every output element is one sum over the expert's rows in GG_BK chunks in
// ascending order, each chunk two m16n8k16 MMAs in ascending k, with no split and no
// atomics; it depends only on the expert's rows, not on where they start.
//
// Block tile GG_BM x GG_BN x GG_BK, eight warps of 64 x 32, operands staged by cp.async
// through a GG_STAGES-deep ring of shared-memory tiles (16-byte chunks XOR-swizzled so
// ldmatrix reads are free of bank conflicts), fragments by ldmatrix.trans (the reduction
// dimension is the strided one of both operands), mma.sync BF16 -> FP32.
//
//! kernels: grouped_mm_wgrad<__nv_bfloat16>, grouped_mm_wgrad<float>

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"

#define GG_BM 128
#define GG_BN 128
#define GG_BK 32
#define GG_STAGES 4
#define GG_THREADS 256
#define GG_BLOCKS_PER_SM 2
#define GG_TILE_BYTES (GG_BM * GG_BK * 2)
#define GG_SMEM_BYTES (GG_STAGES * 2 * GG_TILE_BYTES)

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
// A stage tile is GG_BK x 128 bf16, rows of 16 contiguous 16-byte chunks. Chunks are placed
// in 128-byte lines of 8 with the chunk index XORed by the row, so the 8 row addresses of
// one ldmatrix (8 consecutive rows, one chunk column) fall in 8 different bank groups.

__device__ __forceinline__ unsigned chunk_offset(int row, int chunk) {
    return ((row * 2 + (chunk >> 3)) * 8 + ((chunk & 7) ^ (row & 7))) * 16;
}

// Stage rows [row0, row0 + GG_BK) x columns [col0, col0 + 128) of a row-major matrix with
// leading dimension ld; rows at or past row_end and columns at or past col_end as zeros.
__device__ __forceinline__ void load_tile(unsigned tile, const bf16* g, int ld, int row0, int row_end, int col0,
                                          int col_end) {
    constexpr int CHUNKS_PER_ROW = 128 / 8;
    constexpr int CHUNKS = GG_BK * CHUNKS_PER_ROW;
    static_assert(CHUNKS % GG_THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int j = 0; j < CHUNKS / GG_THREADS; ++j) {
        const int i = threadIdx.x + j * GG_THREADS;
        const int r = i / CHUNKS_PER_ROW, c = i % CHUNKS_PER_ROW;
        const int row = row0 + r, col = col0 + c * 8;
        const bool inside = row < row_end && col < col_end;
        const bf16* src = inside ? g + static_cast<long long>(row) * ld + col : g;
        cp_async_16(tile + chunk_offset(r, c), src, inside ? 16 : 0);
    }
}

// -- The tile loop ----------------------------------------------------------------------------

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

// A = x [rows][K] read as [reduction][out row], B = dy [rows][N] as [reduction][out col].
template <typename OutT>
__global__ void __launch_bounds__(GG_THREADS, GG_BLOCKS_PER_SM)
grouped_mm_wgrad(const bf16* x, const bf16* dy, const void* offsets, int offsets_are_64bit, int experts,
                 long long rows, int K, int N, OutT* dw, long long* status) {
    extern __shared__ __align__(128) unsigned char stages[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    if (!load_offsets(off, offsets, offsets_are_64bit, experts, rows, status)) return;

    const int n_tiles = ceil_div(N, GG_BN), m_tiles = ceil_div(K, GG_BM);
    const int tiles = experts * m_tiles * n_tiles;
    const unsigned stage0 = smem_u32(stages);
    const int warp_m = (warp & 1) * 64, warp_n = (warp >> 1) * 32;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        // Which expert, m-tile and n-tile (m fastest).
        const int e = tile / (m_tiles * n_tiles), local = tile - e * m_tiles * n_tiles;
        const int row0 = (local % m_tiles) * GG_BM, col0 = (local / m_tiles) * GG_BN;
        const int red0 = off[e], red_end = off[e + 1];
        const int k_tiles = ceil_div(red_end - red0, GG_BK);

        auto load_stage = [&](int kt) {
            const unsigned sa = stage0 + (kt % GG_STAGES) * 2 * GG_TILE_BYTES, sb = sa + GG_TILE_BYTES;
            const int r = red0 + kt * GG_BK;
            load_tile(sa, x, K, r, red_end, row0, K);
            load_tile(sb, dy, N, r, red_end, col0, N);
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
                const int q = lane >> 3;
#pragma unroll
                for (int mi = 0; mi < 4; ++mi) {  // [k][m]: matrices (k lo, m lo), (k lo, m hi), (k hi, m lo), (k hi, m hi)
                    const int m = warp_m + mi * 16;
                    ldmatrix_x4_trans(fa[mi], sa + chunk_offset(ks * 16 + (lane & 7) + ((q >> 1) << 3),
                                                                       (m >> 3) + (q & 1)));
                }
#pragma unroll
                for (int p = 0; p < 2; ++p) {  // [k][n]: matrices (n lo, k lo), (n lo, k hi), (n hi, k lo), (n hi, k hi)
                    const int n = warp_n + p * 16;
                    unsigned r[4];
                    ldmatrix_x4_trans(r, sb + chunk_offset(ks * 16 + (lane & 7) + ((q & 1) << 3),
                                                                  (n >> 3) + (q >> 1)));
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

        // Epilogue straight from the accumulators: rows past K are not stored.
        OutT* out_tile = dw + static_cast<long long>(e) * K * N;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int row = row0 + warp_m + mi * 16 + g;
                const int col = col0 + warp_n + ni * 8 + 2 * t;
                store_fragment(out_tile, row, K, col, N, acc[mi][ni][0], acc[mi][ni][1]);
                store_fragment(out_tile, row + 8, K, col, N, acc[mi][ni][2], acc[mi][ni][3]);
            }
    }
}

template __global__ void grouped_mm_wgrad<bf16>(const bf16*, const bf16*, const void*, int, int, long long, int, int,
                                                bf16*, long long*);
template __global__ void grouped_mm_wgrad<float>(const bf16*, const bf16*, const void*, int, int, long long, int,
                                                 int, float*, long long*);
