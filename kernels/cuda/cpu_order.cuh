// Weight-row × activation-row products in the CPU engine's float order
// (`leanstream_kernels::matmul`, which reproduces llama.cpp's CPU backend),
// so the device's outputs equal the CPU's bit for bit and not only to
// rounding: on small Q4 models one rounding step in a layer's output can
// change a greedy token (the README's H200 run).
//
// The integer sum of any group of products is exact, so only the float
// steps need the CPU's order. The CPU computes an output one of five ways
// (`cuda/src/order.rs` picks it per matrix and batch, from the kernels
// crate's own dispatch):
//   ORDER_LANES        ggml_vec_dot_*'s AVX2 kernels: eight f32 lanes, lane k
//                      taking the products of bytes 4k..4k+3 of each 32-byte
//                      vector, one fma per block, then hsum_float_8
//                      ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)); the float
//                      types keep 4 × 16 lanes;
//   ORDER_TILED        the tiled K-quant matmul (8+ activation rows): one
//                      integer sum per super-block, one chain of fmas;
//   ORDER_REPACK_GEMM  repacked Q4_K, the rows the gemm takes: one fma per
//                      pair of 32-value sub-blocks;
//   ORDER_REPACK_GEMV  repacked Q4_K, the other rows: one fma per super-block;
//   ORDER_GENERIC      where the CPU has no AVX2 (an Arm host such as a
//                      Jetson), the vec-dot's generic C instead of the
//                      lanes: one chain of rounded products and adds per
//                      block (the K-quants: eight lanes by value index mod
//                      8, added in order at the end; the float types in f64).
//
// Each lane function below is one CPU lane's whole chain over a row, and
// `row_product` at the end composes them, so a device thread and the host
// harness (`cuda/tests/cpu_order.rs`, which compiles this file with the
// host's C++ compiler) run the same code; only the few lane primitives
// (the group's sums: shuffles there, loops here) differ in form, not in
// order.
#pragma once
#include "blocks.cuh"

#define ORDER_LANES 0
#define ORDER_TILED 1
#define ORDER_REPACK_GEMM 2
#define ORDER_REPACK_GEMV 3
#define ORDER_GENERIC 4

#define CPU_LANES 8

// hsum_float_8 of eight lane values.
HD float hsum8(const float* a) {
    return add_rn(add_rn(add_rn(a[0], a[4]), add_rn(a[2], a[6])), add_rn(add_rn(a[1], a[5]), add_rn(a[3], a[7])));
}

// Byte b (0..32) of a 32-value block's unpacked nibbles: low nibbles first.
HD i32 nibble(const u8* qs, int b) { return b < 16 ? (qs[b] & 15) : (qs[b - 16] >> 4); }

// Q4_K/Q5_K sub-block scale and min (`blocks::scale_min_k4`).
HD void k4_scale_min(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sum of Q8_K's bsums of 32-value sub-block s.
HD i32 q8k_sub_sum(const BlockQ8K* y, int s) { return (i32)y->bsums[2 * s] + (i32)y->bsums[2 * s + 1]; }

// ---------------------------------------------------------------------------
// ORDER_LANES: lane k's chain over `nb` blocks. `side` gets the type's
// scalar chain where it has one (`summs` of Q4_1/Q5_1/Q5_K; Q4_K's min
// accumulator lane k % 4), computed by every lane alike.

template <int TYPE> struct Legacy;
template <> struct Legacy<GGML_Q4_0> { typedef BlockQ4_0 W; typedef BlockQ8_0 X; static constexpr bool MIN = false; };
template <> struct Legacy<GGML_Q4_1> { typedef BlockQ4_1 W; typedef BlockQ8_1 X; static constexpr bool MIN = true; };
template <> struct Legacy<GGML_Q5_0> { typedef BlockQ5_0 W; typedef BlockQ8_0 X; static constexpr bool MIN = false; };
template <> struct Legacy<GGML_Q5_1> { typedef BlockQ5_1 W; typedef BlockQ8_1 X; static constexpr bool MIN = true; };
template <> struct Legacy<GGML_Q8_0> { typedef BlockQ8_0 W; typedef BlockQ8_0 X; static constexpr bool MIN = false; };

// The K-quants' weight blocks by type id.
template <int TYPE> struct KBlock;
template <> struct KBlock<GGML_Q4_K> { typedef BlockQ4K W; };
template <> struct KBlock<GGML_Q5_K> { typedef BlockQ5K W; };
template <> struct KBlock<GGML_Q6_K> { typedef BlockQ6K W; };

// Value b (0..32) of a 32-value weight block, its offset applied.
template <int TYPE> HD i32 legacy_value(const u8* wb, int b) {
    const typename Legacy<TYPE>::W* w = (const typename Legacy<TYPE>::W*)wb;
    if constexpr (TYPE == GGML_Q8_0) {
        return (i32)w->qs[b];
    } else if constexpr (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1) {
        return nibble(w->qs, b) - (TYPE == GGML_Q4_0 ? 8 : 0);
    } else {
        i32 v = nibble(w->qs, b) | (i32)((((u32)load_i32(w->qh) >> b) & 1u) << 4);
        return v - (TYPE == GGML_Q5_0 ? 16 : 0);
    }
}

// The 32-value formats: integer lane k of one block.
template <int TYPE> HD i32 legacy_lane_int(const u8* wb, const u8* xb, int k) {
    const i8* y = ((const typename Legacy<TYPE>::X*)xb)->qs;
    i32 s = 0;
    for (int b = 4 * k; b < 4 * k + 4; ++b) s += legacy_value<TYPE>(wb, b) * (i32)y[b];
    return s;
}

// acc = fma(d_w · d_x, lane, acc) per block; the _1 formats' `summs =
// fma(m_w, s_x, summs)` beside it (every block's `d` and `m` come first in
// these blocks, `d` then `m`/`s` in the activations').
template <int TYPE> HD float legacy_lane_chain(const u8* w, const u8* x, int nb, int k, float* side) {
    typedef Legacy<TYPE> L;
    float acc = 0.0f, summs = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const u8* wb = w + (u64)i * sizeof(typename L::W);
        const u8* xb = x + (u64)i * sizeof(typename L::X);
        u16 wd = (u16)load_i16(wb), xd = (u16)load_i16(xb);
        if (L::MIN) summs = fma_rn(half_to_float((u16)load_i16(wb + 2)), half_to_float((u16)load_i16(xb + 2)), summs);
        float d = mul_rn(half_to_float(wd), half_to_float(xd));
        acc = fma_rn(d, (float)legacy_lane_int<TYPE>(wb, xb, k), acc);
    }
    *side = summs;
    return acc;
}

// Q4_K: lane k of Σ_j sc[2j]·Σ lo·y + sc[2j+1]·Σ hi·y; the mins through
// four lanes of `mins[2q]·S[2q] + mins[2q+1]·S[2q+1]` (S: sub-block sums).
HD float q4_k_lane_chain(const u8* w, const u8* x, int nb, int k, float* side) {
    float acc = 0.0f, acc_m = 0.0f;
    int q = k % 4;
    for (int i = 0; i < nb; ++i) {
        const BlockQ4K* wb = (const BlockQ4K*)(w + (u64)i * sizeof(BlockQ4K));
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        i32 s = 0;
        for (int j = 0; j < 4; ++j) {
            int sc_lo, sc_hi, m;
            k4_scale_min(2 * j, wb->scales, &sc_lo, &m);
            k4_scale_min(2 * j + 1, wb->scales, &sc_hi, &m);
            i32 lo = 0, hi = 0;
            for (int b = 4 * k; b < 4 * k + 4; ++b) {
                lo += (wb->qs[32 * j + b] & 15) * (i32)y->qs[64 * j + b];
                hi += (wb->qs[32 * j + b] >> 4) * (i32)y->qs[64 * j + 32 + b];
            }
            s += sc_lo * lo + sc_hi * hi;
        }
        int sc, m0, m1;
        k4_scale_min(2 * q, wb->scales, &sc, &m0);
        k4_scale_min(2 * q + 1, wb->scales, &sc, &m1);
        i32 prod = m0 * q8k_sub_sum(y, 2 * q) + m1 * q8k_sub_sum(y, 2 * q + 1);
        float yd = load_f32(&y->d);
        float dmin = mul_rn(-yd, half_to_float(wb->dmin));
        acc_m = fma_rn(dmin, (float)prod, acc_m);
        acc = fma_rn(mul_rn(yd, half_to_float(wb->d)), (float)s, acc);
    }
    *side = acc_m;
    return acc;
}

// Q5_K: as Q4_K with the fifth bits (bits 2j, 2j+1 of qh[b]); the mins'
// integer total goes into one scalar `summs` chain.
HD float q5_k_lane_chain(const u8* w, const u8* x, int nb, int k, float* side) {
    float acc = 0.0f, summs = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const BlockQ5K* wb = (const BlockQ5K*)(w + (u64)i * sizeof(BlockQ5K));
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        i32 s = 0, mins = 0;
        for (int j = 0; j < 4; ++j) {
            int sc_lo, sc_hi, m_lo, m_hi;
            k4_scale_min(2 * j, wb->scales, &sc_lo, &m_lo);
            k4_scale_min(2 * j + 1, wb->scales, &sc_hi, &m_hi);
            i32 lo = 0, hi = 0;
            for (int b = 4 * k; b < 4 * k + 4; ++b) {
                i32 v_lo = (wb->qs[32 * j + b] & 15) + (((wb->qh[b] >> (2 * j)) & 1) << 4);
                i32 v_hi = (wb->qs[32 * j + b] >> 4) + (((wb->qh[b] >> (2 * j + 1)) & 1) << 4);
                lo += v_lo * (i32)y->qs[64 * j + b];
                hi += v_hi * (i32)y->qs[64 * j + 32 + b];
            }
            s += sc_lo * lo + sc_hi * hi;
            mins += m_lo * q8k_sub_sum(y, 2 * j) + m_hi * q8k_sub_sum(y, 2 * j + 1);
        }
        float yd = load_f32(&y->d);
        summs = fma_rn(mul_rn(-yd, half_to_float(wb->dmin)), (float)mins, summs);
        acc = fma_rn(mul_rn(yd, half_to_float(wb->d)), (float)s, acc);
    }
    *side = summs;
    return acc;
}

// Q6_K value e of quarter kk of half j, unsigned (0..63), at byte b.
HD i32 q6_value(const BlockQ6K* w, int j, int kk, int b) {
    const u8* ql = w->ql + 64 * j + (kk % 2) * 32;
    u8 h = w->qh[32 * j + b];
    i32 low = kk < 2 ? (ql[b] & 15) : (ql[b] >> 4);
    return low | (((h >> (2 * kk)) & 3) << 4);
}

// Q6_K: lane l of Σ sc·Σ q·y over the 8 quarters (scale 2i for bytes 0..15
// of quarter i, 2i+1 for 16..31), minus 32·(bsums·scales) of pair l.
HD float q6_k_lane_chain(const u8* w, const u8* x, int nb, int l, float* side) {
    float acc = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const BlockQ6K* wb = (const BlockQ6K*)(w + (u64)i * sizeof(BlockQ6K));
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        i32 s = 0;
        for (int j = 0; j < 2; ++j) {
            for (int kk = 0; kk < 4; ++kk) {
                i32 sc = wb->scales[2 * (4 * j + kk) + (l >= 4 ? 1 : 0)];
                i32 dot = 0;
                for (int b = 4 * l; b < 4 * l + 4; ++b) dot += q6_value(wb, j, kk, b) * (i32)y->qs[128 * j + 32 * kk + b];
                s += sc * dot;
            }
        }
        s -= 32 * ((i32)y->bsums[2 * l] * wb->scales[2 * l] + (i32)y->bsums[2 * l + 1] * wb->scales[2 * l + 1]);
        acc = fma_rn(mul_rn(load_f32(&y->d), half_to_float(wb->d)), (float)s, acc);
    }
    *side = 0.0f;
    return acc;
}

// F32 (and F16): four 16-lane accumulators over steps of 64 values, each
// CPU lane pair (k, k + 8) of every accumulator here; returns (hi + lo) of
// `((s0 + s2) + (s1 + s3))` at lane k, what `_mm512_reduce_add_ps` feeds to
// hsum_float_8. The values past the last whole 64 are the tail's.
template <bool HALF> HD float float_lane_chain(const u8* w, const u8* x, int n, int k) {
    float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int np = n & ~63;
    for (int i = 0; i < np; i += 64) {
        for (int j = 0; j < 4; ++j) {
            int a = i + 16 * j + k, b = a + 8;
            if (HALF) {
                lo[j] = fma_rn(half_to_float((u16)load_i16(w + 2 * a)), half_to_float((u16)load_i16(x + 2 * a)), lo[j]);
                hi[j] = fma_rn(half_to_float((u16)load_i16(w + 2 * b)), half_to_float((u16)load_i16(x + 2 * b)), hi[j]);
            } else {
                lo[j] = fma_rn(load_f32(w + 4 * a), load_f32(x + 4 * a), lo[j]);
                hi[j] = fma_rn(load_f32(w + 4 * b), load_f32(x + 4 * b), hi[j]);
            }
        }
    }
    float l = add_rn(add_rn(lo[0], lo[2]), add_rn(lo[1], lo[3]));
    float h = add_rn(add_rn(hi[0], hi[2]), add_rn(hi[1], hi[3]));
    return add_rn(h, l);
}

// The float types' tail after the lanes' sum `sumf`: F32 as GCC compiled
// `sumf += x[i] * y[i]` (runs of 16, then one of 8, multiplied apart, the
// rest fused); F16 in f64.
HD float f32_tail(const u8* w, const u8* x, int n, float sumf) {
    int np = n & ~63, rest = n - np;
    int unfused = rest / 16 * 16 + (rest % 16 >= 8 ? 8 : 0);
    int i = np;
    for (; i < np + unfused; ++i) sumf = add_rn(sumf, mul_rn(load_f32(w + 4 * i), load_f32(x + 4 * i)));
    for (; i < n; ++i) sumf = fma_rn(load_f32(w + 4 * i), load_f32(x + 4 * i), sumf);
    return sumf;
}

HD float f16_tail(const u8* w, const u8* x, int n, float sumf) {
    double s = (double)sumf;
    for (int i = n & ~63; i < n; ++i)
        s += (double)mul_rn(half_to_float((u16)load_i16(w + 2 * i)), half_to_float((u16)load_i16(x + 2 * i)));
    return (float)s;
}

// ---------------------------------------------------------------------------
// One-chain orders: lane k's share of a super-block's exact integer sums
// (`parts`), then the chain's float step on the totals.

// Tiled Q6_K: lane k takes sub-blocks 2k, 2k+1 of 16 values:
// Σ sc·(Σ q·y − 32·bsum).
HD i32 q6_k_tiled_part(const BlockQ6K* w, const BlockQ8K* y, int k) {
    i32 s = 0;
    for (int sub = 2 * k; sub < 2 * k + 2; ++sub) {
        i32 dot = 0;
        for (int e = 16 * sub; e < 16 * sub + 16; ++e) {
            int j = e / 128, kk = (e % 128) / 32, b = e % 32;
            dot += q6_value(w, j, kk, b) * (i32)y->qs[e];
        }
        s += (i32)w->scales[sub] * (dot - 32 * (i32)y->bsums[sub]);
    }
    return s;
}

// acc = fma(f32(sum) · d, y.d, acc).
HD float q6_k_tiled_step(const BlockQ6K* w, const BlockQ8K* y, i32 sum, float acc) {
    return fma_rn(mul_rn((float)sum, half_to_float(w->d)), load_f32(&y->d), acc);
}

// Q4_K/Q5_K value e of sub-block `sub` (0..7), unsigned.
template <int TYPE> HD i32 k4_value(const u8* wb, int sub, int b);
template <> HD i32 k4_value<GGML_Q4_K>(const u8* wb, int sub, int b) {
    const BlockQ4K* w = (const BlockQ4K*)wb;
    u8 q = w->qs[32 * (sub / 2) + b];
    return sub % 2 == 0 ? (q & 15) : (q >> 4);
}
template <> HD i32 k4_value<GGML_Q5_K>(const u8* wb, int sub, int b) {
    const BlockQ5K* w = (const BlockQ5K*)wb;
    u8 q = w->qs[32 * (sub / 2) + b];
    i32 low = sub % 2 == 0 ? (q & 15) : (q >> 4);
    return low | (((w->qh[b] >> sub) & 1) << 4);
}

// Sub-block `sub` of a Q4_K/Q5_K block: scale · Σ q·y and min · bsum.
template <int TYPE> HD void k4_sub_sums(const u8* wb, const BlockQ8K* y, int sub, i32* dot, i32* min) {
    const u8* scales = wb + 4;  // after d and dmin in both formats
    int sc, m;
    k4_scale_min(sub, scales, &sc, &m);
    i32 s = 0;
    for (int b = 0; b < 32; ++b) s += k4_value<TYPE>(wb, sub, b) * (i32)y->qs[32 * sub + b];
    *dot = sc * s;
    *min = m * q8k_sub_sum(y, sub);
}

// Tiled Q4_K/Q5_K: r = fma(−dmin, f32(Σ min), f32(Σ dot) · d); acc = fma(r, y.d, acc).
HD float k4_tiled_step(const u8* wb, const BlockQ8K* y, i32 dot, i32 min, float acc) {
    float d = half_to_float((u16)load_i16(wb)), dmin = half_to_float((u16)load_i16(wb + 2));
    float r = fma_rn(-dmin, (float)min, mul_rn((float)dot, d));
    return fma_rn(r, load_f32(&y->d), acc);
}

// Repacked Q4_K: acc = fma(f32(dot), d · y.d, acc), acc_min likewise with
// dmin, per pair of sub-blocks (gemm) or per super-block (gemv); the output
// is acc − acc_min.
HD void repack_step(const BlockQ4K* w, const BlockQ8K* y, i32 dot, i32 min, float* acc, float* acc_min) {
    float yd = load_f32(&y->d);
    *acc = fma_rn((float)dot, mul_rn(half_to_float(w->d), yd), *acc);
    *acc_min = fma_rn((float)min, mul_rn(half_to_float(w->dmin), yd), *acc_min);
}

// ---------------------------------------------------------------------------
// ORDER_GENERIC (`leanstream_kernels::dot`'s scalar twins, GGML's generic C).

// The 32-value formats: `sumf += term(block)`, the block's integer sum (the
// lanes' parts of `legacy_lane_int`) rounded into each type's expression.
template <int TYPE> HD float legacy_generic_step(const u8* wb, const u8* xb, i32 sumi, float sumf) {
    float dx = half_to_float((u16)load_i16(wb)), dy = half_to_float((u16)load_i16(xb));
    float s = (float)sumi;
    float term;
    if (TYPE == GGML_Q4_0) {
        term = mul_rn(mul_rn(s, dx), dy);
    } else if (TYPE == GGML_Q8_0) {
        term = mul_rn(s, mul_rn(dx, dy));
    } else if (Legacy<TYPE>::MIN) {
        float m = mul_rn(half_to_float((u16)load_i16(wb + 2)), half_to_float((u16)load_i16(xb + 2)));
        term = add_rn(mul_rn(mul_rn(dx, dy), s), m);
    } else {
        term = mul_rn(mul_rn(dx, dy), s);
    }
    return add_rn(sumf, term);
}

// The K-quants' lane l (values with index ≡ l mod 8): Σ scale · q · y of
// one block, exact. Q4_K/Q5_K subtract nothing here (their mins come apart);
// Q6_K's values are signed (q − 32).
template <int TYPE> HD i32 k_generic_lane_int(const u8* wb, const BlockQ8K* y, int l) {
    i32 s = 0;
    if constexpr (TYPE == GGML_Q6_K) {
        const BlockQ6K* w = (const BlockQ6K*)wb;
        for (int e = l; e < QK_K; e += 8) {
            int j = e / 128, kk = (e % 128) / 32, b = e % 32;
            s += (i32)w->scales[e / 16] * ((q6_value(w, j, kk, b) - 32) * (i32)y->qs[e]);
        }
    } else {
        for (int sub = 0; sub < QK_K / 32; ++sub) {
            int sc, m;
            k4_scale_min(sub, wb + 4, &sc, &m);
            for (int b = l; b < 32; b += 8) s += sc * (k4_value<TYPE>(wb, sub, b) * (i32)y->qs[32 * sub + b]);
        }
    }
    return s;
}

// Lane l's chain `sums[l] += d · aux[l]` over the row (rounded product,
// then add); for Q4_K/Q5_K `side` gets the mins' chain `sumf -= dmin · y.d
// · Σ bsum · min`, which the lanes' sums are added to in order at the end.
template <int TYPE, typename W> HD float k_generic_lane_chain(const u8* w, const u8* x, int nb, int l, float* side) {
    float sum = 0.0f, sumf = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const u8* wb = w + (u64)i * sizeof(W);
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        float yd = load_f32(&y->d);
        if constexpr (TYPE == GGML_Q6_K) {
            float d = mul_rn(half_to_float(((const BlockQ6K*)wb)->d), yd);
            sum = add_rn(sum, mul_rn(d, (float)k_generic_lane_int<TYPE>(wb, y, l)));
        } else {
            i32 mins = 0;
            for (int j = 0; j < QK_K / 16; ++j) {
                int sc, m;
                k4_scale_min(j / 2, wb + 4, &sc, &m);
                mins += (i32)y->bsums[j] * m;
            }
            float d = half_to_float((u16)load_i16(wb)), dmin = half_to_float((u16)load_i16(wb + 2));
            sum = add_rn(sum, mul_rn(mul_rn(d, yd), (float)k_generic_lane_int<TYPE>(wb, y, l)));
            sumf = add_rn(sumf, -mul_rn(mul_rn(dmin, yd), (float)mins));
        }
    }
    *side = sumf;
    return sum;
}

// F32/F16: f32 products summed in f64, in order.
template <bool HALF> HD float float_generic(const u8* w, const u8* x, int n) {
    double s = 0.0;
    for (int i = 0; i < n; ++i) {
        float p = HALF ? mul_rn(half_to_float((u16)load_i16(w + 2 * i)), half_to_float((u16)load_i16(x + 2 * i)))
                       : mul_rn(load_f32(w + 4 * i), load_f32(x + 4 * i));
        s += (double)p;
    }
    return (float)s;
}

// ---------------------------------------------------------------------------
// The lanes together. On the device a group of 8 threads is one row's lanes
// (thread k: lane threadIdx.x % 8), and the group's sums are shuffles; on
// the host (`cuda/tests/harness/cpu_order.cpp`) a `PerLane` holds all eight
// and the sums are loops. Everything above and `row_product` below is the
// same code on both; only these few primitives differ in form.

// A lane's chain and its side chain.
struct LaneChain {
    float acc;
    float side;
};

// A lane's share of a block's integer sums.
struct LaneInts {
    i32 dot;
    i32 min;
};

#ifdef __CUDACC__
// The shuffles name only the thread's own group (its 8 lanes of the warp),
// so groups of one warp may run apart: the streaming FFN's groups each wait
// on their own bundle's flag.
__device__ __forceinline__ unsigned group_mask() { return 0xFFu << (threadIdx.x & (WARP - CPU_LANES)); }

template <typename T> struct PerLane {
    T v;
};

// `f(k)` for this thread's lane.
template <typename F> __device__ __forceinline__ auto per_lane(F f) {
    return PerLane<decltype(f(0))>{f((int)(threadIdx.x % CPU_LANES))};
}

// hsum_float_8 of the lanes' `acc`: after the xor-4 step lane i holds
// a_i + a_(i^4), after xor-2 (a_i + a_(i^4)) + (a_(i^2) + a_(i^6)), then the
// two halves; every lane ends with the CPU's sum (float adds commute).
__device__ __forceinline__ float hsum8_acc(PerLane<LaneChain> p) {
    float v = p.v.acc;
    v = add_rn(v, __shfl_xor_sync(group_mask(), v, 4));
    v = add_rn(v, __shfl_xor_sync(group_mask(), v, 2));
    return add_rn(v, __shfl_xor_sync(group_mask(), v, 1));
}

// Q4_K's min lanes 0..3 as `(m0 + m2) + (m1 + m3)` (lanes 4..7 repeat them).
__device__ __forceinline__ float hsum4_side(PerLane<LaneChain> p) {
    float v = p.v.side;
    v = add_rn(v, __shfl_xor_sync(group_mask(), v, 2));
    return add_rn(v, __shfl_xor_sync(group_mask(), v, 1));
}

__device__ __forceinline__ float side_of_lane0(PerLane<LaneChain> p) {
    return __shfl_sync(group_mask(), p.v.side, 0, CPU_LANES);
}

__device__ __forceinline__ float acc_of_lane(PerLane<LaneChain> p, int l) {
    return __shfl_sync(group_mask(), p.v.acc, l, CPU_LANES);
}

__device__ __forceinline__ i32 isum8(i32 v) {
    v += __shfl_xor_sync(group_mask(), v, 4);
    v += __shfl_xor_sync(group_mask(), v, 2);
    return v + __shfl_xor_sync(group_mask(), v, 1);
}

__device__ __forceinline__ LaneInts sum_ints(PerLane<LaneInts> p) { return LaneInts{isum8(p.v.dot), isum8(p.v.min)}; }

// Lanes 2·pair and 2·pair + 1 summed.
__device__ __forceinline__ LaneInts pair_ints(PerLane<LaneInts> p, int pair) {
    i32 dot = p.v.dot + __shfl_xor_sync(group_mask(), p.v.dot, 1);
    i32 min = p.v.min + __shfl_xor_sync(group_mask(), p.v.min, 1);
    return LaneInts{__shfl_sync(group_mask(), dot, 2 * pair, CPU_LANES), __shfl_sync(group_mask(), min, 2 * pair, CPU_LANES)};
}
#else
template <typename T> struct PerLane {
    T v[CPU_LANES];
};

template <typename F> inline auto per_lane(F f) {
    PerLane<decltype(f(0))> p;
    for (int k = 0; k < CPU_LANES; ++k) p.v[k] = f(k);
    return p;
}

inline float hsum8_acc(const PerLane<LaneChain>& p) {
    float a[CPU_LANES];
    for (int k = 0; k < CPU_LANES; ++k) a[k] = p.v[k].acc;
    return hsum8(a);
}

inline float hsum4_side(const PerLane<LaneChain>& p) {
    return add_rn(add_rn(p.v[0].side, p.v[2].side), add_rn(p.v[1].side, p.v[3].side));
}

inline float side_of_lane0(const PerLane<LaneChain>& p) { return p.v[0].side; }

inline float acc_of_lane(const PerLane<LaneChain>& p, int l) { return p.v[l].acc; }

inline LaneInts sum_ints(const PerLane<LaneInts>& p) {
    LaneInts t = {0, 0};
    for (int k = 0; k < CPU_LANES; ++k) {
        t.dot += p.v[k].dot;
        t.min += p.v[k].min;
    }
    return t;
}

inline LaneInts pair_ints(const PerLane<LaneInts>& p, int pair) {
    return LaneInts{p.v[2 * pair].dot + p.v[2 * pair + 1].dot, p.v[2 * pair].min + p.v[2 * pair + 1].min};
}
#endif

// Tiled Q4_K/Q5_K and repacked Q4_K: lane k takes sub-block k; the chain
// steps on the block's totals (or, in the gemm's order, its pairs').
template <int TYPE>
HD float k4_one_chain(const u8* w, const u8* x, int nb, int order) {
    typedef typename KBlock<TYPE>::W W;
    float acc = 0.0f, acc_min = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const u8* wb = w + (u64)i * sizeof(W);
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        auto parts = per_lane([&](int k) {
            LaneInts r;
            k4_sub_sums<TYPE>(wb, y, k, &r.dot, &r.min);
            return r;
        });
        if (order == ORDER_REPACK_GEMM) {
            for (int p = 0; p < 4; ++p) {
                LaneInts s = pair_ints(parts, p);
                repack_step((const BlockQ4K*)wb, y, s.dot, s.min, &acc, &acc_min);
            }
        } else if (order == ORDER_TILED) {
            LaneInts s = sum_ints(parts);
            acc = k4_tiled_step(wb, y, s.dot, s.min, acc);
        } else {
            LaneInts s = sum_ints(parts);
            repack_step((const BlockQ4K*)wb, y, s.dot, s.min, &acc, &acc_min);
        }
    }
    return order == ORDER_TILED ? acc : add_rn(acc, -acc_min);
}

// ORDER_GENERIC: the 32-value formats' one chain on the lanes' integer
// sums; the K-quants' eight lane chains added to the mins' chain in lane
// order; the float types' f64 chain, in every lane alike.
template <int TYPE>
HD float generic_product(const u8* w, const u8* x, int cols) {
    if constexpr (TYPE == GGML_F16 || TYPE == GGML_F32) {
        return float_generic<TYPE == GGML_F16>(w, x, cols);
    } else if constexpr (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K || TYPE == GGML_Q6_K) {
        auto lanes = per_lane([&](int l) {
            LaneChain r;
            r.acc = k_generic_lane_chain<TYPE, typename KBlock<TYPE>::W>(w, x, cols / QK_K, l, &r.side);
            return r;
        });
        float out = side_of_lane0(lanes);
        for (int l = 0; l < CPU_LANES; ++l) out = add_rn(out, acc_of_lane(lanes, l));
        return out;
    } else {
        typedef Legacy<TYPE> L;
        float sumf = 0.0f;
        for (int i = 0; i < cols / QK; ++i) {
            const u8* wb = w + (u64)i * sizeof(typename L::W);
            const u8* xb = x + (u64)i * sizeof(typename L::X);
            auto parts = per_lane([&](int k) { return LaneInts{legacy_lane_int<TYPE>(wb, xb, k), 0}; });
            sumf = legacy_generic_step<TYPE>(wb, xb, sum_ints(parts).dot, sumf);
        }
        return sumf;
    }
}

// One output of weight row `w` (type TYPE) with activation row `x` (its
// dot type), `cols` values, in order `order` (ORDER_*; the repacked orders
// as resolved for this token). On the device every lane of the group
// returns it.
template <int TYPE>
HD float row_product(const u8* w, const u8* x, int cols, int order) {
    if (order == ORDER_GENERIC) return generic_product<TYPE>(w, x, cols);
    if constexpr (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1 || TYPE == GGML_Q5_0 || TYPE == GGML_Q5_1 ||
                  TYPE == GGML_Q8_0) {
        auto c = per_lane([&](int k) {
            LaneChain r;
            r.acc = legacy_lane_chain<TYPE>(w, x, cols / QK, k, &r.side);
            return r;
        });
        float s = hsum8_acc(c);
        return Legacy<TYPE>::MIN ? add_rn(s, side_of_lane0(c)) : s;
    } else if constexpr (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K) {
        if (order != ORDER_LANES) return k4_one_chain<TYPE>(w, x, cols / QK_K, order);
        auto c = per_lane([&](int k) {
            LaneChain r;
            r.acc = TYPE == GGML_Q4_K ? q4_k_lane_chain(w, x, cols / QK_K, k, &r.side)
                                      : q5_k_lane_chain(w, x, cols / QK_K, k, &r.side);
            return r;
        });
        // Q4_K's mins come in four lanes, Q5_K's in one scalar chain.
        return add_rn(hsum8_acc(c), TYPE == GGML_Q4_K ? hsum4_side(c) : side_of_lane0(c));
    } else if constexpr (TYPE == GGML_Q6_K) {
        if (order != ORDER_LANES) {
            float acc = 0.0f;
            for (int i = 0; i < cols / QK_K; ++i) {
                const BlockQ6K* wb = (const BlockQ6K*)(w + (u64)i * sizeof(BlockQ6K));
                const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
                auto parts = per_lane([&](int k) { return LaneInts{q6_k_tiled_part(wb, y, k), 0}; });
                acc = q6_k_tiled_step(wb, y, sum_ints(parts).dot, acc);
            }
            return acc;
        }
        auto c = per_lane([&](int k) {
            LaneChain r;
            r.acc = q6_k_lane_chain(w, x, cols / QK_K, k, &r.side);
            return r;
        });
        return hsum8_acc(c);
    } else {
        constexpr bool HALF = TYPE == GGML_F16;
        auto c = per_lane([&](int k) { return LaneChain{float_lane_chain<HALF>(w, x, cols, k), 0.0f}; });
        return HALF ? f16_tail(w, x, cols, hsum8_acc(c)) : f32_tail(w, x, cols, hsum8_acc(c));
    }
}

// `row_product` for a type id known only at run time. NaN for a type the
// device has no product for (the host checks types first).
HD float row_product_of(int ty, const u8* w, const u8* x, int cols, int order) {
    switch (ty) {
    case GGML_Q4_0: return row_product<GGML_Q4_0>(w, x, cols, order);
    case GGML_Q4_1: return row_product<GGML_Q4_1>(w, x, cols, order);
    case GGML_Q5_0: return row_product<GGML_Q5_0>(w, x, cols, order);
    case GGML_Q5_1: return row_product<GGML_Q5_1>(w, x, cols, order);
    case GGML_Q8_0: return row_product<GGML_Q8_0>(w, x, cols, order);
    case GGML_Q4_K: return row_product<GGML_Q4_K>(w, x, cols, order);
    case GGML_Q5_K: return row_product<GGML_Q5_K>(w, x, cols, order);
    case GGML_Q6_K: return row_product<GGML_Q6_K>(w, x, cols, order);
    case GGML_F16: return row_product<GGML_F16>(w, x, cols, order);
    case GGML_F32: return row_product<GGML_F32>(w, x, cols, order);
    default: {
        u32 nan = 0x7fc00000u;
        return load_f32(&nan);
    }
    }
}
