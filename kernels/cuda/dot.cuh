// Weight-row × activation dot products per GGML type, in *parts* of 8 or
// 16 values so a warp's lanes share a narrow row; the activations are in
// the weight type's vec-dot type (`quantize.cu`). The integer sum of a
// part is exact; its scale is applied per part, so results equal the CPU's
// vec-dot to the rounding of the float adds.
#pragma once
#include "common.cuh"

// Sum of four packed signed bytes.
__device__ __forceinline__ i32 bytes_sum(i32 a) { return dot4(a, 0x01010101, 0); }

// A part's high bits of Q5 values `first..first + 4` as bit 4 of each byte.
__device__ __forceinline__ i32 q5_high(u32 qh, int first) {
    i32 out = 0;
    for (int k = 0; k < 4; ++k) out |= (i32)((qh >> (first + k)) & 1u) << (8 * k + 4);
    return out;
}

// Q4_K / Q5_K sub-block scale and min (`blocks::scale_min_k4`).
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int TYPE> struct Dot;

// Q4_0 × Q8_0: four parts of 8 values (4 low nibbles, the 4 high ones 16 further on).
template <> struct Dot<GGML_Q4_0> {
    static constexpr int PARTS = 4, W_BYTES = sizeof(BlockQ4_0), X_BYTES = sizeof(BlockQ8_0);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ4_0* w = (const BlockQ4_0*)wp;
        const BlockQ8_0* x = (const BlockQ8_0*)xp;
        i32 q = load_i32(w->qs + 4 * p);
        i32 a0 = load_i32(x->qs + 4 * p), a1 = load_i32(x->qs + 16 + 4 * p);
        i32 sumi = dot4(q & 0x0F0F0F0F, a0, dot4((q >> 4) & 0x0F0F0F0F, a1, 0));
        sumi -= 8 * (bytes_sum(a0) + bytes_sum(a1));
        return __fmul_rn(__fmul_rn(h2f(w->d), h2f(x->d)), (float)sumi);
    }
};

// Q4_1 × Q8_1: as Q4_0 without the offset; the block's min times the
// activations' sum (`s`) comes once, with part 0.
template <> struct Dot<GGML_Q4_1> {
    static constexpr int PARTS = 4, W_BYTES = sizeof(BlockQ4_1), X_BYTES = sizeof(BlockQ8_1);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ4_1* w = (const BlockQ4_1*)wp;
        const BlockQ8_1* x = (const BlockQ8_1*)xp;
        i32 q = load_i32(w->qs + 4 * p);
        i32 a0 = load_i32(x->qs + 4 * p), a1 = load_i32(x->qs + 16 + 4 * p);
        i32 sumi = dot4(q & 0x0F0F0F0F, a0, dot4((q >> 4) & 0x0F0F0F0F, a1, 0));
        float r = __fmul_rn(__fmul_rn(h2f(w->d), h2f(x->d)), (float)sumi);
        return p == 0 ? __fadd_rn(r, __fmul_rn(h2f(w->m), h2f(x->s))) : r;
    }
};

template <> struct Dot<GGML_Q5_0> {
    static constexpr int PARTS = 4, W_BYTES = sizeof(BlockQ5_0), X_BYTES = sizeof(BlockQ8_0);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ5_0* w = (const BlockQ5_0*)wp;
        const BlockQ8_0* x = (const BlockQ8_0*)xp;
        u32 qh = (u32)load_i32(w->qh);
        i32 q = load_i32(w->qs + 4 * p);
        i32 lo = (q & 0x0F0F0F0F) | q5_high(qh, 4 * p);
        i32 hi = ((q >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * p);
        i32 a0 = load_i32(x->qs + 4 * p), a1 = load_i32(x->qs + 16 + 4 * p);
        i32 sumi = dot4(lo, a0, dot4(hi, a1, 0)) - 16 * (bytes_sum(a0) + bytes_sum(a1));
        return __fmul_rn(__fmul_rn(h2f(w->d), h2f(x->d)), (float)sumi);
    }
};

template <> struct Dot<GGML_Q5_1> {
    static constexpr int PARTS = 4, W_BYTES = sizeof(BlockQ5_1), X_BYTES = sizeof(BlockQ8_1);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ5_1* w = (const BlockQ5_1*)wp;
        const BlockQ8_1* x = (const BlockQ8_1*)xp;
        u32 qh = (u32)load_i32(w->qh);
        i32 q = load_i32(w->qs + 4 * p);
        i32 lo = (q & 0x0F0F0F0F) | q5_high(qh, 4 * p);
        i32 hi = ((q >> 4) & 0x0F0F0F0F) | q5_high(qh, 16 + 4 * p);
        i32 a0 = load_i32(x->qs + 4 * p), a1 = load_i32(x->qs + 16 + 4 * p);
        i32 sumi = dot4(lo, a0, dot4(hi, a1, 0));
        float r = __fmul_rn(__fmul_rn(h2f(w->d), h2f(x->d)), (float)sumi);
        return p == 0 ? __fadd_rn(r, __fmul_rn(h2f(w->m), h2f(x->s))) : r;
    }
};

template <> struct Dot<GGML_Q8_0> {
    static constexpr int PARTS = 4, W_BYTES = sizeof(BlockQ8_0), X_BYTES = sizeof(BlockQ8_0);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ8_0* w = (const BlockQ8_0*)wp;
        const BlockQ8_0* x = (const BlockQ8_0*)xp;
        i32 sumi = dot4(load_i32(w->qs + 8 * p), load_i32(x->qs + 8 * p),
                        dot4(load_i32(w->qs + 8 * p + 4), load_i32(x->qs + 8 * p + 4), 0));
        return __fmul_rn(__fmul_rn(h2f(w->d), h2f(x->d)), (float)sumi);
    }
};

// Q4_K × Q8_K: sixteen parts of 16 values; part p is half p % 2 of sub-block
// p / 2. `d·sc·Σq·a − dmin·m·bsum`, the min term through Q8_K's per-16 sums.
template <> struct Dot<GGML_Q4_K> {
    static constexpr int PARTS = 16, W_BYTES = sizeof(BlockQ4K), X_BYTES = sizeof(BlockQ8K);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ4K* w = (const BlockQ4K*)wp;
        const BlockQ8K* x = (const BlockQ8K*)xp;
        int j = p / 2, h = p % 2;
        const u8* qs = w->qs + 32 * (j / 2) + 16 * h;
        int shift = 4 * (j % 2);
        i32 sumi = 0;
        for (int k = 0; k < 4; ++k) {
            i32 q = (load_i32(qs + 4 * k) >> shift) & 0x0F0F0F0F;
            sumi = dot4(q, load_i32(x->qs + 32 * j + 16 * h + 4 * k), sumi);
        }
        int sc, m;
        scale_min_k4(j, w->scales, &sc, &m);
        float d = __fmul_rn(x->d, h2f(w->d)), dmin = __fmul_rn(x->d, h2f(w->dmin));
        return __fsub_rn(__fmul_rn(d, (float)(sc * sumi)), __fmul_rn(dmin, (float)(m * x->bsums[2 * j + h])));
    }
};

template <> struct Dot<GGML_Q5_K> {
    static constexpr int PARTS = 16, W_BYTES = sizeof(BlockQ5K), X_BYTES = sizeof(BlockQ8K);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ5K* w = (const BlockQ5K*)wp;
        const BlockQ8K* x = (const BlockQ8K*)xp;
        int j = p / 2, h = p % 2;
        const u8* qs = w->qs + 32 * (j / 2) + 16 * h;
        const u8* qh = w->qh + 16 * h;
        int shift = 4 * (j % 2);
        i32 sumi = 0;
        for (int k = 0; k < 4; ++k) {
            i32 q = (load_i32(qs + 4 * k) >> shift) & 0x0F0F0F0F;
            i32 high = (load_i32(qh + 4 * k) >> j) & 0x01010101;
            sumi = dot4(q | (high << 4), load_i32(x->qs + 32 * j + 16 * h + 4 * k), sumi);
        }
        int sc, m;
        scale_min_k4(j, w->scales, &sc, &m);
        float d = __fmul_rn(x->d, h2f(w->d)), dmin = __fmul_rn(x->d, h2f(w->dmin));
        return __fsub_rn(__fmul_rn(d, (float)(sc * sumi)), __fmul_rn(dmin, (float)(m * x->bsums[2 * j + h])));
    }
};

// Q6_K × Q8_K: sixteen parts of 16 values, each under one scale.
template <> struct Dot<GGML_Q6_K> {
    static constexpr int PARTS = 16, W_BYTES = sizeof(BlockQ6K), X_BYTES = sizeof(BlockQ8K);
    __device__ static float part(const u8* wp, const u8* xp, int p) {
        const BlockQ6K* w = (const BlockQ6K*)wp;
        const BlockQ8K* x = (const BlockQ8K*)xp;
        int half = p / 8, q = p % 8;
        int g = q / 2, l0 = (q % 2) * 16;
        const u8* ql = w->ql + 64 * half + (g % 2) * 32 + l0;
        const u8* qh = w->qh + 32 * half + l0;
        int ql_shift = 4 * (g / 2), qh_shift = 2 * g;
        const i8* a = x->qs + 128 * half + 32 * g + l0;
        i32 sumi = 0;
        for (int k = 0; k < 4; ++k) {
            i32 lo = (load_i32(ql + 4 * k) >> ql_shift) & 0x0F0F0F0F;
            i32 hi = (load_i32(qh + 4 * k) >> qh_shift) & 0x03030303;
            // Values 0..63 in each byte, then minus 32: bytes stay in i8 range.
            i32 v = lo | (hi << 4);
            i32 a4 = load_i32(a + 4 * k);
            sumi = dot4(v, a4, sumi) - 32 * bytes_sum(a4);
        }
        int scale = w->scales[8 * half + (q % 2) + 2 * g];
        return __fmul_rn(__fmul_rn(h2f(w->d), x->d), (float)(scale * sumi));
    }
};

// F16 × F16 (F16 weights' dot type): parts of 8 values, products in f32.
template <> struct Dot<GGML_F16> {
    static constexpr int PARTS = 1, W_BYTES = 16, X_BYTES = 16;
    __device__ static float part(const u8* wp, const u8* xp, int) {
        const u16* w = (const u16*)wp;
        const u16* x = (const u16*)xp;
        float s = 0.0f;
        for (int k = 0; k < 8; ++k) s = fmaf(h2f(w[k]), h2f(x[k]), s);
        return s;
    }
};

template <> struct Dot<GGML_F32> {
    static constexpr int PARTS = 1, W_BYTES = 32, X_BYTES = 32;
    __device__ static float part(const u8* wp, const u8* xp, int) {
        const float* w = (const float*)wp;
        const float* x = (const float*)xp;
        float s = 0.0f;
        for (int k = 0; k < 8; ++k) s = fmaf(w[k], x[k], s);
        return s;
    }
};

// A whole row's dot (`n_units` blocks; F16/F32: groups of 8 values) by one
// warp: this lane's partial sum. Type ids as `GgmlType::id`; an unsupported
// type gives NaN, which the host never lets through (it checks types first).
__device__ __forceinline__ float row_dot_lane(int ty, const u8* w, const u8* x, int n_units, int lane) {
#define ROW_DOT(TYPE)                                                                              \
    {                                                                                              \
        typedef Dot<TYPE> D;                                                                       \
        float s = 0.0f;                                                                            \
        for (int i = lane; i < n_units * D::PARTS; i += WARP)                                      \
            s += D::part(w + (u64)(i / D::PARTS) * D::W_BYTES, x + (u64)(i / D::PARTS) * D::X_BYTES, \
                         i % D::PARTS);                                                            \
        return s;                                                                                  \
    }
    switch (ty) {
    case GGML_Q4_0: ROW_DOT(GGML_Q4_0)
    case GGML_Q4_1: ROW_DOT(GGML_Q4_1)
    case GGML_Q5_0: ROW_DOT(GGML_Q5_0)
    case GGML_Q5_1: ROW_DOT(GGML_Q5_1)
    case GGML_Q8_0: ROW_DOT(GGML_Q8_0)
    case GGML_Q4_K: ROW_DOT(GGML_Q4_K)
    case GGML_Q5_K: ROW_DOT(GGML_Q5_K)
    case GGML_Q6_K: ROW_DOT(GGML_Q6_K)
    case GGML_F16: ROW_DOT(GGML_F16)
    case GGML_F32: ROW_DOT(GGML_F32)
    default: return __int_as_float(0x7fc00000);
    }
#undef ROW_DOT
}
