// Hopper (sm_90a) grouped BF16 GEMM over expert-major rows, forward and dgrad, FP32
// accumulation, BF16 or FP32 output. ultraep/compute/device.py launches them (compiled
// with -arch=sm_90a: wgmma and setmaxnreg exist only there).
//
//   forward  Y[rows_e]  = X[rows_e] @ W_e          x [M, K], w [E, K, N], y  [M, N]
//   dgrad    dX[rows_e] = dY[rows_e] @ W_e^T       dy [M, N], w [E, K, N], dx [M, K]
//
// rows_e = [offsets[e], offsets[e+1]), read and checked on the device by every block
// (grouped_gemm_common.cuh): on a bad array no block writes anything. One persistent
// block per SM walks the tiles t = blockIdx.x, + gridDim.x, ... of one fixed order:
// expert, then n-tile, then m-tile, so the blocks running at once share a slice of W_e
// and each X tile is read by neighbours at about the same time (L2 hits).
//
// A block is three warpgroups. Warpgroup 0 gives most of its registers away (setmaxnreg)
// and one of its threads is the producer: it copies the operand tiles of each k-step by
// TMA (tensor maps encoded on the host, 128-byte swizzle) into a GH_STAGES-deep ring of
// shared-memory stages, each with a "full" mbarrier (TMA bytes arrive) and an "empty" one
// (the consumers are done). Warpgroups 1 and 2 are the consumers: each owns 64 rows x
// GH_BN columns of the GH_BM x GH_BN tile, multiplies with wgmma.mma_async m64n256k16
// straight from the swizzled stages, keeps one k-step of MMAs in flight, and stores its
// accumulators to global memory, BF16 or FP32, masked to the expert's rows and the
// output's columns.
//
// Tiles never straddle experts, and the input is not padded: a tile starts at its
// expert's first row plus a multiple of GH_BM; rows past the expert's end are loaded
// (the next expert's rows, or zeros past the tensor) but never stored, and a row's
// accumulators depend on its own row of A only. Columns past N (or K) and the reduction
// past its end are zeros filled in by TMA.
//
// Determinism: every output element is one K-sum in GH_BK chunks in ascending order,
// each chunk four k16 MMAs in ascending k, with no split-K and no atomics. A row's
// result depends only on its own row and the weights, never on which rows share its
// tile or where its expert starts.
//
//! kernels: grouped_mm_forward<__nv_bfloat16>, grouped_mm_forward<float>
//! kernels: grouped_mm_dgrad<__nv_bfloat16>, grouped_mm_dgrad<float>
//! nvrtc-options: -arch=sm_90a

#include <cuda_bf16.h>

#include "grouped_gemm_common.cuh"
#include "sync.cuh"

#define GH_BM 128
#define GH_BN 256
#define GH_BK 64
#define GH_STAGES 4
#define GH_CONSUMERS 2
#define GH_THREADS (128 * (1 + GH_CONSUMERS))
// Forward's W tile is copied in boxes of this many columns: a box row may span at most
// the 128 bytes of the swizzle.
#define GH_BOX_COLS 64
#define GH_A_BYTES (GH_BM * GH_BK * 2)
#define GH_B_BYTES (GH_BN * GH_BK * 2)
#define GH_STAGE_BYTES (GH_A_BYTES + GH_B_BYTES)
// The swizzled stages must start on a 1024-byte boundary (the swizzle pattern repeats
// every 8 rows of 128 bytes); the slack lets the kernel round the dynamic base up.
#define GH_SMEM_BYTES (GH_STAGES * GH_STAGE_BYTES + 1024)
// setmaxnreg: 128 x 40 + 256 x 232 = the 384 x 168 registers the launch reserves.
#define GH_PRODUCER_REGISTERS 40
#define GH_CONSUMER_REGISTERS 232
// The host encodes the tensor maps with these (CUtensorMap is 128 opaque bytes).
#define GH_TENSOR_MAP_BYTES 128

// status[0] when a stage wait gave up (after grouped_gemm_common.cuh's offsets codes), and
// what it waited for in status[1] (ultraep/compute/device.py words them).
#define GH_STAGE_TIMED_OUT 4
#define GH_WAITED_FOR_CONSUMERS 1
#define GH_WAITED_FOR_COPIES 2

#define GH_FORWARD 0
#define GH_DGRAD 1

typedef __nv_bfloat16 bf16;

static_assert(GH_BK * 2 == 128, "a k-step of A is one 128-byte swizzle row");
static_assert(GH_BM == 64 * GH_CONSUMERS, "each consumer warpgroup owns 64 rows");
static_assert(GH_BN == 256 && GH_BN % GH_BOX_COLS == 0, "the MMA is m64n256k16");

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

// d += A (64 x 16, K-major) x B (16 x 256; K-major, or N-major when TRANS_B), FP32.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %131, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
        "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
        "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, "
        "%67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, "
        "%89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "
        "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
        "%127}, %128, %129, p, 1, 1, 0, %130;\n}\n"
        : GH_D32(0), GH_D32(32), GH_D32(64), GH_D32(96)
        : "l"(a), "l"(b), "n"(TRANS_B), "r"(1));  // p: accumulate into d
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

struct Tile {
    int expert, row0, row_end, col0;
};

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* p, float v0, float v1) {
    if constexpr (sizeof(OutT) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    } else {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
    }
}

// a_map: A [M rows, reduction] (x in forward, dy in dgrad), box GH_BK x GH_BM.
// b_map: W [E, K, N] as (N, K, E); forward box GH_BOX_COLS x GH_BK x 1 (N-major B),
// dgrad box GH_BK x GH_BN x 1 (W_e rows are dgrad's output columns: K-major B).
template <int MODE, typename OutT>
__device__ __forceinline__ void grouped_mm(const TensorMap* a_map, const TensorMap* b_map, const void* offsets,
                                           int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* out,
                                           long long* status) {
    extern __shared__ unsigned char dynamic_shared[];
    __shared__ int off[GG_MAX_EXPERTS + 1];
    __shared__ int tile_start[GG_MAX_EXPERTS + 1];
    __shared__ u64 full[GH_STAGES], empty[GH_STAGES];

    if (!load_offsets(off, offsets, offsets_are_64bit, experts, rows, status)) return;
    const int out_cols = MODE == GH_FORWARD ? N : K;
    const int reduction = MODE == GH_FORWARD ? K : N;
    const int n_tiles = ceil_div(out_cols, GH_BN);
    const int k_steps = ceil_div(reduction, GH_BK);
    if (threadIdx.x < WARP) tile_prefix(tile_start, off, experts, GH_BM, n_tiles);
    if (threadIdx.x == 0) {
        for (int s = 0; s < GH_STAGES; ++s) {
            mbarrier_init(&full[s], 1);                      // the producer's expect_tx arrival
            mbarrier_init(&empty[s], GH_CONSUMERS * 4);      // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int tiles = tile_start[experts];
    const unsigned stages = (shared_address(dynamic_shared) + 1023) & ~1023u;

    auto tile_at = [&](int t) {
        const int e = expert_of_tile(tile_start, experts, t);
        const int m_tiles = ceil_div(off[e + 1] - off[e], GH_BM);
        const int local = t - tile_start[e];
        return Tile{e, off[e] + (local % m_tiles) * GH_BM, off[e + 1], (local / m_tiles) * GH_BN};
    };

    const int warpgroup = threadIdx.x / 128;
    bool gave_up = false;
    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(GH_PRODUCER_REGISTERS));
        if (threadIdx.x != 0) return;
        int step = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            const Tile tile = tile_at(t);
            // Forward: W boxes wholly past N are not copied (their columns are never stored).
            const int boxes = MODE == GH_FORWARD ? min(GH_BN / GH_BOX_COLS, ceil_div(N - tile.col0, GH_BOX_COLS)) : 1;
            const unsigned bytes = GH_A_BYTES + (MODE == GH_FORWARD ? boxes * GH_BOX_COLS * GH_BK * 2 : GH_B_BYTES);
            for (int k = 0; k < k_steps; ++k, ++step) {
                const int s = step % GH_STAGES;
                stage_wait(&empty[s], ((step / GH_STAGES) & 1) ^ 1, status, GH_WAITED_FOR_CONSUMERS, gave_up);
                if (gave_up) return;
                expect_bytes(&full[s], bytes);
                const unsigned a = stages + s * GH_STAGE_BYTES, b = a + GH_A_BYTES;
                tma_load_2d(a, a_map, &full[s], k * GH_BK, tile.row0);
                if constexpr (MODE == GH_FORWARD) {
                    for (int j = 0; j < boxes; ++j)
                        tma_load_3d(b + j * GH_BOX_COLS * GH_BK * 2, b_map, &full[s], tile.col0 + j * GH_BOX_COLS,
                                    k * GH_BK, tile.expert);
                } else {
                    tma_load_3d(b, b_map, &full[s], k * GH_BK, tile.col0, tile.expert);
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(GH_CONSUMER_REGISTERS));
    const int consumer = warpgroup - 1, warp = (threadIdx.x / WARP) % 4, lane = threadIdx.x % WARP;
    int step = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const Tile tile = tile_at(t);
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) d[i] = 0.0f;
        for (int k = 0; k < k_steps; ++k, ++step) {
            const int s = step % GH_STAGES;
            stage_wait(&full[s], (step / GH_STAGES) & 1, status, GH_WAITED_FOR_COPIES, gave_up);
            const unsigned a = stages + s * GH_STAGE_BYTES + consumer * 64 * 128, b = stages + s * GH_STAGE_BYTES + GH_A_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < GH_BK / 16; ++k16) {
                const unsigned long long da = smem_descriptor(a + k16 * 32, 16, 1024);
                if constexpr (MODE == GH_FORWARD) {  // 16 rows of K further: 2 swizzle atoms of 8 rows
                    wgmma_m64n256k16<1>(d, da, smem_descriptor(b + k16 * 16 * 128, GH_BOX_COLS * GH_BK * 2, 1024));
                } else {                             // 16 elements of K further within the 128-byte row
                    wgmma_m64n256k16<0>(d, da, smem_descriptor(b + k16 * 32, 16, 1024));
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
        const int row = tile.row0 + consumer * 64 + warp * 16 + lane / 4;
        const int col = tile.col0 + 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= tile.row_end) continue;
            OutT* out_row = out + static_cast<long long>(r) * out_cols;
#pragma unroll
            for (int j = 0; j < GH_BN / 8; ++j) {
                const int c = col + 8 * j;  // out_cols is a multiple of 8 and c even: c + 1 < out_cols too
                if (c < out_cols) store_pair(out_row + c, d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
            }
        }
    }
}

template <typename OutT>
__global__ void __launch_bounds__(GH_THREADS, 1)
grouped_mm_forward(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map,
                   const void* offsets, int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* y,
                   long long* status) {
    grouped_mm<GH_FORWARD, OutT>(&x_map, &w_map, offsets, offsets_are_64bit, experts, rows, K, N, y, status);
}

template <typename OutT>
__global__ void __launch_bounds__(GH_THREADS, 1)
grouped_mm_dgrad(const __grid_constant__ TensorMap dy_map, const __grid_constant__ TensorMap w_map,
                 const void* offsets, int offsets_are_64bit, int experts, long long rows, int K, int N, OutT* dx,
                 long long* status) {
    grouped_mm<GH_DGRAD, OutT>(&dy_map, &w_map, offsets, offsets_are_64bit, experts, rows, K, N, dx, status);
}

#define GH_INSTANCE(kernel, OutT)                                                                             \
    template __global__ void kernel<OutT>(const __grid_constant__ TensorMap, const __grid_constant__ TensorMap,      \
                                          const void*, int, int, long long, int, int, OutT*, long long*)
GH_INSTANCE(grouped_mm_forward, bf16);
GH_INSTANCE(grouped_mm_forward, float);
GH_INSTANCE(grouped_mm_dgrad, bf16);
GH_INSTANCE(grouped_mm_dgrad, float);
