// Records llama.cpp's CPU flash attention (ggml_flash_attn_ext, f16 K and V,
// F32 precision, as llama.cpp runs it with -fa on) on deterministic inputs,
// for bit-exact tests of LeanStream's flash-attention path. The cases reach
// all three CPU routes: one query per head over fewer than 512 cells (the
// f16-accumulating vector route), one query over 512+ cells (the KV range
// split across threads, then reduced), and 64+ queries (the tiled route).
// Built and run by make_goldens.sh; writes JSON to stdout.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_common.h"

struct fa_case {
    int head_dim, n_head, n_head_kv, n_q, n_kv, pos0, window, threads;
    float scale;
};

int main(void) {
    static const struct fa_case cases[] = {
        // SmolLM2 shape: 9 heads over 3 kv heads of 64.
        { 64, 9, 3, 1, 256, 40, 0, 2, 0.125f },
        { 64, 9, 3, 1, 256, 255, 0, 2, 0.125f },
        { 64, 9, 3, 1, 512, 300, 0, 2, 0.125f },
        { 64, 9, 3, 1, 1024, 700, 0, 3, 0.125f },
        { 64, 9, 3, 1, 1024, 300, 0, 2, 0.125f },
        { 64, 9, 3, 7, 256, 0, 0, 2, 0.125f },
        { 64, 9, 3, 13, 256, 50, 0, 2, 0.125f },
        { 64, 9, 3, 64, 256, 0, 0, 2, 0.125f },
        { 64, 9, 3, 100, 256, 20, 0, 2, 0.125f },
        { 64, 9, 3, 200, 256, 0, 0, 1, 0.125f },
        // Gemma 3 270M shape: 4 heads over 1 kv head of 256, q pre-scaled, 512-wide window.
        { 256, 4, 1, 1, 256, 100, 512, 2, 1.0f },
        { 256, 4, 1, 1, 1024, 700, 512, 2, 1.0f },
        { 256, 4, 1, 1, 1024, 700, 0, 2, 1.0f },
        { 256, 4, 1, 9, 256, 0, 512, 2, 1.0f },
        { 256, 4, 1, 130, 256, 0, 512, 2, 1.0f },
        { 256, 4, 1, 96, 1024, 600, 512, 2, 1.0f },
        // Mistral-7B shape: 32 heads over 8 kv heads of 128.
        { 128, 32, 8, 1, 512, 400, 0, 2, 0.08838834764831845f },
        { 128, 32, 8, 64, 256, 0, 0, 2, 0.08838834764831845f },
    };
    const int ncases = sizeof(cases) / sizeof(cases[0]);
    printf("[\n");
    for (int c = 0; c < ncases; ++c) {
        const struct fa_case fc = cases[c];
        const int D = fc.head_dim;
        const uint64_t seed = 7000 + c;
        lcg_state = seed;
        const size_t nq = (size_t) D * fc.n_q * fc.n_head, nk = (size_t) D * fc.n_kv * fc.n_head_kv;
        float * q = malloc(nq * sizeof(float));
        ggml_fp16_t * k = malloc(nk * sizeof(ggml_fp16_t));
        ggml_fp16_t * v = malloc(nk * sizeof(ggml_fp16_t));
        ggml_fp16_t * mask = malloc((size_t) fc.n_kv * fc.n_q * sizeof(ggml_fp16_t));
        // q as [token][head][dim]; k and v as [kv_head][cell][dim].
        for (size_t i = 0; i < nq; ++i) q[i] = next_value();
        for (size_t i = 0; i < nk; ++i) k[i] = ggml_fp32_to_fp16(next_value());
        for (size_t i = 0; i < nk; ++i) v[i] = ggml_fp32_to_fp16(next_value());
        // Causal, and windowed as llama.cpp's standard SWA: cell j is hidden from position p when j > p or p - j >= window.
        for (int t = 0; t < fc.n_q; ++t) {
            const int p = fc.pos0 + t;
            for (int j = 0; j < fc.n_kv; ++j) {
                const int hidden = j > p || (fc.window > 0 && p - j >= fc.window);
                mask[(size_t) t * fc.n_kv + j] = ggml_fp32_to_fp16(hidden ? -INFINITY : 0.0f);
            }
        }

        struct ggml_init_params params = { 64 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
        struct ggml_context * ctx = ggml_init(params);
        // ggml's layouts: q [D, n_head, n_q] permuted to [D, n_q, n_head]; k, v [D, n_kv, n_head_kv].
        struct ggml_tensor * qt = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, fc.n_head, fc.n_q);
        struct ggml_tensor * kt = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, fc.n_kv, fc.n_head_kv);
        struct ggml_tensor * vt = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, D, fc.n_kv, fc.n_head_kv);
        struct ggml_tensor * mt = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, fc.n_kv, fc.n_q);
        ggml_set_input(qt);
        ggml_set_input(kt);
        ggml_set_input(vt);
        ggml_set_input(mt);
        struct ggml_tensor * out =
            ggml_flash_attn_ext(ctx, ggml_permute(ctx, qt, 0, 2, 1, 3), kt, vt, mt, fc.scale, 0.0f, 0.0f);
        ggml_prec_set_acc(out, GGML_PREC_F32);
        ggml_set_output(out);
        struct ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_t backend = ggml_backend_cpu_init();
        ggml_backend_cpu_set_n_threads(backend, fc.threads);
        ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
        if (!ggml_gallocr_alloc_graph(galloc, gf)) {
            fprintf(stderr, "graph allocation failed\n");
            return 1;
        }
        ggml_backend_tensor_set(qt, q, 0, ggml_nbytes(qt));
        ggml_backend_tensor_set(kt, k, 0, ggml_nbytes(kt));
        ggml_backend_tensor_set(vt, v, 0, ggml_nbytes(vt));
        ggml_backend_tensor_set(mt, mask, 0, ggml_nbytes(mt));
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "compute failed\n");
            return 1;
        }
        // Output [D, n_head, n_q]: [token][head][dim], as our attention writes it.
        const size_t no = (size_t) D * fc.n_head * fc.n_q;
        uint32_t scale_bits;
        memcpy(&scale_bits, &fc.scale, 4);
        float * o = malloc(no * sizeof(float));
        ggml_backend_tensor_get(out, o, 0, no * sizeof(float));
        printf("%s  {\"head_dim\": %d, \"n_head\": %d, \"n_head_kv\": %d, \"n_q\": %d, \"n_kv\": %d, \"pos0\": %d, "
               "\"window\": %d, \"threads\": %d, \"scale_bits\": %u, \"seed\": %llu, \"out_fnv\": \"%016llx\", \"first\": [",
               c ? ",\n" : "", D, fc.n_head, fc.n_head_kv, fc.n_q, fc.n_kv, fc.pos0, fc.window, fc.threads,
               scale_bits, (unsigned long long) seed,
               (unsigned long long) fnv1a(o, no * sizeof(float)));
        for (int i = 0; i < 16; ++i) printf(i ? ",%u" : "%u", ((const uint32_t *) o)[i]);
        printf("]}");
        ggml_gallocr_free(galloc);
        ggml_backend_free(backend);
        ggml_free(ctx);
        free(q); free(k); free(v); free(mask); free(o);
    }
    printf("\n]\n");
    return 0;
}
