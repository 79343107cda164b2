// SwiGLU's rounding (swiglu.cu states it), shared by swiglu.cu and the fused kernels'
// epilogues (fused_moe.cu, fused_moe_backward.cu) so all give the same bits.
#pragma once

#include <cuda_bf16.h>

__device__ __forceinline__ float sigmoid_rn(float a) {
    float e = __double2float_rn(exp(-(double)a));
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
}

// bf16((a * sigmoid(a)) * b): gate a, up b.
__device__ __forceinline__ __nv_bfloat16 swiglu_rn(float a, float b) {
    return __float2bfloat16_rn(__fmul_rn(__fmul_rn(a, sigmoid_rn(a)), b));
}

// SwiGLU's backward at one element before the BF16 rounding: (d gate, d up) =
// ((g * b) * (s * (1 + a * (1 - s))), g * (a * s)), g = float(d_act).
__device__ __forceinline__ float2 swiglu_backward_rn(float a, float b, float g) {
    const float s = sigmoid_rn(a);
    const float slope = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(a, __fadd_rn(1.0f, -s))));
    return make_float2(__fmul_rn(__fmul_rn(g, b), slope), __fmul_rn(g, __fmul_rn(a, s)));
}
