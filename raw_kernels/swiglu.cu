// SwiGLU between the two grouped GEMMs of an MoE expert, over expert-major rows.
// ultraep/integration/moe_layer.py launches them; its NumPy functions are the reference.
//
//   forward   h [rows, 2F] fp32 (gate | up)  ->  act [rows, F] bf16
//   backward  h, d_act [rows, F] bf16       ->  dh  [rows, 2F] bf16 (d gate | d up)
//
// Only rows [0, min(offsets[experts], rows)) are read or written: the row count stays on
// the device, so the host never waits for the dispatch.
//
// Rounding, stated so the NumPy reference repeats it step by step: every operation is one
// IEEE fp32 operation rounded to nearest (__fadd_rn, __fmul_rn, __fdiv_rn: no contraction
// into FMA), the exponential included (exp_rn, as swiglu.cuh states it: fp32 adds,
// multiplies and explicit fused multiply-adds, a clamp and exponent bits, within 1.014 ulp
// of exp); results are rounded once to bf16 (nearest even). With s = sigmoid(a):
//   s      = 1 / (1 + exp_rn(-a))
//   act    = bf16((a * s) * b)
//   d_up   = bf16(g * (a * s))
//   d_gate = bf16((g * b) * (s * (1 + a * (1 - s))))      g = float(d_act)
// CuPy compiles every RawModule with -ftz=true, which even these intrinsics obey: a subnormal
// operand or result of each FP32 operation is a zero of its sign (exp_rn never meets one that
// would change its result); the BF16 roundings keep subnormals. The reference flushes after
// each operation alike (moe_layer.flush_subnormals), so device and host agree bit for bit on
// every input (NaN: both NaN, payloads aside).
//
//! kernels: swiglu_forward, swiglu_backward

#include <cuda_bf16.h>

#include "swiglu.cuh"

#define SWIGLU_THREADS 256
#define SWIGLU_BLOCKS_PER_SM 4


__device__ __forceinline__ long long rows_in_use(const int* offsets, int experts, long long rows) {
    long long used = offsets[experts];
    return used < rows ? used : rows;
}

extern "C" __global__ void swiglu_forward(const float* __restrict__ h, const int* __restrict__ offsets, int experts,
                                          long long rows, int ffn, __nv_bfloat16* __restrict__ act) {
    long long total = rows_in_use(offsets, experts, rows) * ffn;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / ffn, col = i - row * ffn;
        float a = h[row * 2 * ffn + col], b = h[row * 2 * ffn + ffn + col];
        act[i] = swiglu_rn(a, b);
    }
}

extern "C" __global__ void swiglu_backward(const float* __restrict__ h, const __nv_bfloat16* __restrict__ d_act,
                                           const int* __restrict__ offsets, int experts, long long rows, int ffn,
                                           __nv_bfloat16* __restrict__ dh) {
    long long total = rows_in_use(offsets, experts, rows) * ffn;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / ffn, col = i - row * ffn;
        float a = h[row * 2 * ffn + col], b = h[row * 2 * ffn + ffn + col];
        const float2 grads = swiglu_backward_rn(a, b, __bfloat162float(d_act[i]));
        dh[row * 2 * ffn + col] = __float2bfloat16_rn(grads.x);
        dh[row * 2 * ffn + ffn + col] = __float2bfloat16_rn(grads.y);
    }
}
