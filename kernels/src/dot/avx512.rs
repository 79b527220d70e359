//! AVX-512 prompt kernels: for several activation rows at once, the same
//! outputs as llama.cpp's (and our AVX2 kernels'), bit for bit, in fewer
//! instructions.
//!
//! A quantized product's float arithmetic is fixed per output (which
//! integer sums are converted, scaled and accumulated, in which order); the
//! integer sums are exact, so any instruction sequence that reaches the same
//! integers gives the same bits. Both kernels here read activations from
//! *panels*, the rows laid out again once per layer input
//! ([`crate::matmul::ActBuffer`] makes them) and read by every weight row:
//!
//! - **Q5_0 · Q8_0** (tinyBLAS / `ggml_vec_dot_q5_0_q8_0`: eight lanes of
//!   four-byte sums per block, `fma(dx * dy, lanes, acc)`, summed at the
//!   end). The weights are used as their raw 5-bit values `u = x + 16`,
//!   which `vpdpbusd` takes directly as its unsigned operand, and the offset
//!   comes out by starting each lane at `-16 * (its four activation bytes)`,
//!   kept in the panel: no sign trick per product. (The same integers as the
//!   sign trick for every byte Q8_0 quantization makes, -127..=127; the
//!   trick, GGML's included, would get -128 wrong.) The scale products
//!   `dx * dy` of a block are made eight tokens per multiply from the panel's
//!   f32 scales.
//! - **Q4_K · Q8_K as llama.cpp's repacked gemm** ([`crate::repack`]: one
//!   exact integer per output and sub-block pair, one FMA each). The panel
//!   puts eight tokens in the eight lanes, four bytes each, so `vpdpbusd` of
//!   four weight nibbles broadcast to all lanes gives eight outputs' partial
//!   sums with no horizontal reduction afterwards.
//!
//! 256-bit registers (EVEX `vpdpbusd` needs AVX512-VNNI + VL), not 512: on
//! this project's AMD EPYC (Zen 4, which splits 512-bit operations in two) a
//! 512-bit Q5_0 form with two rows per register measured 15% slower, its
//! scale products costing one multiply per pair.
//! On the Intel Xeon (2026-12-07) a form with two *tokens* per register
//! (their bytes and offsets are adjacent in the panel, so one 512-bit load
//! each; a quarter fewer instructions, the same bits) was no faster either:
//! Gemma 3's 512-token prompt ran 634-710 tok/s with this kernel and
//! 659-683 with that one, three interleaved rounds, the kernel's share of
//! the profile 42% against 39-41%.

use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};

use bytemuck::{Pod, Zeroable};

use super::avx2::{fp16, hsum_each};
use crate::blocks::{unpack_scales_mins_k4, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8K, BlockQ8_0, QK, QK_K};

/// Whether these kernels run here: AVX-512 F, BW, VL and VNNI on top of the
/// AVX2 set, detected once.
pub(crate) fn available() -> bool {
    use std::sync::OnceLock;
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        super::has_avx512f()
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// Tokens per panel, and the most one call computes at once.
pub(crate) const PANEL_TOKENS: usize = 8;
/// Q5_0 weight rows computed together: 2 x 8 outputs, sixteen accumulators.
const Q5_0_ROWS: usize = 2;

/// How one kind of activation row is laid out in panels: one panel block
/// holds block `ib` of [`PANEL_TOKENS`] consecutive tokens.
pub(crate) trait PanelLayout: Pod + Send {
    /// The activation blocks the panels are made from.
    type Row: Pod + Sync;
    /// Block `ib` of the tokens `first..first + PANEL_TOKENS` of `rows` (`n`
    /// rows of `blocks` blocks, back to back); slots past token `n` zero.
    fn gather(rows: &[Self::Row], n: usize, blocks: usize, first: usize, ib: usize) -> Self;
}

/// Activation rows laid out for the kernels here: panel `p` holds tokens
/// `8p..8p + 8`, block by block ([`Q8_0Panels`], [`Q8KPanels`]).
pub(crate) struct Panels<'a, B> {
    bytes: &'a [u8],
    blocks: usize,
    layout: PhantomData<B>,
}

impl<B> Clone for Panels<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Panels<'_, B> {}

pub(crate) type Q8_0Panels<'a> = Panels<'a, Q8_0PanelBlock>;
pub(crate) type Q8KPanels<'a> = Panels<'a, Q8KPanelBlock>;

impl<'a, B: PanelLayout> Panels<'a, B> {
    /// Bytes of the panels of `n` tokens of `blocks` blocks each.
    pub(crate) fn bytes_for(n: usize, blocks: usize) -> usize {
        n.div_ceil(PANEL_TOKENS)
            .saturating_mul(blocks)
            .saturating_mul(size_of::<B>())
    }

    /// Lays out `rows` (`n` rows of `blocks` blocks, back to back) in `out`,
    /// which must hold [`Self::bytes_for`]`(n, blocks)` bytes at `B`'s
    /// alignment (the kernels read blocks in place); across rayon's threads
    /// when there are many blocks (a prompt's: thousands).
    pub(crate) fn build(rows: &[B::Row], n: usize, blocks: usize, out: &'a mut [u8]) -> Option<Self> {
        use rayon::prelude::*;
        const PARALLEL_BLOCKS: usize = 256;
        let bytes = Self::bytes_for(n, blocks);
        if rows.len() != n * blocks || out.len() < bytes || !Self::aligned(out) {
            return None;
        }
        let out = &mut out[..bytes];
        let fill = |(index, chunk): (usize, &mut [u8])| {
            let (panel, ib) = (index / blocks, index % blocks);
            chunk.copy_from_slice(bytemuck::bytes_of(&B::gather(
                rows,
                n,
                blocks,
                panel * PANEL_TOKENS,
                ib,
            )));
        };
        if out.len() / size_of::<B>() >= PARALLEL_BLOCKS {
            out.par_chunks_exact_mut(size_of::<B>()).enumerate().for_each(fill);
        } else {
            out.chunks_exact_mut(size_of::<B>()).enumerate().for_each(fill);
        }
        Some(Self {
            bytes: out,
            blocks,
            layout: PhantomData,
        })
    }

    fn aligned(bytes: &[u8]) -> bool {
        (bytes.as_ptr() as usize).is_multiple_of(align_of::<B>())
    }

    /// The panels already in `bytes` (as [`Self::build`] left them).
    pub(crate) fn from_bytes(bytes: &'a [u8], n: usize, blocks: usize) -> Option<Self> {
        let len = Self::bytes_for(n, blocks);
        bytes.get(..len).filter(|bytes| Self::aligned(bytes)).map(|bytes| Self {
            bytes,
            blocks,
            layout: PhantomData,
        })
    }

    /// The panel holding tokens `first_token..first_token + tokens`, if that
    /// is one panel's start and at most its width.
    fn tile(&self, first_token: usize, tokens: usize) -> Option<*const B> {
        let panel_bytes = self.blocks * size_of::<B>();
        let start = (first_token / PANEL_TOKENS) * panel_bytes;
        let fits = first_token.is_multiple_of(PANEL_TOKENS) && (1..=PANEL_TOKENS).contains(&tokens);
        fits.then(|| self.bytes.get(start..start + panel_bytes))
            .flatten()
            .map(|panel| panel.as_ptr() as *const B)
    }
}

/// One block of [`PANEL_TOKENS`] Q8_0 tokens: their 32 bytes each, their
/// scales as f32, and each token's eight lane offsets `-16 * (sum of four
/// bytes)`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q8_0PanelBlock {
    qs: [[i8; QK]; PANEL_TOKENS],
    d: [f32; PANEL_TOKENS],
    offset16: [[i32; 8]; PANEL_TOKENS],
}

const _: () = assert!(size_of::<Q8_0PanelBlock>() == 544);

impl PanelLayout for Q8_0PanelBlock {
    type Row = BlockQ8_0;

    fn gather(rows: &[BlockQ8_0], n: usize, blocks: usize, first: usize, ib: usize) -> Self {
        let mut block = Self::zeroed();
        for t in 0..PANEL_TOKENS.min(n.saturating_sub(first)) {
            let y = &rows[(first + t) * blocks + ib];
            block.qs[t] = y.qs;
            block.d[t] = fp16(y.d);
            for (lane, offset) in block.offset16[t].iter_mut().enumerate() {
                *offset = -16 * y.qs[4 * lane..4 * lane + 4].iter().map(|&q| q as i32).sum::<i32>();
            }
        }
        block
    }
}

/// Q5_0 weight rows · the tokens `first_token..first_token +
/// tokens` of `panels` (`first_token` a multiple of [`PANEL_TOKENS`],
/// `tokens` at most that), into `out[r * tokens + t]`: equal to
/// [`super::avx2::q5_0_q8_0`] on the same rows, bit for bit.
///
/// # Safety
/// [`available`] must have returned true.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q5_0_q8_0(
    ws: &[&[BlockQ5_0]],
    panels: Q8_0Panels,
    first_token: usize,
    tokens: usize,
    out: &mut [f32],
) {
    let nb = panels.blocks;
    let Some(panel) = panels.tile(first_token, tokens) else {
        return;
    };
    if ws.iter().any(|w| w.len() != nb) || out.len() < ws.len() * tokens {
        return;
    }
    for r0 in (0..ws.len()).step_by(Q5_0_ROWS) {
        let rows = Q5_0_ROWS.min(ws.len() - r0);
        macro_rules! run {
            ($R:literal, $T:literal) => {{
                let w: [*const BlockQ5_0; $R] = std::array::from_fn(|i| ws[r0 + i].as_ptr());
                let result = q5_0_tile::<$R, $T>(w, panel, nb);
                for (r, row) in result.iter().enumerate() {
                    out[(r0 + r) * tokens..][..$T].copy_from_slice(row);
                }
            }};
        }
        match (rows, tokens) {
            (2, 1) => run!(2, 1),
            (2, 2) => run!(2, 2),
            (2, 3) => run!(2, 3),
            (2, 4) => run!(2, 4),
            (2, 5) => run!(2, 5),
            (2, 6) => run!(2, 6),
            (2, 7) => run!(2, 7),
            (2, 8) => run!(2, 8),
            (1, 1) => run!(1, 1),
            (1, 2) => run!(1, 2),
            (1, 3) => run!(1, 3),
            (1, 4) => run!(1, 4),
            (1, 5) => run!(1, 5),
            (1, 6) => run!(1, 6),
            (1, 7) => run!(1, 7),
            (1, 8) => run!(1, 8),
            // Checked above: 1..=8 tokens; rows come in twos.
            _ => {}
        }
    }
}

/// `R` weight rows against the first `T` tokens of one panel, one output
/// per 256-bit register; the scale products of a block are made `R` at a
/// time and read back as broadcasts.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
// Rows and tokens index several arrays in step.
#[allow(clippy::needless_range_loop)]
unsafe fn q5_0_tile<const R: usize, const T: usize>(
    ws: [*const BlockQ5_0; R],
    panel: *const Q8_0PanelBlock,
    nb: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // The scale products `dx * dy` of block `ib` are made during block
    // `ib - 1` and read back as broadcasts folded into the FMAs (loads,
    // where broadcasting from a register is a shuffle per output; a block
    // ahead, so the reads never wait on the stores).
    let mut products = [[[0.0f32; PANEL_TOKENS]; R]; 2];
    let products: *mut [[f32; PANEL_TOKENS]; R] = std::hint::black_box(products.as_mut_ptr());
    let scale_products = |ib: usize, slot: *mut [[f32; PANEL_TOKENS]; R]| {
        let dy = _mm256_loadu_ps((*panel.add(ib)).d.as_ptr());
        for r in 0..R {
            let dx = _mm256_set1_ps(fp16((*ws[r].add(ib)).d));
            _mm256_storeu_ps((*slot)[r].as_mut_ptr(), _mm256_mul_ps(dx, dy));
        }
    };
    if nb > 0 {
        scale_products(0, products);
    }
    for ib in 0..nb {
        let block = panel.add(ib);
        let current = products.add(ib % 2);
        if ib + 1 < nb {
            scale_products(ib + 1, products.add((ib + 1) % 2));
        }
        let wx: [__m256i; R] = std::array::from_fn(|r| raw_q5_0(&*ws[r].add(ib)));
        for t in 0..T {
            let y = _mm256_loadu_si256((*block).qs[t].as_ptr() as *const __m256i);
            let offset = _mm256_loadu_si256((*block).offset16[t].as_ptr() as *const __m256i);
            for r in 0..R {
                let q = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(offset, wx[r], y));
                let d = _mm256_broadcast_ss(&(*current)[r][t]);
                acc[r][t] = _mm256_fmadd_ps(d, q, acc[r][t]);
            }
        }
    }
    hsum_each(acc)
}

/// A Q5_0 block's 32 values as unsigned bytes `x + 16` in `0..32`: low
/// nibbles then high nibbles, the fifth bit from `qh`.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn raw_q5_0(b: &BlockQ5_0) -> __m256i {
    let qs = _mm_loadu_si128(b.qs.as_ptr() as *const __m128i);
    let nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
    let fifth: __mmask32 = u32::from_le_bytes(b.qh);
    _mm256_mask_add_epi8(nibbles, fifth, nibbles, _mm256_set1_epi8(16))
}

// ---------------------------------------------------------------------------
// Q4_K in llama.cpp's repacked gemm arithmetic ([`crate::repack`]).

/// One super-block of [`PANEL_TOKENS`] Q8_K tokens with one token per lane:
/// `qs[g][t]` is bytes `4g..4g + 4` of token `t`, so a `vpdpbusd` of four
/// weight bytes broadcast to every lane against `qs[g]` gives eight tokens'
/// partial sums with no reduction afterwards. `pair_bsums[p][t]` holds token
/// `t`'s sums of 32-value sub-blocks `2p` and `2p + 1` (Q4_K's min terms),
/// `bsums16[k][t]` its sums of 16-value groups `2k` and `2k + 1` (Q6_K's
/// offset), `d` its scale. Slots past the last token are zero.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q8KPanelBlock {
    qs: [[[i8; 4]; PANEL_TOKENS]; QK_K / 4],
    d: [f32; PANEL_TOKENS],
    pair_bsums: [[[i16; 2]; PANEL_TOKENS]; QK_K / 64],
    bsums16: [[[i16; 2]; PANEL_TOKENS]; QK_K / 32],
}

const _: () = assert!(size_of::<Q8KPanelBlock>() == 2048 + 32 + 128 + 256);

impl PanelLayout for Q8KPanelBlock {
    type Row = BlockQ8K;

    fn gather(rows: &[BlockQ8K], n: usize, blocks: usize, first: usize, ib: usize) -> Self {
        let mut block = Self::zeroed();
        for t in 0..PANEL_TOKENS.min(n.saturating_sub(first)) {
            let y = &rows[(first + t) * blocks + ib];
            for (g, group) in block.qs.iter_mut().enumerate() {
                group[t].copy_from_slice(&y.qs[4 * g..4 * g + 4]);
            }
            block.d[t] = y.d;
            let sub_block_sum = |s: usize| y.bsums[2 * s].wrapping_add(y.bsums[2 * s + 1]);
            for (p, pair) in block.pair_bsums.iter_mut().enumerate() {
                pair[t] = [sub_block_sum(2 * p), sub_block_sum(2 * p + 1)];
            }
            for (k, pair) in block.bsums16.iter_mut().enumerate() {
                pair[t] = [y.bsums[2 * k], y.bsums[2 * k + 1]];
            }
        }
        block
    }
}

/// K-quant weight rows computed together ([`q4_k_gemm`], [`q6_k_tiled`]):
/// four rows' sums are four to eight independent `vpdpbusd` chains.
const K_ROWS: usize = 4;

/// Defines `$name(ws, panels, first_token, tokens, out)`: weight rows of
/// `$W` · the tokens `first_token..first_token + tokens` of Q8_K `panels`
/// (`first_token` a multiple of [`PANEL_TOKENS`], `tokens` at most that),
/// into `out[r * tokens + t]`, by `$tile::<R>` over groups of up to
/// [`K_ROWS`] rows. Shapes that do not fit leave `out` alone.
macro_rules! q8k_panel_kernel {
    ($(#[$doc:meta])* $name:ident($W:ty) => $tile:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// [`available`] must have returned true.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(crate) unsafe fn $name(ws: &[&[$W]], panels: Q8KPanels, first_token: usize, tokens: usize, out: &mut [f32]) {
            let nb = panels.blocks;
            let Some(panel) = panels.tile(first_token, tokens) else { return };
            if ws.iter().any(|w| w.len() != nb) || out.len() < ws.len() * tokens {
                return;
            }
            for r0 in (0..ws.len()).step_by(K_ROWS) {
                let rows = K_ROWS.min(ws.len() - r0);
                macro_rules! run {
                    ($R:literal) => {{
                        let w: [*const $W; $R] = std::array::from_fn(|i| ws[r0 + i].as_ptr());
                        let result = $tile::<$R>(w, panel, nb);
                        for (r, row) in result.iter().enumerate() {
                            out[(r0 + r) * tokens..][..tokens].copy_from_slice(&row[..tokens]);
                        }
                    }};
                }
                match rows {
                    1 => run!(1),
                    2 => run!(2),
                    3 => run!(3),
                    4 => run!(4),
                    // K_ROWS is 4.
                    _ => {}
                }
            }
        }
    };
}

q8k_panel_kernel!(
    /// All rows as rows of llama.cpp's repacked Q4_K gemm
    /// ([`crate::repack::Mode::Gemm`]): equal to `repack::avx2::tiles`
    /// there, bit for bit.
    q4_k_gemm(BlockQ4K) => q4_k_tile
);

q8k_panel_kernel!(
    /// In the arithmetic of llama.cpp's tiled K-quant matmul (one exact
    /// integer per output and super-block, `fma(float(sum) * d, d8, acc)`):
    /// equal to `avx2::q6_k_q8_k_tiled`, bit for bit.
    q6_k_tiled(BlockQ6K) => q6_k_tile
);

/// `R` weight rows against all eight token slots of one panel (results for
/// empty slots are dropped by the caller).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_k_tile<const R: usize>(
    ws: [*const BlockQ4K; R],
    panel: *const Q8KPanelBlock,
    nb: usize,
) -> [[f32; PANEL_TOKENS]; R] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_min = [_mm256_setzero_ps(); R];
    // Each row's nibbles of one sub-block pair, low then high, read back as
    // 4-byte broadcasts (loads, where shuffles of a register would compete
    // with the multiply-adds).
    let mut nibbles = [[0u8; 64]; R];
    let nibbles: *mut [u8; 64] = std::hint::black_box(nibbles.as_mut_ptr());
    for ib in 0..nb {
        let block = &*panel.add(ib);
        let d8 = _mm256_loadu_ps(block.d.as_ptr());
        let mut d = [_mm256_setzero_ps(); R];
        let mut dmin = [_mm256_setzero_ps(); R];
        let mut scales = [[0u8; 8]; R];
        let mut mins = [[0u8; 8]; R];
        for r in 0..R {
            let xb = &*ws[r].add(ib);
            // fp16(d) * d8 and fp16(dmin) * d8, the products GGML forms.
            d[r] = _mm256_mul_ps(_mm256_set1_ps(fp16(xb.d)), d8);
            dmin[r] = _mm256_mul_ps(_mm256_set1_ps(fp16(xb.dmin)), d8);
            (scales[r], mins[r]) = unpack_scales_mins_k4(&xb.scales);
        }
        for p in 0..QK_K / 64 {
            for (r, w) in ws.iter().enumerate() {
                let q4 = _mm256_loadu_si256((*w.add(ib)).qs.as_ptr().add(32 * p) as *const __m256i);
                let slot = (*nibbles.add(r)).as_mut_ptr();
                _mm256_storeu_si256(slot as *mut __m256i, _mm256_and_si256(q4, m4));
                _mm256_storeu_si256(
                    slot.add(32) as *mut __m256i,
                    _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4),
                );
            }
            let mut lo = [_mm256_setzero_si256(); R];
            let mut hi = [_mm256_setzero_si256(); R];
            for j in 0..8 {
                let y_lo = _mm256_loadu_si256(block.qs[16 * p + j].as_ptr() as *const __m256i);
                let y_hi = _mm256_loadu_si256(block.qs[16 * p + 8 + j].as_ptr() as *const __m256i);
                for r in 0..R {
                    let slot = (*nibbles.add(r)).as_ptr();
                    let w_lo = _mm256_set1_epi32((slot.add(4 * j) as *const i32).read_unaligned());
                    let w_hi = _mm256_set1_epi32((slot.add(32 + 4 * j) as *const i32).read_unaligned());
                    lo[r] = _mm256_dpbusd_epi32(lo[r], w_lo, y_lo);
                    hi[r] = _mm256_dpbusd_epi32(hi[r], w_hi, y_hi);
                }
            }
            let bsums = _mm256_loadu_si256(block.pair_bsums[p].as_ptr() as *const __m256i);
            for r in 0..R {
                let (sl, sh) = (scales[r][2 * p] as i32, scales[r][2 * p + 1] as i32);
                let isum = _mm256_add_epi32(
                    _mm256_mullo_epi32(lo[r], _mm256_set1_epi32(sl)),
                    _mm256_mullo_epi32(hi[r], _mm256_set1_epi32(sh)),
                );
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d[r], acc[r]);
                // min(2p) * bsum(2p) + min(2p + 1) * bsum(2p + 1), per token.
                let pair_mins = (mins[r][2 * p] as i32) | ((mins[r][2 * p + 1] as i32) << 16);
                let imin = _mm256_madd_epi16(_mm256_set1_epi32(pair_mins), bsums);
                acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), dmin[r], acc_min[r]);
            }
        }
    }
    let mut out = [[0.0f32; PANEL_TOKENS]; R];
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr(), _mm256_sub_ps(acc[r], acc_min[r]));
    }
    out
}

/// `R` Q6_K weight rows against all eight token slots of one panel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_k_tile<const R: usize>(
    ws: [*const BlockQ6K; R],
    panel: *const Q8KPanelBlock,
    nb: usize,
) -> [[f32; PANEL_TOKENS]; R] {
    let m15 = _mm256_set1_epi8(15);
    let m3 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); R];
    // Each row's 256 unsigned 6-bit values, read back as 4-byte broadcasts.
    let mut values = [[0u8; QK_K]; R];
    let values: *mut [u8; QK_K] = std::hint::black_box(values.as_mut_ptr());
    for ib in 0..nb {
        let block = &*panel.add(ib);
        let yd = _mm256_loadu_ps(block.d.as_ptr());
        let mut sums = [_mm256_setzero_si256(); R];
        for (r, w) in ws.iter().enumerate() {
            let xb = &*w.add(ib);
            let slot = (*values.add(r)).as_mut_ptr();
            for j in 0..QK_K / 128 {
                let ql1 = _mm256_loadu_si256(xb.ql.as_ptr().add(64 * j) as *const __m256i);
                let ql2 = _mm256_loadu_si256(xb.ql.as_ptr().add(64 * j + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(xb.qh.as_ptr().add(32 * j) as *const __m256i);
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m15),
                        _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql2, m15),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql2, 4), m15),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4),
                    ),
                ];
                for (k, v) in q.iter().enumerate() {
                    _mm256_storeu_si256(slot.add(128 * j + 32 * k) as *mut __m256i, *v);
                }
            }
            // 32 * sum(scale * bsum): the -32 offset of every value at once.
            let mut offset = _mm256_setzero_si256();
            for (k, pair) in block.bsums16.iter().enumerate() {
                let scales = (xb.scales[2 * k] as i16 as u16 as i32) | ((xb.scales[2 * k + 1] as i16 as i32) << 16);
                let bsums = _mm256_loadu_si256(pair.as_ptr() as *const __m256i);
                offset = _mm256_add_epi32(offset, _mm256_madd_epi16(_mm256_set1_epi32(scales), bsums));
            }
            sums[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
        }
        for sub in 0..QK_K / 16 {
            let mut raw = [_mm256_setzero_si256(); R];
            for g in 4 * sub..4 * sub + 4 {
                let y = _mm256_loadu_si256(block.qs[g].as_ptr() as *const __m256i);
                for (r, raw) in raw.iter_mut().enumerate() {
                    let w = ((*values.add(r)).as_ptr().add(4 * g) as *const i32).read_unaligned();
                    *raw = _mm256_dpbusd_epi32(*raw, _mm256_set1_epi32(w), y);
                }
            }
            for r in 0..R {
                let scale = _mm256_set1_epi32((*ws[r].add(ib)).scales[sub] as i32);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_mullo_epi32(raw[r], scale));
            }
        }
        for r in 0..R {
            let d = _mm256_set1_ps(fp16((*ws[r].add(ib)).d));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), d), yd, acc[r]);
        }
    }
    let mut out = [[0.0f32; PANEL_TOKENS]; R];
    for r in 0..R {
        _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::Zeroable;

    fn lcg(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *state >> 33
    }

    fn q5_0_weights(blocks: usize, state: &mut u64, extreme: bool) -> Vec<BlockQ5_0> {
        (0..blocks)
            .map(|_| BlockQ5_0 {
                d: half::f16::from_f32(0.01 + (lcg(state) % 100) as f32 * 1e-3),
                // All bits clear: every value -16, the offset at its largest.
                qh: if extreme {
                    [0; 4]
                } else {
                    (lcg(state) as u32).to_le_bytes()
                },
                qs: std::array::from_fn(|_| if extreme { 0 } else { lcg(state) as u8 }),
            })
            .collect()
    }

    /// Q8_0 quantization's range, -127..=127 (see the module notes).
    fn q8_0_rows(n: usize, blocks: usize, state: &mut u64, extreme: bool) -> Vec<BlockQ8_0> {
        (0..n * blocks)
            .map(|_| BlockQ8_0 {
                d: half::f16::from_f32(0.02 + (lcg(state) % 100) as f32 * 1e-3),
                qs: std::array::from_fn(|_| {
                    if extreme {
                        -127
                    } else {
                        ((lcg(state) % 255) as i32 - 127) as i8
                    }
                }),
            })
            .collect()
    }

    /// `n` rows of `blocks` super-blocks, quantized from values in [-4, 4].
    fn q8k_rows(n: usize, blocks: usize, state: &mut u64) -> Vec<BlockQ8K> {
        let x: Vec<f32> = (0..n * blocks * QK_K)
            .map(|_| (lcg(state) % 2001) as f32 / 250.0 - 4.0)
            .collect();
        let mut ys = vec![BlockQ8K::zeroed(); n * blocks];
        for (row, xs) in ys.chunks_mut(blocks).zip(x.chunks(blocks * QK_K)) {
            crate::quantize::quantize_row_q8_k(xs, bytemuck::cast_slice_mut(row)).unwrap();
        }
        ys
    }

    /// Runs `kernel(first_token, tokens, out)` over every panel of `n`
    /// tokens and checks each output against `expected(row, token)` bit for bit.
    fn check_panels(
        what: &str,
        rows: usize,
        n: usize,
        expected: impl Fn(usize, usize) -> f32,
        mut kernel: impl FnMut(usize, usize, &mut [f32]),
    ) {
        for first in (0..n).step_by(PANEL_TOKENS) {
            let tokens = PANEL_TOKENS.min(n - first);
            let mut got = vec![f32::NAN; rows * tokens];
            kernel(first, tokens, &mut got);
            for r in 0..rows {
                for t in 0..tokens {
                    let e = expected(r, first + t);
                    let g = got[r * tokens + t];
                    assert_eq!(
                        e.to_bits(),
                        g.to_bits(),
                        "{what}: {rows} rows x {n} tokens, row {r} token {}",
                        first + t
                    );
                }
            }
        }
    }

    #[test]
    fn q5_0_matches_the_avx2_kernel_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 VNNI/BW/VL here: nothing to compare");
            return;
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for extreme in [false, true] {
            for rows in 1..=5 {
                for n in 1..=19 {
                    let blocks = 1 + (rows * n) % 7;
                    let ws: Vec<_> = (0..rows).map(|_| q5_0_weights(blocks, &mut state, extreme)).collect();
                    let ys = q8_0_rows(n, blocks, &mut state, extreme);
                    let ws: Vec<&[BlockQ5_0]> = ws.iter().map(|w| &w[..]).collect();
                    let y_rows: Vec<&[BlockQ8_0]> = ys.chunks(blocks).collect();
                    let mut expected = vec![0.0f32; rows * n];
                    // SAFETY: `available()` covers the AVX2 kernel's features.
                    unsafe { super::super::avx2::q5_0_q8_0(&ws, &y_rows, &mut expected) };
                    let mut storage = vec![0u32; Q8_0Panels::bytes_for(n, blocks) / 4];
                    let panels = Q8_0Panels::build(&ys, n, blocks, bytemuck::cast_slice_mut(&mut storage)).unwrap();
                    check_panels(
                        "q5_0",
                        rows,
                        n,
                        |r, t| expected[r * n + t],
                        |first, tokens, out| {
                            // SAFETY: `available()` said yes.
                            unsafe { q5_0_q8_0(&ws, panels, first, tokens, out) }
                        },
                    );
                }
            }
        }
    }

    #[test]
    fn q4_k_gemm_matches_the_repacked_arithmetic_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 VNNI/BW/VL here: nothing to compare");
            return;
        }
        use crate::repack::{dot, Mode};
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for rows in 1..=6 {
            for n in [1, 3, 4, 8, 9, 16, 19] {
                let blocks = 1 + (rows + n) % 3;
                let random_block = |state: &mut u64| {
                    let mut b = BlockQ4K::zeroed();
                    b.d = half::f16::from_bits(0x1400 + (lcg(state) % 0x400) as u16);
                    b.dmin = half::f16::from_bits(0x1000 + (lcg(state) % 0x800) as u16);
                    b.scales = std::array::from_fn(|_| lcg(state) as u8);
                    b.qs = std::array::from_fn(|_| lcg(state) as u8);
                    b
                };
                let ws: Vec<Vec<BlockQ4K>> = (0..rows)
                    .map(|_| (0..blocks).map(|_| random_block(&mut state)).collect())
                    .collect();
                let ys = q8k_rows(n, blocks, &mut state);
                let w_rows: Vec<&[BlockQ4K]> = ws.iter().map(|w| &w[..]).collect();
                let mut storage = vec![0u32; Q8KPanels::bytes_for(n, blocks) / 4];
                let panels = Q8KPanels::build(&ys, n, blocks, bytemuck::cast_slice_mut(&mut storage)).unwrap();
                let y = |t: usize| &ys[t * blocks..(t + 1) * blocks];
                check_panels(
                    "q4_k",
                    rows,
                    n,
                    |r, t| dot(&ws[r], y(t), Mode::Gemm),
                    |first, tokens, out| {
                        // SAFETY: `available()` said yes.
                        unsafe { q4_k_gemm(&w_rows, panels, first, tokens, out) }
                    },
                );
            }
        }
    }

    #[test]
    fn q6_k_tiled_matches_the_tiled_matmul_arithmetic_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 VNNI/BW/VL here: nothing to compare");
            return;
        }
        let mut state = 0x5851_F42D_4C95_7F2Du64;
        for rows in 1..=6 {
            for n in [1, 4, 8, 9, 16, 19] {
                let blocks = 1 + (rows + n) % 3;
                let random_block = |state: &mut u64| {
                    let mut b = BlockQ6K::zeroed();
                    b.d = half::f16::from_bits(0x1400 + (lcg(state) % 0x400) as u16);
                    b.scales = std::array::from_fn(|_| lcg(state) as i8);
                    b.ql = std::array::from_fn(|_| lcg(state) as u8);
                    b.qh = std::array::from_fn(|_| lcg(state) as u8);
                    b
                };
                let ws: Vec<Vec<BlockQ6K>> = (0..rows)
                    .map(|_| (0..blocks).map(|_| random_block(&mut state)).collect())
                    .collect();
                let ys = q8k_rows(n, blocks, &mut state);
                let w_rows: Vec<&[BlockQ6K]> = ws.iter().map(|w| &w[..]).collect();
                let mut storage = vec![0u32; Q8KPanels::bytes_for(n, blocks) / 4];
                let panels = Q8KPanels::build(&ys, n, blocks, bytemuck::cast_slice_mut(&mut storage)).unwrap();
                let y = |t: usize| &ys[t * blocks..(t + 1) * blocks];
                let expected = |r: usize, t: usize| super::super::scalar::q6_k_q8_k_tiled(&ws[r], y(t));
                check_panels("q6_k", rows, n, expected, |first, tokens, out| {
                    // SAFETY: `available()` said yes.
                    unsafe { q6_k_tiled(&w_rows, panels, first, tokens, out) }
                });
            }
        }
    }
}
