// Data-plane kernels: weight sync by persistent tile streaming (with relay forwarding)
// and deterministic gradient reduction. The task lists and their lengths are compiled on
// the device by schedule.cu; ultraep/transfer/schedule.py (its NumPy reference) defines
// every field.
//
//! kernels: weight_sync, reduce_grads<float>, reduce_grads<__nv_bfloat16>

#include <cuda_bf16.h>

#include "bulk_copy.cuh"
#include "task_tables.cuh"

typedef long long i64;

#define SYNC_THREADS 96       // warp 0 loads pieces into shared memory, warp 1 stores them out, warp 2 counts them
#define MAX_STAGES 16         // shared-memory stages per block; the launch picks how many (>= 2)
#define MAX_TENSORS 8         // tensors per expert (host-checked)
#define MAX_DESTS 128         // destinations of one source: replicas of an expert within a domain (host-checked)
#define SRC_CACHED 128        // source-table entries copied into shared memory at start-up (the rest are read from global)
#define FLAG_WRITER_BITS 16
#define SYNC_READ_LAG 1       // pieces whose stores may still be reading their stage (< stages)
#define SYNC_WRITE_LAG 2      // pieces whose stores may still be landing before they are handed to the counting warp
#define HANDOFF 16            // storing -> counting warp ring (> SYNC_WRITE_LAG)

// Waits for the phase of parity `use & 1`, i.e. the barrier's use-th completion (0-based).
// Every arrive it waits for comes from this block, but the block may itself be waiting for
// a peer's chunk flag (a relay), for up to the sync's timeout: `limit_ns` allows that and
// more (SyncShared::wait_limit_ns).
__device__ __forceinline__ void barrier_wait(u64* bar, int use, const char* what, u64 limit_ns) {
    mbarrier_wait(bar, use & 1, what, limit_ns);
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

// One piece (a tile: one stage), handed from the loading warp to the storing warp (and on
// to the counting warp).
struct PieceJob {
    u64 src;                // the piece in its source tensor
    i64 within_slot;        // where it lands inside a replica slot
    int task, chunk;        // task < 0: no more pieces
    int chunk_bytes;        // bytes of the whole chunk (all blocks)
    int publish;            // a destination forwards the chunk: count the piece, flag the chunk once complete
    int last_in_chunk;      // this block's last piece of the chunk: its bytes are counted at once
    int dest_begin, dest_end;
    int bulk_bytes;         // [0, bulk_bytes) goes through shared memory by the bulk engine
    int nbytes;             // [bulk_bytes, nbytes): a tail under 16 B or an unaligned source, copied by lanes
};

struct SyncShared {
    u64 posted[MAX_STAGES];   // the stage's job is written (its piece may still be landing)
    u64 full[MAX_STAGES];     // the stage's piece has landed
    u64 empty[MAX_STAGES];    // the stage's stores have read it
    u64 landed[HANDOFF];      // the entry's stores are complete
    u64 taken[HANDOFF];       // the counting warp has read the entry
    PieceJob job[MAX_STAGES];
    PieceJob handoff[HANDOFF];
    unsigned char* dst[MAX_DESTS];     // replica-slot bases of the storing warp's current destination range
    u64 src_ptr[SRC_CACHED];           // the source table's first entries
    i64 first_row[WEIGHT_TASK_FIELDS]; // the loader's first task row
    i64 first_tile[MAX_TENSORS + 1];   // expert tile index where each tensor starts; [num_tensors]: tiles in all
    i64 tensor_bytes[MAX_TENSORS];
    i64 slot_offset[MAX_TENSORS];      // where each tensor starts inside a replica slot
    int skip;                          // an earlier timeout is not yet reported: do nothing
    u64 wait_limit_ns;                 // barrier_wait's: the chunk-flag timeout and a margin
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

// Loading warp, one thread. The work is a grid of tile slots, chunk_tiles per task (slot
// task * chunk_tiles + i is the chunk's tile i; slots past a short chunk's last tile are
// empty), and block b takes slots b, b + G, b + 2G, ... (G blocks): at any time the blocks
// stream neighbouring tiles, which the memory system serves faster than one contiguous
// share per block. A tile is one piece (tile_bytes <= stage_bytes), its bulk load started
// into the next free stage; then an end marker. s.first_row is the row of task
// blockIdx.x / chunk_tiles, read by the kernel's start-up.
__device__ void load_pieces(SyncShared& s, unsigned char* stage_mem, int stages, int stage_bytes, const i64* tasks,
                            int num_tasks, int chunk_tiles, int num_tensors, i64 tile_bytes, const u64* src_ptrs,
                            const u64* peer_bases, int rank, u64 epoch, u64 timeout_ns, u64* status) {
    const int num_slots = num_tasks * chunk_tiles;  // < 2**30, and G <= 2**20 (host-checked): g + G fits
    int filled = 0, task_id = static_cast<int>(blockIdx.x) / chunk_tiles, chunk_bytes = 0;
    i64 task[WEIGHT_TASK_FIELDS];
    for (int f = 0; f < WEIGHT_TASK_FIELDS; ++f) task[f] = s.first_row[f];
    bool ready = task[6] < 0;  // the current task's chunk is there to be read (a relay waits for its flag)
    if (task[7]) chunk_bytes = static_cast<int>(tile_range_bytes(s, num_tensors, tile_bytes, task[2], task[3]));
    for (int g = blockIdx.x; g < num_slots; g += gridDim.x) {
        const int next = g + static_cast<int>(gridDim.x);
        if (g / chunk_tiles != task_id) {
            task_id = g / chunk_tiles;
            const i64* row = tasks + WEIGHT_TASK_FIELDS * static_cast<i64>(task_id);
            for (int f = 0; f < WEIGHT_TASK_FIELDS; ++f) task[f] = __ldg(row + f);
            ready = task[6] < 0;
            if (task[7]) chunk_bytes = static_cast<int>(tile_range_bytes(s, num_tensors, tile_bytes, task[2], task[3]));
        }
        if (next < num_slots && next / chunk_tiles != task_id)
            prefetch_l1(tasks + WEIGHT_TASK_FIELDS * static_cast<i64>(next / chunk_tiles));
        const i64 k = task[2] + g % chunk_tiles;
        if (k >= task[3]) continue;  // the chunk has fewer tiles (an expert's last chunk)
        int tensor = 0;
        for (int t = 1; t < num_tensors; ++t) tensor += k >= s.first_tile[t];
        const i64 tile_offset = (k - s.first_tile[tensor]) * tile_bytes;
        const int nbytes = static_cast<int>(min(tile_bytes, s.tensor_bytes[tensor] - tile_offset));
        if (!ready && !(ready = wait_chunk_flag(reinterpret_cast<const u64*>(peer_bases[rank]), task[6], epoch, timeout_ns, status))) break;
        const i64 src_ref = task[0] + tensor;
        const u64 src = (src_ref < SRC_CACHED ? s.src_ptr[src_ref] : __ldg(src_ptrs + src_ref)) + tile_offset;
        const int stage = filled % stages;
        if (filled >= stages)
            barrier_wait(&s.empty[stage], filled / stages - 1, "weight_sync: a free stage", s.wait_limit_ns);
        const int bulk_bytes = src % 16 ? 0 : nbytes & ~15;
        // the block's next slot is another chunk's, or an empty slot of this chunk (all later ones are too)
        const bool last_in_chunk = next >= num_slots || next / chunk_tiles != task_id || task[2] + next % chunk_tiles >= task[3];
        s.job[stage] = PieceJob{src, s.slot_offset[tensor] + tile_offset, task_id, static_cast<int>(task[1]),
                                chunk_bytes, task[7] != 0, last_in_chunk, static_cast<int>(task[4]),
                                static_cast<int>(task[5]), bulk_bytes, nbytes};
        mbarrier_arrive(&s.posted[stage]);
        if (bulk_bytes) bulk_load(stage_mem + stage * stage_bytes, reinterpret_cast<const void*>(src), bulk_bytes, &s.full[stage]);
        else mbarrier_arrive(&s.full[stage]);
        ++filled;
    }
    const int stage = filled % stages;
    if (filled >= stages)
        barrier_wait(&s.empty[stage], filled / stages - 1, "weight_sync: a free stage", s.wait_limit_ns);
    s.job[stage].task = -1;
    mbarrier_arrive(&s.posted[stage]);
    mbarrier_arrive(&s.full[stage]);
}

// Storing warp -> counting warp: entry n of the ring (its slot is free once entry n - HANDOFF was taken).
__device__ __forceinline__ void hand_over(SyncShared& s, int n, const PieceJob& job) {
    if (n >= HANDOFF)
        barrier_wait(&s.taken[n % HANDOFF], n / HANDOFF - 1, "weight_sync: a free hand-over slot", s.wait_limit_ns);
    s.handoff[n % HANDOFF] = job;
}

// Storing warp, lane 0: every piece handed to the counting warp has landed (all bulk stores
// complete, made visible to the counting warp's fence and flags); `pending` is cleared.
__device__ __forceinline__ void land_handed(SyncShared& s, unsigned& pending, int handed, int& landed) {
    bulk_wait_done<0>();
    if (pending) fence_async_global();
    for (; landed < handed; ++landed) mbarrier_arrive(&s.landed[landed % HANDOFF]);
    pending = 0;
}

// Storing warp: each piece goes from its stage to every destination by bulk stores (lane 0),
// tails by all lanes. A stage is handed back once SYNC_READ_LAG newer pieces were issued and
// its stores have read it. A piece of a publishing task goes to the counting warp once its
// writes are complete: SYNC_WRITE_LAG pieces later, so no fence waits here for the bulk
// engine's stores in flight while there is a next piece to issue, or as soon as the next
// piece is not there yet. Other pieces are never waited for before the kernel's end.
__device__ void store_pieces(SyncShared& s, const unsigned char* stage_mem, int stages, int stage_bytes,
                             const i64* dests, const u64* peer_bases) {
    const int lane = threadIdx.x % 32;
    int dst_begin = -1, dst_end = -1, issued = 0, released = 0, handed = 0, landed = 0;  // [dst_begin, dst_end): in s.dst
    unsigned pending = 0;  // bit i: the piece issued i pieces ago was handed over and has not landed yet
    for (;; ++issued) {
        const int stage = issued % stages;
        // The loader may be waiting for a peer's chunk flag (a relay task), and that peer for a
        // chunk whose last pieces are pending here: before waiting for the next piece, those
        // are counted. Otherwise two ranks could each wait for a chunk the other holds back.
        if (lane == 0 && pending && !mbarrier_try_wait<false>(shared_address(&s.posted[stage]), (issued / stages) & 1))
            land_handed(s, pending, handed, landed);
        // destinations are looked up while the piece lands
        barrier_wait(&s.posted[stage], issued / stages, "weight_sync: the next piece", s.wait_limit_ns);
        const PieceJob job = s.job[stage];
        if (job.task < 0) break;
        const int num_dests = job.dest_end - job.dest_begin;
        if (job.dest_begin != dst_begin || job.dest_end != dst_end) {  // tasks of one source share their destinations
            for (int d = lane; d < num_dests; d += 32) {
                const i64* dest = dests + DEST_FIELDS * static_cast<i64>(job.dest_begin + d);
                s.dst[d] = reinterpret_cast<unsigned char*>(__ldg(peer_bases + __ldg(dest)) + __ldg(dest + 1));
            }
            dst_begin = job.dest_begin;
            dst_end = job.dest_end;
            __syncwarp();
        }
        barrier_wait(&s.full[stage], issued / stages, "weight_sync: a piece's load", s.wait_limit_ns);
        if (lane == 0) {
            for (int d = 0; d < num_dests && job.bulk_bytes; ++d)
                bulk_store(s.dst[d] + job.within_slot, stage_mem + stage * stage_bytes, job.bulk_bytes);
            bulk_commit();
            if (job.publish) hand_over(s, handed++, job);
        }
        if (job.bulk_bytes < job.nbytes) {
            const unsigned char* src = reinterpret_cast<const unsigned char*>(job.src);
            for (int d = 0; d < num_dests; ++d)
                for (int b = job.bulk_bytes + lane; b < job.nbytes; b += 32) s.dst[d][job.within_slot + b] = __ldcg(src + b);
        }
        __syncwarp();
        if (lane == 0) {
            bulk_wait_read<SYNC_READ_LAG>();
            for (; released <= issued - SYNC_READ_LAG; ++released) mbarrier_arrive(&s.empty[released % stages]);
            pending = pending << 1 | static_cast<unsigned>(job.publish);
            if (pending >> SYNC_WRITE_LAG) {  // handed pieces issued SYNC_WRITE_LAG or more pieces ago
                bulk_wait_done<SYNC_WRITE_LAG>();
                fence_async_global();
                for (int n = __popc(pending >> SYNC_WRITE_LAG); n > 0; --n, ++landed)
                    mbarrier_arrive(&s.landed[landed % HANDOFF]);
                pending &= (1u << SYNC_WRITE_LAG) - 1;
            }
        }
    }
    if (lane == 0) {
        land_handed(s, pending, handed, landed);
        hand_over(s, handed, PieceJob{0, 0, -1});
        mbarrier_arrive(&s.landed[handed % HANDOFF]);
    }
}

// Counting warp, one thread: the bytes of each stored piece of a publishing task (its writes
// complete; lanes' tail stores are ordered by the storing warp's __syncwarp before its
// `landed` arrive) count toward its chunk in done[task], all of this block's pieces of a
// chunk at once; the block whose bytes complete the chunk resets the counter and publishes
// the chunk flag at every destination.
__device__ void count_pieces(SyncShared& s, const i64* dests, const u64* peer_bases, int* done, u64 flag_value) {
    int run = 0;
    for (int n = 0;; ++n) {
        barrier_wait(&s.landed[n % HANDOFF], n / HANDOFF, "weight_sync: a piece to count", s.wait_limit_ns);
        const PieceJob job = s.handoff[n % HANDOFF];
        mbarrier_arrive(&s.taken[n % HANDOFF]);
        if (job.task < 0) return;
        run += job.nbytes;
        if (!job.last_in_chunk) continue;
        const int add = run;
        run = 0;
        fence_gpu();
        if (atomicAdd(done + job.task, add) + add != job.chunk_bytes) continue;
        done[job.task] = 0;
        fence_sys();  // every block's pieces of this chunk before its flags
        for (int d = job.dest_begin; d < job.dest_end; ++d) {
            const i64* dest = dests + DEST_FIELDS * static_cast<i64>(d);
            store_relaxed_sys(reinterpret_cast<u64*>(peer_bases[dest[0]]) + dest[2] + job.chunk, flag_value);
        }
    }
}

// Persistent weight sync through the bulk copy engine. Blocks take tiles in turn; a tile is
// read once into a shared-memory stage and stored from there to every destination. For a
// publishing task (a relay among its destinations), per-chunk byte counts (done[task]) tell
// the block that finishes a chunk to publish its flags (epoch << 16 | rank) at the
// destinations; other tasks are neither counted nor flagged (the heap barrier after the sync
// orders them). A relay task waits (with a timeout) for its own chunk flag before loading.
// A timeout leaves chunks half counted: until the host has reported it (status) and zeroed
// done[], later launches do nothing, so a half count can never publish a flag early.
//
// Start-up: one round trip of global reads before a block's first bulk load. The loading
// thread reads the task count, the status and its first task row (block b's first slot is
// task b / chunk_tiles, so no read waits for the count; `task_rows` is what the table
// holds) while the first num_tensors threads read the tensor table and the storing and
// counting warps read the source table's first SRC_CACHED entries into shared memory and
// prefetch the rest and the peer table into L1.
extern "C" __global__ void __launch_bounds__(SYNC_THREADS)
weight_sync(const i64* tasks, const int* task_count, int task_rows, int chunk_tiles, const i64* tensor_table,
            int num_tensors, i64 tile_bytes, int stages, int stage_bytes, const i64* dests, const u64* src_ptrs,
            int num_src_ptrs, const u64* peer_bases, int num_ranks, int rank, u64 epoch, int* done, u64 timeout_ns,
            u64* status) {
    extern __shared__ __align__(128) unsigned char stage_mem[];  // stages x stage_bytes
    __shared__ SyncShared s;
    const int tid = threadIdx.x;
    // Every table read is issued before any is stored to shared memory (a store there may not
    // be moved above a later load through a generic pointer), so they all take one round trip.
    int num_tasks = 0;
    u64 earlier_timeout = 0;
    i64 row[WEIGHT_TASK_FIELDS], tensor[3];
    u64 cached[SRC_CACHED / 64];
    if (tid == 0) {
        earlier_timeout = *reinterpret_cast<volatile u64*>(status);
        num_tasks = *task_count;  // written on the device by the schedule compiler
        const int first_task = min(static_cast<int>(blockIdx.x) / chunk_tiles, task_rows - 1);
        for (int f = 0; f < WEIGHT_TASK_FIELDS; ++f) row[f] = __ldg(tasks + WEIGHT_TASK_FIELDS * static_cast<i64>(first_task) + f);
    }
    if (tid < num_tensors)
        for (int f = 0; f < 3; ++f) tensor[f] = __ldg(tensor_table + 3 * tid + f);
    if (tid >= 32) {  // the storing and counting warps fetch the tables the loader and they look up
#pragma unroll
        for (int j = 0; j < SRC_CACHED / 64; ++j)
            if (tid - 32 + 64 * j < num_src_ptrs) cached[j] = __ldg(src_ptrs + tid - 32 + 64 * j);
        for (int i = SRC_CACHED + 16 * (tid - 32); i < num_src_ptrs; i += 16 * 64) prefetch_l1(src_ptrs + i);
        for (int i = 16 * (tid - 32); i < num_ranks; i += 16 * 64) prefetch_l1(peer_bases + i);
#pragma unroll
        for (int j = 0; j < SRC_CACHED / 64; ++j)
            if (tid - 32 + 64 * j < num_src_ptrs) s.src_ptr[tid - 32 + 64 * j] = cached[j];
    }
    if (tid == 0)
        for (int f = 0; f < WEIGHT_TASK_FIELDS; ++f) s.first_row[f] = row[f];
    if (tid < num_tensors) {
        s.first_tile[tid] = tensor[0];
        s.tensor_bytes[tid] = tensor[1];
        s.slot_offset[tid] = tensor[2];
        if (tid == num_tensors - 1) s.first_tile[num_tensors] = tensor[0] + (tensor[1] + tile_bytes - 1) / tile_bytes;
    }
    if (tid == 0) {
        s.skip = earlier_timeout != 0;
        s.wait_limit_ns = timeout_ns + MBARRIER_TIMEOUT_NS;
        for (int q = 0; q < stages; ++q) {
            mbarrier_init(&s.posted[q], 1);
            mbarrier_init(&s.full[q], 1);
            mbarrier_init(&s.empty[q], 1);
        }
        for (int q = 0; q < HANDOFF; ++q) {
            mbarrier_init(&s.landed[q], 1);
            mbarrier_init(&s.taken[q], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the bulk engine
    }
    __syncthreads();
    if (s.skip) return;
    if (tid == 0)
        load_pieces(s, stage_mem, stages, stage_bytes, tasks, num_tasks, chunk_tiles, num_tensors,
                    tile_bytes, src_ptrs, peer_bases, rank, epoch, timeout_ns, status);
    else if (tid / 32 == 1)
        store_pieces(s, stage_mem, stages, stage_bytes, dests, peer_bases);
    else if (tid == 64)
        count_pieces(s, dests, peer_bases, done, (epoch << FLAG_WRITER_BITS) | static_cast<u64>(rank));
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
        const i64* task = tasks + GRAD_TASK_FIELDS * static_cast<i64>(t);
        T* dst = reinterpret_cast<T*>(dst_ptrs[task[0]] + task[1]);
        const i64 count = task[2] / static_cast<i64>(sizeof(T));
        for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
            float acc = to_float(dst[i]);
            for (i64 s = task[3]; s < task[4]; ++s) {
                const i64* source = srcs + GRAD_SRC_FIELDS * s;  // rank, heap offset
                const T* src = reinterpret_cast<const T*>(peer_bases[source[0]] + source[1]);
                acc = __fadd_rn(acc, to_float(__ldcg(src + i)));
            }
            dst[i] = from_float<T>(acc);
        }
    }
}
