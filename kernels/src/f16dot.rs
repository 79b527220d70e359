//! f16 dot products for attention (q·k and probabilities·v), accumulated in
//! the orders llama.cpp's CPU backend uses on AVX-512 machines, so our
//! attention agrees with it to the last bit and greedy continuations do not
//! drift apart on near-ties. llama.cpp takes two routes:
//! - batches of two or more queries go through its tinyBLAS GEMM, which keeps
//!   16 lanes, lane `i % 16` accumulating element `i` with a fused
//!   multiply-add, then reduces the lanes in a fixed tree (`dot_f16_gemm`);
//! - a single query goes through `ggml_vec_dot_f16`, which keeps four such
//!   16-lane accumulators over steps of 64, folds them pairwise, reduces, and
//!   adds a tail past the last full step in f64 (`dot_f16_vec`).

use half::f16;

/// The 16-lane reduction tree of `_mm512_reduce_add_ps`.
#[inline(always)]
pub fn reduce16(l: &[f32; 16]) -> f32 {
    let mut t8 = [0.0f32; 8];
    for i in 0..8 {
        t8[i] = l[i] + l[i + 8];
    }
    let t4 = [t8[0] + t8[4], t8[1] + t8[5], t8[2] + t8[6], t8[3] + t8[7]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// Portable twin: same lanes, same fused multiply-adds, same reduction.
pub fn dot_f16_gemm_scalar(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let mut lanes = [0.0f32; 16];
    for i in 0..n {
        lanes[i % 16] = x[i].to_f32().mul_add(y[i].to_f32(), lanes[i % 16]);
    }
    reduce16(&lanes)
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_f16c() -> bool {
    use std::sync::OnceLock;
    static F16C: OnceLock<bool> = OnceLock::new();
    *F16C.get_or_init(|| crate::dot::has_avx2() && std::arch::is_x86_feature_detected!("f16c"))
}

/// Dot product in tinyBLAS order (the shorter length wins).
pub fn dot_f16_gemm(x: &[f16], y: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features the function is compiled for were detected.
        return unsafe { avx2::dot_f16_gemm(x, y) };
    }
    dot_f16_gemm_scalar(x, y)
}

/// Four dot products of `x` with `ys[0..4]`, each in tinyBLAS order: the
/// same bits as four `dot_f16_gemm` calls, with `x` converted once.
pub fn dot_f16_gemm_x4(x: &[f16], ys: [&[f16]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if crate::dot::has_avx512f() {
        // SAFETY: avx512f was detected at run time.
        let [dots] = unsafe { avx512::dot_f16_gemm_tile::<1>([x], ys) };
        return dots;
    }
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features the function is compiled for were detected.
        return unsafe { avx2::dot_f16_gemm_x4(x, ys) };
    }
    ys.map(|y| dot_f16_gemm_scalar(x, y))
}

/// Most rows of `xs` one [`dot_f16_gemm_rows`] tile takes at once.
pub const GEMM_TILE_ROWS: usize = 4;

/// `out[m][k] = dot_f16_gemm(xs[m], ys[k])` for up to [`GEMM_TILE_ROWS`]
/// rows `xs` against four `ys`: the same bits as separate calls, with every
/// row and every `ys[k]` converted once per step (the 4x4 register tile of
/// tinyBLAS's f16 GEMM, where llama.cpp's `-fa off` attention runs its
/// scores and outputs). All rows are as long as the shortest of them and
/// of `ys`; rows of `out` past `xs.len()` are left alone.
pub fn dot_f16_gemm_rows(xs: &[&[f16]], ys: [&[f16]; 4], out: &mut [[f32; 4]]) {
    #[cfg(target_arch = "x86_64")]
    if crate::dot::has_avx512f() {
        macro_rules! tile {
            ($M:literal) => {{
                let x: [&[f16]; $M] = std::array::from_fn(|m| xs[m]);
                // SAFETY: avx512f was detected at run time.
                let d = unsafe { avx512::dot_f16_gemm_tile::<$M>(x, ys) };
                out[..$M].copy_from_slice(&d);
                return;
            }};
        }
        match xs.len().min(out.len()) {
            1 => tile!(1),
            2 => tile!(2),
            3 => tile!(3),
            4 => tile!(4),
            _ => {}
        }
    }
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        *o = dot_f16_gemm_x4(x, ys);
    }
}

/// Folds four 16-lane accumulators as `GGML_F32x16_REDUCE` does.
#[inline(always)]
fn fold4(acc: &[[f32; 16]; 4]) -> f32 {
    let mut x0 = acc[0];
    let mut x1 = acc[1];
    for l in 0..16 {
        x0[l] += acc[2][l];
        x1[l] += acc[3][l];
    }
    for l in 0..16 {
        x0[l] += x1[l];
    }
    reduce16(&x0)
}

/// Portable twin of `dot_f16_vec`.
pub fn dot_f16_vec_scalar(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let full = n / 64 * 64;
    let mut acc = [[0.0f32; 16]; 4];
    for i in 0..full {
        let (j, l) = ((i % 64) / 16, i % 16);
        acc[j][l] = x[i].to_f32().mul_add(y[i].to_f32(), acc[j][l]);
    }
    let mut sum = fold4(&acc) as f64;
    for i in full..n {
        sum += (x[i].to_f32() * y[i].to_f32()) as f64;
    }
    sum as f32
}

/// Dot product in `ggml_vec_dot_f16` order (the shorter length wins).
pub fn dot_f16_vec(x: &[f16], y: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features the function is compiled for were detected.
        return unsafe { avx2::dot_f16_vec(x, y) };
    }
    dot_f16_vec_scalar(x, y)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use half::f16;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn load8(p: *const f16, i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(i) as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_vec(x: &[f16], y: &[f16]) -> f32 {
        let n = x.len().min(y.len());
        let full = n / 64 * 64;
        // Eight 8-lane registers are the four 16-lane accumulators, low half first.
        let mut acc = [_mm256_setzero_ps(); 8];
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let mut i = 0;
        while i < full {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 64 <= n.
                *a = _mm256_fmadd_ps(load8(xp, i + 8 * k), load8(yp, i + 8 * k), *a);
            }
            i += 64;
        }
        let mut lanes = [[0.0f32; 16]; 4];
        for (k, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(lanes[k / 2].as_mut_ptr().add(8 * (k % 2)), *a);
        }
        let mut sum = super::fold4(&lanes) as f64;
        for j in full..n {
            sum += (x[j].to_f32() * y[j].to_f32()) as f64;
        }
        sum as f32
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_gemm_x4(x: &[f16], ys: [&[f16]; 4]) -> [f32; 4] {
        let n = ys.iter().fold(x.len(), |n, y| n.min(y.len()));
        let full = n / 16 * 16;
        let mut lo = [_mm256_setzero_ps(); 4];
        let mut hi = [_mm256_setzero_ps(); 4];
        let xp = x.as_ptr();
        let yp = ys.map(|y| y.as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n for x and every y.
            let (x0, x1) = (load8(xp, i), load8(xp, i + 8));
            for k in 0..4 {
                lo[k] = _mm256_fmadd_ps(x0, load8(yp[k], i), lo[k]);
                hi[k] = _mm256_fmadd_ps(x1, load8(yp[k], i + 8), hi[k]);
            }
            i += 16;
        }
        let mut out = [0.0f32; 4];
        for k in 0..4 {
            let mut lanes = [0.0f32; 16];
            _mm256_storeu_ps(lanes.as_mut_ptr(), lo[k]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi[k]);
            for j in full..n {
                lanes[j % 16] = x[j].to_f32().mul_add(ys[k][j].to_f32(), lanes[j % 16]);
            }
            out[k] = super::reduce16(&lanes);
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16_gemm(x: &[f16], y: &[f16]) -> f32 {
        let n = x.len().min(y.len());
        let full = n / 16 * 16;
        // lo holds lanes 0..8, hi lanes 8..16 of the 16-lane accumulator.
        let mut lo = _mm256_setzero_ps();
        let mut hi = _mm256_setzero_ps();
        let (xp, yp) = (x.as_ptr() as *const __m128i, y.as_ptr() as *const __m128i);
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n, so both 8-element loads are in bounds.
            let (x0, y0) = (
                _mm256_cvtph_ps(_mm_loadu_si128(xp.add(i / 8))),
                _mm256_cvtph_ps(_mm_loadu_si128(yp.add(i / 8))),
            );
            let (x1, y1) = (
                _mm256_cvtph_ps(_mm_loadu_si128(xp.add(i / 8 + 1))),
                _mm256_cvtph_ps(_mm_loadu_si128(yp.add(i / 8 + 1))),
            );
            lo = _mm256_fmadd_ps(x0, y0, lo);
            hi = _mm256_fmadd_ps(x1, y1, hi);
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        for j in full..n {
            lanes[j % 16] = x[j].to_f32().mul_add(y[j].to_f32(), lanes[j % 16]);
        }
        super::reduce16(&lanes)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use half::f16;
    use std::arch::x86_64::*;

    /// `M` rows against four keys, one 16-lane register per pair (tinyBLAS's
    /// lanes, one instruction each).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f16_gemm_tile<const M: usize>(xs: [&[f16]; M], ys: [&[f16]; 4]) -> [[f32; 4]; M] {
        let n = ys.iter().chain(&xs).fold(usize::MAX, |n, v| n.min(v.len()));
        let full = n / 16 * 16;
        let mut acc = [[_mm512_setzero_ps(); 4]; M];
        let xp = xs.map(|x| x.as_ptr() as *const __m256i);
        let yp = ys.map(|y| y.as_ptr() as *const __m256i);
        for i in (0..full).step_by(16) {
            // SAFETY: i + 16 <= n for every row.
            let yv = yp.map(|y| _mm512_cvtph_ps(_mm256_loadu_si256(y.add(i / 16))));
            for (row, x) in acc.iter_mut().zip(&xp) {
                let xv = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(i / 16)));
                for (a, y) in row.iter_mut().zip(&yv) {
                    *a = _mm512_fmadd_ps(xv, *y, *a);
                }
            }
        }
        let mut out = [[0.0f32; 4]; M];
        for m in 0..M {
            for k in 0..4 {
                let mut lanes = [0.0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), acc[m][k]);
                for j in full..n {
                    lanes[j % 16] = xs[m][j].to_f32().mul_add(ys[k][j].to_f32(), lanes[j % 16]);
                }
                out[m][k] = super::reduce16(&lanes);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_scalar_agree_exactly() {
        for n in [1usize, 15, 16, 17, 63, 64, 65, 100, 256, 1000] {
            let x: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(((i * 7919) % 97) as f32 / 13.0 - 3.0))
                .collect();
            let y: Vec<f16> = (0..n)
                .map(|i| f16::from_f32(((i * 104729) % 89) as f32 / 29.0 - 1.5))
                .collect();
            let exact: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            let four = dot_f16_gemm_x4(&x, [&y, &x, &y, &y]);
            let mut tile = [[f32::NAN; 4]; GEMM_TILE_ROWS];
            let z: Vec<f16> = x.iter().rev().copied().collect();
            let rows: [&[f16]; GEMM_TILE_ROWS] = [&x, &y, &z, &y];
            for m in 1..=GEMM_TILE_ROWS {
                dot_f16_gemm_rows(&rows[..m], [&y, &x, &y, &x], &mut tile);
                for (r, row) in rows[..m].iter().enumerate() {
                    for (k, other) in [&y, &x, &y, &x].iter().enumerate() {
                        let single = dot_f16_gemm_scalar(row, other);
                        assert_eq!(tile[r][k].to_bits(), single.to_bits(), "n={n}, {m} rows, ({r}, {k})");
                    }
                }
            }
            assert_eq!(four[0].to_bits(), dot_f16_gemm_scalar(&x, &y).to_bits(), "n={n}");
            assert_eq!(four[1].to_bits(), dot_f16_gemm_scalar(&x, &x).to_bits(), "n={n}");
            for (fast, slow) in [
                (dot_f16_gemm(&x, &y), dot_f16_gemm_scalar(&x, &y)),
                (dot_f16_vec(&x, &y), dot_f16_vec_scalar(&x, &y)),
            ] {
                assert_eq!(fast.to_bits(), slow.to_bits(), "n={n}");
                assert!(
                    (fast as f64 - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                    "n={n}: {fast} vs {exact}"
                );
            }
        }
    }
}
