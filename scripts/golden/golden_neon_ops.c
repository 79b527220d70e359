/* Records the hashes that the `matches_ggml_built_for_aarch64` unit tests of
 * kernels/src/{f16dot,ops,quantize,dequant}.rs hold: ggml_vec_dot_f16,
 * activation quantization (Q8_0, Q8_1, Q8_K), soft_max, swiglu / geglu,
 * rope (normal and neox), f16 x f32 mul_mat (tinyBLAS, the one-column path
 * and a permuted q as in -fa off attention) and ggml-base's to_float, each on
 * the xorshift32 inputs of `f16dot::golden::wide`, as one FNV-1a hash per
 * case. Linked against a real aarch64 ggml (`scripts/aarch64.sh llama
 * armv8-a`: GCC, -O3 -march=armv8-a, llamafile's sgemm on; the
 * armv8.2-a+dotprod build prints the same). From the repository root:
 *
 *   BIN=$(scripts/aarch64.sh llama armv8-a)
 *   SRC=$HOME/.cache/leanstream/llama-cpp-python-0.3.36/llama_cpp_python-0.3.36/vendor/llama.cpp
 *   aarch64-linux-gnu-gcc -O2 -I$SRC/ggml/include scripts/golden/golden_neon_ops.c -o /tmp/neon_ops \
 *       -L$BIN -lggml -lggml-base -lggml-cpu -lm -Wl,-rpath,$BIN
 *   QEMU_CPU=cortex-a72 qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/neon_ops
 *
 * data/golden/aarch64/flash_attn.json is scripts/golden/golden_flash_attn.c
 * built and run the same way.
 */
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

static uint32_t st;
static float next_wide(void) {
    st ^= st << 13; st ^= st >> 17; st ^= st << 5;
    float m = (float)(st >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
    static const float sc[4] = {0.01f, 1.0f, 30.0f, 500.0f};
    return m * sc[st & 3];
}
static void wide(float *v, int n, uint32_t seed) { st = seed | 1; for (int i = 0; i < n; i++) v[i] = next_wide(); }
static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p; uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    return h;
}
static struct ggml_context *mk(void) {
    struct ggml_init_params ip = { 256u << 20, NULL, false };
    return ggml_init(ip);
}
static void run(struct ggml_context *ctx, struct ggml_tensor *t) {
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, t);
    ggml_graph_compute_with_ctx(ctx, gf, 1);
}

int main(void) {
    ggml_cpu_init();
    static float a[1 << 16], b[1 << 16];
    static ggml_fp16_t ha[1 << 16], hb[1 << 16];
    static uint8_t q[1 << 16];

    // ggml_vec_dot_f16
    {
        const int ns[] = {16, 17, 64, 100, 128, 1000, 4099};
        for (int k = 0; k < 7; k++) {
            int n = ns[k];
            wide(a, n, 3); wide(b, n, 5);
            ggml_fp32_to_fp16_row(a, ha, n); ggml_fp32_to_fp16_row(b, hb, n);
            float s;
            ggml_get_type_traits_cpu(GGML_TYPE_F16)->vec_dot(n, &s, 0, ha, 0, hb, 0, 1);
            printf("vec_dot_f16 %d %016llx\n", n, (unsigned long long)fnv(&s, 4));
        }
    }
    // activation quantization
    {
        const enum ggml_type ts[] = {GGML_TYPE_Q8_0, GGML_TYPE_Q8_1, GGML_TYPE_Q8_K};
        const char *names[] = {"q8_0", "q8_1", "q8_K"};
        for (int k = 0; k < 3; k++) {
            int n = 1024;
            wide(a, n, 7);
            for (int i = 64; i < 96; i++) a[i] = 0.0f;           // an all-zero block
            for (int i = 96; i < 128; i++) a[i] = (float)(i - 110) * 0.5f; // ties
            // Blocks where 127 / amax and 1 / (amax / 127) round a value differently.
            static const uint32_t flip[3][2] = {{0x3f000735u, 0x3c61d03du}, {0x3f000885u, 0x3c61d28du}, {0x3f00092du, 0x3c61d3b6u}};
            for (int blk = 0; blk < 3; blk++) {
                for (int i = 0; i < 32; i++) a[128 + 32 * blk + i] = 0.0f;
                memcpy(&a[128 + 32 * blk], &flip[blk][0], 4);
                memcpy(&a[129 + 32 * blk], &flip[blk][1], 4);
            }
            memset(q, 0, sizeof q);
            ggml_get_type_traits_cpu(ts[k])->from_float(a, q, n);
            printf("quantize %s %016llx\n", names[k], (unsigned long long)fnv(q, ggml_row_size(ts[k], n)));
        }
    }
    // soft_max (ggml_v_expf + vaddvq groups)
    {
        const int ns[] = {64, 67, 1000};
        for (int k = 0; k < 3; k++) {
            int n = ns[k];
            struct ggml_context *ctx = mk();
            struct ggml_tensor *x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
            wide(x->data, n, 9);
            for (int i = 0; i < n; i++) ((float *)x->data)[i] *= 0.05f;
            struct ggml_tensor *y = ggml_soft_max_ext(ctx, x, NULL, 1.0f, 0.0f);
            run(ctx, y);
            printf("soft_max %d %016llx\n", n, (unsigned long long)fnv(y->data, 4 * n));
            ggml_free(ctx);
        }
    }
    // swiglu / geglu
    {
        const int ns[] = {1024, 1027};
        for (int k = 0; k < 2; k++) {
            int n = ns[k];
            for (int g = 0; g < 2; g++) {
                struct ggml_context *ctx = mk();
                struct ggml_tensor *x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
                struct ggml_tensor *u = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
                wide(x->data, n, 11); wide(u->data, n, 13);
                for (int i = 0; i < n; i++) ((float *)x->data)[i] *= 0.04f;
                struct ggml_tensor *y = g ? ggml_geglu_split(ctx, x, u) : ggml_swiglu_split(ctx, x, u);
                run(ctx, y);
                printf("%s %d %016llx\n", g ? "geglu" : "swiglu", n, (unsigned long long)fnv(y->data, 4 * n));
                ggml_free(ctx);
            }
        }
    }
    // rope, normal and neox
    {
        const int hd = 128, nh = 4, nt = 3;
        const int32_t pos[3] = {5, 17, 1000};
        for (int mode = 0; mode <= 2; mode += 2) {
            struct ggml_context *ctx = mk();
            struct ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hd, nh, nt);
            struct ggml_tensor *p = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, nt);
            wide(x->data, hd * nh * nt, 15);
            memcpy(p->data, pos, sizeof pos);
            struct ggml_tensor *y = ggml_rope_ext(ctx, x, p, NULL, hd, mode, 0, 10000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
            run(ctx, y);
            printf("rope %s %016llx\n", mode ? "neox" : "normal", (unsigned long long)fnv(y->data, 4 * hd * nh * nt));
            ggml_free(ctx);
        }
    }
    // mul_mat f16 x f32: tinyBLAS for n >= 2, ggml_vec_dot_f16 (B rounded to f16) for n = 1
    {
        const int K = 256, M = 8;
        const int ns[] = {1, 3};
        for (int k = 0; k < 2; k++) {
            int n = ns[k];
            struct ggml_context *ctx = mk();
            struct ggml_tensor *A = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, K, M);
            struct ggml_tensor *B = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, n);
            wide(a, K * M, 17);
            ggml_fp32_to_fp16_row(a, A->data, K * M);
            wide(B->data, K * n, 19);
            struct ggml_tensor *C = ggml_mul_mat(ctx, A, B);
            run(ctx, C);
            printf("mul_mat_f16_f32 %d %016llx\n", n, (unsigned long long)fnv(C->data, 4 * M * n));
            ggml_free(ctx);
        }
    }
    // KQ as llama.cpp's -fa off forms it: q a permuted (non-contiguous) view of [K, n_head, n_tokens]
    {
        const int K = 64, M = 8, NH = 2, NT = 3;
        struct ggml_context *ctx = mk();
        struct ggml_tensor *A = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, K, M, 1);
        struct ggml_tensor *Q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, NH, NT);
        wide(a, K * M, 23);
        ggml_fp32_to_fp16_row(a, A->data, K * M);
        wide(Q->data, K * NH * NT, 29);
        struct ggml_tensor *C = ggml_mul_mat(ctx, A, ggml_permute(ctx, Q, 0, 2, 1, 3));
        run(ctx, C);
        printf("mul_mat_kq_permuted %016llx\n", (unsigned long long)fnv(C->data, 4 * M * NT * NH));
        ggml_free(ctx);
    }
    // dequantization (ggml-base's to_float) of random blocks with sane scales
    {
        const enum ggml_type ts[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
        const char *names[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K"};
        for (int k = 0; k < 8; k++) {
            int n = 512;
            size_t bytes = ggml_row_size(ts[k], n);
            st = 21 + k;
            for (size_t i = 0; i < bytes; i++) { st ^= st << 13; st ^= st >> 17; st ^= st << 5; q[i] = st >> 24; }
            // f16 fields: d (and m / dmin) at the block start for every type but Q6_K (d last).
            size_t bs = ggml_type_size(ts[k]);
            for (size_t blk = 0; blk < bytes / bs; blk++) {
                uint8_t *p = q + blk * bs;
                wide(a, 2, 31 + blk);
                ggml_fp16_t h0 = ggml_fp32_to_fp16(a[0] * 0.01f), h1 = ggml_fp32_to_fp16(a[1] * 0.01f);
                if (ts[k] == GGML_TYPE_Q6_K) { memcpy(p + bs - 2, &h0, 2); }
                else { memcpy(p, &h0, 2); if (ts[k] == GGML_TYPE_Q4_1 || ts[k] == GGML_TYPE_Q5_1 || ts[k] == GGML_TYPE_Q4_K || ts[k] == GGML_TYPE_Q5_K) memcpy(p + 2, &h1, 2); }
            }
            ggml_get_type_traits(ts[k])->to_float(q, b, n);
            printf("dequant %s %016llx\n", names[k], (unsigned long long)fnv(b, 4 * n));
        }
    }
    return 0;
}
