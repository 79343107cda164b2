// What the fused MoE kernels share (fused_moe.cu, fused_moe_backward.cu): the status and
// timeline words, bounded flag waits, the token send and row copy of a warp, and the task
// loop's pieces -- claiming a task, the GEMM stage ring, staging accumulators for the store
// warps. ultraep/integration/fused.py states the task semantics they serve.
#pragma once

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"
#include "swiglu.cuh"

#define FM_UNROLL 4              // 16-byte loads in flight per lane in copies

// status[0] (after the grouped GEMM's codes 1..4), then status[1] the flag, status[2] the
// rank waited on, [3] the flag's index, [4] the epoch expected, [5] the value seen, [6] the block.
#define FM_STATUS_WORDS 8
#define FM_FLAG_TIMED_OUT 5
#define FM_ROW_FLAG 1      // a receive row's arrival (written by its sender)
#define FM_TILE_READY 2    // an M-tile's rows relayed into the receive buffer
#define FM_TILE_DONE 3     // an M-tile's output rows written, every column (read by the reducers)

// The optional task timeline: per task id [start ns, end ns, SM id | kind << 32].
#define FM_TRACE_WORDS 3

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

// Row `src` to row `dst` by one warp, 16-byte vectors, FM_UNROLL loads in flight per lane.
// Plain loads: peers wrote src during this kernel.
__device__ __forceinline__ void warp_copy_row(const uint4* src, uint4* dst, int row_vecs, int lane) {
    for (int v0 = 0; v0 < row_vecs; v0 += WARP * FM_UNROLL) {
        uint4 buf[FM_UNROLL];
#pragma unroll
        for (int u = 0; u < FM_UNROLL; ++u) {
            const int v = v0 + u * WARP + lane;
            if (v < row_vecs) buf[u] = src[v];
        }
#pragma unroll
        for (int u = 0; u < FM_UNROLL; ++u) {
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

struct Pipeline {
    u64 full[GH_STAGES], empty[GH_STAGES], output_full, output_empty;
};

__device__ __forceinline__ void init_pipeline(Pipeline& p) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < GH_STAGES; ++s) {
            mbarrier_init(&p.full[s], 1);
            mbarrier_init(&p.empty[s], GH_CONSUMERS * 4);
        }
        mbarrier_init(&p.output_full, GH_CONSUMERS * 4);
        mbarrier_init(&p.output_empty, GH_STORE_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
}

// The next task id of this block. Every thread calls it, the producer warpgroup and the
// consumers from their own loops (a named barrier of the whole block); the first barrier
// means every thread has read the last id.
// Non-aligned barriers: the producer warp's lane 0 may still be diverged from its warp.
__device__ __forceinline__ void block_sync() { asm volatile("barrier.sync 3, %0;" :: "n"(GH_THREADS) : "memory"); }

// `ready(task)` runs on thread 0 -- the producer thread -- before the block sees the task:
// a wait there keeps the consumers from waiting on a stage (whose timeout is a bug
// detector's) while a peer's data is legitimately late. With a `trace`, thread 0 also
// stamps the task's start (before that wait) and, at its next claim, the end of the task
// it last claimed (`last`, total for none): the barrier between means the block is done.
template <typename Ready, typename Kind>
__device__ __forceinline__ int claim(int* counter, int* claimed, int total, Ready ready, Kind kind, u64* trace,
                                     int& last) {
    block_sync();
    if (threadIdx.x == 0) {
        const u64 now = trace != nullptr ? global_timer_ns() : 0;
        if (trace != nullptr && last < total) trace[FM_TRACE_WORDS * last + 1] = now;
        const int task = atomicAdd(counter, 1);
        if (task < total) {
            if (trace != nullptr) {
                unsigned sm;
                asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
                trace[FM_TRACE_WORDS * task] = now;
                trace[FM_TRACE_WORDS * task + 2] = sm | static_cast<u64>(kind(task)) << 32;
            }
            ready(task);
        }
        *claimed = task;
        last = task;
    }
    block_sync();
    return *claimed;
}

__device__ __forceinline__ void store_warps_sync() {
    asm volatile("barrier.sync 2, %0;" :: "n"(GH_STORE_WARPS * WARP) : "memory");
}

// Stage a consumer's accumulators as BF16 (COLS columns of the tile) for the store warps.
// Accumulator d[4j + {0, 1}] is row lane/4, columns 8j + 2 (lane%4) + {0, 1} of the warp's
// 16 rows; d[4j + {2, 3}] the same 8 rows further. UP: column block j < 16 is gate, j + 16
// the matching up columns, and the staged value is swiglu(gate, up).
template <bool UP>
__device__ __forceinline__ void stage_accumulators(const float (&d)[128], unsigned staged, int consumer, int warp,
                                                   int lane) {
    const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
    constexpr int BLOCKS = UP ? GH_BN / 16 : GH_BN / 8;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < BLOCKS; ++j) {
            const int i = 4 * j + 2 * half;
            __nv_bfloat162 v;
            if constexpr (UP) {
                v.x = swiglu_rn(d[i], d[i + 4 * BLOCKS]);
                v.y = swiglu_rn(d[i + 1], d[i + 1 + 4 * BLOCKS]);
            } else {
                v = __floats2bfloat162_rn(d[i], d[i + 1]);
            }
            asm volatile("st.shared.b32 [%0], %1;" :: "r"(staged + (row + 8 * half) * GH_C_PITCH + (col + 8 * j) * 2),
                         "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
        }
}
