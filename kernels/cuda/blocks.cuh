// Fixed-width types, GGML's quantization blocks (byte for byte as
// `kernels/src/blocks.rs`) and type ids, and the few float primitives the
// CPU-order products need (`cpu_order.cuh`). Plain C++ as well as CUDA, so
// the host can compile the same arithmetic and check it against the CPU
// kernels without a GPU (`cuda/tests/cpu_order.rs`). NVRTC has no standard
// headers, hence the typedefs.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#define QK 32
#define QK_K 256
#define WARP 32

struct BlockQ4_0 { u16 d; u8 qs[QK / 2]; };
struct BlockQ4_1 { u16 d; u16 m; u8 qs[QK / 2]; };
struct BlockQ5_0 { u16 d; u8 qh[4]; u8 qs[QK / 2]; };
struct BlockQ5_1 { u16 d; u16 m; u8 qh[4]; u8 qs[QK / 2]; };
struct BlockQ8_0 { u16 d; i8 qs[QK]; };
struct BlockQ8_1 { u16 d; u16 s; i8 qs[QK]; };
struct BlockQ4K { u16 d; u16 dmin; u8 scales[12]; u8 qs[QK_K / 2]; };
struct BlockQ5K { u16 d; u16 dmin; u8 scales[12]; u8 qh[QK_K / 8]; u8 qs[QK_K / 2]; };
struct BlockQ6K { u8 ql[QK_K / 2]; u8 qh[QK_K / 4]; i8 scales[QK_K / 16]; u16 d; };
struct BlockQ8K { float d; i8 qs[QK_K]; i16 bsums[QK_K / 16]; };

static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
static_assert(sizeof(BlockQ8_1) == 36, "Q8_1 block");
static_assert(sizeof(BlockQ4K) == 144, "Q4_K block");
static_assert(sizeof(BlockQ5K) == 176, "Q5_K block");
static_assert(sizeof(BlockQ6K) == 210, "Q6_K block");
static_assert(sizeof(BlockQ8K) == 292, "Q8_K block");

// GGML type ids, as `GgmlType::id` (the host passes them to generic kernels).
#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q8_1 9
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define GGML_Q8_K 15

// A function both the device and a host build of these headers compile.
#ifdef __CUDACC__
#define HD __device__ __forceinline__
#else
#define HD inline
#endif

// f16 bits to f32 (exact either way).
HD float half_to_float(u16 h) {
#ifdef __CUDACC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    u32 sign = (u32)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    u32 bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: shift the mantissa up to an implicit leading one.
        int e = -1;
        do {
            man <<= 1;
            ++e;
        } while (!(man & 0x400u));
        bits = sign | ((u32)(112 - e) << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
#endif
}

// One rounding each, whatever the compiler's contraction settings (the
// device sources are also compiled with `--fmad=false`, the host harness
// with `-ffp-contract=off`).
HD float mul_rn(float a, float b) {
#ifdef __CUDACC__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

HD float add_rn(float a, float b) {
#ifdef __CUDACC__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

HD float fma_rn(float a, float b, float c) {
#ifdef __CUDACC__
    return fmaf(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}

// Unaligned little-endian loads from byte-packed blocks (blocks of 18, 34
// ... bytes leave words unaligned).
HD i32 load_i32(const void* p) {
    const u8* b = (const u8*)p;
    return (i32)((u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24));
}

HD i16 load_i16(const void* p) {
    const u8* b = (const u8*)p;
    return (i16)((u32)b[0] | ((u32)b[1] << 8));
}

HD float load_f32(const void* p) {
    u32 bits = (u32)load_i32(p);
    float f;
#ifdef __CUDACC__
    f = __uint_as_float(bits);
#else
    __builtin_memcpy(&f, &bits, 4);
#endif
    return f;
}
