// What every grouped GEMM kernel shares: the input contract's limits, the bad-offsets
// codes the host words (ultraep/compute/checks.py), and the device-side reading of the
// expert offsets: loaded and checked by every block alike, then a prefix of tiles per
// expert that a persistent block walks in one fixed order.
#pragma once

#include <cuda_bf16.h>

#include "sync.cuh"

#define GG_MAX_EXPERTS 1024
// K and N must be multiples of this: rows of whole 16-byte chunks (cp.async, and TMA's
// global strides).
#define GG_ALIGN_ELEMENTS 8

// status[0] codes (ultraep/compute/grouped_gemm.py words them); status[1..3] = index, value, rows.
#define GG_OK 0
#define GG_FIRST_OFFSET_NOT_ZERO 1
#define GG_OFFSETS_DECREASE 2
#define GG_OFFSETS_PAST_ROWS 3

#define WARP 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ long long offset_at(const void* offsets, int offsets_are_64bit, int i) {
    return offsets_are_64bit ? static_cast<const long long*>(offsets)[i] : static_cast<const int*>(offsets)[i];
}

// Block 0 records the first bad entry, read again from global memory at full width (the
// host checks status after the stream's work).
__device__ void report_offsets(const void* offsets, int offsets_are_64bit, int experts, long long rows,
                               long long* status) {
    long long code = GG_OK, index = 0, previous = 0;
    for (int i = 0; i <= experts && code == GG_OK; ++i) {
        const long long v = offset_at(offsets, offsets_are_64bit, i);
        if (i == 0 && v != 0) code = GG_FIRST_OFFSET_NOT_ZERO;
        else if (v < previous) code = GG_OFFSETS_DECREASE;
        else if (v > rows) code = GG_OFFSETS_PAST_ROWS;
        index = i, previous = v;
    }
    unsigned long long* word = reinterpret_cast<unsigned long long*>(status);
    if (code != GG_OK && atomicCAS(word, 0ull, static_cast<unsigned long long>(code)) == 0ull) {  // the first error is kept
        status[1] = index;
        status[2] = previous;
        status[3] = rows;
    }
}

// The offsets into shared `off` (all threads of the block call this). Every block reaches
// the same verdict from the same values: false on a bad array (block 0 has then recorded
// it), and the caller must write nothing. Values in [0, rows] fit an int (the host keeps
// rows below 2^31), so the tile arithmetic is 32-bit.
__device__ bool load_offsets(int* off, const void* offsets, int offsets_are_64bit, int experts, long long rows,
                             long long* status) {
    bool bad = false;
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) {
        const long long v = offset_at(offsets, offsets_are_64bit, i);
        bad |= v < 0 || v > rows;
        off[i] = static_cast<int>(v);
    }
    __syncthreads();
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) bad |= i == 0 ? off[0] != 0 : off[i] < off[i - 1];
    if (__syncthreads_or(bad)) {
        if (blockIdx.x == 0 && threadIdx.x == 0) report_offsets(offsets, offsets_are_64bit, experts, rows, status);
        return false;
    }
    return true;
}

// Warp 0: tile_start[e] = tiles of the experts before e (m-tiles of `block_rows` rows times
// `n_tiles`), tile_start[experts] = all tiles. The caller synchronises before reading it.
__device__ void tile_prefix(int* tile_start, const int* off, int experts, int block_rows, int n_tiles) {
    const int lane = threadIdx.x % WARP;
    const int per_lane = (experts + WARP - 1) / WARP;
    const int first = min(lane * per_lane, experts), last = min(first + per_lane, experts);
    int sum = 0;
    for (int e = first; e < last; ++e) sum += ceil_div(off[e + 1] - off[e], block_rows) * n_tiles;
    int inclusive = sum;
#pragma unroll
    for (int d = 1; d < WARP; d *= 2) {
        const int v = __shfl_up_sync(FULL_MASK, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    int running = inclusive - sum;
    for (int e = first; e < last; ++e) {
        tile_start[e] = running;
        running += ceil_div(off[e + 1] - off[e], block_rows) * n_tiles;
    }
    if (lane == WARP - 1) tile_start[experts] = inclusive;
}

// The expert that owns tile `tile`: the last e whose first tile is <= tile.
__device__ __forceinline__ int expert_of_tile(const int* tile_start, int experts, int tile) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Tile `local` of one expert's m_tiles x n_tiles grid, as (m, n), in groups of GG_GROUP_M
// m-tiles: every n-tile of a group before the next group. The blocks running at once then
// share a few m-tiles of A and a slice of B, which stay in L2 together, where walking all
// m-tiles of one n-tile would stream the expert's whole A from HBM once per n-tile.
#define GG_GROUP_M 8
__device__ __forceinline__ int2 grouped_raster(int local, int m_tiles, int n_tiles) {
    const int per_group = GG_GROUP_M * n_tiles, group = local / per_group;
    const int first = group * GG_GROUP_M, in_group = local - group * per_group;
    const int rows = min(GG_GROUP_M, m_tiles - first);
    return make_int2(first + in_group % rows, in_group / rows);
}

// -- The Hopper tile machinery (grouped_gemm.cu and fused_moe.cu) ------------------------------

#define GH_BM 128
#define GH_BN 256
#define GH_BK 64
// grouped_gemm.cu's GG_RING_STAGED schedule compiles with a deeper ring; the fused kernels
// always take this one.
#ifndef GH_STAGES
#define GH_STAGES 3
#endif
#define GH_CONSUMERS 2
#define GH_THREADS (128 * (1 + GH_CONSUMERS))
// Operand tiles are copied in boxes of 64 elements along their contiguous dimension: a box
// row may span at most the 128 bytes of the swizzle.
#define GH_BOX 64
#define GH_BOX_BYTES (GH_BOX * GH_BK * 2)
#define GH_A_BYTES (GH_BM * GH_BK * 2)
#define GH_B_BYTES (GH_BN * GH_BK * 2)
#define GH_STAGE_BYTES (GH_A_BYTES + GH_B_BYTES)
// A BF16 output tile staged for the store warps: rows padded by 16 bytes, so the
// consumers' fragment writes (8 rows x 4 lanes of 4 bytes) hit 32 different banks.
#define GH_C_PITCH (GH_BN * 2 + 16)
#define GH_C_BYTES (GH_BM * GH_C_PITCH)
// The swizzled stages must start on a 1024-byte boundary (the swizzle pattern repeats
// every 8 rows of 128 bytes); the slack lets the kernel round the dynamic base up.
#define GH_SMEM_BYTES (GH_STAGES * GH_STAGE_BYTES + GH_C_BYTES + 1024)

// A ring-staged BF16 output tile (grouped_gemm.cu's GG_RING_STAGED schedule, the fused kernels
// B and D) lies in the stage of its last k-step, held by the consumers, for its first
// GH_STAGE_BLOCKS column blocks and in a GH_TAIL_BYTES tail for the rest: column blocks of
// 64, 128 rows of 128 bytes each, 16-byte chunk c of row r at chunk c ^ (r % 8), so a
// consumer warp's fragment write (8 rows x 4 lanes of 4 bytes) and a store warp's read (8
// lanes x 16 bytes of one row) both hit 32 different banks.
#define GH_BLOCK_COLS 64
#define GH_BLOCK_BYTES (GH_BM * GH_BLOCK_COLS * 2)
#define GH_STAGE_BLOCKS (GH_STAGE_BYTES / GH_BLOCK_BYTES)
#define GH_TAIL_BYTES (GH_BN / GH_BLOCK_COLS * GH_BLOCK_BYTES - GH_STAGE_BYTES)

static_assert(GH_STAGE_BYTES % GH_BLOCK_BYTES == 0 && GH_TAIL_BYTES > 0, "a stage holds whole blocks, not a tile");

// setmaxnreg: 128 x 40 + 256 x 232 = the 384 x 168 registers the launch reserves
// (grouped_gemm.cu's GG_RING_STAGED schedule compiles with another split).
#ifndef GH_PRODUCER_REGISTERS
#define GH_PRODUCER_REGISTERS 40
#define GH_CONSUMER_REGISTERS 232
#endif
// Warpgroup 0: warp 0 copies operands, the other three store output tiles.
#define GH_STORE_WARPS 3
// The host encodes the tensor maps with these (CUtensorMap is 128 opaque bytes).
#define GH_TENSOR_MAP_BYTES 128

// status[0] when a pipeline wait gave up (after grouped_gemm_common.cuh's offsets codes),
// and what it waited for in status[1] (ultraep/compute/device.py words them).
#define GH_STAGE_TIMED_OUT 4
#define GH_WAITED_FOR_CONSUMERS 1
#define GH_WAITED_FOR_COPIES 2
#define GH_WAITED_FOR_OUTPUT 3
#define GH_WAITED_FOR_STORES 4
#define GH_WAITED_FOR_TILE 5     // grouped_gemm.cu's tile queue: a reader for the next tile index
#define GH_WAITED_FOR_READERS 6  // the producer for a queue slot every reader has taken

#define GH_FORWARD 0
#define GH_DGRAD 1
#define GH_WGRAD 2

typedef __nv_bfloat16 bf16;

static_assert(GH_BK * 2 == 128, "a k-step of A is one 128-byte swizzle row");
static_assert(GH_BM == 64 * GH_CONSUMERS, "each consumer warpgroup owns 64 rows");
static_assert(GH_BN == 256 && GH_BK == GH_BOX && GH_BM == 2 * GH_BOX, "the MMA is m64n256k16, boxes are 64 wide");

struct __align__(64) TensorMap {
    unsigned long long opaque[GH_TENSOR_MAP_BYTES / 8];
};

// -- TMA, wgmma and register hand-over ------------------------------------------------------

__device__ __forceinline__ void expect_bytes(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_address(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, u64* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1),
                    "r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
                    "r"(shared_address(bar)) : "memory");
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand at shared address `addr`:
// `leading` and `stride` are the byte offsets wgmma steps by (K-major: stride = next 8
// rows, leading unused; MN-major: leading = next 64-element swizzle atom along M/N,
// stride = next 8 rows along K).
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned addr, unsigned leading, unsigned stride) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           static_cast<unsigned long long>(leading >> 4) << 16 | static_cast<unsigned long long>(stride >> 4) << 32 |
           1ull << 62;
}

// This thread's generic-proxy accesses to shared memory ordered before later async-proxy
// ones (TMA copies, wgmma operand reads) that the block orders after them.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory"); }

#define GH_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define GH_D32(i) GH_D8(i), GH_D8(i + 8), GH_D8(i + 16), GH_D8(i + 24)

// d += A (64 x 16) x B (16 x 256), FP32; A is K-major, or M-major when TRANS_A; B K-major,
// or N-major when TRANS_B.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
        "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, "
        "%67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, "
        "%89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "
        "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
        "%127}, %128, %129, p, 1, 1, %130, %131;\n}\n"
        : GH_D32(0), GH_D32(32), GH_D32(64), GH_D32(96)
        : "l"(a), "l"(b), "n"(TRANS_A), "n"(TRANS_B), "r"(1));  // p: accumulate into d
}

// A stage wait that gives up. Any function call in this kernel (the out-of-line report of
// sync.cuh's mbarrier_wait, printf) makes ptxas serialise every wgmma, and so does a
// consumer leaving its loop on a path of its own; so a wait that runs out of time records
// itself in status for the host (unless an earlier record is there) and sets `gave_up`:
// the producer then stops, the consumers run on without waiting (their results are
// garbage, the host raises; the grouped GEMM's leave together at their next tile).
// status[1] is what it waited for (GH_WAITED_*), status[2] the block, status[3] the
// timeout in ms (record_stage_timeout).
__device__ __forceinline__ void record_stage_timeout(long long* status, int what) {
    unsigned long long* word = reinterpret_cast<unsigned long long*>(status);
    if (atomicCAS(word, 0ull, static_cast<unsigned long long>(GH_STAGE_TIMED_OUT)) == 0ull) {
        status[1] = what;
        status[2] = blockIdx.x;
        status[3] = static_cast<long long>(MBARRIER_TIMEOUT_NS / 1000000ull);
    }
}

__device__ __forceinline__ void stage_wait(u64* bar, unsigned parity, long long* status, int what, bool& gave_up) {
    const unsigned address = shared_address(bar);
    if (gave_up || mbarrier_try_wait<false>(address, parity)) return;
    const u64 start = global_timer_ns();
    while (!mbarrier_try_wait<false>(address, parity)) {
        if (global_timer_ns() - start > MBARRIER_TIMEOUT_NS) {
            record_stage_timeout(status, what);
            gave_up = true;
            return;
        }
    }
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" :: "n"(128 * GH_CONSUMERS) : "memory"); }

// One output tile: expert, first output row and the end of its rows (the expert's end, or
// K in wgrad), first output column, and the reduction's start and length.
struct Tile {
    int expert, row0, row_end, col0, red0, red_len;
};

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* p, float v0, float v1) {
    if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    } else {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
    }
}


// Operands (a_map, b_map tensor maps; the reduction dimension is r):
//   forward  A = x [M, K] as (K, M), box 64 x 128: K-major.  B = w as (N, K, E), boxes 64 x 64 x 1: N-major.
//   dgrad    A = dy [M, N] as (N, M), box 64 x 128: K-major. B = w as (N, K, E), box 64 x 256 x 1: K-major.
//   wgrad    A = x [M, K] as (K, M), boxes 64 x 64: M-major. B = dy [M, N] as (N, M), boxes 64 x 64: N-major.
// An N-major B is four boxes of 64 reduction rows x 64 columns, an M-major A two of 64
// reduction rows x 64 output rows (one per consumer). Boxes wholly past the output's
// columns (or wgrad's K rows) are not copied: nothing is stored from them.
// Where K and N are multiples of 64, wgrad's maps are 3-D instead, x as (64, M, K / 64) and
// dy as (64, M, N / 64) (64-column blocks side by side, 128 bytes apart), and each operand of
// a k-step is one box of 64 x 64 x 2 (A) or 64 x 64 x 4 (B): the same stage, two copies
// instead of six, blocks past K or N filled with zeros. (The 128-byte swizzle caps a box row
// at 64 elements; a partial last block would read past the array's end, hence the 2-D maps.)

// The producer thread's k-steps of one tile into the stage ring (STAGES deep): `a_boxes` boxes of an
// M-major A (wgrad), the N-major B boxes named in `b_box_mask`, box j at column
// tile.col0 + 64 j, plus `b_split` for the upper half (j >= 2: the fused up-projection's
// up columns, F further than its gate columns); or, ONE_BOX_EACH (wgrad's 3-D maps), one
// box per operand. False when a stage wait gave up.
template <int MODE, bool ONE_BOX_EACH = false, int STAGES = GH_STAGES>
__device__ __forceinline__ bool load_tile(const TensorMap* a_map, const TensorMap* b_map, const Tile& tile, int a_boxes,
                                          unsigned b_box_mask, int b_split, unsigned stages, u64* full, u64* empty,
                                          int& step, long long* status, bool& gave_up) {
    constexpr bool A_BOXES = MODE == GH_WGRAD, B_BOXES = MODE != GH_DGRAD;
    static_assert(!ONE_BOX_EACH || MODE == GH_WGRAD, "only wgrad's maps are 3-D");
    const unsigned bytes = ONE_BOX_EACH ? GH_STAGE_BYTES  // boxes past the tensor count in full, as zeros
                                        : (A_BOXES ? a_boxes * GH_BOX_BYTES : GH_A_BYTES) +
                                              (B_BOXES ? __popc(b_box_mask) * GH_BOX_BYTES : GH_B_BYTES);
    const int k_steps = ceil_div(tile.red_len, GH_BK);
    for (int k = 0; k < k_steps; ++k, ++step) {
        const int s = step % STAGES;
        stage_wait(&empty[s], ((step / STAGES) & 1) ^ 1, status, GH_WAITED_FOR_CONSUMERS, gave_up);
        if (gave_up) return false;
        expect_bytes(&full[s], bytes);
        const unsigned a = stages + s * GH_STAGE_BYTES, b = a + GH_A_BYTES;
        const int r = tile.red0 + k * GH_BK;
        if constexpr (ONE_BOX_EACH) {
            tma_load_3d(a, a_map, &full[s], 0, r, tile.row0 / GH_BOX);
            tma_load_3d(b, b_map, &full[s], 0, r, tile.col0 / GH_BOX);
        } else if constexpr (MODE == GH_WGRAD) {
            for (int j = 0; j < a_boxes; ++j)
                tma_load_2d(a + j * GH_BOX_BYTES, a_map, &full[s], tile.row0 + j * GH_BOX, r);
            for (int j = 0; j < GH_BN / GH_BOX; ++j)
                if (b_box_mask >> j & 1) tma_load_2d(b + j * GH_BOX_BYTES, b_map, &full[s], tile.col0 + j * GH_BOX, r);
        } else if constexpr (MODE == GH_FORWARD) {
            tma_load_2d(a, a_map, &full[s], r, tile.row0);
            for (int j = 0; j < GH_BN / GH_BOX; ++j)
                if (b_box_mask >> j & 1)
                    tma_load_3d(b + j * GH_BOX_BYTES, b_map, &full[s], tile.col0 + j * GH_BOX +
                                (j >= GH_BN / GH_BOX / 2 ? b_split : 0), r, tile.expert);
        } else {
            tma_load_2d(a, a_map, &full[s], r, tile.row0);
            tma_load_3d(b, b_map, &full[s], r, tile.col0, tile.expert);
        }
    }
    return true;
}

// One wgrad k-step's batch of MMAs, its first K16_STEPS k16 steps: A (M-major) and B
// (N-major) both 16 reduction rows, 2 swizzle atoms, further each.
template <int K16_STEPS>
__device__ __forceinline__ void wgrad_k16_steps(float (&d)[128], unsigned a, unsigned b, int consumer) {
    static_assert(K16_STEPS >= 1 && K16_STEPS <= GH_BK / 16, "a k-step holds GH_BK / 16 k16 steps");
    wgmma_fence();
#pragma unroll
    for (int k16 = 0; k16 < K16_STEPS; ++k16)
        wgmma_m64n256k16<1, 1>(d, smem_descriptor(a + consumer * GH_BOX_BYTES + k16 * 2048, GH_BOX_BYTES, 1024),
                               smem_descriptor(b + k16 * 2048, GH_BOX_BYTES, 1024));
    wgmma_commit();
}

// A consumer warpgroup's MMAs of one tile (stage ring STAGES deep): d = its 64 rows x GH_BN
// columns, summed over the reduction in GH_BK chunks in ascending order, each releasing its stage once the next
// chunk's MMAs are issued. !RELEASE_LAST: the last chunk's stage stays held (its release
// is then the caller's: grouped_gemm.cu stages an output tile in it).
template <int MODE, bool RELEASE_LAST = true, int STAGES = GH_STAGES>
__device__ __forceinline__ void mma_tile(float (&d)[128], const Tile& tile, unsigned stages, u64* full, u64* empty,
                                         int& step, int consumer, int lane, long long* status, bool& gave_up) {
    const int k_steps = ceil_div(tile.red_len, GH_BK);
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    for (int k = 0; k < k_steps; ++k, ++step) {
        const int s = step % STAGES;
        stage_wait(&full[s], (step / STAGES) & 1, status, GH_WAITED_FOR_COPIES, gave_up);
        const unsigned a = stages + s * GH_STAGE_BYTES, b = a + GH_A_BYTES;
        if constexpr (MODE == GH_WGRAD) {
            // The expert's last chunk may end early: its rows past the end (the next expert's)
            // must count as zeros. Only its k16 steps holding rows of the expert run (the others
            // would add exact zeros), and the last of those is cleared from the end on in every
            // copied box, whole 128-byte lines (the swizzle permutes chunks within a line),
            // before the MMAs read it.
            const int valid = tile.red_len - k * GH_BK;
            const int k16_steps = valid >= GH_BK ? GH_BK / 16 : ceil_div(valid, 16);
            const int lines = k16_steps * 16 - min(valid, GH_BK);
            if (lines > 0) {
                constexpr int LINE_CHUNKS = (GH_BM / GH_BOX + GH_BN / GH_BOX) * 8;  // a line across every box
                for (int i = threadIdx.x - 128; i < lines * LINE_CHUNKS; i += 128 * GH_CONSUMERS) {
                    const int line = valid + i / LINE_CHUNKS, box = i % LINE_CHUNKS / 8, chunk = i % 8;
                    const unsigned at = a + box * GH_BOX_BYTES + line * 128 + chunk * 16;  // B follows A's boxes
                    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(at), "r"(0) : "memory");
                }
                fence_proxy_async_shared();  // seen by the MMAs
                consumers_sync();
            }
            // A batch per count: a wgmma that may or may not run inside a batch makes ptxas
            // serialise every wgmma of the kernel.
            if (k16_steps == 4) wgrad_k16_steps<4>(d, a, b, consumer);
            else if (k16_steps == 3) wgrad_k16_steps<3>(d, a, b, consumer);
            else if (k16_steps == 2) wgrad_k16_steps<2>(d, a, b, consumer);
            else wgrad_k16_steps<1>(d, a, b, consumer);
        } else {
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < GH_BK / 16; ++k16) {
                // A: 16 elements of K further within the 128-byte row.
                const unsigned long long da = smem_descriptor(a + consumer * 64 * 128 + k16 * 32, 16, 1024);
                if constexpr (MODE == GH_FORWARD) {
                    wgmma_m64n256k16<0, 1>(d, da, smem_descriptor(b + k16 * 2048, GH_BOX_BYTES, 1024));
                } else {
                    wgmma_m64n256k16<0, 0>(d, da, smem_descriptor(b + k16 * 32, 16, 1024));
                }
            }
            wgmma_commit();
        }
        wgmma_wait<1>();  // the previous step's MMAs are done: its stage may be refilled
        if (k > 0 && lane == 0) mbarrier_arrive(&empty[(step + STAGES - 1) % STAGES]);
    }
    wgmma_wait<0>();
    if (RELEASE_LAST && k_steps > 0 && lane == 0) mbarrier_arrive(&empty[(step + STAGES - 1) % STAGES]);
}

// The store warps' part of an epilogue: the tile staged in shared memory (GH_C_PITCH bytes
// a row, COLS columns of T) to `out` (row pitch `pitch` elements) in 16-byte chunks, masked
// to the tile's rows and to columns below `col_end` (a multiple of 16 bytes' worth); `id` is
// the thread's index among the store warps.
template <int COLS, typename T = bf16>
__device__ __forceinline__ void store_staged_tile(unsigned staged, const Tile& tile, T* out, long long pitch,
                                                  int col_end, int id) {
    constexpr int PER_CHUNK = 16 / sizeof(T), CHUNKS = COLS / PER_CHUNK;
    for (int i = id; i < GH_BM * CHUNKS; i += GH_STORE_WARPS * WARP) {
        const int row = i / CHUNKS, chunk = i % CHUNKS;
        const int r = tile.row0 + row, c = tile.col0 + chunk * PER_CHUNK;
        if (r < tile.row_end && c < col_end) {
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(staged + row * GH_C_PITCH + chunk * 16));
            *reinterpret_cast<uint4*>(out + r * pitch + c) = v;
        }
    }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a ring-staged column block.
__device__ __forceinline__ unsigned swizzled_chunk(int row, int chunk) {
    return row * (GH_BLOCK_COLS * 2) + ((chunk ^ (row & 7)) * 16);
}

// Store warp w's share of the GH_CONSUMERS * 4 arrivals that release a stage.
__device__ __forceinline__ unsigned store_warp_arrivals(int w) {
    return GH_CONSUMERS * 4 * (w + 1) / GH_STORE_WARPS - GH_CONSUMERS * 4 * w / GH_STORE_WARPS;
}

// A consumer's rows of a ring-staged BF16 tile (accumulators as mma_tile leaves them): column block
// b at stage + b * GH_BLOCK_BYTES for b < GH_STAGE_BLOCKS, the others in the tail.
__device__ __forceinline__ void stage_in_ring(const float (&d)[128], unsigned stage, unsigned tail, int row, int lane) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < GH_BN / 8; ++j) {
            const int block = j / (GH_BLOCK_COLS / 8);
            const unsigned base = block < GH_STAGE_BLOCKS ? stage + block * GH_BLOCK_BYTES
                                                          : tail + (block - GH_STAGE_BLOCKS) * GH_BLOCK_BYTES;
            const __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
            asm volatile("st.shared.b32 [%0], %1;"
                         :: "r"(base + swizzled_chunk(row + 8 * half, j % (GH_BLOCK_COLS / 8)) + 4 * (lane % 4)),
                            "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
        }
}

// A store warp's hand-back of the stage a ring-staged tile was read from (`empty`, its barrier):
// its reads ordered before the TMA copy that overwrites the stage, then its share of the
// consumer warps' arrivals, which mma_tile left out.
__device__ __forceinline__ void hand_stage_back(u64* empty, int id, int lane) {
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) mbarrier_arrive_count(empty, store_warp_arrivals(id / WARP));
}

// The store warps' part of a ring-staged epilogue: BLOCKS column blocks from `base`, the first
// at output column `col0`, to `out` (row pitch out_cols), masked to the tile's rows and to
// columns below out_cols; ZEROS: zeros instead, nothing read (a tile with no reduction). Eight
// lanes take a 128-byte row, a warp 4 rows at a time; each lane keeps UNROLL chunks in flight.
template <int BLOCKS, bool ZEROS = false>
__device__ __forceinline__ void store_ring_blocks(unsigned base, int col0, const Tile& tile, bf16* out, int out_cols,
                                                  int id) {
    constexpr int ROW_STEP = GH_STORE_WARPS * WARP / 8, UNROLL = 2;
    const int chunk = id % 8, first_row = id / 8, rows = min(GH_BM, tile.row_end - tile.row0);
    const long long row_step = static_cast<long long>(ROW_STEP) * out_cols;
#pragma unroll
    for (int b = 0; b < BLOCKS; ++b) {
        const int c = col0 + b * GH_BLOCK_COLS + chunk * 8;
        if (c >= out_cols) break;  // and so are the further blocks' columns
        const unsigned block = base + b * GH_BLOCK_BYTES;
        bf16* at = out + static_cast<long long>(tile.row0 + first_row) * out_cols + c;
#pragma unroll 1
        for (int row = first_row; row < rows; row += UNROLL * ROW_STEP, at += UNROLL * row_step) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                v[u] = make_uint4(0, 0, 0, 0);
                if (!ZEROS && row + u * ROW_STEP < rows)
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                                 : "r"(block + swizzled_chunk(row + u * ROW_STEP, chunk)));
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (row + u * ROW_STEP < rows) *reinterpret_cast<uint4*>(at + u * row_step) = v[u];
        }
    }
}
