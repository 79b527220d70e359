// What the C harnesses in this folder share with each other and with the
// Rust tests that read their output (kernels/tests/harness): the
// pseudo-random generator, value for value, and the FNV-1a hash of output bits.
#pragma once
#include <stddef.h>
#include <stdint.h>

static uint64_t lcg_state;

static inline void lcg_step(void) { lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL; }

// A value in [-1, 1); every 61st or so an outlier in [-20, 20), as real activations have.
static inline float next_value(void) {
    lcg_step();
    float u = (float) (lcg_state >> 40) / 16777216.0f - 0.5f;
    return ((lcg_state >> 20) % 61 == 0) ? u * 40.0f : u * 2.0f;
}

static inline uint32_t next_u32(void) {
    lcg_step();
    return (uint32_t) (lcg_state >> 32);
}

static inline uint64_t fnv1a(const void * data, size_t len) {
    const uint8_t * p = data;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < len; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}
