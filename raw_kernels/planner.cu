//! kernels: plan_domains<1>, plan_domains<2>, plan_domains<4>, plan_split
// Quota planner on the GPU, bitwise equal to ultraep/planner/quota.py (read its module
// docstring first: the same threshold search, greedy oracle and split, step by step).
//
// plan_domains<CHUNKS>: one 1024-thread block per NVLink domain of up to 32*CHUNKS ranks.
//   Expert loads (column sums of the load matrix) and the visiting orders live in shared
//   memory; each of the 32 warps evaluates one threshold probe per round with the probe's
//   rank state in registers (lane l owns ranks l, l+32, ...) and records its moves, so
//   the winning probe's moves become the plan without a re-run.
// plan_split: one block per expert builds the locality-first split prefix; one extra
//   block computes the imbalance before/after once every rank load is known.
// All decisions use integer arithmetic (the total load is below 2**31) and break ties by
// the lowest index, exactly as the NumPy reference does.

#define FULL_MASK 0xffffffffu
#define PROBES 32       // warps per block = probes per round (quota.PROBES_PER_ROUND)
#define NEAR_SCALE 64   // quota.NEAR_SCALE: half the probes cover the first 1/64 of the gap

struct DomainShared {
    int* expert_load;   // [D*M]  load of each expert of the domain
    int* rank_load0;    // [D]    load of each rank without balancing
    int* rank_order;    // [D]    ranks by descending load, ties lowest index
    int* expert_order;  // [D*M]  each rank's experts by descending load, ties lowest index
    int* warp_moves;    // [PROBES][2*S*D]  per probe: (expert << 8 | rank, tokens) per move
    int* best_moves;    // [2*S*D]  moves of the lowest feasible threshold so far
    int* probe_tau;     // [PROBES]
    int* probe_ok;      // [PROBES]  1 feasible, 0 not, -1 not probed
    int* probe_moves;   // [PROBES]
    int* misc;          // [4]    lo, hi, number of best moves, winning warp
    int* used;          // [D]    replicas placed per rank
    int* incoming;      // [D]    tokens of the replicas placed per rank
    int* replicas;      // [D*M]  instances per expert
    int* master_quota;  // [D*M]
};

__device__ __forceinline__ bool better_rank(const int* load, int a, int b) {
    return load[a] > load[b] || (load[a] == load[b] && a < b);
}

// The greedy oracle of quota.DomainOracle.run for one threshold, run by one warp; lane 0
// stores the moves in `moves` and their number in `*num_moves` (when feasible).
template <int CHUNKS>
__device__ bool run_oracle(const DomainShared& sh, int tau, int D, int M, int S, int max_replicas, int step,
                           int* moves, int* num_moves) {
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
        const int r = sh.rank_order[pos];
        int owned = 0;
#pragma unroll
        for (int j = 0; j < CHUNKS; ++j) if (j == (r >> 5)) owned = load[j];
        int source_load = __shfl_sync(FULL_MASK, owned, r & 31);
        if (source_load <= tau) break;
        for (int k = 0; k < M && source_load > tau; ++k) {
            const int e = sh.expert_order[r * M + k];
            int remaining = sh.expert_load[e];
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
        if (source_load > tau) return false;
    }
    if (lane == 0) *num_moves = count;
    return true;
}

// The probes of one round, ascending (quota.probe_points).
__device__ __forceinline__ int probe_point(int lo, long long gap, int w, bool* active) {
    *active = true;
    if (gap - 1 <= PROBES) { *active = w < gap - 1; return lo + 1 + w; }
    const int half = PROBES / 2;
    if (gap >= (long long)NEAR_SCALE * (half + 1)) {
        if (w < half) return (int)(lo + (w + 1) * gap / ((long long)NEAR_SCALE * (half + 1)));
        return (int)(lo + (w - half + 1) * gap / (half + 1));
    }
    return (int)(lo + (w + 1) * gap / (PROBES + 1));
}

template <int CHUNKS>
__global__ void __launch_bounds__(1024)
plan_domains(const int* __restrict__ loads, int R, int E, int S, int D, int K, int step, int tau_tolerance,
             int* __restrict__ phys_to_log, int* __restrict__ log_to_phys, int* __restrict__ replica_count,
             int* __restrict__ quota, long long* __restrict__ rank_load) {
    extern __shared__ int smem[];
    const int M = E / R, DM = D * M, slots_per_rank = M + S, move_ints = 2 * S * D;
    const int first_rank = blockIdx.x * D, first_expert = first_rank * M;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    DomainShared sh;
    int* cursor = smem;
    sh.expert_load = cursor;  cursor += DM;
    sh.rank_load0 = cursor;   cursor += D;
    sh.rank_order = cursor;   cursor += D;
    sh.expert_order = cursor; cursor += DM;
    sh.warp_moves = cursor;   cursor += PROBES * move_ints;
    sh.best_moves = cursor;   cursor += move_ints;
    sh.probe_tau = cursor;    cursor += PROBES;
    sh.probe_ok = cursor;     cursor += PROBES;
    sh.probe_moves = cursor;  cursor += PROBES;
    sh.misc = cursor;         cursor += 4;
    sh.used = cursor;         cursor += D;
    sh.incoming = cursor;     cursor += D;
    sh.replicas = cursor;     cursor += DM;
    sh.master_quota = cursor; cursor += DM;

    for (int e = tid; e < DM; e += blockDim.x) { sh.expert_load[e] = 0; sh.replicas[e] = 1; }
    for (int r = tid; r < D; r += blockDim.x) { sh.used[r] = 0; sh.incoming[r] = 0; }
    __syncthreads();
    // Column sums: consecutive threads read consecutive experts (coalesced); sources are
    // split over thread groups and combined with integer atomics (order-independent).
    const int groups = max(1, (int)blockDim.x / DM);
    for (int idx = tid; idx < DM * groups; idx += blockDim.x) {
        const int e = idx % DM, group = idx / DM;
        int sum = 0;
        for (int src = group; src < R; src += groups) sum += loads[(long long)src * E + first_expert + e];
        atomicAdd(&sh.expert_load[e], sum);
    }
    __syncthreads();
    for (int e = tid; e < DM; e += blockDim.x) sh.master_quota[e] = sh.expert_load[e];
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
    }
    for (int e = tid; e < DM; e += blockDim.x) {
        const int base = (e / M) * M;
        int pos = 0;
        for (int other = base; other < base + M; ++other) pos += better_rank(sh.expert_load, other, e);
        sh.expert_order[base + pos] = e;
    }
    if (tid == 0) {
        long long total = 0;
        int hi = 0;
        for (int r = 0; r < D; ++r) { total += sh.rank_load0[r]; hi = max(hi, sh.rank_load0[r]); }
        sh.misc[0] = (int)((total + D - 1) / D) - 1;  // lo: below the mean, infeasible
        sh.misc[1] = hi;                              // hi: feasible without any move
        sh.misc[2] = 0;
    }
    __syncthreads();

    int* my_moves = sh.warp_moves + warp * move_ints;
    while ((long long)sh.misc[1] - sh.misc[0] > (long long)tau_tolerance + 1) {
        const int lo = sh.misc[0];
        bool active;
        const int tau = probe_point(lo, (long long)sh.misc[1] - lo, warp, &active);
        const bool ok = active && run_oracle<CHUNKS>(sh, tau, D, M, S, K - 1, step, my_moves, &sh.probe_moves[warp]);
        if (lane == 0) { sh.probe_tau[warp] = tau; sh.probe_ok[warp] = active ? (ok ? 1 : 0) : -1; }
        __syncthreads();
        if (tid == 0) {
            int below = lo, w = 0;
            for (; w < PROBES && sh.probe_ok[w] == 0; ++w) below = sh.probe_tau[w];
            const bool found = w < PROBES && sh.probe_ok[w] == 1;
            if (found) { sh.misc[1] = sh.probe_tau[w]; sh.misc[2] = sh.probe_moves[w]; }
            sh.misc[0] = below;
            sh.misc[3] = found ? w : -1;
        }
        __syncthreads();
        const int winner = sh.misc[3];
        if (winner >= 0)
            for (int i = tid; i < 2 * sh.misc[2]; i += blockDim.x) sh.best_moves[i] = sh.warp_moves[winner * move_ints + i];
        __syncthreads();
    }
    // Write the domain's outputs from the best moves (creation order fixes columns and slots).
    const int num_moves = sh.misc[2];
    for (int m = tid; m < num_moves; m += blockDim.x) {
        const int e = sh.best_moves[2 * m] >> 8, t = sh.best_moves[2 * m] & 255, amount = sh.best_moves[2 * m + 1];
        int column = 1, slot = M;
        for (int prev = 0; prev < m; ++prev) {
            column += (sh.best_moves[2 * prev] >> 8) == e;
            slot += (sh.best_moves[2 * prev] & 255) == t;
        }
        const long long row = (long long)(first_expert + e) * K;
        log_to_phys[row + column] = (first_rank + t) * slots_per_rank + slot;
        quota[row + column] = amount;
        phys_to_log[(first_rank + t) * slots_per_rank + slot] = first_expert + e;
        atomicSub(&sh.master_quota[e], amount);  // integer atomics: order-independent
        atomicAdd(&sh.replicas[e], 1);
        atomicAdd(&sh.used[t], 1);
        atomicAdd(&sh.incoming[t], amount);
    }
    __syncthreads();
    for (int e = tid; e < DM; e += blockDim.x) {
        const long long row = (long long)(first_expert + e) * K;
        const int r = e / M;
        log_to_phys[row] = (first_rank + r) * slots_per_rank + (e - r * M);
        quota[row] = sh.master_quota[e];
        for (int column = sh.replicas[e]; column < K; ++column) { log_to_phys[row + column] = -1; quota[row + column] = 0; }
        replica_count[first_expert + e] = sh.replicas[e];
    }
    for (int i = tid; i < D * slots_per_rank; i += blockDim.x) {
        const int r = i / slots_per_rank, j = i - r * slots_per_rank;
        if (j < M) phys_to_log[(first_rank + r) * slots_per_rank + j] = first_expert + r * M + j;
        else if (j >= M + sh.used[r]) phys_to_log[(first_rank + r) * slots_per_rank + j] = -1;
    }
    for (int r = tid; r < D; r += blockDim.x) {
        long long sum = sh.incoming[r];
        for (int k = 0; k < M; ++k) sum += sh.master_quota[r * M + k];
        rank_load[first_rank + r] = sum;
    }
}

// Imbalance max/mean with the formula of plan.imbalance: double(max) * R / double(total).
__device__ double imbalance_of(long long max_load, long long total, int R) {
    return total == 0 ? 1.0 : __ddiv_rn(__dmul_rn((double)max_load, (double)R), (double)total);
}

__device__ void write_imbalance(const int* quota, const long long* rank_load, int R, int E, int K,
                                long long* before, double* imbalance_before, double* imbalance_after) {
    __shared__ long long partial[4][32];
    const int M = E / R, tid = threadIdx.x;
    for (int r = tid; r < R; r += blockDim.x) before[r] = 0;
    __syncthreads();
    // Load without balancing = the quotas of each rank's masters; coalesced over [E, K].
    for (int idx = tid; idx < E * K; idx += blockDim.x)
        atomicAdd((unsigned long long*)&before[idx / K / M], (unsigned long long)quota[idx]);  // exact integer sum
    __syncthreads();
    long long before_max = 0, before_total = 0, after_max = 0, after_total = 0;
    for (int r = tid; r < R; r += blockDim.x) {
        before_max = max(before_max, before[r]);
        before_total += before[r];
        after_max = max(after_max, rank_load[r]);
        after_total += rank_load[r];
    }
    for (int offset = 16; offset; offset >>= 1) {
        before_max = max(before_max, __shfl_xor_sync(FULL_MASK, before_max, offset));
        before_total += __shfl_xor_sync(FULL_MASK, before_total, offset);
        after_max = max(after_max, __shfl_xor_sync(FULL_MASK, after_max, offset));
        after_total += __shfl_xor_sync(FULL_MASK, after_total, offset);
    }
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

// quota.locality_split for one expert per block (block E: the imbalance).
// Shared memory: demand[R], row_deficit[R] (ints) then per instance: host, local,
// capacity, column sum of the proportional shares.
extern "C" __global__ void __launch_bounds__(256)
plan_split(const int* __restrict__ loads, const int* __restrict__ log_to_phys, const int* __restrict__ replica_count,
           const int* __restrict__ quota, const long long* __restrict__ rank_load, int R, int E, int S, int K,
           int* __restrict__ split_prefix, double* __restrict__ imbalance_before,
           double* __restrict__ imbalance_after) {
    extern __shared__ long long split_smem[];
    const int e = blockIdx.x, tid = threadIdx.x, M = E / R;
    if (e == E) { write_imbalance(quota, rank_load, R, E, K, split_smem, imbalance_before, imbalance_after); return; }
    const int n = replica_count[e];
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
    for (int i = tid; i < n; i += blockDim.x) {
        const int h = log_to_phys[(long long)e * K + i] / (M + S);
        const long long q = quota[(long long)e * K + i];
        host[i] = h;
        local[i] = min((long long)loads[(long long)h * E + e], q);
        capacity[i] = q - local[i];
        column_sum[i] = 0;
    }
    __syncthreads();
    long long total = 0;
    for (int i = 0; i < n; ++i) total += capacity[i];
    for (int src = tid; src < R; src += blockDim.x) {
        long long d = loads[(long long)src * E + e];
        for (int i = 0; i < n; ++i) if (host[i] == src) d -= local[i];
        long long row = 0;
        if (total)
            for (int i = 0; i < n; ++i) {
                const long long share = d * capacity[i] / total;
                row += share;
                atomicAdd((unsigned long long*)&column_sum[i], (unsigned long long)share);  // exact integer sum
            }
        demand[src] = d;
        row_end[src] = d - row;
    }
    __syncthreads();
    if (tid == 0)  // inclusive prefix of the row deficits (R is small; one pass)
        for (int src = 1; src < R; ++src) row_end[src] += row_end[src - 1];
    __syncthreads();
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
