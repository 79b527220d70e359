// The device matvec's arithmetic (`kernels/cuda/cpu_order.cuh`) compiled for
// the host, for `cpu_order.rs`: `row_product` is the device's own, with the
// header's host forms of the lane primitives (loops over a row's eight
// lanes where the device shuffles).
#include "cpu_order.cuh"

// One output: weight row `w` of type `ty` (a GGML id) with activation row
// `x` in its dot type, `cols` values, in order `order` (ORDER_*; the
// repacked orders as the kernel resolves them per token). NaN for a type
// the device has no matvec for.
extern "C" float cpu_order_row_product(int ty, const u8* w, const u8* x, int cols, int order) {
    switch (ty) {
    case GGML_Q4_0: return row_product<GGML_Q4_0>(w, x, cols, order);
    case GGML_Q4_1: return row_product<GGML_Q4_1>(w, x, cols, order);
    case GGML_Q5_0: return row_product<GGML_Q5_0>(w, x, cols, order);
    case GGML_Q5_1: return row_product<GGML_Q5_1>(w, x, cols, order);
    case GGML_Q8_0: return row_product<GGML_Q8_0>(w, x, cols, order);
    case GGML_Q4_K: return row_product<GGML_Q4_K>(w, x, cols, order);
    case GGML_Q5_K: return row_product<GGML_Q5_K>(w, x, cols, order);
    case GGML_Q6_K: return row_product<GGML_Q6_K>(w, x, cols, order);
    case GGML_F16: return row_product<GGML_F16>(w, x, cols, order);
    case GGML_F32: return row_product<GGML_F32>(w, x, cols, order);
    default: return __builtin_nanf("");
    }
}

extern "C" float cpu_order_half_to_float(u16 h) { return half_to_float(h); }
