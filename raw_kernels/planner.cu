//! kernels: plan_domains<1>, plan_domains<2>, plan_domains<4>, plan_split
// Quota planner on the GPU, bitwise equal to ultraep/planner/quota.py (read its module
// docstring first: the same threshold search, greedy oracle and split, step by step).
//
// plan_domains<CHUNKS>: one cluster of CLUSTER blocks of WARPS warps per NVLink domain of
//   up to 32*CHUNKS ranks; one warp per threshold probe, PROBES probes per round. A
//   probe's greedy oracle is a long serial chain of warp reductions (~18 us per round at
//   the anchor shapes on the H200 with 4 warps per SM; 32 warps per SM took ~35 us), so
//   the probes are spread thin over the cluster's SMs. Each block holds its own copy of
//   the expert loads and visiting orders in shared memory; the column sums are split
//   over the cluster and exchanged through distributed shared memory. Each probe's rank
//   state lives in registers (lane l owns ranks l, l+32, ...); its result is broadcast
//   to every block, so all blocks take the same decision after one cluster barrier per
//   round. The winning warp keeps its moves, and its block writes the domain's plan.
// plan_split: one block per expert builds the locality-first split prefix; one extra
//   block computes the imbalance before/after once every rank load is known.
// All decisions use integer arithmetic (the total load is below 2**31) and break ties by
// the lowest index, exactly as the NumPy reference does.

#define FULL_MASK 0xffffffffu
#define CLUSTER 8                 // blocks per domain (the portable cluster size)
#define WARPS 4                   // probes per block: one per SM sub-partition
#define PROBES (CLUSTER * WARPS)  // probes per round (quota.PROBES_PER_ROUND)
#define NEAR_PROBES 24            // quota.NEAR_PROBES
#define NEAR_SHIFT 11             // quota.NEAR_SHIFT

static_assert(PROBES == 32, "the round decision reads one probe per lane");

struct DomainShared {
    int* expert_load;   // [D*M]  load of each expert of the domain
    int* rank_load0;    // [D]    load of each rank without balancing
    int* rank_order;    // [D]    ranks by descending load, ties lowest index
    int* order_rank_load;  // [D]  rank_load0 in that order
    int* expert_order;  // [D*M]  each rank's experts by descending load, ties lowest index
    int* order_load;    // [D*M]  expert_load in that order
};

__device__ __forceinline__ unsigned cluster_block_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Barrier over every thread of the cluster; orders shared-memory accesses cluster-wide.
__device__ __forceinline__ void cluster_sync() {
    __syncwarp();
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Store `value` at the address of `local` in the shared memory of cluster block `block`.
__device__ __forceinline__ void store_to_block(int* local, unsigned block, int value) {
    unsigned long long address;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(address) : "l"(reinterpret_cast<unsigned long long>(local)));
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"((unsigned)address), "r"(block));
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(remote), "r"(value) : "memory");
}

__device__ __forceinline__ long long warp_sum(long long value) {
    for (int offset = 16; offset; offset >>= 1) value += __shfl_xor_sync(FULL_MASK, value, offset);
    return value;
}

__device__ __forceinline__ long long warp_max(long long value) {
    for (int offset = 16; offset; offset >>= 1) value = max(value, __shfl_xor_sync(FULL_MASK, value, offset));
    return value;
}

__device__ __forceinline__ bool better_rank(const int* load, int a, int b) {
    return load[a] > load[b] || (load[a] == load[b] && a < b);
}

// The greedy oracle of quota.DomainOracle.run for one threshold, run by one warp: the
// number of moves (the same in every lane) if feasible, else -1. Lane 0 stores the moves
// in `moves` as (expert << 8 | rank, tokens).
template <int CHUNKS>
__device__ int run_oracle(const DomainShared& sh, int tau, int D, int M, int S, int max_replicas, int step,
                          int* moves) {
    const int lane = threadIdx.x & 31;
    int load[CHUNKS], free_slots[CHUNKS];
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        const int t = lane + 32 * j;
        load[j] = t < D ? sh.rank_load0[t] : 0;
        free_slots[j] = t < D ? S : 0;  // ranks beyond the domain never have a free slot
    }
    int count = 0;
    for (int pos = 0; pos < D; ++pos) {
        // A rank's load when visited is its initial load if that is above tau: a target
        // starts at or below tau - step and never ends above tau. Reading it from shared
        // memory, in parallel with the rank, spares a shuffle on the serial chain.
        const int r = sh.rank_order[pos];
        int source_load = sh.order_rank_load[pos];
        if (source_load <= tau) break;
        for (int k = 0; k < M && source_load > tau; ++k) {
            const int e = sh.expert_order[r * M + k];
            int remaining = sh.order_load[r * M + k];
            int hosts = 1;
            unsigned host_bits[CHUNKS];  // ranks hosting e, the same in every lane
#pragma unroll
            for (int j = 0; j < CHUNKS; ++j) host_bits[j] = j == (r >> 5) ? 1u << (r & 31) : 0u;
            while (source_load > tau && hosts <= max_replicas && remaining >= step) {
                const int need = min(max(source_load - tau, step), remaining);
                int slack[CHUNKS];
                bool eligible[CHUNKS];
                unsigned fit = 0xffffffffu, most = 0u;
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) {
                    slack[j] = tau - load[j];
                    eligible[j] = free_slots[j] > 0 && slack[j] >= step && !((host_bits[j] >> lane) & 1u);
                    if (eligible[j]) {
                        if (slack[j] >= need) fit = min(fit, (unsigned)slack[j]);
                        most = max(most, (unsigned)slack[j]);
                    }
                }
                fit = __reduce_min_sync(FULL_MASK, fit);
                most = __reduce_max_sync(FULL_MASK, most);
                if (most == 0u) break;  // nobody eligible (an eligible slack is >= step >= 1)
                const int chosen = (int)(fit != 0xffffffffu ? fit : most);
                int target = -1;
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) {
                    const unsigned hit = __ballot_sync(FULL_MASK, eligible[j] && slack[j] == chosen);
                    if (target < 0 && hit) target = 32 * j + __ffs(hit) - 1;
                }
                const int amount = (chosen - need >= step) ? need : min(chosen, remaining);
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) {
                    if (j == (target >> 5)) {
                        host_bits[j] |= 1u << (target & 31);
                        if (lane == (target & 31)) { load[j] += amount; free_slots[j] -= 1; }
                    }
                    if (j == (r >> 5) && lane == (r & 31)) load[j] -= amount;
                }
                if (lane == 0) { moves[2 * count] = (e << 8) | target; moves[2 * count + 1] = amount; }
                ++count;
                source_load -= amount;
                remaining -= amount;
                ++hosts;
            }
        }
        if (source_load > tau) return -1;
    }
    return count;
}

// Probe w of one round, ascending in w (quota.probe_points).
__device__ __forceinline__ int probe_point(int lo, int hi, int w, bool* active) {
    const long long gap = (long long)hi - lo;
    *active = true;
    if (gap - 1 <= PROBES) { *active = w < gap - 1; return lo + 1 + w; }
    const long long step = max(1LL, min((long long)(lo >> NEAR_SHIFT), gap >> 6));
    if (w < NEAR_PROBES) return (int)(lo + (w + 1) * step);
    const long long start = lo + NEAR_PROBES * step;
    return (int)(start + (w - NEAR_PROBES + 1) * (hi - start) / (PROBES - NEAR_PROBES + 1));
}

template <int CHUNKS>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(WARPS * 32)
plan_domains(const int* __restrict__ loads, int R, int E, int S, int D, int K, int step, int tau_tolerance,
             int* __restrict__ phys_to_log, int* __restrict__ log_to_phys, int* __restrict__ replica_count,
             int* __restrict__ quota, long long* __restrict__ rank_load) {
    extern __shared__ int smem[];
    const int M = E / R, DM = D * M, slots_per_rank = M + S, move_ints = 2 * S * D;
    const int first_rank = (blockIdx.x / CLUSTER) * D, first_expert = first_rank * M;
    const int block = (int)cluster_block_rank(), tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int share = (DM + CLUSTER - 1) / CLUSTER;  // experts whose column sums this block computes
    const int first_column = min(DM, block * share), columns = min(DM, first_column + share) - first_column;
    DomainShared sh;
    int* cursor = smem;
    sh.expert_load = cursor;  cursor += DM;
    sh.rank_load0 = cursor;   cursor += D;
    sh.rank_order = cursor;   cursor += D;
    sh.order_rank_load = cursor; cursor += D;
    sh.expert_order = cursor; cursor += DM;
    sh.order_load = cursor;   cursor += DM;
    int* warp_moves = cursor;   cursor += WARPS * move_ints;  // per warp: the moves of its probe
    int* best_moves = cursor;   cursor += move_ints;          // the moves of the lowest feasible probe so far
    int* results = cursor;      cursor += 2 * 3 * PROBES;     // per round parity: tau, state, moves per probe
    int* bounds = cursor;       cursor += 2;                  // initial lo, hi
    int* partial = cursor;      cursor += share;              // this block's column sums
    int* used = cursor;         cursor += D;                  // replicas placed per rank
    int* incoming = cursor;     cursor += D;                  // tokens of the replicas placed per rank
    int* replicas = cursor;     cursor += DM;                 // instances per expert
    int* master_quota = cursor; cursor += DM;

    for (int i = tid; i < columns; i += blockDim.x) partial[i] = 0;
    for (int e = tid; e < DM; e += blockDim.x) replicas[e] = 1;
    for (int r = tid; r < D; r += blockDim.x) { used[r] = 0; incoming[r] = 0; }
    __syncthreads();
    // Column sums of this block's experts: consecutive threads read consecutive experts
    // (coalesced), sources are split over thread groups, eight loads in flight per thread,
    // combined with integer atomics (order-independent).
    if (columns > 0) {
        const int groups = max(1, (int)blockDim.x / columns);
        for (int idx = tid; idx < columns * groups; idx += blockDim.x) {
            const int column = idx % columns, group = idx / columns;
            const int* source = loads + first_expert + first_column + column;
            int sum = 0, src = group;
            for (; src + 7 * groups < R; src += 8 * groups) {
                int value[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) value[u] = source[(long long)(src + u * groups) * E];
#pragma unroll
                for (int u = 0; u < 8; ++u) sum += value[u];
            }
            for (; src < R; src += groups) sum += source[(long long)src * E];
            atomicAdd(&partial[column], sum);
        }
    }
    cluster_sync();  // every block of the cluster is running and has its partial sums
    for (int i = tid; i < columns * CLUSTER; i += blockDim.x) {
        const int to = i / columns, column = i - to * columns;
        store_to_block(&sh.expert_load[first_column + column], to, partial[column]);
    }
    cluster_sync();  // every block holds all the domain's expert loads
    for (int e = tid; e < DM; e += blockDim.x) master_quota[e] = sh.expert_load[e];
    for (int r = tid; r < D; r += blockDim.x) {
        int sum = 0;
        for (int k = 0; k < M; ++k) sum += sh.expert_load[r * M + k];
        sh.rank_load0[r] = sum;
    }
    __syncthreads();
    // Orders by counting how many items precede each one.
    for (int r = tid; r < D; r += blockDim.x) {
        int pos = 0;
        for (int other = 0; other < D; ++other) pos += better_rank(sh.rank_load0, other, r);
        sh.rank_order[pos] = r;
        sh.order_rank_load[pos] = sh.rank_load0[r];
    }
    for (int e = tid; e < DM; e += blockDim.x) {
        const int base = (e / M) * M;
        int pos = 0;
        for (int other = base; other < base + M; ++other) pos += better_rank(sh.expert_load, other, e);
        sh.expert_order[base + pos] = e;
        sh.order_load[base + pos] = sh.expert_load[e];
    }
    if (warp == 0) {
        long long total = 0, hi = 0;
        for (int r = lane; r < D; r += 32) { total += sh.rank_load0[r]; hi = max(hi, (long long)sh.rank_load0[r]); }
        total = warp_sum(total);
        hi = warp_max(hi);
        if (lane == 0) {
            bounds[0] = (int)((total + D - 1) / D) - 1;  // lo: below the mean, infeasible
            bounds[1] = (int)hi;                         // hi: feasible without any move
        }
    }
    __syncthreads();

    // Every thread of the cluster tracks the same lo, hi and best probe.
    int lo = bounds[0], hi = bounds[1], best_block = 0, best_count = 0, parity = 0;
    const int probe = block * WARPS + warp;
    int* my_moves = warp_moves + warp * move_ints;
    while ((long long)hi - lo > (long long)tau_tolerance + 1) {
        bool active;
        const int tau = probe_point(lo, hi, probe, &active);
        const int count = active ? run_oracle<CHUNKS>(sh, tau, D, M, S, K - 1, step, my_moves) : 0;
        int* round = results + parity * 3 * PROBES;
        if (lane < CLUSTER) {  // lane b publishes the result to block b
            store_to_block(&round[probe], lane, tau);
            store_to_block(&round[PROBES + probe], lane, active ? (count >= 0 ? 1 : 0) : -1);
            store_to_block(&round[2 * PROBES + probe], lane, count);
        }
        cluster_sync();
        // Lowest feasible probe: the first one not infeasible, if it is feasible (inactive
        // probes, state -1, come last); lo moves to the probe just below it.
        const unsigned decided = __ballot_sync(FULL_MASK, round[PROBES + lane] != 0);
        const int first = decided ? __ffs(decided) - 1 : PROBES;
        if (first < PROBES && round[PROBES + first] == 1) {
            hi = round[first];
            best_count = round[2 * PROBES + first];
            best_block = first / WARPS;
            if (probe == first) {  // keep the winner's moves before the next round overwrites them
                for (int i = lane; i < 2 * best_count; i += 32) best_moves[i] = my_moves[i];
                __syncwarp();
            }
        }
        lo = first > 0 ? round[first - 1] : lo;
        parity ^= 1;
    }
    if (block != best_block) return;  // no block reads another's shared memory after the last barrier
    __syncthreads();
    // Write the domain's outputs from the best moves (creation order fixes columns and slots).
    for (int m = tid; m < best_count; m += blockDim.x) {
        const int e = best_moves[2 * m] >> 8, t = best_moves[2 * m] & 255, amount = best_moves[2 * m + 1];
        int column = 1, slot = M;
        for (int prev = 0; prev < m; ++prev) {
            column += (best_moves[2 * prev] >> 8) == e;
            slot += (best_moves[2 * prev] & 255) == t;
        }
        const long long row = (long long)(first_expert + e) * K;
        log_to_phys[row + column] = (first_rank + t) * slots_per_rank + slot;
        quota[row + column] = amount;
        phys_to_log[(first_rank + t) * slots_per_rank + slot] = first_expert + e;
        atomicSub(&master_quota[e], amount);  // integer atomics: order-independent
        atomicAdd(&replicas[e], 1);
        atomicAdd(&used[t], 1);
        atomicAdd(&incoming[t], amount);
    }
    __syncthreads();
    // Masters and unused columns (the replicas' columns are written above), coalesced.
    for (int idx = tid; idx < DM * K; idx += blockDim.x) {
        const int e = idx / K, column = idx - e * K;
        const long long at = (long long)first_expert * K + idx;
        if (column == 0) {
            const int r = e / M;
            log_to_phys[at] = (first_rank + r) * slots_per_rank + (e - r * M);
            quota[at] = master_quota[e];
        } else if (column >= replicas[e]) {
            log_to_phys[at] = -1;
            quota[at] = 0;
        }
    }
    for (int e = tid; e < DM; e += blockDim.x) replica_count[first_expert + e] = replicas[e];
    for (int i = tid; i < D * slots_per_rank; i += blockDim.x) {
        const int r = i / slots_per_rank, j = i - r * slots_per_rank;
        if (j < M) phys_to_log[(first_rank + r) * slots_per_rank + j] = first_expert + r * M + j;
        else if (j >= M + used[r]) phys_to_log[(first_rank + r) * slots_per_rank + j] = -1;
    }
    for (int r = tid; r < D; r += blockDim.x) {
        long long sum = incoming[r];
        for (int k = 0; k < M; ++k) sum += master_quota[r * M + k];
        rank_load[first_rank + r] = sum;
    }
}

// Imbalance max/mean with the formula of plan.imbalance: double(max) * R / double(total).
__device__ double imbalance_of(long long max_load, long long total, int R) {
    return total == 0 ? 1.0 : __ddiv_rn(__dmul_rn((double)max_load, (double)R), (double)total);
}

__device__ void write_imbalance(const int* quota, const long long* rank_load, int R, int E, int K, int* before,
                                double* imbalance_before, double* imbalance_after) {
    __shared__ long long partial[4][32];
    const int M = E / R, tid = threadIdx.x, per_rank = M * K;
    for (int r = tid; r < R; r += blockDim.x) before[r] = 0;
    __syncthreads();
    // Load without balancing = all quotas of the rank's experts (contiguous rows of
    // [E, K]). Each thread sums a contiguous chunk, one atomic per rank it touches; every
    // sum is below the total load, so int32 is exact.
    const int chunk = (E * K + blockDim.x - 1) / blockDim.x;
    const int start = min(E * K, tid * chunk), stop = min(E * K, start + chunk);
    for (int r = start / per_rank; r * per_rank < stop; ++r) {
        int sum = 0;
#pragma unroll 8
        for (int idx = max(start, r * per_rank); idx < min(stop, (r + 1) * per_rank); ++idx) sum += quota[idx];
        atomicAdd(&before[r], sum);
    }
    __syncthreads();
    long long before_max = 0, before_total = 0, after_max = 0, after_total = 0;
    for (int r = tid; r < R; r += blockDim.x) {
        before_max = max(before_max, (long long)before[r]);
        before_total += before[r];
        after_max = max(after_max, rank_load[r]);
        after_total += rank_load[r];
    }
    before_max = warp_max(before_max);
    before_total = warp_sum(before_total);
    after_max = warp_max(after_max);
    after_total = warp_sum(after_total);
    if ((tid & 31) == 0) {
        partial[0][tid >> 5] = before_max; partial[1][tid >> 5] = before_total;
        partial[2][tid >> 5] = after_max;  partial[3][tid >> 5] = after_total;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < (int)(blockDim.x + 31) / 32; ++w) {
            partial[0][0] = max(partial[0][0], partial[0][w]); partial[1][0] += partial[1][w];
            partial[2][0] = max(partial[2][0], partial[2][w]); partial[3][0] += partial[3][w];
        }
        *imbalance_before = imbalance_of(partial[0][0], partial[1][0], R);
        *imbalance_after = imbalance_of(partial[2][0], partial[3][0], R);
    }
}

// In-place inclusive prefix sum of values[0..n) by the whole block (warp scans, then
// the warp totals of each chunk of blockDim.x values).
__device__ void block_inclusive_scan(long long* values, int n) {
    __shared__ long long warp_total[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = (blockDim.x + 31) / 32;
    long long carry = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + tid;
        long long value = i < n ? values[i] : 0;
        for (int offset = 1; offset < 32; offset <<= 1) {
            const long long up = __shfl_up_sync(FULL_MASK, value, offset);
            if (lane >= offset) value += up;
        }
        if (lane == 31) warp_total[warp] = value;
        __syncthreads();
        long long before = carry, chunk = 0;
        for (int w = 0; w < warps; ++w) {
            before += w < warp ? warp_total[w] : 0;
            chunk += warp_total[w];
        }
        if (i < n) values[i] = value + before;
        carry += chunk;
        __syncthreads();
    }
}

// quota.locality_split for one expert per block (block E: the imbalance).
// Shared memory (int64): demand[R], row_deficit[R], then per instance: host, local,
// capacity, column sum of the proportional shares.
extern "C" __global__ void __launch_bounds__(256)
plan_split(const int* __restrict__ loads, const int* __restrict__ log_to_phys, const int* __restrict__ replica_count,
           const int* __restrict__ quota, const long long* __restrict__ rank_load, int R, int E, int S, int K,
           int* __restrict__ split_prefix, double* __restrict__ imbalance_before,
           double* __restrict__ imbalance_after) {
    extern __shared__ long long split_smem[];
    const int e = blockIdx.x, tid = threadIdx.x, M = E / R;
    if (e == E) {
        write_imbalance(quota, rank_load, R, E, K, (int*)split_smem, imbalance_before, imbalance_after);
        return;
    }
    // Everything read from global memory up front, in one round trip: the instance
    // count, this thread's source load and instance (a host's own load comes from shared
    // memory below, not from a second, dependent global read).
    const int n = replica_count[e];
    const int own_load = tid < R ? loads[(long long)tid * E + e] : 0;
    const int own_slot = tid < K ? log_to_phys[(long long)e * K + tid] : 0;
    const int own_quota = tid < K ? quota[(long long)e * K + tid] : 0;
    if (n == 1) {
        for (int idx = tid; idx < R * K; idx += blockDim.x) {
            const int src = idx / K;
            split_prefix[((long long)src * E + e) * K + (idx - src * K)] = loads[(long long)src * E + e];
        }
        return;
    }
    long long* demand = split_smem;            // [R]
    long long* row_end = demand + R;           // [R] inclusive prefix of row deficits
    long long* host = row_end + R;             // [K]
    long long* local = host + K;               // [K]
    long long* capacity = local + K;           // [K]
    long long* column_sum = capacity + K;      // [K]
    for (int src = tid; src < R; src += blockDim.x) demand[src] = src == tid ? own_load : loads[(long long)src * E + e];
    if (tid < n) host[tid] = own_slot / (M + S);  // n <= K <= D <= blockDim.x (cuda.MAX_DOMAIN)
    __syncthreads();
    if (tid < n) {
        local[tid] = min(demand[host[tid]], (long long)own_quota);
        capacity[tid] = own_quota - local[tid];
        column_sum[tid] = 0;
    }
    __syncthreads();
    long long total = 0;
    for (int i = 0; i < n; ++i) total += capacity[i];
    // Every thread of a warp takes part in the shuffles; sources past R add nothing.
    for (int base = 0; base < R; base += blockDim.x) {
        const int src = base + tid;
        long long d = src < R ? demand[src] : 0;
        for (int i = 0; i < n; ++i) if (host[i] == src) d -= local[i];
        long long row = 0;
        for (int i = 0; i < n; ++i) {
            const long long share = total ? d * capacity[i] / total : 0;
            row += share;
            const long long column = warp_sum(share);
            if ((tid & 31) == 0 && column) atomicAdd((unsigned long long*)&column_sum[i], (unsigned long long)column);
        }
        if (src < R) { demand[src] = d; row_end[src] = d - row; }
    }
    __syncthreads();
    block_inclusive_scan(row_end, R);
    for (int src = tid; src < R; src += blockDim.x) {
        const long long d = demand[src];
        const long long row_stop = row_end[src], row_start = src ? row_end[src - 1] : 0;
        long long col_start = 0, prefix = 0;
        int* out = split_prefix + ((long long)src * E + e) * K;
        for (int i = 0; i < K; ++i) {
            if (i < n) {
                const long long col_stop = col_start + capacity[i] - column_sum[i];
                long long value = total ? d * capacity[i] / total : 0;
                value += max(0LL, min(row_stop, col_stop) - max(row_start, col_start));  // north-west corner
                if (host[i] == src) value += local[i];
                prefix += value;
                col_start = col_stop;
            }
            out[i] = (int)prefix;
        }
    }
}
