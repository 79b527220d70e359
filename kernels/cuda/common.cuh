// Shared by every kernel source: the blocks and primitives of `blocks.cuh`,
// half conversions, and the float helpers whose rounding must equal the CPU
// kernels'.
//
// Sources are compiled at run time by NVRTC with `--fmad=false`, so a * b + c
// rounds twice as in Rust; the CPU kernels' explicit fused multiply-adds are
// written as `fmaf` here.
#pragma once

#include "blocks.cuh"

__device__ __forceinline__ float h2f(u16 h) { return half_to_float(h); }

// Round to nearest even, as `half::f16::from_f32` and F16C.
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// GGML's `nearest_int` (`kernels/src/quantize.rs`): ties to even by the
// float-add trick, exact for |v| <= 2^22.
__device__ __forceinline__ i32 nearest_int(float v) {
    float shifted = __fadd_rn(v, 12582912.0f);
    return (i32)(__float_as_uint(shifted) & 0x007fffff) - 0x00400000;
}

// `exp(x)` as GGML's AVX-512 kernels compute it (`ops::expf_ggml`), the
// same operations in the same order, so the same bits.
__device__ __forceinline__ float expf_ggml(float x) {
    const float r = __uint_as_float(0x4b400000u);
    float z = fmaf(x, __uint_as_float(0x3fb8aa3bu), r);
    float n = __fsub_rn(z, r);
    float b = fmaf(-n, __uint_as_float(0x35bfbe8eu), fmaf(-n, __uint_as_float(0x3f317200u), x));
    if (fabsf(n) > 192.0f) {
        return n <= 0.0f ? 0.0f : __int_as_float(0x7f800000);
    }
    float u = __fmul_rn(b, b);
    float j = fmaf(fmaf(fmaf(__uint_as_float(0x3c072010u), b, __uint_as_float(0x3d2b9f17u)), u,
                        fmaf(__uint_as_float(0x3e2aaf33u), b, __uint_as_float(0x3efffedbu))),
                   u, fmaf(__uint_as_float(0x3f7ffff6u), b, 1.0f));
    i32 ni = (i32)n;
    i32 a = ni / 2;
    i32 c = ni - a;
    return __fmul_rn(__fmul_rn(j, __uint_as_float((u32)(a + 127) << 23)), __uint_as_float((u32)(c + 127) << 23));
}

// `silu(g) * u` as `ops::swiglu_element`.
__device__ __forceinline__ float swiglu_element(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf_ggml(-g))), u);
}

// `gelu(g) * u` as `ops::geglu_element`: GGML's CPU GELU is a table indexed
// by the input rounded to f16; the host uploads the same table.
__device__ __forceinline__ float geglu_element(const float* __restrict__ gelu_table, float g, float u) {
    if (g <= -10.0f) return 0.0f;
    if (g >= 10.0f) return __fmul_rn(g, u);
    return __fmul_rn(gelu_table[f2h(g)], u);
}

// Activation ids, as the host's `FfnActivation`.
#define ACT_SILU 0
#define ACT_GELU_TANH 1

__device__ __forceinline__ float gated(int act, const float* __restrict__ gelu_table, float g, float u) {
    return act == ACT_SILU ? swiglu_element(g, u) : geglu_element(gelu_table, g, u);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_min_int(int v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Four packed signed bytes dotted with four more, accumulated (dp4a on
// sm_61 and later; every GPU this backend targets has it).
__device__ __forceinline__ i32 dot4(i32 a, i32 b, i32 acc) {
    return __dp4a(a, b, acc);
}

// Nanoseconds on the GPU's global timer (what the streaming kernels compare
// a deadline with).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
