// Fused MoE layer, backward (UniEP): gradient dispatch + dgrad of down and dgrad of up +
// gradient combine as two persistent kernels, launched by ultraep/compute/fused/device.py.
// ultraep/compute/fused/backward.py states the task semantics in NumPy -- the task order, the flags, why no claim order can
// deadlock. The results are held bit for bit to the sequential backward on the GPU
// (dispatch.cu's grad_rows and sum_slots, grouped_gemm.cu's dgrad, swiglu.cu's backward):
// the same tile arithmetic, the same sums.
//
//   fused_grad_dispatch_dgrad  send dy -> dgrad-down tiles (SwiGLU backward epilogue) -> dh
//                              [rows, 2F]; relay (grad_y rows, gate gradients to the sources)
//                              on the store warps beside them
//   fused_dgrad_combine        dgrad-up tiles -> expert_out (heap) -> reduce -> dx, d_gates
//
// Blocks, claims, the stage ring and the flags are the forward's (fused_common.cuh): the
// backward shares the forward's row_flag, tile_ready and done flags and its epoch counter,
// and reports waits in the same status words; a non-null `trace` gets each task's start,
// end and SM as the forward's does (claim), kinds FB_KIND_*. A dgrad-down tile's
// accumulator is d_act for GH_BN columns of F; its epilogue rounds it to BF16 (as the
// sequential dgrad stores it) and stages it; the consumers then apply SwiGLU's backward with
// h's gate and up columns of the same indices and store dh's gate columns and its up columns
// F further (swiglu_backward_tile); the store warps run kernel C's relays, as kernel A's (on
// those three warps the SwiGLU backward outlasted the next tile's MMAs).
//
//! kernels: fused_grad_dispatch_dgrad, fused_dgrad_combine
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

// fused_common.cuh first: it sets warpgroup 0's register split
#include "fused_common.cuh"
#include "grouped_gemm_common.cuh"
#include "swiglu.cuh"
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
static_assert(GH_CONSUMERS * 4 == 8, "send and reduce tasks run on the 8 consumer warps");

// The SwiGLU backward of a dgrad-down tile on the 8 consumer warps (`id`: the thread's index
// among them), from g = bf16(d_act) of the whole tile that the consumers staged (as the sequential
// dgrad stores it). h's gate and up rows of the tile go
// to L2 first (a bulk prefetch a row by lane 0 of each warp: it takes uniform operands, and
// holds no register). Then a warp takes a row at a time, a lane four columns of each of the
// row's GH_BN / 4 / WARP items, h's gate and up values of the warp's next row loaded before
// this row's math; dh's gate and up columns are stored as BF16 straight to global memory. A
// runtime loop over the staged tile, not the accumulators' registers: the math is inlined a
// few times instead of once per accumulator pair, and a warp reads and writes whole rows.
__device__ __forceinline__ void swiglu_backward_tile(unsigned staged, const Tile& tile, const float* h, bf16* dh,
                                                     int ffn, int id) {
    constexpr int PER = 4, ITEMS = GH_BN / PER / WARP, WARPS = GH_CONSUMERS * 4;
    const int warp = id / WARP, lane = id % WARP;
    const int rows = min(GH_BM, tile.row_end - tile.row0), cols = min(FB_DACT_COLS, ffn - tile.col0);
    const long long pitch = 2ll * ffn;  // h's and dh's row: gate columns, then up columns
    const float* h_tile = h + tile.row0 * pitch + tile.col0;
    bf16* dh_tile = dh + tile.row0 * pitch + tile.col0;
    if (lane == 0)
        for (int i = warp; i < 2 * rows; i += WARPS)  // ffn: whole 16-byte chunks
            prefetch_l2(h_tile + i / 2 * pitch + i % 2 * ffn, cols * sizeof(float));
    float4 gate_h[ITEMS], up_h[ITEMS];
    auto load_row = [&](int row, float4 (&gate)[ITEMS], float4 (&up)[ITEMS]) {
#pragma unroll
        for (int u = 0; u < ITEMS; ++u) {
            const int c = (u * WARP + lane) * PER;
            const bool inside = row < rows && c < cols;  // ffn is a multiple of 8: c < cols holds c + 3 too
            const float* at = h_tile + row * pitch + c;
            gate[u] = inside ? __ldg(reinterpret_cast<const float4*>(at)) : make_float4(0, 0, 0, 0);
            up[u] = inside ? __ldg(reinterpret_cast<const float4*>(at + ffn)) : make_float4(0, 0, 0, 0);
        }
    };
    load_row(warp, gate_h, up_h);
    for (int row = warp; row < rows; row += WARPS) {
        float4 next_gate[ITEMS], next_up[ITEMS];
        load_row(row + WARPS, next_gate, next_up);
#pragma unroll
        for (int u = 0; u < ITEMS; ++u) {
            const int c = (u * WARP + lane) * PER;
            if (c >= cols) continue;
            uint2 bits;
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(bits.x), "=r"(bits.y)
                         : "r"(staged + row * GH_C_PITCH + c * 2));
            const __nv_bfloat162 g01 = *reinterpret_cast<const __nv_bfloat162*>(&bits.x);
            const __nv_bfloat162 g23 = *reinterpret_cast<const __nv_bfloat162*>(&bits.y);
            const float4 a = gate_h[u], b = up_h[u];
            const float2 d0 = swiglu_backward_rn(a.x, b.x, __low2float(g01));
            const float2 d1 = swiglu_backward_rn(a.y, b.y, __high2float(g01));
            const float2 d2 = swiglu_backward_rn(a.z, b.z, __low2float(g23));
            const float2 d3 = swiglu_backward_rn(a.w, b.w, __high2float(g23));
            const __nv_bfloat162 gate[2] = {__floats2bfloat162_rn(d0.x, d1.x), __floats2bfloat162_rn(d2.x, d3.x)};
            const __nv_bfloat162 up[2] = {__floats2bfloat162_rn(d0.y, d1.y), __floats2bfloat162_rn(d2.y, d3.y)};
            bf16* dh_row = dh_tile + row * pitch + c;
            *reinterpret_cast<uint2*>(dh_row) = *reinterpret_cast<const uint2*>(gate);
            *reinterpret_cast<uint2*>(dh_row + ffn) = *reinterpret_cast<const uint2*>(up);
        }
#pragma unroll
        for (int u = 0; u < ITEMS; ++u) gate_h[u] = next_gate[u], up_h[u] = next_up[u];
    }
}

// -- kernel C: gradient dispatch + dgrad of down ------------------------------------------------

// Tasks: [0, n_send) send, then one relay per M-tile, then dgrad-down tiles, both in the
// forward's arrival order (its fused_plan's `arrival`, arrival_tile): the forward kernel A's
// send_relay_then_gemm (the first send_ctas blocks sending first, the relays on the store
// warps), the relay row_math.cuh's grad_row (the sequential path's too), a
// tile's epilogue SwiGLU's backward into dh's gate half and up half on the consumers.
// grad_y_map: grad_y [max_rows, H] as (H, rows), box 64 x 128; w_down_map: w_down
// [slots, F, H] as (H, F, slots), box 64 x 256 x 1. row_landing, row_weight, row_origin: the
// forward's receive-row metadata (the Dispatcher's handle). The send is the forward's
// send_token over dy: it rewrites each pair's heap metadata with the values its forward
// wrote, which no later reader overtakes (compute/fused/backward.py, reuse across calls).
extern "C" __global__ void __launch_bounds__(GH_THREADS, 1)
fused_grad_dispatch_dgrad(const __grid_constant__ TensorMap grad_y_map, const __grid_constant__ TensorMap w_down_map,
                          const uint4* dy, int tokens, int top_k, int hidden, const long long* ids, const float* gates,
                          const int* positions, const int* base, const u64* peer_bases, u64 landing_offset,
                          u64 weight_offset, u64 row_landing_offset, u64 origin_offset, u64 row_flag_offset,
                          u64 slot_grad_w_offset, int me, int spr, int max_tokens, const int* rank_off,
                          const int* rank_mtile, const int* arrival, int send_ctas, const int* row_landing,
                          const float* row_weight,
                          const int* row_origin, const uint4* y, uint4* grad_y, u64* tile_ready, int ffn,
                          const float* h, bf16* dh, u64 epoch, u64 timeout_ns, int* counter, long long* status,
                          const int* outcome, u64* trace) {
    __shared__ int off[FB_MAX_SLOTS + 1], mtile[FB_MAX_SLOTS + 1], tile_start[FB_MAX_SLOTS + 1];
    __shared__ Pipeline p;
    __shared__ int claimed[2];  // the block's claim, the store warps' relay
    if (outcome[0] != FB_OUTCOME_OK) return;  // every block of every rank reads the same verdict
    const int n_cols = load_tables(off, mtile, tile_start, p, rank_off, rank_mtile, me, spr, ffn, FB_DACT_COLS);
    auto dgrad_tile = [&](int t) { return arrival_tile(arrival, off, mtile, spr, n_cols, t, FB_DACT_COLS, hidden); };
    auto relay_row = [&](int row, const uint4* landing, const int*) {  // the handle's row_landing
        grad_row<bf16, FM_RELAY_UNROLL>(row, landing, row_landing, row_weight, row_origin, y, grad_y, hidden * 2 / 16,
                                        peer_bases, slot_grad_w_offset, max_tokens * top_k, threadIdx.x % WARP);
    };
    // The epilogue on the consumers alone, through the idle stage ring: g staged, then the
    // tile's SwiGLU backward from it into dh.
    auto finish = [&](const float (&d)[128], const Tile& tile, unsigned ring, int consumer, int warp, int lane) {
        stage_accumulators(d, ring, consumer, warp, lane);
        consumers_sync();
        swiglu_backward_tile(ring, tile, h, dh, ffn, threadIdx.x - 128);
    };
    // system-scope relay fences: the sources read their gate gradients after kernel D's flags
    send_relay_then_gemm<GH_DGRAD, true>(
        &grad_y_map, &w_down_map, dgrad_tile, [](const Tile&) { return 0u; }, 0, dy, tokens, top_k, hidden, ids, gates,
        positions, base, peer_bases, landing_offset, weight_offset, row_landing_offset, origin_offset, row_flag_offset,
        me, spr, max_tokens, FB_SEND_TOKENS, off, mtile, tile_start, arrival, n_cols, send_ctas, p, claimed,
        tile_ready, relay_row, finish, epoch, timeout_ns, counter, status, trace, FB_KIND_SEND, FB_KIND_RELAY,
        FB_KIND_DGRAD_DOWN);
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
        static_cast<const float*>(nullptr), tokens, top_k, FB_REDUCE_TOKENS, dx, static_cast<bf16*>(nullptr), slot_row,
        static_cast<float(*)[WARP]>(nullptr), copy_gate_grad, down_count, epoch, timeout_ns, counter, status,
        trace, FB_KIND_DGRAD_UP, FB_KIND_REDUCE);
}
