// The device matvec's arithmetic (`kernels/cuda/cpu_order.cuh`) compiled for
// the host, for `cpu_order.rs`: `row_product` is the device's own, with the
// header's host forms of the lane primitives (loops over a row's eight
// lanes where the device shuffles); and the RMS norm's mean
// (`norm_mean.cuh`) as `rms_norm_rows` takes it.
#include "cpu_order.cuh"
#include "norm_mean.cuh"

// One output: weight row `w` of type `ty` (a GGML id) with activation row
// `x` in its dot type, `cols` values, in order `order` (ORDER_*; the
// repacked orders as the kernel resolves them per token).
extern "C" float cpu_order_row_product(int ty, const u8* w, const u8* x, int cols, int order) {
    return row_product_of(ty, w, x, cols, order);
}

extern "C" float cpu_order_half_to_float(u16 h) { return half_to_float(h); }

// The norm's mean of row `x` (`d` values) from a block's tree sum of its
// squares: settled by that sum, else the CPU's chain, as `rms_norm_rows`
// does (there thread 0 runs the chain). `*settled` says which.
extern "C" float cpu_order_norm_mean(const float* x, int d, double tree_sum, int* settled) {
    float mean;
    *settled = norm_mean_settled(tree_sum, d, &mean);
    return *settled ? mean : norm_mean_in_order(x, d);
}
