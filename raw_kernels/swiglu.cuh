// SwiGLU's rounding (swiglu.cu states it), shared by swiglu.cu and the fused kernels'
// epilogues (fused_moe.cu, fused_moe_backward.cu) so all give the same bits.
#pragma once

#include <cuda_bf16.h>

// exp_rn's constants; ultraep/integration/moe_layer.py has the same FP32 values (a CPU test
// compares them), and EXP_INPUT_MAX, 88.75, above which exp_rn is as there: inf. P's
// coefficients: a near-minimax fit of (exp(r) - 1 - r) / r^2 on [-ln2/2, ln2/2] (relative
// error 3e-9), rounded to FP32.
constexpr float EXP_INPUT_MIN = -86.0f;            // exp_rn below: 0 (exp < 2^-124; 2^k exp(r) stays normal)
constexpr float EXP_LOG2E = 1.442695f;
constexpr float EXP_ROUNDING_SHIFT = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
constexpr float EXP_LN2_HI = 0.69314575f;          // 15 significant bits: k * EXP_LN2_HI is exact for |k| < 2^9
constexpr float EXP_LN2_LO = 1.4286068e-06f;       // ln 2 - EXP_LN2_HI
constexpr float EXP_P0 = 0.49999994f, EXP_P1 = 0.16666521f, EXP_P2 = 0.04166839f, EXP_P3 = 0.00836871f,
                EXP_P4 = 0.0013814613f;   // P(r) = EXP_P0 + EXP_P1 r + ... + EXP_P4 r^4

// exp_rn (moe_layer.exp_rn, the reference) is exp(x) within 1.014 ulp (over every FP32 input
// from -86 up: scripts/exp_rn_ulps.py; tests/integration/test_moe_layer.py checks a dense
// sweep) from IEEE FP32 operations alone, each rounded once to nearest -- products, sums and
// fused multiply-adds (__fmaf_rn, one rounding of a * b + c), spelled out so that NumPy
// repeats it bit for bit: exp(x) = 2^k exp(r), k = rint(x log2 e), r = x - k ln2
// (Cody-Waite, exact first step), exp(r) = 1 + (r + r^2 P(r)) by Horner: 11 operations where
// separate multiplies and adds take 19 (the up tiles' SwiGLU epilogue is bound by them).
// Results are never subnormal, and intermediates only for |x| < 2^-62, where the result is 1
// flushed or not: the -ftz=true CuPy compiles with changes no bit.
//
// The kernels take exp_rn only inside the sigmoid, 1 / (1 + exp_rn(-a)), where two of its
// ends make no difference: below -86 (exp_rn's 0) 1 + exp_rn(-86) is 1 as well, and from
// 87.34 up the reciprocal is subnormal, flushed to 0 as exp_rn's inf makes it. So
// sigmoid_exp_rn clamps x into [-86, 88] by a maximum and a minimum, where k <= 127 and
// 2^k exp(r) is normal: k goes into exp(r)'s exponent bits by one integer add, exact as
// exp_rn's two products are, and the sigmoid has no inf to handle. It equals exp_rn(x) on
// [-86, 88]. A NaN x gives a number: every SwiGLU result multiplies the sigmoid by a, so is
// NaN all the same.
constexpr float SIGMOID_EXP_INPUT_MAX = 88.0f;  // exp_rn(88) is finite; 1 / (1 + it) flushes to 0

__device__ __forceinline__ float sigmoid_exp_rn(float x) {
    const float clamped = fminf(fmaxf(x, EXP_INPUT_MIN), SIGMOID_EXP_INPUT_MAX);
    const float shifted = __fmaf_rn(clamped, EXP_LOG2E, EXP_ROUNDING_SHIFT);
    const float k = __fsub_rn(shifted, EXP_ROUNDING_SHIFT);
    const float r = __fmaf_rn(-k, EXP_LN2_LO, __fmaf_rn(-k, EXP_LN2_HI, clamped));
    float poly = __fmaf_rn(EXP_P4, r, EXP_P3);
    poly = __fmaf_rn(poly, r, EXP_P2);
    poly = __fmaf_rn(poly, r, EXP_P1);
    poly = __fmaf_rn(poly, r, EXP_P0);
    const float exp_r = __fadd_rn(1.0f, __fmaf_rn(__fmul_rn(r, r), poly, r));
    const unsigned k_bits = __float_as_uint(shifted) - __float_as_uint(EXP_ROUNDING_SHIFT);  // k
    return __uint_as_float(__float_as_uint(exp_r) + (k_bits << 23));
}

// 1 / (1 + e) for a finite e >= 0: the sigmoid from its exponential. The reciprocal as
// MUFU.RCP and one Newton step, not __fdiv_rn, whose range check branches to a slow path
// that ptxas schedules no code across: for every finite e the two agree bit for bit
// (tests/integration/test_moe_layer.py checks every one).
__device__ __forceinline__ float sigmoid_of_exp_rn(float e) {
    const float d = __fadd_rn(1.0f, e);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
    return __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
}

// 1 / (1 + exp_rn(-a)), bit for bit for every a but NaN (see sigmoid_exp_rn).
__device__ __forceinline__ float sigmoid_rn(float a) {
    return sigmoid_of_exp_rn(sigmoid_exp_rn(-a));
}

// out[i] = bf16((a[i] * sigmoid(a[i])) * b[i]): gate a, up b, N pairs, the N exponentials'
// chains first, side by side, then the rest.
template <int N>
__device__ __forceinline__ void swiglu_rn_batch(const float (&a)[N], const float (&b)[N], __nv_bfloat16 (&out)[N]) {
    float e[N];
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = sigmoid_exp_rn(-a[i]);
#pragma unroll
    for (int i = 0; i < N; ++i)
        out[i] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(a[i], sigmoid_of_exp_rn(e[i])), b[i]));
}

// bf16((a * sigmoid(a)) * b): gate a, up b.
__device__ __forceinline__ __nv_bfloat16 swiglu_rn(float a, float b) {
    const float gate[1] = {a}, up[1] = {b};
    __nv_bfloat16 out[1];
    swiglu_rn_batch(gate, up, out);
    return out[0];
}

// SwiGLU's backward at one element before the BF16 rounding: (d gate, d up) =
// ((g * b) * (s * (1 + a * (1 - s))), g * (a * s)), g = float(d_act).
__device__ __forceinline__ float2 swiglu_backward_rn(float a, float b, float g) {
    const float s = sigmoid_rn(a);
    const float slope = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(a, __fadd_rn(1.0f, -s))));
    return make_float2(__fmul_rn(__fmul_rn(g, b), slope), __fmul_rn(g, __fmul_rn(a, s)));
}
