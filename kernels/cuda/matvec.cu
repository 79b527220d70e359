// Quantized matrix times activation rows, `y[t][r] = W[r] · x[t]`, with the
// activations already in the weight type's vec-dot type (`quantize.cu`),
// in the CPU engine's float order (`cpu_order.cuh`), so each output equals
// the CPU's bit for bit.
//
// A group of 8 threads per weight row, one per lane of the CPU's kernel,
// and up to TOKENS activation rows (grid.y walks the rest). `order` is how
// the CPU computes this matrix for this batch (ORDER_*); for repacked Q4_K
// the first `gemm_rows` tokens take the gemm's order, the rest the gemv's.
#include "common.cuh"
#include "cpu_order.cuh"

#define TOKENS 8
#define FULL_MASK 0xffffffffu

// hsum_float_8 across a group: after the xor-4 step lane i holds
// a_i + a_(i^4), after xor-2 (a_i + a_(i^4)) + (a_(i^2) + a_(i^6)), then the
// two halves; every lane ends with the CPU's sum (float adds commute).
__device__ __forceinline__ float group_hsum8(float v) {
    v = add_rn(v, __shfl_xor_sync(FULL_MASK, v, 4));
    v = add_rn(v, __shfl_xor_sync(FULL_MASK, v, 2));
    return add_rn(v, __shfl_xor_sync(FULL_MASK, v, 1));
}

// Q4_K's min lanes 0..3 as `(m0 + m2) + (m1 + m3)` (lanes 4..7 repeat them).
__device__ __forceinline__ float group_hsum4(float v) {
    v = add_rn(v, __shfl_xor_sync(FULL_MASK, v, 2));
    return add_rn(v, __shfl_xor_sync(FULL_MASK, v, 1));
}

__device__ __forceinline__ i32 group_isum(i32 v) {
    v += __shfl_xor_sync(FULL_MASK, v, 4);
    v += __shfl_xor_sync(FULL_MASK, v, 2);
    return v + __shfl_xor_sync(FULL_MASK, v, 1);
}

// Tiled Q4_K/Q5_K and repacked Q4_K: lane k takes sub-block k.
template <int TYPE, typename W>
__device__ float k4_one_chain(const u8* w, const u8* x, int nb, int order, int k) {
    float acc = 0.0f, acc_min = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const u8* wb = w + (u64)i * sizeof(W);
        const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
        i32 dot, min;
        k4_sub_sums<TYPE>(wb, y, k, &dot, &min);
        if (order == ORDER_REPACK_GEMM) {
            // Pairs of sub-blocks in order: lanes 2p and 2p + 1 hold pair p.
            dot += __shfl_xor_sync(FULL_MASK, dot, 1);
            min += __shfl_xor_sync(FULL_MASK, min, 1);
            for (int p = 0; p < 4; ++p) {
                i32 dp = __shfl_sync(FULL_MASK, dot, 2 * p, CPU_LANES);
                i32 mp = __shfl_sync(FULL_MASK, min, 2 * p, CPU_LANES);
                repack_step((const BlockQ4K*)wb, y, dp, mp, &acc, &acc_min);
            }
            continue;
        }
        dot = group_isum(dot);
        min = group_isum(min);
        if (order == ORDER_TILED) {
            acc = k4_tiled_step(wb, y, dot, min, acc);
        } else {
            repack_step((const BlockQ4K*)wb, y, dot, min, &acc, &acc_min);
        }
    }
    return order == ORDER_TILED ? acc : add_rn(acc, -acc_min);
}

// ORDER_GENERIC: the 32-value formats' one chain on the lanes' integer
// sums; the K-quants' eight lane chains added to the mins' chain in lane
// order; the float types' f64 chain, in every lane alike.
template <int TYPE>
__device__ float generic_product(const u8* w, const u8* x, int cols, int k) {
    if constexpr (TYPE == GGML_F16 || TYPE == GGML_F32) {
        return float_generic<TYPE == GGML_F16>(w, x, cols);
    } else if constexpr (TYPE == GGML_Q4_K || TYPE == GGML_Q5_K || TYPE == GGML_Q6_K) {
        typedef typename KBlock<TYPE>::W W;
        float side;
        float lane = k_generic_lane_chain<TYPE, W>(w, x, cols / QK_K, k, &side);
        for (int l = 0; l < CPU_LANES; ++l) side = add_rn(side, __shfl_sync(FULL_MASK, lane, l, CPU_LANES));
        return side;
    } else {
        typedef Legacy<TYPE> L;
        float sumf = 0.0f;
        for (int i = 0; i < cols / QK; ++i) {
            const u8* wb = w + (u64)i * sizeof(typename L::W);
            const u8* xb = x + (u64)i * sizeof(typename L::X);
            sumf = legacy_generic_step<TYPE>(wb, xb, group_isum(legacy_lane_int<TYPE>(wb, xb, k)), sumf);
        }
        return sumf;
    }
}

// One output, in every lane of the group (lane k = threadIdx.x % 8).
template <int TYPE>
__device__ float row_product(const u8* w, const u8* x, int cols, int order, int k) {
    if (order == ORDER_GENERIC) return generic_product<TYPE>(w, x, cols, k);
    float side;
    if constexpr (TYPE == GGML_Q4_0 || TYPE == GGML_Q4_1 || TYPE == GGML_Q5_0 || TYPE == GGML_Q5_1 ||
                  TYPE == GGML_Q8_0) {
        float s = group_hsum8(legacy_lane_chain<TYPE>(w, x, cols / QK, k, &side));
        return Legacy<TYPE>::MIN ? add_rn(s, side) : s;
    } else if constexpr (TYPE == GGML_Q4_K) {
        if (order != ORDER_LANES) return k4_one_chain<GGML_Q4_K, BlockQ4K>(w, x, cols / QK_K, order, k);
        float s = group_hsum8(q4_k_lane_chain(w, x, cols / QK_K, k, &side));
        return add_rn(s, group_hsum4(side));
    } else if constexpr (TYPE == GGML_Q5_K) {
        if (order != ORDER_LANES) return k4_one_chain<GGML_Q5_K, BlockQ5K>(w, x, cols / QK_K, order, k);
        float s = group_hsum8(q5_k_lane_chain(w, x, cols / QK_K, k, &side));
        return add_rn(s, side);
    } else if constexpr (TYPE == GGML_Q6_K) {
        if (order != ORDER_LANES) {
            float acc = 0.0f;
            for (int i = 0; i < cols / QK_K; ++i) {
                const BlockQ6K* wb = (const BlockQ6K*)(w + (u64)i * sizeof(BlockQ6K));
                const BlockQ8K* y = (const BlockQ8K*)(x + (u64)i * sizeof(BlockQ8K));
                acc = q6_k_tiled_step(wb, y, group_isum(q6_k_tiled_part(wb, y, k)), acc);
            }
            return acc;
        }
        return group_hsum8(q6_k_lane_chain(w, x, cols / QK_K, k, &side));
    } else if constexpr (TYPE == GGML_F16) {
        return f16_tail(w, x, cols, group_hsum8(float_lane_chain<true>(w, x, cols, k)));
    } else {
        return f32_tail(w, x, cols, group_hsum8(float_lane_chain<false>(w, x, cols, k)));
    }
}

template <int TYPE>
__device__ void matvec(const u8* __restrict__ w, u64 w_row_bytes, const u8* __restrict__ x, u64 x_row_bytes,
                       float* __restrict__ y, u64 y_stride, int rows, int n_tokens, int cols, int order,
                       int gemm_rows) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / CPU_LANES;
    int k = threadIdx.x % CPU_LANES;
    int t0 = blockIdx.y * TOKENS;
    // Groups past the last row compute the last row again and write nothing:
    // every thread of a warp must reach the shuffles.
    bool live = row < rows;
    const u8* wr = w + (u64)(live ? row : rows - 1) * w_row_bytes;
    for (int t = t0; t < t0 + TOKENS && t < n_tokens; ++t) {
        int ord = order == ORDER_REPACK_GEMV && t < gemm_rows ? ORDER_REPACK_GEMM : order;
        float s = row_product<TYPE>(wr, x + (u64)t * x_row_bytes, cols, ord, k);
        if (live && k == 0) y[(u64)t * y_stride + row] = s;
    }
}

#define MATVEC(name, TYPE)                                                                                         \
    extern "C" __global__ void name(const u8* __restrict__ w, u64 w_row_bytes, const u8* __restrict__ x,          \
                                    u64 x_row_bytes, float* __restrict__ y, u64 y_stride, int rows, int n_tokens, \
                                    int cols, int order, int gemm_rows) {                                          \
        matvec<TYPE>(w, w_row_bytes, x, x_row_bytes, y, y_stride, rows, n_tokens, cols, order, gemm_rows);         \
    }

MATVEC(matvec_q4_0, GGML_Q4_0)
MATVEC(matvec_q4_1, GGML_Q4_1)
MATVEC(matvec_q5_0, GGML_Q5_0)
MATVEC(matvec_q5_1, GGML_Q5_1)
MATVEC(matvec_q8_0, GGML_Q8_0)
MATVEC(matvec_q4_k, GGML_Q4_K)
MATVEC(matvec_q5_k, GGML_Q5_K)
MATVEC(matvec_q6_k, GGML_Q6_K)
MATVEC(matvec_f16, GGML_F16)
MATVEC(matvec_f32, GGML_F32)
