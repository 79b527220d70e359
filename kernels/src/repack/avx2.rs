//! AVX2 + FMA kernels for the repacked Q4_K arithmetic (see the parent
//! module). Like GGML's, they keep one output per float lane: a tile of up to
//! eight (weight row, activation row) pairs shares one accumulator vector,
//! so each super-block (gemv) or sub-block pair (gemm) costs one vector
//! `fmadd` for eight outputs, after a transposing reduction of their integer
//! sums.

use std::arch::x86_64::*;

use super::Mode;
use crate::blocks::*;
use crate::dot::avx2::{common_len, fp16, k4_scale, k4_scales_and_mins, load_256, q8k_sub_block_sums};

/// Outputs per tile: one per f32 lane.
const LANES: usize = 8;

/// `out[r * ys.len() + t]` = the repacked-path output for weight row `ws[r]`
/// and activation row `ys[t]`, every row taken by `mode`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`crate::dot::has_avx2`]).
pub(crate) unsafe fn tiles(ws: &[&[BlockQ4K]], ys: &[&[BlockQ8K]], mode: Mode, out: &mut [f32]) {
    let n = ys.len();
    if out.len() < ws.len() * n {
        return;
    }
    // One activation row: eight weight rows per tile; several: one weight
    // row (its unpacked blocks reused) against up to eight activation rows.
    let (row_tile, token_tile) = if n == 1 { (LANES, 1) } else { (1, LANES) };
    for (rc, w_chunk) in ws.chunks(row_tile).enumerate() {
        for (tc, y_chunk) in ys.chunks(token_tile).enumerate() {
            let (r0, t0) = (rc * row_tile, tc * token_tile);
            macro_rules! run {
                ($R:literal, $T:literal) => {{
                    let w: [&[BlockQ4K]; $R] = std::array::from_fn(|i| w_chunk[i]);
                    let y: [&[BlockQ8K]; $T] = std::array::from_fn(|i| y_chunk[i]);
                    let result = match mode {
                        Mode::Gemm => tile::<$R, $T, true>(w, y),
                        Mode::Gemv => tile::<$R, $T, false>(w, y),
                    };
                    for (r, row) in result.iter().enumerate() {
                        out[(r0 + r) * n + t0..][..$T].copy_from_slice(row);
                    }
                }};
            }
            match (w_chunk.len(), y_chunk.len()) {
                (1, 1) => run!(1, 1),
                (2, 1) => run!(2, 1),
                (3, 1) => run!(3, 1),
                (4, 1) => run!(4, 1),
                (5, 1) => run!(5, 1),
                (6, 1) => run!(6, 1),
                (7, 1) => run!(7, 1),
                (8, 1) => run!(8, 1),
                (1, 2) => run!(1, 2),
                (1, 3) => run!(1, 3),
                (1, 4) => run!(1, 4),
                (1, 5) => run!(1, 5),
                (1, 6) => run!(1, 6),
                (1, 7) => run!(1, 7),
                (1, 8) => run!(1, 8),
                // Chunks are at most 8 x 1 or 1 x 8.
                _ => {}
            }
        }
    }
}

/// Lane `k` = the sum of the eight lanes of `v[k]` (exact, in i32).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce_8x8(v: &[__m256i; LANES]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    // [v0..v3 low-half sums | v0..v3 high-half sums], likewise v4..v7.
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(h0123, h4567, 0x20),
        _mm256_permute2x128_si256(h0123, h4567, 0x31),
    )
}

/// Transposes eight 4-lane vectors: result `j`, lane `k` = lane `j` of `p[k]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_4x8(p: &[__m128i; LANES]) -> [__m256i; 4] {
    let y: [__m256i; 4] = std::array::from_fn(|k| _mm256_set_m128i(p[k + 4], p[k]));
    let t0 = _mm256_unpacklo_epi32(y[0], y[1]);
    let t1 = _mm256_unpacklo_epi32(y[2], y[3]);
    let t2 = _mm256_unpackhi_epi32(y[0], y[1]);
    let t3 = _mm256_unpackhi_epi32(y[2], y[3]);
    [
        _mm256_unpacklo_epi64(t0, t1),
        _mm256_unpackhi_epi64(t0, t1),
        _mm256_unpacklo_epi64(t2, t3),
        _mm256_unpackhi_epi64(t2, t3),
    ]
}

/// `R` weight rows x `T` activation rows (`R * T <= 8`), output `(r, t)` in
/// lane `r * T + t`. `GEMM`: one `fmadd` per sub-block pair, else one per
/// super-block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const T: usize, const GEMM: bool>(
    xs: [&[BlockQ4K]; R],
    ys: [&[BlockQ8K]; T],
) -> [[f32; T]; R] {
    const { assert!(R * T <= LANES) };
    let nb = common_len(&xs, &ys);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut acc_min = _mm256_setzero_ps();
    for i in 0..nb {
        // Per row: the eight scales (16-bit lanes, both halves) and mins; per
        // output: fp16(d) * d8 and fp16(dmin) * d8, the products GGML forms.
        let mut scales = [_mm256_setzero_si256(); R];
        let mut mins = [_mm_setzero_si128(); R];
        let mut xd = [0.0f32; LANES];
        let mut xdmin = [0.0f32; LANES];
        let mut yd = [0.0f32; LANES];
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let mins_and_scales = k4_scales_and_mins(&xb.scales);
            scales[r] = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(mins_and_scales));
            mins[r] = _mm256_extracti128_si256(mins_and_scales, 1);
            for t in 0..T {
                xd[r * T + t] = fp16(xb.d);
                xdmin[r * T + t] = fp16(xb.dmin);
                yd[r * T + t] = ys[t].get_unchecked(i).d;
            }
        }
        let yd = _mm256_loadu_ps(yd.as_ptr());
        let d = _mm256_mul_ps(_mm256_loadu_ps(xd.as_ptr()), yd);
        let dmin = _mm256_mul_ps(_mm256_loadu_ps(xdmin.as_ptr()), yd);

        let mut block_sums = [_mm256_setzero_si256(); LANES];
        for p in 0..QK_K / 64 {
            // Eight lanes of partial integer sums per output for sub-blocks
            // 2p (low nibbles) and 2p + 1 (high nibbles), scales applied.
            let mut sums = [_mm256_setzero_si256(); LANES];
            for r in 0..R {
                let xb = xs[r].get_unchecked(i);
                let scale_l = k4_scale(scales[r], 2 * p);
                let scale_h = k4_scale(scales[r], 2 * p + 1);
                let q4bits = _mm256_loadu_si256(xb.qs.as_ptr().add(32 * p) as *const __m256i);
                let q4l = _mm256_and_si256(q4bits, m4);
                let q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                for t in 0..T {
                    let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(64 * p);
                    let lo = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, load_256(q8)));
                    let hi = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, load_256(q8.add(32))));
                    sums[r * T + t] = _mm256_add_epi32(lo, hi);
                }
            }
            if GEMM {
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_8x8(&sums)), d, acc);
            } else {
                for (b, s) in block_sums.iter_mut().zip(&sums) {
                    *b = _mm256_add_epi32(*b, *s);
                }
            }
        }
        if !GEMM {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_8x8(&block_sums)), d, acc);
        }

        // min * bsum per sub-block pair: four lanes per output, transposed
        // so each pair is one vector over the outputs.
        let mut pair_mins = [_mm_setzero_si128(); LANES];
        for t in 0..T {
            let bsums = q8k_sub_block_sums(ys[t].get_unchecked(i));
            for r in 0..R {
                pair_mins[r * T + t] = _mm_madd_epi16(mins[r], bsums);
            }
        }
        let by_pair = transpose_4x8(&pair_mins);
        if GEMM {
            for m in by_pair {
                acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), dmin, acc_min);
            }
        } else {
            let all = _mm256_add_epi32(
                _mm256_add_epi32(by_pair[0], by_pair[1]),
                _mm256_add_epi32(by_pair[2], by_pair[3]),
            );
            acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), dmin, acc_min);
        }
    }
    let mut lanes = [0.0f32; LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_sub_ps(acc, acc_min));
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = lanes[r * T + t];
        }
    }
    out
}
