// Padding-free grouped BF16 GEMM over expert-major rows for Hopper (sm_90a): forward,
// dgrad and wgrad, FP32 accumulation, BF16 or FP32 output. ultraep/compute/device.py
// launches them (compiled with -arch=sm_90a: wgmma and setmaxnreg exist only there).
//
//   forward  Y[rows_e]  = X[rows_e] @ W_e          x [M, K], w [E, K, N], y  [M, N]
//   dgrad    dX[rows_e] = dY[rows_e] @ W_e^T       dy [M, N], w [E, K, N], dx [M, K]
//   wgrad    dW_e       = X[rows_e]^T @ dY[rows_e] x [M, K], dy [M, N],   dw [E - A, K, N]
//
// A wgrad with FP32 output may add its first A experts into add_to [A, K, N] instead of
// storing them (dw then holds experts A.. only): add_to[e] += dW_e, one FP32 add an element
// after the sum, done in L2 by red.global.add (fire and forget: the consumers go on with the
// next tile). That add rounds to nearest even but flushes subnormal inputs and results to
// signed zero (PTX ISA), which compute/host.py's reference does too. A layer's gradient
// accumulates without a pass over it and without room for its masters' dW_e; forward, dgrad
// and BF16 output take A = 0.
//
// rows_e = [offsets[e], offsets[e+1]), read and checked on the device by every block
// (grouped_gemm_common.cuh): on a bad array no block writes anything. Persistent blocks, one
// per SM, claim the tiles of one fixed order -- expert, then groups of 8 m-tiles, every
// n-tile of a group (grouped_raster), so the blocks running at once share a few m-side tiles
// and an n-side slice in L2 -- one at a time from a counter of the launch's stream (`claims`),
// so a block that gets its SM late (SMs shared with other processes under MPS, or with other
// kernels) takes fewer tiles instead of holding the launch up by its share of them. Which
// block runs a tile changes no bit of it.
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
// chunks; the last chunk runs only its k16 steps that hold rows of the expert, and the rows
// past the expert's end in the last of those are cleared in shared memory before the MMAs
// (an empty expert's dW_e is all zeros). Columns past the output's and the reduction past
// its end (K or N) are zeros filled in by TMA.
//
// Determinism: every output element is one sum in GH_BK chunks in ascending order, each
// chunk four k16 MMAs in ascending k (a wgrad expert's last chunk leaves out those that
// would add only zeros), with no split-K and no atomics. A row's forward or
// dgrad result depends only on its own row and the weights, never on which rows share its
// tile or where its expert starts; a dW_e only on the expert's rows, not where they start.
// The schedules below change where output tiles wait and how deep the ring is, never a sum:
// they give the same bits.
//
//! kernels: grouped_mm_forward<__nv_bfloat16>, grouped_mm_forward<float>
//! kernels: grouped_mm_dgrad<__nv_bfloat16>, grouped_mm_dgrad<float>
//! kernels: grouped_mm_wgrad<__nv_bfloat16>, grouped_mm_wgrad<float>
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

// -- Schedules --------------------------------------------------------------------------------
// GG_SCHEDULE (a -D option; ultraep/compute/device.py names them) decides where a BF16 output
// tile waits for the store warps, and with it the depth of the stage ring:
//   GG_STAGED_TILE  (without the option) a padded buffer of its own, GH_C_BYTES, beside 3
//                   stages, as in the fused kernels;
//   GG_RING_STAGED  the stage of the tile's last k-step, still held by the consumers, for its
//                   first GH_STAGE_BLOCKS column blocks and a GH_TAIL_BYTES tail for the
//                   rest, beside GG_RING_STAGES stages; the store warps hand that stage back
//                   to the producer once they have read it (until then the ring is 3 deep).
// While the MMAs of one k-step run, the consumers hold its stage and the producer refills the
// others: a copy may take two k-steps of MMAs with 3 stages, three with 4 (~1.1 against ~1.7 us
// at the tensor cores' peak) before the MMAs wait for it; the same epilogue overlaps the next
// tile's MMAs in both.
#define GG_STAGED_TILE 0
#define GG_RING_STAGED 1
#ifndef GG_SCHEDULE
#define GG_SCHEDULE GG_STAGED_TILE
#endif
#define GG_RING_STAGES 4
#if GG_SCHEDULE == GG_RING_STAGED
#define GH_STAGES GG_RING_STAGES
// The store warps keep two 16-byte chunks a lane in flight: warpgroup 0 takes 56 registers
// (40 spill), the consumers 224 (they use about 170); 128 x 56 + 256 x 224 = 384 x 168.
#define GH_PRODUCER_REGISTERS 56
#define GH_CONSUMER_REGISTERS 224
#endif

#include "grouped_gemm_common.cuh"

// The host's dynamic shared memory for GG_RING_STAGED (GH_SMEM_BYTES for GG_STAGED_TILE).
#define GG_RING_SMEM_BYTES (GG_RING_STAGES * GH_STAGE_BYTES + GH_TAIL_BYTES + 1024)
static_assert(GG_SCHEDULE == GG_STAGED_TILE || GG_SCHEDULE == GG_RING_STAGED, "GG_SCHEDULE names no schedule");

// Tile timing for scripts/gemm_tile_stamps.py, which compiles with -DGG_TILE_STAMPS: the first
// consumer thread of each block records for tile t (below GG_STAMPED_TILES) %globaltimer before
// its MMAs, after them and once its output is handed on, its SM, rows and k-steps. Without the
// define the stamps compile to nothing.
enum TileStamp { STAMP_MMA_START, STAMP_MMA_END, STAMP_HANDED_ON, STAMP_SM, STAMP_ROWS, STAMP_K_STEPS, TILE_STAMPS };
#ifdef GG_TILE_STAMPS
#define GG_STAMPED_TILES 65536
__device__ long long gg_tile_stamps[GG_STAMPED_TILES * TILE_STAMPS];
#define TILE_STAMP(t, field, value)                                                                  \
    do {                                                                                             \
        if (threadIdx.x == 128 && (t) < GG_STAMPED_TILES) gg_tile_stamps[(t) * TILE_STAMPS + (field)] = (value); \
    } while (0)
__device__ __forceinline__ int sm_id() {
    int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}
#else
#define TILE_STAMP(t, field, value) \
    do {                            \
    } while (0)
#endif

// *p += (v0, v1) in L2, no value returned (8-byte aligned p; subnormals flushed, see above).
__device__ __forceinline__ void add_pair(float* p, float v0, float v1) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(v0), "f"(v1) : "memory");
}

// -- The tile loop ----------------------------------------------------------------------------

// The claimed tiles' way to the block's roles: the producer claims a tile, writes its index
// to the next of GG_TILE_SLOTS shared slots and arrives on the slot's `full` barrier; every
// reading warp (the consumers' and, for BF16 output, the store warps) reads it and arrives on
// the slot's `empty` one, which the producer waits for before it reuses the slot. An index
// of `tiles` or more ends each role's loop.
#define GG_TILE_SLOTS 4
struct TileQueue {
    int* index;
    u64* full;
    u64* empty;
};

// The producer's i-th tile: claimed from the launch's counter once slot i % GG_TILE_SLOTS is
// free, and published to the readers (`tiles` or more: none left).
__device__ __forceinline__ int claim_tile(const TileQueue& queue, int i, int* claims, long long* status,
                                          bool& gave_up) {
    const int slot = i % GG_TILE_SLOTS;
    stage_wait(&queue.empty[slot], ((i / GG_TILE_SLOTS) & 1) ^ 1, status, GH_WAITED_FOR_READERS, gave_up);
    if (gave_up) return 0x7fffffff;  // past every tile: the loop ends
    const int t = atomicAdd(claims, 1);
    queue.index[slot] = t;
    mbarrier_arrive(&queue.full[slot]);
    return t;
}

// A reading warp's i-th tile index (`tiles` once a wait gave up, which ends its loop).
__device__ __forceinline__ int next_tile(const TileQueue& queue, int i, int tiles, int lane, long long* status,
                                         bool& gave_up) {
    const int slot = i % GG_TILE_SLOTS;
    stage_wait(&queue.full[slot], (i / GG_TILE_SLOTS) & 1, status, GH_WAITED_FOR_TILE, gave_up);
    const int t = gave_up ? tiles : queue.index[slot];
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&queue.empty[slot]);
    return t;
}

// The consumers' i-th tile index, the same in every consumer thread: past every tile for all
// of them once any gave up (one leaving alone would leave the others in consumers_sync or a
// warpgroup-wide wgmma for good).
__device__ __forceinline__ int consumers_next_tile(const TileQueue& queue, int i, int tiles, int lane,
                                                   long long* status, bool& gave_up) {
    const int t = next_tile(queue, i, tiles, lane, status, gave_up);
    unsigned any_done;
    asm volatile("{\n .reg .pred done, any;\n setp.ge.s32 done, %1, %2;\n"
                 " bar.red.or.pred any, 1, %3, done;\n selp.u32 %0, 1, 0, any;\n}"
                 : "=r"(any_done) : "r"(t), "r"(tiles), "n"(128 * GH_CONSUMERS) : "memory");
    return any_done ? tiles : t;
}

// Called once by each block (its producer, or thread 0 of a block that refused the offsets)
// when it claims no more: the last of the launch resets the counter, so the next launch on
// the stream starts at tile 0.
__device__ __forceinline__ void done_claiming(int* claims) {
    __threadfence();  // this block's last claim before its count
    if (atomicAdd(claims + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        atomicExch(claims, 0);
        atomicExch(claims + 1, 0);
    }
}

// A compile-time choice passed to a generic lambda (NVRTC has no <type_traits>).
template <bool VALUE>
struct Flag {
    static constexpr bool value = VALUE;
};

// The operands as grouped_gemm_common.cuh describes them (load_tile).
template <int MODE, typename OutT>
__device__ __forceinline__ void grouped_mm(const TensorMap* a_map, const TensorMap* b_map, const void* offsets,
                                           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out,
                                           OutT* add_to, int added_experts, long long* status, int* claims) {
    constexpr bool STAGED_OUTPUT = sizeof(OutT) == 2;  // FP32 tiles do not fit beside the stages: stored directly
    constexpr bool RING_STAGED = STAGED_OUTPUT && GG_SCHEDULE == GG_RING_STAGED;
    constexpr bool A_BOXES = MODE == GH_WGRAD, B_BOXES = MODE != GH_DGRAD;
    extern __shared__ unsigned char dynamic_shared[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    __shared__ int tile_start[GG_MAX_EXPERTS + 1];
    __shared__ u64 full[GH_STAGES], empty[GH_STAGES], output_full, output_empty;
    __shared__ int queued_tile[GG_TILE_SLOTS];
    __shared__ u64 tile_full[GG_TILE_SLOTS], tile_empty[GG_TILE_SLOTS];

    if (!load_offsets(off, offsets, offsets_are_64bit, experts, rows, status)) {
        if (threadIdx.x == 0) done_claiming(claims);  // (offsets rewritten meanwhile: other blocks may have claimed)
        return;
    }
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
        for (int s = 0; s < GG_TILE_SLOTS; ++s) {
            mbarrier_init(&tile_full[s], 1);
            mbarrier_init(&tile_empty[s], GH_CONSUMERS * 4 + (STAGED_OUTPUT ? GH_STORE_WARPS : 0));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int tiles = MODE == GH_WGRAD ? experts * wgrad_m_tiles * n_tiles : tile_start[experts];
    const unsigned stages = (shared_address(dynamic_shared) + 1023) & ~1023u;
    const unsigned staged = stages + GH_STAGES * GH_STAGE_BYTES;  // the BF16 output tile (ring-staged: its tail)
    const TileQueue queue{queued_tile, tile_full, tile_empty};

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
            // wgrad with K and N multiples of GH_BOX: its operands are 3-D maps (device.py makes
            // the same choice), copied one box each.
            auto produce = [&](auto one_box_each) {
                int step = 0;
                for (int i = 0, t; (t = claim_tile(queue, i, claims, status, gave_up)) < tiles; ++i) {
                    const Tile tile = tile_at(t);
                    const int a_boxes = A_BOXES ? min(GH_BM / GH_BOX, ceil_div(K - tile.row0, GH_BOX)) : 1;
                    const int b_boxes = B_BOXES ? min(GH_BN / GH_BOX, ceil_div(out_cols - tile.col0, GH_BOX)) : 1;
                    if (!load_tile<MODE, decltype(one_box_each)::value>(a_map, b_map, tile, a_boxes,
                                                                        (1u << b_boxes) - 1, 0, stages, full, empty,
                                                                        step, status, gave_up))
                        break;
                }
                done_claiming(claims);
            };
            if constexpr (MODE == GH_WGRAD) {
                if (K % GH_BOX == 0 && N % GH_BOX == 0) {
                    produce(Flag<true>{});
                    return;
                }
            }
            produce(Flag<false>{});
            return;
        }
        if constexpr (RING_STAGED) {
            // Store warps: each tile from the stage of its last k-step and the tail; the stage
            // goes back to the producer first (its arrivals, shared out among the store warps,
            // are the consumer warps' that mma_tile left out). A tile with no k-step is zeros
            // and was staged nowhere.
            const int id = threadIdx.x - WARP;
            int phase = 0, step = 0;
            for (int i = 0, t; (t = next_tile(queue, i, tiles, lane, status, gave_up)) < tiles; ++i) {
                const Tile tile = tile_at(t);
                OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert - added_experts) * K * N : out;
                step += ceil_div(tile.red_len, GH_BK);
                if (tile.red_len == 0) {
                    store_ring_blocks<GH_BN / GH_BLOCK_COLS, true>(0, tile.col0, tile, base, out_cols, id);
                    continue;
                }
                stage_wait(&output_full, phase, status, GH_WAITED_FOR_OUTPUT, gave_up);
                phase ^= 1;
                if (__any_sync(FULL_MASK, gave_up)) return;  // the whole warp, or its __syncwarp would hang
                const int s = (step - 1) % GH_STAGES;
                store_ring_blocks<GH_STAGE_BLOCKS>(stages + s * GH_STAGE_BYTES, tile.col0, tile, base, out_cols, id);
                hand_stage_back(&empty[s], id, lane);
                store_ring_blocks<GH_BN / GH_BLOCK_COLS - GH_STAGE_BLOCKS>(
                    staged, tile.col0 + GH_STAGE_BLOCKS * GH_BLOCK_COLS, tile, base, out_cols, id);
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&output_empty);
            }
        } else if constexpr (STAGED_OUTPUT) {
            // Store warps: each staged tile to global memory in 16-byte chunks, a warp per
            // 512-byte row at a time, masked to the tile's rows and the output's columns.
            const int id = threadIdx.x - WARP;
            int phase = 0;
            for (int i = 0, t; (t = next_tile(queue, i, tiles, lane, status, gave_up)) < tiles; ++i, phase ^= 1) {
                const Tile tile = tile_at(t);
                stage_wait(&output_full, phase, status, GH_WAITED_FOR_OUTPUT, gave_up);
                if (__any_sync(FULL_MASK, gave_up)) return;  // the whole warp, or its __syncwarp would hang
                OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert - added_experts) * K * N : out;
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
    for (int i = 0, t; (t = consumers_next_tile(queue, i, tiles, lane, status, gave_up)) < tiles; ++i) {
        const Tile tile = tile_at(t);
        float d[128];
        TILE_STAMP(t, STAMP_MMA_START, static_cast<long long>(global_timer_ns()));
        mma_tile<MODE, !RING_STAGED>(d, tile, stages, full, empty, step, consumer, lane, status, gave_up);
        TILE_STAMP(t, STAMP_MMA_END, static_cast<long long>(global_timer_ns()));

        // Accumulator d[4j + {0, 1}] is row lane/4, columns 8j + 2 (lane%4) + {0, 1} of the
        // warp's 16 rows; d[4j + {2, 3}] the same 8 rows further.
        const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
        if constexpr (RING_STAGED) {  // over the last k-step's stage and the tail, once the store warps are done with it
            if (tile.red_len > 0) {   // else zeros, which the store warps write
                consumers_sync();     // both warpgroups' last MMAs have read the stage
                stage_wait(&output_empty, phase ^ 1, status, GH_WAITED_FOR_STORES, gave_up);
                stage_in_ring(d, stages + (step - 1) % GH_STAGES * GH_STAGE_BYTES, staged, row, lane);
                fence_proxy_async_shared();
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&output_full);
                phase ^= 1;
            }
        } else if constexpr (STAGED_OUTPUT) {  // to the staged tile once the store warps are done with the last
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
            phase ^= 1;
        } else {
            const bool add = MODE == GH_WGRAD && tile.expert < added_experts;
            OutT* base = MODE != GH_WGRAD ? out
                         : add ? add_to + static_cast<long long>(tile.expert) * K * N
                               : out + static_cast<long long>(tile.expert - added_experts) * K * N;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = tile.row0 + row + 8 * half;
                if (r >= tile.row_end) continue;
                OutT* out_row = base + static_cast<long long>(r) * out_cols;
                // out_cols is a multiple of 8 and c even: c + 1 < out_cols too
                if (add) {
#pragma unroll
                    for (int j = 0; j < GH_BN / 8; ++j) {
                        const int c = tile.col0 + col + 8 * j;
                        if (c < out_cols) add_pair(reinterpret_cast<float*>(out_row + c), d[4 * j + 2 * half],
                                                   d[4 * j + 2 * half + 1]);
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < GH_BN / 8; ++j) {
                        const int c = tile.col0 + col + 8 * j;
                        if (c < out_cols) store_pair(out_row + c, d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
                    }
                }
            }
        }
        TILE_STAMP(t, STAMP_HANDED_ON, static_cast<long long>(global_timer_ns()));
        TILE_STAMP(t, STAMP_SM, sm_id());
        TILE_STAMP(t, STAMP_ROWS, min(GH_BM, tile.row_end - tile.row0));
        TILE_STAMP(t, STAMP_K_STEPS, ceil_div(tile.red_len, GH_BK));
    }
}

#define GH_KERNEL(kernel, mode, a, b)                                                                                  \
    template <typename OutT>                                                                                           \
    __global__ void __launch_bounds__(GH_THREADS, 1)                                                                   \
    kernel(const __grid_constant__ TensorMap a, const __grid_constant__ TensorMap b, const void* offsets,               \
           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out, OutT* add_to, int added_experts,     \
           long long* status, int* claims) {                                                                           \
        grouped_mm<mode, OutT>(&a, &b, offsets, offsets_are_64bit, experts, rows, K, N, out, add_to, added_experts,     \
                               status, claims);                                                                        \
    }
GH_KERNEL(grouped_mm_forward, GH_FORWARD, x_map, w_map)
GH_KERNEL(grouped_mm_dgrad, GH_DGRAD, dy_map, w_map)
GH_KERNEL(grouped_mm_wgrad, GH_WGRAD, x_map, dy_map)

#define GH_INSTANCE(kernel, OutT)                                                                             \
    template __global__ void kernel<OutT>(const __grid_constant__ TensorMap, const __grid_constant__ TensorMap,      \
                                          const void*, int, int, long long, int, int, OutT*, OutT*, int, long long*, \
                                          int*)
GH_INSTANCE(grouped_mm_forward, bf16);
GH_INSTANCE(grouped_mm_forward, float);
GH_INSTANCE(grouped_mm_dgrad, bf16);
GH_INSTANCE(grouped_mm_dgrad, float);
GH_INSTANCE(grouped_mm_wgrad, bf16);
GH_INSTANCE(grouped_mm_wgrad, float);
