// Data-plane kernels: weight sync by persistent tile streaming (with relay forwarding)
// and deterministic gradient reduction. The task lists and their lengths are compiled on
// the device by schedule.cu; ultraep/transfer/schedule.py (its NumPy reference) defines
// every field.
//
//! kernels: weight_sync, agree_compile_and_sync_weights, wait_replica_slots
//! kernels: reduce_grads<float>, reduce_grads<__nv_bfloat16>, copy_filled_slots

#include <cuda_bf16.h>

#include "agree.cuh"
#include "piece_copy.cuh"
#include "schedule.cuh"
#include "sync.cuh"
#include "task_tables.cuh"

#define SYNC_WARPS 8           // a block: eight warps, each copying its own pieces
#define SYNC_THREADS (32 * SYNC_WARPS)
#define SYNC_MIN_BLOCKS 4       // blocks per SM the registers must allow: the host caps a grid at that (residency)
#define MAX_TENSORS 8           // tensors per expert (host-checked)
#define MAX_DESTS 128           // destinations of one source: replicas of an expert within a domain (host-checked)
#define STATUS_WORDS 4          // status[]: timed out, flag slot, expected epoch, flag seen (wait_chunk_flag)
#define GATE_SLOT (-1)          // the flag slot status[] names when a one-launch sync's copy waited for its roles
#define LINE_WORDS 16           // u64 words in a 128-byte line: the count of warps done claiming has one of its own
#define GATE_WORDS (LINE_WORDS + 1)   // agree_compile_and_sync_weights' gate[]: tickets taken, roles done, runs claimed; warps done claiming at [LINE_WORDS]
#define CLAIM_WORDS (LINE_WORDS + 1)  // weight_sync's claims[]: runs claimed; warps done claiming at [LINE_WORDS]
#define CLAIM_PIECES 4          // consecutive pieces a warp claims at a time while many are left
#define HALF_RUNS_LEFT 8        // pieces left per warp of the grid below which runs shrink to CLAIM_PIECES / 2
#define SINGLE_RUNS_LEFT 2      // and to one piece
#define WAIT_STATUS_WORDS 6     // wait_replica_slots' status[]: timed out, layer, slot, chunk, expected epoch, flag seen
#define WAIT_THREADS 128        // a wait_replica_slots block: one thread per chunk flag at a time
#define SRC_CACHED 128          // source-table entries copied into shared memory at start-up (the rest are read from global)
#define DEST_CACHED SYNC_THREADS  // destination rows and peer bases copied into shared memory at start-up (likewise)
#define FLAG_WRITER_BITS 16
#define WARP 32
#define FULL_MASK 0xffffffffu

// after WARP and FULL_MASK, which it uses
#include "row_math.cuh"

__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void store_relaxed_sys(u64* addr, u64 value) {  // after a fence: a release pattern
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(addr), "l"(value) : "memory");
}

struct SyncShared {
    unsigned char* dst[SYNC_WARPS][MAX_DESTS];  // per warp: replica-slot bases of its current destination range
    u64 src_ptr[SRC_CACHED];                    // the source table's first entries
    u64 peer_base[DEST_CACHED];                 // the peer table's first entries
    i64 dest_offset[DEST_CACHED];               // the destination table's first rows: slot heap offset
    int dest_rank[DEST_CACHED];                 // and rank
    i64 first_tile[MAX_TENSORS + 1];            // expert tile index where each tensor starts; [num_tensors]: tiles in all
    i64 tensor_bytes[MAX_TENSORS];
    i64 slot_offset[MAX_TENSORS];               // where each tensor starts inside a replica slot
    unsigned long long first_runs;              // the block's first 2 * SYNC_WARPS runs start here
};

// Lane 0 waits for a relay's chunk flag (in its own signal pad) to reach this epoch, the
// whole warp gets the outcome; false after the timeout (recorded as (1, flag slot, expected
// epoch, seen) in status) or once another warp has recorded one. The __syncwarp after lane
// 0's acquiring load orders the lanes' reads of the chunk after it.
__device__ bool wait_chunk_flag(const u64* pad, i64 slot, u64 epoch, u64 timeout_ns, u64* status, int lane) {
    bool ok = true;
    if (lane == 0) {
        const u64 start = global_timer_ns();
        u64 seen;
        while (((seen = load_acquire_sys(pad + slot)) >> FLAG_WRITER_BITS) < epoch) {
            if (*reinterpret_cast<volatile u64*>(status)) { ok = false; break; }
            if (global_timer_ns() - start > timeout_ns) {
                if (atomicCAS(reinterpret_cast<u64*>(status), 0ull, 1ull) == 0ull) {
                    status[1] = static_cast<u64>(slot);
                    status[2] = epoch;
                    status[3] = seen;
                }
                ok = false;
                break;
            }
            __nanosleep(200);
        }
    }
    ok = __shfl_sync(FULL_MASK, ok, 0);
    __syncwarp();
    return ok;
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

// How the copy reads the task and destination tables: through the read-only cache when an
// earlier launch compiled them (weight_sync); with loads that see this launch's stores when
// a block of the same launch did (agree_compile_and_sync_weights), as the read-only cache is
// coherent only across launches.
struct TablesOfEarlierLaunch {
    static __device__ __forceinline__ i64 load(const i64* p) { return __ldg(p); }
};
struct TablesOfThisLaunch {
    static __device__ __forceinline__ i64 load(const i64* p) {
        i64 value;
        asm volatile("ld.relaxed.gpu.global.s64 %0, [%1];" : "=l"(value) : "l"(p) : "memory");
        return value;
    }
};

// Lane f < WEIGHT_TASK_FIELDS reads field f of a task row (one coalesced read per warp;
// __shfl_sync hands the fields out).
template <class Tables>
__device__ __forceinline__ int task_row_field(const i64* tasks, int task, int lane) {  // every field is a small int
    const i64* row = tasks + WEIGHT_TASK_FIELDS * static_cast<i64>(task);
    return lane < WEIGHT_TASK_FIELDS ? static_cast<int>(Tables::load(row + lane)) : 0;
}
__device__ __forceinline__ int row_field(int row, WeightTaskField field) { return __shfl_sync(FULL_MASK, row, field); }

// A place in the piece grid: piece `piece` of tile slot `tile` of task `task` (grid index
// (task * chunk_tiles + tile) * pieces_per_tile + piece). A warp steps through the grid by
// a mixed-radix add: a run-time division per piece would slow the copy measurably.
struct PieceSlot {
    int task, tile, piece;
};

__device__ __forceinline__ PieceSlot piece_slot(int g, int chunk_tiles, int pieces_per_tile) {
    const int tile_slot = g / pieces_per_tile;
    return {tile_slot / chunk_tiles, tile_slot % chunk_tiles, g % pieces_per_tile};
}

__device__ __forceinline__ PieceSlot advance(PieceSlot at, const PieceSlot& by, int chunk_tiles, int pieces_per_tile) {
    at.piece += by.piece;
    at.tile += by.tile;
    at.task += by.task;
    if (at.piece >= pieces_per_tile) {
        at.piece -= pieces_per_tile;
        ++at.tile;
    }
    if (at.tile >= chunk_tiles) {
        at.tile -= chunk_tiles;
        ++at.task;
    }
    return at;
}

// A warp's pieces: runs of consecutive grid indices, claimed in increasing order from the
// launch's counter of runs (`runs_claimed`). A block's thread 0 claims its warps' first two
// runs at start-up with one atomic (warp w's are w and SYNC_WARPS + w of them), so that the
// grid's warps do not all queue on the counter at once; afterwards lane 0 of each warp claims
// the run after the current one as the current one starts, so that the claim's round trip
// hides behind its copies. Runs shrink as the grid's end nears (RunSchedule), so that the
// last runs to start end about together: a warp holds two runs claimed, so a run is at most
// half a warp's share of the pieces left (at start-up too: with 4 blocks an SM a 37.7 MB
// expert is 4.4 pieces a warp of an H100, and runs of CLAIM_PIECES there gave the first
// blocks' warps 8), down to two pieces a warp left; only those go one at a time, since a run
// of one piece is a round trip on the counter for one piece's copies. `at` is the last piece
// handed out. A warp's claims end with the first run past the grid: lane 0 then counts the
// warp done claiming (ClaimWords), two pieces before the warp's copies end, so that the count
// and the last warp's zeroing of the counters take no time at the launch's end.
struct RunSchedule {
    int long_runs, half_runs;     // runs of CLAIM_PIECES, then of CLAIM_PIECES / 2, then of one piece
    int half_begin, single_begin;  // the grid indices where those start
    int runs;                      // in all: a run from here on lies past the grid
};

__device__ __forceinline__ RunSchedule run_schedule(int pieces) {
    const int warps = static_cast<int>(gridDim.x) * SYNC_WARPS, half = CLAIM_PIECES / 2;
    RunSchedule r;
    r.long_runs = max(0, pieces - HALF_RUNS_LEFT * warps) / CLAIM_PIECES;
    r.half_begin = r.long_runs * CLAIM_PIECES;
    r.half_runs = max(0, pieces - SINGLE_RUNS_LEFT * warps - r.half_begin) / half;
    r.single_begin = r.half_begin + r.half_runs * half;
    r.runs = r.long_runs + r.half_runs + max(0, pieces - r.single_begin);
    return r;
}

// A launch's counters, which the last warp done claiming zeroes for the next launch on the
// stream: the runs claimed, the warps done claiming (on a line of its own, away from the
// claims' atomics), and `other_count` more words of the launch's at `others`.
struct ClaimWords {
    u64* runs_claimed;
    u64* warps_done;
    u64* others;
    int other_count;
};

#define NO_RUN (~0ull)
struct ClaimedPieces {
    PieceSlot at;
    int left;                      // pieces of at's run after it
    unsigned long long following;  // lane 0: the next run
    unsigned long long reserved;   // lane 0: the run after it where the block claimed it, else NO_RUN
    unsigned long long done_ticket;  // lane 0: the warp's place among those done claiming; NO_RUN before, SETTLED after
};
#define SETTLED (NO_RUN - 1)

// Lane 0 of a warp that claims no more: the first call counts it done claiming, the next
// (a piece later, when the count's value is back) zeroes the counters if it was the last.
// Each warp counts only once its last claim has returned its run, and the zeroing waits for
// the last count's value: an atomic returns once performed at L2, and none is issued ahead
// of the branch that its value decides, so no claim lands after the zeroing.
__device__ __forceinline__ void count_or_settle(ClaimedPieces& c, const ClaimWords& w) {
    if (c.done_ticket == NO_RUN) {
        c.done_ticket = atomicAdd(w.warps_done, 1ull);
    } else if (c.done_ticket != SETTLED) {
        if (c.done_ticket == static_cast<u64>(gridDim.x) * SYNC_WARPS - 1) {
            atomicExch(w.runs_claimed, 0ull);
            atomicExch(w.warps_done, 0ull);
            for (int i = 0; i < w.other_count; ++i) atomicExch(w.others + i, 0ull);
        }
        c.done_ticket = SETTLED;
    }
}

// Lane 0, as its warp ends. A warp that gave up may have a claim in flight: the fence
// orders it before the count.
__device__ __forceinline__ void retire_warp(ClaimedPieces& c, const ClaimWords& w) {
    if (c.done_ticket == NO_RUN) {
        fence_gpu();
        count_or_settle(c, w);
    }
    count_or_settle(c, w);
}

__device__ __forceinline__ PieceSlot next_claimed_piece(ClaimedPieces& c, const RunSchedule& r, const ClaimWords& w,
                                                        int chunk_tiles, int pieces_per_tile, int lane) {
    if (c.left > 0) {
        --c.left;
        c.at = advance(c.at, PieceSlot{0, 0, 1}, chunk_tiles, pieces_per_tile);
        return c.at;
    }
    const int run = static_cast<int>(__shfl_sync(FULL_MASK, c.following, 0));
    if (lane == 0) {
        if (run < r.runs)
            c.following = c.reserved != NO_RUN ? c.reserved : atomicAdd(w.runs_claimed, 1ull);
        else
            count_or_settle(c, w);
    }
    c.reserved = NO_RUN;
    int start;  // past the grid: ends the copy
    if (run < r.long_runs) {
        start = run * CLAIM_PIECES;
        c.left = CLAIM_PIECES - 1;
    } else if (run < r.long_runs + r.half_runs) {
        start = r.half_begin + (run - r.long_runs) * (CLAIM_PIECES / 2);
        c.left = CLAIM_PIECES / 2 - 1;
    } else {
        start = r.single_begin + (run - r.long_runs - r.half_runs);
        c.left = 0;
    }
    c.at = piece_slot(start, chunk_tiles, pieces_per_tile);
    return c.at;
}

// Where the piece at `at` lies, its task having tiles [tile_begin, tile_end): its tensor t
// and byte offset there; returns its length, 0 for an empty slot (past a short chunk's last
// tile or a tensor's short last tile). A piece never crosses a tile.
__device__ __forceinline__ int locate_piece(const SyncShared& s, int num_tensors, i64 tile_bytes, const PieceSlot& at,
                                            int tile_begin, int tile_end, int& t, i64& offset) {
    const int k = tile_begin + at.tile;
    if (k >= tile_end) return 0;
    t = 0;
    for (int j = 1; j < num_tensors; ++j) t += k >= s.first_tile[j];
    const i64 tile_offset = (k - s.first_tile[t]) * tile_bytes;
    offset = tile_offset + static_cast<i64>(at.piece) * PIECE_BYTES;
    if (offset >= s.tensor_bytes[t]) return 0;
    return static_cast<int>(min(min(static_cast<i64>(PIECE_BYTES), s.tensor_bytes[t] - offset),
                                tile_offset + tile_bytes - offset));
}

// Where destination row `row` starts: its rank's heap base plus the slot's offset.
template <class Tables>
__device__ __forceinline__ unsigned char* destination(const SyncShared& s, const i64* dests, const u64* peer_bases,
                                                      int row) {
    const i64* dest = dests + DEST_FIELDS * static_cast<i64>(row);
    const bool row_cached = static_cast<unsigned>(row) < DEST_CACHED;
    const int rank = row_cached ? s.dest_rank[row] : static_cast<int>(Tables::load(dest));
    const i64 offset = row_cached ? s.dest_offset[row] : Tables::load(dest + 1);
    const u64 base = static_cast<unsigned>(rank) < DEST_CACHED ? s.peer_base[rank] : __ldg(peer_bases + rank);
    return reinterpret_cast<unsigned char*>(base + offset);
}

__device__ __forceinline__ const unsigned char* source_base(const SyncShared& s, const u64* src_ptrs, int ref) {
    return reinterpret_cast<const unsigned char*>(ref < SRC_CACHED ? s.src_ptr[ref] : __ldg(src_ptrs + ref));
}

// Persistent weight sync through registers. The work is a grid of pieces: chunk_tiles tile
// slots per task (slot task * chunk_tiles + i is the chunk's tile i; slots past a short
// chunk's last tile are empty), each tile cut into PIECE_BYTES pieces. Warps claim runs of
// neighbouring pieces from `runs_claimed` as they go (ClaimedPieces), so a
// block that starts late -- its SMs busy with another client's work under MPS -- takes what
// is left rather than a fixed share, and each piece is read once into registers and stored
// to every destination.
// Before a warp loads a piece, it starts a prefetch of its next one into L2, so that load
// waits for L2 rather than for memory busy with everyone's stores.
//
// For a publishing task (a relay among its destinations), or for every task when
// flag_every_chunk is set (no heap barrier follows: readers wait per slot, wait_replica_slots),
// per-chunk byte counts (done[task]) tell the warp that finishes a chunk to publish its flags
// (epoch << FLAG_WRITER_BITS | rank, the epoch the compile counted in weight_syncs) at the
// destinations; other tasks are neither counted nor flagged (the heap barrier after the sync orders them). A relay task waits (with a timeout) for its own chunk flag before loading,
// and its pieces are not prefetched (they are not there yet).
// Master tasks come first in the table and a warp's claims increase, so a warp has stored and
// counted all its master pieces before it can wait for a flag, and every master piece is
// claimed, by a running warp, before any relay piece: every chunk a relay waits for is being
// copied, and two ranks cannot each wait for a chunk the other holds back. A timeout leaves
// chunks half counted: until the host has reported it (status) and zeroed done[], later
// launches do nothing, so a half count can never publish a flag early.
//
// `refused`: a word that is nonzero when the ranks refused the plan the tables were compiled
// from (the agreement's status kind; null where the compile read an agreed plan): nothing is copied.
//
// Start-up (each thread of the SYNC_THREADS a block must have reads one entry of each table
// it copies): one round trip of global reads (the block's claim, the status, the task count,
// the tensor table and the first entries of the source, destination and peer tables, copied
// into shared memory, so that a warp switching destination ranges reads no global memory)
// before one block barrier, then each warp's first two task rows; afterwards each warp reads
// the task row of its piece after next while it copies the current one. The last warp to be
// done claiming zeroes the counters for the next launch (ClaimWords), also where it copied nothing.
#define WEIGHT_COPY_PARAMETERS \
        const i64 *tasks, const int *task_count, int task_rows, int chunk_tiles, const i64 *tensor_table, \
        int num_tensors, i64 tile_bytes, const i64 *dests, int dest_rows, const u64 *src_ptrs, int num_src_ptrs, \
        const u64 *peer_bases, int num_ranks, int rank, const u64 *weight_syncs, int flag_every_chunk, int *done, \
        u64 timeout_ns, u64 *status
#define WEIGHT_COPY_ARGUMENTS \
        tasks, task_count, task_rows, chunk_tiles, tensor_table, num_tensors, tile_bytes, dests, dest_rows, \
        src_ptrs, num_src_ptrs, peer_bases, num_ranks, rank, weight_syncs, flag_every_chunk, done, timeout_ns, status
template <class Tables>
__device__ void copy_weight_pieces(const ClaimWords& claim_words, const u64* refused, WEIGHT_COPY_PARAMETERS) {
    __shared__ SyncShared s;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int pieces_per_tile = static_cast<int>((tile_bytes + PIECE_BYTES - 1) / PIECE_BYTES);
    // the block's first runs, claimed beside the tables' reads
    ClaimedPieces claimed{{0, 0, 0}, 0, 0, NO_RUN, NO_RUN};
    unsigned long long first_runs = 0;
    if (tid == 0) first_runs = atomicAdd(claim_words.runs_claimed, 2ull * SYNC_WARPS);
    // Every table read is issued before any shared-memory store (a store there is not moved
    // above a later load through a generic pointer), so they all take one round trip.
    const u64 earlier_timeout = *reinterpret_cast<volatile u64*>(status);
    const u64 refusal = refused ? *reinterpret_cast<const volatile u64*>(refused) : 0;  // the agreement's verdict
    const int num_tasks = *reinterpret_cast<const volatile int*>(task_count);  // written by the schedule compiler
    const u64 epoch = *reinterpret_cast<const volatile u64*>(weight_syncs);  // which counted this sync
    const RunSchedule runs = run_schedule(num_tasks * chunk_tiles * pieces_per_tile);
    i64 tensor[3];
    u64 cached = 0;
    if (tid < num_tensors)
        for (int f = 0; f < 3; ++f) tensor[f] = __ldg(tensor_table + 3 * tid + f);
    if (tid < SRC_CACHED && tid < num_src_ptrs) cached = __ldg(src_ptrs + tid);
    // the destination and peer tables' first entries, so a destination look-up needs no
    // global read (two dependent ones otherwise)
    i64 dest_row[2];
    u64 peer = 0;
    if (tid < dest_rows)
        for (int f = 0; f < 2; ++f) dest_row[f] = Tables::load(dests + DEST_FIELDS * static_cast<i64>(tid) + f);
    if (tid < num_ranks) peer = __ldg(peer_bases + tid);
    if (tid < SRC_CACHED && tid < num_src_ptrs) s.src_ptr[tid] = cached;
    if (tid < dest_rows) {
        s.dest_rank[tid] = static_cast<int>(dest_row[0]);
        s.dest_offset[tid] = dest_row[1];
    }
    if (tid < num_ranks) s.peer_base[tid] = peer;
    if (tid < num_tensors) {
        s.first_tile[tid] = tensor[0];
        s.tensor_bytes[tid] = tensor[1];
        s.slot_offset[tid] = tensor[2];
        if (tid == num_tensors - 1) s.first_tile[num_tensors] = tensor[0] + (tensor[1] + tile_bytes - 1) / tile_bytes;
    }
    if (tid == 0) s.first_runs = first_runs;
    __syncthreads();
    if (earlier_timeout || refusal) {
        if (lane == 0) retire_warp(claimed, claim_words);
        return;
    }
    claimed.following = s.first_runs + warp;
    claimed.reserved = s.first_runs + SYNC_WARPS + warp;
    // the warp's first two pieces and their task rows (lane f holds field f), clamped to the
    // table (a row past the count is not used)
    PieceSlot at = next_claimed_piece(claimed, runs, claim_words, chunk_tiles, pieces_per_tile, lane);
    PieceSlot next = next_claimed_piece(claimed, runs, claim_words, chunk_tiles, pieces_per_tile, lane);
    int row = task_row_field<Tables>(tasks, min(at.task, task_rows - 1), lane);
    int next_row = task_row_field<Tables>(tasks, min(next.task, task_rows - 1), lane);

    const u64 flag_value = (epoch << FLAG_WRITER_BITS) | static_cast<u64>(rank);
    unsigned char* const* dst = s.dst[warp];
    int task_id = -1;
    bool ready = true;  // the current task's chunk is there to be read (a relay waits for its flag)
    int dst_begin = -1, dst_end = -1;  // the destination range in s.dst[warp]
    // The task fields (schedule.py) are read from the rows when needed (no registers held for
    // them); the row of the piece after next is read while this one is copied.
    PieceSlot later;
    int later_row = 0;
    for (; at.task < num_tasks; at = next, next = later, row = next_row, next_row = later_row) {
        later = next_claimed_piece(claimed, runs, claim_words, chunk_tiles, pieces_per_tile, lane);
        if (later.task < num_tasks) later_row = task_row_field<Tables>(tasks, later.task, lane);
        if (at.task != task_id) {
            task_id = at.task;
            ready = row_field(row, WAIT_SLOT) < 0;
        }
        // the next piece, if a master's and whole, is prefetched into L2 while this one is copied
        const unsigned char* next_src = nullptr;
        if (next.task < num_tasks && row_field(next_row, WAIT_SLOT) < 0) {
            int next_t;
            i64 next_offset;
            if (locate_piece(s, num_tensors, tile_bytes, next, row_field(next_row, TILE_BEGIN),
                             row_field(next_row, TILE_END), next_t, next_offset) == PIECE_BYTES)
                next_src = source_base(s, src_ptrs, row_field(next_row, SRC_REF) + next_t) + next_offset;
        }
        prefetch_piece_l2(next_src, lane);
        int t;
        i64 offset;
        const int nbytes = locate_piece(s, num_tensors, tile_bytes, at, row_field(row, TILE_BEGIN),
                                        row_field(row, TILE_END), t, offset);
        if (nbytes == 0) continue;
        if (!ready && !(ready = wait_chunk_flag(reinterpret_cast<const u64*>(peer_bases[rank]),
                                                row_field(row, WAIT_SLOT), epoch, timeout_ns, status, lane)))
            break;
        const unsigned char* src = source_base(s, src_ptrs, row_field(row, SRC_REF) + t) + offset;
        const i64 within = s.slot_offset[t] + offset;
        const bool whole = nbytes == PIECE_BYTES && (reinterpret_cast<u64>(src) | static_cast<u64>(within)) % 16 == 0;
        const int dest_begin = row_field(row, DEST_BEGIN), dest_end = row_field(row, DEST_END);
        if (dest_begin != dst_begin || dest_end != dst_end) {  // a source's tasks share their destinations
            dst_begin = dest_begin;
            dst_end = dest_end;
            __syncwarp();  // every lane is done with the previous range
            for (int d = lane; d < dst_end - dst_begin; d += 32)
                s.dst[warp][d] = destination<Tables>(s, dests, peer_bases, dst_begin + d);
            __syncwarp();
        }
        if (whole) {
            uint4 v[PIECE_VECS];
            load_piece(src, v, lane);
            store_whole_piece(dst, dst_end - dst_begin, within, v, lane);
        } else {
            copy_partial_piece(src, dst, dst_end - dst_begin, within, nbytes, lane);
        }
        if (flag_every_chunk || row_field(row, PUBLISH)) {  // count the piece; the warp completing the chunk flags it at every destination
            const int chunk = row_field(row, CHUNK);
            const int chunk_bytes = static_cast<int>(
                tile_range_bytes(s, num_tensors, tile_bytes, row_field(row, TILE_BEGIN), row_field(row, TILE_END)));
            __syncwarp();  // every lane's stores before lane 0's release
            if (lane == 0) fence_gpu();
            if (lane == 0 && atomicAdd(done + task_id, nbytes) + nbytes == chunk_bytes) {
                done[task_id] = 0;
                fence_sys();  // every warp's pieces of this chunk before its flags
                for (int d = dst_begin; d < dst_end; ++d) {
                    const i64* dest = dests + DEST_FIELDS * static_cast<i64>(d);
                    store_relaxed_sys(reinterpret_cast<u64*>(peer_bases[dest[0]]) + dest[2] + chunk, flag_value);
                }
            }
        }
    }
    if (lane == 0) retire_warp(claimed, claim_words);
}

// A weight sync whose tables an earlier launch compiled (compile_weight_tasks); `claims`:
// CLAIM_WORDS, zero between launches.
extern "C" __global__ void __launch_bounds__(SYNC_THREADS, SYNC_MIN_BLOCKS) weight_sync(WEIGHT_COPY_PARAMETERS,
                                                                                        u64* claims) {
    copy_weight_pieces<TablesOfEarlierLaunch>(ClaimWords{claims, claims + LINE_WORDS, nullptr, 0}, nullptr,
                                              WEIGHT_COPY_ARGUMENTS);
}

// The first two blocks to start play the roles (one block does both in a grid of one).
__device__ __forceinline__ int role_blocks() { return gridDim.x > 1 ? 2 : 1; }

// Thread 0 waits (acquire) until the roles are done; false after the timeout, recorded in
// the sync's status as (1, GATE_SLOT, roles, roles seen) unless another wait's is there.
__device__ bool wait_for_roles(const u64* roles_done, u64 timeout_ns, u64* status) {
    const u64 start = global_timer_ns(), roles = static_cast<u64>(role_blocks());
    u64 seen;
    while ((seen = load_acquire_sys(roles_done)) < roles) {
        if (global_timer_ns() - start > timeout_ns) {
            if (atomicCAS(status, 0ull, 1ull) == 0ull) {
                status[1] = static_cast<u64>(static_cast<i64>(GATE_SLOT));
                status[2] = roles;
                status[3] = seen;
            }
            return false;
        }
        __nanosleep(128);
    }
    return true;
}

// A whole weight sync in one launch: the plan agreement (agree.cuh) and the compile of
// this rank's tables (schedule.cuh), then the copy of weight_sync by every block. The
// blocks take tickets as they start, so the agreement (ticket 0) and the compile (ticket
// 1) run on blocks that are running while the others wait for both (no block waits for one
// that may not be resident yet); each block then claims runs of pieces with the others (gate[2]),
// and reads the tables and the verdict with loads that see this launch's stores. The last
// warp to be done claiming zeroes gate[] for the next launch (a block that gave up waiting
// for the roles counts its warps at once). With `agreed_before` set, agree.cu's
// kernel has run the agreement just before on the stream (same arguments, its verdict in the
// status) and ticket 0 skips it: the grid then never holds its SMs while it waits for peers
// (where ranks share a GPU, a late peer's planner, a cluster of whole SMs, could not start
// before that wait timed out). The agreement's arguments come first (agree_on_plan's, then
// agreed_before), then the compile's, then the copy's that the compile has not (the copy's
// epoch is the sync count the compile keeps, its status `sync_status`; the peer tables are
// the same heap's, passed twice so a test can agree alone and copy to many). A gate wait
// that outlasts 2 x timeout_ns (the agreement's waits for its peers end within one) records
// itself there and the block copies nothing.
extern "C" __global__ void __launch_bounds__(SYNC_THREADS, SYNC_MIN_BLOCKS) agree_compile_and_sync_weights(
        const int* agreed_log_to_phys, const int* agreed_replica_count, int agreed_E, int agreed_K, int op, u64 layer,
        const u64* peer_bases, int agreeing_rank, int world, u64 pad, u64* calls, u64 timeout_ns, u64* hashes,
        u64* agreement_status, int agreed_before, COMPILE_WEIGHT_PARAMETERS, int task_rows, const i64* tensor_table,
        i64 tile_bytes, int dest_rows, const u64* src_ptrs, int num_src_ptrs, const u64* copy_peer_bases, int num_ranks,
        int flag_every_chunk, int* done, u64* sync_status, u64* gate) {
    static_assert(AGREE_THREADS == SYNC_THREADS && COMPILE_THREADS == SYNC_THREADS, "one block size for every role");
    __shared__ int ticket_of_block;
    __shared__ bool roles_done;
    if (threadIdx.x == 0) ticket_of_block = static_cast<int>(atomicAdd(gate, 1ull));
    __syncthreads();
    const int ticket = ticket_of_block;
    if (ticket == 0 && !agreed_before)
        agree_on_plan(agreed_log_to_phys, agreed_replica_count, agreed_E, agreed_K, op, layer, peer_bases,
                      agreeing_rank, world, pad, calls, timeout_ns, hashes, agreement_status);
    if (ticket == role_blocks() - 1) compile_weights(COMPILE_WEIGHT_ARGUMENTS);
    __syncthreads();  // the role's stores, by every thread, before thread 0 announces them
    if (threadIdx.x == 0) {
        if (ticket < role_blocks()) {
            __threadfence();
            atomicAdd(gate + 1, 1ull);
        }
        roles_done = wait_for_roles(gate + 1, 2 * timeout_ns, sync_status);
    }
    __syncthreads();
    const ClaimWords claim_words{gate + 2, gate + LINE_WORDS, gate, 2};
    if (roles_done) {
        copy_weight_pieces<TablesOfThisLaunch>(claim_words, agreement_status + STATUS_KIND, tasks,
                                               counts + COUNT_WEIGHT_TASKS, task_rows, chunk_tiles, tensor_table,
                                               num_tensors, tile_bytes, dests, dest_rows, src_ptrs, num_src_ptrs,
                                               copy_peer_bases, num_ranks, rank, weight_syncs, flag_every_chunk, done,
                                               timeout_ns, sync_status);
    } else if (threadIdx.x % WARP == 0) {
        ClaimedPieces none{{0, 0, 0}, 0, 0, NO_RUN, NO_RUN};
        retire_warp(none, claim_words);
    }
}

// A reader's wait for its replica slots [first_slot, first_slot + gridDim.x) (block b: slot
// first_slot + b): every chunk flag of the slot, in this rank's own pad, reaches `epoch`;
// the senders store each flag with release semantics after the chunk's bytes (weight_sync
// with flag_every_chunk), and the acquiring loads here order the kernels after this one on
// the stream behind them. A slot the plan leaves empty (phys_to_log[slot_index(b)] < 0) has
// nothing to wait for. A wait that outlasts timeout_ns records (1, layer, slot, chunk,
// expected epoch, seen) in status, says so once on stdout, and gives up; the host raises it.
extern "C" __global__ void __launch_bounds__(WAIT_THREADS)
wait_replica_slots(const u64* pad, i64 flag_base_slot, int num_chunks, int first_slot, u64 epoch,
                   const int* phys_to_log, int first_phys, int rank, int layer, u64 timeout_ns, u64* status) {
    const int slot = first_slot + static_cast<int>(blockIdx.x);
    if (phys_to_log[first_phys + slot] < 0) return;
    const u64* flags = pad + flag_base_slot + static_cast<i64>(slot) * num_chunks;
    for (int chunk = threadIdx.x; chunk < num_chunks; chunk += blockDim.x) {
        const u64 start = global_timer_ns();
        u64 seen;
        while (((seen = load_acquire_sys(flags + chunk)) >> FLAG_WRITER_BITS) < epoch) {
            if (*reinterpret_cast<volatile u64*>(status)) return;  // one report is enough
            if (global_timer_ns() - start > timeout_ns) {
                if (atomicCAS(status, 0ull, 1ull) == 0ull) {
                    status[1] = static_cast<u64>(layer);
                    status[2] = static_cast<u64>(slot);
                    status[3] = static_cast<u64>(chunk);
                    status[4] = epoch;
                    status[5] = seen;
                    printf("ultraep: rank %d waited over %llu ms for replica slot %d of layer %d (chunk %d: flag "
                           "epoch %llu expected, saw %llu)\n", rank, timeout_ns / 1000000ull, slot, layer, chunk,
                           epoch, seen >> FLAG_WRITER_BITS);
                }
                return;
            }
            __nanosleep(128);
        }
    }
}

// Gradient reduction, one task per block iteration (static assignment: the arithmetic
// order per element is fixed by the task, not by scheduling): master tile in fp32, plus
// each replica's tile in replica order, rounded once. Plain adds: no FMA can contract them.
// A task's destination and source pointers are read once into shared memory; where they
// and the length allow, each thread moves 16-byte vectors, REDUCE_VECTORS of them in
// flight, else single elements (the same sums either way). Threads stride by blockDim.x,
// so any block works; the host launches REDUCE_THREADS.
#define REDUCE_THREADS 256
#define REDUCE_VECTORS 4          // 16-byte vectors per thread per source in flight
#define REDUCE_CACHED_SOURCES 64  // a task's sources kept in shared memory; a task with more takes the element path
template <typename T>
__global__ void __launch_bounds__(REDUCE_THREADS)
reduce_grads(const i64* __restrict__ tasks, const int* __restrict__ task_count, const i64* __restrict__ srcs,
             const u64* __restrict__ dst_ptrs, const u64* __restrict__ peer_bases) {
    constexpr int N = Vector<T>::N;
    __shared__ const T* source[REDUCE_CACHED_SOURCES];
    const int num_tasks = *task_count;  // written on the device by the schedule compiler
    for (int t = blockIdx.x; t < num_tasks; t += gridDim.x) {
        const i64* task = tasks + GRAD_TASK_FIELDS * static_cast<i64>(t);
        T* dst = reinterpret_cast<T*>(dst_ptrs[task[0]] + task[1]);
        const i64 bytes = task[2], first_source = task[3];
        const int sources = static_cast<int>(task[4] - first_source);
        __syncthreads();  // the previous task's reads of source[] are done
        int element_path = threadIdx.x == 0 && (sources > REDUCE_CACHED_SOURCES ||
                                                ((reinterpret_cast<u64>(dst) | static_cast<u64>(bytes)) & 15));
        for (int s = threadIdx.x; s < sources && s < REDUCE_CACHED_SOURCES; s += blockDim.x) {
            const i64* entry = srcs + GRAD_SRC_FIELDS * (first_source + s);  // rank, heap offset
            const u64 address = peer_bases[entry[0]] + entry[1];
            source[s] = reinterpret_cast<const T*>(address);
            element_path |= (address & 15) != 0;
        }
        if (!__syncthreads_or(element_path)) {
            uint4* out = reinterpret_cast<uint4*>(dst);
            const i64 vectors = bytes / 16;
            for (i64 v0 = threadIdx.x; v0 < vectors; v0 += static_cast<i64>(blockDim.x) * REDUCE_VECTORS) {
                float acc[REDUCE_VECTORS][N];
#pragma unroll
                for (int u = 0; u < REDUCE_VECTORS; ++u) {
                    const i64 v = v0 + static_cast<i64>(u) * blockDim.x;
                    if (v < vectors) Vector<T>::to_float(out[v], acc[u]);
                }
                for (int s = 0; s < sources; ++s) {
                    const uint4* in = reinterpret_cast<const uint4*>(source[s]);
                    uint4 loaded[REDUCE_VECTORS];
#pragma unroll
                    for (int u = 0; u < REDUCE_VECTORS; ++u) {
                        const i64 v = v0 + static_cast<i64>(u) * blockDim.x;
                        if (v < vectors) loaded[u] = __ldcg(in + v);
                    }
#pragma unroll
                    for (int u = 0; u < REDUCE_VECTORS; ++u) {
                        float add[N];
                        Vector<T>::to_float(loaded[u], add);
#pragma unroll
                        for (int j = 0; j < N; ++j) acc[u][j] = __fadd_rn(acc[u][j], add[j]);
                    }
                }
#pragma unroll
                for (int u = 0; u < REDUCE_VECTORS; ++u) {
                    const i64 v = v0 + static_cast<i64>(u) * blockDim.x;
                    if (v < vectors) out[v] = Vector<T>::from_float(acc[u]);
                }
            }
            continue;
        }
        const i64 count = bytes / static_cast<i64>(sizeof(T));
        for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
            float acc = as_float(dst[i]);
            for (int s = 0; s < sources; ++s) {
                const i64* entry = srcs + GRAD_SRC_FIELDS * (first_source + s);
                const T* in = reinterpret_cast<const T*>(peer_bases[entry[0]] + entry[1]);
                acc = __fadd_rn(acc, as_float(__ldcg(in + i)));
            }
            T rounded;
            round_to(acc, rounded);
            dst[i] = rounded;
        }
    }
}

// Whole replica slots moved only where the plan fills them, the plan read on the device (no
// host round trip; an empty slot costs its blocks one load). Row z of `rows` (SLOT_COPY_FIELDS
// int64s: source, source slot stride, destination, destination slot stride, bytes per slot)
// moves slot y = blockIdx.y's bytes when filled[y] >= 0 (this rank's phys_to_log entries of
// its replica slots); a null source writes zeros. Blocks along x stride over the bytes: in
// 16-byte words where both sides and the length allow, else byte by byte.
#define SLOT_COPY_FIELDS 5
#define SLOT_COPY_THREADS 256
extern "C" __global__ void __launch_bounds__(SLOT_COPY_THREADS)
copy_filled_slots(const int* filled, const i64* rows) {
    if (filled[blockIdx.y] < 0) return;
    const i64* row = rows + SLOT_COPY_FIELDS * static_cast<i64>(blockIdx.z);
    const u64 src_base = static_cast<u64>(row[0]);
    const unsigned char* src = src_base ? reinterpret_cast<const unsigned char*>(src_base + blockIdx.y * row[1]) : nullptr;
    unsigned char* dst = reinterpret_cast<unsigned char*>(static_cast<u64>(row[2]) + blockIdx.y * row[3]);
    const i64 bytes = row[4];
    const i64 first = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 step = static_cast<i64>(gridDim.x) * blockDim.x;
    if (((reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst) | static_cast<u64>(bytes)) & 15) == 0) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (i64 i = first; i < bytes / 16; i += step)
            reinterpret_cast<uint4*>(dst)[i] = src ? __ldcs(reinterpret_cast<const uint4*>(src) + i) : zero;
    } else {
        for (i64 i = first; i < bytes; i += step) dst[i] = src ? src[i] : 0;
    }
}
