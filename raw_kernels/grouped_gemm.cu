// Padding-free grouped BF16 GEMM over expert-major rows for Hopper (sm_90a): forward,
// dgrad and wgrad, FP32 accumulation, BF16 or FP32 output. ultraep/compute/device.py
// launches them (compiled with -arch=sm_90a: wgmma and setmaxnreg exist only there).
//
//   forward  Y[rows_e]  = X[rows_e] @ W_e          x [M, K], w [E, K, N], y  [M, N]
//   dgrad    dX[rows_e] = dY[rows_e] @ W_e^T       dy [M, N], w [E, K, N], dx [M, K]
//   wgrad    dW_e       = X[rows_e]^T @ dY[rows_e] x [M, K], dy [M, N],   dw [E, K, N]
//
// rows_e = [offsets[e], offsets[e+1]), read and checked on the device by every block
// (grouped_gemm_common.cuh): on a bad array no block writes anything. One persistent
// block per SM walks the tiles t = blockIdx.x, + gridDim.x, ... of one fixed order:
// expert, then n-tile, then m-tile, so the blocks running at once share a slice of the
// n-side operand and each m-side tile is read by neighbours at about the same time (L2).
//
// A block is three warpgroups. In warpgroup 0, which gives most of its registers away
// (setmaxnreg), one thread is the producer: it copies the operand tiles of each k-step by
// TMA (tensor maps encoded on the host, 128-byte swizzle) into a GH_STAGES-deep ring of
// shared-memory stages, each with a "full" mbarrier (TMA bytes arrive) and an "empty" one
// (the consumers are done); its three other warps store BF16 output tiles that the
// consumers staged in shared memory, while the consumers go on with the next tile.
// Warpgroups 1 and 2 are the consumers: each owns 64 rows x GH_BN columns of the
// GH_BM x GH_BN tile and multiplies with wgmma.mma_async m64n256k16 straight from the
// swizzled stages, one k-step of MMAs in flight. FP32 output is stored by the consumers.
//
// Forward/dgrad tiles never straddle experts, and the input is not padded: a tile starts
// at its expert's first row plus a multiple of GH_BM; rows past the expert's end are loaded
// (the next expert's rows, or zeros past the tensor) but never stored, and a row's
// accumulators depend on its own row of A only. A wgrad tile is GH_BM rows of K by GH_BN
// columns of N of one expert, reduced over the expert's rows from its first in GH_BK
// chunks; in the last chunk, rows past the expert's end are cleared in shared memory
// before the MMAs (an empty expert's dW_e is all zeros). Columns past the output's and
// the reduction past its end (K or N) are zeros filled in by TMA.
//
// Determinism: every output element is one sum in GH_BK chunks in ascending order, each
// chunk four k16 MMAs in ascending k, with no split-K and no atomics. A row's forward or
// dgrad result depends only on its own row and the weights, never on which rows share its
// tile or where its expert starts; a dW_e only on the expert's rows, not where they start.
//
//! kernels: grouped_mm_forward<__nv_bfloat16>, grouped_mm_forward<float>
//! kernels: grouped_mm_dgrad<__nv_bfloat16>, grouped_mm_dgrad<float>
//! kernels: grouped_mm_wgrad<__nv_bfloat16>, grouped_mm_wgrad<float>
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"
#include "sync.cuh"

#define GH_BM 128
#define GH_BN 256
#define GH_BK 64
#define GH_STAGES 3
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
// setmaxnreg: 128 x 40 + 256 x 232 = the 384 x 168 registers the launch reserves.
#define GH_PRODUCER_REGISTERS 40
#define GH_CONSUMER_REGISTERS 232
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
// garbage, the host raises). status[1] is what it waited for (GH_WAITED_*), status[2]
// the block, status[3] the timeout in ms.
__device__ __forceinline__ void stage_wait(u64* bar, unsigned parity, long long* status, int what, bool& gave_up) {
    const unsigned address = shared_address(bar);
    if (gave_up || mbarrier_try_wait<false>(address, parity)) return;
    const u64 start = global_timer_ns();
    while (!mbarrier_try_wait<false>(address, parity)) {
        if (global_timer_ns() - start > MBARRIER_TIMEOUT_NS) {
            unsigned long long* word = reinterpret_cast<unsigned long long*>(status);
            if (atomicCAS(word, 0ull, static_cast<unsigned long long>(GH_STAGE_TIMED_OUT)) == 0ull) {
                status[1] = what;
                status[2] = blockIdx.x;
                status[3] = static_cast<long long>(MBARRIER_TIMEOUT_NS / 1000000ull);
            }
            gave_up = true;
            return;
        }
    }
}

// -- The tile loop ----------------------------------------------------------------------------

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
template <int MODE, typename OutT>
__device__ __forceinline__ void grouped_mm(const TensorMap* a_map, const TensorMap* b_map, const void* offsets,
                                           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out,
                                           long long* status) {
    constexpr bool STAGED_OUTPUT = sizeof(OutT) == 2;  // FP32 tiles do not fit beside the stages: stored directly
    constexpr bool A_BOXES = MODE == GH_WGRAD, B_BOXES = MODE != GH_DGRAD;
    extern __shared__ unsigned char dynamic_shared[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    __shared__ int tile_start[GG_MAX_EXPERTS + 1];
    __shared__ u64 full[GH_STAGES], empty[GH_STAGES], output_full, output_empty;

    if (!load_offsets(off, offsets, offsets_are_64bit, experts, rows, status)) return;
    const int out_cols = MODE == GH_DGRAD ? K : N;
    const int n_tiles = ceil_div(out_cols, GH_BN);
    const int wgrad_m_tiles = ceil_div(K, GH_BM);
    if (MODE != GH_WGRAD && threadIdx.x < WARP) tile_prefix(tile_start, off, experts, GH_BM, n_tiles);
    if (threadIdx.x == 0) {
        for (int s = 0; s < GH_STAGES; ++s) {
            mbarrier_init(&full[s], 1);                  // the producer's expect_tx arrival
            mbarrier_init(&empty[s], GH_CONSUMERS * 4);  // one arrival per consumer warp
        }
        mbarrier_init(&output_full, GH_CONSUMERS * 4);
        mbarrier_init(&output_empty, GH_STORE_WARPS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int tiles = MODE == GH_WGRAD ? experts * wgrad_m_tiles * n_tiles : tile_start[experts];
    const unsigned stages = (shared_address(dynamic_shared) + 1023) & ~1023u;
    const unsigned staged = stages + GH_STAGES * GH_STAGE_BYTES;  // the BF16 output tile

    // Tile t of the order expert, n-tile, m-tile (m fastest).
    auto tile_at = [&](int t) {
        if constexpr (MODE == GH_WGRAD) {
            const int e = t / (wgrad_m_tiles * n_tiles), local = t - e * wgrad_m_tiles * n_tiles;
            return Tile{e, (local % wgrad_m_tiles) * GH_BM, K, (local / wgrad_m_tiles) * GH_BN, off[e],
                        off[e + 1] - off[e]};
        } else {
            const int e = expert_of_tile(tile_start, experts, t);
            const int m_tiles = ceil_div(off[e + 1] - off[e], GH_BM);
            const int local = t - tile_start[e];
            return Tile{e, off[e] + (local % m_tiles) * GH_BM, off[e + 1], (local / m_tiles) * GH_BN, 0,
                        MODE == GH_FORWARD ? K : N};
        }
    };

    const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / WARP) % 4, lane = threadIdx.x % WARP;
    bool gave_up = false;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(GH_PRODUCER_REGISTERS));
        if (warp == 0) {
            if (lane != 0) return;
            int step = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const Tile tile = tile_at(t);
                const int a_boxes = A_BOXES ? min(GH_BM / GH_BOX, ceil_div(K - tile.row0, GH_BOX)) : 1;
                const int b_boxes = B_BOXES ? min(GH_BN / GH_BOX, ceil_div(out_cols - tile.col0, GH_BOX)) : 1;
                const unsigned bytes = (A_BOXES ? a_boxes * GH_BOX_BYTES : GH_A_BYTES) +
                                       (B_BOXES ? b_boxes * GH_BOX_BYTES : GH_B_BYTES);
                const int k_steps = ceil_div(tile.red_len, GH_BK);
                for (int k = 0; k < k_steps; ++k, ++step) {
                    const int s = step % GH_STAGES;
                    stage_wait(&empty[s], ((step / GH_STAGES) & 1) ^ 1, status, GH_WAITED_FOR_CONSUMERS, gave_up);
                    if (gave_up) return;
                    expect_bytes(&full[s], bytes);
                    const unsigned a = stages + s * GH_STAGE_BYTES, b = a + GH_A_BYTES;
                    const int r = tile.red0 + k * GH_BK;
                    if constexpr (MODE == GH_WGRAD) {
                        for (int j = 0; j < a_boxes; ++j)
                            tma_load_2d(a + j * GH_BOX_BYTES, a_map, &full[s], tile.row0 + j * GH_BOX, r);
                        for (int j = 0; j < b_boxes; ++j)
                            tma_load_2d(b + j * GH_BOX_BYTES, b_map, &full[s], tile.col0 + j * GH_BOX, r);
                    } else if constexpr (MODE == GH_FORWARD) {
                        tma_load_2d(a, a_map, &full[s], r, tile.row0);
                        for (int j = 0; j < b_boxes; ++j)
                            tma_load_3d(b + j * GH_BOX_BYTES, b_map, &full[s], tile.col0 + j * GH_BOX, r, tile.expert);
                    } else {
                        tma_load_2d(a, a_map, &full[s], r, tile.row0);
                        tma_load_3d(b, b_map, &full[s], r, tile.col0, tile.expert);
                    }
                }
            }
            return;
        }
        if constexpr (STAGED_OUTPUT) {
            // Store warps: each staged tile to global memory in 16-byte chunks, a warp per
            // 512-byte row at a time, masked to the tile's rows and the output's columns.
            const int id = threadIdx.x - WARP;
            int phase = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x, phase ^= 1) {
                const Tile tile = tile_at(t);
                stage_wait(&output_full, phase, status, GH_WAITED_FOR_OUTPUT, gave_up);
                if (__any_sync(FULL_MASK, gave_up)) return;  // the whole warp, or its __syncwarp would hang
                OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert) * K * N : out;
                for (int i = id; i < GH_BM * (GH_BN / 8); i += GH_STORE_WARPS * WARP) {
                    const int row = i / (GH_BN / 8), chunk = i % (GH_BN / 8);
                    const int r = tile.row0 + row, c = tile.col0 + chunk * 8;  // out_cols is a multiple of 8
                    if (r < tile.row_end && c < out_cols) {
                        uint4 v;
                        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                     : "r"(staged + row * GH_C_PITCH + chunk * 16));
                        *reinterpret_cast<uint4*>(base + static_cast<long long>(r) * out_cols + c) = v;
                    }
                }
                __syncwarp();
                if (lane == 0) mbarrier_arrive(&output_empty);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(GH_CONSUMER_REGISTERS));
    const int consumer = warpgroup - 1;
    int step = 0, phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, phase ^= 1) {
        const Tile tile = tile_at(t);
        const int k_steps = ceil_div(tile.red_len, GH_BK);
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.0f;
        for (int k = 0; k < k_steps; ++k, ++step) {
            const int s = step % GH_STAGES;
            stage_wait(&full[s], (step / GH_STAGES) & 1, status, GH_WAITED_FOR_COPIES, gave_up);
            const unsigned a = stages + s * GH_STAGE_BYTES, b = a + GH_A_BYTES;
            if constexpr (MODE == GH_WGRAD) {
                // The expert's last chunk: its rows past the end (the next expert's) count as
                // zeros. Every copied box is cleared from that row on, whole 128-byte lines
                // (the swizzle permutes chunks within a line), before the MMAs read them.
                const int valid = tile.red_len - k * GH_BK;
                if (valid < GH_BK) {
                    const int lines = GH_BK - valid, chunks = lines * 8;
                    const int boxes = GH_BM / GH_BOX + GH_BN / GH_BOX;
                    for (int i = threadIdx.x - 128; i < boxes * chunks; i += 128 * GH_CONSUMERS) {
                        const int box = i / chunks, line = valid + (i % chunks) / 8, chunk = i % 8;
                        const unsigned at = a + box * GH_BOX_BYTES + line * 128 + chunk * 16;  // B follows A's boxes
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(at), "r"(0) : "memory");
                    }
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // seen by the MMAs (async proxy)
                    consumers_sync();
                }
            }
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < GH_BK / 16; ++k16) {
                if constexpr (MODE == GH_WGRAD) {  // both 16 reduction rows further: 2 swizzle atoms
                    wgmma_m64n256k16<1, 1>(d, smem_descriptor(a + consumer * GH_BOX_BYTES + k16 * 2048, GH_BOX_BYTES, 1024),
                                           smem_descriptor(b + k16 * 2048, GH_BOX_BYTES, 1024));
                } else {
                    // A: 16 elements of K further within the 128-byte row.
                    const unsigned long long da = smem_descriptor(a + consumer * 64 * 128 + k16 * 32, 16, 1024);
                    if constexpr (MODE == GH_FORWARD) {
                        wgmma_m64n256k16<0, 1>(d, da, smem_descriptor(b + k16 * 2048, GH_BOX_BYTES, 1024));
                    } else {
                        wgmma_m64n256k16<0, 0>(d, da, smem_descriptor(b + k16 * 32, 16, 1024));
                    }
                }
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous step's MMAs are done: its stage may be refilled
            if (k > 0 && lane == 0) mbarrier_arrive(&empty[(step + GH_STAGES - 1) % GH_STAGES]);
        }
        wgmma_wait<0>();
        if (k_steps > 0 && lane == 0) mbarrier_arrive(&empty[(step + GH_STAGES - 1) % GH_STAGES]);

        // Accumulator d[4j + {0, 1}] is row lane/4, columns 8j + 2 (lane%4) + {0, 1} of the
        // warp's 16 rows; d[4j + {2, 3}] the same 8 rows further.
        const int row = consumer * 64 + warp * 16 + lane / 4, col = 2 * (lane % 4);
        if constexpr (STAGED_OUTPUT) {  // to the staged tile once the store warps are done with the last
            stage_wait(&output_empty, phase ^ 1, status, GH_WAITED_FOR_STORES, gave_up);
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < GH_BN / 8; ++j) {
                    const __nv_bfloat162 v = __floats2bfloat162_rn(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
                    asm volatile("st.shared.b32 [%0], %1;" :: "r"(staged + (row + 8 * half) * GH_C_PITCH + (col + 8 * j) * 2),
                                 "r"(*reinterpret_cast<const unsigned*>(&v)) : "memory");
                }
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&output_full);
        } else {
            OutT* base = MODE == GH_WGRAD ? out + static_cast<long long>(tile.expert) * K * N : out;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = tile.row0 + row + 8 * half;
                if (r >= tile.row_end) continue;
                OutT* out_row = base + static_cast<long long>(r) * out_cols;
#pragma unroll
                for (int j = 0; j < GH_BN / 8; ++j) {
                    const int c = tile.col0 + col + 8 * j;  // out_cols is a multiple of 8 and c even: c + 1 < out_cols too
                    if (c < out_cols) store_pair(out_row + c, d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
                }
            }
        }
    }
}

#define GH_KERNEL(kernel, mode, a, b)                                                                                  \
    template <typename OutT>                                                                                           \
    __global__ void __launch_bounds__(GH_THREADS, 1)                                                                   \
    kernel(const __grid_constant__ TensorMap a, const __grid_constant__ TensorMap b, const void* offsets,               \
           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out, long long* status) {          \
        grouped_mm<mode, OutT>(&a, &b, offsets, offsets_are_64bit, experts, rows, K, N, out, status);                 \
    }
GH_KERNEL(grouped_mm_forward, GH_FORWARD, x_map, w_map)
GH_KERNEL(grouped_mm_dgrad, GH_DGRAD, dy_map, w_map)
GH_KERNEL(grouped_mm_wgrad, GH_WGRAD, x_map, dy_map)

#define GH_INSTANCE(kernel, OutT)                                                                             \
    template __global__ void kernel<OutT>(const __grid_constant__ TensorMap, const __grid_constant__ TensorMap,      \
                                          const void*, int, int, long long, int, int, OutT*, long long*)
GH_INSTANCE(grouped_mm_forward, bf16);
GH_INSTANCE(grouped_mm_forward, float);
GH_INSTANCE(grouped_mm_dgrad, bf16);
GH_INSTANCE(grouped_mm_dgrad, float);
GH_INSTANCE(grouped_mm_wgrad, bf16);
GH_INSTANCE(grouped_mm_wgrad, float);
