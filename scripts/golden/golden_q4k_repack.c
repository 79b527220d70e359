// Records llama.cpp's Q4_K matrix products through the CPU backend's repack
// buffer type ("CPU_REPACK"): the weight is placed there, so ggml converts it
// to block_q4_Kx8 and runs ggml_gemv/gemm_q4_K_8x8_q8_K, as llama.cpp does for
// a model's Q4_K weights on an AVX2 machine. Same graph, 2 threads, as in
// llama.cpp. Inputs are deterministic (the generator of
// kernels/tests/q4k_repack_golden.rs); outputs are recorded as a 64-bit FNV-1a
// hash of each activation row's output bits plus its first 16 values' bits.
// Built and run by make_goldens.sh; writes JSON to stdout.
//
// Also records, per case, how many outputs differ from the same product with
// the weight in a plain CPU buffer (the vec_dot path): non-zero shows the
// repack path is really taken.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_common.h"

// The generator of golden_vec_dot.c / kernels/tests/q4k_repack_golden.rs.

// block_q4_K: d, dmin (f16), scales[12], qs[128].
#define QK_K 256
#define Q4K_BLOCK 144

// Random but well-formed Q4_K blocks: every 6-bit scale and min and every
// nibble occurs; d in [2^-10, 2^-9), dmin in [2^-11, 2^-9) (finite, normal).
static void random_q4k(uint8_t * dst, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t * blk = dst + b * Q4K_BLOCK;
        uint16_t d = (uint16_t) (0x1400 + next_u32() % 0x400);
        uint16_t dmin = (uint16_t) (0x1000 + next_u32() % 0x800);
        memcpy(blk, &d, 2);
        memcpy(blk + 2, &dmin, 2);
        for (int i = 0; i < 140; i += 4) {
            uint32_t u = next_u32();
            memcpy(blk + 4 + i, &u, 4);
        }
    }
}

static ggml_backend_buffer_type_t repack_buft(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_dev_get_extra_bufts_t get_extra =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) return NULL;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return NULL;
}

// out[t * rows + r] = W row r . X row t, with W allocated in `wbuft`.
static void mul_mat(ggml_backend_t backend, ggml_backend_buffer_type_t wbuft, const uint8_t * wq, const float * x,
                    int rows, int cols, int n, float * out) {
    struct ggml_init_params params = { 4 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx_w = ggml_init(params);
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx_w, GGML_TYPE_Q4_K, cols, rows);
    ggml_set_name(w, "w");
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, wbuft);
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_set(w, wq, 0, ggml_nbytes(w));

    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, n);
    ggml_set_input(xt);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, xt);
    ggml_set_output(y);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf)) {
        fprintf(stderr, "graph allocation failed\n");
        exit(1);
    }
    ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "compute failed\n");
        exit(1);
    }
    ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    ggml_gallocr_free(galloc);
    ggml_backend_buffer_free(wbuf);
    ggml_free(ctx);
    ggml_free(ctx_w);
}

// GGML's log without the per-tensor "repack tensor w with q4_K_8x8" debug lines.
static void log_quietly(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level != GGML_LOG_LEVEL_DEBUG) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    // `full`: print every output's bits, not just the first 16 (for debugging).
    const int full = argc > 1 && strcmp(argv[1], "full") == 0;
    ggml_log_set(log_quietly, NULL);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    ggml_backend_buffer_type_t rbuft = repack_buft();
    if (!rbuft) {
        fprintf(stderr, "no CPU_REPACK buffer type in this build\n");
        return 1;
    }
    // (rows, cols, n): Gemma 3 270M's attn_output (1024 -> 640) and ffn_down
    // (2048 -> 640), and rows % 16 == 8 (the AVX-512 gemm's 8-column tail).
    static const int cases[][3] = {
        { 640, 1024, 1 },  { 640, 1024, 2 },  { 640, 1024, 3 },  { 640, 1024, 4 },  { 640, 1024, 5 },
        { 640, 1024, 6 },  { 640, 1024, 8 },  { 640, 1024, 13 }, { 640, 1024, 16 }, { 640, 1024, 19 },
        { 640, 2048, 1 },  { 640, 2048, 3 },  { 640, 2048, 4 },  { 640, 2048, 7 },  { 640, 2048, 16 },
        { 136, 256, 1 },   { 136, 256, 5 },   { 136, 512, 21 },
    };
    const int ncases = sizeof(cases) / sizeof(cases[0]);
    printf("[\n");
    for (int c = 0; c < ncases; ++c) {
        const int rows = cases[c][0], cols = cases[c][1], n = cases[c][2];
        const uint64_t seed = 7000 + c;
        lcg_state = seed;
        const int64_t blocks = (int64_t) rows * cols / QK_K;
        uint8_t * wq = malloc(blocks * Q4K_BLOCK);
        random_q4k(wq, blocks);
        float * x = malloc(sizeof(float) * n * cols);
        for (int i = 0; i < n * cols; ++i) x[i] = next_value();
        float * out = malloc(sizeof(float) * n * rows);
        float * plain = malloc(sizeof(float) * n * rows);
        mul_mat(backend, rbuft, wq, x, rows, cols, n, out);
        mul_mat(backend, ggml_backend_cpu_buffer_type(), wq, x, rows, cols, n, plain);
        int differs = 0;
        for (int i = 0; i < n * rows; ++i) differs += memcmp(&out[i], &plain[i], 4) != 0;
        printf("%s  {\"rows\": %d, \"cols\": %d, \"n\": %d, \"seed\": %llu, \"weights_fnv\": \"%016llx\", "
               "\"acts_fnv\": \"%016llx\", \"plain_path_differs\": %d, \"tokens\": [",
               c ? ",\n" : "", rows, cols, n, (unsigned long long) seed,
               (unsigned long long) fnv1a(wq, blocks * Q4K_BLOCK),
               (unsigned long long) fnv1a(x, sizeof(float) * n * cols), differs);
        for (int t = 0; t < n; ++t) {
            const float * o = out + (size_t) t * rows;
            const int head = full ? rows : 16;
            printf("%s\n    {\"fnv\": \"%016llx\", \"head\": [", t ? "," : "",
                   (unsigned long long) fnv1a(o, sizeof(float) * rows));
            for (int i = 0; i < head; ++i) {
                uint32_t bits;
                memcpy(&bits, &o[i], 4);
                printf("%s%u", i ? ", " : "", bits);
            }
            printf("]}");
        }
        printf("]}");
        free(wq); free(x); free(out); free(plain);
    }
    printf("\n]\n");
    ggml_backend_free(backend);
    return 0;
}
