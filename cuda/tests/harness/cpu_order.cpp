// The device matvec's arithmetic (`kernels/cuda/cpu_order.cuh`) compiled for
// the host, for `cpu_order.rs`: the same lane functions, composed as
// `matvec.cu`'s `row_product` composes them, with the group's shuffles as
// loops over its eight lanes.
#include "cpu_order.cuh"

#define LANES CPU_LANES

// `group_hsum4` of `matvec.cu`: lanes 0..3 as (m0 + m2) + (m1 + m3).
static float hsum4(const float* m) { return add_rn(add_rn(m[0], m[2]), add_rn(m[1], m[3])); }

template <int TYPE, typename W>
static float k4_one_chain(const u8* w, const u8* x, int nb, int order) {
    float acc = 0.0f, acc_min = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const u8* wb = w + (u64)i * sizeof(W);
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        i32 dot[LANES], min[LANES];
        for (int k = 0; k < LANES; ++k) k4_sub_sums<TYPE>(wb, y, k, &dot[k], &min[k]);
        if (order == ORDER_REPACK_GEMM) {
            for (int p = 0; p < 4; ++p)
                repack_step((const BlockQ4K*)wb, y, dot[2 * p] + dot[2 * p + 1], min[2 * p] + min[2 * p + 1], &acc,
                            &acc_min);
            continue;
        }
        i32 d = 0, m = 0;
        for (int k = 0; k < LANES; ++k) {
            d += dot[k];
            m += min[k];
        }
        if (order == ORDER_TILED) {
            acc = k4_tiled_step(wb, y, d, m, acc);
        } else {
            repack_step((const BlockQ4K*)wb, y, d, m, &acc, &acc_min);
        }
    }
    return order == ORDER_TILED ? acc : add_rn(acc, -acc_min);
}

template <int TYPE>
static float generic_product(const u8* w, const u8* x, int cols) {
    if constexpr (TYPE == GGML_F16 || TYPE == GGML_F32) {
        return float_generic<TYPE == GGML_F16>(w, x, cols);
    } else if constexpr (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K || TYPE == GGML_Q6_K) {
        typedef typename KBlock<TYPE>::W W;
        float lane[LANES], side[LANES];
        for (int l = 0; l < LANES; ++l) lane[l] = k_generic_lane_chain<TYPE, W>(w, x, cols / QK_K, l, &side[l]);
        float out = side[0];
        for (int l = 0; l < LANES; ++l) out = add_rn(out, lane[l]);
        return out;
    } else {
        typedef Legacy<TYPE> L;
        float sumf = 0.0f;
        for (int i = 0; i < cols / QK; ++i) {
            const u8* wb = w + (u64)i * sizeof(typename L::W);
            const u8* xb = x + (u64)i * sizeof(typename L::X);
            i32 s = 0;
            for (int k = 0; k < LANES; ++k) s += legacy_lane_int<TYPE>(wb, xb, k);
            sumf = legacy_generic_step<TYPE>(wb, xb, s, sumf);
        }
        return sumf;
    }
}

template <int TYPE>
static float row_product(const u8* w, const u8* x, int cols, int order) {
    if (order == ORDER_GENERIC) return generic_product<TYPE>(w, x, cols);
    float a[LANES], side[LANES];
    if constexpr (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1 || TYPE == GGML_Q5_0 || TYPE == GGML_Q5_1 ||
                  TYPE == GGML_Q8_0) {
        for (int k = 0; k < LANES; ++k) a[k] = legacy_lane_chain<TYPE>(w, x, cols / QK, k, &side[k]);
        float s = hsum8(a);
        return Legacy<TYPE>::MIN ? add_rn(s, side[0]) : s;
    } else if constexpr (TYPE == GGML_Q4_K) {
        if (order != ORDER_LANES) return k4_one_chain<GGML_Q4_K, BlockQ4K>(w, x, cols / QK_K, order);
        for (int k = 0; k < LANES; ++k) a[k] = q4_k_lane_chain(w, x, cols / QK_K, k, &side[k]);
        return add_rn(hsum8(a), hsum4(side));
    } else if constexpr (TYPE == GGML_Q5_K) {
        if (order != ORDER_LANES) return k4_one_chain<GGML_Q5_K, BlockQ5K>(w, x, cols / QK_K, order);
        for (int k = 0; k < LANES; ++k) a[k] = q5_k_lane_chain(w, x, cols / QK_K, k, &side[k]);
        return add_rn(hsum8(a), side[0]);
    } else if constexpr (TYPE == GGML_Q6_K) {
        if (order != ORDER_LANES) {
            float acc = 0.0f;
            for (int i = 0; i < cols / QK_K; ++i) {
                const BlockQ6K* wb = (const BlockQ6K*)(w + (u64)i * sizeof(BlockQ6K));
                const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
                i32 s = 0;
                for (int k = 0; k < LANES; ++k) s += q6_k_tiled_part(wb, y, k);
                acc = q6_k_tiled_step(wb, y, s, acc);
            }
            return acc;
        }
        for (int k = 0; k < LANES; ++k) a[k] = q6_k_lane_chain(w, x, cols / QK_K, k, &side[k]);
        return hsum8(a);
    } else if constexpr (TYPE == GGML_F16) {
        for (int k = 0; k < LANES; ++k) a[k] = float_lane_chain<true>(w, x, cols, k);
        return f16_tail(w, x, cols, hsum8(a));
    } else {
        for (int k = 0; k < LANES; ++k) a[k] = float_lane_chain<false>(w, x, cols, k);
        return f32_tail(w, x, cols, hsum8(a));
    }
}

// One output: weight row `w` of type `ty` (a GGML id) with activation row
// `x` in its dot type, `cols` values, in order `order` (ORDER_*; the
// repacked orders as the kernel resolves them per token). NaN for a type
// the device has no matvec for.
extern "C" float cpu_order_row_product(int ty, const u8* w, const u8* x, int cols, int order) {
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
    default: return __builtin_nanf("");
    }
}

extern "C" float cpu_order_half_to_float(u16 h) { return half_to_float(h); }
