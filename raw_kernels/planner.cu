//! kernels: plan_domains, plan_split
// Quota planner on the GPU, bitwise equal to ultraep/planner/quota.py (read its module
// docstring first: the same threshold search, greedy oracle and split, step by step).
//
// plan_domains: one 1024-thread block per NVLink domain. Expert loads (column sums of the
//   load matrix) and the visiting orders live in shared memory; each of the 32 warps
//   evaluates one threshold probe per round, its lanes owning ranks lane, lane+32, ...
// plan_split:   one block per expert builds the locality-first split prefix; one extra
//   block computes the imbalance before/after once every rank load is known.
// All decisions use integer arithmetic (the total load is below 2**31) and break ties by
// the lowest index, exactly as the NumPy reference does.

#define FULL_MASK 0xffffffffu
#define PROBES 32            // warps per block = probes per round (quota.PROBES_PER_ROUND)
#define MAX_RANK_CHUNKS 4    // ranks per lane: domains of up to 128 ranks

struct DomainShared {
    int* expert_load;   // [D*M]  load of each expert of the domain
    int* rank_load0;    // [D]    load of each rank without balancing
    int* rank_order;    // [D]    ranks by descending load, ties lowest index
    int* expert_order;  // [D*M]  each rank's experts by descending load, ties lowest index
    int* warp_state;    // [PROBES][3*D]  per probe: load, free slots, host mark
    int* moves;         // [3*S*D] (expert, rank, tokens) of the final plan
    int* probe_tau;     // [PROBES]
    int* probe_ok;      // [PROBES]
    int* misc;          // [4]    lo, hi, number of moves
    int* used;          // [D]    replicas placed per rank
    int* replicas;      // [D*M]  instances per expert
    int* master_quota;  // [D*M]
};

__device__ __forceinline__ bool better_rank(const int* load, int a, int b) {
    return load[a] > load[b] || (load[a] == load[b] && a < b);
}

// The greedy oracle of quota.DomainOracle.run for one threshold, run by one warp.
// When `moves` is non-null (lane 0 of the recording warp) the moves are stored there.
__device__ bool run_oracle(const DomainShared& sh, int* state, int tau, int D, int M, int S,
                           int max_replicas, int step, int* moves, int* num_moves) {
    const int lane = threadIdx.x & 31;
    int* load = state;
    int* free_slots = state + D;
    int* mark = state + 2 * D;
    for (int t = lane; t < D; t += 32) {
        load[t] = sh.rank_load0[t];
        free_slots[t] = S;
        mark[t] = -1;
    }
    __syncwarp();
    int count = 0;
    for (int pos = 0; pos < D; ++pos) {
        const int r = sh.rank_order[pos];
        int source_load = load[r];
        if (source_load <= tau) break;
        for (int k = 0; k < M && source_load > tau; ++k) {
            const int e = sh.expert_order[r * M + k];
            int remaining = sh.expert_load[e];
            int hosts = 1;
            while (source_load > tau && hosts <= max_replicas && remaining >= step) {
                const int need = min(max(source_load - tau, step), remaining);
                int slack[MAX_RANK_CHUNKS];
                bool eligible[MAX_RANK_CHUNKS];
                unsigned fit = 0xffffffffu, most = 0u;
#pragma unroll
                for (int j = 0; j < MAX_RANK_CHUNKS; ++j) {
                    const int t = lane + 32 * j;
                    eligible[j] = false;
                    slack[j] = 0;
                    if (t < D) {
                        slack[j] = tau - load[t];
                        eligible[j] = free_slots[t] > 0 && slack[j] >= step && mark[t] != e && t != r;
                    }
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
                for (int j = 0; j < MAX_RANK_CHUNKS; ++j) {
                    const unsigned hit = __ballot_sync(FULL_MASK, eligible[j] && slack[j] == chosen);
                    if (target < 0 && hit) target = 32 * j + __ffs(hit) - 1;
                }
                const int amount = (chosen - need >= step) ? need : min(chosen, remaining);
                __syncwarp();  // every lane has read the state before lane 0 changes it
                if (lane == 0) {
                    load[r] = source_load - amount;
                    load[target] += amount;
                    free_slots[target] -= 1;
                    mark[target] = e;
                    if (moves) {
                        moves[3 * count] = e;
                        moves[3 * count + 1] = target;
                        moves[3 * count + 2] = amount;
                    }
                }
                __syncwarp();
                ++count;
                source_load -= amount;
                remaining -= amount;
                ++hosts;
            }
        }
        if (source_load > tau) return false;
    }
    if (num_moves && lane == 0) *num_moves = count;
    return true;
}

extern "C" __global__ void __launch_bounds__(1024)
plan_domains(const int* __restrict__ loads, int R, int E, int S, int D, int K, int step, int tau_tolerance,
             int* __restrict__ phys_to_log, int* __restrict__ log_to_phys, int* __restrict__ replica_count,
             int* __restrict__ quota, long long* __restrict__ rank_load) {
    extern __shared__ int smem[];
    const int M = E / R, DM = D * M, slots_per_rank = M + S;
    const int first_rank = blockIdx.x * D, first_expert = first_rank * M;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    DomainShared sh;
    int* cursor = smem;
    sh.expert_load = cursor;  cursor += DM;
    sh.rank_load0 = cursor;   cursor += D;
    sh.rank_order = cursor;   cursor += D;
    sh.expert_order = cursor; cursor += DM;
    sh.warp_state = cursor;   cursor += PROBES * 3 * D;
    sh.moves = cursor;        cursor += 3 * S * D;
    sh.probe_tau = cursor;    cursor += PROBES;
    sh.probe_ok = cursor;     cursor += PROBES;
    sh.misc = cursor;         cursor += 4;
    sh.used = cursor;         cursor += D;
    sh.replicas = cursor;     cursor += DM;
    sh.master_quota = cursor; cursor += DM;

    // Column sums: one warp per expert, lanes over source ranks (fixed order -> exact).
    for (int e = warp; e < DM; e += PROBES) {
        int sum = 0;
        for (int src = lane; src < R; src += 32) sum += loads[(long long)src * E + first_expert + e];
        sum = __reduce_add_sync(FULL_MASK, sum);
        if (lane == 0) { sh.expert_load[e] = sum; sh.master_quota[e] = sum; sh.replicas[e] = 1; }
    }
    __syncthreads();
    for (int r = tid; r < D; r += blockDim.x) {
        int sum = 0;
        for (int k = 0; k < M; ++k) sum += sh.expert_load[r * M + k];
        sh.rank_load0[r] = sum;
        sh.used[r] = 0;
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

    const int max_replicas = K - 1;
    int* state = sh.warp_state + warp * 3 * D;
    while ((long long)sh.misc[1] - sh.misc[0] > (long long)tau_tolerance + 1) {
        const int lo = sh.misc[0], hi = sh.misc[1];
        const long long gap = (long long)hi - lo;
        int tau;
        bool active;
        if (gap - 1 <= PROBES) { tau = lo + 1 + warp; active = warp < gap - 1; }
        else { tau = (int)(lo + (warp + 1) * gap / (PROBES + 1)); active = true; }
        const bool ok = active && run_oracle(sh, state, tau, D, M, S, max_replicas, step, nullptr, nullptr);
        if (lane == 0) { sh.probe_tau[warp] = tau; sh.probe_ok[warp] = active ? (ok ? 1 : 0) : -1; }
        __syncthreads();
        if (tid == 0) {
            int below = lo, w = 0;
            for (; w < PROBES && sh.probe_ok[w] == 0; ++w) below = sh.probe_tau[w];
            if (w < PROBES && sh.probe_ok[w] == 1) sh.misc[1] = sh.probe_tau[w];
            sh.misc[0] = below;
        }
        __syncthreads();
    }
    // Record the plan of the chosen threshold (warp 0), then write the domain's outputs.
    if (warp == 0) run_oracle(sh, state, sh.misc[1], D, M, S, max_replicas, step, sh.moves, &sh.misc[2]);
    __syncthreads();
    const int num_moves = sh.misc[2];
    for (int m = tid; m < num_moves; m += blockDim.x) {
        const int e = sh.moves[3 * m], t = sh.moves[3 * m + 1], amount = sh.moves[3 * m + 2];
        int column = 1, slot = M;
        for (int prev = 0; prev < m; ++prev) {
            column += sh.moves[3 * prev] == e;
            slot += sh.moves[3 * prev + 1] == t;
        }
        const long long row = (long long)(first_expert + e) * K;
        log_to_phys[row + column] = (first_rank + t) * slots_per_rank + slot;
        quota[row + column] = amount;
        phys_to_log[(first_rank + t) * slots_per_rank + slot] = first_expert + e;
        atomicSub(&sh.master_quota[e], amount);  // integer: order-independent
        atomicAdd(&sh.replicas[e], 1);
        atomicAdd(&sh.used[t], 1);
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
    for (int r = tid; r < D; r += blockDim.x) rank_load[first_rank + r] = sh.warp_state[r];  // warp 0's final loads
}

// Imbalance max/mean with the formula of plan.imbalance: double(max) * R / double(total).
__device__ double imbalance_of(long long max_load, long long total, int R) {
    return total == 0 ? 1.0 : __ddiv_rn(__dmul_rn((double)max_load, (double)R), (double)total);
}

__device__ void write_imbalance(const int* quota, const long long* rank_load, int R, int E, int K,
                                double* imbalance_before, double* imbalance_after) {
    __shared__ long long partial[4][32];
    const int M = E / R, tid = threadIdx.x;
    long long before_max = 0, before_total = 0, after_max = 0, after_total = 0;
    for (int r = tid; r < R; r += blockDim.x) {
        long long before = 0;
        for (int e = r * M; e < (r + 1) * M; ++e)
            for (int i = 0; i < K; ++i) before += quota[(long long)e * K + i];
        before_max = max(before_max, before);
        before_total += before;
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
    if (e == E) { write_imbalance(quota, rank_load, R, E, K, imbalance_before, imbalance_after); return; }
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
