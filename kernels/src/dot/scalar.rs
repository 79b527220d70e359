//! Portable dot products: GGML's `ggml_vec_dot_*_generic` formulas (and the
//! non-SIMD branches of `vec.cpp` for the float types), in the same order of
//! operations. They define the semantics the SIMD kernels must agree with.

use half::{bf16, f16};

use crate::blocks::*;

pub fn q4_0_q8_0(x: &[BlockQ4_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = (xb.qs[j] & 0x0F) as i32 - 8;
            let v1 = (xb.qs[j] >> 4) as i32 - 8;
            sumi += v0 * yb.qs[j] as i32 + v1 * yb.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * xb.d.to_f32() * yb.d.to_f32();
    }
    sumf
}

pub fn q4_1_q8_1(x: &[BlockQ4_1], y: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = (xb.qs[j] & 0x0F) as i32;
            let v1 = (xb.qs[j] >> 4) as i32;
            sumi += v0 * yb.qs[j] as i32 + v1 * yb.qs[j + QK / 2] as i32;
        }
        sumf += (xb.d.to_f32() * yb.d.to_f32()) * sumi as f32 + xb.m.to_f32() * yb.s.to_f32();
    }
    sumf
}

/// Value `j` of a Q5 block (0..32) before any offset: 4 low bits from the
/// nibbles, bit 4 from `qh`.
#[inline]
fn q5_value(qs: &[u8; 16], qh: u32, j: usize) -> i32 {
    let low = if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 };
    (low as u32 | (((qh >> j) & 1) << 4)) as i32
}

pub fn q5_0_q8_0(x: &[BlockQ5_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let qh = u32::from_le_bytes(xb.qh);
        let sumi: i32 = (0..QK).map(|j| (q5_value(&xb.qs, qh, j) - 16) * yb.qs[j] as i32).sum();
        sumf += (xb.d.to_f32() * yb.d.to_f32()) * sumi as f32;
    }
    sumf
}

pub fn q5_1_q8_1(x: &[BlockQ5_1], y: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let qh = u32::from_le_bytes(xb.qh);
        let sumi: i32 = (0..QK).map(|j| q5_value(&xb.qs, qh, j) * yb.qs[j] as i32).sum();
        sumf += (xb.d.to_f32() * yb.d.to_f32()) * sumi as f32 + xb.m.to_f32() * yb.s.to_f32();
    }
    sumf
}

pub fn q8_0_q8_0(x: &[BlockQ8_0], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let sumi: i32 = xb.qs.iter().zip(&yb.qs).map(|(&a, &b)| a as i32 * b as i32).sum();
        sumf += sumi as f32 * (xb.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

/// The K-quant generic kernels accumulate integer products in eight lanes
/// (value index mod 8) and only then scale them into eight float sums.
fn accumulate_lanes(aux32: &mut [i32; 8], scale: i32, a: &[i8], q8: &[i8]) {
    for (lanes_a, lanes_q) in a.chunks_exact(8).zip(q8.chunks_exact(8)) {
        for l in 0..8 {
            aux32[l] += scale * (lanes_q[l] as i32 * lanes_a[l] as i32);
        }
    }
}

/// Shared tail of the Q4_K/Q5_K generic kernels: `values` are the unsigned
/// quants of one super-block.
fn k4_block(values: &[i8; QK_K], scales: &[u8; 12], d: f16, dmin: f16, yb: &BlockQ8K, sums: &mut [f32; 8]) -> f32 {
    let (sc, mins) = unpack_scales_mins_k4(scales);
    let sumi: i32 = yb
        .bsums
        .iter()
        .enumerate()
        .map(|(j, &b)| b as i32 * mins[j / 2] as i32)
        .sum();
    let mut aux32 = [0i32; 8];
    for (sub, s) in sc.iter().enumerate() {
        let range = 32 * sub..32 * sub + 32;
        accumulate_lanes(&mut aux32, *s as i32, &values[range.clone()], &yb.qs[range]);
    }
    let dk = d.to_f32() * yb.d;
    for (s, &a) in sums.iter_mut().zip(&aux32) {
        *s += dk * a as f32;
    }
    dmin.to_f32() * yb.d * sumi as f32
}

pub fn q4_k_q8_k(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut values = [0i8; QK_K];
        for (chunk, qs) in xb.qs.chunks_exact(32).enumerate() {
            for (l, &q) in qs.iter().enumerate() {
                values[64 * chunk + l] = (q & 0x0F) as i8;
                values[64 * chunk + 32 + l] = (q >> 4) as i8;
            }
        }
        sumf -= k4_block(&values, &xb.scales, xb.d, xb.dmin, yb, &mut sums);
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

pub fn q5_k_q8_k(x: &[BlockQ5K], y: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut values = [0i8; QK_K];
        for (chunk, qs) in xb.qs.chunks_exact(32).enumerate() {
            let (bit_lo, bit_hi) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            for (l, &q) in qs.iter().enumerate() {
                let h = xb.qh[l];
                values[64 * chunk + l] = ((q & 0x0F) + if h & bit_lo != 0 { 16 } else { 0 }) as i8;
                values[64 * chunk + 32 + l] = ((q >> 4) + if h & bit_hi != 0 { 16 } else { 0 }) as i8;
            }
        }
        sumf -= k4_block(&values, &xb.scales, xb.d, xb.dmin, yb, &mut sums);
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

pub fn q6_k_q8_k(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    let mut sums = [0.0f32; 8];
    for (xb, yb) in x.iter().zip(y) {
        let mut values = [0i8; QK_K];
        for half in 0..2 {
            let ql = &xb.ql[64 * half..];
            let qh = &xb.qh[32 * half..];
            let a = &mut values[128 * half..];
            for l in 0..32 {
                a[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                a[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                a[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                a[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let mut aux32 = [0i32; 8];
        for (sub, &s) in xb.scales.iter().enumerate() {
            let range = 16 * sub..16 * sub + 16;
            accumulate_lanes(&mut aux32, s as i32, &values[range.clone()], &yb.qs[range]);
        }
        let d = xb.d.to_f32() * yb.d;
        for (s, &a) in sums.iter_mut().zip(&aux32) {
            *s += d * a as f32;
        }
    }
    let mut sumf = 0.0f32;
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `ggml_vec_dot_f32` without SIMD: f32 products summed in f64.
pub fn f32_f32(x: &[f32], y: &[f32]) -> f32 {
    x.iter().zip(y).fold(0.0f64, |acc, (&a, &b)| acc + (a * b) as f64) as f32
}

pub fn f16_f16(x: &[f16], y: &[f16]) -> f32 {
    x.iter()
        .zip(y)
        .fold(0.0f64, |acc, (&a, &b)| acc + (a.to_f32() * b.to_f32()) as f64) as f32
}

pub fn bf16_bf16(x: &[bf16], y: &[bf16]) -> f32 {
    x.iter()
        .zip(y)
        .fold(0.0f64, |acc, (&a, &b)| acc + (a.to_f32() * b.to_f32()) as f64) as f32
}

// ---------------------------------------------------------------------------
// llama.cpp's tiled K-quant matmul (`ggml-cpu/tiled/`), which the reference
// build runs for K-quant weights in a plain buffer against 8 or more
// activation rows, with its AVX-512 VNNI microkernel. Per super-block it
// forms exact integer sums, converts them to f32 once and scales them:
//   no min (Q6_K): r = f32(sum_s sc[s] * sum_e (q[e] - 32) * y[e]) * d
//   min (Q4/Q5_K): r = fma(-dmin, f32(sum_s m[s] * bsum[s]), f32(sum_s sc[s] * sum_e q[e] * y[e]) * d)
// and accumulates block after block, in order, acc = fma(r, y.d, acc) from
// acc = 0 (GCC contracts the kernel's `buf + r * d1` into one FMA).

/// The unsigned (0..64) values of a Q6_K block, in element order.
fn q6_k_unsigned(xb: &BlockQ6K) -> [u8; QK_K] {
    let mut values = [0u8; QK_K];
    for half in 0..2 {
        let ql = &xb.ql[64 * half..];
        let qh = &xb.qh[32 * half..];
        let a = &mut values[128 * half..];
        for l in 0..32 {
            a[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            a[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            a[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            a[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    values
}

/// `sum_e q[e] * y[e]` over one sub-block.
fn int_dot(q: &[u8], y: &[i8]) -> i32 {
    q.iter().zip(y).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// Q6_K weights · Q8_K activations, the tiled matmul's way.
pub fn q6_k_q8_k_tiled(x: &[BlockQ6K], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let values = q6_k_unsigned(xb);
        let mut sum = 0i32;
        for (sub, &sc) in xb.scales.iter().enumerate() {
            let range = 16 * sub..16 * sub + 16;
            let raw = int_dot(&values[range.clone()], &yb.qs[range]) - 32 * yb.bsums[sub] as i32;
            sum += sc as i32 * raw;
        }
        let r = sum as f32 * xb.d.to_f32();
        acc = r.mul_add(yb.d, acc);
    }
    acc
}

/// One Q4_K/Q5_K super-block of the tiled matmul: `values` are its unsigned quants.
fn k4_tiled_block(values: &[u8; QK_K], scales: &[u8; 12], d: f16, dmin: f16, yb: &BlockQ8K) -> f32 {
    let (sc, mins) = unpack_scales_mins_k4(scales);
    let mut s1 = 0i32;
    let mut s2 = 0i32;
    for sub in 0..QK_K / 32 {
        let range = 32 * sub..32 * sub + 32;
        s1 += sc[sub] as i32 * int_dot(&values[range.clone()], &yb.qs[range]);
        s2 += mins[sub] as i32 * (yb.bsums[2 * sub] as i32 + yb.bsums[2 * sub + 1] as i32);
    }
    (-dmin.to_f32()).mul_add(s2 as f32, s1 as f32 * d.to_f32())
}

/// Q4_K weights · Q8_K activations, the tiled matmul's way.
pub fn q4_k_q8_k_tiled(x: &[BlockQ4K], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut values = [0u8; QK_K];
        for (chunk, qs) in xb.qs.chunks_exact(32).enumerate() {
            for (l, &q) in qs.iter().enumerate() {
                values[64 * chunk + l] = q & 0x0F;
                values[64 * chunk + 32 + l] = q >> 4;
            }
        }
        let r = k4_tiled_block(&values, &xb.scales, xb.d, xb.dmin, yb);
        acc = r.mul_add(yb.d, acc);
    }
    acc
}

/// Q5_K weights · Q8_K activations, the tiled matmul's way.
pub fn q5_k_q8_k_tiled(x: &[BlockQ5K], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let mut values = [0u8; QK_K];
        for (chunk, qs) in xb.qs.chunks_exact(32).enumerate() {
            let (bit_lo, bit_hi) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            for (l, &q) in qs.iter().enumerate() {
                let h = xb.qh[l];
                values[64 * chunk + l] = (q & 0x0F) | if h & bit_lo != 0 { 16 } else { 0 };
                values[64 * chunk + 32 + l] = (q >> 4) | if h & bit_hi != 0 { 16 } else { 0 };
            }
        }
        let r = k4_tiled_block(&values, &xb.scales, xb.d, xb.dmin, yb);
        acc = r.mul_add(yb.d, acc);
    }
    acc
}
