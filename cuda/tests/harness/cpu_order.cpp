// The device matvec's arithmetic (`kernels/cuda/cpu_order.cuh`) compiled for
// the host, for `cpu_order.rs`: `row_product` is the device's own, with the
// header's host forms of the lane primitives (loops over a row's eight
// lanes where the device shuffles).
#include "cpu_order.cuh"

// One output: weight row `w` of type `ty` (a GGML id) with activation row
// `x` in its dot type, `cols` values, in order `order` (ORDER_*; the
// repacked orders as the kernel resolves them per token).
extern "C" float cpu_order_row_product(int ty, const u8* w, const u8* x, int cols, int order) {
    return row_product_of(ty, w, x, cols, order);
}

extern "C" float cpu_order_half_to_float(u16 h) { return half_to_float(h); }
