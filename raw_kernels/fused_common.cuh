// What the fused MoE kernels share (fused_moe.cu, fused_moe_backward.cu): the status and
// timeline words, bounded flag waits, the token send and row copy of a warp, the task loop's
// pieces -- the shared tables, claiming a task, the GEMM stage ring and its hand-overs to the
// store warps -- and the task loops themselves: kernels A and C's (send and GEMM tiles of the
// relayed rows, the relays on the store warps beside them) and kernels B and D's (GEMM tiles
// into the heap, then the slot-order reduce). Everything is inline: a function call anywhere
// in a kernel makes ptxas serialise its wgmma instructions. ultraep/compute/fused/forward.py
// states the task semantics they serve.
#pragma once

#include <cuda_bf16.h>

// Warpgroup 0's registers a thread after setmaxnreg: the store warps of kernels A and C
// relay rows (relay_on_store_warps), whose loop state and copy need more than the grouped
// GEMM's 40 (at 40 kernel A spilled 44 bytes, kernel C's grad_row 356; at 72 kernel C still
// 4); the consumers compile without spills at 208 in all four kernels. 128 x 88 + 256 x 208
// = the 384 x 168 the launch reserves. Before grouped_gemm_common.cuh, which defaults them.
#ifndef GH_PRODUCER_REGISTERS
#define GH_PRODUCER_REGISTERS 88
#define GH_CONSUMER_REGISTERS 208
#endif
#include "grouped_gemm_common.cuh"
#include "swiglu.cuh"
static_assert(128 * GH_PRODUCER_REGISTERS + 256 * GH_CONSUMER_REGISTERS <= 384 * 168,
              "the register split fits what the launch reserves");

// The fused kernels' stage ring is 4 deep (the grouped GEMM's staged schedule: 3), so a TMA
// copy gets three k-steps of MMAs to land instead of two. No kernel keeps a staging buffer
// beside it: kernels A and C stage their epilogues in the ring, idle between a tile's last MMA
// and the next claim; kernels B and D stage their output tiles as grouped_gemm.cu's ring
// schedule does, in the stage of the tile's last k-step and a GH_TAIL_BYTES tail after the
// ring. FM_SMEM_BYTES: the dynamic shared memory each launch reserves.
#define FM_STAGES 4
#define FM_SMEM_BYTES (FM_STAGES * GH_STAGE_BYTES + GH_TAIL_BYTES + 1024)

// Overridable with -D (FusedConfig's copy_unroll, reduce_unroll: ultraep/compute/fused/config.py); no
// result bit depends on them (a reduce still adds its slots one by one in slot order).
#ifndef FM_UNROLL
#define FM_UNROLL 4              // 16-byte loads in flight per lane in copies
#endif
#ifndef FM_REDUCE_UNROLL
#define FM_REDUCE_UNROLL 8       // slots read at once per lane in a reduce
#endif
static_assert(FM_UNROLL >= 1 && FM_REDUCE_UNROLL >= 1, "the copy and reduce unrolls are positive");
// 16-byte loads in flight per lane in a relay's row copy on the store warps: fixed, not
// FM_UNROLL, which the consumers' sends may raise past what warpgroup 0's registers hold.
// No bit depends on it (grad_row's dot visits a lane's columns in the same order).
#define FM_RELAY_UNROLL 4

// status[0] (after the grouped GEMM's codes 1..4), then status[1] the flag, status[2] the
// rank waited on, [3] the flag's index, [4] the epoch expected, [5] the value seen, [6] the block.
#define FM_STATUS_WORDS 8
#define FM_FLAG_TIMED_OUT 5
#define FM_ROW_FLAG 1      // a receive row's arrival (written by its sender)
#define FM_TILE_READY 2    // an M-tile's rows relayed into the receive buffer
#define FM_TILE_DONE 3     // an M-tile's output rows written, every column (read by the reducers)

// The optional task timeline: per task id [start ns, end ns, SM id | kind << 32].
#define FM_TRACE_WORDS 3

// Arrival bands of kernels A and C's relays and first GEMM tiles (fused_moe.cu's fused_plan,
// arrival_tile): an M-tile's band is where its last row stands in its source's segment of
// the slot. Only speed depends on it; the host's task order reads it (Granularity.bands).
#define FM_ARRIVAL_BANDS 8

// The task counters of kernels A and C: sends, relays, GEMM tiles, and the ticket that makes
// a block a sender; kernels B and D's one claim counter follows them.
#define FM_SEND_COUNTER 0
#define FM_RELAY_COUNTER 1
#define FM_TILE_COUNTER 2
#define FM_SENDER_TICKET 3
#define FM_COUNTERS 5

// -- bounded flag waits ------------------------------------------------------------------------

__device__ __forceinline__ bool aborted(const long long* status) {
    return *reinterpret_cast<const volatile long long*>(status) != 0;
}

// Waits until *flag == epoch; false on timeout (recorded) or once an earlier wait anywhere in
// this kernel has recorded one. Inline: a function call anywhere in a kernel makes ptxas
// serialise its wgmma instructions.
__device__ __forceinline__ bool wait_flag(const u64* flag, u64 epoch, u64 timeout_ns, long long* status, int what,
                                          int rank, long long index) {
    u64 seen = load_acquire_sys(flag);
    if (seen == epoch) return true;
    const u64 start = global_timer_ns();
    while ((seen = load_acquire_sys(flag)) != epoch) {
        if (aborted(status)) return false;
        if (global_timer_ns() - start > timeout_ns) {
            unsigned long long* word = reinterpret_cast<unsigned long long*>(status);
            if (atomicCAS(word, 0ull, static_cast<unsigned long long>(FM_FLAG_TIMED_OUT)) == 0ull) {
                status[1] = what;
                status[2] = rank;
                status[3] = index;
                status[4] = static_cast<long long>(epoch);
                status[5] = static_cast<long long>(seen);
                status[6] = blockIdx.x;
            }
            return false;
        }
    }
    return true;
}

// -- copies ----------------------------------------------------------------------------------------

// Row `src` to row `dst` by one warp, 16-byte vectors, LOADS loads in flight per lane.
// Plain loads: peers wrote src during this kernel.
template <int LOADS>
__device__ __forceinline__ void warp_copy_row(const uint4* src, uint4* dst, int row_vecs, int lane) {
    for (int v0 = 0; v0 < row_vecs; v0 += WARP * LOADS) {
        uint4 buf[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) buf[u] = src[v];
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) dst[v] = buf[u];
        }
    }
}

// Kernel A's send task for one token (a warp): as dispatch.cu's send_tokens -- lane k < K
// writes slot k's gate, landing row and origin into its receive row on its rank; the token
// goes once to each destination rank's landing rows -- then the warp fences its writes at
// system scope and lane k releases row_flag of slot k's row on its rank.
__device__ __forceinline__ void send_token(int t, const uint4* x, int top_k, int row_vecs, const long long* ids,
                                           const float* gates, const int* positions, const int* base, int n,
                                           const u64* peer_bases, u64 landing_offset, u64 weight_offset,
                                           u64 row_landing_offset, u64 origin_offset, u64 row_flag_offset, int me,
                                           int spr, int max_tokens, u64 epoch, int lane) {
    u64 dest = 0, flag = 0;
    bool sends = false;
    if (lane < top_k) {
        const int i = t * top_k + lane;
        const int expert = static_cast<int>(ids[i]);
        const int rank = expert / spr;
        const u64 peer = peer_bases[rank];
        sends = positions[n + i] >= 0;
        dest = peer + landing_offset + (static_cast<u64>(me) * max_tokens + positions[n + i]) * row_vecs * sizeof(uint4);
        int first_slot = lane;
        for (int k = lane - 1; k >= 0; --k)
            if (static_cast<int>(ids[t * top_k + k]) / spr == rank) first_slot = k;
        const int row = base[expert] + positions[i];
        reinterpret_cast<float*>(peer + weight_offset)[row] = gates[i];
        reinterpret_cast<int*>(peer + row_landing_offset)[row] = me * max_tokens + positions[n + t * top_k + first_slot];
        reinterpret_cast<int*>(peer + origin_offset)[row] = me * max_tokens * top_k + i;
        flag = peer + row_flag_offset + static_cast<u64>(row) * sizeof(u64);
    }
    const uint4* src = x + static_cast<long long>(t) * row_vecs;
    const unsigned send_mask = __ballot_sync(FULL_MASK, sends);
    for (int v0 = 0; v0 < row_vecs; v0 += WARP * FM_UNROLL) {  // the token read once, stored to each rank
        uint4 buf[FM_UNROLL];
#pragma unroll
        for (int u = 0; u < FM_UNROLL; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) buf[u] = __ldg(src + v);
        }
        for (unsigned m = send_mask; m; m &= m - 1) {
            uint4* dst = reinterpret_cast<uint4*>(__shfl_sync(FULL_MASK, dest, __ffs(m) - 1));
#pragma unroll
            for (int u = 0; u < FM_UNROLL; ++u) {
                const int v = v0 + u * WARP + lane;
                if (v < row_vecs) dst[v] = buf[u];
            }
        }
    }
    __threadfence_system();
    __syncwarp();
    if (lane < top_k) store_release_sys(reinterpret_cast<u64*>(flag), epoch);
}

// -- the task loop's shared pieces ----------------------------------------------------------------

// The SM this thread runs on: a timeline row's worker.
__device__ __forceinline__ unsigned sm_id() {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    return sm;
}

// The stage ring's barriers, and the hand-over to the store warps: output_full (the consumer
// warps' arrivals) and output_empty (the store warps'), with the task id handed over.
struct Pipeline {
    u64 full[FM_STAGES], empty[FM_STAGES], output_full, output_empty;
    int handed_task;
};

__device__ __forceinline__ void init_pipeline(Pipeline& p) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < FM_STAGES; ++s) {
            mbarrier_init(&p.full[s], 1);
            mbarrier_init(&p.empty[s], GH_CONSUMERS * 4);
        }
        mbarrier_init(&p.output_full, GH_CONSUMERS * 4);
        mbarrier_init(&p.output_empty, GH_STORE_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}

// The stage ring in dynamic shared memory, 1024-aligned for the swizzled TMA boxes; in kernels
// B and D a staged tile's tail follows it (the ring's stages further).
__device__ __forceinline__ unsigned stage_ring() {
    extern __shared__ unsigned char dynamic_shared[];
    return (shared_address(dynamic_shared) + 1023) & ~1023u;
}

// This rank's tables in shared memory -- off[j] slot j's first row, mtile[j] its first M-tile
// (entry spr the totals), tile_start the grouped GEMM's tile prefix over the column blocks
// of `block_cols` in `cols` -- and the stage ring's barriers, before any task. Returns the
// number of column blocks.
__device__ __forceinline__ int load_tables(int* off, int* mtile, int* tile_start, Pipeline& p, const int* rank_off,
                                           const int* rank_mtile, int me, int spr, int cols, int block_cols) {
    for (int j = threadIdx.x; j <= spr; j += blockDim.x) {
        off[j] = rank_off[me * (spr + 1) + j];
        mtile[j] = rank_mtile[me * (spr + 1) + j];
    }
    __syncthreads();
    if (threadIdx.x < WARP) tile_prefix(tile_start, off, spr, GH_BM, ceil_div(cols, block_cols));
    const int n_cols = ceil_div(cols, block_cols);
    init_pipeline(p);
    __syncthreads();
    return n_cols;
}

// GEMM tile t in the grouped GEMM's order (slot, then grouped_raster's (M-tile, column
// block)): `cols` output columns per block, a reduction over `k`.
__device__ __forceinline__ Tile gemm_tile(const int* tile_start, const int* off, int spr, int t, int cols, int k) {
    const int j = expert_of_tile(tile_start, spr, t);  // a slot with tiles: m_tiles >= 1
    const int m_tiles = ceil_div(off[j + 1] - off[j], GH_BM), n_tiles = (tile_start[j + 1] - tile_start[j]) / m_tiles;
    const int2 mn = grouped_raster(t - tile_start[j], m_tiles, n_tiles);
    return Tile{j, off[j] + mn.x * GH_BM, off[j + 1], mn.y * cols, 0, k};
}

// Where GEMM tile t of kernels A and C stands in arrival order (ultraep/compute/fused/forward.py's
// task_order): `arrival` is fused_plan's -- run q (band q / spr of slot q % spr) holds the
// M-tiles [arrival[q], arrival[q + 1]) of the order that follows the FM_ARRIVAL_BANDS * spr
// + 1 run starts -- and a run's tiles are its M-tiles x `n_cols` column blocks in
// grouped_raster's order. Returns its run (the last whose first tile is <= t: one with
// tiles), M-tile id and column block.
__device__ __forceinline__ int3 arrival_place(const int* arrival, int spr, int n_cols, int t) {
    const int runs = FM_ARRIVAL_BANDS * spr;
    int lo = 0, hi = runs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (__ldg(arrival + mid) * n_cols <= t) lo = mid; else hi = mid - 1;
    }
    const int first = __ldg(arrival + lo), count = __ldg(arrival + lo + 1) - first;
    const int2 mn = grouped_raster(t - first * n_cols, count, n_cols);
    return make_int3(lo, __ldg(arrival + runs + 1 + first + mn.x), mn.y);
}

// Tile t itself: `cols` output columns per block, a reduction over `k`.
__device__ __forceinline__ Tile arrival_tile(const int* arrival, const int* off, const int* mtile, int spr,
                                             int n_cols, int t, int cols, int k) {
    const int3 place = arrival_place(arrival, spr, n_cols, t);
    const int j = place.x % spr;
    return Tile{j, off[j] + (place.y - mtile[j]) * GH_BM, off[j + 1], place.z * cols, 0, k};
}

// This rank's index of a tile's M-tile: the index of its tile_ready and done flags.
__device__ __forceinline__ int mtile_of(const int* mtile, const int* off, const Tile& tile) {
    return mtile[tile.expert] + (tile.row0 - off[tile.expert]) / GH_BM;
}

// A GEMM tile of relayed rows (kernels A and C) is handed to the block once its M-tile's rows
// are relayed, tile_ready[m] (acquire); the proxy fence orders the relay's generic stores
// before this thread's TMA loads of them.
__device__ __forceinline__ void wait_rows_relayed(const u64* tile_ready, int m, u64 epoch, u64 timeout_ns,
                                                  long long* status, int me) {
    // twice the relay's bound: a relay that gives up on a sender records that first, and the
    // copies of the relays ahead of this one take milliseconds
    wait_flag(tile_ready + m, epoch, 2 * timeout_ns, status, FM_TILE_READY, me, m);
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The next task id of this block. Thread 0 takes it (`take()`: a counter's next value)
// between two named barriers of the threads that claim -- the producer warp and the
// consumers (the store warps run loops of their own) -- and they read it after the second;
// the first means they have all read the last id. Non-aligned barriers: the producer
// warp's lane 0 may still be diverged from its warp.
__device__ __forceinline__ void claim_sync() {
    asm volatile("barrier.sync 4, %0;" :: "n"(GH_THREADS - GH_STORE_WARPS * WARP) : "memory");
}

// `ready(task)` runs on thread 0 -- the producer thread -- before the block sees the task:
// a wait there keeps the consumers from waiting on a stage (whose timeout is a bug
// detector's) while a peer's data is legitimately late. With a `trace`, thread 0 also
// stamps the task's start (before that wait) and, at its next claim, the end of the task
// it last claimed (`last`, total for none): the barrier between means the producer and the
// consumers are done with it -- a GEMM tile's end is its hand-over to the store warps,
// whose stores overlap what the block runs next.
template <typename Take, typename Ready, typename Kind>
__device__ __forceinline__ int claim(Take take, int* claimed, int total, Ready ready, Kind kind, u64* trace,
                                     int& last) {
    claim_sync();
    if (threadIdx.x == 0) {
        const u64 now = trace != nullptr ? global_timer_ns() : 0;
        if (trace != nullptr && last < total) trace[FM_TRACE_WORDS * last + 1] = now;
        const int task = take();
        if (task < total) {
            if (trace != nullptr) {
                trace[FM_TRACE_WORDS * task] = now;
                trace[FM_TRACE_WORDS * task + 2] = sm_id() | static_cast<u64>(kind(task)) << 32;
            }
            ready(task);
        }
        *claimed = task;
        last = task;
    }
    claim_sync();
    return *claimed;
}

__device__ __forceinline__ void store_warps_sync() {
    asm volatile("barrier.sync 2, %0;" :: "n"(GH_STORE_WARPS * WARP) : "memory");
}

// Whether `vote` holds on any store-warp thread, on all of them (store_warps_sync's barrier).
__device__ __forceinline__ bool store_warps_any(bool vote) {
    unsigned any;
    asm volatile("{\n .reg .pred vote, any;\n setp.ne.u32 vote, %1, 0;\n"
                 " barrier.red.or.pred any, 2, %2, vote;\n selp.u32 %0, 1, 0, any;\n}"
                 : "=r"(any) : "r"(static_cast<unsigned>(vote)), "n"(GH_STORE_WARPS * WARP) : "memory");
    return any != 0;
}

// Stage a consumer's accumulators as BF16 for the store warps. Accumulator d[4j + {0, 1}] is
// row lane/4, columns 8j + 2 (lane%4) + {0, 1} of the warp's 16 rows; d[4j + {2, 3}] the same
// 8 rows further.
__device__ __forceinline__ void stage_accumulators(const float (&d)[128], unsigned staged, int consumer, int warp,
                                                   int lane) {
    const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < GH_BN / 8; ++j) {
            const int i = 4 * j + 2 * half;
            const __nv_bfloat162 v = __floats2bfloat162_rn(d[i], d[i + 1]);
            asm volatile("st.shared.b32 [%0], %1;" :: "r"(staged + (row + 8 * half) * GH_C_PITCH + (col + 8 * j) * 2),
                         "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
        }
}

// A whole FP32 tile, GH_BM rows of GH_BN columns, staged in the stage ring, which is idle
// between a tile's last MMA and the next claim (the producer issues the next tile's copies
// only after the claim's barrier). Rows padded by 32 bytes: a warp's fragment
// stores (8 rows x 4 lanes of 8 bytes) take the two wavefronts 256 bytes need.
#define RING_TILE_PITCH (GH_BN * 4 + 32)
static_assert(GH_BM * RING_TILE_PITCH <= FM_STAGES * GH_STAGE_BYTES, "an FP32 tile fits in the idle stage ring");

__device__ __forceinline__ void stage_accumulators_fp32(const float (&d)[128], unsigned ring, int consumer, int warp,
                                                        int lane) {
    const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < GH_BN / 8; ++j) {
            const int i = 4 * j + 2 * half;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};"
                         :: "r"(ring + (row + 8 * half) * RING_TILE_PITCH + (col + 8 * j) * 4), "f"(d[i]), "f"(d[i + 1])
                         : "memory");
        }
}


// A consumer warp's hand-over to the store warps: once they have freed the staged tile's tail
// (output_empty of the hand-over before), `stage()` stages this thread's part and the
// block's first consumer thread writes `task` -- a GEMM tile's id, or the block's first
// claim past its tiles, which ends the store warps' loop -- then the warp arrives on
// output_full (a release; the store warps' wait acquires). The caller flips phase.
template <typename Stage>
__device__ __forceinline__ void hand_to_stores(Pipeline& p, int phase, int task, long long* status, bool& gave_up,
                                               int lane, Stage stage) {
    stage_wait(&p.output_empty, phase ^ 1, status, GH_WAITED_FOR_STORES, gave_up);
    if (threadIdx.x == 128) p.handed_task = task;
    stage();
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&p.output_full);
}

// A store warp's wait for the consumers' next hand-over, bounded and recorded as a stage
// wait. It gives up at once when a stage wait has (status
// GH_STAGE_TIMED_OUT): consumers that gave up no longer wait for the buffer, so hand-overs
// may be missed. After a flag wait's record the hand-overs stay in step (no flag wait sets
// gave_up), and the store warps serve them to the end rather than make the consumers' next
// wait for the buffer time out.
__device__ __forceinline__ void wait_for_hand_over(Pipeline& p, int phase, long long* status,
                                                   bool& gave_up) {
    const unsigned address = shared_address(&p.output_full);
    const u64 start = global_timer_ns();
    while (!gave_up && !mbarrier_try_wait<false>(address, phase)) {
        if (*reinterpret_cast<const volatile long long*>(status) == GH_STAGE_TIMED_OUT) {
            gave_up = true;
        } else if (global_timer_ns() - start > MBARRIER_TIMEOUT_NS) {
            record_stage_timeout(status, GH_WAITED_FOR_OUTPUT);
            gave_up = true;
        }
    }
}

// The store warps' own loop, from their block's first GEMM tile on: each tile the consumers
// hand over, `store(task)` stores this thread's part of task's output from the staging
// buffer, then each warp frees the buffer; the loop ends at the hand-over of a task at or
// past `end_tile` (the block's first claim past its tiles). The three warps decide together
// to give up (a vote), so none is left alone in a store_warps_sync of `store`; they leave,
// and the consumers' next wait for the buffer gives up in turn, bounded: the block does not
// hang.
// Why this loop cannot deadlock: a store warp waits only for its own block's next hand-over,
// which the consumers make once a tile's MMAs are done (or at their claim past the tiles),
// waiting for no other task. What waits for the store warps -- the consumers for the tail,
// the producer for a tile's last stage, kernels B and D's reducers for a done flag -- waits
// on work that needs nothing but hand-overs already made. So a claimed tile finishes whatever
// its block runs next (a reduce waiting for that tile's own done flag included), and the task
// order's argument (ultraep/compute/fused/forward.py) holds as before.
template <typename Store>
__device__ __forceinline__ void store_handed_tiles(Pipeline& p, int end_tile, long long* status,
                                                   Store store) {
    const int lane = threadIdx.x % WARP;
    bool gave_up = false;
    for (int phase = 0;; phase ^= 1) {
        wait_for_hand_over(p, phase, status, gave_up);
        if (store_warps_any(gave_up)) return;
        const int task = *reinterpret_cast<volatile int*>(&p.handed_task);
        if (task >= end_tile) return;
        store(task);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&p.output_empty);
    }
}

// -- kernels A and C: send, then GEMM tiles of the relayed rows; relays on the store warps ----------

// The relays of kernels A and C on the store warps of every block, beside the block's claimed
// tasks: one M-tile at a time from the rank's relay counter (counter[FM_RELAY_COUNTER]; the
// id read through claimed[1]), relay i the M-tile `order[i]` (arrival order), `n_relay` of
// them; the three warps take a row at a time: wait for its row_flag, then `relay_row(row,
// landing, row_landing)` (this rank's landing rows and the heap's row_landing). Each thread then fences its stores -- the proxy fence orders
// them before the TMA loads of the tiles that read them, the fence at gpu scope or (SYSTEM)
// system scope before the flag -- and after the warps' barrier one thread releases
// tile_ready[m], stamps the relay's end and claims the next. A relay's timeline row is
// `first_row` + i (its task id in send_relay_then_gemm), stamped from its claim
// (before its row waits) to its release.
template <bool SYSTEM, typename RelayRow>
__device__ __forceinline__ void relay_on_store_warps(int* counter, int* claimed, int n_relay, const int* order,
                                                     const int* off, const int* mtile, int spr, u64 heap,
                                                     u64 landing_offset, u64 row_landing_offset, u64 row_flag_offset,
                                                     u64* tile_ready, RelayRow relay_row, u64 epoch, u64 timeout_ns,
                                                     long long* status, int me, u64* trace, int first_row,
                                                     int relay_kind) {
    const int id = threadIdx.x - WARP, warp = id / WARP;  // among the store warps
    const uint4* landing = reinterpret_cast<const uint4*>(heap + landing_offset);
    const int* row_landing = reinterpret_cast<const int*>(heap + row_landing_offset);
    const u64* row_flag = reinterpret_cast<const u64*>(heap + row_flag_offset);
    for (int relay = -1, m = 0;;) {
        store_warps_sync();  // the last relay's rows are relayed and fenced, its id read by every thread
        if (id == 0) {
            const u64 now = trace != nullptr ? global_timer_ns() : 0;
            if (relay >= 0) {
                if (!aborted(status)) store_release_sys(tile_ready + m, epoch);
                if (trace != nullptr) trace[FM_TRACE_WORDS * (first_row + relay) + 1] = now;
            }
            const int next = atomicAdd(counter + FM_RELAY_COUNTER, 1);
            if (trace != nullptr && next < n_relay) {
                trace[FM_TRACE_WORDS * (first_row + next)] = now;
                trace[FM_TRACE_WORDS * (first_row + next) + 2] = sm_id() | static_cast<u64>(relay_kind) << 32;
            }
            claimed[1] = next;
        }
        store_warps_sync();
        relay = *reinterpret_cast<volatile int*>(claimed + 1);
        if (relay >= n_relay) return;
        m = __ldg(order + relay);
        const int j = expert_of_tile(mtile, spr, m);
        const int lo = off[j] + (m - mtile[j]) * GH_BM, hi = min(off[j + 1], lo + GH_BM);
        for (int row = lo + warp; row < hi; row += GH_STORE_WARPS) {
            wait_flag(row_flag + row, epoch, timeout_ns, status, FM_ROW_FLAG, me, row);
            relay_row(row, landing, row_landing);
        }
        asm volatile("fence.proxy.async.global;" ::: "memory");
        if constexpr (SYSTEM)
            __threadfence_system();
        else
            __threadfence();
    }
}

// The task loop of kernels A and C after load_tables. Task ids: [0, n_send) send tasks of
// `chunk` tokens of src (send_token, a consumer warp per token; kind `send_kind`); then one
// relay per M-tile in arrival order (`arrival`: fused_plan's; kind `relay_kind`), run by
// relay_on_store_warps; then GEMM tiles (kind `tile_kind`), MODE's, `tile_of(t)` tile t
// (arrival_tile), each handed to the block once its M-tile is relayed. Each counter of
// FM_*_COUNTER serves one stream: the first `send_ctas` blocks to take a ticket are senders,
// which claim sends while any is left, then tiles; the other blocks claim the next tile
// whose rows are relayed, a send where its rows are not there yet, so the GEMM runs beside
// the sends instead of after them. The store warps claim the
// relays, so a relay's copies run beside the consumers' sends and MMAs. The producer thread
// loads a tile with load_tile's `boxes(tile)` and `b_split`; the consumers then run
// `finish(d, tile, ring, consumer, warp, lane)`, the tile's epilogue, which may stage the tile in the idle stage ring (`ring`; see
// stage_accumulators_fp32): both warpgroups' MMAs are done with it before, and the producer
// issues no copy into it before the next claim's barrier.
// Why no claim order deadlocks (ultraep/compute/fused/forward.py states it for the host model):
// a store warp waits only for row flags, which send tasks release; sends wait for nothing,
// and no block claims a tile it must wait for while a send is unclaimed, so every rank's
// sends finish (whatever send_ctas, 0 included); a tile waits for
// tile_ready, which a relay releases, and relays progress on the store warps of any resident
// block, whatever its consumers wait for. So one resident block per rank suffices.
// A tile's wait for its rows spans their arrival (the relay's bounded row waits) and the
// copies of the relays ahead of its own (milliseconds against a timeout of seconds): twice
// the relay's bound (wait_rows_relayed).
template <int MODE, bool SYSTEM, typename TileOf, typename Boxes, typename RelayRow, typename Finish>
__device__ __forceinline__ void send_relay_then_gemm(
    const TensorMap* a_map, const TensorMap* b_map, TileOf tile_of, Boxes boxes, int b_split, const uint4* src,
    int tokens, int top_k, int hidden, const long long* ids, const float* gates, const int* positions,
    const int* base, const u64* peer_bases, u64 landing_offset, u64 weight_offset, u64 row_landing_offset,
    u64 origin_offset, u64 row_flag_offset, int me, int spr, int max_tokens, int chunk, const int* off,
    const int* mtile, const int* tile_start, const int* arrival, int n_cols, int send_ctas, Pipeline& p, int* claimed,
    u64* tile_ready, RelayRow relay_row, Finish finish, u64 epoch, u64 timeout_ns, int* counter, long long* status,
    u64* trace, int send_kind, int relay_kind, int tile_kind) {
    const int row_vecs = hidden * 2 / 16, n = tokens * top_k;
    const int n_send = ceil_div(tokens, chunk), n_relay = mtile[spr];
    const int first_tile = n_send + n_relay, total = first_tile + tile_start[spr];
    const unsigned stages = stage_ring();
    const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / WARP) % 4, lane = threadIdx.x % WARP;
    const int cwarp = (threadIdx.x - 128) / WARP;  // consumer warp 0..7
    bool gave_up = false;
    int step = 0;
    auto rows_relayed = [&](int task) {
        if (task >= first_tile)
            wait_rows_relayed(tile_ready, mtile_of(mtile, off, tile_of(task - first_tile)), epoch, timeout_ns, status,
                              me);
    };
    // Thread 0 claims. A sender sends while any send is left; any other block takes the next
    // tile only once its rows are relayed (a compare-and-swap on exactly that tile), else a
    // send while any is left. So no block waits for a tile while a send is unclaimed.
    bool sending = threadIdx.x == 0 && atomicAdd(counter + FM_SENDER_TICKET, 1) < send_ctas;
    const int n_tiles = total - first_tile;
    auto counted = [&](int which) { return *reinterpret_cast<volatile int*>(counter + which); };
    auto relayed = [&](int t) {
        return load_acquire_sys(tile_ready + arrival_place(arrival, spr, n_cols, t).y) == epoch;
    };
    auto take = [&] {
        if (sending || counted(FM_SEND_COUNTER) < n_send) {
            const int tile = counted(FM_TILE_COUNTER);  // another block may take it first: then a send
            if (!sending && tile < n_tiles && relayed(tile) &&
                atomicCAS(counter + FM_TILE_COUNTER, tile, tile + 1) == tile)
                return first_tile + tile;
            const int send = atomicAdd(counter + FM_SEND_COUNTER, 1);
            if (send < n_send) return send;
            sending = false;  // every send claimed: tiles, in turn
        }
        return first_tile + atomicAdd(counter + FM_TILE_COUNTER, 1);
    };
    auto kind = [&](int task) { return task < n_send ? send_kind : tile_kind; };  // the relays stamp their own
    int last = total;
    auto next = [&] { return claim(take, claimed, total, rows_relayed, kind, trace, last); };

    if (warpgroup == 0) {  // the producer thread and the store warps
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(GH_PRODUCER_REGISTERS));
        if (warp > 0) {
            relay_on_store_warps<SYSTEM>(counter, claimed, n_relay, arrival + FM_ARRIVAL_BANDS * spr + 1, off, mtile,
                                         spr, peer_bases[me], landing_offset,
                                         row_landing_offset, row_flag_offset, tile_ready, relay_row, epoch, timeout_ns,
                                         status, me, trace, n_send, relay_kind);
            return;
        }
        for (int task = next(); task < total; task = next()) {  // the producer warp
            if (task < n_send || lane != 0 || gave_up) continue;
            const Tile tile = tile_of(task - first_tile);
            load_tile<MODE, false, FM_STAGES>(a_map, b_map, tile, 1, boxes(tile), b_split, stages, p.full, p.empty, step,
                                           status, gave_up);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(GH_CONSUMER_REGISTERS));
    const int consumer = warpgroup - 1;
    for (int task = next(); task < total; task = next()) {
        if (task < n_send) {
            const int end = min(tokens, (task + 1) * chunk);
            for (int t = task * chunk + cwarp; t < end; t += GH_CONSUMERS * 4)
                send_token(t, src, top_k, row_vecs, ids, gates, positions, base, n, peer_bases, landing_offset,
                           weight_offset, row_landing_offset, origin_offset, row_flag_offset, me, spr, max_tokens,
                           epoch, lane);
        } else {
            const Tile tile = tile_of(task - first_tile);
            float d[128];
            mma_tile<MODE, true, FM_STAGES>(d, tile, stages, p.full, p.empty, step, consumer, lane, status, gave_up);
            consumers_sync();  // both warpgroups' MMAs have read the ring's last stages
            finish(d, tile, stages, consumer, warp, lane);
            fence_proxy_async_shared();  // before the claim barrier after which the producer's TMA overwrites the ring
        }
    }
}

// -- kernels B and D: GEMM tiles into the heap, then the slot-order reduce ---------------------------

static_assert(GH_BN == WARP * 8, "a reduce warp covers a tile's columns, 8 BF16 per lane");

// The task loop of kernels B and D after load_tables (over `n_cols` column blocks of hidden,
// its result). Tasks: GEMM tiles -- MODE's, `tile_of(t)` tile t (columns of GH_BN), `boxes(tile)`
// load_tile's box mask, task kind `tile_kind` -- whose BF16 output [rows, hidden] goes to the
// heap's expert_out (and, unless null, to `kept` [rows, hidden] too: the store warps' second
// store beside the next tile's MMAs costs less than a copy after the kernel), then reduce
// tasks of `chunk` tokens, every column (kind `reduce_kind`).
// done[m]: M-tile m (this rank's M-tile index), released by the block that finishes its last
// column block (down_count[m], local, counts them): a reducer waits once per slot instead of
// once per slot and column block.
// A reduce warp takes a token: lane k < top_k finds slot k's row on its expert's rank, waits
// for that M-tile's done flag, keeps the row in slot_row (WEIGHTED: its gate, gates[i], in
// slot_gate) and runs `slot(i, heap)`, the kernel's own per-slot work (heap: this rank's heap
// base); then dispatch.cu's sum_slots over the lane's 8 columns of each block: fp32, slots in
// order, WEIGHTED each row times its gate (product and sum rounded separately), one BF16
// rounding into out [tokens, hidden].
template <int MODE, bool WEIGHTED, typename TileOf, typename Boxes, typename Slot>
__device__ __forceinline__ void gemm_tiles_then_reduce(
    const TensorMap* a_map, const TensorMap* b_map, TileOf tile_of, Boxes boxes, int n_cols, int hidden,
    const u64* peer_bases, u64 expert_out_offset, u64 done_offset, int me, int spr, const int* rank_off,
    const int* rank_mtile, const int* off, const int* mtile, const int* tile_start, Pipeline& p, int* claimed,
    const long long* ids, const int* positions, const int* base, const float* gates, int tokens, int top_k, int chunk,
    bf16* out, bf16* kept, const uint4* (*slot_row)[WARP], float (*slot_gate)[WARP], Slot slot, int* down_count, u64 epoch,
    u64 timeout_ns, int* counter, long long* status, u64* trace, int tile_kind, int reduce_kind) {
    const int n_tiles = tile_start[spr];
    const int total = n_tiles + ceil_div(tokens, chunk);
    const unsigned stages = stage_ring();
    const unsigned tail = stages + FM_STAGES * GH_STAGE_BYTES;  // a staged tile's last column blocks
    const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / WARP) % 4, lane = threadIdx.x % WARP;
    const int cwarp = (threadIdx.x - 128) / WARP;
    const u64 heap = peer_bases[me];
    bf16* expert_out = reinterpret_cast<bf16*>(heap + expert_out_offset);
    bool gave_up = false;
    int step = 0, phase = 0;
    auto no_wait = [](int) {};
    auto take = [&] { return atomicAdd(counter, 1); };
    auto kind = [&](int task) { return task < n_tiles ? tile_kind : reduce_kind; };
    int last = total;
    auto next = [&] { return claim(take, claimed, total, no_wait, kind, trace, last); };

    if (warpgroup == 0) {  // the producer thread and the store warps: GEMM tiles only
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(GH_PRODUCER_REGISTERS));
        if (warp > 0) {
            // The store warps, in their own loop from the start (the tiles are the first
            // tasks, whose claims wait for nothing: a hand-over comes within a tile's MMAs).
            // A tile's first column blocks come from the stage of its last k-step, which goes
            // back to the producer once read (the consumer warps' arrivals, shared out among the
            // store warps: mma_tile left them out), then the tail's. Its rows are then in the
            // heap: fenced at system scope by every store thread, then one counts the tile; the
            // M-tile's last column block (fenced after the count, so every earlier block's rows
            // are ordered before) releases its done flag for the reducers on every rank.
            const int id = threadIdx.x - WARP;
            store_handed_tiles(p, n_tiles, status, [&](int task) {
                const Tile tile = tile_of(task);
                step += ceil_div(tile.red_len, GH_BK);  // >= 1: MoELayer refuses ffn < 1
                const int s = (step - 1) % FM_STAGES;
                const unsigned stage = stages + s * GH_STAGE_BYTES;
                store_ring_blocks<GH_STAGE_BLOCKS>(stage, tile.col0, tile, expert_out, hidden, id);
                if (kept != nullptr) store_ring_blocks<GH_STAGE_BLOCKS>(stage, tile.col0, tile, kept, hidden, id);
                hand_stage_back(&p.empty[s], id, lane);
                constexpr int TAIL_BLOCKS = GH_BN / GH_BLOCK_COLS - GH_STAGE_BLOCKS;
                const int tail_col = tile.col0 + GH_STAGE_BLOCKS * GH_BLOCK_COLS;
                store_ring_blocks<TAIL_BLOCKS>(tail, tail_col, tile, expert_out, hidden, id);
                if (kept != nullptr) store_ring_blocks<TAIL_BLOCKS>(tail, tail_col, tile, kept, hidden, id);
                __threadfence_system();
                store_warps_sync();
                if (threadIdx.x == WARP && !aborted(status)) {
                    const int m = mtile_of(mtile, off, tile);
                    if (atomicAdd(down_count + m, 1) == n_cols - 1) {
                        down_count[m] = 0;
                        __threadfence_system();
                        store_release_sys(reinterpret_cast<u64*>(peer_bases[me] + done_offset) + m, epoch);
                    }
                }
            });
            return;
        }
        for (int task = next(); task < total; task = next()) {  // the producer warp
            if (task >= n_tiles || lane != 0 || gave_up) continue;
            const Tile tile = tile_of(task);
            load_tile<MODE, false, FM_STAGES>(a_map, b_map, tile, 1, boxes(tile), 0, stages, p.full, p.empty, step, status,
                                           gave_up);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(GH_CONSUMER_REGISTERS));
    const int consumer = warpgroup - 1;
    int task = next();
    for (; task < n_tiles; task = next()) {
        const Tile tile = tile_of(task);
        float d[128];
        // the last k-step's stage stays held: the tile is staged in it, and the store warps release it
        mma_tile<MODE, false, FM_STAGES>(d, tile, stages, p.full, p.empty, step, consumer, lane, status, gave_up);
        consumers_sync();  // both warpgroups' last MMAs have read that stage
        hand_to_stores(p, phase, task, status, gave_up, lane, [&] {
            stage_in_ring(d, stages + (step - 1) % FM_STAGES * GH_STAGE_BYTES, tail, consumer * 64 + warp * 16 + lane / 4,
                          lane);
            fence_proxy_async_shared();  // these writes before the TMA copy that overwrites the stage
        });
        phase ^= 1;
    }
    hand_to_stores(p, phase, task, status, gave_up, lane, [] {});  // ends the store warps' loop
    for (; task < total; task = next()) {
        const int c = task - n_tiles;
        const int end = min(tokens, (c + 1) * chunk);
        for (int t = c * chunk + cwarp; t < end; t += GH_CONSUMERS * 4) {
            if (lane < top_k) {
                const int i = t * top_k + lane;
                const int expert = static_cast<int>(ids[i]);
                const int rank = expert / spr, j = expert % spr;
                const int row = base[expert] + positions[i];
                const int* roff = rank_off + rank * (spr + 1);
                const int m = rank_mtile[rank * (spr + 1) + j] + (row - roff[j]) / GH_BM;
                const u64 peer = peer_bases[rank];
                wait_flag(reinterpret_cast<const u64*>(peer + done_offset) + m, epoch, timeout_ns, status, FM_TILE_DONE,
                          rank, m);
                slot_row[cwarp][lane] = reinterpret_cast<const uint4*>(
                    reinterpret_cast<const bf16*>(peer + expert_out_offset) + static_cast<long long>(row) * hidden);
                if constexpr (WEIGHTED) slot_gate[cwarp][lane] = gates[i];
                slot(i, heap);
            }
            __syncwarp();
            for (int col = lane * 8; col < hidden; col += GH_BN) {
                float acc[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
                for (int k0 = 0; k0 < top_k; k0 += FM_REDUCE_UNROLL) {
                    uint4 v[FM_REDUCE_UNROLL];
#pragma unroll
                    for (int u = 0; u < FM_REDUCE_UNROLL; ++u)
                        if (k0 + u < top_k) v[u] = slot_row[cwarp][k0 + u][col / 8];
#pragma unroll
                    for (int u = 0; u < FM_REDUCE_UNROLL; ++u) {
                        if (k0 + u < top_k) {
                            const bf16* h = reinterpret_cast<const bf16*>(&v[u]);
                            if constexpr (WEIGHTED) {
                                const float g = slot_gate[cwarp][k0 + u];
#pragma unroll
                                for (int e = 0; e < 8; ++e)
                                    acc[e] = __fadd_rn(acc[e], __fmul_rn(g, __bfloat162float(h[e])));
                            } else {
#pragma unroll
                                for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __bfloat162float(h[e]));
                            }
                        }
                    }
                }
                uint4 v;
                bf16* h = reinterpret_cast<bf16*>(&v);
#pragma unroll
                for (int e = 0; e < 8; ++e) h[e] = __float2bfloat16_rn(acc[e]);
                *reinterpret_cast<uint4*>(out + static_cast<long long>(t) * hidden + col) = v;
            }
            __syncwarp();
        }
    }
}
