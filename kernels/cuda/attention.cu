// Causal (and, on sliding-window layers, windowed) attention of a batch of
// queries against the f16 KV cache, as an online softmax over chunks of
// positions (the flash-attention form llama.cpp's CPU default runs).
// Queries are rounded to f16 first, as the CPU path converts them to the
// keys' type; scores, exponentials (GGML's exp) and the value sums are f32,
// so outputs agree with the CPU engine's to rounding.
//
// Cache layout: `[cell][n_head_kv * head_dim]` per layer, cell = position.
#include "common.cuh"

#define CHUNK 128
#define MAX_HEAD_DIM 256

// One block of CHUNK threads per (token, head). `q`: `[n_tokens][n_head][head_dim]`,
// already normed, rotated and scaled; `out` the same shape. Token t sits at
// position `pos0 + t` and sees cells `max(0, pos - window + 1)..=pos`
// (`window` 0: all).
extern "C" __global__ void attention(const float* __restrict__ q, const u16* __restrict__ k_cache,
                                     const u16* __restrict__ v_cache, float* __restrict__ out, int n_head,
                                     int n_head_kv, int head_dim, int pos0, int window, float kq_scale) {
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_p[CHUNK];
    __shared__ float s_red[CHUNK / WARP];
    int t = blockIdx.y, h = blockIdx.x;
    int kv_h = h / (n_head / n_head_kv);
    int kv_dim = n_head_kv * head_dim;
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    for (int d = tid; d < head_dim; d += CHUNK) s_q[d] = h2f(f2h(qh[d]));
    int pos = pos0 + t;
    int lo = window > 0 ? max(0, pos - window + 1) : 0;
    // Each thread owns output dims tid and tid + CHUNK.
    float acc0 = 0.0f, acc1 = 0.0f;
    float m = -__int_as_float(0x7f800000), sum = 0.0f;
    __syncthreads();
    for (int c0 = lo; c0 <= pos; c0 += CHUNK) {
        int n = min(CHUNK, pos + 1 - c0);
        // Scores: each warp takes every (CHUNK / WARP)-th cell, lanes over dims.
        for (int i = warp; i < n; i += CHUNK / WARP) {
            const u16* kr = k_cache + (u64)(c0 + i) * kv_dim + (u64)kv_h * head_dim;
            float dot = 0.0f;
            for (int d = lane; d < head_dim; d += WARP) dot = fmaf(h2f(kr[d]), s_q[d], dot);
            dot = warp_sum(dot);
            if (lane == 0) s_p[i] = __fmul_rn(dot, kq_scale);
        }
        __syncthreads();
        float local = tid < n ? s_p[tid] : -__int_as_float(0x7f800000);
        local = warp_max(local);
        if (lane == 0) s_red[warp] = local;
        __syncthreads();
        float m_new = m;
        for (int w = 0; w < CHUNK / WARP; ++w) m_new = fmaxf(m_new, s_red[w]);
        float rescale = expf_ggml(__fsub_rn(m, m_new));
        __syncthreads();
        if (tid < n) s_p[tid] = expf_ggml(__fsub_rn(s_p[tid], m_new));
        __syncthreads();
        float chunk_sum = 0.0f;
        for (int i = 0; i < n; ++i) chunk_sum = __fadd_rn(chunk_sum, s_p[i]);
        sum = __fadd_rn(__fmul_rn(sum, rescale), chunk_sum);
        acc0 = __fmul_rn(acc0, rescale);
        acc1 = __fmul_rn(acc1, rescale);
        const u16* vb = v_cache + (u64)c0 * kv_dim + (u64)kv_h * head_dim;
        for (int i = 0; i < n; ++i) {
            const u16* vr = vb + (u64)i * kv_dim;
            float p = s_p[i];
            if (tid < head_dim) acc0 = fmaf(p, h2f(vr[tid]), acc0);
            if (tid + CHUNK < head_dim) acc1 = fmaf(p, h2f(vr[tid + CHUNK]), acc1);
        }
        m = m_new;
        __syncthreads();
    }
    float* oh = out + ((u64)t * n_head + h) * head_dim;
    float inv = __fdiv_rn(1.0f, sum);
    if (tid < head_dim) oh[tid] = __fmul_rn(acc0, inv);
    if (tid + CHUNK < head_dim) oh[tid + CHUNK] = __fmul_rn(acc1, inv);
}

// Stores `n_tokens` rows of keys and values (f32, `[t][kv_dim]`) into the
// layer's cache at cells `pos0..`, rounded to f16 (nearest even, as the CPU).
extern "C" __global__ void kv_store(const float* __restrict__ k, const float* __restrict__ v, u16* k_cache,
                                    u16* v_cache, int kv_dim, int pos0, int n_tokens) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 n = (u64)n_tokens * kv_dim;
    if (i >= n) return;
    u64 at = (u64)pos0 * kv_dim + i;
    k_cache[at] = f2h(k[i]);
    v_cache[at] = f2h(v[i]);
}
