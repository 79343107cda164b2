// The transfer schedule compiled on the device: this rank's weight-sync and gradient
// tasks for a plan, row for row what ultraep/transfer/schedule.py (compile_schedule, the
// NumPy reference, whose docstring defines every field) produces -- relay trees
// included -- written into tables preallocated at the largest size the layout allows.
// The lengths go to counts[], where the transfer kernels read them: nothing returns to
// the host. The weight compile also counts itself in weight_syncs[0], the epoch the copy
// behind it flags its chunks with: the device numbers its syncs, so a sync captured in a
// CUDA graph flags each replay with a new epoch (the host keeps the same count).
//
// counts: the four tables' lengths, then sticky error codes of the weight / gradient
// compile: placement_code's when the plan's placement breaks the layout (every rank
// derives the same one from the whole plan, so every rank refuses it), TABLES_OVERFLOW
// when the tables would outgrow their capacity (which a sound placement never does). A
// failed compile writes zero lengths, so its transfers do nothing.
//
// Both compilers stride over their work by blockDim.x: any block of whole warps works, and
// the host launches COMPILE_THREADS. Each block first stages the plan's log_to_phys and
// replica_count in shared memory: the serial parts read them in chains of dependent
// loads, which cost an L2 round trip each when read from global memory.
//
// This header holds the pieces both schedule.cu's compilers use and the weight compile
// itself, which transfer.cu's one-launch weight sync runs too.

#pragma once

#include "task_tables.cuh"

typedef long long i64;

#define COMPILE_THREADS 256
#define COUNT_WEIGHT_TASKS 0  // counts[] indices
#define COUNT_DESTS 1
#define COUNT_GRAD_TASKS 2
#define COUNT_GRAD_SRCS 3
#define COUNT_WEIGHT_ERROR 4
#define COUNT_GRAD_ERROR 5
#define COUNT_SLOTS 6
#define TABLES_OVERFLOW (-1)
#define NO_FAULT 0x7fffffff
// What placement_code finds wrong with an expert's instances (device_schedule.py names them).
#define FAULT_COUNT 0        // an instance count outside [1, K]
#define FAULT_SLOT 1         // a replica outside the redundant slots
#define FAULT_HOST 2         // a replica on its master's rank or outside its domain
#define FAULT_SHARED_RANK 3  // two instances of the expert on one rank
#define FAULT_SHARED_SLOT 4  // a replica in a slot that a lower expert's replica holds
#define FAULT_KINDS 8

// The block copies the plan into staged_log_to_phys [E * K] and staged_replica_count [E].
__device__ void stage_plan(const int* log_to_phys, const int* replica_count, int E, int K,
                           int* staged_log_to_phys, int* staged_replica_count) {
    for (i64 i = threadIdx.x; i < static_cast<i64>(E) * K; i += blockDim.x) staged_log_to_phys[i] = log_to_phys[i];
    for (int e = threadIdx.x; e < E; e += blockDim.x) staged_replica_count[e] = replica_count[e];
    __syncthreads();
}

// Whether the plan's placement can drive transfers (schedule.py placement_error, the same
// checks): 0, else 1 + kind + FAULT_KINDS * e for the lowest expert e at fault (and its
// lowest kind). The whole block calls it; slot_owner: [R * S] ints of shared memory.
__device__ int placement_code(const int* log_to_phys, const int* replica_count, int R, int E, int S, int K, int D,
                              int* slot_owner) {
    const int M = E / R, P = M + S;
    __shared__ int fault;
    if (threadIdx.x == 0) fault = NO_FAULT;
    for (int i = threadIdx.x; i < R * S; i += blockDim.x) slot_owner[i] = NO_FAULT;
    __syncthreads();
    // Each replica in a redundant slot claims it for the lowest expert; faults of one expert.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int n = replica_count[e], master = e / M;
        const int* phys = log_to_phys + static_cast<i64>(e) * K;
        int kind = n < 1 || n > K ? FAULT_COUNT : NO_FAULT;
        for (int i = 1; i < n && kind != FAULT_COUNT; ++i) {
            const int host = phys[i] / P;
            if (phys[i] < 0 || phys[i] >= R * P || phys[i] % P < M) {
                kind = min(kind, FAULT_SLOT);
                continue;
            }
            if (host == master || host / D != master / D) kind = min(kind, FAULT_HOST);
            for (int j = 1; j < i; ++j) kind = phys[j] / P == host ? min(kind, FAULT_SHARED_RANK) : kind;
            atomicMin(&slot_owner[host * S + phys[i] % P - M], e);
        }
        if (kind != NO_FAULT) atomicMin(&fault, 1 + kind + FAULT_KINDS * e);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {  // a slot claimed by a lower expert
        const int n = replica_count[e];
        const int* phys = log_to_phys + static_cast<i64>(e) * K;
        for (int i = 1; i < n && n <= K; ++i)
            if (phys[i] >= 0 && phys[i] < R * P && phys[i] % P >= M && slot_owner[phys[i] / P * S + phys[i] % P - M] != e)
                atomicMin(&fault, 1 + FAULT_SHARED_SLOT + FAULT_KINDS * e);
    }
    __syncthreads();
    const int code = fault == NO_FAULT ? 0 : fault;
    __syncthreads();  // every thread read it before a later call resets it
    return code;
}

// Weight tasks and destinations, one block. In the reference's order: the global relay
// decisions (every rank takes the same ones from the same plan), then this rank's
// sources -- its replicated masters in expert order, then the relays it hosts in expert
// order -- each with one task per chunk and its run of destination rows.
//
// tree (int32 [2][E][K], global scratch; rows of hot experts only): chosen[c] = the
// replica index (0-based, instance - 1) of relay c; owner[i] = the relay position
// serving replica i (a relay serves itself: chosen[owner[i]] == i).
//
// Dynamic shared memory, carved at the top of the kernel: sent (i64 [R]), then the int
// arrays found, hot, src_expert, src_relay, src_dest, relay_expert, relay_position,
// relay_leaves, slot_owner and the staged plan (log_to_phys [E * K], replica_count [E]).
// The host launches with this many bytes (M = E / R).
#define WEIGHT_COMPILE_SHARED_BYTES(R, E, M, S, K) (8 * (R) + 4 * ((E) * ((K) + 3) + 3 * ((M) + (S)) + 1 + 3 * (S) + (R) * (S)))
__device__ void compile_weights(
        const int* log_to_phys, const int* replica_count, int R, int E, int S, int K, int D, int rank, int num_tensors,
        i64 slot_bytes, int relay_threshold, int relay_count, int num_chunks, int chunk_tiles, int num_tiles,
        i64 weight_base, i64 flag_base_slot, int max_tasks, int max_dests, int* tree, i64* tasks, i64* dests,
        int* counts, unsigned long long* weight_syncs) {
    const int M = E / R, P = M + S, tid = threadIdx.x;
    if (tid == 0) ++*weight_syncs;  // a refused plan's sync counts too: the host counts every call
    extern __shared__ i64 shared[];
    i64* sent = shared;                          // [R] weight bytes each rank sends
    int* found = reinterpret_cast<int*>(sent + R);  // [E] hot experts as found
    int* hot = found + E;                        // [E] hot experts, most replicas first, then by index
    int* src_expert = hot + E;                   // [M + S] this rank's sources: the expert,
    int* src_relay = src_expert + M + S;         // [M + S]   the relay position (-1: the master),
    int* src_dest = src_relay + M + S;           // [M + S + 1] its first destination row
    int* relay_expert = src_dest + M + S + 1;    // [S] relays hosted here with leaves, by expert
    int* relay_position = relay_expert + S;      // [S]
    int* relay_leaves = relay_position + S;      // [S]
    int* slot_owner = relay_leaves + S;          // [R * S] placement_code's
    int* staged_log_to_phys = slot_owner + R * S;  // [E * K]
    int* staged_replica_count = staged_log_to_phys + static_cast<i64>(E) * K;  // [E]
    __shared__ int hot_count, num_sources;
    int* chosen_rows = tree;
    int* owner_rows = tree + static_cast<i64>(E) * K;

    stage_plan(log_to_phys, replica_count, E, K, staged_log_to_phys, staged_replica_count);
    log_to_phys = staged_log_to_phys;
    replica_count = staged_replica_count;
    const int fault = placement_code(log_to_phys, replica_count, R, E, S, K, D, slot_owner);
    if (fault) {
        if (tid == 0) {
            counts[COUNT_WEIGHT_TASKS] = counts[COUNT_DESTS] = 0;
            counts[COUNT_WEIGHT_ERROR] = fault;
        }
        return;
    }
    if (tid == 0) hot_count = 0;
    __syncthreads();
    for (int r = tid; r < R; r += blockDim.x) {  // direct sends of experts below the relay threshold
        i64 bytes = 0;
        for (int m = 0; m < M; ++m) {
            const int fanout = replica_count[r * M + m] - 1;
            if (fanout >= 1 && fanout <= relay_threshold) bytes += fanout * slot_bytes;
        }
        sent[r] = bytes;
    }
    for (int e = tid; e < E; e += blockDim.x)
        if (replica_count[e] - 1 > relay_threshold) found[atomicAdd(&hot_count, 1)] = e;
    __syncthreads();
    const int H = hot_count;
    for (int i = tid; i < H; i += blockDim.x) {  // rank in the order (-fanout, expert): found order is racy
        const int e = found[i];
        const i64 key = static_cast<i64>(K - replica_count[e]) * E + e;
        int position = 0;
        for (int j = 0; j < H; ++j)
            position += static_cast<i64>(K - replica_count[found[j]]) * E + found[j] < key;
        hot[position] = e;
    }
    __syncthreads();

    if (tid == 0) {
        // Relay trees, hottest first: each choice depends on the bytes sent so far.
        int relays = 0;
        bool overflow = false;
        for (int h = 0; h < H; ++h) {
            const int e = hot[h], n = replica_count[e] - 1, k = min(relay_count, n);
            const int* replica = log_to_phys + static_cast<i64>(e) * K + 1;
            int* chosen = chosen_rows + static_cast<i64>(e) * K;
            int* owner = owner_rows + static_cast<i64>(e) * K;
            for (int i = 0; i < n; ++i) owner[i] = -1;
            for (int c = 0; c < k; ++c) {  // the k replicas whose ranks sent least, ties to the lower index
                int best = -1;
                i64 best_sent = 0;
                for (int i = 0; i < n; ++i) {
                    const i64 bytes = sent[replica[i] / P];
                    if (owner[i] < 0 && (best < 0 || bytes < best_sent)) {
                        best = i;
                        best_sent = bytes;
                    }
                }
                chosen[c] = best;
                owner[best] = c;
            }
            sent[e / M] += k * slot_bytes;
            for (int i = 0; i < n; ++i) {  // each leaf to the relay that sent least, ties to the earlier relay
                if (owner[i] >= 0) continue;
                int best = 0;
                i64 best_sent = sent[replica[chosen[0]] / P];
                for (int c = 1; c < k; ++c) {
                    const i64 bytes = sent[replica[chosen[c]] / P];
                    if (bytes < best_sent) {
                        best = c;
                        best_sent = bytes;
                    }
                }
                owner[i] = best;
                sent[replica[chosen[best]] / P] += slot_bytes;
            }
            for (int c = 0; c < k; ++c) {
                if (replica[chosen[c]] / P != rank) continue;
                int leaves = 0;
                for (int i = 0; i < n; ++i) leaves += owner[i] == c && chosen[c] != i;
                if (leaves == 0) continue;
                if (relays == S) {
                    overflow = true;
                    break;
                }
                int at = relays++;  // insertion by expert: trees are visited hottest first
                for (; at > 0 && relay_expert[at - 1] > e; --at) {
                    relay_expert[at] = relay_expert[at - 1];
                    relay_position[at] = relay_position[at - 1];
                    relay_leaves[at] = relay_leaves[at - 1];
                }
                relay_expert[at] = e;
                relay_position[at] = c;
                relay_leaves[at] = leaves;
            }
        }
        // This rank's sources and where each one's destination rows start.
        int sources = 0, rows = 0;
        for (int m = 0; m < M; ++m) {
            const int e = rank * M + m, n = replica_count[e] - 1;
            if (n < 1) continue;
            src_expert[sources] = e;
            src_relay[sources] = -1;
            src_dest[sources++] = rows;
            rows += n > relay_threshold ? min(relay_count, n) : n;
        }
        for (int j = 0; j < relays; ++j) {
            src_expert[sources] = relay_expert[j];
            src_relay[sources] = relay_position[j];
            src_dest[sources++] = rows;
            rows += relay_leaves[j];
        }
        src_dest[sources] = rows;
        overflow |= static_cast<i64>(sources) * num_chunks > max_tasks || rows > max_dests;
        num_sources = overflow ? 0 : sources;
        counts[COUNT_WEIGHT_TASKS] = overflow ? 0 : sources * num_chunks;
        counts[COUNT_DESTS] = overflow ? 0 : rows;
        if (overflow) counts[COUNT_WEIGHT_ERROR] = TABLES_OVERFLOW;
    }
    __syncthreads();

    const int num_tasks = num_sources * num_chunks;
    for (int t = tid; t < num_tasks; t += blockDim.x) {
        const int s = t / num_chunks, chunk = t % num_chunks, e = src_expert[s], c = src_relay[s];
        const int n = replica_count[e] - 1;
        i64 src_ref = static_cast<i64>(e - rank * M) * num_tensors, wait = -1;
        if (c >= 0) {  // a relay forwards from its own replica slot once the chunk's flag is set
            const int slot = log_to_phys[static_cast<i64>(e) * K + 1 + chosen_rows[static_cast<i64>(e) * K + c]] % P - M;
            src_ref = static_cast<i64>(M + slot) * num_tensors;
            wait = flag_base_slot + static_cast<i64>(slot) * num_chunks + chunk;
        }
        const int first = chunk * chunk_tiles;
        i64* row = tasks + WEIGHT_TASK_FIELDS * static_cast<i64>(t);
        row[0] = src_ref;
        row[1] = chunk;
        row[2] = first;
        row[3] = min(first + chunk_tiles, num_tiles);
        row[4] = src_dest[s];
        row[5] = src_dest[s + 1];
        row[6] = wait;
        row[7] = c < 0 && n > relay_threshold && n > relay_count;  // a hot master's relays have leaves to serve
    }
    for (int s = tid; s < num_sources; s += blockDim.x) {
        const int e = src_expert[s], c = src_relay[s], n = replica_count[e] - 1;
        const int* replica = log_to_phys + static_cast<i64>(e) * K + 1;
        const int* chosen = chosen_rows + static_cast<i64>(e) * K;
        const int* owner = owner_rows + static_cast<i64>(e) * K;
        i64* row = dests + DEST_FIELDS * static_cast<i64>(src_dest[s]);
        auto put = [&](int i) {
            const int slot = replica[i] % P - M;
            row[0] = replica[i] / P;
            row[1] = weight_base + slot * slot_bytes;
            row[2] = flag_base_slot + static_cast<i64>(slot) * num_chunks;
            row += 3;
        };
        if (c >= 0) {  // a relay's leaves, in replica order
            for (int i = 0; i < n; ++i)
                if (owner[i] == c && chosen[c] != i) put(i);
        } else if (n > relay_threshold) {  // a hot master sends to its relays only, in relay order
            for (int r = 0; r < min(relay_count, n); ++r) put(chosen[r]);
        } else {
            for (int i = 0; i < n; ++i) put(i);
        }
    }
}

#define COMPILE_WEIGHT_PARAMETERS \
        const int *log_to_phys, const int *replica_count, int R, int E, int S, int K, int D, int rank, \
        int num_tensors, i64 slot_bytes, int relay_threshold, int relay_count, int num_chunks, int chunk_tiles, \
        int num_tiles, i64 weight_base, i64 flag_base_slot, int max_tasks, int max_dests, int *tree, i64 *tasks, \
        i64 *dests, int *counts, unsigned long long *weight_syncs
#define COMPILE_WEIGHT_ARGUMENTS \
        log_to_phys, replica_count, R, E, S, K, D, rank, num_tensors, slot_bytes, relay_threshold, relay_count, \
        num_chunks, chunk_tiles, num_tiles, weight_base, flag_base_slot, max_tasks, max_dests, tree, tasks, dests, counts, \
        weight_syncs

