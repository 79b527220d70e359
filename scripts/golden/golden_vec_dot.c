// Records llama.cpp's CPU dot products (activation quantization + vec_dot)
// on deterministic pseudo-random rows, for bit-exact kernel tests.
// Built and run by make_goldens.sh; writes JSON to stdout.
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_common.h"

int main(void) {
    ggml_cpu_init();
    const enum ggml_type types[] = { GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
                                     GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K };
    const int sizes[] = { 256, 1024, 2048 };
    printf("[\n");
    int first = 1;
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ++ti) {
        for (size_t si = 0; si < 3; ++si) {
            const enum ggml_type wt = types[ti];
            const int n = sizes[si];
            const uint64_t seed = 1000 * ti + si + 1;
            lcg_state = seed;
            float * w = malloc(n * sizeof(float));
            float * a = malloc(n * sizeof(float));
            for (int i = 0; i < n; ++i) w[i] = next_value();
            for (int i = 0; i < n; ++i) a[i] = next_value();
            const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(wt);
            const enum ggml_type at = cpu->vec_dot_type;
            uint8_t * wq = malloc(ggml_row_size(wt, n));
            uint8_t * aq = malloc(ggml_row_size(at, n));
            ggml_quantize_chunk(wt, w, wq, 0, 1, n, NULL);
            ggml_get_type_traits_cpu(at)->from_float(a, aq, n);
            float result = 0.0f;
            cpu->vec_dot(n, &result, 0, wq, 0, aq, 0, 1);
            uint32_t bits;
            memcpy(&bits, &result, 4);
            printf("%s  {\"type\": \"%s\", \"n\": %d, \"seed\": %llu, \"result_bits\": %u, \"weights_hex\": \"",
                   first ? "" : ",\n", ggml_type_name(wt), n, (unsigned long long) seed, bits);
            for (size_t i = 0; i < ggml_row_size(wt, n); ++i) printf("%02x", wq[i]);
            printf("\"}");
            first = 0;
            free(w); free(a); free(wq); free(aq);
        }
    }
    printf("\n]\n");
    return 0;
}
