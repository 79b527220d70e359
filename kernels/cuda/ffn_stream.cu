// The streaming FFN of one token and layer over neuron bundles as they
// land (`kernels/src/sparse_ffn`: gate row, up row, down column, back to
// back), without the host synchronizing the device between stages.
//
// The host's storage workers read bundles into pinned, device-mapped host
// memory (or copy them into the device's neuron cache) and then publish a
// per-slot *flag*: a u32 that reaches the layer's `epoch` once the slot's
// bytes are visible. Stage 1's warps poll their slot's flag and compute as
// soon as it turns, so compute follows arrival order; a slot still missing
// at the deadline is skipped (its activation is 0 and `skipped` says so).
// Cached bundles point at a flag that always reads 0xFFFFFFFF.
//
// Determinism: stage 1 writes slot-local values only, its gate and up dots
// in the float order of the CPU's tail (`cpu_order.cuh`; the tail computes
// what `matmul` gives over the layer's matrices, so its bits);
// stage 2 sums in the host's `order` (ascending neuron id), one fused
// multiply-add per neuron and output as the CPU's `axpy_down`, so `y` for a
// given set of neurons is the same whatever the arrival order.
#include "common.cuh"
#include "cpu_order.cuh"

// Acquire load of a flag the host (or a copy engine) writes: the slot's
// bytes are read only after the flag, never a stale line from before it.
__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

struct Slot {
    // Device address of the bundle (mapped host memory or the device cache).
    u64 bundle;
    // Device address of its flag.
    u64 flag;
    u32 neuron;
    u32 pad;
};
static_assert(sizeof(Slot) == 24, "Slot layout is shared with the host");

// Stage 1: one group of 8 threads per slot (the CPU dot's lanes; groups of
// a warp wait on their own flags). `x_gate` / `x_up`: the FFN input in the
// gate and up rows' vec-dot types, `n_embd` values; `gate_order` /
// `up_order`: the CPU's float order for this token's dots (ORDER_*, the
// repacked ones resolved). `start_ns` is zeroed by the
// host before the launch; the first group to run stamps it, and
// `deadline_ns` counts from there (0: wait for every slot). `act[s]` gets
// `act(gate·x) * (up·x)`, or 0 where the policy drops the neuron, as the
// CPU's tail does: by the row's bitmap over neuron ids `keep` where given,
// else where |a| is below `threshold` (0 keeps all).
extern "C" __global__ void ffn_stream_activations(const Slot* __restrict__ slots, int n_slots, u32 epoch,
                                                  const u8* __restrict__ x_gate, const u8* __restrict__ x_up,
                                                  int gate_ty, int up_ty, int n_embd, int gate_order,
                                                  int up_order, u64 gate_bytes,
                                                  int act_kind, const float* __restrict__ gelu_table,
                                                  u64* start_ns, u64 deadline_ns, float threshold,
                                                  const u64* __restrict__ keep, float* __restrict__ act,
                                                  u8* __restrict__ skipped) {
    int s = (blockIdx.x * blockDim.x + threadIdx.x) / CPU_LANES;
    int lane = threadIdx.x % CPU_LANES;
    // Whole groups leave together (blocks are whole warps of whole groups).
    if (s >= n_slots) return;
    Slot slot = slots[s];
    const u32* flag = (const u32*)slot.flag;
    bool ready = true;
    if (lane == 0) {
        u64 now = global_ns();
        u64 start = atomicCAS((unsigned long long*)start_ns, 0ull, (unsigned long long)now);
        if (start == 0) start = now;
        while (load_acquire(flag) < epoch) {
            if (deadline_ns != 0 && global_ns() - start > deadline_ns) {
                ready = false;
                break;
            }
            __nanosleep(200);
        }
    }
    // Lane 0's acquire orders its own later loads only; the barrier (which,
    // unlike a shuffle, orders memory) carries it to the group's other
    // lanes, which read the bundle's bytes too.
    __syncwarp(group_mask());
    ready = __shfl_sync(group_mask(), ready, 0, CPU_LANES);
    if (!ready) {
        if (lane == 0) {
            act[s] = 0.0f;
            skipped[s] = 1;
        }
        return;
    }
    const u8* bundle = (const u8*)slot.bundle;
    float g = row_product_of(gate_ty, bundle, x_gate, n_embd, gate_order);
    float u = row_product_of(up_ty, bundle + gate_bytes, x_up, n_embd, up_order);
    if (lane == 0) {
        float a = gated(act_kind, gelu_table, g, u);
        bool kept = keep != nullptr ? ((keep[slot.neuron >> 6] >> (slot.neuron & 63)) & 1ull) != 0
                                    : !(fabsf(a) < threshold);
        act[s] = kept ? a : 0.0f;
        skipped[s] = 0;
    }
}

// Stage 2: `y[j] += Σ act[s] * down_s[j]` over slots in `order`, skipping
// zero activations; one thread per output. Down columns are Q8_0 (blocks of
// 32) or F16, at `down_offset` in each bundle.
extern "C" __global__ void ffn_stream_down(const Slot* __restrict__ slots, const u32* __restrict__ order,
                                           int n_slots, const float* __restrict__ act, u64 down_offset, int down_ty,
                                           float* __restrict__ y, int n_embd) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_embd) return;
    float acc = y[j];
    for (int i = 0; i < n_slots; ++i) {
        u32 s = order[i];
        float a = act[s];
        if (a == 0.0f) continue;
        const u8* col = (const u8*)slots[s].bundle + down_offset;
        float w;
        if (down_ty == GGML_Q8_0) {
            const BlockQ8_0* b = (const BlockQ8_0*)col + j / QK;
            w = __fmul_rn((float)b->qs[j % QK], h2f(b->d));
        } else {
            w = h2f(((const u16*)col)[j]);
        }
        acc = fmaf(a, w, acc);
    }
    y[j] = acc;
}

// The device's neuron cache: after a layer's kernels, bundles that were
// landed from the host's cache are copied from their staging into the
// device's cache slots (`pairs[2k]` from, `pairs[2k + 1]` to; one block per
// bundle), so the next time they are hits they are read in place.
extern "C" __global__ void ffn_cache_fill(const u64* __restrict__ pairs, int n, u64 bytes) {
    int k = blockIdx.x;
    if (k >= n) return;
    const u8* from = (const u8*)pairs[2 * k];
    u8* to = (u8*)pairs[2 * k + 1];
    for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) to[i] = from[i];
}

// Table 3's hand-off: stage `k` of `n_stages` waits for `flags[k]` to reach
// `epoch` and then does `work` rounds of the FFN-like arithmetic over its
// share of `data`; the host either publishes flags while one launch runs
// (`flags` in mapped memory) or launches stage by stage and synchronizes.
extern "C" __global__ void staged_handoff(const u32* flags, u32 epoch, int stage, int n_stages,
                                          const float* __restrict__ data, u64 n, float* __restrict__ out) {
    int k = stage >= 0 ? stage : (int)(blockIdx.x % n_stages);
    if (threadIdx.x == 0) {
        while (load_acquire(flags + k) < epoch) __nanosleep(100);
    }
    __syncthreads();
    int blocks_per_stage = stage >= 0 ? gridDim.x : gridDim.x / n_stages;
    int b = stage >= 0 ? blockIdx.x : blockIdx.x / n_stages;
    u64 per = n / n_stages;
    const float* d = data + (u64)k * per;
    float acc = 0.0f;
    for (u64 i = (u64)b * blockDim.x + threadIdx.x; i < per; i += (u64)blocks_per_stage * blockDim.x)
        acc = fmaf(d[i], d[i], acc);
    acc = warp_sum(acc);
    if (threadIdx.x % WARP == 0) atomicAdd(out + k, acc);
}
