//! x86_64 kernels of the SIMD path. They vectorise only integer work (block
//! dots, popcounts, i16 sums), so results equal the scalar path bit for bit.

use std::arch::x86_64::*;

use super::{QuantMatrix, BLOCK};

/// `acc += Σ q·w` over one 32-byte block in eight i32 lanes, like ggml's
/// q8_0 dot: |q| · sign(w, q) as unsigned × signed bytes, pairs into i16 (no
/// saturation: 2 · 127² < 2¹⁵), then into i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_block(acc: __m256i, ax: __m256i, x: __m256i, w: *const i8) -> __m256i {
    let sy = _mm256_sign_epi8(_mm256_loadu_si256(w.cast()), x);
    let p16 = _mm256_maddubs_epi16(ax, sy);
    _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// The projection of `infer::project`: exact i32 row dots, four rows per
/// pass over `xq` so each input block is loaded once per four rows.
///
/// # Safety
/// AVX2 must be available; `m.cols == xq.len()`, a multiple of 32;
/// `m.q.len() >= y.len() · m.cols`, `m.scales.len() >= y.len()`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn project_avx2(m: &QuantMatrix, xq: &[i8], y: &mut [f32]) {
    let nb = xq.len() / BLOCK;
    debug_assert!(m.cols == xq.len() && xq.len().is_multiple_of(BLOCK) && m.q.len() >= y.len() * m.cols);
    let mut j = 0;
    while j < y.len() {
        let rows = (y.len() - j).min(4);
        let mut acc = [_mm256_setzero_si256(); 4];
        for b in 0..nb {
            let x = _mm256_loadu_si256(xq.as_ptr().add(b * BLOCK).cast());
            let ax = _mm256_sign_epi8(x, x);
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                *a = dot_block(*a, ax, x, m.q.as_ptr().add((j + r) * m.cols + b * BLOCK));
            }
        }
        for (r, a) in acc.iter().enumerate().take(rows) {
            y[j + r] = super::portable::projected(m.scales[j + r], hsum(*a));
        }
        j += rows;
    }
}

/// [`super::quantize_input`] compiled for AVX2 (same operations, same bytes).
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_avx2(x: &[f32], xq: &mut [i8]) -> Result<(), super::PredictError> {
    super::portable::quantize_body(x, xq)
}

/// The final scaling of the hashing scores compiled for AVX2.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scale_avx2(out: &mut [f32], acc: &[i16], scale: f32, bias: &[f32]) {
    super::portable::scale_body(out, acc, scale, bias)
}

/// `acc[i] += row[i]` in i16, 16 lanes at a time.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn add_row_avx2(acc: &mut [i16], row: &[i8]) {
    let n = acc.len().min(row.len());
    let mut i = 0;
    while i + 16 <= n {
        let r = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.as_ptr().add(i).cast()));
        let p = acc.as_mut_ptr().add(i).cast::<__m256i>();
        _mm256_storeu_si256(p, _mm256_add_epi16(_mm256_loadu_si256(p), r));
        i += 16;
    }
    for (a, &r) in acc[i..n].iter_mut().zip(&row[i..n]) {
        *a = a.wrapping_add(r as i16);
    }
}

/// The first key with the most bits equal to `code`: AVX-512 VPOPCNTDQ over
/// eight keys at once when the CPU has it, else hardware popcnt per key.
pub(super) fn best_key(keys: &[u64], code: u64, mask: u64) -> usize {
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vpopcntdq") {
        // SAFETY: features checked just above.
        unsafe { best_key_avx512(keys, code, mask) }
    } else if is_x86_feature_detected!("popcnt") {
        // SAFETY: feature checked just above.
        unsafe { best_key_popcnt(keys, code, mask) }
    } else {
        super::portable::best_key_scalar(keys, code, mask)
    }
}

#[target_feature(enable = "popcnt")]
unsafe fn best_key_popcnt(keys: &[u64], code: u64, mask: u64) -> usize {
    super::portable::best_key_scalar(keys, code, mask)
}

#[target_feature(enable = "avx512f,avx512vpopcntdq")]
unsafe fn best_key_avx512(keys: &[u64], code: u64, mask: u64) -> usize {
    let c = _mm512_set1_epi64(code as i64);
    let m = _mm512_set1_epi64(mask as i64);
    let mut best = 0usize;
    let mut best_sim = -1i64;
    for (ci, chunk) in keys.chunks(8).enumerate() {
        let lanes: __mmask8 = if chunk.len() == 8 {
            0xff
        } else {
            (1u8 << chunk.len()) - 1
        };
        // Lanes past the end load nothing and are left out of the max below.
        let k = _mm512_maskz_loadu_epi64(lanes, chunk.as_ptr().cast());
        let sim = _mm512_popcnt_epi64(_mm512_andnot_si512(_mm512_xor_si512(c, k), m));
        let max = _mm512_mask_reduce_max_epi64(lanes, sim);
        // Strictly greater: an earlier chunk keeps a tie, as in the scalar loop.
        if max > best_sim {
            let at = _mm512_mask_cmpeq_epi64_mask(lanes, sim, _mm512_set1_epi64(max));
            best = ci * 8 + at.trailing_zeros() as usize;
            best_sim = max;
        }
    }
    best
}
