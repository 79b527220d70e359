// Quantized matrix times activation rows, `y[t][r] = W[r] · x[t]`, with the
// activations already in the weight type's vec-dot type (`quantize.cu`),
// as the CPU engine and llama.cpp do: the integer sums per block are exact,
// so results differ from the CPU's only in the order float partial sums
// are added.
//
// One warp per weight row and up to TOKENS activation rows (grid.y walks
// the rest); lanes take *parts* of blocks (8 or 16 values) so narrow rows
// (576 values: 18 blocks) still use the whole warp. A warp's tokens reuse
// each part's weights from L1 rather than reading the row again.
#include "dot.cuh"

#define TOKENS 8

// `n_units`: blocks per row (for F16/F32: groups of 8 values). `y` is
// `[n_tokens][rows]` with row stride `y_stride`.
template <int TYPE>
__device__ void matvec(const u8* __restrict__ w, u64 w_row_bytes, const u8* __restrict__ x, u64 x_row_bytes,
                       float* __restrict__ y, u64 y_stride, int rows, int n_tokens, int n_units) {
    typedef Dot<TYPE> D;
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    int lane = threadIdx.x % WARP;
    int t0 = blockIdx.y * TOKENS;
    if (row >= rows || t0 >= n_tokens) return;
    int nt = min(TOKENS, n_tokens - t0);
    float acc[TOKENS];
    for (int t = 0; t < TOKENS; ++t) acc[t] = 0.0f;
    const u8* wr = w + (u64)row * w_row_bytes;
    int items = n_units * D::PARTS;
    for (int i = lane; i < items; i += WARP) {
        int b = i / D::PARTS, p = i % D::PARTS;
        const u8* wb = wr + (u64)b * D::W_BYTES;
        for (int t = 0; t < TOKENS; ++t) {
            if (t < nt) acc[t] += D::part(wb, x + (u64)(t0 + t) * x_row_bytes + (u64)b * D::X_BYTES, p);
        }
    }
    for (int t = 0; t < TOKENS; ++t) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) y[(u64)(t0 + t) * y_stride + row] = s;
    }
}

#define MATVEC(name, TYPE)                                                                                         \
    extern "C" __global__ void name(const u8* __restrict__ w, u64 w_row_bytes, const u8* __restrict__ x,          \
                                    u64 x_row_bytes, float* __restrict__ y, u64 y_stride, int rows, int n_tokens, \
                                    int n_units) {                                                                 \
        matvec<TYPE>(w, w_row_bytes, x, x_row_bytes, y, y_stride, rows, n_tokens, n_units);                      \
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
