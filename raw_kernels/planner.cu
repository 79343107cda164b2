//! kernels: plan_domains<1>, plan_domains<2>, plan_domains<4>
// Quota planner on the GPU, bitwise equal to ultraep/planner/quota.py (read its module
// docstring first: the same threshold search, greedy oracle and split, step by step).
//
// plan_domains<CHUNKS>: the whole plan in one launch. One cluster of CLUSTER blocks of
// WARPS warps per NVLink domain of up to 32*CHUNKS ranks. Only PROBE_WARPS warps of a
// block run probes (one per SM sub-partition: a probe is a latency-bound chain that
// would only slow down if it shared a scheduler); the other warps join the phases that
// are wide: staging, ordering, outputs and the split.
//  1. Each block stages the load columns of its share of the domain's experts (all
//     source ranks) in shared memory and sums them; the column sums are exchanged
//     through distributed shared memory, so every block holds the domain's expert loads
//     and derives the visiting orders itself.
//  2. Threshold search: one probe warp per probe, PROBES probes per round. A probe's greedy
//     oracle is a serial loop of warp-wide moves, and a warp issues an integer
//     instruction every other cycle at best, so a move is kept to few instructions: each
//     lane owns the keys of ranks lane, lane+32, ... in registers (selected, never
//     indexed: an indexed register array lives in local memory), one min-reduction over
//     them names the target (best fit before most slack; the rank index and whether it
//     has one free slot left packed in the key when loads allow, else one ballot per
//     chunk and a shuffle), and the target's new keys follow from the winning key (about
//     60 instructions). The ranks' visits are one loop over their experts, with the next
//     rank's visit loaded a move ahead. The oracle is compiled per pass count. A probe's
//     result is broadcast to every block, so all blocks take the same decision after one
//     cluster barrier per round; with a cap, the first round's probe 0 (the cap) sends its
//     outcome and moves to every block itself, and when it is feasible that ends the
//     search without a cluster barrier. Meanwhile ROW_WARPS idle warps write the split
//     rows as if no expert had replicas (lean loops: they share schedulers with the
//     probes), the others set up the tables step 3 rebuilds the placement in, and the idle
//     warps of the winner's block push its moves to every block.
//  3. Every block rebuilds the domain's placement from the winner's moves and writes the
//     outputs of its share of the experts and ranks, and the locality-first split of its
//     replicated experts (deficits a warp per expert, then rows a source per thread,
//     storing only the prefixes that differ from the rows written during the search).
//  4. Imbalance before/after, by one warp alongside step 3: directly when there is one
//     domain, else the last cluster to finish (a ticket in the plan's workspace)
//     combines the domains' figures.
// Phase times: scripts/planner_phases.py. Code that runs once per launch is paid for in
// instruction fetch and issue, so keep it small: loops that run once are not unrolled.
// All decisions use integer arithmetic (the total load is below 2**31) and break ties by
// the lowest index, exactly as the NumPy reference does.

#include "sync.cuh"

#define FULL_MASK 0xffffffffu
#define CLUSTER 8                 // blocks per domain (the portable cluster size)
#define PROBE_WARPS 4             // probes per block: one per SM sub-partition
#define WARPS 16                  // all warps share the set-up, the outputs and the split
#define ROW_WARPS 4               // warps that write the master-only split rows during the search
#define THREADS (WARPS * 32)
#define PROBES (CLUSTER * PROBE_WARPS)  // probes per round (quota.PROBES_PER_ROUND)
#define NEAR_PROBES 24            // quota.NEAR_PROBES
#define NEAR_SHIFT 11             // quota.NEAR_SHIFT
#define NO_TARGET 0xffffffffu     // oracle key of a rank that cannot take the replica
#define MOVE_INTS 2               // per move: expert << 16 | slot << 8 | target, tokens
#define SPILL_FLIP 0xffffff00u    // packed spill key = fit key ^ SPILL_FLIP
#define STAGE_BATCH 4             // load values a staging thread has in flight at once

static_assert(PROBES == 32, "the round decision reads one probe per lane");

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
// no fence and the receivers no cluster barrier (together about 1 us of the round).
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
        target = (best >> 1) & 127;
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
        moves[MOVE_INTS * count] = e << 16 | (S - mine) << 8 | target;
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
// min-reduction and about 60 instructions: a warp issues an integer instruction every
// other cycle at best, so the instruction count, not the chain, sets the pace. Pass 2
// visits the ranks in one loop over their experts, and the next rank's visit and the
// rank's next expert are loaded while the expert's moves run. A compile-time choice: the
// loop over passes costs the one-pass oracle about 2 us. Not inlined: the loop keeps its
// own register allocation whatever the rest of the kernel needs.
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
        if (FIT_FIRST && next < 128) {
            const unsigned long long low = next < 64 ? ~relieved_low & (~0ull << next) : 0ull;
            const unsigned long long high = ~relieved_high & (next < 64 ? ~0ull : ~0ull << (next - 64));
            next = low ? __ffsll(low) - 1 : high ? 63 + __ffsll(high) : 128;
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
    const long long step = max(1LL, min((long long)(lo >> NEAR_SHIFT), gap >> 6));
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

template <int CHUNKS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1)
plan_domains(const int* __restrict__ loads, int R, int E, int S, int D, int K, int step, int tau_tolerance,
             long long cap_ppm, int fit_first, int* __restrict__ phys_to_log, int* __restrict__ log_to_phys,
             int* __restrict__ replica_count, int* __restrict__ quota, long long* __restrict__ rank_load, int* __restrict__ split_prefix,
             double* __restrict__ imbalance_before, double* __restrict__ imbalance_after,
             long long* __restrict__ workspace) {
    extern __shared__ int4 smem[];
    const int M = E / R, DM = D * M, slots_per_rank = M + S;
    const int move_ints = (MOVE_INTS * S * D + 3) & ~3;  // whole 16-byte words: the cap probe sends them so
    const int domain = blockIdx.x / CLUSTER, domains = gridDim.x / CLUSTER;
    const int first_rank = domain * D, first_expert = first_rank * M;
    const int block = (int)cluster_block_rank(), tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int share = (DM + CLUSTER - 1) / CLUSTER;  // experts whose columns and split this block owns
    const int first_column = min(DM, block * share), columns = min(DM, first_column + share) - first_column;
    const DomainShared sh(smem, D, M);
    int* cursor = sh.end + (-(sh.end - reinterpret_cast<int*>(smem)) & 3);  // 16-byte aligned: moves, mbarrier, doubles
    int* warp_moves = cursor;    cursor += 2 * PROBE_WARPS * move_ints;  // per round parity and probe warp: its moves
    int* best_moves = cursor;    cursor += move_ints;          // the moves of the chosen probe
    auto* cap_signal = reinterpret_cast<unsigned long long*>(cursor);  cursor += 2;  // the cap probe's outcome arrived
    int* cap_count = cursor;     cursor += 2;                  // its move count, -1 if infeasible
    double* inst_ratio = reinterpret_cast<double*>(cursor);  cursor += 2 * share * K;  // the split's capacity / total
    int* results = cursor;       cursor += 2 * 3 * PROBES;     // per round parity: tau, state, moves per probe
    int* staged = cursor;        cursor += R * share;          // loads[src][this block's experts]
    int* partial = cursor;       cursor += share;              // this block's column sums
    int* replicas = cursor;      cursor += DM;                 // instances per expert
    int* master_quota = cursor;  cursor += DM;
    int* first_move = cursor;    cursor += DM;                 // index of the expert's first move
    int* incoming = cursor;      cursor += D;                  // tokens of the replicas placed per rank
    int* slot_expert = cursor;   cursor += D * S;              // expert of each redundant slot, -1 if idle
    int* replicated = cursor;    cursor += share + 1;          // this block's replicated experts, then their count
    // The split of the block's replicated experts ("items"): per item, per instance [K]
    // and per source [R].
    int* inst_host = cursor;     cursor += share * K;          // host rank (global) of each instance
    int* inst_local = cursor;    cursor += share * K;          // tokens it takes from its own host rank
    int* inst_capacity = cursor; cursor += share * K;          // quota left after them
    int* inst_column = cursor;   cursor += share * K;          // column deficits, then their prefixes
    int* row_prefix = cursor;    cursor += share * R;          // row deficits, then their inclusive prefix
    int* remote = cursor;        cursor += share * R;          // each source's demand once hosts took theirs
    int* item_total = cursor;    cursor += share;              // total capacity of each item

    // 1. Stage this block's load columns and sum them: thread (group, c) reads column c of
    // every groups-th source (consecutive threads, consecutive columns: coalesced), with
    // STAGE_BATCH loads in flight before the first is used (one memory round trip, not
    // one per source).
#pragma unroll 1
    for (int i = tid; i < columns; i += THREADS) partial[i] = 0;
    if (tid == 0) {
        mbarrier_init(cap_signal, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // before the cluster barrier below
    }
    __syncthreads();
    if (columns > 0) {
        const int groups = max(1, THREADS / columns);
        const int* block_loads = loads + first_expert + first_column;
        for (int idx = tid; idx < columns * groups; idx += THREADS) {
            const int c = idx % columns, group = idx / columns;
            int sum = 0;
            for (int first_src = group; first_src < R; first_src += STAGE_BATCH * groups) {
                int tokens[STAGE_BATCH];
#pragma unroll
                for (int b = 0; b < STAGE_BATCH; ++b) {
                    const int src = first_src + b * groups;
                    tokens[b] = src < R ? block_loads[(long long)src * E + c] : 0;
                }
#pragma unroll
                for (int b = 0; b < STAGE_BATCH; ++b) {
                    const int src = first_src + b * groups;
                    if (src < R) staged[src * share + c] = tokens[b];
                    sum += tokens[b];
                }
            }
            atomicAdd(&partial[c], sum);  // integer atomics: order-independent
        }
    }
    __syncthreads();      // the block's partial sums are complete
    cluster_sync(false);  // every block of the cluster is running
#pragma unroll 1
    for (int to = warp; to < CLUSTER; to += WARPS)
        for (int c = lane; c < columns; c += 32) store_to_block(&sh.expert_load[first_column + c], to, partial[c]);
    cluster_sync(warp < CLUSTER);  // every block holds all the domain's expert loads
#pragma unroll 1
    for (int r = tid; r < D; r += THREADS) {
        int sum = 0;
#pragma unroll 1
        for (int k = 0; k < M; ++k) sum += sh.expert_load[r * M + k];
        sh.rank_load0[r] = sum;
    }
    __syncthreads();
    // Orders by counting how many items precede each one: ranks in the first half of the
    // block, experts in the second, at once (the counting is short; issuing it is what
    // costs). A rank's count is split over `parts` consecutive lanes (a power of two) and
    // summed with shuffles. Each thread holds the load it compares against, so the loads
    // of the others are independent.
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
    // Search bounds (every warp computes them): lo = ceil(mean) - 1 is infeasible (or
    // cap - 1: quota.search_floor), hi = the initial max is feasible without any move.
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
    __syncthreads();

    // 2. Threshold search. Every thread of the cluster tracks the same lo, hi and best probe.
    int best_count = 0, parity = 0;
    const bool packed = hi < (1 << 23);  // every slack fits the packed oracle keys
    const bool prober = warp < PROBE_WARPS;
    const int probe = block * PROBE_WARPS + warp;
    // Meanwhile the other warps write every split row of the block's experts as if no
    // expert had replicas; the block overwrites the first prefixes of its replicated
    // experts' rows after the search (a block barrier orders the two writes).
    // (Few warps: more would slow the probes down through the shared memory pipeline.)
    if (!prober && warp < PROBE_WARPS + ROW_WARPS)
        write_master_rows(split_prefix, staged, R, E, K, first_expert + first_column, columns, share,
                          warp - PROBE_WARPS, ROW_WARPS);
    // This warp wrote memory that other warps read after the next cluster barrier (another
    // block's shared memory, or the tables below), so it arrives there with release (when a
    // feasible cap ends the search, a block barrier orders the tables instead).
    bool pushed = false;
    if (warp >= PROBE_WARPS + ROW_WARPS) {  // the rest set up the tables the placement is rebuilt in
        const int helper = tid - (PROBE_WARPS + ROW_WARPS) * 32, helpers = THREADS - (PROBE_WARPS + ROW_WARPS) * 32;
#pragma unroll 1
        for (int e = helper; e < DM; e += helpers) {
            replicas[e] = 1;
            first_move[e] = 0;
            master_quota[e] = sh.expert_load[e];
        }
#pragma unroll 1
        for (int i = helper; i < D * S; i += helpers) slot_expert[i] = -1;
#pragma unroll 1
        for (int r = helper; r < D; r += helpers) incoming[r] = 0;
        pushed = true;
    }
    // With a cap, the first round's probe 0 is the cap: when it is feasible it ends the
    // search, and its outcome alone decides, without a cluster barrier.
    bool cap_round = cap_ppm != 0, cap_reached = false;
    while ((long long)hi - lo > (long long)tolerance + 1) {
        int* round = results + parity * 3 * PROBES;
        int* round_moves = warp_moves + parity * PROBE_WARPS * move_ints;
        int tau = 0, count = 0;
        bool active = false;
        if (prober) {
            tau = probe_point(lo, hi, probe, &active);
            int* moves = round_moves + warp * move_ints;
            // The oracle's pass 1 is optional (quota.plan_placement: fit_first).
            count = !active ? 0
                    : packed ? (fit_first ? run_oracle<CHUNKS, true, true>(tau, D, M, S, K - 1, step, moves)
                                          : run_oracle<CHUNKS, true, false>(tau, D, M, S, K - 1, step, moves))
                             : (fit_first ? run_oracle<CHUNKS, false, true>(tau, D, M, S, K - 1, step, moves)
                                          : run_oracle<CHUNKS, false, false>(tau, D, M, S, K - 1, step, moves));
            if (cap_round && probe == 0) send_cap_outcome(count, moves, best_moves, cap_count, cap_signal);
        }
        if (cap_round) {
            mbarrier_wait<true>(cap_signal, 0, "the cap probe's outcome (sent by warp 0 of cluster block 0)");
            cap_round = false;
            if (*cap_count >= 0) {  // the other probes' results are not needed (nor published)
                hi = lo + 1;
                best_count = *cap_count;
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

    // 3. Every block holds the winner's moves (none if no probe ran or none was feasible).
    // Received with the cap's outcome, or pushed: then a cluster barrier completes the
    // last pushes. From here on no block touches another's shared memory.
    if (cap_reached) __syncthreads();  // the tables set up during the search are complete
    else cluster_sync(pushed);  // the last pushes are complete
#pragma unroll 1
    for (int m = tid; m < best_count; m += THREADS) {
        const int e = best_moves[MOVE_INTS * m] >> 16, t = best_moves[MOVE_INTS * m] & 255;
        const int amount = best_moves[MOVE_INTS * m + 1];
        if (m == 0 || best_moves[MOVE_INTS * (m - 1)] >> 16 != e) first_move[e] = m;  // an expert's moves are consecutive
        slot_expert[t * S + (best_moves[MOVE_INTS * m] >> 8 & 255)] = e;
        atomicSub(&master_quota[e], amount);  // integer atomics: order-independent
        atomicAdd(&replicas[e], 1);
        atomicAdd(&incoming[t], amount);
    }
    __syncthreads();
    // This block's experts: placement rows [K] (consecutive threads, consecutive entries of
    // the block's rows: one pass of the block for up to THREADS entries) and replica counts.
#pragma unroll 1
    for (int idx = tid; idx < columns * K; idx += THREADS) {
        const int c = idx / K, column = idx - c * K, e = first_column + c, r = e / M;
        const long long at = (long long)(first_expert + e) * K + column;
        int slot = -1, tokens = 0;
        if (column == 0) {
            slot = (first_rank + r) * slots_per_rank + (e - r * M);
            tokens = master_quota[e];
        } else if (column < replicas[e]) {
            const int m = first_move[e] + column - 1;
            slot = (first_rank + (best_moves[MOVE_INTS * m] & 255)) * slots_per_rank + M + (best_moves[MOVE_INTS * m] >> 8 & 255);
            tokens = best_moves[MOVE_INTS * m + 1];
        }
        log_to_phys[at] = slot;
        quota[at] = tokens;
    }
    if (warp == WARPS - 1) {  // replica counts, and the replicated experts in column order (a ballot per 32)
        int count = 0;
#pragma unroll 1
        for (int first = 0; first < columns; first += 32) {
            const int c = first + lane, instances = c < columns ? replicas[first_column + c] : 0;
            if (c < columns) replica_count[first_expert + first_column + c] = instances;
            const unsigned found = __ballot_sync(FULL_MASK, instances > 1);
            if (instances > 1) replicated[count + __popc(found & ((1u << lane) - 1))] = c;
            count += __popc(found);
        }
        if (lane == 0) replicated[share] = count;
    }
    // This block's ranks: slot contents and loads after balancing.
    const int rank_share = (D + CLUSTER - 1) / CLUSTER;
    const int my_first_rank = min(D, block * rank_share), my_ranks = min(D, my_first_rank + rank_share) - my_first_rank;
#pragma unroll 1
    for (int r = my_first_rank + warp; r < my_first_rank + my_ranks; r += WARPS)
        for (int j = lane; j < slots_per_rank; j += 32) {
            const int e = j < M ? r * M + j : slot_expert[r * S + j - M];
            phys_to_log[(first_rank + r) * slots_per_rank + j] = e < 0 ? -1 : first_expert + e;
        }
#pragma unroll 1
    for (int r = my_first_rank + tid; r < my_first_rank + my_ranks; r += THREADS) {
        long long sum = incoming[r];
#pragma unroll 1
        for (int k = 0; k < M; ++k) sum += master_quota[r * M + k];
        rank_load[first_rank + r] = sum;
    }
    __syncthreads();

    // Split (quota.locality_split) of this block's replicated experts ("items"): one warp
    // per item finds the shares' row and column deficits and their prefixes (no block
    // barrier between these steps), then the whole block writes the rows, a source each.
    // (Every expert's rows were written during the search as if it had no replicas.)
    const int items = replicated[share];
    if (block == 0 && warp == WARPS - 1)  // alongside the items (it takes one only when there are WARPS)
        write_imbalance(sh.rank_load0, incoming, master_quota, total, D, M, R, domain, domains, workspace,
                        imbalance_before, imbalance_after);
#pragma unroll 1
    for (int x = warp; x < items; x += WARPS) {
        const int c = replicated[x], e = first_column + c, n = replicas[e];
        int* host = inst_host + x * K;
        int* local = inst_local + x * K;
        int* capacity = inst_capacity + x * K;
        int* column = inst_column + x * K;
        int* row = row_prefix + x * R;
        int spare = 0;
#pragma unroll 1
        for (int i = lane; i < n; i += 32) {
            int h = first_rank + e / M, tokens = master_quota[e];
            if (i > 0) {
                const int* move = best_moves + MOVE_INTS * (first_move[e] + i - 1);
                h = first_rank + (move[0] & 255);
                tokens = move[1];
            }
            local[i] = min(staged[h * share + c], tokens);
            host[i] = h;
            capacity[i] = tokens - local[i];
            column[i] = capacity[i];  // less the column sums of the shares: the column deficits
            spare += capacity[i];
        }
        const int total = __reduce_add_sync(FULL_MASK, spare);
        if (lane == 0) item_total[x] = total;
        const double inverse = total ? __drcp_rn((double)total) : 0.0;
        double* ratio = inst_ratio + x * K;
#pragma unroll 1
        for (int i = lane; i < n; i += 32) ratio[i] = capacity[i] * inverse;
        int* demand = remote + x * R;
#pragma unroll 1
        for (int src = lane; src < R; src += 32) demand[src] = staged[src * share + c];
        __syncwarp();
#pragma unroll 1
        for (int i = lane; i < n; i += 32) demand[host[i]] -= local[i];  // the hosts are distinct ranks
        __syncwarp();
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
        warp_inclusive_scan(column, n);  // north-west corner bounds: deficit prefixes
        warp_inclusive_scan(row, R);
    }
    __syncthreads();
    // Each source's row of K prefixes: share + north-west overlap + local tokens. Only the
    // quads before instance n - 1 are written: from there on the prefix is the source's
    // load, which the master-only rows written during the search already hold (the stores,
    // not the arithmetic, set the pace here).
#pragma unroll 1
    for (int idx = tid; idx < items * R; idx += THREADS) {
        const int x = idx / R, src = idx - x * R, c = replicated[x], e = first_column + c, n = replicas[e];
        const int* host = inst_host + x * K;
        const int* local = inst_local + x * K;
        const int* capacity = inst_capacity + x * K;
        const int* column = inst_column + x * K;
        const int* row = row_prefix + x * R;
        const double* ratio = inst_ratio + x * K;
        const int total = item_total[x], d = remote[x * R + src];
        const double demand = d;
        const int row_stop = row[src], row_start = src ? row[src - 1] : 0;
        int* out = split_prefix + ((long long)src * E + first_expert + e) * K;
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
