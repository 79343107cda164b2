// Padding-free grouped BF16 GEMM over expert-major rows for Hopper (sm_90a): forward,
// dgrad and wgrad, FP32 accumulation, BF16 or FP32 output. ultraep/compute/device.py
// launches them (compiled with -arch=sm_90a: wgmma and setmaxnreg exist only there).
//
//   forward  Y[rows_e]  = X[rows_e] @ W_e          x [M, K], w [E, K, N], y  [M, N]
//   dgrad    dX[rows_e] = dY[rows_e] @ W_e^T       dy [M, N], w [E, K, N], dx [M, K]
//   wgrad    dW_e       = X[rows_e]^T @ dY[rows_e] x [M, K], dy [M, N],   dw [E, K, N]
//
// rows_e = [offsets[e], offsets[e+1]), read and checked on the device by every block
// (grouped_gemm_common.cuh): on a bad array no block writes anything. One persistent
// block per SM walks the tiles t = blockIdx.x, + gridDim.x, ... of one fixed order:
// expert, then groups of 8 m-tiles, every n-tile of a group (grouped_raster), so the blocks
// running at once share a few m-side tiles and an n-side slice in L2.
//
// A block is three warpgroups. In warpgroup 0, which gives most of its registers away
// (setmaxnreg), one thread is the producer: it copies the operand tiles of each k-step by
// TMA (tensor maps encoded on the host, 128-byte swizzle) into a GH_STAGES-deep ring of
// shared-memory stages, each with a "full" mbarrier (TMA bytes arrive) and an "empty" one
// (the consumers are done); its three other warps store BF16 output tiles that the
// consumers staged in shared memory, while the consumers go on with the next tile.
// Warpgroups 1 and 2 are the consumers: each owns 64 rows x GH_BN columns of the
// GH_BM x GH_BN tile and multiplies with wgmma.mma_async m64n256k16 straight from the
// swizzled stages, one k-step of MMAs in flight. FP32 output is stored by the consumers.
//
// Forward/dgrad tiles never straddle experts, and the input is not padded: a tile starts
// at its expert's first row plus a multiple of GH_BM; rows past the expert's end are loaded
// (the next expert's rows, or zeros past the tensor) but never stored, and a row's
// accumulators depend on its own row of A only. A wgrad tile is GH_BM rows of K by GH_BN
// columns of N of one expert, reduced over the expert's rows from its first in GH_BK
// chunks; in the last chunk, rows past the expert's end are cleared in shared memory
// before the MMAs (an empty expert's dW_e is all zeros). Columns past the output's and
// the reduction past its end (K or N) are zeros filled in by TMA.
//
// Determinism: every output element is one sum in GH_BK chunks in ascending order, each
// chunk four k16 MMAs in ascending k, with no split-K and no atomics. A row's forward or
// dgrad result depends only on its own row and the weights, never on which rows share its
// tile or where its expert starts; a dW_e only on the expert's rows, not where they start.
//
//! kernels: grouped_mm_forward<__nv_bfloat16>, grouped_mm_forward<float>
//! kernels: grouped_mm_dgrad<__nv_bfloat16>, grouped_mm_dgrad<float>
//! kernels: grouped_mm_wgrad<__nv_bfloat16>, grouped_mm_wgrad<float>
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"

// -- The tile loop ----------------------------------------------------------------------------

// The operands as grouped_gemm_common.cuh describes them (load_tile).
template <int MODE, typename OutT>
__device__ __forceinline__ void grouped_mm(const TensorMap* a_map, const TensorMap* b_map, const void* offsets,
                                           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out,
                                           long long* status) {
    constexpr bool STAGED_OUTPUT = sizeof(OutT) == 2;  // FP32 tiles do not fit beside the stages: stored directly
    constexpr bool A_BOXES = MODE == GH_WGRAD, B_BOXES = MODE != GH_DGRAD;
    extern __shared__ unsigned char dynamic_shared[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    __shared__ int tile_start[GG_MAX_EXPERTS + 1];
    __shared__ u64 full[GH_STAGES], empty[GH_STAGES], output_full, output_empty;

    if (!load_offsets(off, offsets, offsets_are_64bit, experts, rows, status)) return;
    const int out_cols = MODE == GH_DGRAD ? K : N;
    const int n_tiles = ceil_div(out_cols, GH_BN);
    const int wgrad_m_tiles = ceil_div(K, GH_BM);
    if (MODE != GH_WGRAD && threadIdx.x < WARP) tile_prefix(tile_start, off, experts, GH_BM, n_tiles);
    if (threadIdx.x == 0) {
        for (int s = 0; s < GH_STAGES; ++s) {
            mbarrier_init(&full[s], 1);                  // the producer's expect_tx arrival
            mbarrier_init(&empty[s], GH_CONSUMERS * 4);  // one arrival per consumer warp
        }
        mbarrier_init(&output_full, GH_CONSUMERS * 4);
        mbarrier_init(&output_empty, GH_STORE_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int tiles = MODE == GH_WGRAD ? experts * wgrad_m_tiles * n_tiles : tile_start[experts];
    const unsigned stages = (shared_address(dynamic_shared) + 1023) & ~1023u;
    const unsigned staged = stages + GH_STAGES * GH_STAGE_BYTES;  // the BF16 output tile

    // Tile t: its expert, then (m, n) of the expert's tiles in grouped_raster's order.
    auto tile_at = [&](int t) {
        if constexpr (MODE == GH_WGRAD) {
            const int e = t / (wgrad_m_tiles * n_tiles);
            const int2 mn = grouped_raster(t - e * wgrad_m_tiles * n_tiles, wgrad_m_tiles, n_tiles);
            return Tile{e, mn.x * GH_BM, K, mn.y * GH_BN, off[e], off[e + 1] - off[e]};
        } else {
            const int e = expert_of_tile(tile_start, experts, t);
            const int2 mn = grouped_raster(t - tile_start[e], ceil_div(off[e + 1] - off[e], GH_BM), n_tiles);
            return Tile{e, off[e] + mn.x * GH_BM, off[e + 1], mn.y * GH_BN, 0, MODE == GH_FORWARD ? K : N};
        }
    };

    const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / WARP) % 4, lane = threadIdx.x % WARP;
    bool gave_up = false;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(GH_PRODUCER_REGISTERS));
        if (warp == 0) {
            if (lane != 0) return;
            int step = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const Tile tile = tile_at(t);
                const int a_boxes = A_BOXES ? min(GH_BM / GH_BOX, ceil_div(K - tile.row0, GH_BOX)) : 1;
                const int b_boxes = B_BOXES ? min(GH_BN / GH_BOX, ceil_div(out_cols - tile.col0, GH_BOX)) : 1;
                if (!load_tile<MODE>(a_map, b_map, tile, a_boxes, (1u << b_boxes) - 1, 0, stages, full, empty, step,
                                     status, gave_up))
                    return;
            }
            return;
        }
        if constexpr (STAGED_OUTPUT) {
            // Store warps: each staged tile to global memory in 16-byte chunks, a warp per
            // 512-byte row at a time, masked to the tile's rows and the output's columns.
            const int id = threadIdx.x - WARP;
            int phase = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x, phase ^= 1) {
                const Tile tile = tile_at(t);
                stage_wait(&output_full, phase, status, GH_WAITED_FOR_OUTPUT, gave_up);
                if (__any_sync(FULL_MASK, gave_up)) return;  // the whole warp, or its __syncwarp would hang
                OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert) * K * N : out;
                store_staged_tile<GH_BN>(staged, tile, base, out_cols, out_cols, id);
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&output_empty);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(GH_CONSUMER_REGISTERS));
    const int consumer = warpgroup - 1;
    int step = 0, phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, phase ^= 1) {
        const Tile tile = tile_at(t);
        float d[128];
        mma_tile<MODE>(d, tile, stages, full, empty, step, consumer, lane, status, gave_up);

        // Accumulator d[4j + {0, 1}] is row lane/4, columns 8j + 2 (lane%4) + {0, 1} of the
        // warp's 16 rows; d[4j + {2, 3}] the same 8 rows further.
        const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
        if constexpr (STAGED_OUTPUT) {  // to the staged tile once the store warps are done with the last
            stage_wait(&output_empty, phase ^ 1, status, GH_WAITED_FOR_STORES, gave_up);
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < GH_BN / 8; ++j) {
                    const __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
                    asm volatile("st.shared.b32 [%0], %1;" :: "r"(staged + (row + 8 * half) * GH_C_PITCH + (col + 8 * j) * 2),
                                 "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
                }
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&output_full);
        } else {
            OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert) * K * N : out;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = tile.row0 + row + 8 * half;
                if (r >= tile.row_end) continue;
                OutT* out_row = base + static_cast<long long>(r) * out_cols;
#pragma unroll
                for (int j = 0; j < GH_BN / 8; ++j) {
                    const int c = tile.col0 + col + 8 * j;  // out_cols is a multiple of 8 and c even: c + 1 < out_cols too
                    if (c < out_cols) store_pair(out_row + c, d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
                }
            }
        }
    }
}

#define GH_KERNEL(kernel, mode, a, b)                                                                                  \
    template <typename OutT>                                                                                           \
    __global__ void __launch_bounds__(GH_THREADS, 1)                                                                   \
    kernel(const __grid_constant__ TensorMap a, const __grid_constant__ TensorMap b, const void* offsets,               \
           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out, long long* status) {          \
        grouped_mm<mode, OutT>(&a, &b, offsets, offsets_are_64bit, experts, rows, K, N, out, status);                 \
    }
GH_KERNEL(grouped_mm_forward, GH_FORWARD, x_map, w_map)
GH_KERNEL(grouped_mm_dgrad, GH_DGRAD, dy_map, w_map)
GH_KERNEL(grouped_mm_wgrad, GH_WGRAD, x_map, dy_map)

#define GH_INSTANCE(kernel, OutT)                                                                             \
    template __global__ void kernel<OutT>(const __grid_constant__ TensorMap, const __grid_constant__ TensorMap,      \
                                          const void*, int, int, long long, int, int, OutT*, long long*)
GH_INSTANCE(grouped_mm_forward, bf16);
GH_INSTANCE(grouped_mm_forward, float);
GH_INSTANCE(grouped_mm_dgrad, bf16);
GH_INSTANCE(grouped_mm_dgrad, float);
GH_INSTANCE(grouped_mm_wgrad, bf16);
GH_INSTANCE(grouped_mm_wgrad, float);
