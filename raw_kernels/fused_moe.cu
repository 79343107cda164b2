// Fused MoE layer (UniEP): dispatch + up-projection and down-projection + combine as two
// persistent kernels, launched by ultraep/compute/fused/device.py after the
// Dispatcher's token map (route_keys .. plan_rows of dispatch.cu, its count barrier
// included). ultraep/compute/fused/forward.py states the task semantics in NumPy -- the task
// order, the scoreboard, where each flag is released and acquired and why no claim order
// can deadlock. The outputs are held bit for bit to the sequential path on the GPU (the
// Dispatcher, grouped_gemm.cu, swiglu.cu): the same tile arithmetic, the same sums.
//
//   fused_plan          one block: every rank's offsets and M-tile starts from the gathered
//                       count table, this rank's arrival order of its M-tiles; the
//                       counters zeroed (kernel A's streams and ticket, kernel B's claims)
//   fused_dispatch_up   send -> up tiles (SwiGLU epilogue) -> act [rows, F] BF16, and
//                       h [rows, 2F] FP32 kept for the backward (unless h is null); relay
//                       (landing -> recv rows) on the store warps beside them
//   fused_down_combine  down tiles -> expert_out (heap), and y [rows, H] kept for the
//                       backward unless y is null -> reduce -> out [T, H] BF16
//
// A block (GH_THREADS: a producer warpgroup and two consumer warpgroups, as the grouped
// GEMM) claims one task at a time: thread 0 takes the next id from the kernel's counter,
// the producer warp and the consumers read it after a barrier. GEMM tiles run the grouped
// GEMM's producer and MMAs on a 4-stage ring (grouped_gemm_common.cuh); a down tile's
// output is staged as the grouped GEMM's ring schedule stages it (its last k-step's stage and
// a tail) for the store warps, which run a loop of their own, so its stores overlap the
// block's next task (fused_common.cuh); an up tile's epilogue runs on the consumers, through
// the ring once its MMAs are done. Send and reduce tasks run on the consumer warps, a warp
// per token. In kernel A the store warps of every block claim the relays from a counter of
// their own and copy their rows beside the block's sends and MMAs; the first send_ctas
// blocks to start send first, the others take an up tile once its rows are relayed and send
// meanwhile (relays and up tiles in arrival order: the M-tiles whose rows come first go
// first). Any number of resident
// blocks is correct (a block never waits for a task claimed after its own, nor for a relay
// that no resident block's store warps can run), so the grid is the SM count whatever share
// of them MPS grants.
//
// Flags hold the call's epoch. Cross-rank flags (row_flag, done) live in the symmetric
// heap: the writer fences its data at system scope and stores the flag with release
// semantics; the reader loads it with system-scope acquire semantics. tile_ready is
// local (gpu scope), and a proxy fence on both sides orders the relay's generic stores
// before the TMA loads of the up tiles. Every wait gives up after timeout_ns and records
// (FM_FLAG_TIMED_OUT, which flag, rank, index, expected, seen, block) in status; once
// status holds a record every later wait returns at once, so a failed peer ends the
// kernel within one timeout and the host raises.
//
//! kernels: fused_plan, fused_dispatch_up, fused_down_combine
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

// fused_common.cuh first: it sets warpgroup 0's register split
#include "fused_common.cuh"
#include "grouped_gemm_common.cuh"
#include "swiglu.cuh"

// Task granularity, shared with the host (kernel_constant). The task sizes are overridable
// with -D (FusedConfig's send_tokens, reduce_tokens: ultraep/compute/fused/config.py); the host sizes
// its task lists from the same values.
#ifndef FM_SEND_TOKENS
#define FM_SEND_TOKENS 16        // tokens per send task
#endif
#ifndef FM_REDUCE_TOKENS
#define FM_REDUCE_TOKENS 16      // tokens per reduce task (every output column)
#endif
#define FM_BM GH_BM              // rows per relay task and per GEMM tile
#define FM_UP_COLS (GH_BN / 2)   // act columns per up tile: the accumulator is gate half | up half
#define FM_DOWN_COLS GH_BN       // output columns per down tile and per reduce task
#define FM_MAX_SLOTS 256         // local slots (M + S) per rank (shared-memory tables)
#define FM_MAX_TOP_K WARP        // a warp's lanes hold a token's slots
#define FM_PLAN_THREADS 256

#define FM_KIND_SEND 0
#define FM_KIND_RELAY 1
#define FM_KIND_UP 2
#define FM_KIND_DOWN 3
#define FM_KIND_REDUCE 4

// Dispatch outcome codes of dispatch.cu's plan_rows: anything but OK means no work.
#define FM_OUTCOME_OK 0

static_assert(FM_SEND_TOKENS >= 1 && FM_REDUCE_TOKENS >= 1, "task sizes are positive");
static_assert(FM_UP_COLS * 2 == GH_BN && FM_DOWN_COLS == GH_BN, "an up tile is gate | up halves of one accumulator");
static_assert(FM_DOWN_COLS == WARP * 8, "a reduce warp covers a down tile's columns, 8 BF16 per lane");
static_assert(GH_CONSUMERS * 4 == 8, "send and reduce tasks run on the 8 consumer warps");

// -- the plan ------------------------------------------------------------------------------------

// The arrival band of rows [lo, hi) of expert e's rows on its rank, which come from the
// sources in rank order, source s's count table[s * table_cols + e] of them
// (ultraep/compute/fused/forward.py's tile_band): where the last row stands in its source's
// segment, in FM_ARRIVAL_BANDS steps; rows of two sources wait for the first one's last row:
// the last band. `s` and `start` walk forward over the sources: a slot's M-tiles ask in order.
__device__ __forceinline__ int tile_band(const int* table, int table_cols, int ranks, int e, int lo, int hi, int& s,
                                         int& start) {
    for (; s < ranks; ++s) {
        const int count = table[s * table_cols + e];
        if (hi - 1 < start + count)
            return lo < start ? FM_ARRIVAL_BANDS - 1 : (FM_ARRIVAL_BANDS * (hi - start) - 1) / count;
        start += count;
    }
    return FM_ARRIVAL_BANDS - 1;  // not reached: hi is at most the slot's rows
}

// From the gathered count table (rows: sources; columns: num_experts pair counts first):
// rank_off[r * (spr + 1) + j] = rank r's expert-major offsets, rank_mtile[...] its first
// M-tile per slot (the last entry the total); `arrival` (forward.py's arrival_tables) this
// rank's M-tiles by band, slot and M-tile: the FM_ARRIVAL_BANDS * spr run sizes' prefix, then
// the order (room for `max_tiles` M-tiles). Zeroes the counters (FM_COUNTERS) and the
// per-M-tile counts of finished down tiles (a failed call may have left some short).
extern "C" __global__ void fused_plan(const int* table, int ranks, int num_experts, int table_cols, int spr, int me,
                                      int* rank_off, int* rank_mtile, int* arrival, int* counters, int* down_count,
                                      int max_tiles) {
    __shared__ int run[FM_ARRIVAL_BANDS * FM_MAX_SLOTS];  // per run: its size, then where its next M-tile goes
    const int runs = FM_ARRIVAL_BANDS * spr;
    if (threadIdx.x < FM_COUNTERS) counters[threadIdx.x] = 0;
    for (int q = threadIdx.x; q < runs; q += blockDim.x) run[q] = 0;
    for (int m = threadIdx.x; m < max_tiles; m += blockDim.x) down_count[m] = 0;
    for (int r = threadIdx.x; r < ranks; r += blockDim.x) {
        int rows = 0, tiles = 0;
        for (int j = 0; j < spr; ++j) {
            rank_off[r * (spr + 1) + j] = rows;
            rank_mtile[r * (spr + 1) + j] = tiles;
            int count = 0;
            for (int s = 0; s < ranks; ++s) count += table[s * table_cols + r * spr + j];
            rows += count;
            tiles += ceil_div(count, FM_BM);
        }
        rank_off[r * (spr + 1) + spr] = rows;
        rank_mtile[r * (spr + 1) + spr] = tiles;
    }
    __syncthreads();  // this rank's offsets and M-tile starts, written above by thread me
    // More rows than the receive bound (the token map's verdict, which stops kernels A and B):
    // no order, whose M-tiles would not fit the `max_tiles` the buffer holds.
    if (rank_mtile[me * (spr + 1) + spr] > max_tiles) return;
    const int* off = rank_off + me * (spr + 1);
    for (int j = threadIdx.x; j < spr; j += blockDim.x) {  // a thread per slot: the slot's runs are its own
        const int rows = off[j + 1] - off[j];
        for (int lo = 0, s = 0, start = 0; lo < rows; lo += FM_BM)
            ++run[tile_band(table, table_cols, ranks, me * spr + j, lo, min(rows, lo + FM_BM), s, start) * spr + j];
    }
    __syncthreads();
    if (threadIdx.x < WARP) {  // the runs' prefix on warp 0, a stretch of runs per lane
        const int lane = threadIdx.x, per_lane = ceil_div(runs, WARP);
        const int first = min(lane * per_lane, runs), last = min(first + per_lane, runs);
        int sum = 0;
        for (int q = first; q < last; ++q) sum += run[q];
        int inclusive = sum;
#pragma unroll
        for (int d = 1; d < WARP; d *= 2) {
            const int v = __shfl_up_sync(FULL_MASK, inclusive, d);
            if (lane >= d) inclusive += v;
        }
        for (int q = first, at = inclusive - sum; q < last; ++q) {
            const int size = run[q];
            arrival[q] = run[q] = at;
            at += size;
        }
        if (lane == WARP - 1) arrival[runs] = inclusive;
    }
    __syncthreads();
    int* order = arrival + runs + 1;
    for (int j = threadIdx.x; j < spr; j += blockDim.x) {
        const int rows = off[j + 1] - off[j], first = rank_mtile[me * (spr + 1) + j];
        for (int lo = 0, s = 0, start = 0; lo < rows; lo += FM_BM)
            order[run[tile_band(table, table_cols, ranks, me * spr + j, lo, min(rows, lo + FM_BM), s, start) * spr +
                      j]++] = first + lo / FM_BM;
    }
}

// An up tile's SwiGLU on its 256 consumer threads (`id`), from the FP32 tile staged in the
// ring (RING_TILE_PITCH a row, gate columns then the matching up columns): four columns of a
// row per item, act stored as BF16 and, with h (a training forward), h's gate and up columns
// as FP32, all straight to global memory. A runtime loop over the staged tile, not the
// accumulators' registers: unrolled over the registers, the SwiGLU of a thread's 64 pairs
// outgrows the instruction cache, and here a warp writes whole rows. Each iteration loads its
// UNROLL items, then takes their SwiGLU as one batch (swiglu_rn_batch), then stores them.
__device__ __forceinline__ void swiglu_up_tile(unsigned ring, const Tile& tile, bf16* act, float* h, int ffn, int id) {
    constexpr int PER = 4, ROW_ITEMS = FM_UP_COLS / PER, THREADS = 128 * GH_CONSUMERS, UNROLL = 4;
    static_assert(GH_BM * ROW_ITEMS % (THREADS * UNROLL) == 0, "every thread runs the same iterations");
    for (int i0 = id; i0 < GH_BM * ROW_ITEMS; i0 += THREADS * UNROLL) {
        float gate[UNROLL * PER], up[UNROLL * PER];
        __nv_bfloat16 a[UNROLL * PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // rows past the tile's end are staged too: their results go nowhere
            const int i = i0 + u * THREADS, row = i / ROW_ITEMS, c = i % ROW_ITEMS * PER;
            const unsigned at = ring + row * RING_TILE_PITCH + c * 4;
            float* g = gate + u * PER;
            float* v = up + u * PER;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(g[0]), "=f"(g[1]), "=f"(g[2]), "=f"(g[3])
                         : "r"(at));
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                         : "r"(at + FM_UP_COLS * 4));
        }
        swiglu_rn_batch(gate, up, a);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int i = i0 + u * THREADS, row = i / ROW_ITEMS, c = i % ROW_ITEMS * PER;
            const int r = tile.row0 + row, f = tile.col0 + c;
            if (r >= tile.row_end || f >= ffn) continue;  // ffn is a multiple of 8: f < ffn holds f + 3 too
            *reinterpret_cast<uint2*>(act + static_cast<long long>(r) * ffn + f) =
                *reinterpret_cast<const uint2*>(a + u * PER);
            if (h != nullptr) {
                float* h_row = h + static_cast<long long>(r) * 2 * ffn + f;
                *reinterpret_cast<float4*>(h_row) = make_float4(gate[u * PER], gate[u * PER + 1], gate[u * PER + 2],
                                                                gate[u * PER + 3]);
                *reinterpret_cast<float4*>(h_row + ffn) = make_float4(up[u * PER], up[u * PER + 1], up[u * PER + 2],
                                                                      up[u * PER + 3]);
            }
        }
    }
}

// -- kernel A: dispatch + up-projection ------------------------------------------------------------

// Tasks: [0, n_send) send, then one relay per M-tile, then up tiles, both in arrival order
// (arrival_tile): send_relay_then_gemm, the first send_ctas blocks to start sending before
// anything else, the relays on the store warps; the relay a row copy into
// recv (gpu-scope fence: only this rank's TMA reads it), an up tile's epilogue SwiGLU into
// act [rows, F]. recv_map: recv [max_rows, H] as
// (H, rows), box 64 x 128; w_up_map: w_up [slots, H, 2F] as (2F, H, slots), boxes 64 x 64 x 1.
extern "C" __global__ void __launch_bounds__(GH_THREADS, 1)
fused_dispatch_up(const __grid_constant__ TensorMap recv_map, const __grid_constant__ TensorMap w_up_map,
                  const uint4* x, int tokens, int top_k, int hidden, const long long* ids, const float* gates,
                  const int* positions, const int* base, const u64* peer_bases, u64 landing_offset, u64 weight_offset,
                  u64 row_landing_offset, u64 origin_offset, u64 row_flag_offset, int me, int spr, int max_tokens,
                  const int* rank_off, const int* rank_mtile, const int* arrival, int send_ctas, int max_rows,
                  uint4* recv, u64* tile_ready, int ffn, bf16* act, float* h, u64 epoch, u64 timeout_ns, int* counter,
                  long long* status, const int* outcome, u64* trace) {
    __shared__ int off[FM_MAX_SLOTS + 1], mtile[FM_MAX_SLOTS + 1], tile_start[FM_MAX_SLOTS + 1];
    __shared__ Pipeline p;
    __shared__ int claimed[2];  // the block's claim, the store warps' relay
    if (outcome[0] != FM_OUTCOME_OK) return;  // every block of every rank reads the same verdict
    const int n_cols = load_tables(off, mtile, tile_start, p, rank_off, rank_mtile, me, spr, ffn, FM_UP_COLS);
    // Tile t of the up tiles: gate columns [c0, c0 + 128) and up columns F + [c0, c0 + 128) of slot j.
    auto up_tile = [&](int t) { return arrival_tile(arrival, off, mtile, spr, n_cols, t, FM_UP_COLS, hidden); };
    auto boxes = [&](const Tile& tile) {
        const unsigned half = ffn - tile.col0 > GH_BOX ? 3u : 1u;  // each half's boxes left of F
        return half | half << 2;
    };
    auto relay_row = [&](int row, const uint4* landing, const int* row_landing) {
        const int row_vecs = hidden * 2 / 16;
        warp_copy_row<FM_RELAY_UNROLL>(landing + static_cast<long long>(row_landing[row]) * row_vecs,
                                       recv + static_cast<long long>(row) * row_vecs, row_vecs, threadIdx.x % WARP);
    };
    // The epilogue on the consumers alone, through the idle stage ring: the FP32 tile (gate
    // half | up half) staged, then act (and with h, h) stored from it by swiglu_up_tile.
    auto finish = [&](const float (&d)[128], const Tile& tile, unsigned ring, int consumer, int warp, int lane) {
        stage_accumulators_fp32(d, ring, consumer, warp, lane);
        consumers_sync();
        swiglu_up_tile(ring, tile, act, h, ffn, threadIdx.x - 128);
    };
    // The up half's boxes are F further than the gate half's.
    send_relay_then_gemm<GH_FORWARD, false>(
        &recv_map, &w_up_map, up_tile, boxes, ffn - FM_UP_COLS, x, tokens, top_k, hidden, ids, gates, positions, base,
        peer_bases, landing_offset, weight_offset, row_landing_offset, origin_offset, row_flag_offset, me, spr,
        max_tokens, FM_SEND_TOKENS, off, mtile, tile_start, arrival, n_cols, send_ctas, p, claimed, tile_ready,
        relay_row, finish, epoch, timeout_ns, counter, status, trace, FM_KIND_SEND, FM_KIND_RELAY, FM_KIND_UP);
}

// -- kernel B: down-projection + combine -----------------------------------------------------------

// Tasks: down tiles in the grouped GEMM's order (gemm_tile), then reduce
// tasks (a token chunk, every column): gemm_tiles_then_reduce, weighted by the gates. y
// (null in an inference forward): the down tiles' outputs [rows, H] kept for the backward.
// act_map: act [max_rows, F] as (F, rows), box 64 x 128; w_down_map: w_down [slots, F, H] as
// (H, F, slots), boxes 64 x 64 x 1. expert_out and the done flags are heap tensors (offsets
// from each peer's base): reducers read them on the experts' ranks.
extern "C" __global__ void __launch_bounds__(GH_THREADS, 1)
fused_down_combine(const __grid_constant__ TensorMap act_map, const __grid_constant__ TensorMap w_down_map,
                   int ffn, int hidden, const u64* peer_bases, u64 expert_out_offset, u64 done_offset, int me,
                   int spr, const int* rank_off, const int* rank_mtile, const long long* ids, const int* positions,
                   const int* base, const float* gates, int tokens, int top_k, bf16* out, bf16* y, int* down_count,
                   u64 epoch,
                   u64 timeout_ns, int* counter, long long* status, const int* outcome, u64* trace) {
    __shared__ int off[FM_MAX_SLOTS + 1], mtile[FM_MAX_SLOTS + 1], tile_start[FM_MAX_SLOTS + 1];
    __shared__ Pipeline p;
    __shared__ int claimed;
    __shared__ const uint4* slot_row[GH_CONSUMERS * 4][FM_MAX_TOP_K];
    __shared__ float slot_gate[GH_CONSUMERS * 4][FM_MAX_TOP_K];
    if (outcome[0] != FM_OUTCOME_OK) return;
    const int n_cols = load_tables(off, mtile, tile_start, p, rank_off, rank_mtile, me, spr, hidden, FM_DOWN_COLS);
    // the boxes of w_down's columns left of H
    auto boxes = [&](const Tile& tile) {
        return (1u << min(GH_BN / GH_BOX, ceil_div(hidden - tile.col0, GH_BOX))) - 1;
    };
    auto tile_of = [&](int t) { return gemm_tile(tile_start, off, spr, t, FM_DOWN_COLS, ffn); };
    gemm_tiles_then_reduce<GH_FORWARD, true>(&act_map, &w_down_map, tile_of, boxes, n_cols, hidden, peer_bases,
                                             expert_out_offset, done_offset, me, spr, rank_off, rank_mtile, off,
                                             mtile, tile_start, p, &claimed, ids, positions, base, gates, tokens,
                                             top_k, FM_REDUCE_TOKENS, out, y, slot_row, slot_gate, [](int, u64) {},
                                             down_count, epoch, timeout_ns, counter, status, trace, FM_KIND_DOWN,
                                             FM_KIND_REDUCE);
}
