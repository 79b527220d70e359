// Quantized matrix times activation rows, `y[t][r] = W[r] · x[t]`, with the
// activations already in the weight type's vec-dot type (`quantize.cu`),
// in the CPU engine's float order (`cpu_order.cuh`), so each output equals
// the CPU's bit for bit.
//
// A group of 8 threads per weight row, one per lane of the CPU's kernel
// (`row_product` and its lane primitives), and up to TOKENS activation rows
// (grid.y walks the rest). `order` is how the CPU computes this matrix for
// this batch (ORDER_*); for repacked Q4_K the first `gemm_rows` tokens take
// the gemm's order, the rest the gemv's.
#include "common.cuh"
#include "cpu_order.cuh"

#define TOKENS 8

template <int TYPE>
__device__ void matvec(const u8* __restrict__ w, u64 w_row_bytes, const u8* __restrict__ x, u64 x_row_bytes,
                       float* __restrict__ y, u64 y_stride, int rows, int n_tokens, int cols, int order,
                       int gemm_rows) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / CPU_LANES;
    int t0 = blockIdx.y * TOKENS;
    // Groups past the last row compute the last row again and write nothing:
    // every thread of a warp must reach the shuffles.
    bool live = row < rows;
    const u8* wr = w + (u64)(live ? row : rows - 1) * w_row_bytes;
    for (int t = t0; t < t0 + TOKENS && t < n_tokens; ++t) {
        int ord = order == ORDER_REPACK_GEMV && t < gemm_rows ? ORDER_REPACK_GEMM : order;
        float s = row_product<TYPE>(wr, x + (u64)t * x_row_bytes, cols, ord);
        if (live && threadIdx.x % CPU_LANES == 0) y[(u64)t * y_stride + row] = s;
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
