//! aarch64 kernels of the SIMD path: NEON (baseline on aarch64), plus `sdot`
//! where the CPU has FEAT_DotProd (detected at run time). They vectorise only
//! integer work (block dots, i16 sums), exactly, so results equal the scalar
//! path bit for bit. The popcounts of `best_key` stay in the scalar loop:
//! on aarch64 `count_ones` already compiles to NEON's `cnt`.

use std::arch::aarch64::*;
use std::sync::OnceLock;

use super::{QuantMatrix, BLOCK};

/// Whether `sdot` (FEAT_DotProd) is available, detected once.
fn has_dotprod() -> bool {
    static DOTPROD: OnceLock<bool> = OnceLock::new();
    *DOTPROD.get_or_init(|| std::arch::is_aarch64_feature_detected!("dotprod"))
}

/// The projection of `infer::project`: exact i32 row dots, four rows per
/// pass over `xq` so each input block is loaded once per four rows.
///
/// # Safety
/// `m.cols == xq.len()`, a multiple of 32; `m.q.len() >= y.len() · m.cols`,
/// `m.scales.len() >= y.len()`.
pub(super) unsafe fn project(m: &QuantMatrix, xq: &[i8], y: &mut [f32]) {
    debug_assert!(m.cols == xq.len() && xq.len().is_multiple_of(BLOCK) && m.q.len() >= y.len() * m.cols);
    if has_dotprod() {
        project_with::<true>(m, xq, y)
    } else {
        project_with::<false>(m, xq, y)
    }
}

/// `acc += Σ w·x` over 16 bytes: products in i16 pairs (no overflow:
/// |w| <= 128, |x| <= 127, 2 · 128 · 127 < 2¹⁵), pairs into i32 lanes.
#[inline(always)]
unsafe fn dot16(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let p = vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), w, x);
    vpadalq_s16(acc, p)
}

/// The same sum by `sdot`, four bytes per lane.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot16(mut acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    std::arch::asm!(
        "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
        acc = inout(vreg) acc,
        w = in(vreg) w,
        x = in(vreg) x,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

#[inline(always)]
unsafe fn project_with<const SDOT: bool>(m: &QuantMatrix, xq: &[i8], y: &mut [f32]) {
    let nb = xq.len() / BLOCK;
    let mut j = 0;
    while j < y.len() {
        let rows = (y.len() - j).min(4);
        let mut acc = [vdupq_n_s32(0); 4];
        for b in 0..nb {
            // SAFETY: b < nb blocks of 32 bytes in xq and in each row.
            let x0 = vld1q_s8(xq.as_ptr().add(b * BLOCK));
            let x1 = vld1q_s8(xq.as_ptr().add(b * BLOCK + 16));
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                let w = m.q.as_ptr().add((j + r) * m.cols + b * BLOCK);
                let (w0, w1) = (vld1q_s8(w), vld1q_s8(w.add(16)));
                *a = if SDOT {
                    sdot16(sdot16(*a, w0, x0), w1, x1)
                } else {
                    dot16(dot16(*a, w0, x0), w1, x1)
                };
            }
        }
        for (r, a) in acc.iter().enumerate().take(rows) {
            y[j + r] = super::portable::projected(m.scales[j + r], vaddvq_s32(*a));
        }
        j += rows;
    }
}

/// `acc[i] += row[i]` in i16 (wrapping, as the scalar loop), 16 lanes at a time.
///
/// # Safety
/// None beyond NEON, which aarch64 always has; the kernel bounds itself by both lengths.
pub(super) unsafe fn add_row(acc: &mut [i16], row: &[i8]) {
    let n = acc.len().min(row.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n for both slices.
        let r = vld1q_s8(row.as_ptr().add(i));
        let p = acc.as_mut_ptr().add(i);
        vst1q_s16(p, vaddw_s8(vld1q_s16(p), vget_low_s8(r)));
        vst1q_s16(p.add(8), vaddw_high_s8(vld1q_s16(p.add(8)), r));
        i += 16;
    }
    for (a, &r) in acc[i..n].iter_mut().zip(&row[i..n]) {
        *a = a.wrapping_add(r as i16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both dot forms and the i16 adds equal plain integer loops, at the
    /// extremes of the byte ranges too.
    #[test]
    fn kernels_equal_plain_loops() {
        let mut s = 12345u32;
        let mut byte = || {
            s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (s >> 16) as i8
        };
        let (rows, cols) = (7, 96);
        let mut q: Vec<i8> = (0..rows * cols).map(|_| byte()).collect();
        let mut xq: Vec<i8> = (0..cols).map(|_| byte().max(-127)).collect();
        q[..32].fill(-128);
        xq[..32].fill(-127);
        let m = QuantMatrix {
            rows,
            cols,
            q: q.clone(),
            scales: (0..rows).map(|r| 0.5 + r as f32).collect(),
        };
        let want: Vec<f32> = (0..rows)
            .map(|r| {
                let dot: i32 = q[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&xq)
                    .map(|(&w, &x)| w as i32 * x as i32)
                    .sum();
                super::super::portable::projected(m.scales[r], dot)
            })
            .collect();
        let mut plain = vec![0.0f32; rows];
        let mut sdot = vec![0.0f32; rows];
        // SAFETY: shapes as documented; `sdot` only where detected.
        unsafe {
            project_with::<false>(&m, &xq, &mut plain);
            if has_dotprod() {
                project_with::<true>(&m, &xq, &mut sdot);
                assert_eq!(sdot, want);
            }
        }
        assert_eq!(plain, want);
        let row: Vec<i8> = (0..37).map(|_| byte()).collect();
        let mut acc: Vec<i16> = (0..37).map(|i| i16::MAX - 60 + i as i16).collect();
        let mut want_acc = acc.clone();
        for (a, &r) in want_acc.iter_mut().zip(&row) {
            *a = a.wrapping_add(r as i16);
        }
        // SAFETY: NEON is baseline.
        unsafe { add_row(&mut acc, &row) };
        assert_eq!(acc, want_acc);
    }
}
