// The row-wise and elementwise ops of a layer (`kernels/src/ops.rs`), with
// the CPU's numerics where they decide bits: norms accumulate squares in
// f64, the gated activations use GGML's exp and GELU table, RoPE takes the
// host's cos/sin table and the same fused multiply-adds.
#include "common.cuh"
#include "norm_mean.cuh"

// `out[r] = x[r] / rms(x[r]) * weight`, one block per row of `d` values
// (also per-head q/k norms: rows = heads, d = head_dim, in place allowed).
extern "C" __global__ void rms_norm_rows(const float* x, const float* __restrict__ weight, float* out, int d,
                                         float eps) {
    __shared__ double partial[32];
    const float* xr = x + (u64)blockIdx.x * d;
    float* outr = out + (u64)blockIdx.x * d;
    double sum = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        sum += (double)__fmul_rn(v, v);
    }
    sum = warp_sum_f64(sum);
    if (threadIdx.x % WARP == 0) partial[threadIdx.x / WARP] = sum;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < (int)(blockDim.x / WARP); ++w) total += partial[w];
    // Every thread holds the same total, so the branch is the block's.
    __shared__ float in_order;
    float mean;
    if (!norm_mean_settled(total, d, &mean)) {
        if (threadIdx.x == 0) in_order = norm_mean_in_order(xr, d);
        __syncthreads();
        mean = in_order;
    }
    float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) outr[i] = __fmul_rn(__fmul_rn(xr[i], scale), weight[i]);
}

// Rotary embedding of `n_tokens` rows of `n_heads` heads of `head_dim`, the
// first `n_rot` dims of each head rotated; `table` is per token `n_rot / 2`
// cosines then as many sines (the host's `RopeTable`, so angles are the
// CPU's bits). neox: pairs (i, i + n_rot/2), else (2i, 2i + 1).
extern "C" __global__ void rope(float* x, const float* __restrict__ table, int n_tokens, int n_heads, int head_dim,
                                int n_rot, int neox) {
    int half = n_rot / 2;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 total = (u64)n_tokens * n_heads * half;
    if (i >= total) return;
    int pair = (int)(i % half);
    u64 head = i / half;
    int t = (int)(head / n_heads);
    float* h = x + head * head_dim;
    int a = neox ? pair : 2 * pair;
    int b = neox ? pair + half : 2 * pair + 1;
    float c = table[(u64)t * n_rot + pair], s = table[(u64)t * n_rot + half + pair];
    float x0 = h[a], x1 = h[b];
    h[a] = fmaf(x0, c, -__fmul_rn(x1, s));
    h[b] = fmaf(x0, s, __fmul_rn(x1, c));
}

// `gate[i] = act(gate[i]) * up[i]`.
extern "C" __global__ void gated_activation(float* gate, const float* __restrict__ up,
                                            const float* __restrict__ gelu_table, u64 n, int act) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = gated(act, gelu_table, gate[i], up[i]);
}

// `y += x`.
extern "C" __global__ void add_assign(float* y, const float* __restrict__ x, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(y[i], x[i]);
}

// `y[t][i] += b[i]` for rows of `n` (attention biases).
extern "C" __global__ void add_bias(float* y, const float* __restrict__ b, int n, u64 total) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] = __fadd_rn(y[i], b[i % n]);
}

// `x *= s`.
extern "C" __global__ void scale(float* x, float s, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], s);
}

// `x = tanh(x / cap) * cap` (final logit soft-capping; tanhf rounds as
// CUDA's libdevice does, so logits agree with the CPU's to rounding).
extern "C" __global__ void softcap(float* x, float cap, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(tanhf(__fdiv_rn(x[i], cap)), cap);
}

__device__ __forceinline__ void q5_bits(const u8* qh4, int j, int* h0, int* h1) {
    u32 qh = (u32)load_i32(qh4);
    *h0 = ((qh >> j) << 4) & 0x10;
    *h1 = (qh >> (j + 12)) & 0x10;
}

// Value `i` of a row of GGML type `ty` (`kernels/src/dequant.rs`, the same
// float operations).
__device__ float dequant_value(int ty, const u8* row, int i) {
    switch (ty) {
    case GGML_F32: return ((const float*)row)[i];
    case GGML_F16: return h2f(((const u16*)row)[i]);
    case GGML_Q4_0: {
        const BlockQ4_0* b = (const BlockQ4_0*)row + i / QK;
        int j = i % QK;
        int q = j < 16 ? (b->qs[j] & 0x0F) : (b->qs[j - 16] >> 4);
        return __fmul_rn((float)(q - 8), h2f(b->d));
    }
    case GGML_Q4_1: {
        const BlockQ4_1* b = (const BlockQ4_1*)row + i / QK;
        int j = i % QK;
        int q = j < 16 ? (b->qs[j] & 0x0F) : (b->qs[j - 16] >> 4);
        return __fadd_rn(__fmul_rn((float)q, h2f(b->d)), h2f(b->m));
    }
    case GGML_Q5_0: {
        const BlockQ5_0* b = (const BlockQ5_0*)row + i / QK;
        int j = i % QK, h0, h1;
        q5_bits(b->qh, j % 16, &h0, &h1);
        int q = j < 16 ? ((b->qs[j] & 0x0F) | h0) : ((b->qs[j - 16] >> 4) | h1);
        return __fmul_rn((float)(q - 16), h2f(b->d));
    }
    case GGML_Q5_1: {
        const BlockQ5_1* b = (const BlockQ5_1*)row + i / QK;
        int j = i % QK, h0, h1;
        q5_bits(b->qh, j % 16, &h0, &h1);
        int q = j < 16 ? ((b->qs[j] & 0x0F) | h0) : ((b->qs[j - 16] >> 4) | h1);
        return __fadd_rn(__fmul_rn((float)q, h2f(b->d)), h2f(b->m));
    }
    case GGML_Q8_0: {
        const BlockQ8_0* b = (const BlockQ8_0*)row + i / QK;
        return __fmul_rn((float)b->qs[i % QK], h2f(b->d));
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        int j = i % QK_K, sub = j / 32, v = j % 32;
        const u8* scales;
        const u8* qs;
        float d, dmin;
        int high = 0;
        if (ty == GGML_Q4_K) {
            const BlockQ4K* b = (const BlockQ4K*)row + i / QK_K;
            scales = b->scales, qs = b->qs, d = h2f(b->d), dmin = h2f(b->dmin);
        } else {
            const BlockQ5K* b = (const BlockQ5K*)row + i / QK_K;
            scales = b->scales, qs = b->qs, d = h2f(b->d), dmin = h2f(b->dmin);
            high = (b->qh[v] >> sub) & 1 ? 16 : 0;
        }
        int sc, m;
        if (sub < 4) {
            sc = scales[sub] & 63;
            m = scales[sub + 4] & 63;
        } else {
            sc = (scales[sub + 4] & 0xF) | ((scales[sub - 4] >> 6) << 4);
            m = (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4);
        }
        u8 byte = qs[32 * (sub / 2) + v];
        int q = ((sub % 2) ? (byte >> 4) : (byte & 0x0F)) + high;
        return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)q), __fmul_rn(dmin, (float)m));
    }
    case GGML_Q6_K: {
        const BlockQ6K* b = (const BlockQ6K*)row + i / QK_K;
        int j = i % QK_K, half = j / 128, r = j % 128, g = r / 32, l = r % 32;
        u8 lo = b->ql[64 * half + (g % 2) * 32 + l];
        int nib = (g / 2) ? (lo >> 4) : (lo & 0x0F);
        int q = (nib | (((b->qh[32 * half + l] >> (2 * g)) & 3) << 4)) - 32;
        int sc = b->scales[8 * half + l / 16 + 2 * g];
        return __fmul_rn(__fmul_rn(h2f(b->d), (float)sc), (float)q);
    }
    default: return __int_as_float(0x7fc00000);
    }
}

// Token embeddings: row `tokens[t]` of a `ty` matrix, dequantized, times
// `scale` when `scale != 0` (Gemma's sqrt(n_embd)).
extern "C" __global__ void embed(const u8* __restrict__ table, u64 row_bytes, int ty, const u32* __restrict__ tokens,
                                 float* out, int n_embd, float scale) {
    int t = blockIdx.y;
    const u8* row = table + (u64)tokens[t] * row_bytes;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_embd; i += gridDim.x * blockDim.x) {
        float v = dequant_value(ty, row, i);
        out[(u64)t * n_embd + i] = scale != 0.0f ? __fmul_rn(v, scale) : v;
    }
}
