// Token path kernels (UniEP): the deterministic global token map, one send per
// destination rank, expansion into the expert-major receive buffer (or each pair straight
// into its row there), and the fixed-order combine. ultraep/token/device.py launches them
// in this order on one stream:
//
//   route_keys -> count_segments -> scan_segments -> rank_segments   (token map, local)
//   publish_counts -> [heap.cu symmetric_barrier] -> plan_rows        (count table, row bases)
//   send_tokens -> [barrier] -> expand_rows                          (dispatch)
//   send_pairs -> [barrier]                                          (dispatch into expert_in)
//   [barrier] -> send_rows -> [barrier] -> reduce_slots              (combine)
//   [barrier] -> pull_slots -> [barrier]                             (combine from expert_out)
//   [barrier] -> send_tokens -> [barrier] -> grad_rows -> [barrier]  (combine backward)
//
// Addresses come from stable key positions (warp-sequential segments, prefix sums over
// segments) -- no atomic decides where a row goes, so every run writes the same bytes to
// the same rows. Sums use __fmul_rn/__fadd_rn so no fused multiply-add changes a bit
// against the NumPy reference (ultraep/token/reference.py). plan_rows refuses a routing
// whose rows exceed the set-up bound on every rank (all ranks see the same table); every
// later kernel reads that outcome and does nothing, so nothing is written out of bounds.
// Copies move 16-byte vectors, a warp per row, UNROLL loads in flight per lane.
//
//! kernels: route_keys, count_segments, scan_segments, rank_segments, publish_counts, plan_rows
//! kernels: send_tokens, send_pairs, expand_rows, send_rows
//! kernels: reduce_slots<__nv_bfloat16>, reduce_slots<__half>, reduce_slots<float>
//! kernels: pull_slots<__nv_bfloat16>, pull_slots<__half>, pull_slots<float>
//! kernels: grad_rows<__nv_bfloat16>, grad_rows<__half>, grad_rows<float>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned long long u64;

// The host reads the constants it shares with these kernels from here (kernel_constant).
#define WARP 32                 // also the bound on top_k: a warp's lanes hold a token's slots
#define FULL_MASK 0xffffffffu
#define UNROLL 4
#define VECTOR_BYTES 16         // rows move as uint4 vectors, so a row is a multiple of this
#define MAX_RANKS 1024          // plan_rows keeps a running row count per rank in shared memory
#define NO_BAD_ITEM 0x7fffffff  // first_bad before route_keys: no bad (token, slot) seen

// Codes in outcome[0].
#define OUTCOME_OK 0
#define OUTCOME_BAD_INPUT 1
#define OUTCOME_TOO_MANY_ROWS 2
// A count table row ends in a bad-input record (code, token, slot, value); codes:
#define BAD_RECORD_FIELDS 4
#define BAD_EXPERT_ID 1
#define NAN_GATE 2

static_assert(sizeof(uint4) == VECTOR_BYTES, "rows are copied as uint4 vectors");

#include "row_math.cuh"

__device__ __forceinline__ int warp_id_global() { return (blockIdx.x * blockDim.x + threadIdx.x) / WARP; }
__device__ __forceinline__ int warps_in_grid() { return gridDim.x * blockDim.x / WARP; }
__device__ __forceinline__ int lane_id() { return threadIdx.x % WARP; }

// Read-only, non-coherent load: only for inputs no other rank writes during the kernel.
__device__ __forceinline__ uint4 load_input(const uint4* p) { return __ldg(p); }

// ---------------------------------------------------------------------------------------
// Token map
// ---------------------------------------------------------------------------------------

// Keys of the two stable orders, for n = T*K (token, slot) items: keys[i] is the expert,
// keys[n+i] is num_experts + destination rank on the first slot of the token that goes to
// that rank (its single send), -1 on later slots for the same rank. A bad item (expert id
// outside [0, E) or a NaN or infinite gate) gets -1 and the lowest bad index lands in first_bad.
extern "C" __global__ void route_keys(const long long* ids, const float* gates, int n, int top_k, int num_experts,
                                      int experts_per_rank, int* keys, int* first_bad) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long id = ids[i];
    if (id < 0 || id >= num_experts || !isfinite(gates[i])) {
        atomicMin(first_bad, i);  // an error report, not an address: the minimum is order-free
        keys[i] = -1;
        keys[n + i] = -1;
        return;
    }
    const int rank = static_cast<int>(id) / experts_per_rank;
    const int token_start = i - i % top_k;
    bool first = true;
    for (int j = token_start; j < i; ++j) {
        const long long other = ids[j];
        first = first && !(other >= 0 && other < num_experts && static_cast<int>(other) / experts_per_rank == rank);
    }
    keys[i] = static_cast<int>(id);
    keys[n + i] = first ? num_experts + rank : -1;
}

// Items are cut into segments of seg_len; a warp walks its segment 32 items at a time and
// counts each key: lanes with equal keys find each other with __match_any_sync and the
// lowest of them adds the group's size. Only this warp touches its row: no atomics.
extern "C" __global__ void count_segments(const int* keys, int n, int seg_len, int num_keys, int* seg_counts) {
    const int seg = warp_id_global(), lane = lane_id();
    const int num_segs = (n + seg_len - 1) / seg_len;
    if (seg >= num_segs) return;
    int* row = seg_counts + static_cast<long long>(seg) * num_keys;
    for (int j = lane; j < num_keys; j += WARP) row[j] = 0;
    __syncwarp();
    const int end = min(n, (seg + 1) * seg_len);
    for (int first = seg * seg_len; first < end; first += WARP) {
        const int i = first + lane;
        const int key = i < end ? keys[i] : -1;
        const unsigned same = __match_any_sync(FULL_MASK, key);
        if (key >= 0 && lane == __ffs(same) - 1) row[key] += __popc(same);
        __syncwarp();
    }
}

// One block per key: the segment counts of that key become exclusive prefix sums (where
// the key's run starts in each segment); totals[key] is the key's count.
extern "C" __global__ void scan_segments(int* seg_counts, int num_segs, int num_keys, int* totals) {
    __shared__ int warp_sums[WARP];
    const int key = blockIdx.x, lane = lane_id(), warp = threadIdx.x / WARP;
    const int per_thread = (num_segs + blockDim.x - 1) / blockDim.x;
    const int s0 = min(num_segs, threadIdx.x * per_thread), s1 = min(num_segs, s0 + per_thread);
    int sum = 0;
    for (int s = s0; s < s1; ++s) sum += seg_counts[static_cast<long long>(s) * num_keys + key];
    int inclusive = sum;  // block-wide inclusive scan of the thread sums
    for (int d = 1; d < WARP; d *= 2) {
        const int up = __shfl_up_sync(FULL_MASK, inclusive, d);
        if (lane >= d) inclusive += up;
    }
    if (lane == WARP - 1) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x / WARP;
        int w = lane < warps ? warp_sums[lane] : 0;
        for (int d = 1; d < WARP; d *= 2) {
            const int up = __shfl_up_sync(FULL_MASK, w, d);
            if (lane >= d) w += up;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    int run = inclusive - sum + (warp > 0 ? warp_sums[warp - 1] : 0);
    for (int s = s0; s < s1; ++s) {
        int* cell = seg_counts + static_cast<long long>(s) * num_keys + key;
        const int count = *cell;
        *cell = run;
        run += count;
    }
    if (threadIdx.x == blockDim.x - 1) totals[key] = run;
}

// positions[i] = how many earlier items share keys[i] (-1 for key -1): the segment's start
// for that key plus the lanes below with the same key, then the group's leader advances it.
extern "C" __global__ void rank_segments(const int* keys, int n, int seg_len, int num_keys, int* seg_counts,
                                         int* positions) {
    const int seg = warp_id_global(), lane = lane_id();
    const int num_segs = (n + seg_len - 1) / seg_len;
    if (seg >= num_segs) return;
    int* row = seg_counts + static_cast<long long>(seg) * num_keys;
    const int end = min(n, (seg + 1) * seg_len);
    for (int first = seg * seg_len; first < end; first += WARP) {
        const int i = first + lane;
        const int key = i < end ? keys[i] : -1;
        const unsigned same = __match_any_sync(FULL_MASK, key);
        const int start = key >= 0 ? row[key] : 0;
        if (i < end) positions[i] = key >= 0 ? start + __popc(same & ((1u << lane) - 1u)) : -1;
        __syncwarp();
        if (key >= 0 && lane == __ffs(same) - 1) row[key] = start + __popc(same);
        __syncwarp();
    }
}

// Row `me` of every peer's count table: totals (pairs per expert, then sends per rank),
// then this rank's first bad item as (code, token, slot, value) or zeros.
extern "C" __global__ void publish_counts(const u64* peer_bases, u64 table_offset, int me, int ranks, int num_experts,
                                          const int* totals, const int* first_bad, const long long* ids,
                                          const float* gates, int top_k) {
    __shared__ int record[BAD_RECORD_FIELDS];
    const int cols = num_experts + ranks + BAD_RECORD_FIELDS;
    if (threadIdx.x == 0) {
        const int bad = *first_bad;
        if (bad == NO_BAD_ITEM) {
            record[0] = record[1] = record[2] = record[3] = 0;
        } else {
            const long long id = ids[bad];
            const bool bad_id = id < 0 || id >= num_experts;
            record[0] = bad_id ? BAD_EXPERT_ID : NAN_GATE;
            record[1] = bad / top_k;
            record[2] = bad % top_k;
            record[3] = static_cast<int>(max(min(id, 2147483647ll), -2147483647ll - 1));
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < ranks * cols; j += blockDim.x) {
        const int peer = j / cols, col = j % cols;
        int* table = reinterpret_cast<int*>(peer_bases[peer] + table_offset);
        table[me * cols + col] = col < num_experts + ranks ? totals[col] : record[col - num_experts - ranks];
    }
}

// From the gathered table (one block, a thread per destination rank): base[e], the first
// row on e's rank of the pairs this rank sends to e (expert start + pairs from lower
// ranks); this rank's expert counts and offsets; and the outcome every rank agrees on:
// bad input somewhere, or some rank receiving more than max_rows rows.
extern "C" __global__ void plan_rows(const int* table, int ranks, int num_experts, int experts_per_rank, int me,
                                     int max_rows, int* base, int* counts, int* offsets, int* outcome) {
    __shared__ long long rank_rows[MAX_RANKS];
    const int cols = num_experts + ranks + BAD_RECORD_FIELDS;
    for (int r = threadIdx.x; r < ranks; r += blockDim.x) {
        long long running = 0;
        for (int j = 0; j < experts_per_rank; ++j) {
            const int e = r * experts_per_rank + j;
            if (r == me) offsets[j] = static_cast<int>(min(running, 2147483647ll));
            long long expert_rows = 0;
            for (int s = 0; s < ranks; ++s) {
                if (s == me) base[e] = static_cast<int>(min(running + expert_rows, 2147483647ll));
                expert_rows += table[s * cols + e];
            }
            if (r == me) counts[j] = static_cast<int>(min(expert_rows, 2147483647ll));
            running += expert_rows;
        }
        if (r == me) offsets[experts_per_rank] = static_cast<int>(min(running, 2147483647ll));
        rank_rows[r] = running;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int code = OUTCOME_OK, who = 0, rows = 0;
    for (int s = 0; s < ranks && code == OUTCOME_OK; ++s)
        if (table[s * cols + num_experts + ranks] != 0) code = OUTCOME_BAD_INPUT, who = s;
    for (int r = 0; r < ranks && code == OUTCOME_OK; ++r)
        if (rank_rows[r] > max_rows) code = OUTCOME_TOO_MANY_ROWS, who = r, rows = static_cast<int>(min(rank_rows[r], 2147483647ll));
    outcome[0] = code;
    outcome[1] = who;
    outcome[2] = rows;
}

// ---------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------

// Lane k < top_k of token t's warp: slot k's gate, the landing row of the token's single send
// to slot k's rank (its first slot there) and its origin s*T*K + t*K + k, into receive row
// `row` on that rank (heap base `peer`) -- what combine and the backward read, whichever
// way the row's data arrives.
__device__ __forceinline__ void write_pair_meta(u64 peer, int row, int t, int lane, int top_k, int rank,
                                                const long long* ids, const float* gates, const int* positions,
                                                int n, u64 weight_offset, u64 row_landing_offset, u64 origin_offset,
                                                int me, int experts_per_rank, int max_tokens) {
    const int i = t * top_k + lane;
    int first_slot = lane;
    for (int k = lane - 1; k >= 0; --k)
        if (static_cast<int>(ids[t * top_k + k]) / experts_per_rank == rank) first_slot = k;
    reinterpret_cast<float*>(peer + weight_offset)[row] = gates[i];
    reinterpret_cast<int*>(peer + row_landing_offset)[row] = me * max_tokens + positions[n + t * top_k + first_slot];
    reinterpret_cast<int*>(peer + origin_offset)[row] = me * max_tokens * top_k + i;
}

// The warp reads row src once, UNROLL vectors per lane at a time, and stores each piece
// into the row at `dest` of every lane set in dest_mask.
__device__ __forceinline__ void store_row_to_each(const uint4* src, u64 dest, unsigned dest_mask, int row_vecs) {
    const int lane = lane_id();
    for (int v0 = 0; v0 < row_vecs; v0 += WARP * UNROLL) {
        uint4 buf[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) buf[u] = load_input(src + v);
        }
        for (unsigned m = dest_mask; m; m &= m - 1) {
            uint4* dst = reinterpret_cast<uint4*>(__shfl_sync(FULL_MASK, dest, __ffs(m) - 1));
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int v = v0 + u * WARP + lane;
                if (v < row_vecs) dst[v] = buf[u];
            }
        }
    }
}

// A warp per token (grid-stride, persistent). Lanes k < top_k write slot k's metadata into
// its receive row on the destination rank (with_meta); then the warp reads the token once
// and stores it into the landing row of every destination rank the token goes to (one
// send per rank).
extern "C" __global__ void send_tokens(const uint4* x, int tokens, int top_k, int row_vecs, const long long* ids,
                                       const float* gates, const int* positions, const int* base,
                                       const u64* peer_bases, u64 landing_offset, u64 weight_offset,
                                       u64 row_landing_offset, u64 origin_offset, int me, int experts_per_rank,
                                       int max_tokens, int with_meta, const int* outcome) {
    if (outcome[0] != OUTCOME_OK) return;
    const int lane = lane_id();
    const int n = tokens * top_k;
    for (int t = warp_id_global(); t < tokens; t += warps_in_grid()) {
        u64 dest = 0;  // lane k: landing row address on slot k's rank if slot k is the token's send
        bool sends = false;
        if (lane < top_k) {
            const int i = t * top_k + lane;
            const int expert = static_cast<int>(ids[i]);
            const int rank = expert / experts_per_rank;
            const u64 peer = peer_bases[rank];
            sends = positions[n + i] >= 0;
            dest = peer + landing_offset +
                   (static_cast<u64>(me) * max_tokens + positions[n + i]) * row_vecs * sizeof(uint4);
            if (with_meta)
                write_pair_meta(peer, base[expert] + positions[i], t, lane, top_k, rank, ids, gates, positions, n,
                                weight_offset, row_landing_offset, origin_offset, me, experts_per_rank, max_tokens);
        }
        store_row_to_each(x + static_cast<long long>(t) * row_vecs, dest, __ballot_sync(FULL_MASK, sends), row_vecs);
    }
}

// Dispatch with the receive buffer in the heap (expert_input), a warp per token: lane k <
// top_k writes slot k's metadata as send_tokens does, then the warp reads the token once
// and stores it straight into slot k's final row of every peer's expert_in -- no landing
// row, no expand_rows pass, the same rows, bits and metadata. Pair (t, k) to expert e goes
// to row base[e] + positions[t*K+k] on e's rank: base[e] (plan_rows) = rows of the experts
// before e on that rank + pairs to e of every source below this one, positions[i]
// (rank_segments) = this source's pairs to e before (t, k) in token-then-slot order.
extern "C" __global__ void send_pairs(const uint4* x, int tokens, int top_k, int row_vecs, const long long* ids,
                                      const float* gates, const int* positions, const int* base,
                                      const u64* peer_bases, u64 expert_in_offset, u64 weight_offset,
                                      u64 row_landing_offset, u64 origin_offset, int me, int experts_per_rank,
                                      int max_tokens, const int* outcome) {
    if (outcome[0] != OUTCOME_OK) return;
    const int lane = lane_id();
    const int n = tokens * top_k;
    for (int t = warp_id_global(); t < tokens; t += warps_in_grid()) {
        u64 dest = 0;  // lane k: slot k's row in expert_in on its rank
        if (lane < top_k) {
            const int i = t * top_k + lane;
            const int expert = static_cast<int>(ids[i]);
            const int rank = expert / experts_per_rank;
            const u64 peer = peer_bases[rank];
            const int row = base[expert] + positions[i];
            dest = peer + expert_in_offset + static_cast<u64>(row) * row_vecs * sizeof(uint4);
            write_pair_meta(peer, row, t, lane, top_k, rank, ids, gates, positions, n, weight_offset,
                            row_landing_offset, origin_offset, me, experts_per_rank, max_tokens);
        }
        store_row_to_each(x + static_cast<long long>(t) * row_vecs, dest, __ballot_sync(FULL_MASK, lane < top_k),
                          row_vecs);
    }
}

// Copies row `from` of src into row `to` of dst: a warp, 16-byte vectors, UNROLL in flight.
__device__ __forceinline__ void copy_row(const uint4* src, uint4* dst, int row_vecs) {
    const int lane = lane_id();
    for (int v0 = 0; v0 < row_vecs; v0 += WARP * UNROLL) {
        uint4 buf[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) buf[u] = src[v];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) dst[v] = buf[u];
        }
    }
}

// Receiver: out[row] = landing[row_landing[row]] for every received row (a warp per row).
extern "C" __global__ void expand_rows(const uint4* landing, const int* row_landing, const int* offsets_end,
                                       int row_vecs, uint4* out, const int* outcome) {
    if (outcome[0] != OUTCOME_OK) return;
    const int rows = *offsets_end;
    for (int row = warp_id_global(); row < rows; row += warps_in_grid())
        copy_row(landing + static_cast<long long>(row_landing[row]) * row_vecs, out + static_cast<long long>(row) * row_vecs,
                 row_vecs);
}

// ---------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------

// Expert side: received row `row` goes back to slot (t, k) of its source, whose origin is
// s * slots_per_rank + t * K + k, into the source's slot_rows.
extern "C" __global__ void send_rows(const uint4* y, const int* row_origin, const int* offsets_end, int row_vecs,
                                     const u64* peer_bases, u64 slot_rows_offset, int slots_per_rank,
                                     const int* outcome) {
    if (outcome[0] != OUTCOME_OK) return;
    const int rows = *offsets_end;
    for (int row = warp_id_global(); row < rows; row += warps_in_grid()) {
        const int origin = row_origin[row];
        uint4* dst = reinterpret_cast<uint4*>(peer_bases[origin / slots_per_rank] + slot_rows_offset);
        copy_row(y + static_cast<long long>(row) * row_vecs, dst + static_cast<long long>(origin % slots_per_rank) * row_vecs,
                 row_vecs);
    }
}

// The gate-weighted sum of one token's K slot rows into out_row (unweighted when gates is
// null), fp32, products and sums rounded separately, slots in order 0..K-1; row_of(k) is
// slot k's row. Every combine path sums through here, so they agree bit for bit.
template <typename T, typename RowOf>
__device__ __forceinline__ void sum_slots(RowOf row_of, const float* gates, int top_k, int row_vecs, uint4* out_row) {
    constexpr int N = Vector<T>::N;
    for (int v = lane_id(); v < row_vecs; v += WARP) {
        float acc[N];
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = 0.0f;
        for (int k0 = 0; k0 < top_k; k0 += UNROLL) {
            uint4 buf[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (k0 + u < top_k) buf[u] = row_of(k0 + u)[v];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (k0 + u >= top_k) break;
                float f[N];
                Vector<T>::to_float(buf[u], f);
                const float g = gates ? gates[k0 + u] : 1.0f;
#pragma unroll
                for (int j = 0; j < N; ++j) acc[j] = __fadd_rn(acc[j], gates ? __fmul_rn(g, f[j]) : f[j]);
            }
        }
        out_row[v] = Vector<T>::from_float(acc);
    }
}

// Source side, a warp per token: out[t] = the sum of its K slot rows, which send_rows
// placed in this rank's slot_rows.
template <typename T>
__global__ void reduce_slots(const uint4* slots, const float* gates, int tokens, int top_k, int row_vecs, uint4* out) {
    for (int t = warp_id_global(); t < tokens; t += warps_in_grid()) {
        const uint4* token_slots = slots + static_cast<long long>(t) * top_k * row_vecs;
        sum_slots<T>([&](int k) { return token_slots + static_cast<long long>(k) * row_vecs; },
                     gates ? gates + static_cast<long long>(t) * top_k : nullptr, top_k, row_vecs,
                     out + static_cast<long long>(t) * row_vecs);
    }
}

// Source side, a warp per token, when the experts wrote their outputs into the heap's
// expert_out: slot (t, k)'s row is read where it lies, row base[e] + positions[t*K+k] of
// expert e's rank (the rows dispatch assigned), so no slot rows are sent or stored.
// Lane k finds slot k's row; the warp's rows wait in shared memory (blockDim.x / WARP
// warps of WARP pointers, dynamic).
template <typename T>
__global__ void pull_slots(const u64* peer_bases, u64 expert_out_offset, const long long* ids, const int* positions,
                           const int* base, const float* gates, int tokens, int top_k, int experts_per_rank,
                           int row_vecs, uint4* out, const int* outcome) {
    extern __shared__ const uint4* slot_row[];
    if (outcome[0] != OUTCOME_OK) return;
    const int lane = lane_id();
    const uint4** rows = slot_row + (threadIdx.x / WARP) * WARP;
    for (int t = warp_id_global(); t < tokens; t += warps_in_grid()) {
        if (lane < top_k) {
            const int i = t * top_k + lane;
            const int expert = static_cast<int>(ids[i]);
            const u64 peer = peer_bases[expert / experts_per_rank] + expert_out_offset;
            rows[lane] = reinterpret_cast<const uint4*>(peer) + static_cast<long long>(base[expert] + positions[i]) * row_vecs;
        }
        __syncwarp();
        sum_slots<T>([&](int k) { return rows[k]; }, gates ? gates + static_cast<long long>(t) * top_k : nullptr,
                     top_k, row_vecs, out + static_cast<long long>(t) * row_vecs);
        __syncwarp();
    }
}

// Combine backward, expert side, a warp per received row: row_math.cuh's grad_row (the
// fused backward's relay runs the same).
template <typename T>
__global__ void grad_rows(const uint4* landing, const int* row_landing, const float* row_weight, const uint4* y,
                          const int* row_origin, const int* offsets_end, int row_vecs, uint4* grad_y,
                          const u64* peer_bases, u64 slot_grad_w_offset, int slots_per_rank, const int* outcome) {
    if (outcome[0] != OUTCOME_OK) return;
    const int lane = lane_id();
    const int rows = *offsets_end;
    for (int row = warp_id_global(); row < rows; row += warps_in_grid())
        grad_row<T, UNROLL>(row, landing, row_landing, row_weight, row_origin, y, grad_y, row_vecs, peer_bases,
                            slot_grad_w_offset, slots_per_rank, lane);
}
