// Causal (and, on sliding-window layers, windowed) attention of a batch of
// queries against the f16 KV cache, by the route llama.cpp's CPU flash
// attention takes for the shape (`kernels/src/flash_attn.rs`), with that
// route's numerics, so the device engine's outputs are the CPU engine's to
// the last bits of an f32 sum (these small quantized models part greedy
// ways on far less than the difference between the routes):
// - VECTOR (fewer than 64 queries): q rounded to f16, f16 dot products in
//   `ggml_vec_dot_f16`'s lane order, an online softmax with libm's exp, the
//   output accumulated in f16 (each update rounded back to f16);
// - SPLIT (one query over 512 or more cells): the cells cut into `chunks`
//   parts (the CPU's thread count), each a vector-route partial (a block
//   each), merged in order by `attention_merge`;
// - TILED (64 or more queries): tiles of 64 cells in f32, products as fused
//   multiply-adds in dimension order, GGML's exp and tile sums, values
//   accumulated in f32.
// Within a chunk of cells everything that does not depend on the order
// (scores, the running maximum as a prefix scan, each cell's exps) runs in
// parallel; only the f16 accumulation walks the cells in order, each
// thread over its own output dimensions.
//
// Cache layout: `[cell][n_head_kv * head_dim]` per layer, cell = position.
#include "common.cuh"

#define THREADS 128
#define MAX_HEAD_DIM 256
#define KV_TILE 64
#define ROUTE_VECTOR 0
#define ROUTE_SPLIT 1
#define ROUTE_TILED 2

// libm's expf (`f32::exp` on the CPU) to its rounding: exp in f64, rounded.
__device__ __forceinline__ float exp_libm(float x) { return (float)exp((double)x); }

__device__ __forceinline__ float round_f16(float x) { return h2f(f2h(x)); }

// `ggml_vec_dot_f16` (`f16dot::dot_f16_vec`) of a warp: virtual lane v of 64
// takes elements v, v + 64, ... by fused multiply-adds; lanes fold as
// (v, v + 32), then (l, l + 16), then GGML's 16-lane tree; a tail past a
// multiple of 64 is added in f64.
__device__ float dot_f16_ggml(const u16* __restrict__ k, const float* __restrict__ q16, int n, int lane) {
    int full = n / 64 * 64;
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < full; i += 64) {
        lo = fmaf(h2f(k[i + lane]), q16[i + lane], lo);
        hi = fmaf(h2f(k[i + lane + 32]), q16[i + lane + 32], hi);
    }
    float v = __fadd_rn(lo, hi);
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, o));
    v = __shfl_sync(0xffffffffu, v, 0);
    if (full < n) {
        double sum = (double)v;
        for (int i = full; i < n; ++i) sum += (double)__fmul_rn(h2f(k[i]), q16[i]);
        v = (float)sum;
    }
    return v;
}

// GGML's 16-lane reduction (`f16dot::reduce16`).
__device__ float reduce16(const float* l) {
    float t8[8];
    for (int i = 0; i < 8; ++i) t8[i] = __fadd_rn(l[i], l[i + 8]);
    float t4[4];
    for (int i = 0; i < 4; ++i) t4[i] = __fadd_rn(t8[i], t8[i + 4]);
    return __fadd_rn(__fadd_rn(t4[0], t4[2]), __fadd_rn(t4[1], t4[3]));
}

struct Shared {
    float q[MAX_HEAD_DIM];
    float s[THREADS];
    float scan[THREADS];
    float ms[THREADS];
    float vs[THREADS];
    int grow[THREADS];
};

// One vector-route partial over cells `lo..hi` from a fresh state: `acc0`,
// `acc1` (this thread's dims `tid`, `tid + THREADS`, f16 values held as f32)
// get the unnormalized sum; returns the running maximum and sum.
__device__ void vector_partial(Shared& sh, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
                               int kv_dim, int kv_off, int hd, int lo, int hi, float scale, float* acc0,
                               float* acc1, float* max_out, float* sum_out) {
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    float a0 = 0.0f, a1 = 0.0f;
    float m = -__int_as_float(0x7f800000), sum = 0.0f;
    for (int base = lo; base < hi; base += THREADS) {
        int nc = min(THREADS, hi - base);
        for (int i = warp; i < nc; i += THREADS / WARP) {
            float dot = dot_f16_ggml(k_cache + (u64)(base + i) * kv_dim + kv_off, sh.q, hd, lane);
            if (lane == 0) sh.s[i] = __fadd_rn(__fmul_rn(dot, scale), 0.0f);
        }
        __syncthreads();
        // Inclusive prefix maximum of the chunk's scores.
        sh.scan[tid] = tid < nc ? sh.s[tid] : -__int_as_float(0x7f800000);
        __syncthreads();
        for (int off = 1; off < THREADS; off <<= 1) {
            float y = tid >= off ? sh.scan[tid - off] : -__int_as_float(0x7f800000);
            __syncthreads();
            sh.scan[tid] = fmaxf(sh.scan[tid], y);
            __syncthreads();
        }
        if (tid < nc) {
            // The maximum before this cell, as the CPU's loop holds it.
            float prev = tid == 0 ? m : fmaxf(m, sh.scan[tid - 1]);
            float s = sh.s[tid];
            if (s > prev) {
                sh.ms[tid] = exp_libm(__fsub_rn(prev, s));
                sh.vs[tid] = 1.0f;
                sh.grow[tid] = 1;
            } else {
                sh.ms[tid] = 1.0f;
                sh.vs[tid] = exp_libm(__fsub_rn(s, prev));
                sh.grow[tid] = 0;
            }
        }
        __syncthreads();
        for (int i = 0; i < nc; ++i) sum = fmaf(sum, sh.ms[i], sh.vs[i]);
        m = fmaxf(m, sh.scan[nc - 1]);
        const u16* vb = v_cache + (u64)base * kv_dim + kv_off;
        for (int i = 0; i < nc; ++i) {
            const u16* vr = vb + (u64)i * kv_dim;
            float ms = sh.ms[i], vs = sh.vs[i];
            int grow = sh.grow[i];
            if (tid < hd) {
                if (grow) a0 = round_f16(__fmul_rn(a0, ms));
                a0 = round_f16(fmaf(h2f(vr[tid]), vs, a0));
            }
            if (tid + THREADS < hd) {
                if (grow) a1 = round_f16(__fmul_rn(a1, ms));
                a1 = round_f16(fmaf(h2f(vr[tid + THREADS]), vs, a1));
            }
        }
        __syncthreads();
    }
    *acc0 = a0;
    *acc1 = a1;
    *max_out = m;
    *sum_out = sum;
}

// One block of THREADS per (head, token). `q`: `[n_tokens][n_head][head_dim]`,
// already normed, rotated and scaled; `out` the same shape. Token t sits at
// position `pos0 + t` and sees cells `max(0, pos - window + 1)..=pos`
// (`window` 0: all). `cells`: the CPU's cache view (where split chunks
// fall); `chunks`: split parts, one block each along z, their partials
// (`head_dim` sums, the maximum, the sum of exps) written to `partials`.
extern "C" __global__ void attention(const float* __restrict__ q, const u16* __restrict__ k_cache,
                                     const u16* __restrict__ v_cache, float* __restrict__ out, int n_head,
                                     int n_head_kv, int head_dim, int pos0, int window, float kq_scale, int route,
                                     int cells, int chunks, float* __restrict__ partials) {
    __shared__ Shared sh;
    int t = blockIdx.y, h = blockIdx.x;
    int kv_h = h / (n_head / n_head_kv);
    int kv_dim = n_head_kv * head_dim, kv_off = kv_h * head_dim;
    int tid = threadIdx.x;
    const float* qh = q + ((u64)t * n_head + h) * head_dim;
    float* oh = out + ((u64)t * n_head + h) * head_dim;
    int pos = pos0 + t;
    int vis_lo = window > 0 ? max(0, pos - window + 1) : 0, vis_hi = pos + 1;
    float o0 = 0.0f, o1 = 0.0f, sum = 0.0f;

    if (route == ROUTE_TILED) {
        for (int d = tid; d < head_dim; d += THREADS) sh.q[d] = qh[d];
        __syncthreads();
        float m = -__int_as_float(0x7f800000);
        for (int lo = 0; lo < vis_hi; lo += KV_TILE) {
            if (tid < KV_TILE) {
                int c = lo + tid;
                float s = -__int_as_float(0x7f800000);
                if (c >= vis_lo && c < vis_hi) {
                    const u16* kr = k_cache + (u64)c * kv_dim + kv_off;
                    float acc = 0.0f;
                    for (int d = 0; d < head_dim; ++d) acc = fmaf(sh.q[d], h2f(kr[d]), acc);
                    s = __fadd_rn(__fmul_rn(acc, kq_scale), 0.0f);
                }
                sh.s[tid] = s;
            }
            __syncthreads();
            float tile_max = -__int_as_float(0x7f800000);
            for (int c = 0; c < KV_TILE; ++c) tile_max = fmaxf(tile_max, sh.s[c]);
            if (tile_max == -__int_as_float(0x7f800000)) {
                __syncthreads();
                continue;
            }
            float m_new = fmaxf(m, tile_max);
            if (m_new > m) {
                float ms = exp_libm(__fsub_rn(m, m_new));
                o0 = __fmul_rn(o0, ms);
                o1 = __fmul_rn(o1, ms);
                sum = __fmul_rn(sum, ms);
            }
            m = m_new;
            if (tid < KV_TILE) sh.scan[tid] = expf_ggml(__fsub_rn(sh.s[tid], m));
            __syncthreads();
            double tile_sum = 0.0;
            for (int gi = 0; gi < KV_TILE / 16; ++gi) tile_sum += (double)reduce16(sh.scan + 16 * gi);
            sum = (float)((double)sum + tile_sum);
            int n = min(KV_TILE, vis_hi - lo);
            const u16* vb = v_cache + (u64)lo * kv_dim + kv_off;
            for (int c = 0; c < n; ++c) {
                float p = sh.scan[c];
                const u16* vr = vb + (u64)c * kv_dim;
                if (tid < head_dim) o0 = fmaf(p, h2f(vr[tid]), o0);
                if (tid + THREADS < head_dim) o1 = fmaf(p, h2f(vr[tid + THREADS]), o1);
            }
            __syncthreads();
        }
    } else {
        for (int d = tid; d < head_dim; d += THREADS) sh.q[d] = round_f16(qh[d]);
        __syncthreads();
        if (route == ROUTE_VECTOR) {
            float m;
            vector_partial(sh, k_cache, v_cache, kv_dim, kv_off, head_dim, vis_lo, vis_hi, kq_scale, &o0, &o1, &m,
                           &sum);
        } else {
            // Chunk blockIdx.z of the split: its partial goes to `partials`,
            // `attention_merge` folds them in order.
            int chunk = max(1, (cells + chunks - 1) / chunks), k = blockIdx.z;
            int a = max(vis_lo, k * chunk), b = min(vis_hi, min((k + 1) * chunk, cells));
            float m;
            vector_partial(sh, k_cache, v_cache, kv_dim, kv_off, head_dim, a, max(a, b), kq_scale, &o0, &o1, &m,
                           &sum);
            float* p = partials + (((u64)t * n_head + h) * chunks + k) * (head_dim + 2);
            if (tid < head_dim) p[tid] = o0;
            if (tid + THREADS < head_dim) p[tid + THREADS] = o1;
            if (tid == 0) {
                p[head_dim] = m;
                p[head_dim + 1] = sum;
            }
            return;
        }
    }
    float inv = sum == 0.0f ? 0.0f : __fdiv_rn(1.0f, sum);
    if (tid < head_dim) oh[tid] = __fmul_rn(o0, inv);
    if (tid + THREADS < head_dim) oh[tid + THREADS] = __fmul_rn(o1, inv);
}

// The split route's merge: per (head, token), the chunks' partials in
// chunk order (`flash_attn::split`), then the division.
extern "C" __global__ void attention_merge(const float* __restrict__ partials, float* __restrict__ out, int n_head,
                                           int head_dim, int chunks) {
    int t = blockIdx.y, h = blockIdx.x, d = threadIdx.x;
    if (d >= head_dim) return;
    const float* base = partials + ((u64)t * n_head + h) * chunks * (head_dim + 2);
    float o = 0.0f, sum = 0.0f, m = -__int_as_float(0x7f800000);
    for (int k = 0; k < chunks; ++k) {
        const float* p = base + (u64)k * (head_dim + 2);
        float pm = p[head_dim], ps = p[head_dim + 1];
        if (ps == 0.0f) continue;
        float mm = fmaxf(m, pm);
        float old = exp_libm(__fsub_rn(m, mm)), nw = exp_libm(__fsub_rn(pm, mm));
        o = fmaf(o, old, __fmul_rn(p[d], nw));
        sum = fmaf(sum, old, __fmul_rn(ps, nw));
        m = mm;
    }
    float inv = sum == 0.0f ? 0.0f : __fdiv_rn(1.0f, sum);
    out[((u64)t * n_head + h) * head_dim + d] = __fmul_rn(o, inv);
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
