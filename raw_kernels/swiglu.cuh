// SwiGLU's rounding (swiglu.cu states it), shared by swiglu.cu and the fused up-projection's
// epilogue (fused_moe.cu) so both give the same bits.
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
