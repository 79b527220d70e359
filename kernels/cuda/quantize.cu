// Activation quantization into the vec-dot types, the same formulas as
// `kernels/src/quantize.rs` (GGML's x86 CPU backend): a block's scale and
// every quant equal the CPU's bit for bit, so the integer dot products that
// follow see the same integers on both devices.
#include "common.cuh"

// One warp per 32-value block of `x`: this lane's quant of the block and
// the block's scale (d = amax / 127, q = nearest_int(v * (127 / amax))).
__device__ __forceinline__ i32 q8_lane(const float* __restrict__ x, int block, int lane, float* d) {
    float v = x[(u64)block * QK + lane];
    float amax = warp_max(fabsf(v));
    *d = __fdiv_rn(amax, 127.0f);
    float mul = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    return nearest_int(__fmul_rn(v, mul));
}

extern "C" __global__ void quantize_q8_0(const float* __restrict__ x, BlockQ8_0* __restrict__ out, int n_blocks) {
    int block = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    int lane = threadIdx.x % WARP;
    if (block >= n_blocks) return;
    float d;
    out[block].qs[lane] = (i8)q8_lane(x, block, lane, &d);
    if (lane == 0) out[block].d = f2h(d);
}

// Q8_1: Q8_0 plus s = d * (sum of the quants), as GGML computes it.
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, BlockQ8_1* __restrict__ out, int n_blocks) {
    int block = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    int lane = threadIdx.x % WARP;
    if (block >= n_blocks) return;
    float d;
    i32 q = q8_lane(x, block, lane, &d);
    out[block].qs[lane] = (i8)q;
    i32 sum = q;
    for (int o = WARP / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
        out[block].d = f2h(d);
        out[block].s = f2h(__fmul_rn(d, (float)sum));
    }
}

// Q8_K: one 256-thread block per super-block. The scale comes from the first
// value of largest magnitude *with its sign* (it maps to -127).
extern "C" __global__ void quantize_q8_k(const float* __restrict__ x, BlockQ8K* __restrict__ out, int n_blocks) {
    __shared__ float s_amax[QK_K / WARP];
    __shared__ int s_first[QK_K / WARP];
    __shared__ i32 s_q[QK_K];
    int block = blockIdx.x;
    int t = threadIdx.x;
    if (block >= n_blocks) return;
    float v = x[(u64)block * QK_K + t];
    float a = warp_max(fabsf(v));
    if (t % WARP == 0) s_amax[t / WARP] = a;
    __syncthreads();
    float amax = 0.0f;
    for (int w = 0; w < QK_K / WARP; ++w) amax = fmaxf(amax, s_amax[w]);
    int first = warp_min_int(fabsf(v) == amax ? t : QK_K);
    if (t % WARP == 0) s_first[t / WARP] = first;
    __syncthreads();
    BlockQ8K* b = &out[block];
    if (amax == 0.0f) {
        b->qs[t] = 0;
        if (t < QK_K / 16) b->bsums[t] = 0;
        if (t == 0) b->d = 0.0f;
        return;
    }
    first = QK_K;
    for (int w = 0; w < QK_K / WARP; ++w) first = min(first, s_first[w]);
    float max = x[(u64)block * QK_K + first];
    float iscale = __fdiv_rn(-127.0f, max);
    i32 q = min(nearest_int(__fmul_rn(iscale, v)), 127);
    b->qs[t] = (i8)q;
    s_q[t] = q;
    __syncthreads();
    if (t < QK_K / 16) {
        i32 sum = 0;
        for (int i = 0; i < 16; ++i) sum += s_q[t * 16 + i];
        b->bsums[t] = (i16)sum;
    }
    if (t == 0) b->d = __fdiv_rn(1.0f, iscale);
}

// F16 activations (the dot type of F16 weights): round to nearest even.
extern "C" __global__ void convert_f16(const float* __restrict__ x, u16* __restrict__ out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2h(x[i]);
}
