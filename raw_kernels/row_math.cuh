// Row arithmetic shared by dispatch.cu and the fused backward (fused_moe_backward.cu), so
// the sequential and the fused path compute these rows with one piece of code, bit for bit;
// its vectors' conversions also serve the gradient reduction (transfer.cu).
// The includer defines WARP, FULL_MASK and the u64 type first.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// 16-byte vectors of T as floats: 8 bf16/half or 4 float.
__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float as_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void round_to(float f, float& v) { v = f; }
__device__ __forceinline__ void round_to(float f, __nv_bfloat16& v) { v = __float2bfloat16_rn(f); }
__device__ __forceinline__ void round_to(float f, __half& v) { v = __float2half_rn(f); }

template <typename T> struct Vector {  // the 16-bit types
    static constexpr int N = 8;
    __device__ static void to_float(const uint4& v, float* f) {
        const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int j = 0; j < N; ++j) f[j] = as_float(h[j]);
    }
    __device__ static uint4 from_float(const float* f) {
        uint4 v;
        T* h = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int j = 0; j < N; ++j) round_to(f[j], h[j]);
        return v;
    }
};
template <> struct Vector<float> {
    static constexpr int N = 4;
    __device__ static void to_float(const uint4& v, float* f) {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
    }
    __device__ static uint4 from_float(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};

// Combine backward, expert side, one received row by one warp: its token's output gradient
// g (row_landing[row] of landing); grad_y[row] = gate * g; the gate gradient dot(g, y[row])
// -- each lane sums its elements in increasing order (LOADS vectors' loads in flight, the
// math one vector at a time), lanes meet in an xor butterfly (reference.lane_dot) --
// written to slot (t, k) of the source's slot_grad_w.
template <typename T, int LOADS>
__device__ __forceinline__ void grad_row(int row, const uint4* landing, const int* row_landing,
                                         const float* row_weight, const int* row_origin, const uint4* y,
                                         uint4* grad_y, int row_vecs, const u64* peer_bases, u64 slot_grad_w_offset,
                                         int slots_per_rank, int lane) {
    constexpr int N = Vector<T>::N;
    const uint4* g_row = landing + static_cast<long long>(row_landing[row]) * row_vecs;
    const uint4* y_row = y + static_cast<long long>(row) * row_vecs;
    const float gate = row_weight[row];
    float dot = 0.0f;
    for (int v0 = lane; v0 < row_vecs; v0 += WARP * LOADS) {
        uint4 gv[LOADS], yv[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int v = v0 + u * WARP;
            if (v < row_vecs) gv[u] = g_row[v], yv[u] = __ldg(y_row + v);  // y: no other rank writes it
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int v = v0 + u * WARP;
            if (v >= row_vecs) break;
            float g[N], h[N], scaled[N];
            Vector<T>::to_float(gv[u], g);
            Vector<T>::to_float(yv[u], h);
#pragma unroll
            for (int j = 0; j < N; ++j) {
                dot = __fadd_rn(dot, __fmul_rn(g[j], h[j]));
                scaled[j] = __fmul_rn(gate, g[j]);
            }
            grad_y[static_cast<long long>(row) * row_vecs + v] = Vector<T>::from_float(scaled);
        }
    }
    for (int offset = WARP / 2; offset > 0; offset /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(FULL_MASK, dot, offset));
    if (lane == 0) {
        const int origin = row_origin[row];
        reinterpret_cast<float*>(peer_bases[origin / slots_per_rank] + slot_grad_w_offset)[origin % slots_per_rank] = dot;
    }
}
