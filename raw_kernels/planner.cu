//! kernels: plan_domains<1>, plan_domains<2>, plan_domains<4>
// The quota planner on the GPU, bitwise equal to ultraep/planner/quota.py (its module
// docstring describes the threshold search, the greedy oracle and the split).
//
// plan_domains computes the whole plan in one launch, one cluster of CLUSTER blocks per
// NVLink domain: each block stages its share of the load columns and the blocks exchange
// the column sums through distributed shared memory; PROBES warps of the cluster each run
// the greedy oracle for one threshold per round; then every block rebuilds the winner's
// placement and writes the outputs and the split of its share of the experts. Integer
// arithmetic and lowest-index ties in every decision, as in the reference.

#include "sync.cuh"

#define FULL_MASK 0xffffffffu
#define CLUSTER 8                 // blocks per domain (the portable cluster size)
#define PROBE_WARPS 4             // probes per block: one per SM sub-partition
#define WARPS 16                  // all warps share the set-up, the outputs and the split
#define ROW_WARPS 4               // warps that write the master-only split rows during the search
#define THREADS (WARPS * 32)
#define PROBES (CLUSTER * PROBE_WARPS)  // probes per round
#define NEAR_PROBES 24            // probes spaced by the near step from lo + 1 (quota.probe_points)
#define NEAR_SHIFT 11             // near step: lo >> NEAR_SHIFT, at most gap >> NEAR_GAP_SHIFT
#define NEAR_GAP_SHIFT 6
#define MAX_CHUNKS 4              // plan_domains<CHUNKS>: each lane holds the oracle keys of CHUNKS ranks
#define MAX_DOMAIN (32 * MAX_CHUNKS)  // ranks per domain
#define NO_TARGET 0xffffffffu     // oracle key of a rank that cannot take the replica
#define MOVE_INTS 2               // per move: expert << 16 | slot << 8 | target, tokens
#define MOVE_FIELD_BITS 8         // width of a move's slot and target fields
#define MAX_SLOTS (1 << MOVE_FIELD_BITS)  // redundant slots per rank a move can name
#define SPILL_FLIP 0xffffff00u    // packed spill key = fit key ^ SPILL_FLIP
#define STAGE_BATCH 4             // load values a staging thread has in flight at once

static_assert(PROBES == 32, "the round decision reads one probe per lane");
static_assert(MAX_DOMAIN <= MAX_SLOTS, "a move's target field names every rank of the domain");

// Phase timing for scripts/planner_phases.py, which compiles with -DPLANNER_PHASE_STAMPS:
// thread 0 of each block of the first cluster stamps %globaltimer at each PhaseStamp, and
// each probe warp around its oracle run. Without the define the stamps compile to nothing.
enum PhaseStamp {
    STAMP_START, STAMP_CLUSTER_STARTED, STAMP_EXCHANGED, STAMP_SEARCH, STAMP_SEARCH_DONE, STAMP_MOVES_RECEIVED,
    STAMP_SPLIT, STAMP_END, STAMP_SHARES, STAMP_SCANS, STAMP_ROWS, STAMP_STAGED, STAMP_ORDERS, STAMP_BOUNDS,
    STAMP_EXPERT_OUTPUTS, STAMP_RANK_OUTPUTS, STAMPS
};
#ifdef PLANNER_PHASE_STAMPS
__device__ unsigned long long g_stamps[CLUSTER * STAMPS];
__device__ unsigned long long g_probe[2 * PROBES];  // each probe's oracle run: start, end
__device__ int g_probe_moves[PROBES];
#define PHASE_STAMP(stamp)                                                                          \
    do {                                                                                            \
        __syncwarp();                                                                               \
        if (blockIdx.x < CLUSTER && threadIdx.x == 0) g_stamps[STAMPS * blockIdx.x + (stamp)] = global_timer_ns(); \
    } while (0)
#define PROBE_START(start) const unsigned long long start = global_timer_ns()
#define PROBE_STAMP(probe, start, count)                                                            \
    do {                                                                                            \
        const unsigned long long end = global_timer_ns();                                          \
        if ((threadIdx.x & 31) == 0 && blockIdx.x < CLUSTER) {                                     \
            g_probe[2 * (probe)] = start;                                                          \
            g_probe[2 * (probe) + 1] = end;                                                        \
            g_probe_moves[probe] = count;                                                          \
        }                                                                                           \
    } while (0)
#else
#define PHASE_STAMP(stamp) do {} while (0)
#define PROBE_START(start) do {} while (0)
#define PROBE_STAMP(probe, start, count) do {} while (0)
#endif

// A move's first int: its expert, the slot it fills on the target rank and the target.
__device__ __forceinline__ int move_word(int expert, int slot, int target) {
    return expert << (2 * MOVE_FIELD_BITS) | slot << MOVE_FIELD_BITS | target;
}
__device__ __forceinline__ int move_expert(int word) { return word >> (2 * MOVE_FIELD_BITS); }
__device__ __forceinline__ int move_slot(int word) { return word >> MOVE_FIELD_BITS & (MAX_SLOTS - 1); }
__device__ __forceinline__ int move_target(int word) { return word & ((1 << MOVE_FIELD_BITS) - 1); }


__device__ __forceinline__ unsigned cluster_block_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Barrier over every thread of the cluster. A warp that wrote another block's shared
// memory since the last barrier passes release (warp-uniform): a cluster-scope release
// is a GPU-scope fence here (MEMBAR.ALL.GPU), which also waits for the warp's global
// stores in flight, so the other warps arrive relaxed. Waiting acquires in every warp.
__device__ __forceinline__ void cluster_sync(bool release) {
    __syncwarp();
    if (release) asm volatile("fence.acq_rel.cluster;" ::: "memory");
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Address of `local` in the shared memory of cluster block `block`.
__device__ __forceinline__ unsigned remote_address(const void* local, unsigned block) {
    unsigned long long address;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(address) : "l"(reinterpret_cast<unsigned long long>(local)));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((unsigned)address), "r"(block));
    return remote;
}

__device__ __forceinline__ void store_to_block(int* local, unsigned block, int value) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(remote_address(local, block)), "r"(value) : "memory");
}

// The cap probe's outcome (quota.search: with a cap, the first probe is the cap, and
// when it is feasible the search ends there) reaches every block through an mbarrier in
// the block's shared memory: remote stores that count their bytes on the receiver's
// barrier (st.async), announced by one remote arrival that expects them. The sender needs
// no fence and the receivers no cluster barrier.
// Block b receives its count (-1: infeasible) and, when feasible, the moves.
__device__ __forceinline__ void send_cap_outcome(int count, const int* moves, int* best_moves, int* cap_count,
                                                 unsigned long long* signal) {
    static_assert(MOVE_INTS == 2 && 32 % CLUSTER == 0, "lane l sends two moves at a time to block l % CLUSTER");
    const int lane = threadIdx.x & 31, to = lane % CLUSTER;
    const int words = (max(count, 0) + 1) / 2;  // 16-byte words of moves (the move buffers are whole words)
    const unsigned remote_signal = remote_address(signal, to), remote_moves = remote_address(best_moves, to);
    __syncwarp();  // the moves were stored by the lanes of their targets
    if (lane < CLUSTER)
        asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster.b64 _, [%0], %1;"
                     :: "r"(remote_signal), "r"(4 + 16 * words) : "memory");
#pragma unroll 1
    for (int w = lane / CLUSTER; w < words; w += 32 / CLUSTER) {
        const int4 word = reinterpret_cast<const int4*>(moves)[w];
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                     :: "r"(remote_moves + 16 * w), "r"(word.x), "r"(word.y), "r"(word.z), "r"(word.w),
                        "r"(remote_signal) : "memory");
    }
    if (lane < CLUSTER)
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                     :: "r"(remote_address(cap_count, to)), "r"(count), "r"(remote_signal) : "memory");
}

__device__ __forceinline__ long long warp_sum(long long value) {
    for (int offset = 16; offset; offset >>= 1) value += __shfl_xor_sync(FULL_MASK, value, offset);
    return value;
}

// Whether item `other` comes before item `index` in descending load order, ties by
// ascending index.
__device__ __forceinline__ bool precedes(int other_load, int other, int load, int index) {
    return other_load > load || (other_load == load && other < index);
}

// floor(a / b) for 0 <= a < 2**62 and 0 < b < 2**31, given inverse = __drcp_rn(b): the
// double estimate is within one of the quotient (below 2**31) and is corrected exactly;
// 64-bit integer division is far slower.
__device__ __forceinline__ long long floor_div(long long a, long long b, double inverse) {
    long long q = (long long)__dmul_rz((double)a, inverse);
    const long long r = a - q * b;
    q += (r >= b) - (r < 0);
    return q;
}

// floor(d * capacity / total) for 0 <= d, capacity < 2**31 and 0 <= total < 2**31 (0 when
// total is 0, and so is every capacity), given demand = (double)d and ratio = capacity *
// __drcp_rn(total): the double estimate is within one of the quotient and is corrected
// exactly (the remainder from unsigned 32x32-bit products: all factors are non-negative).
// The conversions and the reciprocal are paid once per source and per instance, not per
// share.
__device__ __forceinline__ int proportional_share(int d, double demand, int capacity, double ratio, int total) {
    const unsigned share = (unsigned)__double2int_rz(demand * ratio);
    const long long rest = (long long)((unsigned long long)(unsigned)d * (unsigned)capacity -
                                       (unsigned long long)share * (unsigned)total);
    return (int)share + (rest >= total && total > 0) - (rest < 0);
}

// The front of the dynamic shared memory: what the oracle reads. Built from the base
// wherever it is used, so that the compiler sees shared-memory pointers (LDS, not
// generic loads) also inside the non-inlined oracle.
struct DomainShared {
    int4* visits;        // [D]   ranks by descending load (ties lowest index): rank, its load, its hottest expert, its load
    int2* expert_order;  // [D*M] each rank's experts by descending load (ties lowest index): expert, load
    int* expert_load;    // [D*M] load of each expert of the domain
    int* rank_load0;     // [D]   load of each rank without balancing
    int* end;            // the rest of the shared memory
    __device__ DomainShared(int4* base, int D, int M)
        : visits(base), expert_order(reinterpret_cast<int2*>(base + D)), expert_load(reinterpret_cast<int*>(expert_order + D * M)),
          rank_load0(expert_load + D * M), end(rank_load0 + D) {}
};

// Oracle keys of a rank with `room` tokens of slack and `free_slots` free slots: it may
// host a replica if it has a free slot and room >= step; the fit key orders by ascending
// room, the spill key (the fit key with the room's bits flipped and the top bit set) by
// descending room, both NO_TARGET when it may not host. PACKED keys (every room below
// 2**23) carry the rank and a "last free slot" bit in the low 8 bits, so the minimum
// names the target with the lowest index and says whether it is full afterwards;
// unpacked keys need a ballot and a shuffle for that.
static_assert(MAX_DOMAIN <= 128, "a packed key holds the rank in 7 bits");
template <bool PACKED>
__device__ __forceinline__ void rank_keys(int rank, int room, int free_slots, int step, unsigned& fit_key,
                                          unsigned& spill_key) {
    const bool may_host = free_slots > 0 && room >= step;
    fit_key = !may_host ? NO_TARGET : PACKED ? (unsigned)room << 8 | (unsigned)rank << 1 | (free_slots == 1) : (unsigned)room;
    spill_key = !may_host ? NO_TARGET : fit_key ^ (PACKED ? SPILL_FLIP : ~0u);
}

// The least fit key of a rank with room for `need` tokens (fit keys hold the room above
// the low bits).
template <bool PACKED>
__device__ __forceinline__ unsigned fit_floor(int need) {
    return PACKED ? (unsigned)need << 8 : (unsigned)need;
}

// One move of the greedy oracle: `need` tokens of expert e to the best-fit rank, or with
// `spill` the roomiest when none fits. Returns the tokens moved, 0 when no rank may host
// (found false); the target's lane stores the move with the slot it fills. Only an
// exact fit (need, leaving the target q_min or more and a free slot) lets the target
// host again: anything else leaves it no room (filled, or below q_min) or no slot. And
// after an exact fit the expert's moves end (its rank is relieved or it is placed), so a
// target needs no striking off for the rest of its expert; its new keys follow from the
// winning key.
template <int CHUNKS, bool PACKED>
__device__ __forceinline__ int place_replica(int need, int remaining, int step, int S, int e, int count, bool spill,
                                             unsigned (&fit_key)[CHUNKS], unsigned (&spill_key)[CHUNKS],
                                             int (&free_slots)[CHUNKS], int* moves, bool& found) {
    const int lane = threadIdx.x & 31;
    const unsigned fit_from = fit_floor<PACKED>(need);
    unsigned key[CHUNKS], best = NO_TARGET;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        key[j] = fit_key[j] >= fit_from ? fit_key[j] : spill ? spill_key[j] : NO_TARGET;
        best = min(best, key[j]);
    }
    best = __reduce_min_sync(FULL_MASK, best);
    found = best != NO_TARGET;
    const unsigned room_bits = best ^ (unsigned)((int)best >> 31);  // a spill key flipped back; NO_TARGET: 0
    const int chosen = (int)(PACKED ? room_bits >> 8 : room_bits);
    int target = 0;
    if (PACKED) {
        target = (best >> 1) & (MAX_DOMAIN - 1);
    } else {
#pragma unroll
        for (int j = CHUNKS - 1; j >= 0; --j) {  // the lowest chunk holding the key wins
            const unsigned hit = __ballot_sync(FULL_MASK, key[j] == best);
            if (hit) target = 32 * j + __ffs(hit) - 1;
        }
    }
    // The target's free slots, in its lane (selected, not indexed: an indexed register
    // array would live in local memory).
    int mine = 0;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) mine = lane + 32 * j == target ? free_slots[j] : mine;
    const bool last_slot = PACKED ? (best & 1) : __shfl_sync(FULL_MASK, mine, target & 31) == 1;
    // A target that could take no further replica (leftover below q_min, or its last
    // slot) is filled instead: the slack gathers on the source rank, where it stays
    // usable. (A spill's room is below need, so it never counts as exact.)
    const bool exact = chosen - need >= step && !last_slot;
    const int amount = exact ? need : min(chosen, remaining);
    if (found && lane == (target & 31)) {  // the target's lane knows the slot it fills
        moves[MOVE_INTS * count] = move_word(e, S - mine, target);
        moves[MOVE_INTS * count + 1] = amount;
    }
    const unsigned target_fit = !exact ? NO_TARGET : (best - fit_from) | (PACKED && mine == 2);
    const unsigned target_spill = !exact ? NO_TARGET : target_fit ^ (PACKED ? SPILL_FLIP : ~0u);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const bool is_target = found && lane + 32 * j == target;
        fit_key[j] = is_target ? target_fit : fit_key[j];
        spill_key[j] = is_target ? target_spill : spill_key[j];
        free_slots[j] -= is_target;
    }
    return amount;
}

// Rank r ends its visit at or below tau with `room` tokens of slack: from now on it may
// receive replicas (its slots are all free: an overloaded rank never receives one).
// Returns its fit key.
template <int CHUNKS, bool PACKED>
__device__ __forceinline__ unsigned open_rank(int r, int room, int S, int step, unsigned (&fit_key)[CHUNKS],
                                              unsigned (&spill_key)[CHUNKS]) {
    const int lane = threadIdx.x & 31;
    unsigned fit, spill;
    rank_keys<PACKED>(r, room, S, step, fit, spill);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        fit_key[j] = lane + 32 * j == r ? fit : fit_key[j];
        spill_key[j] = lane + 32 * j == r ? spill : spill_key[j];
    }
    return fit;
}

// The greedy oracle of quota.DomainOracle.run for one threshold, run by one warp: the
// number of moves (the same in every lane) if feasible, else -1. Each move is stored in
// `moves` (MOVE_INTS ints, creation order). The overloaded ranks are visited by
// descending load; with FIT_FIRST twice, as there: pass 1 places one best-fit replica of
// a rank's hottest expert where that relieves the rank, pass 2 the rest. Each lane holds
// the keys and free slots of ranks lane, lane+32, ... in registers, and not their rooms:
// a rank that may not host never may again (rooms only shrink, slots only fill), except
// an overloaded one after its visit, whose room is set then. One move is one
// min-reduction and few instructions: a warp issues an integer instruction every other
// cycle at best, so the instruction count, not the chain, sets the pace. Pass 2 visits
// the ranks in one loop over their experts, and the next rank's visit and the rank's
// next expert are loaded while the expert's moves run. The pass count is a compile-time
// choice, so the one-pass oracle pays for no loop over passes. Not inlined: the loop
// keeps its own register allocation whatever the rest of the kernel needs.
template <int CHUNKS, bool PACKED, bool FIT_FIRST>
__device__ __noinline__ int run_oracle(int tau, int D, int M, int S, int max_replicas, int step, int* moves) {
    extern __shared__ int4 smem[];
    const DomainShared sh(smem, D, M);
    const int lane = threadIdx.x & 31;
    step = __shfl_sync(FULL_MASK, step, 0);  // held in registers, not reloaded from the constant bank per move
    S = __shfl_sync(FULL_MASK, S, 0);
    unsigned fit_key[CHUNKS], spill_key[CHUNKS];
    int free_slots[CHUNKS];
    int overloaded = 0;  // ranks above tau: positions 0..overloaded-1 of the visiting order
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const int t = lane + 32 * j;
        free_slots[j] = t < D ? S : 0;  // ranks beyond the domain never have a free slot
        rank_keys<PACKED>(t, t < D ? tau - sh.rank_load0[t] : 0, free_slots[j], step, fit_key[j], spill_key[j]);
        overloaded += __popc(__ballot_sync(FULL_MASK, t < D && sh.visits[t].y > tau));
    }
    if (max_replicas < 1) return overloaded ? -1 : 0;
    int count = 0;
    bool found;
    // Pass 1 marks the positions it relieved (bit p of the pair: positions 0-63, 64-127;
    // two named words, not an array, which the compiler would index in local memory).
    static_assert(MAX_DOMAIN <= 128, "the relieved positions fit in two 64-bit words");
    unsigned long long relieved_low = 0, relieved_high = 0;
    if (FIT_FIRST) {
        // Above every fit key (rooms only shrink; a relieved rank's opens): a rank whose need
        // is above it finds no fit, and skips the reduction.
        unsigned fit_bound = 0;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) fit_bound = max(fit_bound, fit_key[j] == NO_TARGET ? 0u : fit_key[j]);
        fit_bound = __reduce_max_sync(FULL_MASK, fit_bound);
#pragma unroll 1
        for (int pos = 0; pos < overloaded; ++pos) {
            const int4 visit = sh.visits[pos];  // rank, load, hottest expert, its load
            const int excess = visit.y - tau, need = min(max(excess, step), visit.w);
            if (need < excess || visit.w < step) continue;  // one replica cannot relieve the rank
            if (fit_floor<PACKED>(need) > fit_bound) continue;  // nor can any rank take it
            const int amount = place_replica<CHUNKS, PACKED>(need, visit.w, step, S, visit.z, count, false, fit_key, spill_key,
                                                             free_slots, moves, found);
            if (!found) continue;
            ++count;
            const unsigned opened = open_rank<CHUNKS, PACKED>(visit.x, amount - excess, S, step, fit_key,
                                                              spill_key);  // amount >= excess
            fit_bound = max(fit_bound, opened == NO_TARGET ? 0u : opened);
            relieved_low |= pos < 64 ? 1ull << pos : 0ull;
            relieved_high |= pos < 64 ? 0ull : 1ull << (pos - 64);
        }
    }
    // The position pass 2 visits after `pos`: the next one, or with FIT_FIRST the next
    // one pass 1 did not relieve; `overloaded` when none is left.
    auto next_position = [&](int pos) {
        int next = pos + 1;
        if (FIT_FIRST && next < MAX_DOMAIN) {
            const unsigned long long low = next < 64 ? ~relieved_low & (~0ull << next) : 0ull;
            const unsigned long long high = ~relieved_high & (next < 64 ? ~0ull : ~0ull << (next - 64));
            next = low ? __ffsll(low) - 1 : high ? 63 + __ffsll(high) : MAX_DOMAIN;
        }
        return min(next, overloaded);
    };
    // Pass 2: rank r (load L) is at expert k of its visiting order (e), `remaining` of
    // whose tokens are not placed yet.
    int pos = next_position(-1);
    if (pos >= overloaded) return count;
    int r = sh.visits[pos].x, L = sh.visits[pos].y, e = sh.visits[pos].z, remaining = sh.visits[pos].w, k = 0;
    pos = next_position(pos);  // from here on: the next rank's position
    if (remaining < step) return -1;  // experts come by descending load: none could place a replica
    while (true) {
        // Loaded while the moves run: the next rank's visit and this rank's next expert.
        const int4 next_visit = sh.visits[min(pos, D - 1)];
        const int2 following = sh.expert_order[r * M + min(k + 1, M - 1)];
        int hosts = 1;
        do {
            const int need = min(max(L - tau, step), remaining);
            const int amount = place_replica<CHUNKS, PACKED>(need, remaining, step, S, e, count, true, fit_key, spill_key,
                                                             free_slots, moves, found);
            count += found;
            L -= amount;
            remaining -= amount;
            ++hosts;
        } while (found && L > tau && hosts <= max_replicas && remaining >= step);
        if (L <= tau) {
            open_rank<CHUNKS, PACKED>(r, tau - L, S, step, fit_key, spill_key);
            if (pos >= overloaded) return count;  // every overloaded rank relieved
            r = next_visit.x;
            L = next_visit.y;
            e = next_visit.z;
            remaining = next_visit.w;
            k = 0;
            pos = next_position(pos);
        } else {
            if (++k == M) return -1;  // r cannot be relieved
            e = following.x;
            remaining = following.y;
        }
        if (remaining < step) return -1;  // nor can it when the expert, and every later one, is below q_min
    }
}

// Probe w of one round, ascending in w (quota.probe_points).
__device__ __forceinline__ int probe_point(int lo, int hi, int w, bool* active) {
    const long long gap = (long long)hi - lo;
    *active = true;
    if (gap - 1 <= PROBES) { *active = w < gap - 1; return lo + 1 + w; }
    const long long step = max(1LL, min((long long)(lo >> NEAR_SHIFT), gap >> NEAR_GAP_SHIFT));
    if (w < NEAR_PROBES) return (int)(lo + 1 + w * step);
    const long long start = lo + NEAR_PROBES * step;
    return (int)(start + (w - NEAR_PROBES + 1) * (hi - start) / (PROBES - NEAR_PROBES + 1));
}

// Imbalance max/mean with the formula of plan.imbalance: double(max) * R / double(total).
__device__ double imbalance_of(long long max_load, long long total, int R) {
    return total == 0 ? 1.0 : __ddiv_rn(__dmul_rn((double)max_load, (double)R), (double)total);
}

// In-place inclusive prefix sum of values[0..n) by one warp.
__device__ void warp_inclusive_scan(int* values, int n) {
    const int lane = threadIdx.x & 31;
    int carry = 0;
#pragma unroll 1
    for (int base = 0; base < n; base += 32) {
        int value = base + lane < n ? values[base + lane] : 0;
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int up = __shfl_up_sync(FULL_MASK, value, offset);
            if (lane >= offset) value += up;
        }
        if (base + lane < n) values[base + lane] = value + carry;
        carry += __shfl_sync(FULL_MASK, value, 31);
    }
}

// Imbalance before/after (the total load is the same before and after), by one warp of
// the domain: directly with one domain, else the last domain to finish combines the
// domains' figures through a ticket in the plan's workspace (which it resets). Not
// inlined: code that runs once is paid for in instruction fetch, so the other warps'
// path after the search stays short.
__device__ __noinline__ void write_imbalance(const int* rank_load0, const int* incoming, const int* master_quota, long long total,
                                             int D, int M, int R, int domain, int domains, long long* workspace,
                                             double* imbalance_before, double* imbalance_after) {
    const int lane = threadIdx.x & 31;
    long long before_max = 0, after_max = 0;
#pragma unroll 1
    for (int r = lane; r < D; r += 32) {
        long long after = incoming[r];
        for (int k = 0; k < M; ++k) after += master_quota[r * M + k];
        before_max = max(before_max, (long long)rank_load0[r]);
        after_max = max(after_max, after);
    }
    for (int offset = 16; offset; offset >>= 1) {
        before_max = max(before_max, __shfl_xor_sync(FULL_MASK, before_max, offset));
        after_max = max(after_max, __shfl_xor_sync(FULL_MASK, after_max, offset));
    }
    if (lane != 0) return;
    if (domains > 1) {
        // workspace: [3 * domain + 0..2] = before max, after max, total; [3 * domains] = ticket.
        workspace[3 * domain] = before_max;
        workspace[3 * domain + 1] = after_max;
        workspace[3 * domain + 2] = total;
        __threadfence();
        const unsigned long long ticket = atomicAdd((unsigned long long*)&workspace[3 * domains], 1ULL);
        if (ticket != (unsigned long long)(domains - 1)) return;  // not the last domain to finish
        __threadfence();
        total = 0;
#pragma unroll 1
        for (int d = 0; d < domains; ++d) {
            const volatile long long* figures = workspace + 3 * d;
            before_max = max(before_max, figures[0]);
            after_max = max(after_max, figures[1]);
            total += figures[2];
        }
        workspace[3 * domains] = 0;  // ready for the next launch
    }
    *imbalance_before = imbalance_of(before_max, total, R);
    *imbalance_after = imbalance_of(after_max, total, R);
}

// Split rows as if no expert had replicas, for every expert of the block: every source
// sends all its tokens to the master, so all K prefixes of row (src, e) are the load. The
// split of a replicated expert later overwrites only the prefixes that differ, so these
// rows must cover all K entries of every expert. Warps warp_index, +warps, ...
// take the sources in turn; a warp's lanes store consecutive 16-byte words of the source's
// row segment (coalesced: scattered stores would hold up the probes' shared-memory
// loads in the same pipeline), and step through the (expert, word) pairs without a
// division per store, since these warps share their schedulers with the probes.
__device__ void write_master_rows(int* __restrict__ split_prefix, const int* staged, int R, int E, int K,
                                  int first_expert, int columns, int share, int warp_index, int warps) {
    const int lane = threadIdx.x & 31;
    const int width = (K & 3) == 0 ? 4 : 1;  // ints per store: 16-byte aligned rows when K % 4 == 0
    const int per = K / width;                // stores per (source, expert)
    const int step_column = 32 / per, step_word = 32 % per;
    for (int src = warp_index; src < R; src += warps) {
        int* out = split_prefix + ((long long)src * E + first_expert) * K;
        for (int c = lane / per, word = lane % per; c < columns;) {
            const int tokens = staged[src * share + c];
            if (width == 4) reinterpret_cast<int4*>(out)[c * per + word] = make_int4(tokens, tokens, tokens, tokens);
            else out[c * per + word] = tokens;
            c += step_column;
            word += step_word;
            if (word >= per) { word -= per; ++c; }
        }
    }
}

// Store values[0..4) at out[i0..i0+4) clipped to K (one 16-byte store when K % 4 == 0).
__device__ __forceinline__ void store_quad(int* out, int i0, int K, const int (&values)[4]) {
    if ((K & 3) == 0) {
        *reinterpret_cast<int4*>(out + i0) = make_int4(values[0], values[1], values[2], values[3]);
    } else {
        for (int u = 0; u < 4 && i0 + u < K; ++u) out[i0 + u] = values[u];
    }
}

// What one block of a domain's cluster works on.
struct BlockTask {
    int R, E, S, D, K, M, DM, slots_per_rank;
    int move_ints;                 // ints of one probe's moves, in whole 16-byte words (the cap probe sends them so)
    int domain, domains, first_rank, first_expert;
    int block;                     // the block's rank in its cluster
    int share;                     // experts whose columns and split a block owns
    int first_column, columns;     // this block's experts (domain-local)
    __device__ __forceinline__ BlockTask(int R_, int E_, int S_, int D_, int K_)
        : R(R_), E(E_), S(S_), D(D_), K(K_), M(E_ / R_), DM(D_ * M), slots_per_rank(M + S_),
          move_ints((MOVE_INTS * S_ * D_ + 3) & ~3), domain(blockIdx.x / CLUSTER), domains(gridDim.x / CLUSTER),
          first_rank(domain * D_), first_expert(first_rank * M), block((int)cluster_block_rank()),
          share((DM + CLUSTER - 1) / CLUSTER), first_column(min(DM, block * share)),
          columns(min(DM, first_column + share) - first_column) {}
};

// The dynamic shared memory of a block: the oracle's front, then the rest in this order.
// ultraep/planner/device.py (plan_shared_bytes) sizes the launch by the same carve-up,
// and the kernel checks its launch against `bytes`.
struct BlockShared : DomainShared {
    int* warp_moves;     // per round parity and probe warp: its moves
    int* best_moves;     // the moves of the chosen probe
    unsigned long long* cap_signal;  // mbarrier: the cap probe's outcome arrived
    int* cap_count;      // its move count, -1 if infeasible
    double* inst_ratio;  // the split's capacity / total, per item and instance
    int* results;        // per round parity: tau, state, moves per probe
    int* staged;         // loads[src][this block's experts]
    int* partial;        // this block's column sums
    int* replicas;       // instances per expert
    int* master_quota;
    int* first_move;     // index of the expert's first move
    int* incoming;       // tokens of the replicas placed per rank
    int* slot_expert;    // expert of each redundant slot, -1 if idle
    int* replicated;     // this block's replicated experts, then their count
    // The split of the block's replicated experts ("items"): per item, per instance [K]
    // and per source [R].
    int* inst_host;      // host rank (global) of each instance
    int* inst_local;     // tokens it takes from its own host rank
    int* inst_capacity;  // quota left after them
    int* inst_column;    // column deficits, then their prefixes
    int* row_prefix;     // row deficits, then their inclusive prefix
    int* remote;         // each source's demand once hosts took theirs
    int* item_total;     // total capacity of each item
    unsigned bytes;      // the size of it all
    __device__ __forceinline__ BlockShared(int4* base, const BlockTask& t) : DomainShared(base, t.D, t.M) {
        int* cursor = end + (-(end - reinterpret_cast<int*>(base)) & 3);  // 16-byte aligned: moves, mbarrier, doubles
        warp_moves = cursor;     cursor += 2 * PROBE_WARPS * t.move_ints;
        best_moves = cursor;     cursor += t.move_ints;
        cap_signal = reinterpret_cast<unsigned long long*>(cursor);  cursor += 2;
        cap_count = cursor;      cursor += 2;
        inst_ratio = reinterpret_cast<double*>(cursor);  cursor += 2 * t.share * t.K;
        results = cursor;        cursor += 2 * 3 * PROBES;
        staged = cursor;         cursor += t.R * t.share;
        partial = cursor;        cursor += t.share;
        replicas = cursor;       cursor += t.DM;
        master_quota = cursor;   cursor += t.DM;
        first_move = cursor;     cursor += t.DM;
        incoming = cursor;       cursor += t.D;
        slot_expert = cursor;    cursor += t.D * t.S;
        replicated = cursor;     cursor += t.share + 1;
        inst_host = cursor;      cursor += t.share * t.K;
        inst_local = cursor;     cursor += t.share * t.K;
        inst_capacity = cursor;  cursor += t.share * t.K;
        inst_column = cursor;    cursor += t.share * t.K;
        row_prefix = cursor;     cursor += t.share * t.R;
        remote = cursor;         cursor += t.share * t.R;
        item_total = cursor;     cursor += t.share;
        bytes = (unsigned)(cursor - reinterpret_cast<int*>(base)) * (unsigned)sizeof(int);
    }
};

__device__ __forceinline__ unsigned dynamic_shared_bytes() {
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// A launch with less dynamic shared memory than the carve-up is a bug of the host's
// sizing: trapped before any block touches its shared memory (a printf would not survive
// the trap, so there is none).
__device__ __noinline__ void shared_memory_short() {
    __trap();
}

// Phase 1. Stage this block's load columns and sum them: thread (group, c) reads column c
// of every groups-th source (consecutive threads, consecutive columns: coalesced), with
// STAGE_BATCH loads in flight before the first is used (one memory round trip, not one
// per source). Thread 0 also sets up the mbarrier of the cap probe's outcome.
__device__ __forceinline__ void stage_loads(const int* __restrict__ loads, const BlockTask& t, const BlockShared& mem) {
    const int tid = threadIdx.x;
#pragma unroll 1
    for (int i = tid; i < t.columns; i += THREADS) mem.partial[i] = 0;
    if (tid == 0) {
        mbarrier_init(mem.cap_signal, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // before the next cluster barrier
    }
    __syncthreads();
    if (t.columns > 0) {
        const int groups = max(1, THREADS / t.columns);
        const int* block_loads = loads + t.first_expert + t.first_column;
        for (int idx = tid; idx < t.columns * groups; idx += THREADS) {
            const int c = idx % t.columns, group = idx / t.columns;
            int sum = 0;
            for (int first_src = group; first_src < t.R; first_src += STAGE_BATCH * groups) {
                int tokens[STAGE_BATCH];
#pragma unroll
                for (int b = 0; b < STAGE_BATCH; ++b) {
                    const int src = first_src + b * groups;
                    tokens[b] = src < t.R ? block_loads[(long long)src * t.E + c] : 0;
                }
#pragma unroll
                for (int b = 0; b < STAGE_BATCH; ++b) {
                    const int src = first_src + b * groups;
                    if (src < t.R) mem.staged[src * t.share + c] = tokens[b];
                    sum += tokens[b];
                }
            }
            atomicAdd(&mem.partial[c], sum);  // integer atomics: order-independent
        }
    }
    __syncthreads();  // the block's partial sums are complete
    PHASE_STAMP(STAMP_STAGED);
}

// Phase 2. Every block stores its column sums into every block of the cluster, so each
// holds all the domain's expert loads, and sums them per rank.
__device__ __forceinline__ void exchange_expert_loads(const BlockTask& t, const BlockShared& mem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    cluster_sync(false);  // every block of the cluster is running
    PHASE_STAMP(STAMP_CLUSTER_STARTED);
#pragma unroll 1
    for (int to = warp; to < CLUSTER; to += WARPS)
        for (int c = lane; c < t.columns; c += 32) store_to_block(&mem.expert_load[t.first_column + c], to, mem.partial[c]);
    cluster_sync(warp < CLUSTER);  // every block holds all the domain's expert loads
    PHASE_STAMP(STAMP_EXCHANGED);
#pragma unroll 1
    for (int r = tid; r < t.D; r += THREADS) {
        int sum = 0;
#pragma unroll 1
        for (int k = 0; k < t.M; ++k) sum += mem.expert_load[r * t.M + k];
        mem.rank_load0[r] = sum;
    }
    __syncthreads();
}

// Phase 3. The oracle's visiting orders, by counting how many items precede each one:
// ranks in the first half of the block, experts in the second, at once (the counting is
// short; issuing it is what costs). A rank's count is split over `parts` consecutive
// lanes (a power of two) and summed with shuffles. Each thread holds the load it
// compares against, so the loads of the others are independent.
__device__ __forceinline__ void order_visits(int D, int M, const DomainShared& sh) {
    const int tid = threadIdx.x, DM = D * M;
    PHASE_STAMP(STAMP_ORDERS);
    const int half = THREADS / 2;
    if (tid < half) {
        const int part_bits = min(5, 31 - __clz(half / D)), parts = 1 << part_bits;
#pragma unroll 1
        for (int idx = tid; idx < ((D * parts + 31) & ~31); idx += half) {
            const int r = idx >> part_bits, part = idx & (parts - 1);
            int pos = 0;
            if (r < D) {
                const int load = sh.rank_load0[r];
#pragma unroll 4
                for (int other = part; other < D; other += parts) pos += precedes(sh.rank_load0[other], other, load, r);
            }
            for (int offset = parts >> 1; offset; offset >>= 1) pos += __shfl_xor_sync(FULL_MASK, pos, offset);
            if (r < D && part == 0) {
                int hottest = r * M;  // ties to the lowest index
#pragma unroll 1
                for (int other = r * M + 1; other < (r + 1) * M; ++other)
                    hottest = sh.expert_load[other] > sh.expert_load[hottest] ? other : hottest;
                sh.visits[pos] = make_int4(r, sh.rank_load0[r], hottest, sh.expert_load[hottest]);
            }
        }
    } else {
#pragma unroll 1
        for (int e = tid - half; e < DM; e += half) {
            const int base = (e / M) * M, load = sh.expert_load[e];
            int pos = 0;
#pragma unroll 4
            for (int other = base; other < base + M; ++other) pos += precedes(sh.expert_load[other], other, load, e);
            sh.expert_order[base + pos] = make_int2(e, sh.expert_load[e]);
        }
    }
}

struct SearchBounds {
    long long total;  // the domain's load
    int lo, hi;       // the search's infeasible lower and feasible upper end
    int tolerance;
};

// Phase 4 (every warp computes them): lo = ceil(mean) - 1 is infeasible (or cap - 1:
// quota.search_floor), hi = the initial max is feasible without any move.
__device__ __forceinline__ SearchBounds search_bounds(int D, const DomainShared& sh, int tau_tolerance,
                                                      long long cap_ppm) {
    const int lane = threadIdx.x & 31;
    PHASE_STAMP(STAMP_BOUNDS);
    long long total = 0;
    int hi = 0;
#pragma unroll 1
    for (int r = lane; r < D; r += 32) { total += sh.rank_load0[r]; hi = max(hi, sh.rank_load0[r]); }
    total = warp_sum(total);
    hi = __reduce_max_sync(FULL_MASK, hi);
    int lo = (int)floor_div(total + D - 1, D, __drcp_rn((double)D)) - 1;  // 64-bit division is a long call
    if (cap_ppm) {  // no search from hi - 1 on
        const long long cap = floor_div(total * cap_ppm, D * 1000000LL, __drcp_rn(D * 1e6));
        lo = (int)max((long long)lo, min((long long)hi, cap) - 1);
    }
    const int tolerance = tau_tolerance >= 0 ? tau_tolerance : max(0, lo >> NEAR_SHIFT);  // -1: quota.auto_tolerance
    return SearchBounds{total, lo, hi, tolerance};
}

// Phase 5. The threshold search: one probe warp per probe, PROBES probes per round; every
// thread of the cluster tracks the same lo, hi and best probe. A probe's result is
// broadcast to every block, so all blocks take the same decision after one cluster
// barrier per round; with a cap, the first round's probe 0 (the cap) sends its outcome
// and moves to every block itself, and when it is feasible that ends the search without
// a cluster barrier. Meanwhile ROW_WARPS idle warps write the split rows as if no expert
// had replicas, the others set up the tables the placement is rebuilt in, and the idle
// warps of the winner's block push its moves to every block. Returns the winner's move
// count, once every block holds its moves (none if no probe ran or none was feasible).
template <int CHUNKS>
__device__ __forceinline__ int search_threshold(const BlockTask& t, const BlockShared& mem, SearchBounds bounds,
                                                int step, int fit_first, long long cap_ppm,
                                                int* __restrict__ split_prefix) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int D = t.D, M = t.M, S = t.S, K = t.K, move_ints = t.move_ints, block = t.block;
    int lo = bounds.lo, hi = bounds.hi;
    const int tolerance = bounds.tolerance;
    int* const best_moves = mem.best_moves;
    PHASE_STAMP(STAMP_SEARCH);
    int best_count = 0, parity = 0;
    const bool packed = hi < (1 << 23);  // every slack fits the packed oracle keys
    const bool prober = warp < PROBE_WARPS;
    const int probe = block * PROBE_WARPS + warp;
    // The master-only rows: the block overwrites the first prefixes of its replicated
    // experts' rows after the search (a block barrier orders the two writes). Few warps:
    // more would slow the probes down through the shared memory pipeline.
    if (!prober && warp < PROBE_WARPS + ROW_WARPS)
        write_master_rows(split_prefix, mem.staged, t.R, t.E, K, t.first_expert + t.first_column, t.columns, t.share,
                          warp - PROBE_WARPS, ROW_WARPS);
    // This warp wrote memory that other warps read after the next cluster barrier (another
    // block's shared memory, or the tables below), so it arrives there with release (when a
    // feasible cap ends the search, a block barrier orders the tables instead).
    bool pushed = false;
    if (warp >= PROBE_WARPS + ROW_WARPS) {  // the rest set up the tables the placement is rebuilt in
        const int helper = tid - (PROBE_WARPS + ROW_WARPS) * 32, helpers = THREADS - (PROBE_WARPS + ROW_WARPS) * 32;
#pragma unroll 1
        for (int e = helper; e < t.DM; e += helpers) {
            mem.replicas[e] = 1;
            mem.first_move[e] = 0;
            mem.master_quota[e] = mem.expert_load[e];
        }
#pragma unroll 1
        for (int i = helper; i < D * S; i += helpers) mem.slot_expert[i] = -1;
#pragma unroll 1
        for (int r = helper; r < D; r += helpers) mem.incoming[r] = 0;
        pushed = true;
    }
    // With a cap, the first round's probe 0 is the cap: when it is feasible it ends the
    // search, and its outcome alone decides, without a cluster barrier.
    bool cap_round = cap_ppm != 0, cap_reached = false;
    while ((long long)hi - lo > (long long)tolerance + 1) {
        int* round = mem.results + parity * 3 * PROBES;
        int* round_moves = mem.warp_moves + parity * PROBE_WARPS * move_ints;
        int tau = 0, count = 0;
        bool active = false;
        if (prober) {
            PROBE_START(probe_start);
            tau = probe_point(lo, hi, probe, &active);
            int* moves = round_moves + warp * move_ints;
            // The oracle's pass 1 is optional (quota.plan_placement: fit_first).
            count = !active ? 0
                    : packed ? (fit_first ? run_oracle<CHUNKS, true, true>(tau, D, M, S, K - 1, step, moves)
                                          : run_oracle<CHUNKS, true, false>(tau, D, M, S, K - 1, step, moves))
                             : (fit_first ? run_oracle<CHUNKS, false, true>(tau, D, M, S, K - 1, step, moves)
                                          : run_oracle<CHUNKS, false, false>(tau, D, M, S, K - 1, step, moves));
            PROBE_STAMP(probe, probe_start, count);
            if (cap_round && probe == 0) send_cap_outcome(count, moves, best_moves, mem.cap_count, mem.cap_signal);
        }
        if (cap_round) {
            mbarrier_wait<true>(mem.cap_signal, 0, "the cap probe's outcome (sent by warp 0 of cluster block 0)");
            cap_round = false;
            if (*mem.cap_count >= 0) {  // the other probes' results are not needed (nor published)
                hi = lo + 1;
                best_count = *mem.cap_count;
                cap_reached = true;
                break;
            }
        }
        if (prober && lane < CLUSTER) {  // lane b publishes the result to block b
            store_to_block(&round[probe], lane, tau);
            store_to_block(&round[PROBES + probe], lane, active ? (count >= 0 ? 1 : 0) : -1);
            store_to_block(&round[2 * PROBES + probe], lane, count);
        }
        cluster_sync(prober || pushed);
        pushed = false;
        // Lowest feasible probe: the first one not infeasible, if it is feasible (inactive
        // probes, state -1, come last); lo moves to the probe just below it.
        const unsigned decided = __ballot_sync(FULL_MASK, round[PROBES + lane] != 0);
        const int first = decided ? __ffs(decided) - 1 : PROBES;
        if (first < PROBES && round[PROBES + first] == 1) {
            hi = round[first];
            best_count = round[2 * PROBES + first];
            // The idle warps of the winner's block push its moves to every block (the probe
            // warps go on; the next round writes the other parity's buffers).
            if (!prober && block == first / PROBE_WARPS) {
                const int* winner = round_moves + (first % PROBE_WARPS) * move_ints;
                const int ints = MOVE_INTS * best_count;
                for (int i = tid - PROBE_WARPS * 32; i < ints * CLUSTER; i += THREADS - PROBE_WARPS * 32) {
                    const int to = i / ints, at = i - to * ints;
                    store_to_block(&best_moves[at], to, winner[at]);
                }
                pushed = true;
            }
        }
        lo = first > 0 ? round[first - 1] : lo;
        parity ^= 1;
    }
    PHASE_STAMP(STAMP_SEARCH_DONE);
    // The winner's moves were received with the cap's outcome, or pushed: then a cluster
    // barrier completes the last pushes. From here on no block touches another's shared
    // memory.
    if (cap_reached) __syncthreads();  // the tables set up during the search are complete
    else cluster_sync(pushed);  // the last pushes are complete
    PHASE_STAMP(STAMP_MOVES_RECEIVED);
    return best_count;
}

// Phase 6. Every block rebuilds the domain's placement from the winner's moves.
__device__ __forceinline__ void rebuild_placement(const BlockTask& t, const BlockShared& mem, int best_count) {
    const int* best_moves = mem.best_moves;
#pragma unroll 1
    for (int m = threadIdx.x; m < best_count; m += THREADS) {
        const int e = move_expert(best_moves[MOVE_INTS * m]), target = move_target(best_moves[MOVE_INTS * m]);
        const int amount = best_moves[MOVE_INTS * m + 1];
        if (m == 0 || move_expert(best_moves[MOVE_INTS * (m - 1)]) != e)
            mem.first_move[e] = m;  // an expert's moves are consecutive
        mem.slot_expert[target * t.S + move_slot(best_moves[MOVE_INTS * m])] = e;
        atomicSub(&mem.master_quota[e], amount);  // integer atomics: order-independent
        atomicAdd(&mem.replicas[e], 1);
        atomicAdd(&mem.incoming[target], amount);
    }
    __syncthreads();
}

// Phase 7. This block's experts: placement rows [K] (consecutive threads, consecutive
// entries of the block's rows: one pass of the block for up to THREADS entries), replica
// counts, and the replicated experts in column order (a ballot per 32) for the split.
__device__ __forceinline__ void write_expert_outputs(const BlockTask& t, const BlockShared& mem,
                                                     int* __restrict__ log_to_phys, int* __restrict__ quota,
                                                     int* __restrict__ replica_count) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, K = t.K, M = t.M;
    const int* best_moves = mem.best_moves;
    PHASE_STAMP(STAMP_EXPERT_OUTPUTS);
#pragma unroll 1
    for (int idx = tid; idx < t.columns * K; idx += THREADS) {
        const int c = idx / K, column = idx - c * K, e = t.first_column + c, r = e / M;
        const long long at = (long long)(t.first_expert + e) * K + column;
        int slot = -1, tokens = 0;
        if (column == 0) {
            slot = (t.first_rank + r) * t.slots_per_rank + (e - r * M);
            tokens = mem.master_quota[e];
        } else if (column < mem.replicas[e]) {
            const int m = mem.first_move[e] + column - 1;
            slot = (t.first_rank + move_target(best_moves[MOVE_INTS * m])) * t.slots_per_rank + M +
                   move_slot(best_moves[MOVE_INTS * m]);
            tokens = best_moves[MOVE_INTS * m + 1];
        }
        log_to_phys[at] = slot;
        quota[at] = tokens;
    }
    if (warp == WARPS - 1) {
        int count = 0;
#pragma unroll 1
        for (int first = 0; first < t.columns; first += 32) {
            const int c = first + lane, instances = c < t.columns ? mem.replicas[t.first_column + c] : 0;
            if (c < t.columns) replica_count[t.first_expert + t.first_column + c] = instances;
            const unsigned found = __ballot_sync(FULL_MASK, instances > 1);
            if (instances > 1) mem.replicated[count + __popc(found & ((1u << lane) - 1))] = c;
            count += __popc(found);
        }
        if (lane == 0) mem.replicated[t.share] = count;
    }
}

// Phase 8. This block's ranks: slot contents and loads after balancing.
__device__ __forceinline__ void write_rank_outputs(const BlockTask& t, const BlockShared& mem,
                                                   int* __restrict__ phys_to_log, long long* __restrict__ rank_load) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, D = t.D, M = t.M;
    PHASE_STAMP(STAMP_RANK_OUTPUTS);
    const int rank_share = (D + CLUSTER - 1) / CLUSTER;
    const int my_first_rank = min(D, t.block * rank_share), my_ranks = min(D, my_first_rank + rank_share) - my_first_rank;
#pragma unroll 1
    for (int r = my_first_rank + warp; r < my_first_rank + my_ranks; r += WARPS)
        for (int j = lane; j < t.slots_per_rank; j += 32) {
            const int e = j < M ? r * M + j : mem.slot_expert[r * t.S + j - M];
            phys_to_log[(t.first_rank + r) * t.slots_per_rank + j] = e < 0 ? -1 : t.first_expert + e;
        }
#pragma unroll 1
    for (int r = my_first_rank + tid; r < my_first_rank + my_ranks; r += THREADS) {
        long long sum = mem.incoming[r];
#pragma unroll 1
        for (int k = 0; k < M; ++k) sum += mem.master_quota[r * M + k];
        rank_load[t.first_rank + r] = sum;
    }
    __syncthreads();
}

// Phase 9 (quota.locality_split), by one warp for item x of the block's replicated
// experts: the instances' local tokens and capacities, the proportional shares' row and
// column deficits, and their prefixes (the north-west corner's bounds).
__device__ __forceinline__ void split_deficits(const BlockTask& t, const BlockShared& mem, int x) {
    const int lane = threadIdx.x & 31, R = t.R, K = t.K, M = t.M;
    const int c = mem.replicated[x], e = t.first_column + c, n = mem.replicas[e];
    int* host = mem.inst_host + x * K;
    int* local = mem.inst_local + x * K;
    int* capacity = mem.inst_capacity + x * K;
    int* column = mem.inst_column + x * K;
    int* row = mem.row_prefix + x * R;
    int spare = 0;
#pragma unroll 1
    for (int i = lane; i < n; i += 32) {
        int h = t.first_rank + e / M, tokens = mem.master_quota[e];
        if (i > 0) {
            const int* move = mem.best_moves + MOVE_INTS * (mem.first_move[e] + i - 1);
            h = t.first_rank + move_target(move[0]);
            tokens = move[1];
        }
        local[i] = min(mem.staged[h * t.share + c], tokens);
        host[i] = h;
        capacity[i] = tokens - local[i];
        column[i] = capacity[i];  // less the column sums of the shares: the column deficits
        spare += capacity[i];
    }
    const int total = __reduce_add_sync(FULL_MASK, spare);
    if (lane == 0) mem.item_total[x] = total;
    const double inverse = total ? __drcp_rn((double)total) : 0.0;
    double* ratio = mem.inst_ratio + x * K;
#pragma unroll 1
    for (int i = lane; i < n; i += 32) ratio[i] = capacity[i] * inverse;
    int* demand = mem.remote + x * R;
#pragma unroll 1
    for (int src = lane; src < R; src += 32) demand[src] = mem.staged[src * t.share + c];
    __syncwarp();
#pragma unroll 1
    for (int i = lane; i < n; i += 32) demand[host[i]] -= local[i];  // the hosts are distinct ranks
    __syncwarp();
    PHASE_STAMP(STAMP_SHARES);
    // Proportional shares floor(d * capacity / total): row and column deficits, two
    // sources per lane at a time. Lane j keeps the column sum of instance first + j in
    // a register, so no shared-memory store orders the instances: their shares and
    // reductions overlap (the hottest experts, with the most instances, set the pace).
#pragma unroll 1
    for (int base = 0; base < R; base += 64) {
        const int src0 = base + lane, src1 = src0 + 32;
        const int d0 = src0 < R ? demand[src0] : 0, d1 = src1 < R ? demand[src1] : 0;
        const double demand0 = d0, demand1 = d1;
        int taken0 = 0, taken1 = 0;
        for (int first = 0; first < n; first += 32) {
            int column_sum = 0;
#pragma unroll 4
            for (int i = first; i < min(n, first + 32); ++i) {
                const int share0 = proportional_share(d0, demand0, capacity[i], ratio[i], total);
                const int share1 = proportional_share(d1, demand1, capacity[i], ratio[i], total);
                taken0 += share0;
                taken1 += share1;
                const int sum = __reduce_add_sync(FULL_MASK, share0 + share1);
                column_sum = lane == i - first ? sum : column_sum;
            }
            if (first + lane < n) column[first + lane] -= column_sum;
        }
        if (src0 < R) row[src0] = d0 - taken0;
        if (src1 < R) row[src1] = d1 - taken1;
    }
    __syncwarp();
    PHASE_STAMP(STAMP_SCANS);
    warp_inclusive_scan(column, n);  // north-west corner bounds: deficit prefixes
    warp_inclusive_scan(row, R);
}

// Phase 10. Each source's row of K prefixes of the block's replicated experts: share +
// north-west overlap + local tokens, a source per thread. Only the quads before instance
// n - 1 are written: from there on the prefix is the source's load, which the
// master-only rows written during the search already hold (the stores, not the
// arithmetic, set the pace here).
__device__ __forceinline__ void write_split_rows(const BlockTask& t, const BlockShared& mem, int items,
                                                 int* __restrict__ split_prefix) {
    const int R = t.R, K = t.K;
    PHASE_STAMP(STAMP_ROWS);
#pragma unroll 1
    for (int idx = threadIdx.x; idx < items * R; idx += THREADS) {
        const int x = idx / R, src = idx - x * R, c = mem.replicated[x], e = t.first_column + c, n = mem.replicas[e];
        const int* host = mem.inst_host + x * K;
        const int* local = mem.inst_local + x * K;
        const int* capacity = mem.inst_capacity + x * K;
        const int* column = mem.inst_column + x * K;
        const int* row = mem.row_prefix + x * R;
        const double* ratio = mem.inst_ratio + x * K;
        const int total = mem.item_total[x], d = mem.remote[x * R + src];
        const double demand = d;
        const int row_stop = row[src], row_start = src ? row[src - 1] : 0;
        int* out = split_prefix + ((long long)src * t.E + t.first_expert + e) * K;
        int prefix = 0;
#pragma unroll 1
        for (int i0 = 0; i0 < n - 1; i0 += 4) {
            int values[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + u;
                if (i < n) {
                    const int col_start = i ? column[i - 1] : 0, col_stop = column[i];
                    prefix += proportional_share(d, demand, capacity[i], ratio[i], total);
                    prefix += max(0, min(row_stop, col_stop) - max(row_start, col_start));
                    prefix += host[i] == src ? local[i] : 0;
                }
                values[u] = prefix;
            }
            store_quad(out, i0, K, values);
        }
    }
}

template <int CHUNKS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1)
plan_domains(const int* __restrict__ loads, int R, int E, int S, int D, int K, int step, int tau_tolerance,
             long long cap_ppm, int fit_first, int* __restrict__ phys_to_log, int* __restrict__ log_to_phys,
             int* __restrict__ replica_count, int* __restrict__ quota, long long* __restrict__ rank_load, int* __restrict__ split_prefix,
             double* __restrict__ imbalance_before, double* __restrict__ imbalance_after,
             long long* __restrict__ workspace) {
    static_assert(CHUNKS <= MAX_CHUNKS, "a domain holds at most MAX_DOMAIN ranks");
    extern __shared__ int4 smem[];
    PHASE_STAMP(STAMP_START);
    const BlockTask t(R, E, S, D, K);
    const BlockShared mem(smem, t);
    if (mem.bytes > dynamic_shared_bytes()) shared_memory_short();

    stage_loads(loads, t, mem);
    exchange_expert_loads(t, mem);
    order_visits(D, t.M, mem);
    const SearchBounds bounds = search_bounds(D, mem, tau_tolerance, cap_ppm);
    __syncthreads();  // the visiting orders are complete
    const int best_count = search_threshold<CHUNKS>(t, mem, bounds, step, fit_first, cap_ppm, split_prefix);
    rebuild_placement(t, mem, best_count);
    write_expert_outputs(t, mem, log_to_phys, quota, replica_count);
    write_rank_outputs(t, mem, phys_to_log, rank_load);

    // The split of this block's replicated experts ("items"): a warp per item finds the
    // deficits (no block barrier between its steps), then the whole block writes the rows.
    // The imbalance goes alongside (its warp takes an item only when there are WARPS).
    PHASE_STAMP(STAMP_SPLIT);
    const int items = mem.replicated[t.share];
    if (t.block == 0 && (threadIdx.x >> 5) == WARPS - 1)
        write_imbalance(mem.rank_load0, mem.incoming, mem.master_quota, bounds.total, D, t.M, R, t.domain, t.domains,
                        workspace, imbalance_before, imbalance_after);
#pragma unroll 1
    for (int x = threadIdx.x >> 5; x < items; x += WARPS) split_deficits(t, mem, x);
    __syncthreads();
    write_split_rows(t, mem, items, split_prefix);
#ifdef PLANNER_PHASE_STAMPS
    __syncthreads();  // the block's last phase is complete
#endif
    PHASE_STAMP(STAMP_END);
}
