//! Q4_K matrix products in the arithmetic of llama.cpp's *repacked* path.
//!
//! On an AVX2 CPU, llama.cpp does not multiply a Q4_K weight matrix with
//! `ggml_vec_dot_q4_K_q8_K`. Its CPU backend places every Q4_K weight whose
//! row count (`ne[1]`) is a multiple of 8 in the "CPU_REPACK" buffer type
//! (`ggml-cpu/repack.cpp`, `ggml_repack_get_optimal_repack_type` →
//! `q4_K_8x8_q8_K`), which interleaves 8 rows into `block_q4_Kx8`, and
//! `forward_mul_mat` then runs:
//!
//! * activation rows in whole groups of four (`i < n - n % 4`) quantized by
//!   `ggml_quantize_mat_q8_K_4x8` and multiplied by
//!   `ggml_gemm_q4_K_8x8_q8_K` (called only when a chunk has more than three
//!   rows, which is the same condition);
//! * the other `n % 4` rows (all of them when `n < 4`) quantized by the
//!   ordinary `quantize_row_q8_K` and multiplied by `ggml_gemv_q4_K_8x8_q8_K`,
//!   one row per call.
//!
//! Threads split the weight rows into chunks aligned to 8; every output is
//! computed by one kernel call either way, so neither the chunking nor the
//! thread count changes a result. The reference build (`-march=native` on an
//! AVX-512 machine) takes the AVX-512 branch of the gemm and the AVX2 gemv;
//! both, and the gemm's AVX2 tail, give each output the same arithmetic:
//!
//! * per super-block `b` and, for the gemm, per pair `p` of 32-value
//!   sub-blocks (`2p`, `2p + 1`), an exact integer `isum` (sum of
//!   `scale * Σ q4 · q8`) and `imin` (sum of `min * bsum`) — for the gemv the
//!   same sums over all eight sub-blocks;
//! * `acc = fma(float(isum), fp16(d) * d8, acc)` and
//!   `acc_min = fma(float(imin), fp16(dmin) * d8, acc_min)`, one lane each,
//!   in that order over `b` (and `p`), starting from zero;
//! * the output `acc - acc_min`.
//!
//! That differs from `vec_dot`'s eight-lane partial sums, hence this module.
//! It reads the standard Q4_K blocks in place (weights stay mmapped) and
//! reproduces only the arithmetic, not the interleaved layout.
//!
//! The 4x8 quantizer gives the same quants, scale and sums as
//! `quantize_row_q8_K` except when a super-block's largest magnitude occurs
//! with both signs: it then takes the positive one where the reference takes
//! the first. That negates every quant and the scale together, which leaves
//! every product above unchanged bit for bit (`fma(-i, -s, acc) =
//! fma(i, s, acc)`), so activations are quantized once, the ordinary way,
//! for every row.

use crate::blocks::*;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

/// Which repacked kernel an activation row goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `ggml_gemm_q4_K_8x8_q8_K`: rows in whole groups of four.
    Gemm,
    /// `ggml_gemv_q4_K_8x8_q8_K`: the remaining `n % 4` rows.
    Gemv,
}

/// Whether llama.cpp's AVX2 CPU backend repacks a Q4_K matrix of `rows`
/// rows (and so computes it as this module does). Always false off x86_64:
/// llama.cpp's aarch64 repacking (`q4_K_8x4` with dotprod, `q4_K_8x8` with
/// i8mm, `ggml-cpu/arch/arm/repack.cpp`) is another arithmetic, not
/// emulated; there every Q4_K product is the vec-dot's.
pub fn q4k_is_repacked(rows: usize) -> bool {
    cfg!(target_arch = "x86_64") && rows.is_multiple_of(8)
}

/// How many of `n` activation rows go through the gemm (the first ones);
/// the rest go through the gemv.
pub fn gemm_rows(n: usize) -> usize {
    n - n % 4
}

/// One output of the repacked path: weight row `x` (Q4_K) with activation
/// row `y` (Q8_K), for a row taken by `mode`. Portable; bit-identical to
/// the AVX2 kernels (and to llama.cpp).
pub fn dot(x: &[BlockQ4K], y: &[BlockQ8K], mode: Mode) -> f32 {
    let mut acc = 0.0f32;
    let mut acc_min = 0.0f32;
    for (xb, yb) in x.iter().zip(y) {
        let (scales, mins) = unpack_scales_mins_k4(&xb.scales);
        let d = xb.d.to_f32() * yb.d;
        let dmin = xb.dmin.to_f32() * yb.d;
        let (mut block_sum, mut block_min) = (0i32, 0i32);
        for p in 0..QK_K / 64 {
            let qs = &xb.qs[32 * p..32 * p + 32];
            let q8 = &yb.qs[64 * p..64 * p + 64];
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (qs[l] & 0x0F) as i32 * q8[l] as i32;
                hi += (qs[l] >> 4) as i32 * q8[l + 32] as i32;
            }
            let isum = scales[2 * p] as i32 * lo + scales[2 * p + 1] as i32 * hi;
            let bsum = |s: usize| yb.bsums[2 * s] as i32 + yb.bsums[2 * s + 1] as i32;
            let imin = mins[2 * p] as i32 * bsum(2 * p) + mins[2 * p + 1] as i32 * bsum(2 * p + 1);
            match mode {
                Mode::Gemm => {
                    acc = (isum as f32).mul_add(d, acc);
                    acc_min = (imin as f32).mul_add(dmin, acc_min);
                }
                Mode::Gemv => {
                    block_sum += isum;
                    block_min += imin;
                }
            }
        }
        if mode == Mode::Gemv {
            acc = (block_sum as f32).mul_add(d, acc);
            acc_min = (block_min as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

/// Slice form of [`dot`]: `out[r * ys.len() + t] = dot(ws[r], ys[t], mode)`.
pub(crate) fn scalar_tiles(ws: &[&[BlockQ4K]], ys: &[&[BlockQ8K]], mode: Mode, out: &mut [f32]) {
    let n = ys.len();
    for (w, out) in ws.iter().zip(out.chunks_mut(n.max(1))) {
        for (o, y) in out.iter_mut().zip(ys) {
            *o = dot(w, y, mode);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::quantize_row_q8_k;
    use bytemuck::Zeroable;
    use half::f16;

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    fn random_q4k(blocks: usize, state: &mut u64) -> Vec<BlockQ4K> {
        (0..blocks)
            .map(|_| {
                let mut b = BlockQ4K::zeroed();
                b.d = f16::from_bits(0x1400 + (xorshift(state) % 0x400) as u16);
                b.dmin = f16::from_bits(0x1000 + (xorshift(state) % 0x800) as u16);
                for s in &mut b.scales {
                    *s = xorshift(state) as u8;
                }
                for q in &mut b.qs {
                    *q = xorshift(state) as u8;
                }
                b
            })
            .collect()
    }

    fn q8k(x: &[f32]) -> Vec<BlockQ8K> {
        let mut blocks = vec![BlockQ8K::zeroed(); x.len() / QK_K];
        quantize_row_q8_k(x, bytemuck::cast_slice_mut(&mut blocks)).unwrap();
        blocks
    }

    #[test]
    fn modes_agree_to_rounding_with_the_exact_value() {
        let mut state = 99;
        let w = random_q4k(4, &mut state);
        let x: Vec<f32> = (0..4 * QK_K).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let a = q8k(&x);
        // Exact value of the same integer formula, in f64.
        let mut exact = 0.0f64;
        for (xb, yb) in w.iter().zip(&a) {
            let (sc, mn) = unpack_scales_mins_k4(&xb.scales);
            for s in 0..8 {
                let mut dot = 0i64;
                for l in 0..32 {
                    let byte = xb.qs[32 * (s / 2) + l];
                    let q = if s % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    dot += q as i64 * yb.qs[32 * s + l] as i64;
                }
                let bsum = yb.bsums[2 * s] as i64 + yb.bsums[2 * s + 1] as i64;
                exact += xb.d.to_f64() * yb.d as f64 * (sc[s] as i64 * dot) as f64;
                exact -= xb.dmin.to_f64() * yb.d as f64 * (mn[s] as i64 * bsum) as f64;
            }
        }
        for mode in [Mode::Gemm, Mode::Gemv] {
            let got = dot(&w, &a, mode) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * exact.abs().max(1.0),
                "{mode:?}: {got} vs {exact}"
            );
        }
    }

    #[test]
    fn gemm_takes_whole_groups_of_four() {
        assert_eq!(
            (0..10).map(gemm_rows).collect::<Vec<_>>(),
            [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
        );
        assert_eq!(q4k_is_repacked(640), cfg!(target_arch = "x86_64"));
        assert!(!q4k_is_repacked(644));
    }
}
