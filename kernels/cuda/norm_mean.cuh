// The RMS norm's mean square in the CPU engine's bits
// (`leanstream_kernels::ops::rms_norm`, as GGML: each square rounded to
// f32, the squares added in order in f64, that sum divided by `d` and
// rounded to f32).
//
// A device block adds the squares in a tree, and its f64 sum can differ
// from the CPU's in the last bits. With every term >= 0, both sums lie
// within (d - 1)·2^-53 of the exact sum, relative. When every f64 sum
// that close to the tree's gives the same f32 mean (the map is monotonic,
// so the two ends decide), that mean is the CPU's. Otherwise the mean sits
// on the edge of an f32 rounding (about d·2^-27 of rows: one in 30,000 at
// d = 4096, one in 230,000 at 576) and the row's squares are added again
// in the CPU's order.
#pragma once
#include "blocks.cuh"

// 2^-53, the unit roundoff of f64.
#define F64_UNIT_ROUNDOFF 1.1102230246251565e-16

HD float mean_of_sum(double sum, int d) { return (float)(sum / (double)d); }

// The mean from a block's tree sum of the squares of `d` values, or false
// when that sum does not settle it (a NaN or infinite sum neither).
HD bool norm_mean_settled(double tree_sum, int d, float* mean) {
    // Twice the two sums' distance bound, and then some for the rounding
    // of `reach` and of the ends themselves.
    double reach = 4.0 * (double)d * F64_UNIT_ROUNDOFF * tree_sum;
    float lo = mean_of_sum(tree_sum - reach, d);
    float hi = mean_of_sum(tree_sum + reach, d);
    *mean = mean_of_sum(tree_sum, d);
    return lo == hi && *mean == lo;
}

// The CPU's chain: squares rounded to f32, added in order in f64.
HD float norm_mean_in_order(const float* x, int d) {
    double sum = 0.0;
    for (int i = 0; i < d; ++i) sum += (double)mul_rn(x[i], x[i]);
    return mean_of_sum(sum, d);
}
