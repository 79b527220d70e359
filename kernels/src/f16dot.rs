//! f16 dot products for attention (q·k and probabilities·v), accumulated in
//! the orders llama.cpp's CPU backend uses, so our attention agrees with it to
//! the last bit and greedy continuations do not drift apart on near-ties.
//!
//! On x86_64 (AVX-512 without AVX512-FP16) llama.cpp takes two routes:
//! - batches of two or more queries go through its tinyBLAS GEMM, which keeps
//!   16 lanes, lane `i % 16` accumulating element `i` with a fused
//!   multiply-add, then reduces the lanes in a fixed tree (`dot_f16_gemm`);
//! - a single query goes through `ggml_vec_dot_f16`, which keeps four such
//!   16-lane accumulators over steps of 64, folds them pairwise, reduces, and
//!   adds a tail past the last full step in f64 (`dot_f16_vec`).
//!
//! On aarch64 the reference is llama.cpp built by GCC for ARMv8 without the
//! FP16 vector arithmetic extension (`-march=armv8-a` or
//! `armv8.2-a+dotprod`), where ggml's f16 vectors are f32 lanes
//! (`GGML_F32Cx4`) and the orders differ:
//! - `ggml_vec_dot_f16` keeps four 4-lane accumulators over steps of 16
//!   (`GGML_F16_STEP` 16, `GGML_F16_EPR` 4), folds them as
//!   `GGML_F32x4_REDUCE` does (`a0 + a2`, `a1 + a3`, then their sum), reduces
//!   the four lanes with `vaddvq_f32` (`(l0 + l1) + (l2 + l3)`) and adds the
//!   tail past the last full step in f64. `dot_f16_vec` follows that order on
//!   aarch64 ([`dot_f16_vec_neon_order`]) and the AVX-512 one elsewhere
//!   ([`dot_f16_vec_x86_order`]).
//! - tinyBLAS has no f16 × f16 kernel without FP16 arithmetic: its NEON f16
//!   kernel is `tinyBLAS<4, float32x4_t, .., ggml_fp16_t, float>`, f16 rows of
//!   A against f32 columns of B, one 4-lane accumulator per output (lane
//!   `i % 4`, `vfmaq_f32`) reduced by `vaddvq_f32` ([`dot_f16_f32_gemm`]). In
//!   `-fa off` attention this means: q·k always goes through
//!   `ggml_vec_dot_f16` with q rounded to f16 (q is a permuted view, so it is
//!   converted to f16 first, and tinyBLAS then refuses an f16 B); the value
//!   product of a batch goes through tinyBLAS with the probabilities left in
//!   f32 (the softmax output is contiguous f32, which tinyBLAS takes as is),
//!   and that of a single query through `ggml_vec_dot_f16` with the
//!   probabilities rounded to f16 (tinyBLAS is only used for two or more
//!   columns).
//!
//! [`dot_f16_gemm`] keeps the x86 tinyBLAS order on every machine (its NEON
//! code is a faster way to the same bits), so a caller that wants aarch64
//! llama.cpp's bits uses [`dot_f16_vec`] and [`dot_f16_f32_gemm`] as above.

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

/// Four lanes reduced as `vaddvq_f32` does (`faddp`, then `faddp` again):
/// `(l0 + l1) + (l2 + l3)`.
#[inline(always)]
pub fn reduce4(l: &[f32; 4]) -> f32 {
    (l[0] + l[1]) + (l[2] + l[3])
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
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::dot_f16_gemm(x, y) }
    }
    #[cfg(not(target_arch = "aarch64"))]
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
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::dot_f16_gemm_x4(x, ys) }
    }
    #[cfg(not(target_arch = "aarch64"))]
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

/// `ggml_vec_dot_f16` as built for AVX-512, portably: four 16-lane
/// accumulators over steps of 64, folded by `GGML_F32x16_REDUCE`, the tail
/// past the last full step added in f64.
pub fn dot_f16_vec_x86_order(x: &[f16], y: &[f16]) -> f32 {
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

/// `ggml_vec_dot_f16` as built for NEON without FP16 arithmetic, portably:
/// four 4-lane accumulators over steps of 16 (`GGML_F16_STEP`), accumulator
/// `a[(i % 16) / 4]` lane `i % 4` taking element `i` by a fused multiply-add
/// (`vfmaq_f32`); folded as `GGML_F32x4_REDUCE` does (`a0 + a2`, `a1 + a3`,
/// then their sum), the lanes reduced by `vaddvq_f32`, the tail past the last
/// full step added in f64.
pub fn dot_f16_vec_neon_order(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let full = n / 16 * 16;
    let mut acc = [[0.0f32; 4]; 4];
    for i in 0..full {
        let (j, l) = ((i % 16) / 4, i % 4);
        acc[j][l] = x[i].to_f32().mul_add(y[i].to_f32(), acc[j][l]);
    }
    let mut folded = [0.0f32; 4];
    for (l, f) in folded.iter_mut().enumerate() {
        *f = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce4(&folded) as f64;
    for i in full..n {
        sum += (x[i].to_f32() * y[i].to_f32()) as f64;
    }
    sum as f32
}

/// Portable twin of `dot_f16_vec` on this machine: the NEON order on
/// aarch64, the AVX-512 order elsewhere.
pub fn dot_f16_vec_scalar(x: &[f16], y: &[f16]) -> f32 {
    #[cfg(target_arch = "aarch64")]
    {
        dot_f16_vec_neon_order(x, y)
    }
    #[cfg(not(target_arch = "aarch64"))]
    dot_f16_vec_x86_order(x, y)
}

/// Dot product in `ggml_vec_dot_f16` order of this machine's llama.cpp build
/// (see the module docs; the shorter length wins).
pub fn dot_f16_vec(x: &[f16], y: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features the function is compiled for were detected.
        return unsafe { avx2::dot_f16_vec(x, y) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::dot_f16_vec(x, y) }
    }
    #[cfg(not(target_arch = "aarch64"))]
    dot_f16_vec_scalar(x, y)
}

/// Portable twin of [`dot_f16_f32_gemm`]: lane `i % 4` takes `x[i] * y[i]`
/// by a fused multiply-add, the lanes reduced as `vaddvq_f32` does.
pub fn dot_f16_f32_gemm_scalar(x: &[f16], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let mut lanes = [0.0f32; 4];
    for i in 0..n {
        lanes[i % 4] = x[i].to_f32().mul_add(y[i], lanes[i % 4]);
    }
    reduce4(&lanes)
}

/// An f16 row against an f32 column in the order of aarch64 llama.cpp's
/// tinyBLAS (`tinyBLAS<4, float32x4_t, float32x4_t, ggml_fp16_t, float>`,
/// the kernel an f16 × f32 product of two or more columns takes there, e.g.
/// values × probabilities in `-fa off` attention). tinyBLAS needs the length
/// to be a multiple of 4; past the last multiple the elements go on into
/// lanes `i % 4` (the shorter length wins).
pub fn dot_f16_f32_gemm(x: &[f16], y: &[f32]) -> f32 {
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::dot_f16_f32_gemm(x, y) }
    }
    #[cfg(not(target_arch = "aarch64"))]
    dot_f16_f32_gemm_scalar(x, y)
}

/// Four [`dot_f16_f32_gemm`]s of the f16 rows `xs` against one f32 column
/// `y`, `y` loaded once per step: the same bits as four calls.
pub fn dot_f16_f32_gemm_x4(xs: [&[f16]; 4], y: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { neon::dot_f16_f32_gemm_x4(xs, y) }
    }
    #[cfg(not(target_arch = "aarch64"))]
    xs.map(|x| dot_f16_f32_gemm_scalar(x, y))
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

/// NEON kernels. NEON and its fused multiply-add are baseline on aarch64, so
/// nothing here needs run-time detection; f16 is converted with `fcvtl` /
/// `fcvtn` (baseline ARMv8; the `float16x4_t` intrinsics are unstable in
/// Rust), which round to nearest even as `half` does. No FP16 arithmetic is
/// used: the llama.cpp build these kernels follow has none.
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use core::arch::aarch64::*;
    use core::arch::asm;
    use half::f16;

    /// Four f16 at `p` widened to f32.
    #[inline(always)]
    pub unsafe fn load4(p: *const f16) -> float32x4_t {
        let h = vld1_u16(p as *const u16);
        let d: float32x4_t;
        asm!("fcvtl {d:v}.4s, {s:v}.4h", d = lateout(vreg) d, s = in(vreg) h, options(pure, nomem, nostack, preserves_flags));
        d
    }

    /// Eight f16 at `p` widened to f32, low four first.
    #[inline(always)]
    pub unsafe fn load8(p: *const f16) -> (float32x4_t, float32x4_t) {
        let h = vld1q_u16(p as *const u16);
        let (lo, hi): (float32x4_t, float32x4_t);
        asm!(
            "fcvtl {lo:v}.4s, {s:v}.4h",
            "fcvtl2 {hi:v}.4s, {s:v}.8h",
            lo = out(vreg) lo,
            hi = lateout(vreg) hi,
            s = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        (lo, hi)
    }

    /// `v` rounded to f16 (nearest even) and stored at `p`.
    #[inline(always)]
    pub unsafe fn store4(p: *mut f16, v: float32x4_t) {
        let h: uint16x4_t;
        asm!("fcvtn {d:v}.4h, {s:v}.4s", d = lateout(vreg) h, s = in(vreg) v, options(pure, nomem, nostack, preserves_flags));
        vst1_u16(p as *mut u16, h);
    }

    /// `lo` and `hi` rounded to f16 (nearest even) and stored at `p`, `lo` first.
    #[inline(always)]
    pub unsafe fn store8(p: *mut f16, lo: float32x4_t, hi: float32x4_t) {
        let h: uint16x8_t;
        asm!(
            "fcvtn {d:v}.4h, {lo:v}.4s",
            "fcvtn2 {d:v}.8h, {hi:v}.4s",
            d = out(vreg) h,
            lo = in(vreg) lo,
            hi = in(vreg) hi,
            options(pure, nomem, nostack, preserves_flags)
        );
        vst1q_u16(p as *mut u16, h);
    }

    #[inline(always)]
    unsafe fn lanes(v: float32x4_t) -> [f32; 4] {
        let mut l = [0.0f32; 4];
        vst1q_f32(l.as_mut_ptr(), v);
        l
    }

    /// `ggml_vec_dot_f16` of the NEON build (`dot_f16_vec_neon_order`).
    pub unsafe fn dot_f16_vec(x: &[f16], y: &[f16]) -> f32 {
        let n = x.len().min(y.len());
        let full = n / 16 * 16;
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i < full {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 16 <= n for both slices.
                *a = vfmaq_f32(*a, load4(xp.add(i + 4 * j)), load4(yp.add(i + 4 * j)));
            }
            i += 16;
        }
        let folded = vaddq_f32(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]));
        let mut sum = vaddvq_f32(folded) as f64;
        for j in full..n {
            sum += (x[j].to_f32() * y[j].to_f32()) as f64;
        }
        sum as f32
    }

    /// The 16-lane tinyBLAS order of `dot_f16_gemm_scalar`, four registers per accumulator.
    pub unsafe fn dot_f16_gemm(x: &[f16], y: &[f16]) -> f32 {
        let [d] = dot_f16_gemm_n(x, [y]);
        d
    }

    pub unsafe fn dot_f16_gemm_x4(x: &[f16], ys: [&[f16]; 4]) -> [f32; 4] {
        dot_f16_gemm_n(x, ys)
    }

    #[inline(always)]
    unsafe fn dot_f16_gemm_n<const K: usize>(x: &[f16], ys: [&[f16]; K]) -> [f32; K] {
        let n = ys.iter().fold(x.len(), |n, y| n.min(y.len()));
        let full = n / 16 * 16;
        let mut acc = [[vdupq_n_f32(0.0); 4]; K];
        let xp = x.as_ptr();
        let yp = ys.map(|y| y.as_ptr());
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n for x and every y.
            let (x0, x1) = load8(xp.add(i));
            let (x2, x3) = load8(xp.add(i + 8));
            let xv = [x0, x1, x2, x3];
            for (a, y) in acc.iter_mut().zip(&yp) {
                let (y0, y1) = load8(y.add(i));
                let (y2, y3) = load8(y.add(i + 8));
                for (aj, (xj, yj)) in a.iter_mut().zip(xv.iter().zip([y0, y1, y2, y3])) {
                    *aj = vfmaq_f32(*aj, *xj, yj);
                }
            }
            i += 16;
        }
        let mut out = [0.0f32; K];
        for k in 0..K {
            let mut l = [0.0f32; 16];
            for j in 0..4 {
                l[4 * j..4 * j + 4].copy_from_slice(&lanes(acc[k][j]));
            }
            for j in full..n {
                l[j % 16] = x[j].to_f32().mul_add(ys[k][j].to_f32(), l[j % 16]);
            }
            out[k] = super::reduce16(&l);
        }
        out
    }

    /// aarch64 tinyBLAS's f16 × f32 order (`dot_f16_f32_gemm_scalar`).
    pub unsafe fn dot_f16_f32_gemm(x: &[f16], y: &[f32]) -> f32 {
        let [d] = dot_f16_f32_gemm_n([x], y);
        d
    }

    pub unsafe fn dot_f16_f32_gemm_x4(xs: [&[f16]; 4], y: &[f32]) -> [f32; 4] {
        dot_f16_f32_gemm_n(xs, y)
    }

    #[inline(always)]
    unsafe fn dot_f16_f32_gemm_n<const K: usize>(xs: [&[f16]; K], y: &[f32]) -> [f32; K] {
        let n = xs.iter().fold(y.len(), |n, x| n.min(x.len()));
        let full = n / 4 * 4;
        let mut acc = [vdupq_n_f32(0.0); K];
        let xp = xs.map(|x| x.as_ptr());
        let yp = y.as_ptr();
        let mut i = 0;
        while i < full {
            // SAFETY: i + 4 <= n for y and every x.
            let yv = vld1q_f32(yp.add(i));
            for (a, x) in acc.iter_mut().zip(&xp) {
                *a = vfmaq_f32(*a, yv, load4(x.add(i)));
            }
            i += 4;
        }
        let mut out = [0.0f32; K];
        for k in 0..K {
            if full == n {
                out[k] = vaddvq_f32(acc[k]);
                continue;
            }
            let mut l = lanes(acc[k]);
            for j in full..n {
                l[j % 4] = xs[k][j].to_f32().mul_add(y[j], l[j % 4]);
            }
            out[k] = super::reduce4(&l);
        }
        out
    }
}

/// Inputs and hashes shared by the tests that compare this crate's aarch64
/// kernels with ggml's CPU backend built for aarch64 (GCC 12,
/// `-march=armv8-a`, `-O3`, run under qemu-user): a program linked against
/// that build (scripts/golden/golden_neon_ops.c) feeds the same xorshift32
/// inputs to ggml and prints an FNV-1a hash of each output, which the tests
/// hold as constants.
#[cfg(test)]
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
pub(crate) mod golden {
    /// xorshift32 values of wide dynamic range, as the reference program
    /// makes them (so a changed order of additions shows in the bits).
    pub fn wide(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                let m = (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
                m * [0.01f32, 1.0, 30.0, 500.0][(s & 3) as usize]
            })
            .collect()
    }

    /// FNV-1a (64-bit) of `bytes`.
    pub fn fnv(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }

    pub fn fnv_f32(v: &[f32]) -> u64 {
        fnv(bytemuck::cast_slice(v))
    }
}

#[cfg(test)]
mod tests {
    use super::golden::wide;
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

    fn halves(v: &[f32]) -> Vec<f16> {
        v.iter().map(|&x| f16::from_f32(x)).collect()
    }

    #[test]
    fn f16_f32_gemm_agrees_with_its_twin() {
        for n in [0usize, 1, 3, 4, 5, 15, 16, 17, 64, 100, 256, 1027] {
            let xs: Vec<Vec<f16>> = (0..4).map(|k| halves(&wide(n, 11 + k))).collect();
            let y = wide(n, 77);
            let four = dot_f16_f32_gemm_x4([&xs[0], &xs[1], &xs[2], &xs[3]], &y);
            let exact: f64 = xs[0].iter().zip(&y).map(|(a, &b)| a.to_f64() * b as f64).sum();
            let norm: f64 = xs[0].iter().zip(&y).map(|(a, &b)| (a.to_f64() * b as f64).abs()).sum();
            for k in 0..4 {
                let slow = dot_f16_f32_gemm_scalar(&xs[k], &y);
                assert_eq!(four[k].to_bits(), slow.to_bits(), "n={n} k={k}");
                assert_eq!(dot_f16_f32_gemm(&xs[k], &y).to_bits(), slow.to_bits(), "n={n} k={k}");
            }
            assert!((four[0] as f64 - exact).abs() <= 1e-5 * norm.max(1.0), "n={n}");
        }
    }

    #[test]
    fn both_vec_orders_are_accurate_and_the_orders_differ() {
        let mut differ = 0;
        for n in [16usize, 17, 64, 80, 130, 1000, 4096] {
            let (x, y) = (halves(&wide(n, 3)), halves(&wide(n, 5)));
            let exact: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            let norm: f64 = x.iter().zip(&y).map(|(a, b)| (a.to_f64() * b.to_f64()).abs()).sum();
            let (arm, avx) = (dot_f16_vec_neon_order(&x, &y), dot_f16_vec_x86_order(&x, &y));
            for v in [arm, avx] {
                assert!(
                    (v as f64 - exact).abs() <= 1e-5 * norm.max(1.0),
                    "n={n}: {v} vs {exact}"
                );
            }
            differ += (arm.to_bits() != avx.to_bits()) as usize;
            assert_eq!(
                dot_f16_vec(&x, &y).to_bits(),
                dot_f16_vec_scalar(&x, &y).to_bits(),
                "n={n}"
            );
        }
        // Otherwise a test comparing an order with the wrong twin could not fail.
        assert!(differ >= 3, "orders differed on only {differ} lengths");
    }

    #[test]
    fn reduce4_is_pairwise() {
        // (1e8 + 1) + (-1e8 + 1) rounds both inner sums; other trees give 2.
        assert_eq!(reduce4(&[1e8, 1.0, -1e8, 1.0]), 0.0);
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_kernels_equal_their_twins_bit_for_bit() {
        use core::arch::aarch64::*;
        // vaddvq_f32 reduces pairwise, as `reduce4`.
        let l = [1e8f32, 1.0, -1e8, 1.0];
        // SAFETY: NEON is baseline; `l` holds four floats.
        assert_eq!(unsafe { vaddvq_f32(vld1q_f32(l.as_ptr())) }, reduce4(&l));
        for n in [0usize, 1, 4, 15, 16, 17, 31, 63, 64, 65, 100, 256, 1000, 4099] {
            let (x, y) = (halves(&wide(n, 21)), halves(&wide(n, 23)));
            // SAFETY: NEON is baseline.
            let (v, g) = unsafe { (neon::dot_f16_vec(&x, &y), neon::dot_f16_gemm(&x, &y)) };
            assert_eq!(v.to_bits(), dot_f16_vec_neon_order(&x, &y).to_bits(), "vec n={n}");
            assert_eq!(g.to_bits(), dot_f16_gemm_scalar(&x, &y).to_bits(), "gemm n={n}");
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn f16_conversions_round_to_nearest_even_like_half() {
        // Every f16 widens exactly; f32s next to f16 ties and past the range round as `half` does.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).filter(|h| !h.is_nan()).collect();
        let mut wide32 = vec![0.0f32; all.len() / 8 * 8];
        for (i, w) in wide32.chunks_exact_mut(8).enumerate() {
            // SAFETY: 8 halves from i * 8 are in bounds; `w` holds 8 floats.
            unsafe {
                let (lo, hi) = neon::load8(all.as_ptr().add(8 * i));
                core::arch::aarch64::vst1q_f32(w.as_mut_ptr(), lo);
                core::arch::aarch64::vst1q_f32(w.as_mut_ptr().add(4), hi);
                assert_eq!(
                    core::arch::aarch64::vgetq_lane_f32::<0>(neon::load4(all.as_ptr().add(8 * i))),
                    w[0]
                );
            }
        }
        for (h, &w) in all.iter().zip(&wide32) {
            assert_eq!(h.to_f32().to_bits(), w.to_bits());
        }
        let mut bits = 0x3f80_0000u32.wrapping_sub(0x10_0000);
        let samples: Vec<f32> = (0..4096)
            .map(|i| {
                bits = bits.wrapping_mul(1_103_515_245).wrapping_add(12345);
                match i % 4 {
                    0 => f32::from_bits((bits & 0x8fff_e000) | 0x1000), // ties
                    1 => f32::from_bits(bits & 0xc7ff_ffff),
                    2 => f32::from_bits(bits & 0x87ff_ffff), // subnormal and tiny
                    _ => f32::from_bits(bits | 0x4700_0000), // up to overflow
                }
            })
            .collect();
        let mut out = vec![f16::ZERO; samples.len()];
        for (o, s) in out.chunks_exact_mut(8).zip(samples.chunks_exact(8)) {
            // SAFETY: eight halves and floats in each chunk.
            unsafe {
                let lo = core::arch::aarch64::vld1q_f32(s.as_ptr());
                let hi = core::arch::aarch64::vld1q_f32(s.as_ptr().add(4));
                neon::store8(o.as_mut_ptr(), lo, hi);
                neon::store4(o.as_mut_ptr(), lo);
            }
        }
        for (o, &s) in out.iter().zip(&samples) {
            assert_eq!(o.to_bits(), f16::from_f32(s).to_bits(), "{s:e}");
        }
    }

    /// `ggml_vec_dot_f16` and f16 × f32 `ggml_mul_mat`s (tinyBLAS for three
    /// contiguous columns, `ggml_vec_dot_f16` with the column rounded to f16
    /// for one, and for a permuted q as in `-fa off` attention) of ggml built
    /// for aarch64 (llamafile's sgemm on, as llama.cpp builds it).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn matches_ggml_built_for_aarch64() {
        use super::golden::{fnv_f32, wide};
        let want = [
            (16, 0x843d5f7cf10e75a9u64),
            (17, 0x058925868b2d5410),
            (64, 0x2a877e553b63bf12),
            (100, 0x83d12effc5e9b969),
            (128, 0x364d4b6032f87161),
            (1000, 0x5ae1f7b4099e2257),
            (4099, 0x9fc0f880baeb4c50),
        ];
        for (n, hash) in want {
            let (x, y) = (halves(&wide(n, 3)), halves(&wide(n, 5)));
            assert_eq!(fnv_f32(&[dot_f16_vec(&x, &y)]), hash, "vec_dot_f16 n={n}");
        }
        let (k, m) = (256, 8);
        let a = halves(&wide(k * m, 17));
        for (n, hash) in [(1usize, 0x4e1c5a57c7a22569u64), (3, 0x998abfdf69cd371c)] {
            let b = wide(k * n, 19);
            let mut c = vec![0.0f32; m * n];
            for j in 0..n {
                let col = &b[j * k..(j + 1) * k];
                for i in 0..m {
                    let row = &a[i * k..(i + 1) * k];
                    c[j * m + i] = if n == 1 {
                        dot_f16_vec(row, &halves(col))
                    } else {
                        dot_f16_f32_gemm(row, col)
                    };
                }
            }
            assert_eq!(fnv_f32(&c), hash, "mul_mat n={n}");
        }
        // q·k of several tokens as llama.cpp forms it (q a permuted view):
        // q is rounded to f16 and every dot is `ggml_vec_dot_f16`'s.
        let (k, m, heads, tokens) = (64, 8, 2, 3);
        let a = halves(&wide(k * m, 23));
        let q = wide(k * heads * tokens, 29);
        let mut c = vec![0.0f32; m * tokens * heads];
        for h in 0..heads {
            for t in 0..tokens {
                let q16 = halves(&q[(t * heads + h) * k..][..k]);
                for i in 0..m {
                    c[(h * tokens + t) * m + i] = dot_f16_vec(&a[i * k..(i + 1) * k], &q16);
                }
            }
        }
        assert_eq!(fnv_f32(&c), 0x976578284f4c5f5f, "mul_mat q·k");
    }
}
