// Fused MoE layer, backward (UniEP): gradient dispatch + dgrad of down and dgrad of up +
// gradient combine as two persistent kernels, launched by
// ultraep/integration/fused_backward_device.py. ultraep/integration/fused_backward.py states
// the task semantics in NumPy -- the task order, the flags, why no claim order can
// deadlock. The results are held bit for bit to the sequential backward on the GPU
// (dispatch.cu's grad_rows and sum_slots, grouped_gemm.cu's dgrad, swiglu.cu's backward):
// the same tile arithmetic, the same sums.
//
//   fused_grad_dispatch_dgrad  send dy -> relay (grad_y rows, gate gradients to the sources)
//                              -> dgrad-down tiles (SwiGLU backward epilogue) -> dh [rows, 2F]
//   fused_dgrad_combine        dgrad-up tiles -> expert_out (heap) -> reduce -> dx, d_gates
//
// Blocks, claims, the stage ring and the flags are the forward's (fused_common.cuh): the
// backward shares the forward's row_flag, tile_ready and done flags and its epoch counter,
// and reports waits in the same status words; a non-null `trace` gets each task's start,
// end and SM as the forward's does (claim), kinds FB_KIND_*. A dgrad-down tile's
// accumulator is d_act for GH_BN columns of F; its epilogue rounds it to BF16 (as the
// sequential dgrad stores it), applies SwiGLU's backward with h's gate and up columns of
// the same indices and hands the store warps two staged halves: dh's gate columns, then its
// up columns F further.
//
//! kernels: fused_grad_dispatch_dgrad, fused_dgrad_combine
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"
#include "swiglu.cuh"
#include "fused_common.cuh"
#include "row_math.cuh"
#include "piece_copy.cuh"

// Task granularity, shared with the host (kernel_constant). FB_BM and FB_DOWN_COLS index
// the forward's flags, so they are fused_moe.cu's FM_BM and FM_DOWN_COLS (the host checks).
#define FB_SEND_TOKENS 16        // tokens per send task
#define FB_REDUCE_TOKENS 16      // tokens per reduce task (every dx column)
#define FB_BM GH_BM              // rows per relay task and per GEMM tile
#define FB_DACT_COLS GH_BN       // d_act columns per dgrad-down tile (as many dh gate and up columns)
#define FB_DOWN_COLS GH_BN       // dx columns per dgrad-up tile and per reduce task
#define FB_MAX_SLOTS 256         // local slots (M + S) per rank (shared-memory tables)
#define FB_MAX_TOP_K WARP        // a warp's lanes hold a token's slots

#define FB_KIND_SEND 0
#define FB_KIND_RELAY 1
#define FB_KIND_DGRAD_DOWN 2
#define FB_KIND_DGRAD_UP 3
#define FB_KIND_REDUCE 4

// Dispatch outcome codes of dispatch.cu's plan_rows: anything but OK means no work.
#define FB_OUTCOME_OK 0

static_assert(FB_DOWN_COLS == WARP * 8, "a reduce warp covers a dgrad-up tile's columns, 8 BF16 per lane");
static_assert(GH_CONSUMERS * 4 == 8, "send, relay and reduce tasks run on the 8 consumer warps");

// The first half of a dgrad-down tile's epilogue, a consumer thread's accumulators (the
// layout of stage_accumulators): g = bf16(d_act), staged BF16 d gate = SwiGLU backward's
// gate half; d keeps the up half's FP32 value for the second half (stage_accumulators<false>
// rounds it). Rows past the tile's and columns past F give zeros, which no store writes.
__device__ __forceinline__ void stage_dgrad_gate(float (&d)[128], unsigned staged, const Tile& tile, const float* h,
                                                 int ffn, int consumer, int warp, int lane) {
    const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
    constexpr int CHUNK = 4;  // column blocks whose h loads are in flight at once (the stores below fence them)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = tile.row0 + row + 8 * half;
        const float* h_row = h + static_cast<long long>(r) * 2 * ffn;
#pragma unroll
        for (int j0 = 0; j0 < GH_BN / 8; j0 += CHUNK) {
            float2 a[CHUNK], b[CHUNK];  // h's gate and up pairs of the chunk's columns
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                const int f = tile.col0 + col + 8 * (j0 + u);  // ffn is even: f < ffn holds f + 1 too
                const bool inside = r < tile.row_end && f < ffn;
                a[u] = inside ? __ldg(reinterpret_cast<const float2*>(h_row + f)) : make_float2(0.0f, 0.0f);
                b[u] = inside ? __ldg(reinterpret_cast<const float2*>(h_row + ffn + f)) : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < CHUNK; ++u) {
                const int j = j0 + u, i = 4 * j + 2 * half, f = tile.col0 + col + 8 * j;
                float gate[2] = {0.0f, 0.0f};
                if (r < tile.row_end && f < ffn) {
                    const __nv_bfloat162 g = __floats2bfloat162_rn(d[i], d[i + 1]);
                    const float2 g0 = swiglu_backward_rn(a[u].x, b[u].x, __low2float(g));
                    const float2 g1 = swiglu_backward_rn(a[u].y, b[u].y, __high2float(g));
                    gate[0] = g0.x, gate[1] = g1.x, d[i] = g0.y, d[i + 1] = g1.y;
                } else {
                    d[i] = 0.0f, d[i + 1] = 0.0f;
                }
                const __nv_bfloat162 v = __floats2bfloat162_rn(gate[0], gate[1]);
                asm volatile("st.shared.b32 [%0], %1;"
                             :: "r"(staged + (row + 8 * half) * GH_C_PITCH + (col + 8 * j) * 2),
                                "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
            }
        }
    }
}

// -- kernel C: gradient dispatch + dgrad of down ------------------------------------------------

// Tasks: [0, n_send) send, then one relay per M-tile (slot, then M-tile), then dgrad-down
// tiles in the grouped GEMM's order (gemm_tile): the forward kernel A's
// send_relay_then_gemm, the relay row_math.cuh's grad_row (the sequential path's too), a
// tile's epilogue SwiGLU's backward into dh's gate half and up half (two stagings). grad_y_map: grad_y
// [max_rows, H] as (H, rows), box 64 x 128; w_down_map: w_down [slots, F, H] as (H, F, slots),
// box 64 x 256 x 1. row_landing, row_weight, row_origin: the forward's receive-row metadata
// (the Dispatcher's handle). The send is the forward's send_token over dy: it rewrites each
// pair's heap metadata with the values its forward wrote, which no later reader overtakes
// (fused_backward.py, reuse across calls).
extern "C" __global__ void __launch_bounds__(GH_THREADS, 1)
fused_grad_dispatch_dgrad(const __grid_constant__ TensorMap grad_y_map, const __grid_constant__ TensorMap w_down_map,
                          const uint4* dy, int tokens, int top_k, int hidden, const long long* ids, const float* gates,
                          const int* positions, const int* base, const u64* peer_bases, u64 landing_offset,
                          u64 weight_offset, u64 row_landing_offset, u64 origin_offset, u64 row_flag_offset,
                          u64 slot_grad_w_offset, int me, int spr, int max_tokens, const int* rank_off,
                          const int* rank_mtile, const int* row_landing, const float* row_weight,
                          const int* row_origin, const uint4* y, uint4* grad_y, u64* tile_ready, int ffn,
                          const float* h, bf16* dh, u64 epoch, u64 timeout_ns, int* counter, long long* status,
                          const int* outcome, u64* trace) {
    __shared__ int off[FB_MAX_SLOTS + 1], mtile[FB_MAX_SLOTS + 1], tile_start[FB_MAX_SLOTS + 1];
    __shared__ Pipeline p;
    __shared__ int claimed;
    if (outcome[0] != FB_OUTCOME_OK) return;  // every block of every rank reads the same verdict
    load_tables(off, mtile, tile_start, p, rank_off, rank_mtile, me, spr, ffn, FB_DACT_COLS);
    auto dgrad_tile = [&](int t) { return gemm_tile(tile_start, off, spr, t, FB_DACT_COLS, hidden); };
    auto relay_row = [&](int row, const uint4* landing, const int*) {  // the handle's row_landing
        grad_row<bf16, FM_UNROLL>(row, landing, row_landing, row_weight, row_origin, y, grad_y, hidden * 2 / 16,
                                  peer_bases, slot_grad_w_offset, max_tokens * top_k, threadIdx.x % WARP);
    };
    // dh's gate half (its first F columns), then its up half: staging s to columns s F + the tile's
    auto store = [&](unsigned staged, const Tile& tile, int s) {
        store_staged_tile<GH_BN>(staged, tile, dh + s * ffn, 2 * ffn, ffn, threadIdx.x - WARP);
    };
    auto stage = [&](float (&d)[128], const Tile& tile, int half, unsigned staged, int consumer, int warp,
                     int lane) {
        if (half == 0)
            stage_dgrad_gate(d, staged, tile, h, ffn, consumer, warp, lane);
        else
            stage_accumulators<false>(d, staged, consumer, warp, lane);
    };
    // h's gate and up columns of the tile: 256 KB that the epilogue would otherwise wait for
    // from HBM in serial rounds (its loads cannot pass its shared stores)
    auto prefetch_h = [&](const Tile& tile, int id) {
        const unsigned bytes = min(FB_DACT_COLS, ffn - tile.col0) * sizeof(float);  // ffn: whole 16-byte chunks
        const int rows = min(GH_BM, tile.row_end - tile.row0);
        for (int i = id / WARP; i < 2 * rows; i += GH_STORE_WARPS)  // a warp's rows, its lane 0
            if (id % WARP == 0) prefetch_l2(h + static_cast<long long>(tile.row0 + i / 2) * 2 * ffn + (i % 2) * ffn + tile.col0, bytes);
    };
    // system-scope relay fences: the sources read their gate gradients after kernel D's flags
    send_relay_then_gemm<GH_DGRAD, true>(
        &grad_y_map, &w_down_map, dgrad_tile, [](const Tile&) { return 0u; }, 0, 2, dy, tokens, top_k, hidden, ids,
        gates, positions, base, peer_bases, landing_offset, weight_offset, row_landing_offset, origin_offset,
        row_flag_offset, me, spr, max_tokens, FB_SEND_TOKENS, off, mtile, tile_start, p, &claimed, tile_ready,
        relay_row, store, stage, prefetch_h, epoch, timeout_ns, counter, status, trace, FB_KIND_SEND,
        FB_KIND_RELAY, FB_KIND_DGRAD_DOWN);
}

// -- kernel D: dgrad of up + gradient combine -----------------------------------------------------

// Tasks: dgrad-up tiles in the grouped GEMM's order (gemm_tile), then reduce
// tasks (a token chunk, every column): the forward kernel B's gemm_tiles_then_reduce,
// unweighted, each reduce also copying the gate gradients (the relays that wrote them ran
// before the dgrad-up tiles whose flag is acquired). dh_map: dh [max_rows, 2F] as (2F, rows),
// box 64 x 128; w_up_map: w_up [slots, H, 2F] as (2F, H, slots), box 64 x 256 x 1. expert_out,
// the done flags and slot_grad_w are heap tensors (offsets from each peer's base).
extern "C" __global__ void __launch_bounds__(GH_THREADS, 1)
fused_dgrad_combine(const __grid_constant__ TensorMap dh_map, const __grid_constant__ TensorMap w_up_map, int ffn,
                    int hidden, const u64* peer_bases, u64 expert_out_offset, u64 done_offset, u64 slot_grad_w_offset,
                    int me, int spr, const int* rank_off, const int* rank_mtile, const long long* ids,
                    const int* positions, const int* base, int tokens, int top_k, bf16* dx, float* d_gates,
                    int* down_count, u64 epoch, u64 timeout_ns, int* counter, long long* status, const int* outcome,
                    u64* trace) {
    __shared__ int off[FB_MAX_SLOTS + 1], mtile[FB_MAX_SLOTS + 1], tile_start[FB_MAX_SLOTS + 1];
    __shared__ Pipeline p;
    __shared__ int claimed;
    __shared__ const uint4* slot_row[GH_CONSUMERS * 4][FB_MAX_TOP_K];
    if (outcome[0] != FB_OUTCOME_OK) return;
    const int n_cols = load_tables(off, mtile, tile_start, p, rank_off, rank_mtile, me, spr, hidden, FB_DOWN_COLS);
    auto tile_of = [&](int t) { return gemm_tile(tile_start, off, spr, t, FB_DOWN_COLS, 2 * ffn); };
    auto copy_gate_grad = [&](int i, u64 heap) {
        d_gates[i] = reinterpret_cast<const float*>(heap + slot_grad_w_offset)[i];
    };
    gemm_tiles_then_reduce<GH_DGRAD, false>(
        &dh_map, &w_up_map, tile_of, [](const Tile&) { return 0u; }, n_cols, hidden, peer_bases, expert_out_offset,
        done_offset, me, spr, rank_off, rank_mtile, off, mtile, tile_start, p, &claimed, ids, positions, base,
        static_cast<const float*>(nullptr), tokens, top_k, FB_REDUCE_TOKENS, dx, slot_row,
        static_cast<float(*)[WARP]>(nullptr), copy_gate_grad, down_count, epoch, timeout_ns, counter, status,
        trace, FB_KIND_DGRAD_UP, FB_KIND_REDUCE);
}
