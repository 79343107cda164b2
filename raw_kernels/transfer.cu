// Data-plane kernels: weight sync by persistent tile streaming (with relay forwarding)
// and deterministic gradient reduction. The task lists and their lengths are compiled on
// the device by schedule.cu; ultraep/transfer/schedule.py (its NumPy reference) defines
// every field.
//
//! kernels: weight_sync, reduce_grads<float>, reduce_grads<__nv_bfloat16>

#include <cuda_bf16.h>

#include "sync.cuh"

typedef long long i64;

#define MAX_STAGES 16         // shared-memory stages per block; the launch picks how many (a multiple of the storing warps, >= 2 of them)
#define MAX_STORERS 4         // storing warps per block (the launch picks how many: 32 x (1 + storers) threads)
#define MAX_TENSORS 8         // tensors per expert (host-checked)
#define MAX_DESTS 128         // destinations of one source: replicas of an expert within a domain (host-checked)
#define FLAG_WRITER_BITS 16
#define SYNC_COUNT_BATCH 8    // a storing warp's pieces issued but not yet counted, at most (<= 32: a lane each)
#define SYNC_PATIENCE 4096    // cycles (about 2 us) a storing warp waits for its next piece before it counts what it holds

// -- Hopper bulk copy engine and shared-memory barriers (PTX ISA 8.0, sm_90) -------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void barrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
// Waits for the phase of parity `use & 1`, i.e. the barrier's use-th completion (0-based).
// Intra-block only: every arrive it waits for comes from this block, never from a peer.
__device__ __forceinline__ void barrier_wait(u64* bar, int use) {
    unsigned done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(use & 1) : "memory");
    } while (!done);
}
// Whether the barrier's use-th completion happened, without waiting.
__device__ __forceinline__ bool barrier_done(u64* bar, int use) {
    unsigned done;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(use & 1) : "memory");
    return done;
}
// Arrive once and expect `bytes` from the bulk engine: the phase completes when both happened.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, unsigned bytes, u64* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(smem_dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* smem_src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(smem_addr(smem_src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {  // all but N groups have read shared memory
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_done() {  // all but N groups have written global memory
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// Starts pulling a line of a small read-only table into L1, so a dependent look-up later hits it.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" :: "l"(p)); }
// Orders the bulk engine's global accesses (async proxy) with ordinary loads/stores and flags.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void store_relaxed_sys(u64* addr, u64 value) {  // after a fence: a release pattern
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(addr), "l"(value) : "memory");
}

// One piece (a tile, or a stage-sized part of one), handed from the loading warp to a storing warp.
struct PieceJob {
    u64 src;                // the piece in its source tensor
    i64 within_slot;        // where it lands inside a replica slot
    int task, chunk;        // task < 0: no more pieces
    int chunk_bytes;        // bytes of the whole chunk (all pieces, all blocks)
    int dest_begin, dest_end;
    int bulk_bytes;         // [0, bulk_bytes) goes through shared memory by the bulk engine
    int nbytes;             // [bulk_bytes, nbytes): a tail under 16 B or an unaligned source, copied by lanes
};

struct SyncShared {
    u64 posted[MAX_STAGES];   // the stage's job is written (its piece may still be landing)
    u64 full[MAX_STAGES];     // the stage's piece has landed
    u64 empty[MAX_STAGES];    // the stage's stores have read it
    PieceJob job[MAX_STAGES];
    PieceJob landing[MAX_STORERS][SYNC_COUNT_BATCH];  // a storing warp's issued pieces not yet counted
    unsigned char* dst[MAX_STORERS][MAX_DESTS];          // replica-slot bases of each storing warp's destinations
    i64 first_tile[MAX_TENSORS + 1];   // expert tile index where each tensor starts; [num_tensors]: tiles in all
    i64 tensor_bytes[MAX_TENSORS];
    i64 slot_offset[MAX_TENSORS];      // where each tensor starts inside a replica slot
    int skip;                          // an earlier timeout is not yet reported: do nothing
};

// A relay's chunk flag (in its own signal pad) reached this epoch; false after the timeout,
// recorded as (1, flag slot, expected epoch, seen) in status.
__device__ bool wait_chunk_flag(const u64* pad, i64 slot, u64 epoch, u64 timeout_ns, u64* status) {
    const u64 start = global_timer_ns();
    u64 seen;
    while (((seen = load_acquire_sys(pad + slot)) >> FLAG_WRITER_BITS) < epoch) {
        if (global_timer_ns() - start > timeout_ns) {
            if (atomicCAS(reinterpret_cast<u64*>(status), 0ull, 1ull) == 0ull) {
                status[1] = static_cast<u64>(slot);
                status[2] = epoch;
                status[3] = seen;
            }
            return false;
        }
        __nanosleep(200);
    }
    fence_async_global();  // the bulk engine reads the chunk only after its flag
    return true;
}

// Bytes of expert tiles [begin, end) (a tile is tile_bytes, except the last of a tensor).
__device__ i64 tile_range_bytes(const SyncShared& s, int num_tensors, i64 tile_bytes, i64 begin, i64 end) {
    i64 bytes = 0;
    for (int t = 0; t < num_tensors; ++t) {
        const i64 first = s.first_tile[t], lo = max(begin, first), hi = min(end, s.first_tile[t + 1]);
        if (lo < hi) bytes += min((hi - first) * tile_bytes, s.tensor_bytes[t]) - (lo - first) * tile_bytes;
    }
    return bytes;
}

// Loading warp, one thread. The work is a row of piece slots: task t owns task_slots of
// them, chunk_tiles tiles of tile_pieces pieces of stage_bytes (slots past a short tile's
// end or a short chunk's last tile are empty). Block b takes slots b, b + gridDim.x, ...,
// so all blocks stream through one window of the sources and destinations at a time (on
// the H200 2-3% faster than a contiguous share per block) and no block waits for another.
// Each piece's bulk load goes into the next free stage; then an end marker for every
// storing warp. Tasks that wait for a relay's chunk come after every direct task, so a
// block has handed all its direct pieces on before it waits.
__device__ void load_pieces(SyncShared& s, unsigned char* stage_mem, int stages, int stage_bytes, int storers,
                            const i64* tasks, int num_tasks, int chunk_tiles, int num_tensors, i64 tile_bytes,
                            const u64* src_ptrs, const u64* peer_bases, int rank, u64 epoch, u64 timeout_ns,
                            u64* status) {
    const i64 tile_pieces = (tile_bytes + stage_bytes - 1) / stage_bytes, task_slots = chunk_tiles * tile_pieces;
    const i64 num_slots = num_tasks * task_slots;
    const auto prefetch_row = [&](i64 slot) {  // the slot's task row (56 bytes, at most two lines) into L1
        if (slot < num_slots) {
            prefetch_l1(tasks + 7 * (slot / task_slots));
            prefetch_l1(tasks + 7 * (slot / task_slots) + 6);
        }
    };
    for (int i = 0; i < stages; ++i) prefetch_row(blockIdx.x + static_cast<i64>(i) * gridDim.x);
    int filled = 0, task_id = -1, chunk_bytes = 0;
    i64 task[7], src_index = -1;  // src_index: the source table entry src_base was read from
    u64 src_base = 0;
    bool ready = false;  // the current task's chunk is there to be read (a relay waits for its flag)
    for (i64 q = blockIdx.x; q < num_slots; q += gridDim.x) {
        prefetch_row(q + static_cast<i64>(stages) * gridDim.x);  // consecutive pieces are of other tasks
        if (q / task_slots != task_id) {
            task_id = static_cast<int>(q / task_slots);
            for (int f = 0; f < 7; ++f) task[f] = __ldg(tasks + 7 * static_cast<i64>(task_id) + f);
            ready = task[6] < 0;
            chunk_bytes = static_cast<int>(tile_range_bytes(s, num_tensors, tile_bytes, task[2], task[3]));
        }
        const i64 in_task = q - task_id * task_slots, k = task[2] + in_task / tile_pieces;
        if (k >= task[3]) continue;  // the chunk has fewer tiles (an expert's last chunk)
        int tensor = 0;
        for (int t = 1; t < num_tensors; ++t) tensor += k >= s.first_tile[t];
        const i64 tile_offset = (k - s.first_tile[tensor]) * tile_bytes;
        const i64 tile_nbytes = min(tile_bytes, s.tensor_bytes[tensor] - tile_offset);
        const i64 begin = in_task % tile_pieces * stage_bytes;
        if (begin >= tile_nbytes) continue;  // past a short tile's end
        if (!ready && !(ready = wait_chunk_flag(reinterpret_cast<const u64*>(peer_bases[rank]), task[6], epoch, timeout_ns, status))) break;
        const int nbytes = static_cast<int>(min(static_cast<i64>(stage_bytes), tile_nbytes - begin));
        if (task[0] + tensor != src_index) src_base = __ldg(src_ptrs + (src_index = task[0] + tensor));
        const u64 src = src_base + tile_offset + begin;
        const int stage = filled % stages;
        if (filled >= stages) barrier_wait(&s.empty[stage], filled / stages - 1);
        const int bulk_bytes = src % 16 ? 0 : nbytes & ~15;
        s.job[stage] = PieceJob{src, s.slot_offset[tensor] + tile_offset + begin, task_id, static_cast<int>(task[1]),
                                chunk_bytes, static_cast<int>(task[4]), static_cast<int>(task[5]), bulk_bytes, nbytes};
        barrier_arrive(&s.posted[stage]);
        if (bulk_bytes) bulk_load(stage_mem + stage * stage_bytes, reinterpret_cast<const void*>(src), bulk_bytes, &s.full[stage]);
        else barrier_arrive(&s.full[stage]);
        ++filled;
    }
    for (int end = filled; end < filled + storers; ++end) {  // each storing warp's next piece is an end marker
        const int stage = end % stages;
        if (end >= stages) barrier_wait(&s.empty[stage], end / stages - 1);
        s.job[stage].task = -1;
        barrier_arrive(&s.posted[stage]);
    }
}

// Lanes count a storing warp's pieces [from, to) of its ring, a piece each, once lane 0
// waited for their writes (bulk groups) and the lanes' tail stores were made before the
// caller's last __syncwarp: each piece's bytes count toward its chunk in done[task]; the
// piece that completes the chunk resets the counter and publishes the chunk flag at every
// destination.
__device__ void count_pieces(const PieceJob* landing, int from, int to, const i64* dests, const u64* peer_bases,
                             int* done, u64 flag_value) {
    const int lane = threadIdx.x % 32;
    if (lane == 0) fence_async_global();  // the bulk engine's completed writes before the counts
    __syncwarp();
    if (lane < to - from) {
        const PieceJob& job = landing[(from + lane) % SYNC_COUNT_BATCH];
        fence_gpu();
        if (atomicAdd(done + job.task, job.nbytes) + job.nbytes == job.chunk_bytes) {
            done[job.task] = 0;
            fence_sys();  // every block's pieces of this chunk before its flags
            for (int d = job.dest_begin; d < job.dest_end; ++d) {
                const i64* dest = dests + 3 * static_cast<i64>(d);
                store_relaxed_sys(reinterpret_cast<u64*>(peer_bases[dest[0]]) + dest[2] + job.chunk, flag_value);
            }
        }
    }
    __syncwarp();  // the ring entries are read before lane 0 reuses them
}

// Storing warp w of `storers`: the block's pieces w, w + storers, ... (a stage always
// serves the same warp: stages is a multiple of storers, at least twice). Its destinations
// are looked up while a piece lands; lane 0 sends the piece from its stage to every
// destination by bulk stores, all lanes copy a tail, and the previous piece's stage goes
// back once its stores have read it. Waiting for writes is kept off the store path: issued
// pieces are counted in batches, when SYNC_COUNT_BATCH are pending (all but the newest,
// whose writes are still going) or when the next piece is late, not posted or not landed
// after SYNC_PATIENCE (all of them: a warp never sits on a count for long while it waits,
// since a relay elsewhere may wait for that chunk; counting at every short wait put each
// piece's writes back on the store path and timed no faster).
__device__ void store_pieces(SyncShared& s, const unsigned char* stage_mem, int stages, int stage_bytes, int storers,
                             const i64* dests, const u64* peer_bases, int* done, u64 flag_value) {
    const int warp = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
    unsigned char** dst = s.dst[warp];
    PieceJob* landing = s.landing[warp];
    int dst_begin = -1, dst_end = -1, issued = 0, counted = 0;
    for (int n = warp;; n += storers, ++issued) {
        const int stage = n % stages;
        const auto count_all_unless_soon = [&](u64* bar) {  // what comes next is late: count first
            int late = 0;
            if (lane == 0 && counted < issued)
                for (const long long start = clock64(); !late && !barrier_done(bar, n / stages);)
                    late = clock64() - start > SYNC_PATIENCE;
            if (__shfl_sync(0xffffffffu, late, 0)) {
                if (lane == 0) bulk_wait_done<0>();
                count_pieces(landing, counted, issued, dests, peer_bases, done, flag_value);
                counted = issued;
            }
        };
        count_all_unless_soon(&s.posted[stage]);
        barrier_wait(&s.posted[stage], n / stages);
        const PieceJob job = s.job[stage];
        if (job.task < 0) break;
        const int num_dests = job.dest_end - job.dest_begin;
        if (job.dest_begin != dst_begin || job.dest_end != dst_end) {
            for (int d = lane; d < num_dests; d += 32) {
                const i64* dest = dests + 3 * static_cast<i64>(job.dest_begin + d);
                dst[d] = reinterpret_cast<unsigned char*>(__ldg(peer_bases + __ldg(dest)) + __ldg(dest + 1));
            }
            dst_begin = job.dest_begin;
            dst_end = job.dest_end;
        }
        if (issued - counted == SYNC_COUNT_BATCH) {
            if (lane == 0) bulk_wait_done<1>();
            count_pieces(landing, counted, issued - 1, dests, peer_bases, done, flag_value);
            counted = issued - 1;
        }
        count_all_unless_soon(&s.full[stage]);
        barrier_wait(&s.full[stage], n / stages);
        __syncwarp();  // every lane's destination look-up before lane 0's stores
        if (lane == 0) {
            for (int d = 0; d < num_dests && job.bulk_bytes; ++d)
                bulk_store(dst[d] + job.within_slot, stage_mem + stage * stage_bytes, job.bulk_bytes);
            bulk_commit();
        }
        if (job.bulk_bytes < job.nbytes) {
            const unsigned char* src = reinterpret_cast<const unsigned char*>(job.src);
            for (int d = 0; d < num_dests; ++d)
                for (int b = job.bulk_bytes + lane; b < job.nbytes; b += 32) dst[d][job.within_slot + b] = __ldcg(src + b);
        }
        __syncwarp();
        if (lane == 0) {
            landing[issued % SYNC_COUNT_BATCH] = job;
            bulk_wait_read<1>();  // the previous piece's stores have read its stage
            if (issued > 0) barrier_arrive(&s.empty[(n - storers) % stages]);
        }
    }
    if (lane == 0) bulk_wait_done<0>();
    count_pieces(landing, counted, issued, dests, peer_bases, done, flag_value);
}

// Persistent weight sync through the bulk copy engine: a loading warp and 1..MAX_STORERS
// storing warps per block (32 x (1 + storers) threads). Blocks take the pieces in turn
// (load_pieces); each piece is read once into a shared-memory stage and stored from there
// to every destination; per-chunk byte counts (done[task]) tell the piece that finishes a
// chunk to publish its flags (epoch << 16 | rank) at the destinations. A relay task waits
// (with a timeout) for its own chunk flag before loading. A timeout leaves chunks half
// counted: until the host has reported it (status) and zeroed done[], later launches do
// nothing, so a half count can never publish a flag early.
extern "C" __global__ void __launch_bounds__(32 * (1 + MAX_STORERS))
weight_sync(const i64* tasks, const int* task_count, int chunk_tiles, const i64* tensor_table, int num_tensors,
            i64 tile_bytes, int stages, int stage_bytes, const i64* dests, const u64* src_ptrs, int num_src_ptrs,
            const u64* peer_bases, int num_ranks, int rank, u64 epoch, int* done, u64 timeout_ns, u64* status) {
    extern __shared__ __align__(128) unsigned char stage_mem[];  // stages x stage_bytes
    __shared__ SyncShared s;
    const int num_tasks = *task_count;  // written on the device by the schedule compiler
    const int tid = threadIdx.x, storers = blockDim.x / 32 - 1;
    if (tid < num_tensors) {
        s.first_tile[tid] = tensor_table[3 * tid];
        s.tensor_bytes[tid] = tensor_table[3 * tid + 1];
        s.slot_offset[tid] = tensor_table[3 * tid + 2];
        if (tid == num_tensors - 1)
            s.first_tile[num_tensors] = s.first_tile[tid] + (s.tensor_bytes[tid] + tile_bytes - 1) / tile_bytes;
    }
    if (tid >= 32) {  // the storing warps prefetch the tables the loader and they look up
        const int stride = 16 * (blockDim.x - 32);
        for (int i = 16 * (tid - 32); i < num_src_ptrs; i += stride) prefetch_l1(src_ptrs + i);
        for (int i = 16 * (tid - 32); i < num_ranks; i += stride) prefetch_l1(peer_bases + i);
    }
    if (tid == 0) {
        s.skip = *reinterpret_cast<volatile u64*>(status) != 0;
        for (int q = 0; q < stages; ++q) {
            barrier_init(&s.posted[q]);
            barrier_init(&s.full[q]);
            barrier_init(&s.empty[q]);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the bulk engine
    }
    __syncthreads();
    if (s.skip) return;
    if (tid == 0)
        load_pieces(s, stage_mem, stages, stage_bytes, storers, tasks, num_tasks, chunk_tiles, num_tensors, tile_bytes,
                    src_ptrs, peer_bases, rank, epoch, timeout_ns, status);
    else if (tid >= 32)
        store_pieces(s, stage_mem, stages, stage_bytes, storers, dests, peer_bases, done,
                     (epoch << FLAG_WRITER_BITS) | static_cast<u64>(rank));
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Gradient reduction, one task per block iteration (static assignment: the arithmetic
// order per element is fixed by the task, not by scheduling): master tile in fp32, plus
// each replica's tile in replica order, rounded once. Plain adds: no FMA can contract them.
template <typename T>
__global__ void reduce_grads(const i64* tasks, const int* task_count, const i64* srcs, const u64* dst_ptrs,
                             const u64* peer_bases) {
    const int num_tasks = *task_count;  // written on the device by the schedule compiler
    for (int t = blockIdx.x; t < num_tasks; t += gridDim.x) {
        const i64* task = tasks + 5 * static_cast<i64>(t);
        T* dst = reinterpret_cast<T*>(dst_ptrs[task[0]] + task[1]);
        const i64 count = task[2] / static_cast<i64>(sizeof(T));
        for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
            float acc = to_float(dst[i]);
            for (i64 s = task[3]; s < task[4]; ++s) {
                const T* src = reinterpret_cast<const T*>(peer_bases[srcs[2 * s]] + srcs[2 * s + 1]);
                acc = __fadd_rn(acc, to_float(__ldcg(src + i)));
            }
            dst[i] = from_float<T>(acc);
        }
    }
}
