// Records llama.cpp's K-quant matrix products for batches of 8+ activation
// rows with the weight in a plain CPU buffer: there ggml_compute_forward_mul_mat
// hands Q6_K/Q5_K/Q4_K (and others) to the "tiled K-quant matmul"
// (ggml-cpu/tiled/), whose float arithmetic differs from vec_dot's. Below 8
// rows the vec_dot path runs (n = 7 cases confirm it). Same graph, 2 threads,
// as in llama.cpp. Inputs are deterministic (the generator of
// kernels/tests/tiled_kquant_golden.rs); outputs are recorded as a 64-bit
// FNV-1a hash of each activation row's output bits plus its first 16 values'
// bits. Built and run by make_goldens.sh; writes JSON to stdout.
//
// Also records, per case, how many outputs differ from GGML's own vec_dot
// (from_float to Q8_K, then the type's vec_dot, as the non-tiled path does):
// non-zero for n >= 8 shows the tiled path is really taken, zero for n = 7
// shows the fallback.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_common.h"

// The generator of golden_vec_dot.c / golden_q4k_repack.c / the Rust test.

#define QK_K 256

// Random but well-formed K-quant blocks: every quant, scale and min bit
// random; the f16 scales d in [2^-10, 2^-9) and dmin in [2^-11, 2^-9) (finite,
// normal). Q4_K/Q5_K: d, dmin first, then the rest of the block; Q6_K: the
// block's first 208 bytes (ql, qh, int8 scales), then d.
static size_t block_bytes(enum ggml_type ty) {
    switch (ty) {
        case GGML_TYPE_Q4_K: return 144;
        case GGML_TYPE_Q5_K: return 176;
        case GGML_TYPE_Q6_K: return 210;
        default: exit(2);
    }
}
static void random_blocks(enum ggml_type ty, uint8_t * dst, int64_t blocks) {
    const size_t bb = block_bytes(ty);
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t * blk = dst + b * bb;
        if (ty == GGML_TYPE_Q6_K) {
            for (int i = 0; i < 208; i += 4) {
                uint32_t u = next_u32();
                memcpy(blk + i, &u, 4);
            }
            uint16_t d = (uint16_t) (0x1400 + next_u32() % 0x400);
            memcpy(blk + 208, &d, 2);
        } else {
            uint16_t d = (uint16_t) (0x1400 + next_u32() % 0x400);
            uint16_t dmin = (uint16_t) (0x1000 + next_u32() % 0x800);
            memcpy(blk, &d, 2);
            memcpy(blk + 2, &dmin, 2);
            for (size_t i = 4; i < bb; i += 4) {
                uint32_t u = next_u32();
                memcpy(blk + i, &u, 4);
            }
        }
    }
}

// out[t * rows + r] = W row r . X row t, W in a plain CPU buffer.
static void mul_mat(ggml_backend_t backend, enum ggml_type ty, const uint8_t * wq, const float * x, int rows,
                    int cols, int n, float * out) {
    struct ggml_init_params params = { 4 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx_w = ggml_init(params);
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx_w, ty, cols, rows);
    ggml_set_name(w, "w");
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, ggml_backend_cpu_buffer_type());
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

// The non-tiled path's arithmetic: Q8_K activations, one vec_dot per output.
static void vec_dot_products(enum ggml_type ty, const uint8_t * wq, const float * x, int rows, int cols, int n,
                             float * out) {
    const struct ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(ty);
    const struct ggml_type_traits_cpu * q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K);
    const size_t wrow = ggml_row_size(ty, cols), arow = ggml_row_size(GGML_TYPE_Q8_K, cols);
    uint8_t * a = malloc(arow * n);
    for (int t = 0; t < n; ++t) q8->from_float(x + (size_t) t * cols, a + t * arow, cols);
    for (int t = 0; t < n; ++t)
        for (int r = 0; r < rows; ++r)
            tr->vec_dot(cols, &out[(size_t) t * rows + r], 0, wq + r * wrow, 0, a + t * arow, 0, 1);
    free(a);
}

int main(int argc, char ** argv) {
    // `full`: print every output's bits, not just the first 16 (for debugging).
    const int full = argc > 1 && strcmp(argv[1], "full") == 0;
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 2);
    // (type, rows, cols, n): Gemma 3 270M's Q6_K ffn_down (2048 -> 640) and a
    // 1024-column twin, on the tiled path's narrow (n <= 16) and standard
    // (n > 16) loops, n = 7 for the vec_dot fallback; rows not a multiple of
    // its 16-row microtile; Q5_K; Q4_K with rows % 8 != 0 (not repacked).
    static const int cases[][4] = {
        { GGML_TYPE_Q6_K, 640, 2048, 7 },  { GGML_TYPE_Q6_K, 640, 2048, 8 },  { GGML_TYPE_Q6_K, 640, 2048, 9 },
        { GGML_TYPE_Q6_K, 640, 2048, 13 }, { GGML_TYPE_Q6_K, 640, 2048, 16 }, { GGML_TYPE_Q6_K, 640, 2048, 17 },
        { GGML_TYPE_Q6_K, 640, 2048, 32 }, { GGML_TYPE_Q6_K, 640, 1024, 7 },  { GGML_TYPE_Q6_K, 640, 1024, 8 },
        { GGML_TYPE_Q6_K, 640, 1024, 9 },  { GGML_TYPE_Q6_K, 640, 1024, 13 }, { GGML_TYPE_Q6_K, 640, 1024, 16 },
        { GGML_TYPE_Q6_K, 640, 1024, 17 }, { GGML_TYPE_Q6_K, 640, 1024, 32 }, { GGML_TYPE_Q6_K, 136, 768, 11 },
        { GGML_TYPE_Q6_K, 100, 512, 40 },  { GGML_TYPE_Q5_K, 640, 1024, 7 },  { GGML_TYPE_Q5_K, 640, 1024, 8 },
        { GGML_TYPE_Q5_K, 640, 1024, 17 }, { GGML_TYPE_Q5_K, 136, 512, 21 },  { GGML_TYPE_Q4_K, 100, 512, 7 },
        { GGML_TYPE_Q4_K, 100, 512, 8 },   { GGML_TYPE_Q4_K, 100, 256, 19 },  { GGML_TYPE_Q4_K, 36, 1024, 16 },
    };
    const int ncases = sizeof(cases) / sizeof(cases[0]);
    printf("[\n");
    for (int c = 0; c < ncases; ++c) {
        const enum ggml_type ty = (enum ggml_type) cases[c][0];
        const int rows = cases[c][1], cols = cases[c][2], n = cases[c][3];
        const uint64_t seed = 9000 + c;
        lcg_state = seed;
        const int64_t blocks = (int64_t) rows * cols / QK_K;
        const size_t wbytes = blocks * block_bytes(ty);
        uint8_t * wq = malloc(wbytes);
        random_blocks(ty, wq, blocks);
        float * x = malloc(sizeof(float) * n * cols);
        for (int i = 0; i < n * cols; ++i) x[i] = next_value();
        float * out = malloc(sizeof(float) * n * rows);
        float * plain = malloc(sizeof(float) * n * rows);
        mul_mat(backend, ty, wq, x, rows, cols, n, out);
        vec_dot_products(ty, wq, x, rows, cols, n, plain);
        int differs = 0;
        for (int i = 0; i < n * rows; ++i) differs += memcmp(&out[i], &plain[i], 4) != 0;
        printf("%s  {\"type\": \"%s\", \"rows\": %d, \"cols\": %d, \"n\": %d, \"seed\": %llu, \"weights_fnv\": \"%016llx\", "
               "\"acts_fnv\": \"%016llx\", \"vec_dot_differs\": %d, \"tokens\": [",
               c ? ",\n" : "", ggml_type_name(ty), rows, cols, n, (unsigned long long) seed,
               (unsigned long long) fnv1a(wq, wbytes), (unsigned long long) fnv1a(x, sizeof(float) * n * cols),
               differs);
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
