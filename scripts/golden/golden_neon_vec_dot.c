/* Records llama.cpp's aarch64 vec-dots for kernels/tests/neon_vec_dot_golden.rs.
 *
 * Reads the cases that test writes (LEANSTREAM_RECORD_NEON_CASES=path: per
 * case u32 type id, n, weight bytes, activation bytes, then the two rows) and
 * prints one JSON line per case with the result's bits, calling the
 * `ggml_vec_dot_*` of a real aarch64 libggml-cpu.so directly (not the
 * repacked gemv/gemm a model takes for some types). Two recordings, one per
 * build (GCC, -O3): `scripts/aarch64.sh llama armv8-a` (no dotprod; GGML's
 * emulated byte dot) for vec_dot.jsonl, and `scripts/aarch64.sh llama
 * armv8.2-a+dotprod` (`sdot`) for vec_dot_dotprod.jsonl, each run as a CPU of
 * its level. From the repository root:
 *
 *   LEANSTREAM_RECORD_NEON_CASES=/tmp/neon_cases.bin \
 *       cargo test -p leanstream-kernels --test neon_vec_dot_golden
 *   for arch in armv8-a armv8.2-a+dotprod; do
 *     BIN=$(scripts/aarch64.sh llama $arch)
 *     aarch64-linux-gnu-gcc -O2 scripts/golden/golden_neon_vec_dot.c -o /tmp/neon_oracle_$arch \
 *         -L$BIN -lggml-cpu -lggml-base -Wl,-rpath,$BIN
 *   done
 *   QEMU_CPU=cortex-a72 qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/neon_oracle_armv8-a \
 *       /tmp/neon_cases.bin > data/golden/aarch64/vec_dot.jsonl
 *   QEMU_CPU=max qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/neon_oracle_armv8.2-a+dotprod \
 *       /tmp/neon_cases.bin > data/golden/aarch64/vec_dot_dotprod.jsonl
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t ggml_fp16_t;
#define VEC_DOT(name) \
    void name(int n, float *s, size_t bs, const void *vx, size_t bx, const void *vy, size_t by, int nrc)
VEC_DOT(ggml_vec_dot_q4_0_q8_0);
VEC_DOT(ggml_vec_dot_q4_1_q8_1);
VEC_DOT(ggml_vec_dot_q5_0_q8_0);
VEC_DOT(ggml_vec_dot_q5_1_q8_1);
VEC_DOT(ggml_vec_dot_q8_0_q8_0);
VEC_DOT(ggml_vec_dot_q4_K_q8_K);
VEC_DOT(ggml_vec_dot_q5_K_q8_K);
VEC_DOT(ggml_vec_dot_q6_K_q8_K);
void ggml_vec_dot_f32(int n, float *s, size_t bs, const float *x, size_t bx, const float *y, size_t by, int nrc);
void ggml_vec_dot_f16(int n, float *s, size_t bs, ggml_fp16_t *x, size_t bx, ggml_fp16_t *y, size_t by, int nrc);

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CASES\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) {
        perror(argv[1]);
        return 1;
    }
    uint32_t hdr[4];
    while (fread(hdr, 4, 4, in) == 4) {
        void *w = aligned_alloc(64, (hdr[2] + 63) / 64 * 64);
        void *a = aligned_alloc(64, (hdr[3] + 63) / 64 * 64);
        if (fread(w, 1, hdr[2], in) != hdr[2] || fread(a, 1, hdr[3], in) != hdr[3]) {
            fprintf(stderr, "truncated case\n");
            return 1;
        }
        int n = (int)hdr[1];
        float s = 0;
        const char *name;
        switch (hdr[0]) {
            case 0: name = "f32"; ggml_vec_dot_f32(n, &s, 0, w, 0, a, 0, 1); break;
            case 1: name = "f16"; ggml_vec_dot_f16(n, &s, 0, w, 0, a, 0, 1); break;
            case 2: name = "q4_0"; ggml_vec_dot_q4_0_q8_0(n, &s, 0, w, 0, a, 0, 1); break;
            case 3: name = "q4_1"; ggml_vec_dot_q4_1_q8_1(n, &s, 0, w, 0, a, 0, 1); break;
            case 6: name = "q5_0"; ggml_vec_dot_q5_0_q8_0(n, &s, 0, w, 0, a, 0, 1); break;
            case 7: name = "q5_1"; ggml_vec_dot_q5_1_q8_1(n, &s, 0, w, 0, a, 0, 1); break;
            case 8: name = "q8_0"; ggml_vec_dot_q8_0_q8_0(n, &s, 0, w, 0, a, 0, 1); break;
            case 12: name = "q4_K"; ggml_vec_dot_q4_K_q8_K(n, &s, 0, w, 0, a, 0, 1); break;
            case 13: name = "q5_K"; ggml_vec_dot_q5_K_q8_K(n, &s, 0, w, 0, a, 0, 1); break;
            case 14: name = "q6_K"; ggml_vec_dot_q6_K_q8_K(n, &s, 0, w, 0, a, 0, 1); break;
            default: fprintf(stderr, "unknown type %u\n", hdr[0]); return 1;
        }
        uint32_t bits;
        memcpy(&bits, &s, 4);
        printf("{\"type\":\"%s\",\"n\":%d,\"bits\":\"0x%08x\"}\n", name, n, bits);
        free(w);
        free(a);
    }
    return 0;
}
