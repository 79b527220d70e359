//! AVX2 + FMA (+ F16C) dot kernels.
//!
//! Each quantized kernel repeats the arithmetic of GGML's AVX2
//! `ggml_vec_dot_*` in `ggml-cpu/arch/x86/quants.c`: the same integer lanes,
//! the same per-block `fmadd` into eight float lanes and the same horizontal
//! sums, so results match llama.cpp's bit for bit. Scalar `a += b * c`
//! accumulations are FMAs because GCC contracts them in llama.cpp's `-march`
//! builds (checked in the reference `libggml-cpu.so`). The float kernels
//! (`vec.cpp`) follow that build's AVX-512 code paths; see "Float rows".
//!
//! The quantized kernels are tiled: `R` weight rows against `T` activation
//! rows at once, so each weight block is unpacked once per `T` tokens, each
//! activation block is loaded once per `R` rows, and one-token products get
//! `R` independent FMA chains instead of one. Every output keeps its own
//! accumulators and sees the same operations in the same order as a lone
//! dot, so a tile's results equal separate dots exactly.

use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::blocks::*;

/// Most weight rows per tile when there is a single activation row (decode;
/// how many a caller passes per call is its choice, see `Kernel::decode_rows`).
const DECODE_ROWS: usize = 4;

/// Wraps a const-generic tile kernel `$tile::<R, T>([w; R], [a; T]) -> [[f32; T]; R]`
/// into the slice form `(ws, as, out)` with `out[r * as.len() + t]`, cutting
/// the operands into tiles. With several activation rows, tiles are
/// `$rows` x `$tokens`: one row x 8 tokens where unpacking a weight block
/// dominates, 2 x 4 where sharing activation loads matters more.
macro_rules! tiled {
    ($(#[$doc:meta])* $name:ident => $tile:ident($W:ty, $A:ty), prompt_tile = ($rows:literal, $tokens:literal)
     $(, needs = $needs:literal)?) => {
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("The CPU must support AVX2, FMA and F16C ([`super::has_avx2`])", $(" and ", $needs,)? ".")]
        pub unsafe fn $name(ws: &[&[$W]], ys: &[&[$A]], out: &mut [f32]) {
            const _: () = assert!(($rows == 1 && $tokens <= 8) || ($rows == 2 && $tokens <= 4));
            let n = ys.len();
            if out.len() < ws.len() * n {
                return;
            }
            let (row_tile, token_tile) = if n == 1 { (DECODE_ROWS, 1) } else { ($rows, $tokens) };
            for (rc, w_chunk) in ws.chunks(row_tile).enumerate() {
                for (tc, y_chunk) in ys.chunks(token_tile).enumerate() {
                    let (r0, t0) = (rc * row_tile, tc * token_tile);
                    macro_rules! run {
                        ($R:literal, $T:literal) => {{
                            let w: [&[$W]; $R] = std::array::from_fn(|i| w_chunk[i]);
                            let y: [&[$A]; $T] = std::array::from_fn(|i| y_chunk[i]);
                            let result = $tile::<$R, $T>(w, y);
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
                        (1, 2) => run!(1, 2),
                        (1, 3) => run!(1, 3),
                        (1, 4) => run!(1, 4),
                        (1, 5) => run!(1, 5),
                        (1, 6) => run!(1, 6),
                        (1, 7) => run!(1, 7),
                        (1, 8) => run!(1, 8),
                        (2, 2) => run!(2, 2),
                        (2, 3) => run!(2, 3),
                        (2, 4) => run!(2, 4),
                        // Chunks are at most DECODE_ROWS x 1 or $rows x $tokens.
                        _ => {}
                    }
                }
            }
        }
    };
}

/// Same slice form for the float kernels, which gain nothing from tiling.
macro_rules! per_row {
    ($(#[$doc:meta])* $name:ident => $single:ident($T:ty)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C ([`super::has_avx2`]).
        pub unsafe fn $name(ws: &[&[$T]], ys: &[&[$T]], out: &mut [f32]) {
            let n = ys.len();
            for (w, out) in ws.iter().zip(out.chunks_mut(n.max(1))) {
                for (o, y) in out.iter_mut().zip(ys) {
                    *o = $single(w, y);
                }
            }
        }
    };
}

tiled!(
    /// Q4_0 weights · Q8_0 activations.
    q4_0_q8_0 => q4_0_tile(BlockQ4_0, BlockQ8_0), prompt_tile = (1, 8)
);
tiled!(
    /// Q4_1 weights · Q8_1 activations.
    q4_1_q8_1 => q4_1_tile(BlockQ4_1, BlockQ8_1), prompt_tile = (2, 4)
);
tiled!(
    /// [`q4_1_q8_1`] with AVX-VNNI's byte dot (same results).
    q4_1_q8_1_avxvnni => q4_1_tile_avxvnni(BlockQ4_1, BlockQ8_1), prompt_tile = (2, 4), needs = "AVX-VNNI"
);
tiled!(
    /// [`q4_1_q8_1`] with AVX512-VNNI's byte dot (same results).
    q4_1_q8_1_avx512vnni => q4_1_tile_avx512vnni(BlockQ4_1, BlockQ8_1), prompt_tile = (2, 4),
    needs = "AVX512-VNNI and AVX512VL"
);
tiled!(
    /// Q5_0 weights · Q8_0 activations.
    q5_0_q8_0 => q5_0_tile(BlockQ5_0, BlockQ8_0), prompt_tile = (1, 8)
);
tiled!(
    /// [`q5_0_q8_0`] with AVX-VNNI's byte dot (same results).
    q5_0_q8_0_avxvnni => q5_0_tile_avxvnni(BlockQ5_0, BlockQ8_0), prompt_tile = (1, 8), needs = "AVX-VNNI"
);
tiled!(
    /// [`q5_0_q8_0`] with AVX512-VNNI's byte dot (same results).
    q5_0_q8_0_avx512vnni => q5_0_tile_avx512vnni(BlockQ5_0, BlockQ8_0), prompt_tile = (1, 8),
    needs = "AVX512-VNNI and AVX512VL"
);
tiled!(
    /// Q5_1 weights · Q8_1 activations.
    q5_1_q8_1 => q5_1_tile(BlockQ5_1, BlockQ8_1), prompt_tile = (1, 8)
);
tiled!(
    /// Q8_0 weights · Q8_0 activations.
    q8_0_q8_0 => q8_0_tile(BlockQ8_0, BlockQ8_0), prompt_tile = (2, 4)
);
tiled!(
    /// [`q8_0_q8_0`] with AVX-VNNI's byte dot (same results).
    q8_0_q8_0_avxvnni => q8_0_tile_avxvnni(BlockQ8_0, BlockQ8_0), prompt_tile = (2, 4), needs = "AVX-VNNI"
);
tiled!(
    /// [`q8_0_q8_0`] with AVX512-VNNI's byte dot (same results).
    q8_0_q8_0_avx512vnni => q8_0_tile_avx512vnni(BlockQ8_0, BlockQ8_0), prompt_tile = (2, 4),
    needs = "AVX512-VNNI and AVX512VL"
);
tiled!(
    /// Q4_K weights · Q8_K activations.
    q4_k_q8_k => q4_k_tile(BlockQ4K, BlockQ8K), prompt_tile = (1, 8)
);
tiled!(
    /// Q5_K weights · Q8_K activations.
    q5_k_q8_k => q5_k_tile(BlockQ5K, BlockQ8K), prompt_tile = (1, 8)
);
tiled!(
    /// Q6_K weights · Q8_K activations.
    q6_k_q8_k => q6_k_tile(BlockQ6K, BlockQ8K), prompt_tile = (1, 8)
);
per_row!(
    /// F32 · F32 (`ggml_vec_dot_f32`).
    f32_f32 => dot_f32(f32)
);
per_row!(
    /// F16 · F16 (`ggml_vec_dot_f16`).
    f16_f16 => dot_f16(f16)
);
per_row!(
    /// BF16 · BF16 (`ggml_vec_dot_bf16`).
    bf16_bf16 => dot_bf16(bf16)
);

// ---------------------------------------------------------------------------
// Helpers (GGML's names in comments where they correspond).

/// Blocks every operand has; equal for validated rows, and the bound that
/// keeps the unchecked indexing below in range either way.
#[inline]
pub(crate) fn common_len<W, A, const R: usize, const T: usize>(xs: &[&[W]; R], ys: &[&[A]; T]) -> usize {
    let n = xs.iter().fold(usize::MAX, |n, x| n.min(x.len()));
    ys.iter().fold(n, |n, y| n.min(y.len()))
}

/// Every f16 as f32, like GGML's x86 `GGML_CPU_FP16_TO_FP32`: a scale is
/// then one load, where `vcvtph2ps` on a lone scalar costs a shuffle and
/// invites false dependencies on whatever register LLVM merges into.
static F16_TO_F32: [f32; 1 << 16] = f16_table();

const fn f16_table() -> [f32; 1 << 16] {
    let mut table = [0.0f32; 1 << 16];
    let mut bits = 0;
    while bits < table.len() {
        table[bits] = f16::from_bits(bits as u16).to_f32_const();
        bits += 1;
    }
    table
}

#[inline]
pub(crate) fn fp16(h: f16) -> f32 {
    F16_TO_F32[h.to_bits() as usize]
}

/// `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_float_8(x: __m256) -> f32 {
    let mut res = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    _mm_cvtss_f32(res)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum_each<const R: usize, const T: usize>(acc: [[__m256; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum_float_8(acc[r][t]);
        }
    }
    out
}

/// `mul_sum_us8_pairs_float`: unsigned × signed bytes, summed in fours.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn mul_sum_us8_pairs_float(ax: __m256i, sy: __m256i) -> __m256 {
    let dot = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot))
}

/// The integer core of `mul_sum_us8_pairs_float` for the tiles that come in
/// VNNI forms: unsigned × signed bytes, summed in fours into i32 lanes.
///
/// `maddubs` saturates each sum of two products to i16 and `vpdpbusd` does
/// not, so they agree exactly when no pair leaves [-32768, 32767]. For every
/// byte pattern the tiles below can pass, none does: Q4_1's unsigned values
/// are at most 15 and Q5_0's `ax = |x|` at most 16 (pairs within ±4096);
/// Q8_0's `ax = |x|` is at most 128 (`sign(-128, -128)` is 0x80) and its `sy`
/// in [-128, 127], so pairs lie in [2 * 128 * -128, 2 * 128 * 127] =
/// [-32768, 32512]. The lanes, and so every float after them, are identical.
pub(crate) trait ByteDot {
    /// # Safety
    /// The CPU must have the implementor's features.
    unsafe fn sum4(ax: __m256i, sy: __m256i) -> __m256i;
}

/// GGML's AVX2 form: `maddubs`, then `madd` with ones.
pub(crate) struct Maddubs;
/// `vpdpbusd` with the VEX encoding (AVX-VNNI).
pub(crate) struct AvxVnni;
/// `vpdpbusd` with the EVEX encoding on 256 bits (AVX512-VNNI + AVX512VL).
pub(crate) struct Avx512Vnni;

impl ByteDot for Maddubs {
    #[inline(always)]
    unsafe fn sum4(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy))
    }
}

// These intrinsics and the VNNI target features need Rust 1.89 (the workspace's rust-version).
impl ByteDot for AvxVnni {
    #[inline(always)]
    unsafe fn sum4(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy)
    }
}

impl ByteDot for Avx512Vnni {
    #[inline(always)]
    unsafe fn sum4(ax: __m256i, sy: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
    }
}

/// `mul_sum_us8_pairs_float` with the integer sums of `D`.
#[inline(always)]
unsafe fn byte_dot_float<D: ByteDot>(ax: __m256i, sy: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(D::sum4(ax, sy))
}

/// Compiles the tile body `$body::<D, R, T>` once per [`ByteDot`] form, each
/// entry point with the features its form needs. The bodies are
/// `#[inline(always)]` without features of their own, so all of their code,
/// helpers included, is generated inside each entry point.
macro_rules! byte_dot_tiles {
    ($body:ident($W:ty, $A:ty) => $avx2:ident, $avxvnni:ident, $avx512vnni:ident) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $avx2<const R: usize, const T: usize>(xs: [&[$W]; R], ys: [&[$A]; T]) -> [[f32; T]; R] {
            $body::<Maddubs, R, T>(xs, ys)
        }

        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        unsafe fn $avxvnni<const R: usize, const T: usize>(xs: [&[$W]; R], ys: [&[$A]; T]) -> [[f32; T]; R] {
            $body::<AvxVnni, R, T>(xs, ys)
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
        unsafe fn $avx512vnni<const R: usize, const T: usize>(xs: [&[$W]; R], ys: [&[$A]; T]) -> [[f32; T]; R] {
            $body::<Avx512Vnni, R, T>(xs, ys)
        }
    };
}

/// `bytes_from_nibbles_32`: 16 bytes → 32 values, low nibbles first.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes_from_nibbles_32(qs: &[u8; 16]) -> __m256i {
    let tmp = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
    let bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(_mm256_set1_epi8(0x0F), bytes)
}

/// `bytes_from_bits_32`: bit `j` of `qh` → byte `j` = 0xFF or 0x00.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes_from_bits_32(qh: [u8; 4]) -> __m256i {
    let x32 = u32::from_le_bytes(qh) as i32;
    let shuf_mask = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x32), shuf_mask);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn load_256(bytes: *const i8) -> __m256i {
    _mm256_loadu_si256(bytes as *const __m256i)
}

// ---------------------------------------------------------------------------
// Legacy 32-value blocks.

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_tile<const R: usize, const T: usize>(xs: [&[BlockQ4_0]; R], ys: [&[BlockQ8_0]; T]) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let offset = _mm256_set1_epi8(8);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for ib in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            // [0, 15] -> [-8, 7]; the sign trick turns signed x signed into
            // maddubs' unsigned x signed form.
            let qx = _mm256_sub_epi8(bytes_from_nibbles_32(&xb.qs), offset);
            let ax = _mm256_sign_epi8(qx, qx);
            let dx = _mm256_set1_ps(fp16(xb.d));
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                // dx * dy in every lane: the product GGML broadcasts.
                let d = _mm256_mul_ps(dx, _mm256_set1_ps(fp16(yb.d)));
                let q = mul_sum_us8_pairs_float(ax, _mm256_sign_epi8(load_256(yb.qs.as_ptr()), qx));
                acc[r][t] = _mm256_fmadd_ps(d, q, acc[r][t]);
            }
        }
    }
    hsum_each(acc)
}

byte_dot_tiles!(q4_1_body(BlockQ4_1, BlockQ8_1) => q4_1_tile, q4_1_tile_avxvnni, q4_1_tile_avx512vnni);

#[inline(always)]
unsafe fn q4_1_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ4_1]; R],
    ys: [&[BlockQ8_1]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // The offset terms m * s, summed apart from the lanes as GGML does.
    let mut summs = [[0.0f32; T]; R];
    for ib in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let d0 = _mm256_set1_ps(fp16(xb.d));
            let m = fp16(xb.m);
            let qx = bytes_from_nibbles_32(&xb.qs);
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                summs[r][t] = m.mul_add(fp16(yb.s), summs[r][t]);
                let d0d1 = _mm256_mul_ps(d0, _mm256_set1_ps(fp16(yb.d)));
                let xy = byte_dot_float::<D>(qx, load_256(yb.qs.as_ptr()));
                acc[r][t] = _mm256_fmadd_ps(d0d1, xy, acc[r][t]);
            }
        }
    }
    add_scalars(hsum_each(acc), summs)
}

byte_dot_tiles!(q5_0_body(BlockQ5_0, BlockQ8_0) => q5_0_tile, q5_0_tile_avxvnni, q5_0_tile_avx512vnni);

#[inline(always)]
unsafe fn q5_0_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ5_0]; R],
    ys: [&[BlockQ8_0]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for ib in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            // A clear 5th bit means value - 16 < 0: OR-ing 0xF0 into the
            // nibble is exactly that subtraction in two's complement.
            let high = _mm256_andnot_si256(bytes_from_bits_32(xb.qh), _mm256_set1_epi8(0xF0u8 as i8));
            let qx = _mm256_or_si256(bytes_from_nibbles_32(&xb.qs), high);
            let ax = _mm256_sign_epi8(qx, qx);
            let dx = _mm256_set1_ps(fp16(xb.d));
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                // dx * dy in every lane: the product GGML broadcasts.
                let d = _mm256_mul_ps(dx, _mm256_set1_ps(fp16(yb.d)));
                let q = byte_dot_float::<D>(ax, _mm256_sign_epi8(load_256(yb.qs.as_ptr()), qx));
                acc[r][t] = _mm256_fmadd_ps(d, q, acc[r][t]);
            }
        }
    }
    hsum_each(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1_tile<const R: usize, const T: usize>(xs: [&[BlockQ5_1]; R], ys: [&[BlockQ8_1]; T]) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = [[0.0f32; T]; R];
    for ib in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let dx = _mm256_set1_ps(fp16(xb.d));
            let m = fp16(xb.m);
            let high = _mm256_and_si256(bytes_from_bits_32(xb.qh), _mm256_set1_epi8(0x10));
            let qx = _mm256_or_si256(bytes_from_nibbles_32(&xb.qs), high);
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                summs[r][t] = m.mul_add(fp16(yb.s), summs[r][t]);
                let q = mul_sum_us8_pairs_float(qx, load_256(yb.qs.as_ptr()));
                acc[r][t] = _mm256_fmadd_ps(q, _mm256_mul_ps(dx, _mm256_set1_ps(fp16(yb.d))), acc[r][t]);
            }
        }
    }
    add_scalars(hsum_each(acc), summs)
}

byte_dot_tiles!(q8_0_body(BlockQ8_0, BlockQ8_0) => q8_0_tile, q8_0_tile_avxvnni, q8_0_tile_avx512vnni);

#[inline(always)]
unsafe fn q8_0_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ8_0]; R],
    ys: [&[BlockQ8_0]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for ib in 0..nb {
        // Nothing to unpack here, so the activation scales are worth
        // converting once for all rows of the tile.
        let mut dy = [0.0f32; T];
        for t in 0..T {
            dy[t] = fp16(ys[t].get_unchecked(ib).d);
        }
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let qx = load_256(xb.qs.as_ptr());
            let ax = _mm256_sign_epi8(qx, qx);
            let dx = fp16(xb.d);
            for t in 0..T {
                let qy = load_256(ys[t].get_unchecked(ib).qs.as_ptr());
                let q = byte_dot_float::<D>(ax, _mm256_sign_epi8(qy, qx));
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy[t]), q, acc[r][t]);
            }
        }
    }
    hsum_each(acc)
}

/// Lane sums plus the separately kept scalar terms, as GGML's final `+ summs`.
#[inline]
fn add_scalars<const R: usize, const T: usize>(mut sums: [[f32; T]; R], extra: [[f32; T]; R]) -> [[f32; T]; R] {
    for r in 0..R {
        for t in 0..T {
            sums[r][t] += extra[r][t];
        }
    }
    sums
}

// ---------------------------------------------------------------------------
// K super-blocks.

/// The eight 6-bit scales (low 128 bits) and mins (high 128 bits) of a
/// Q4_K/Q5_K block as 16-bit lanes, via GGML's 32-bit mask unpacking.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn k4_scales_and_mins(scales: &[u8; 12]) -> __m256i {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let [u0, u1, u2]: [u32; 3] = bytemuck::cast(*scales);
    let mins_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let mins_lo = u1 & KMASK1;
    let scales_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let scales_lo = u0 & KMASK1;
    _mm256_cvtepu8_epi16(_mm_set_epi32(
        mins_hi as i32,
        mins_lo as i32,
        scales_hi as i32,
        scales_lo as i32,
    ))
}

/// Sums of adjacent pairs of Q8_K's 16 `bsums`: one per 32-value sub-block.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn q8k_sub_block_sums(yb: &BlockQ8K) -> __m128i {
    let q8sums = _mm256_loadu_si256(yb.bsums.as_ptr() as *const __m256i);
    _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1))
}

/// `get_scale_shuffle_k4(i)`: broadcasts 16-bit scale `i` of a
/// lane-duplicated scale vector.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn k4_scale(scales: __m256i, i: usize) -> __m256i {
    let pick = (((2 * i + 1) << 8) | (2 * i)) as i16;
    _mm256_shuffle_epi8(scales, _mm256_set1_epi16(pick))
}

/// What a Q4_K/Q5_K tile needs per weight block besides its quants.
struct K4Block {
    d: f32,
    dmin: f32,
    mins: __m128i,
    /// The eight scales as 16-bit lanes, in both 128-bit halves.
    scales: __m256i,
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k4_block(d: f16, dmin: f16, scales: &[u8; 12]) -> K4Block {
    let mins_and_scales = k4_scales_and_mins(scales);
    K4Block {
        d: fp16(d),
        dmin: fp16(dmin),
        mins: _mm256_extracti128_si256(mins_and_scales, 1),
        scales: _mm256_broadcastsi128_si256(_mm256_extracti128_si256(mins_and_scales, 0)),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tile<const R: usize, const T: usize>(xs: [&[BlockQ4K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut acc_m = [[_mm_setzero_ps(); T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let k = k4_block(xb.d, xb.dmin, &xb.scales);
            let mut sumi = [_mm256_setzero_si256(); T];
            for j in 0..QK_K / 64 {
                let scale_l = k4_scale(k.scales, 2 * j);
                let scale_h = k4_scale(k.scales, 2 * j + 1);
                let q4bits = _mm256_loadu_si256(xb.qs.as_ptr().add(32 * j) as *const __m256i);
                let q4l = _mm256_and_si256(q4bits, m4);
                let q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                for t in 0..T {
                    let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(64 * j);
                    let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, load_256(q8)));
                    let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, load_256(q8.add(32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16l, p16h));
                }
            }
            for t in 0..T {
                let yb = ys[t].get_unchecked(i);
                let d = yb.d * k.d;
                let dmin = -yb.d * k.dmin;
                let prod = _mm_madd_epi16(k.mins, q8k_sub_block_sums(yb));
                acc_m[r][t] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r][t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[r][t]);
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut m = _mm_add_ps(acc_m[r][t], _mm_movehl_ps(acc_m[r][t], acc_m[r][t]));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            out[r][t] = hsum_float_8(acc[r][t]) + _mm_cvtss_f32(m);
        }
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_tile<const R: usize, const T: usize>(xs: [&[BlockQ5K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let m4 = _mm256_set1_epi8(0x0F);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = [[0.0f32; T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let k = k4_block(xb.d, xb.dmin, &xb.scales);
            let hbits = _mm256_loadu_si256(xb.qh.as_ptr() as *const __m256i);
            let mut sumi = [_mm256_setzero_si256(); T];
            for j in 0..QK_K / 64 {
                let scale_0 = k4_scale(k.scales, 2 * j);
                let scale_1 = k4_scale(k.scales, 2 * j + 1);
                let q5bits = _mm256_loadu_si256(xb.qs.as_ptr().add(32 * j) as *const __m256i);
                // Bits 2j and 2j+1 of each qh byte are the 5th bits of the two halves.
                let mask_0 = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                let mask_1 = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                let high_0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, mask_0), mask_0), sixteen);
                let high_1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, mask_1), mask_1), sixteen);
                let q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), high_0);
                let q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), high_1);
                for t in 0..T {
                    let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(64 * j);
                    let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, load_256(q8)));
                    let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, load_256(q8.add(32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16_0, p16_1));
                }
            }
            for t in 0..T {
                let yb = ys[t].get_unchecked(i);
                let d = yb.d * k.d;
                let dmin = -yb.d * k.dmin;
                let prod = _mm_madd_epi16(k.mins, q8k_sub_block_sums(yb));
                let zero = _mm_setzero_si128();
                let hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, zero), zero);
                summs[r][t] = dmin.mul_add(_mm_cvtsi128_si32(hsum) as f32, summs[r][t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[r][t]);
            }
        }
    }
    add_scalars(hsum_each(acc), summs)
}

/// `get_scale_shuffle(i)`: bytes picking Q6_K scales 2i (x8) and 2i+1 (x8).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q6_scale_pick(i: usize) -> __m128i {
    const ONES: i64 = 0x0101010101010101;
    _mm_set_epi64x((2 * i as i64 + 1) * ONES, (2 * i as i64) * ONES)
}

/// Integer part of one Q6_K block against `T` Q8_K blocks, as GGML's AVX2
/// kernels compute it: per token, eight int32 lanes of `scale * (q - 32) * y`.
/// Exact, so the vec-dot and tiled kernels share it whatever they do next.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q6_k_block_sums<const T: usize>(xb: &BlockQ6K, ys: &[&[BlockQ8K]; T], i: usize) -> [__m256i; T] {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let scales = _mm_loadu_si128(xb.scales.as_ptr() as *const __m128i);
    let mut sumi = [_mm256_setzero_si256(); T];
    for j in 0..QK_K / 128 {
        let q4bits1 = _mm256_loadu_si256(xb.ql.as_ptr().add(64 * j) as *const __m256i);
        let q4bits2 = _mm256_loadu_si256(xb.ql.as_ptr().add(64 * j + 32) as *const __m256i);
        let q4bits_h = _mm256_loadu_si256(xb.qh.as_ptr().add(32 * j) as *const __m256i);
        let q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bits_h, m3), 4);
        let q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bits_h, _mm256_set1_epi8(12)), 2);
        let q4h_2 = _mm256_and_si256(q4bits_h, _mm256_set1_epi8(48));
        let q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bits_h, _mm256_set1_epi8(-64)), 2);
        // Unsigned 6-bit values; the -32 offset is applied once per block below.
        let q = [
            _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0),
            _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3),
        ];
        let mut scale = [_mm256_setzero_si256(); 4];
        for (k, s) in scale.iter_mut().enumerate() {
            *s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, q6_scale_pick(4 * j + k)));
        }
        for t in 0..T {
            let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(128 * j);
            let mut p16 = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let prod = _mm256_maddubs_epi16(q[k], load_256(q8.add(32 * k)));
                p16[k] = _mm256_madd_epi16(scale[k], prod);
            }
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16[0], p16[1]));
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16[2], p16[3]));
        }
    }
    let scales_16 = _mm256_cvtepi8_epi16(scales);
    for t in 0..T {
        // 32 * sum(scale * bsum): the -32 offset of every value at once.
        let q8sums = _mm256_loadu_si256(ys[t].get_unchecked(i).bsums.as_ptr() as *const __m256i);
        let q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
        sumi[t] = _mm256_sub_epi32(sumi[t], q8sclsub);
    }
    sumi
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_tile<const R: usize, const T: usize>(xs: [&[BlockQ6K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let xd = fp16(xb.d);
            let sums = q6_k_block_sums(xb, &ys, i);
            for t in 0..T {
                let d = ys[t].get_unchecked(i).d * xd;
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums[t]), acc[r][t]);
            }
        }
    }
    hsum_each(acc)
}

// ---------------------------------------------------------------------------
// Float rows.
//
// These follow the reference llama.cpp build (`GGML_NATIVE` on an AVX-512
// machine), whose float dots keep 16-lane accumulators: each is emulated
// here as two 8-lane halves, which is exact since every operation is per
// lane. The quantized kernels above are the same in AVX2 and AVX-512 builds.

/// A 16-lane f32 vector as two AVX halves: lanes 0..8 and 8..16.
#[derive(Clone, Copy)]
struct F32x16 {
    lo: __m256,
    hi: __m256,
}

impl F32x16 {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn zero() -> Self {
        Self {
            lo: _mm256_setzero_ps(),
            hi: _mm256_setzero_ps(),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add(self, other: Self) -> Self {
        Self {
            lo: _mm256_add_ps(self.lo, other.lo),
            hi: _mm256_add_ps(self.hi, other.hi),
        }
    }

    /// `_mm512_reduce_add_ps` as GCC expands it: halves, quarters, then
    /// pairs, which is `hsum_float_8` of the sum of the halves.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_add(self) -> f32 {
        hsum_float_8(_mm256_add_ps(self.hi, self.lo))
    }
}

/// `GGML_F32x16_REDUCE` of GGML's four accumulators: (0+2) + (1+3), reduced.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce_4x16(sum: [F32x16; 4]) -> f32 {
    sum[0].add(sum[2]).add(sum[1].add(sum[3])).reduce_add()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16x8(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// `ggml_vec_dot_f32`: four 16-lane FMA accumulators over steps of 64.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !63;
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut sum = [F32x16::zero(); 4];
    for i in (0..np).step_by(64) {
        for (j, s) in sum.iter_mut().enumerate() {
            let p = i + 16 * j;
            s.lo = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(p)), _mm256_loadu_ps(yp.add(p)), s.lo);
            s.hi = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(p + 8)), _mm256_loadu_ps(yp.add(p + 8)), s.hi);
        }
    }
    let mut sumf = reduce_4x16(sum);
    // The tail `sumf += x[i] * y[i]`, as GCC compiled it in the reference
    // build: runs of 16, then one of 8, have their products rounded before
    // the in-order adds (vectorized multiplies); the last few are fused.
    let mut i = np;
    let unfused = (n - np) / 16 * 16 + if (n - np) % 16 >= 8 { 8 } else { 0 };
    while i < np + unfused {
        sumf += x.get_unchecked(i) * y.get_unchecked(i);
        i += 1;
    }
    while i < n {
        sumf = x.get_unchecked(i).mul_add(*y.get_unchecked(i), sumf);
        i += 1;
    }
    sumf
}

/// `ggml_vec_dot_f16`: as the f32 dot on converted halves, with the reduced
/// sum and the tail accumulated in f64.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !63;
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut sum = [F32x16::zero(); 4];
    for i in (0..np).step_by(64) {
        for (j, s) in sum.iter_mut().enumerate() {
            let p = i + 16 * j;
            s.lo = _mm256_fmadd_ps(load_f16x8(xp.add(p)), load_f16x8(yp.add(p)), s.lo);
            s.hi = _mm256_fmadd_ps(load_f16x8(xp.add(p + 8)), load_f16x8(yp.add(p + 8)), s.hi);
        }
    }
    let mut sumf = reduce_4x16(sum) as f64;
    for i in np..n {
        sumf += (fp16(*x.get_unchecked(i)) * fp16(*y.get_unchecked(i))) as f64;
    }
    sumf as f32
}

/// One `vdpbf16ps` step on 8 lanes: each lane takes the pair of bf16 values
/// in its 32 bits, adding the odd (high) product and then the even one, each
/// add rounded (checked on the reference CPU). bf16 x bf16 products are exact
/// in f32. Denormals, which the instruction flushes, are not.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dpbf16_8(acc: __m256, x: *const bf16, y: *const bf16) -> __m256 {
    let xw = _mm256_loadu_si256(x as *const __m256i);
    let yw = _mm256_loadu_si256(y as *const __m256i);
    let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let x_odd = _mm256_castsi256_ps(_mm256_and_si256(xw, high));
    let y_odd = _mm256_castsi256_ps(_mm256_and_si256(yw, high));
    let x_even = _mm256_castsi256_ps(_mm256_slli_epi32(xw, 16));
    let y_even = _mm256_castsi256_ps(_mm256_slli_epi32(yw, 16));
    let acc = _mm256_add_ps(acc, _mm256_mul_ps(x_odd, y_odd));
    _mm256_add_ps(acc, _mm256_mul_ps(x_even, y_even))
}

/// `ggml_vec_dot_bf16` on AVX512-BF16: two 16-lane `vdpbf16ps` accumulators
/// over steps of 64, reduced into an f64 sum that also takes the tail.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16(x: &[bf16], y: &[bf16]) -> f32 {
    let n = x.len().min(y.len());
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut c1 = F32x16::zero();
    let mut c2 = F32x16::zero();
    let mut i = 0;
    while i + 64 <= n {
        c1.lo = dpbf16_8(c1.lo, xp.add(i), yp.add(i));
        c1.hi = dpbf16_8(c1.hi, xp.add(i + 16), yp.add(i + 16));
        c2.lo = dpbf16_8(c2.lo, xp.add(i + 32), yp.add(i + 32));
        c2.hi = dpbf16_8(c2.hi, xp.add(i + 48), yp.add(i + 48));
        i += 64;
    }
    let mut sumf = 0.0f64;
    sumf += c1.reduce_add() as f64;
    sumf += c2.reduce_add() as f64;
    for k in i..n {
        sumf += (x.get_unchecked(k).to_f32() * y.get_unchecked(k).to_f32()) as f64;
    }
    sumf as f32
}

// ---------------------------------------------------------------------------
// llama.cpp's tiled K-quant matmul (see `scalar::q6_k_q8_k_tiled`): the
// integer sums of the vec-dot kernels above, reduced per super-block to one
// exact i32 per output, then scaled and accumulated in f32 with activation
// rows in the eight lanes.

tiled!(
    /// Q6_K weights · Q8_K activations, the tiled matmul's way.
    q6_k_q8_k_tiled => q6_k_tiled_tile(BlockQ6K, BlockQ8K), prompt_tile = (1, 8)
);
tiled!(
    /// Q4_K weights · Q8_K activations, the tiled matmul's way.
    q4_k_q8_k_tiled => q4_k_tiled_tile(BlockQ4K, BlockQ8K), prompt_tile = (1, 8)
);
tiled!(
    /// Q5_K weights · Q8_K activations, the tiled matmul's way.
    q5_k_q8_k_tiled => q5_k_tiled_tile(BlockQ5K, BlockQ8K), prompt_tile = (1, 8)
);

/// Lane `t` = the sum of `v[t]`'s eight i32 lanes (exact: integer adds).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_epi32_x8(v: [__m256i; 8]) -> __m256i {
    let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256(h0123, h4567, 0x20),
        _mm256_permute2x128_si256(h0123, h4567, 0x31),
    )
}

/// The activation scales of block `i` of each row, one lane per row (0 past `T`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8k_scales<const T: usize>(ys: &[&[BlockQ8K]; T], i: usize) -> __m256 {
    let mut d = [0.0f32; 8];
    for t in 0..T {
        d[t] = ys[t].get_unchecked(i).d;
    }
    _mm256_loadu_ps(d.as_ptr())
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes_out<const R: usize, const T: usize>(acc: [__m256; R]) -> [[f32; T]; R] {
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]);
        out[r].copy_from_slice(&lanes[..T]);
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_tiled_tile<const R: usize, const T: usize>(xs: [&[BlockQ6K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    const { assert!(T <= 8) };
    let nb = common_len(&xs, &ys);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..nb {
        let yd = q8k_scales(&ys, i);
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let mut sumi = [_mm256_setzero_si256(); 8];
            sumi[..T].copy_from_slice(&q6_k_block_sums(xb, &ys, i));
            let block = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum_epi32_x8(sumi)), _mm256_set1_ps(fp16(xb.d)));
            acc[r] = _mm256_fmadd_ps(block, yd, acc[r]);
        }
    }
    lanes_out(acc)
}

/// Q4_K/Q5_K tail of a tiled block: `sumi[t]` holds `sc * q * y` sums in
/// lanes; scales into `acc`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k4_tiled_block<const T: usize>(
    k: &K4Block,
    sumi: [__m256i; 8],
    ys: &[&[BlockQ8K]; T],
    i: usize,
    yd: __m256,
    acc: __m256,
) -> __m256 {
    let mut mins = [_mm256_setzero_si256(); 8];
    for t in 0..T {
        let prod = _mm_madd_epi16(k.mins, q8k_sub_block_sums(ys[t].get_unchecked(i)));
        mins[t] = _mm256_zextsi128_si256(prod);
    }
    let s1 = _mm256_cvtepi32_ps(hsum_epi32_x8(sumi));
    let s2 = _mm256_cvtepi32_ps(hsum_epi32_x8(mins));
    let block = _mm256_fnmadd_ps(_mm256_set1_ps(k.dmin), s2, _mm256_mul_ps(s1, _mm256_set1_ps(k.d)));
    _mm256_fmadd_ps(block, yd, acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tiled_tile<const R: usize, const T: usize>(xs: [&[BlockQ4K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    const { assert!(T <= 8) };
    let nb = common_len(&xs, &ys);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..nb {
        let yd = q8k_scales(&ys, i);
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let k = k4_block(xb.d, xb.dmin, &xb.scales);
            let mut sumi = [_mm256_setzero_si256(); 8];
            for j in 0..QK_K / 64 {
                let scale_l = k4_scale(k.scales, 2 * j);
                let scale_h = k4_scale(k.scales, 2 * j + 1);
                let q4bits = _mm256_loadu_si256(xb.qs.as_ptr().add(32 * j) as *const __m256i);
                let q4l = _mm256_and_si256(q4bits, m4);
                let q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
                for t in 0..T {
                    let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(64 * j);
                    let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, load_256(q8)));
                    let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, load_256(q8.add(32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16l, p16h));
                }
            }
            acc[r] = k4_tiled_block(&k, sumi, &ys, i, yd, acc[r]);
        }
    }
    lanes_out(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_tiled_tile<const R: usize, const T: usize>(xs: [&[BlockQ5K]; R], ys: [&[BlockQ8K]; T]) -> [[f32; T]; R] {
    const { assert!(T <= 8) };
    let nb = common_len(&xs, &ys);
    let m4 = _mm256_set1_epi8(0x0F);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = [_mm256_setzero_ps(); R];
    for i in 0..nb {
        let yd = q8k_scales(&ys, i);
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let k = k4_block(xb.d, xb.dmin, &xb.scales);
            let hbits = _mm256_loadu_si256(xb.qh.as_ptr() as *const __m256i);
            let mut sumi = [_mm256_setzero_si256(); 8];
            for j in 0..QK_K / 64 {
                let scale_0 = k4_scale(k.scales, 2 * j);
                let scale_1 = k4_scale(k.scales, 2 * j + 1);
                let q5bits = _mm256_loadu_si256(xb.qs.as_ptr().add(32 * j) as *const __m256i);
                // Bits 2j and 2j+1 of each qh byte are the 5th bits of the two halves.
                let mask_0 = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
                let mask_1 = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
                let high_0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, mask_0), mask_0), sixteen);
                let high_1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, mask_1), mask_1), sixteen);
                let q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), high_0);
                let q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), high_1);
                for t in 0..T {
                    let q8 = ys[t].get_unchecked(i).qs.as_ptr().add(64 * j);
                    let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, load_256(q8)));
                    let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, load_256(q8.add(32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16_0, p16_1));
                }
            }
            acc[r] = k4_tiled_block(&k, sumi, &ys, i, yd, acc[r]);
        }
    }
    lanes_out(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte patterns at the edges of `maddubs`' range, plus random ones.
    fn fill(bytes: &mut [u8], state: &mut u64) {
        let mut next = || {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state
        };
        let mode = next() % 6;
        for b in bytes.iter_mut() {
            let r = next() as u8;
            *b = match mode {
                0 => 0x80,
                1 => 0x7F,
                2 => 0x81,
                3 => [0x80, 0x7F, 0x81, 0xFF, 0x00, 0x01][(r % 6) as usize],
                _ => r,
            };
        }
    }

    fn random_blocks<B: bytemuck::Pod>(count: usize, scale_offsets: &[usize], state: &mut u64) -> Vec<B> {
        let mut blocks = vec![B::zeroed(); count];
        let scales = [1.0f32, -0.5, 0.0123, 65504.0, 6.0e-8, -3.0e-3];
        for block in blocks.iter_mut() {
            let bytes = bytemuck::bytes_of_mut(block);
            fill(bytes, state);
            for &offset in scale_offsets {
                *state ^= *state << 13;
                *state ^= *state >> 7;
                *state ^= *state << 17;
                let d = f16::from_f32(scales[(*state % scales.len() as u64) as usize]);
                bytes[offset..offset + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        blocks
    }

    /// Runs `kernels` (AVX2 first) on every row and token count a tile can
    /// see, with rows of 7 blocks, and checks their outputs agree bit for bit.
    fn check<W: bytemuck::Pod, A: bytemuck::Pod>(
        kernels: [(&str, bool, super::super::TileFn<W, A>); 3],
        w_scales: &[usize],
        a_scales: &[usize],
    ) {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for rows in 1..=5 {
            for tokens in 1..=9 {
                let ws: Vec<Vec<W>> = (0..rows).map(|_| random_blocks(7, w_scales, &mut state)).collect();
                let ys: Vec<Vec<A>> = (0..tokens).map(|_| random_blocks(7, a_scales, &mut state)).collect();
                let ws: Vec<&[W]> = ws.iter().map(|w| &w[..]).collect();
                let ys: Vec<&[A]> = ys.iter().map(|y| &y[..]).collect();
                let mut expected = vec![0.0f32; rows * tokens];
                // SAFETY: the tests run only where the detection said yes.
                unsafe { (kernels[0].2)(&ws, &ys, &mut expected) };
                for &(name, available, kernel) in &kernels[1..] {
                    if !available {
                        eprintln!("{name}: not on this CPU, not checked");
                        continue;
                    }
                    let mut got = vec![f32::NAN; rows * tokens];
                    unsafe { kernel(&ws, &ys, &mut got) };
                    for (i, (e, g)) in expected.iter().zip(&got).enumerate() {
                        assert_eq!(
                            e.to_bits(),
                            g.to_bits(),
                            "{name}, {rows}x{tokens}, output {i}: {e} vs {g}"
                        );
                    }
                }
            }
        }
    }

    fn features() -> Option<(bool, bool)> {
        if !super::super::has_avx2() {
            return None;
        }
        let avx = is_x86_feature_detected!("avxvnni");
        let avx512 = is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
        Some((avx, avx512))
    }

    #[test]
    fn vnni_tiles_match_avx2() {
        let Some((avx, avx512)) = features() else {
            eprintln!("no AVX2: nothing to compare");
            return;
        };
        check::<BlockQ5_0, BlockQ8_0>(
            [
                ("q5_0 avx2", true, q5_0_q8_0),
                ("q5_0 avxvnni", avx, q5_0_q8_0_avxvnni),
                ("q5_0 avx512vnni", avx512, q5_0_q8_0_avx512vnni),
            ],
            &[0],
            &[0],
        );
        check::<BlockQ8_0, BlockQ8_0>(
            [
                ("q8_0 avx2", true, q8_0_q8_0),
                ("q8_0 avxvnni", avx, q8_0_q8_0_avxvnni),
                ("q8_0 avx512vnni", avx512, q8_0_q8_0_avx512vnni),
            ],
            &[0],
            &[0],
        );
        check::<BlockQ4_1, BlockQ8_1>(
            [
                ("q4_1 avx2", true, q4_1_q8_1),
                ("q4_1 avxvnni", avx, q4_1_q8_1_avxvnni),
                ("q4_1 avx512vnni", avx512, q4_1_q8_1_avx512vnni),
            ],
            &[0, 2],
            &[0, 2],
        );
    }
}
