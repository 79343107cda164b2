//! kernels: compile_weight_tasks, compile_grad_tasks
// The transfer schedule's compilers as kernels of their own (schedule.cuh says what they
// compile and how): the weight tasks for a sync whose copy is launched apart (benches,
// tests), and the gradient tasks of every reduce_grads.

#include "schedule.cuh"

extern "C" __global__ void compile_weight_tasks(COMPILE_WEIGHT_PARAMETERS) {
    compile_weights(COMPILE_WEIGHT_ARGUMENTS);
}

// Gradient tasks and their sources, grid-stride: one task per tile of each gradient
// tensor of each replicated master (masters in expert order, then tensors, then tiles),
// its sources the replicas' gradient tiles in replica order. Every block derives the
// same small per-master prefix; block 0 publishes the lengths.
//
// grad_tensors (int64 [T][3]): first tile of the tensor within an expert's tile list,
// offset in a gradient slot, bytes.
//
// Dynamic shared memory, carved at the top of the kernel: the int arrays replicated,
// src_first, slot_owner and the staged plan (log_to_phys [E * K], replica_count [E]). The
// host launches with this many bytes (M = E / R).
#define GRAD_COMPILE_SHARED_BYTES(R, E, M, S, K) (4 * (2 * (M) + 1 + (R) * (S) + (E) * (K) + (E)))
extern "C" __global__ void compile_grad_tasks(
        const int* log_to_phys, const int* replica_count, int R, int E, int S, int K, int D, int rank, int num_tensors,
        const i64* grad_tensors, int tiles_per_expert, i64 tile_bytes, i64 grad_base, i64 grad_slot_bytes,
        int max_tasks, int max_srcs, i64* tasks, i64* srcs, int* counts) {
    const int M = E / R, P = M + S;
    extern __shared__ int master_table[];
    int* replicated = master_table;     // [M] this rank's masters with replicas (local index), in order
    int* src_first = replicated + M;    // [M + 1] replicas before each, summed over its predecessors
    int* slot_owner = src_first + M + 1;  // [R * S] placement_code's
    int* staged_log_to_phys = slot_owner + R * S;  // [E * K]
    int* staged_replica_count = staged_log_to_phys + static_cast<i64>(E) * K;  // [E]
    __shared__ int num_replicated;
    stage_plan(log_to_phys, replica_count, E, K, staged_log_to_phys, staged_replica_count);
    log_to_phys = staged_log_to_phys;
    replica_count = staged_replica_count;
    const int fault = placement_code(log_to_phys, replica_count, R, E, S, K, D, slot_owner);
    if (threadIdx.x == 0) {
        int count = 0, replicas = 0, code = fault;
        for (int m = 0; m < M && code == 0; ++m) {
            const int e = rank * M + m;
            if (replica_count[e] > 1) {
                replicated[count] = m;
                src_first[count++] = replicas;
                replicas += replica_count[e] - 1;
            }
        }
        src_first[count] = replicas;
        if (code == 0 && (static_cast<i64>(count) * tiles_per_expert > max_tasks ||
                          static_cast<i64>(replicas) * tiles_per_expert > max_srcs))
            code = TABLES_OVERFLOW;
        num_replicated = code ? 0 : count;
        if (blockIdx.x == 0) {
            counts[COUNT_GRAD_TASKS] = code ? 0 : count * tiles_per_expert;
            counts[COUNT_GRAD_SRCS] = code ? 0 : replicas * tiles_per_expert;
            if (code) counts[COUNT_GRAD_ERROR] = code;
        }
    }
    __syncthreads();
    const int num_tasks = num_replicated * tiles_per_expert;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tasks; t += gridDim.x * blockDim.x) {
        const int j = t / tiles_per_expert, tile = t % tiles_per_expert, m = replicated[j];
        const int n = src_first[j + 1] - src_first[j];
        int tensor = 0;
        while (tensor + 1 < num_tensors && tile >= grad_tensors[3 * (tensor + 1)]) ++tensor;
        const i64* shape = grad_tensors + 3 * tensor;
        const i64 offset = (tile - shape[0]) * tile_bytes;
        const i64 first = static_cast<i64>(src_first[j]) * tiles_per_expert + static_cast<i64>(tile) * n;
        i64* row = tasks + GRAD_TASK_FIELDS * static_cast<i64>(t);
        row[0] = static_cast<i64>(m) * num_tensors + tensor;
        row[1] = offset;
        row[2] = min(tile_bytes, shape[2] - offset);
        row[3] = first;
        row[4] = first + n;
        const int* replica = log_to_phys + static_cast<i64>(rank * M + m) * K + 1;
        for (int i = 0; i < n; ++i) {
            const int slot = replica[i] % P - M;
            srcs[GRAD_SRC_FIELDS * (first + i)] = replica[i] / P;
            srcs[GRAD_SRC_FIELDS * (first + i) + 1] = grad_base + slot * grad_slot_bytes + shape[1] + offset;
        }
    }
}
