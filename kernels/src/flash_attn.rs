//! llama.cpp's CPU flash attention (`ggml_flash_attn_ext` over f16 keys and
//! values at f32 precision, what `-fa on` and the default `-fa auto` run),
//! reproduced bit for bit on AVX-512 machines without AVX512-FP16 (there
//! ggml's f16 vectors are f32 lanes rounded back to f16 on every store).
//!
//! ggml takes one of three routes by shape, and [`route`] picks the same:
//! - [`Route::Vector`], fewer than [`Q_TILE`] queries: per query, q rounded
//!   to f16, f16 dot products, an online softmax with libm's `expf`, and the
//!   output accumulated in f16, each update rounded back to f16;
//! - [`Route::Split`], one query over [`SPLIT_FROM_CELLS`] or more cells: the
//!   cells cut into one chunk per thread, each chunk as the vector route
//!   without the final division, the chunks then merged in order;
//! - [`Route::Tiled`], [`Q_TILE`] or more queries: tiles of `Q_TILE` queries
//!   by [`KV_TILE`] cells in f32, products as fused multiply-adds in
//!   dimension order, ggml's own `exp` and softmax sums, values accumulated
//!   in f32.
//!
//! Tiles are counted from cell 0 and every query row is computed on its own,
//! so rows may be grouped into tiles in any way (ggml groups them by thread).
//!
//! On aarch64 the reference is llama.cpp built by GCC for ARMv8 without FP16
//! arithmetic (f16 vectors are f32 lanes there too). The routes and their
//! float operations are the same but for three functions, which follow the
//! NEON build there: the f16 dot product of the vector and split routes
//! ([`dot_f16_vec`], `ggml_vec_dot_f16`'s NEON order), and in the tiled route
//! ggml's `exp` and the softmax sums ([`exp_sum`], `ggml_vec_soft_max_f32`'s
//! NEON code: its own `ggml_v_expf`, four lanes per `vaddvq_f32` group). The
//! tile products (`simd_gemm`, a fused multiply-add chain per output in
//! dimension or cell order, `vfmaq_f32` on NEON; the column tail's scalar
//! `a += x * y` is contracted to the same fused operation by GCC) and the
//! elementwise f16 updates (`ggml_vec_scale_f16`, `ggml_vec_mad_f16`: f32
//! lanes rounded back to f16) give the same bits on both, and have NEON
//! kernels here that are checked against the portable loops.

use std::ops::Range;

use half::f16;

use crate::f16dot::dot_f16_vec;
use crate::ops::exp_sum;

/// Queries per tile of the tiled route (`GGML_FA_TILE_Q`); also the batch
/// size from which ggml takes that route.
pub const Q_TILE: usize = 64;
/// Cells per tile of the tiled route (`GGML_FA_TILE_KV`).
pub const KV_TILE: usize = 64;
/// A single query over at least this many cells has its cells split across threads.
pub const SPLIT_FROM_CELLS: usize = 512;

/// Which of ggml's routes a call takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Vector,
    /// The cells in `chunks` equal parts (ggml: one per thread).
    Split {
        chunks: usize,
    },
    Tiled,
}

/// ggml's choice for `queries` query rows per head over a cache view of
/// `cells` cells, computed by `threads` threads.
pub fn route(queries: usize, cells: usize, threads: usize) -> Route {
    if queries == 1 && cells >= SPLIT_FROM_CELLS {
        Route::Split { chunks: threads.max(1) }
    } else if queries >= Q_TILE {
        Route::Tiled
    } else {
        Route::Vector
    }
}

/// The cached keys and values of one kv head, a row of `head_dim` f16s per cell.
pub trait KvHead: Sync {
    fn key(&self, cell: usize) -> &[f16];
    fn value(&self, cell: usize) -> &[f16];
}

/// Where one query's online softmax stands: the running maximum score and
/// the running sum of `exp(score - max)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Partial {
    pub max: f32,
    pub sum: f32,
}

/// f32 scratch of one vector- or split-route query: q and the accumulator
/// in f16, then (split route) the chunk being merged.
pub fn vector_scratch_len(head_dim: usize) -> usize {
    2 * head_dim
}

/// f32 scratch of one tile of the tiled route.
pub fn tile_scratch_len(head_dim: usize) -> usize {
    // Keys transposed, values, scores.
    2 * KV_TILE * head_dim + Q_TILE * KV_TILE
}

/// One query `q` (f32) against the cells of `cells` it sees (those of
/// `visible` for which `sees` holds), by the vector route; `out` gets the
/// unnormalized sum (divide by the returned sum, or merge partials).
/// `scratch` holds at least `head_dim` f32s.
#[allow(clippy::too_many_arguments)]
pub fn vector_partial(
    kv: &impl KvHead,
    q: &[f32],
    visible: Range<usize>,
    sees: impl Fn(usize) -> bool,
    cells: Range<usize>,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) -> Partial {
    let hd = q.len();
    let (q16, acc) = bytemuck::cast_slice_mut::<f32, f16>(&mut scratch[..hd]).split_at_mut(hd);
    for (d, &s) in q16.iter_mut().zip(q) {
        *d = f16::from_f32(s);
    }
    acc.fill(f16::ZERO);
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0.0f32;
    for cell in visible.start.max(cells.start)..visible.end.min(cells.end) {
        if !sees(cell) {
            continue;
        }
        // The mask adds 0 to a visible score.
        let s = dot_f16_vec(kv.key(cell), q16) * scale + 0.0;
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if s > max {
            ms = (max - s).exp();
            max = s;
            scale_f16(acc, ms);
        } else {
            vs = (s - max).exp();
        }
        mad_f16(acc, kv.value(cell), vs);
        sum = sum.mul_add(ms, vs);
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = a.to_f32();
    }
    Partial { max, sum }
}

/// `out /= sum` (0 when nothing was visible), as ggml finishes a query.
pub fn normalize(out: &mut [f32], sum: f32) {
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for o in out {
        *o *= inv;
    }
}

/// One query by the vector route, normalized.
pub fn vector(
    kv: &impl KvHead,
    q: &[f32],
    visible: Range<usize>,
    sees: impl Fn(usize) -> bool,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let p = vector_partial(kv, q, visible.clone(), sees, visible, scale, scratch, out);
    normalize(out, p.sum);
}

/// One query by the split route: cells `0..cells` in `chunks` parts, each
/// a vector-route partial, merged in chunk order as each is made (ggml
/// makes them all first; the sums are the same). `scratch` is
/// [`vector_scratch_len`]`(head_dim)` long.
#[allow(clippy::too_many_arguments)]
pub fn split(
    kv: &impl KvHead,
    q: &[f32],
    visible: Range<usize>,
    sees: impl Fn(usize) -> bool,
    cells: usize,
    chunks: usize,
    scale: f32,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    let chunk = cells.div_ceil(chunks.max(1));
    let (own, part) = scratch.split_at_mut(hd);
    let part = &mut part[..hd];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    out.fill(0.0);
    for lo in (0..cells).step_by(chunk.max(1)).take(chunks) {
        let p = vector_partial(
            kv,
            q,
            visible.clone(),
            &sees,
            lo..(lo + chunk).min(cells),
            scale,
            own,
            part,
        );
        if p.sum == 0.0 {
            continue;
        }
        let m = max.max(p.max);
        let (old, new) = ((max - m).exp(), (p.max - m).exp());
        for (o, &v) in out.iter_mut().zip(part.iter()) {
            *o = o.mul_add(old, v * new);
        }
        sum = sum.mul_add(old, p.sum * new);
        max = m;
    }
    // With nothing seen `out` stays 0, as ggml leaves it.
    normalize(out, sum);
}

/// Up to [`Q_TILE`] query rows of one head against its cells, for the tiled route.
#[derive(Clone, Copy)]
pub struct Tile<'a> {
    /// `rows * head_dim` queries in f32.
    pub q: &'a [f32],
    pub head_dim: usize,
    /// Cells `0..cells` of the cache view.
    pub cells: usize,
    pub scale: f32,
}

/// `tile`'s rows (row `r` seeing the cells `c` of `visible(r)` with
/// `sees(r, c)`) by the tiled route; `out` gets `rows * head_dim`
/// normalized outputs. `scratch` is [`tile_scratch_len`]`(head_dim)` long.
pub fn tiled(
    kv: &impl KvHead,
    tile: Tile,
    visible: impl Fn(usize) -> Range<usize>,
    sees: impl Fn(usize, usize) -> bool,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::f16dot::has_f16c() {
        // SAFETY: avx2, fma and f16c were detected at run time.
        return unsafe { tiled_fma(kv, tile, visible, sees, scratch, out) };
    }
    tiled_body(kv, tile, visible, sees, scratch, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiled_fma(
    kv: &impl KvHead,
    tile: Tile,
    visible: impl Fn(usize) -> Range<usize>,
    sees: impl Fn(usize, usize) -> bool,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    tiled_body(kv, tile, visible, sees, scratch, out)
}

#[inline(always)]
fn tiled_body(
    kv: &impl KvHead,
    tile: Tile,
    visible: impl Fn(usize) -> Range<usize>,
    sees: impl Fn(usize, usize) -> bool,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    let Tile {
        q,
        head_dim: hd,
        cells,
        scale,
    } = tile;
    let rows = q.len() / hd;
    debug_assert!(rows <= Q_TILE && out.len() == rows * hd);
    let (kt, rest) = scratch.split_at_mut(KV_TILE * hd);
    let (v32, rest) = rest.split_at_mut(KV_TILE * hd);
    let (kq, _) = rest.split_at_mut(Q_TILE * KV_TILE);
    let vis: [Range<usize>; Q_TILE] = std::array::from_fn(|r| if r < rows { visible(r) } else { 0..0 });
    let mut max = [f32::NEG_INFINITY; Q_TILE];
    let mut sum = [0.0f32; Q_TILE];
    out.fill(0.0);
    for lo in (0..cells).step_by(KV_TILE) {
        let n = KV_TILE.min(cells - lo);
        let seen = |r: usize| (vis[r].start.max(lo)..vis[r].end.min(lo + n)).any(|c| sees(r, c));
        if !(0..rows).any(seen) {
            continue;
        }
        // Values in f32 as [cell][dim]; keys transposed to [dim][cell] (each
        // row widened in the first value row's place first); zero past the last cell.
        for c in 0..KV_TILE {
            if c < n {
                let row = &mut v32[..hd];
                widen(kv.key(lo + c), row);
                for (d, &k) in row.iter().enumerate() {
                    kt[d * KV_TILE + c] = k;
                }
            } else {
                for d in 0..hd {
                    kt[d * KV_TILE + c] = 0.0;
                }
            }
        }
        for c in 0..KV_TILE {
            let row = &mut v32[c * hd..(c + 1) * hd];
            if c < n {
                widen(kv.value(lo + c), row);
            } else {
                row.fill(0.0);
            }
        }
        let kq = &mut kq[..rows * KV_TILE];
        scores(q, hd, kt, kq);
        for r in 0..rows {
            let s = &mut kq[r * KV_TILE..(r + 1) * KV_TILE];
            for (c, sc) in s.iter_mut().enumerate() {
                let at = lo + c;
                *sc = if c < n && vis[r].contains(&at) && sees(r, at) {
                    *sc * scale + 0.0
                } else {
                    f32::NEG_INFINITY
                };
            }
            let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if tile_max == f32::NEG_INFINITY {
                // Nothing seen: zero weights in the value product, as ggml.
                s.fill(0.0);
                continue;
            }
            let m = max[r].max(tile_max);
            if m > max[r] {
                let ms = (max[r] - m).exp();
                for a in out[r * hd..(r + 1) * hd].iter_mut() {
                    *a *= ms;
                }
                sum[r] *= ms;
            }
            max[r] = m;
            sum[r] = (sum[r] as f64 + exp_sum(s, m)) as f32;
        }
        add_values(kq, v32, hd, out);
    }
    for r in 0..rows {
        normalize(&mut out[r * hd..(r + 1) * hd], sum[r]);
    }
}

/// Every row's scores over the tile: `s[r][c] = sum over d of q[r][d] *
/// kt[d][c]`, each a chain of fused multiply-adds in dimension order from 0
/// (ggml's `simd_gemm`; blocking rows changes no result).
#[inline(always)]
fn scores(q: &[f32], hd: usize, kt: &[f32], s: &mut [f32]) {
    let rows = s.len() / KV_TILE;
    #[cfg(target_arch = "x86_64")]
    if crate::dot::has_avx512f() {
        let four = rows / 4 * 4;
        for r in (0..four).step_by(4) {
            // SAFETY: avx512f was detected at run time.
            unsafe { simd::scores_rows::<4>(&q[r * hd..(r + 4) * hd], hd, kt, &mut s[r * KV_TILE..(r + 4) * KV_TILE]) };
        }
        for r in four..rows {
            // SAFETY: as above.
            unsafe { simd::scores_rows::<1>(&q[r * hd..(r + 1) * hd], hd, kt, &mut s[r * KV_TILE..(r + 1) * KV_TILE]) };
        }
        return;
    }
    for r in 0..rows {
        let s = &mut s[r * KV_TILE..(r + 1) * KV_TILE];
        let q = &q[r * hd..(r + 1) * hd];
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            // SAFETY: avx2 and fma were detected at run time.
            unsafe { simd::scores_row(q, kt, s) };
            continue;
        }
        #[cfg(target_arch = "aarch64")]
        {
            // SAFETY: NEON is part of the aarch64 baseline.
            unsafe { neon::scores_row(q, kt, s) };
            continue;
        }
        #[allow(unreachable_code)]
        s.fill(0.0);
        for (d, &qd) in q.iter().enumerate() {
            for (sc, &kc) in s.iter_mut().zip(&kt[d * KV_TILE..(d + 1) * KV_TILE]) {
                *sc = qd.mul_add(kc, *sc);
            }
        }
    }
}

/// Every row's `acc[r][d] += sum over c of p[r][c] * v32[c][d]`, each a
/// chain of fused multiply-adds in cell order (ggml's `simd_gemm`).
#[inline(always)]
fn add_values(p: &[f32], v32: &[f32], hd: usize, acc: &mut [f32]) {
    let rows = p.len() / KV_TILE;
    #[cfg(target_arch = "x86_64")]
    if crate::dot::has_avx512f() {
        let four = rows / 4 * 4;
        for r in (0..four).step_by(4) {
            // SAFETY: avx512f was detected at run time.
            unsafe {
                simd::values_rows::<4>(
                    &p[r * KV_TILE..(r + 4) * KV_TILE],
                    v32,
                    hd,
                    &mut acc[r * hd..(r + 4) * hd],
                )
            };
        }
        for r in four..rows {
            // SAFETY: as above.
            unsafe {
                simd::values_rows::<1>(
                    &p[r * KV_TILE..(r + 1) * KV_TILE],
                    v32,
                    hd,
                    &mut acc[r * hd..(r + 1) * hd],
                )
            };
        }
        return;
    }
    for r in 0..rows {
        let (p, acc) = (&p[r * KV_TILE..(r + 1) * KV_TILE], &mut acc[r * hd..(r + 1) * hd]);
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            // SAFETY: avx2 and fma were detected at run time.
            unsafe { simd::add_values(p, v32, acc) };
            continue;
        }
        #[cfg(target_arch = "aarch64")]
        {
            // SAFETY: NEON is part of the aarch64 baseline.
            unsafe { neon::add_values(p, v32, acc) };
            continue;
        }
        #[allow(unreachable_code)]
        for (c, &pc) in p.iter().enumerate() {
            for (a, &vd) in acc.iter_mut().zip(&v32[c * hd..(c + 1) * hd]) {
                *a = pc.mul_add(vd, *a);
            }
        }
    }
}

/// `dst = src` widened to f32.
#[inline(always)]
fn widen(src: &[f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::f16dot::has_f16c() {
        // SAFETY: avx2, fma and f16c were detected at run time.
        return unsafe { simd::widen(src, dst) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        return unsafe { neon::widen(src, dst) };
    }
    #[allow(unreachable_code)]
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = x.to_f32();
    }
}

/// `y = f16(y * v)` element by element (`ggml_vec_scale_f16`).
fn scale_f16(y: &mut [f16], v: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::f16dot::has_f16c() {
        // SAFETY: avx2, fma and f16c were detected at run time.
        return unsafe { simd::scale_f16(y, v) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        return unsafe { neon::scale_f16(y, v) };
    }
    #[allow(unreachable_code)]
    for e in y {
        *e = f16::from_f32(e.to_f32() * v);
    }
}

/// `y = f16(fma(x, v, y))` element by element (`ggml_vec_mad_f16`).
fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::f16dot::has_f16c() {
        // SAFETY: avx2, fma and f16c were detected at run time.
        return unsafe { simd::mad_f16(y, x, v) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: NEON is part of the aarch64 baseline.
        return unsafe { neon::mad_f16(y, x, v) };
    }
    #[allow(unreachable_code)]
    for (e, &xi) in y.iter_mut().zip(x) {
        *e = f16::from_f32(xi.to_f32().mul_add(v, e.to_f32()));
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use half::f16;
    use std::arch::x86_64::*;

    use super::KV_TILE;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let len = src.len().min(dst.len());
        let n = len / 8 * 8;
        let (s, d) = (src.as_ptr() as *const __m128i, dst.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices.
            _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(_mm_loadu_si128(s.add(i / 8))));
        }
        for (o, &x) in dst[n..len].iter_mut().zip(&src[n..len]) {
            *o = x.to_f32();
        }
    }

    /// `R` rows' scores at once: four 16-lane accumulators per row over
    /// the 64 cells, each key load shared by the rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_rows<const R: usize>(q: &[f32], hd: usize, kt: &[f32], s: &mut [f32]) {
        debug_assert!(q.len() == R * hd && kt.len() >= hd * KV_TILE && s.len() == R * KV_TILE);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let (k, qp) = (kt.as_ptr(), q.as_ptr());
        for d in 0..hd {
            // SAFETY: d < hd, so the key row and the query elements are in bounds.
            let kv: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(k.add(d * KV_TILE + 16 * j)));
            for (r, a) in acc.iter_mut().enumerate() {
                let qb = _mm512_set1_ps(*qp.add(r * hd + d));
                for (aj, &kj) in a.iter_mut().zip(&kv) {
                    *aj = _mm512_fmadd_ps(qb, kj, *aj);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (j, aj) in a.iter().enumerate() {
                _mm512_storeu_ps(s.as_mut_ptr().add(r * KV_TILE + 16 * j), *aj);
            }
        }
    }

    /// `R` rows' value sums at once, 64 dimensions at a time held in
    /// registers across the cells, each value load shared by the rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn values_rows<const R: usize>(p: &[f32], v32: &[f32], hd: usize, acc: &mut [f32]) {
        debug_assert!(p.len() == R * KV_TILE && acc.len() == R * hd && v32.len() >= KV_TILE * hd);
        let blocks = hd / 64 * 64;
        let (v, o, pp) = (v32.as_ptr(), acc.as_mut_ptr(), p.as_ptr());
        for d0 in (0..blocks).step_by(64) {
            // SAFETY: d0 + 64 <= hd for every row's accumulator.
            let mut a: [[__m512; 4]; R] =
                std::array::from_fn(|r| std::array::from_fn(|j| _mm512_loadu_ps(o.add(r * hd + d0 + 16 * j))));
            for c in 0..KV_TILE {
                // SAFETY: c < KV_TILE rows of hd values.
                let vv: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(v.add(c * hd + d0 + 16 * j)));
                for (r, ar) in a.iter_mut().enumerate() {
                    let pb = _mm512_set1_ps(*pp.add(r * KV_TILE + c));
                    for (aj, &vj) in ar.iter_mut().zip(&vv) {
                        *aj = _mm512_fmadd_ps(pb, vj, *aj);
                    }
                }
            }
            for (r, ar) in a.iter().enumerate() {
                for (j, aj) in ar.iter().enumerate() {
                    _mm512_storeu_ps(o.add(r * hd + d0 + 16 * j), *aj);
                }
            }
        }
        for r in 0..R {
            for c in 0..KV_TILE {
                let pc = p[r * KV_TILE + c];
                for d in blocks..hd {
                    acc[r * hd + d] = pc.mul_add(v32[c * hd + d], acc[r * hd + d]);
                }
            }
        }
    }

    /// Eight 8-lane accumulators hold the 64 cells' scores across the dimensions.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores_row(q: &[f32], kt: &[f32], s: &mut [f32]) {
        debug_assert!(kt.len() >= q.len() * KV_TILE && s.len() == KV_TILE);
        let mut acc = [_mm256_setzero_ps(); KV_TILE / 8];
        let k = kt.as_ptr();
        for (d, &qd) in q.iter().enumerate() {
            let qv = _mm256_set1_ps(qd);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: d < q.len(), so the row of KV_TILE lies inside kt.
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add(d * KV_TILE + 8 * j)), *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(s.as_mut_ptr().add(8 * j), *a);
        }
    }

    /// The accumulators in blocks of 64 dimensions, kept in registers across the cells.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add_values(p: &[f32], v32: &[f32], acc: &mut [f32]) {
        let hd = acc.len();
        debug_assert!(v32.len() >= p.len() * hd);
        let blocks = hd / 64 * 64;
        let (v, o) = (v32.as_ptr(), acc.as_mut_ptr());
        for d0 in (0..blocks).step_by(64) {
            let mut a = [_mm256_setzero_ps(); 8];
            for (j, r) in a.iter_mut().enumerate() {
                *r = _mm256_loadu_ps(o.add(d0 + 8 * j));
            }
            for (c, &pc) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pc);
                for (j, r) in a.iter_mut().enumerate() {
                    // SAFETY: c < p.len() and d0 + 64 <= hd.
                    *r = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(c * hd + d0 + 8 * j)), *r);
                }
            }
            for (j, r) in a.iter().enumerate() {
                _mm256_storeu_ps(o.add(d0 + 8 * j), *r);
            }
        }
        for (c, &pc) in p.iter().enumerate() {
            for d in blocks..hd {
                acc[d] = pc.mul_add(v32[c * hd + d], acc[d]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_f16(y: &mut [f16], v: f32) {
        let n = y.len() / 8 * 8;
        let vv = _mm256_set1_ps(v);
        let p = y.as_mut_ptr() as *mut __m128i;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= y.len().
            let a = _mm256_cvtph_ps(_mm_loadu_si128(p.add(i / 8)));
            _mm_storeu_si128(p.add(i / 8), _mm256_cvtps_ph::<0>(_mm256_mul_ps(a, vv)));
        }
        for e in &mut y[n..] {
            *e = f16::from_f32(e.to_f32() * v);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
        let len = y.len().min(x.len());
        let n = len / 8 * 8;
        let vv = _mm256_set1_ps(v);
        let (py, px) = (y.as_mut_ptr() as *mut __m128i, x.as_ptr() as *const __m128i);
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices.
            let a = _mm256_cvtph_ps(_mm_loadu_si128(py.add(i / 8)));
            let b = _mm256_cvtph_ps(_mm_loadu_si128(px.add(i / 8)));
            _mm_storeu_si128(py.add(i / 8), _mm256_cvtps_ph::<0>(_mm256_fmadd_ps(b, vv, a)));
        }
        for (e, &xi) in y[n..len].iter_mut().zip(&x[n..len]) {
            *e = f16::from_f32(xi.to_f32().mul_add(v, e.to_f32()));
        }
    }
}

/// NEON twins of the `simd` kernels: the same per-element operations (each
/// output a fused multiply-add chain in the portable order, each f16 update
/// rounded to nearest even once), four lanes at a time.
#[cfg(target_arch = "aarch64")]
mod neon {
    use core::arch::aarch64::*;
    use half::f16;

    use super::KV_TILE;
    use crate::f16dot::neon::{load4, load8, store4, store8};

    pub unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let len = src.len().min(dst.len());
        let n = len / 8 * 8;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices.
            let (lo, hi) = load8(s.add(i));
            vst1q_f32(d.add(i), lo);
            vst1q_f32(d.add(i + 4), hi);
        }
        for (o, &x) in dst[n..len].iter_mut().zip(&src[n..len]) {
            *o = x.to_f32();
        }
    }

    /// Sixteen 4-lane accumulators hold the 64 cells' scores across the dimensions.
    pub unsafe fn scores_row(q: &[f32], kt: &[f32], s: &mut [f32]) {
        debug_assert!(kt.len() >= q.len() * KV_TILE && s.len() == KV_TILE);
        let mut acc = [vdupq_n_f32(0.0); KV_TILE / 4];
        let k = kt.as_ptr();
        for (d, &qd) in q.iter().enumerate() {
            let qv = vdupq_n_f32(qd);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: d < q.len(), so the row of KV_TILE lies inside kt.
                *a = vfmaq_f32(*a, qv, vld1q_f32(k.add(d * KV_TILE + 4 * j)));
            }
        }
        for (j, a) in acc.iter().enumerate() {
            vst1q_f32(s.as_mut_ptr().add(4 * j), *a);
        }
    }

    /// The accumulators in blocks of 64 dimensions (then of 4), kept in
    /// registers across the cells.
    pub unsafe fn add_values(p: &[f32], v32: &[f32], acc: &mut [f32]) {
        let hd = acc.len();
        debug_assert!(v32.len() >= p.len() * hd);
        let blocks = hd / 64 * 64;
        let quads = hd / 4 * 4;
        let (v, o) = (v32.as_ptr(), acc.as_mut_ptr());
        for d0 in (0..blocks).step_by(64) {
            let mut a = [vdupq_n_f32(0.0); 16];
            for (j, r) in a.iter_mut().enumerate() {
                *r = vld1q_f32(o.add(d0 + 4 * j));
            }
            for (c, &pc) in p.iter().enumerate() {
                let pv = vdupq_n_f32(pc);
                for (j, r) in a.iter_mut().enumerate() {
                    // SAFETY: c < p.len() and d0 + 64 <= hd.
                    *r = vfmaq_f32(*r, pv, vld1q_f32(v.add(c * hd + d0 + 4 * j)));
                }
            }
            for (j, r) in a.iter().enumerate() {
                vst1q_f32(o.add(d0 + 4 * j), *r);
            }
        }
        for d0 in (blocks..quads).step_by(4) {
            // SAFETY: d0 + 4 <= hd.
            let mut r = vld1q_f32(o.add(d0));
            for (c, &pc) in p.iter().enumerate() {
                r = vfmaq_f32(r, vdupq_n_f32(pc), vld1q_f32(v.add(c * hd + d0)));
            }
            vst1q_f32(o.add(d0), r);
        }
        for (c, &pc) in p.iter().enumerate() {
            for d in quads..hd {
                acc[d] = pc.mul_add(v32[c * hd + d], acc[d]);
            }
        }
    }

    /// `ggml_vec_scale_f16` of the NEON build: f32 lanes, `vmulq_f32`, back to f16.
    pub unsafe fn scale_f16(y: &mut [f16], v: f32) {
        let n = y.len() / 8 * 8;
        let quads = y.len() / 4 * 4;
        let vv = vdupq_n_f32(v);
        let p = y.as_mut_ptr();
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= y.len().
            let (lo, hi) = load8(p.add(i));
            store8(p.add(i), vmulq_f32(lo, vv), vmulq_f32(hi, vv));
        }
        if quads > n {
            // SAFETY: n + 4 <= y.len().
            store4(p.add(n), vmulq_f32(load4(p.add(n)), vv));
        }
        for e in &mut y[quads..] {
            *e = f16::from_f32(e.to_f32() * v);
        }
    }

    /// `ggml_vec_mad_f16` of the NEON build: `vfmaq_f32(y, x, v)` in f32 lanes, back to f16.
    pub unsafe fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
        let len = y.len().min(x.len());
        let n = len / 8 * 8;
        let quads = len / 4 * 4;
        let vv = vdupq_n_f32(v);
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= len for both slices.
            let (a0, a1) = load8(py.add(i));
            let (b0, b1) = load8(px.add(i));
            store8(py.add(i), vfmaq_f32(a0, b0, vv), vfmaq_f32(a1, b1, vv));
        }
        if quads > n {
            // SAFETY: n + 4 <= len.
            store4(py.add(n), vfmaq_f32(load4(py.add(n)), load4(px.add(n)), vv));
        }
        for (e, &xi) in y[quads..len].iter_mut().zip(&x[quads..len]) {
            *e = f16::from_f32(xi.to_f32().mul_add(v, e.to_f32()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f16dot::golden::wide;

    /// Every instruction set's tile products give the portable chain's bits.
    #[test]
    fn tile_products_agree_across_instruction_sets() {
        let hd = 80; // one 64-wide block and a remainder
        let rows = 6;
        let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 250.0 - 2.0;
        let q: Vec<f32> = (0..rows * hd).map(val).collect();
        let kt: Vec<f32> = (0..hd * KV_TILE).map(|i| val(i + 7)).collect();
        let v32: Vec<f32> = (0..KV_TILE * hd).map(|i| val(i + 13)).collect();
        let p: Vec<f32> = (0..rows * KV_TILE).map(|i| val(i + 29).abs()).collect();
        let mut want_s = vec![0.0f32; rows * KV_TILE];
        let mut want_acc: Vec<f32> = (0..rows * hd).map(|i| val(i + 31)).collect();
        let mut got_acc = want_acc.clone();
        for r in 0..rows {
            for c in 0..KV_TILE {
                let mut a = 0.0f32;
                for d in 0..hd {
                    a = q[r * hd + d].mul_add(kt[d * KV_TILE + c], a);
                }
                want_s[r * KV_TILE + c] = a;
            }
            for d in 0..hd {
                for c in 0..KV_TILE {
                    let i = r * hd + d;
                    want_acc[i] = p[r * KV_TILE + c].mul_add(v32[c * hd + d], want_acc[i]);
                }
            }
        }
        let mut got_s = vec![0.0f32; rows * KV_TILE];
        scores(&q, hd, &kt, &mut got_s);
        add_values(&p, &v32, hd, &mut got_acc);
        assert_eq!(got_s, want_s);
        assert_eq!(got_acc, want_acc);
        #[cfg(target_arch = "x86_64")]
        if crate::dot::has_avx2() {
            let (mut s2, mut acc2) = (vec![0.0f32; KV_TILE], got_acc[..hd].to_vec());
            acc2.copy_from_slice(&(0..hd).map(|i| val(i + 31)).collect::<Vec<_>>());
            // SAFETY: avx2 and fma were detected.
            unsafe {
                simd::scores_row(&q[..hd], &kt, &mut s2);
                simd::add_values(&p[..KV_TILE], &v32, &mut acc2);
            }
            assert_eq!(s2, want_s[..KV_TILE]);
            assert_eq!(acc2, want_acc[..hd]);
        }
    }

    /// The value products at head sizes with 64-wide blocks, 4-wide blocks
    /// and a scalar remainder, against the portable chains.
    #[test]
    fn value_products_agree_at_every_head_size() {
        for hd in [4usize, 7, 64, 66, 72, 80, 128, 131] {
            let p: Vec<f32> = wide(KV_TILE, 9).iter().map(|v| v.abs()).collect();
            let v32 = wide(KV_TILE * hd, 10);
            let start = wide(hd, 11);
            let mut want = start.clone();
            for (c, &pc) in p.iter().enumerate() {
                for (d, w) in want.iter_mut().enumerate() {
                    *w = pc.mul_add(v32[c * hd + d], *w);
                }
            }
            let mut got = start.clone();
            add_values(&p, &v32, hd, &mut got);
            assert_eq!(got, want, "hd={hd}");
        }
    }

    /// The f16 updates of the vector route equal the element formulas.
    #[test]
    fn f16_updates_equal_their_element_formulas() {
        for n in [1usize, 3, 4, 7, 8, 12, 64, 100, 131] {
            let y0: Vec<f16> = wide(n, 1).iter().map(|&v| f16::from_f32(v)).collect();
            let x: Vec<f16> = wide(n, 2).iter().map(|&v| f16::from_f32(v)).collect();
            for v in [0.37f32, 1.0, 1e-3, 0.999_9] {
                let mut y = y0.clone();
                scale_f16(&mut y, v);
                for (a, b) in y.iter().zip(&y0) {
                    assert_eq!(a.to_bits(), f16::from_f32(b.to_f32() * v).to_bits(), "scale n={n}");
                }
                let mut y = y0.clone();
                mad_f16(&mut y, &x, v);
                for ((a, b), xi) in y.iter().zip(&y0).zip(&x) {
                    let want = f16::from_f32(xi.to_f32().mul_add(v, b.to_f32()));
                    assert_eq!(a.to_bits(), want.to_bits(), "mad n={n}");
                }
                let mut w = vec![0.0f32; n];
                widen(&x, &mut w);
                assert!(w.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_f32().to_bits()));
            }
        }
    }
}
