//! NEON dot kernels (aarch64).
//!
//! Each quantized kernel repeats, for one (weight row, activation row) pair,
//! the arithmetic of GGML's NEON `ggml_vec_dot_*` in
//! `ggml-cpu/arch/arm/quants.c` (the `__ARM_NEON` branches: no SVE, and the
//! `nrc == 1` form llama.cpp's matmul takes without i8mm) as GCC 12 compiles
//! it (`-O3`, GNU C, so `-ffp-contract=fast`), checked against that object
//! code run under qemu. The float order is GGML's NEON code, not the scalar
//! twins' (`scalar.rs`, GGML's generic C), so the two agree to rounding only
//! (the tests hold them to a bound). In detail:
//!
//! * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: two four-lane accumulators, one for even
//!   and one for odd blocks; per block `acc + f32(p) * (dx * dy)` with `p` the
//!   four i32 lanes of the byte dot. `vmlaq_n_f32` is a multiply and a
//!   separate add in GCC's `arm_neon.h` (`float_mla_n`), not an FMA. Then
//!   `vaddvq(acc0) + vaddvq(acc1)` (pairwise: `(l0 + l1) + (l2 + l3)`), the
//!   `_1` formats' scalar offset sums `m * s`, and the last block of an odd
//!   count in GGML's scalar tail, whose `a += b * c` GCC fuses.
//! * Q4_K, Q5_K, Q6_K: exact integer sums per super-block, then one scalar
//!   float accumulator with GGML's (fused where GCC fuses) updates.
//! * F32, F16: four four-lane FMA accumulators over steps of 16 values,
//!   reduced `(0 + 2) + (1 + 3)` then pairwise, the tail in order (F16 in
//!   f64; F32 partly vectorized by GCC, see [`f32_f32`]).
//!
//! # The byte dot: which llama.cpp build each form matches
//!
//! GGML's `ggml_vdotq_s32` is `vdotq_s32` (`sdot`) in a build with
//! `__ARM_FEATURE_DOTPROD`, else an emulation with widening multiplies and
//! pairwise adds. Their lanes hold different bytes (`sdot`: `4i..4i + 4`;
//! the emulation: `2i, 2i + 1, 8 + 2i, 9 + 2i`), and the 32-value formats
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) convert and scale the four lanes
//! separately, so the two llama.cpp builds round those formats differently.
//! Each form here takes its own build's lanes ([`ByteDot`]):
//!
//! * the plain form (any aarch64 CPU) computes the emulation's, so it gives
//!   the bits of llama.cpp built without dotprod (`-march=armv8-a`, its
//!   portable aarch64 build and the reference of `data/golden/aarch64/`);
//! * the `sdot` form (CPUs with FEAT_DotProd, chosen at run time) uses
//!   `sdot`'s own lanes, so it gives the bits of the `ggml_vec_dot_*` of
//!   llama.cpp built with dotprod (`-march=armv8.2-a+dotprod`,
//!   `data/golden/aarch64/vec_dot_dotprod.jsonl`).
//!
//! The K formats, F16 and F32 do not depend on lanes: both forms give the
//! same results, those of either build.
//!
//! A llama.cpp built with dotprod does not compute every product with its
//! vec-dots, though: it repacks Q4_0 (`q4_0_4x4`), Q8_0 (`q8_0_4x4`) and
//! Q4_K/Q5_K/Q6_K (`*_8x4`; with i8mm the 8x8 forms and the `nrc == 2`
//! vec-dots, `ggml-cpu/arch/arm/repack.cpp`) into interleaved layouts whose
//! gemv/gemm round otherwise again (per block, one update by the block's
//! whole integer sum). Those are not emulated, so on a dotprod CPU a model's
//! results equal that build's only where it takes the vec-dots (Q4_1, Q5_0,
//! Q5_1, and whatever it does not repack). Nor is F16 with
//! `__ARM_FEATURE_FP16_VECTOR_ARITHMETIC` emulated (a native build on a core
//! with FP16 arithmetic), which accumulates in half precision: F16 follows
//! the f32-accumulating branch.
//!
//! The tiling is `avx2.rs`'s: `R` weight rows against `T` activation rows,
//! each output with its own accumulators and exactly the operations of a
//! lone pair, so a tile's results equal separate dots bit for bit.
//!
//! With one activation row (decode, where a token spends its time) the
//! bodies take paths of their own ([`decode_pairs`], [`q4_k_decode`],
//! [`q6_k_decode`]), with the same operations per output: each row's blocks
//! read in order through post-indexed loads, the scales of up to four rows
//! converted in one vector, their integer sums reduced and their float
//! updates made together (lane `r`), and in the `sdot` form the loads,
//! unpacking and dots of a row's block written out as `asm!`: from the
//! intrinsics LLVM hoists every row's loads and spills, or makes each load an
//! offset from a shared index (an add per row and block). The shapes were
//! chosen by guest instructions under qemu (`matvec_workload` in
//! `tests/neon_vec_dot_golden.rs`).

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;

use crate::blocks::*;

/// Wraps a const-generic tile kernel `$tile::<R, T>([w; R], [a; T]) -> [[f32; T]; R]`
/// into the slice form `(ws, as, out)` with `out[r * as.len() + t]`, cutting
/// the operands into tiles. One activation row (decode): tiles of 4 rows
/// (8 spill registers), the rest in tiles of 2 and 1 (how many rows a caller
/// passes per call is its choice, see `Kernel::decode_rows`).
/// Several: `$rows` x `$tokens` (1 x 8 or 2 x 4, whichever took fewer guest
/// instructions per output under qemu in a 16-token matmul).
macro_rules! tiled {
    ($(#[$doc:meta])* $name:ident => $tile:ident($W:ty, $A:ty),
     prompt_tile = ($rows:literal, $tokens:literal) $(, needs = $needs:literal)?) => {
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("NEON is part of aarch64", $("; the CPU must also have ", $needs,)? ".")]
        pub unsafe fn $name(ws: &[&[$W]], ys: &[&[$A]], out: &mut [f32]) {
            const _: () = assert!(($rows == 1 && $tokens <= 8) || ($rows == 2 && $tokens <= 4));
            let n = ys.len();
            if out.len() < ws.len() * n {
                return;
            }
            if n == 1 {
                let y = [ys[0]];
                let mut r0 = 0;
                while r0 < ws.len() {
                    macro_rules! rows {
                        ($R:literal) => {{
                            let w: [&[$W]; $R] = std::array::from_fn(|i| *ws.get_unchecked(r0 + i));
                            let result = $tile::<$R, 1>(w, y);
                            for (o, r) in out[r0..r0 + $R].iter_mut().zip(result) {
                                *o = r[0];
                            }
                            $R
                        }};
                    }
                    r0 += match ws.len() - r0 {
                        4.. => rows!(4),
                        2 | 3 => rows!(2),
                        _ => rows!(1),
                    };
                }
                return;
            }
            for (rc, w_chunk) in ws.chunks($rows).enumerate() {
                for (tc, y_chunk) in ys.chunks($tokens).enumerate() {
                    let (r0, t0) = (rc * $rows, tc * $tokens);
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
                        // Chunks are at most $rows x $tokens.
                        _ => {}
                    }
                }
            }
        }
    };
}

/// `for $i in 0..$n { $body }` with the body repeated for each constant
/// index (`$n <= 8`), so that every copy sees its index as a constant: LLVM
/// leaves large loops over rows rolled, with the accumulators in memory and
/// the lanes picked at run time.
macro_rules! unroll {
    ($i:ident in 0..$n:expr => $body:block) => {
        unroll!(@ $i, $n, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $i:ident, $n:expr, $body:block, $($k:literal)*) => {{
        const { assert!($n <= 8) };
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    }};
}

/// Both forms of a byte-dot format: `$plain` and `$dotprod` in the slice
/// form, on the tile bodies `$body::<Plain>` and `$body::<Sdot>`.
macro_rules! byte_dot_kernels {
    ($(#[$doc:meta])* $plain:ident, $dotprod:ident => $body:ident($W:ty, $A:ty), prompt_tile = ($rows:literal, $tokens:literal)) => {
        tiled!(
            $(#[$doc])*
            $plain => plain_tile($W, $A), prompt_tile = ($rows, $tokens)
        );
        tiled!(
            #[doc = concat!("[`", stringify!($plain), "`] with `sdot`: the lanes of llama.cpp built with dotprod (see the module doc).")]
            $dotprod => dotprod_tile($W, $A), prompt_tile = ($rows, $tokens),
            needs = "FEAT_DotProd ([`crate::dot::has_neon_dotprod`])"
        );

        // The bodies are `#[inline(always)]` without features of their own,
        // so all of their code is generated inside each entry point.
        unsafe fn plain_tile<const R: usize, const T: usize>(xs: [&[$W]; R], ys: [&[$A]; T]) -> [[f32; T]; R] {
            $body::<Plain, R, T>(xs, ys)
        }

        #[target_feature(enable = "dotprod")]
        unsafe fn dotprod_tile<const R: usize, const T: usize>(xs: [&[$W]; R], ys: [&[$A]; T]) -> [[f32; T]; R] {
            $body::<Sdot, R, T>(xs, ys)
        }
    };
}

/// Same slice form for the float kernels, which gain nothing from tiling.
macro_rules! per_row {
    ($(#[$doc:meta])* $name:ident => $single:ident($T:ty)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// None beyond aarch64 (NEON is part of it); `unsafe` for the tile form.
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

// One module per byte-dot format, so that each can name its tile functions
// `plain_tile` and `dotprod_tile`.
mod q4_0 {
    use super::*;
    byte_dot_kernels!(
        /// Q4_0 weights · Q8_0 activations (`ggml_vec_dot_q4_0_q8_0`).
        q4_0_q8_0, q4_0_q8_0_dotprod => q4_0_body(BlockQ4_0, BlockQ8_0), prompt_tile = (1, 8)
    );
}
mod q4_1 {
    use super::*;
    byte_dot_kernels!(
        /// Q4_1 weights · Q8_1 activations (`ggml_vec_dot_q4_1_q8_1`).
        q4_1_q8_1, q4_1_q8_1_dotprod => q4_1_body(BlockQ4_1, BlockQ8_1), prompt_tile = (1, 8)
    );
}
mod q5_0 {
    use super::*;
    byte_dot_kernels!(
        /// Q5_0 weights · Q8_0 activations (`ggml_vec_dot_q5_0_q8_0`).
        q5_0_q8_0, q5_0_q8_0_dotprod => q5_0_body(BlockQ5_0, BlockQ8_0), prompt_tile = (1, 8)
    );
}
mod q5_1 {
    use super::*;
    byte_dot_kernels!(
        /// Q5_1 weights · Q8_1 activations (`ggml_vec_dot_q5_1_q8_1`).
        q5_1_q8_1, q5_1_q8_1_dotprod => q5_1_body(BlockQ5_1, BlockQ8_1), prompt_tile = (1, 8)
    );
}
mod q8_0 {
    use super::*;
    byte_dot_kernels!(
        /// Q8_0 weights · Q8_0 activations (`ggml_vec_dot_q8_0_q8_0`).
        q8_0_q8_0, q8_0_q8_0_dotprod => q8_0_body(BlockQ8_0, BlockQ8_0), prompt_tile = (2, 4)
    );
}
mod q4_k {
    use super::*;
    byte_dot_kernels!(
        /// Q4_K weights · Q8_K activations (`ggml_vec_dot_q4_K_q8_K`).
        q4_k_q8_k, q4_k_q8_k_dotprod => q4_k_body(BlockQ4K, BlockQ8K), prompt_tile = (1, 8)
    );
}
mod q5_k {
    use super::*;
    byte_dot_kernels!(
        /// Q5_K weights · Q8_K activations (`ggml_vec_dot_q5_K_q8_K`).
        q5_k_q8_k, q5_k_q8_k_dotprod => q5_k_body(BlockQ5K, BlockQ8K), prompt_tile = (1, 8)
    );
}
mod q6_k {
    use super::*;
    byte_dot_kernels!(
        /// Q6_K weights · Q8_K activations (`ggml_vec_dot_q6_K_q8_K`).
        q6_k_q8_k, q6_k_q8_k_dotprod => q6_k_body(BlockQ6K, BlockQ8K), prompt_tile = (1, 8)
    );
}

pub use q4_0::{q4_0_q8_0, q4_0_q8_0_dotprod};
pub use q4_1::{q4_1_q8_1, q4_1_q8_1_dotprod};
pub use q4_k::{q4_k_q8_k, q4_k_q8_k_dotprod};
pub use q5_0::{q5_0_q8_0, q5_0_q8_0_dotprod};
pub use q5_1::{q5_1_q8_1, q5_1_q8_1_dotprod};
pub use q5_k::{q5_k_q8_k, q5_k_q8_k_dotprod};
pub use q6_k::{q6_k_q8_k, q6_k_q8_k_dotprod};
pub use q8_0::{q8_0_q8_0, q8_0_q8_0_dotprod};

per_row!(
    /// F32 · F32 (`ggml_vec_dot_f32`).
    f32_f32 => dot_f32(f32)
);
per_row!(
    /// F16 · F16 (`ggml_vec_dot_f16`, without FP16 vector arithmetic).
    f16_f16 => dot_f16(f16)
);

// ---------------------------------------------------------------------------
// Helpers.

/// Blocks every operand has; equal for validated rows, and the bound that
/// keeps the unchecked indexing below in range either way.
#[inline(always)]
fn common_len<W, A, const R: usize, const T: usize>(xs: &[&[W]; R], ys: &[&[A]; T]) -> usize {
    let n = xs.iter().fold(usize::MAX, |n, x| n.min(x.len()));
    ys.iter().fold(n, |n, y| n.min(y.len()))
}

/// `GGML_CPU_FP16_TO_FP32` on aarch64: `(float)` of an `__fp16`, one `fcvt`
/// (part of the base ARMv8-A FP set; `half` would check for FEAT_FP16 per call).
#[inline(always)]
pub(crate) fn fp16(h: f16) -> f32 {
    let out: f32;
    // SAFETY: FCVT between half and single precision is in every aarch64 CPU;
    // it reads and writes registers only.
    unsafe {
        asm!("fcvt {out:s}, {h:h}", h = in(vreg) h.to_bits() as u32, out = lateout(vreg) out,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// Four f16 (as bits) widened to f32 (`vcvt_f32_f16`: one `fcvtl`, base
/// ARMv8-A like `fcvt`; `float16x4_t` is unstable in Rust).
#[inline(always)]
pub(crate) fn widen_f16x4(halves: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: FCVTL is in every aarch64 CPU; registers only.
    unsafe {
        asm!("fcvtl {out:v}.4s, {h:v}.4h", h = in(vreg) halves, out = lateout(vreg) out,
             options(pure, nomem, nostack, preserves_flags));
    }
    out
}

/// Four f16 values at `p` widened to f32 (`vcvt_f32_f16(vld1_f16(p))`).
///
/// # Safety
/// `p` must be valid for reading four values.
#[inline(always)]
unsafe fn load_f16x4(p: *const f16) -> float32x4_t {
    widen_f16x4(vld1_u16(p as *const u16))
}

/// `acc + f32(p) * d`: GCC's `vmlaq_n_f32(acc, vcvtq_f32_s32(p), d)`, a
/// multiply then an add (not fused).
#[inline(always)]
unsafe fn mla_n(acc: float32x4_t, p: int32x4_t, d: f32) -> float32x4_t {
    vaddq_f32(acc, vmulq_n_f32(vcvtq_f32_s32(p), d))
}

/// Lane `i` (< 4) of `v`; `i` is a constant wherever this is inlined.
#[inline(always)]
unsafe fn lane(v: float32x4_t, i: usize) -> f32 {
    match i {
        0 => vgetq_lane_f32::<0>(v),
        1 => vgetq_lane_f32::<1>(v),
        2 => vgetq_lane_f32::<2>(v),
        _ => vgetq_lane_f32::<3>(v),
    }
}

/// The f16 scales `h(r)` of `R <= 4` weight rows' blocks widened to f32,
/// row `r` in lane `r` (lanes past `R` zero): a lane load each and one
/// conversion for all (one `fcvt` each would be two instructions a row).
#[inline(always)]
unsafe fn row_scales<const R: usize>(h: impl Fn(usize) -> *const f16) -> float32x4_t {
    const { assert!(R <= 4) };
    let mut v = vdup_n_u16(0);
    for r in 0..R {
        let p = h(r) as *const u16;
        v = match r {
            0 => vld1_lane_u16::<0>(p, v),
            1 => vld1_lane_u16::<1>(p, v),
            2 => vld1_lane_u16::<2>(p, v),
            _ => vld1_lane_u16::<3>(p, v),
        };
    }
    widen_f16x4(v)
}

/// GGML's `ggml_vdotq_s32` in one of llama.cpp's two aarch64 builds: lane
/// `i` of `dot(acc, a, b)` is `acc[i]` plus the products of the bytes
/// [`Self::LANES`]`[i]` of `a` and `b`.
pub(crate) trait ByteDot {
    /// Whether this is [`Sdot`] (whose decode bodies are written out).
    const SDOT: bool;

    /// The bytes each lane sums.
    #[cfg_attr(not(test), allow(dead_code))]
    const LANES: [[usize; 4]; 4];

    /// `ggml_vdotq_s32(acc, a, b)`.
    ///
    /// # Safety
    /// The CPU must have the implementor's features.
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;

    /// `ggml_vdotq_s32(ggml_vdotq_s32(0, a0, b0), a1, b1)`, which has the
    /// same lanes (exact integers) as GGML's other form
    /// `vaddq_s32(ggml_vdotq_s32(0, a0, b0), ggml_vdotq_s32(0, a1, b1))`.
    ///
    /// # Safety
    /// As [`Self::dot`].
    #[inline(always)]
    unsafe fn dot2(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        Self::dot(Self::dot(vdupq_n_s32(0), a0, b0), a1, b1)
    }

    /// [`Self::dot2`] where `|a0[k] b0[k] + a1[k] b1[k]| < 2^15` for every
    /// byte `k`: true when `|a| <= 32` (the 4- and 5-bit formats' values)
    /// and the activations are bytes.
    ///
    /// # Safety
    /// As [`Self::dot`].
    #[inline(always)]
    unsafe fn dot2_small(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        Self::dot2(a0, b0, a1, b1)
    }

    /// The 32 bytes of nibbles at `q` against `y`: the low nibbles'
    /// `dot2_small` with `y[0], y[1]` and the high nibbles' with `y[2], y[3]`
    /// (a Q4_K step of 64 values).
    ///
    /// # Safety
    /// As [`Self::dot`]; `q` must be valid for reading 32 bytes.
    #[inline(always)]
    unsafe fn nibble_dots(q: *const u8, y: &[int8x16_t; 4]) -> (int32x4_t, int32x4_t) {
        let (b0, b1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
        let m4b = vdupq_n_u8(0x0F);
        let lo = |b| vreinterpretq_s8_u8(vandq_u8(b, m4b));
        let hi = |b| vreinterpretq_s8_u8(vshrq_n_u8::<4>(b));
        (
            Self::dot2_small(lo(b0), y[0], lo(b1), y[1]),
            Self::dot2_small(hi(b0), y[2], hi(b1), y[3]),
        )
    }

    /// One Q6_K step of 128 values: the 6-bit values from the 64 bytes at
    /// `ql` and the 32 at `qh`, in GGML's order (16 per vector), each
    /// vector's byte dot with `y[v]` times scale `v` (lane `v % 4` of
    /// `sc[v / 4]`) added to `sumi`.
    ///
    /// # Safety
    /// As [`Self::dot`]; `ql`, `qh` must be valid for reading 64 and 32 bytes.
    #[inline(always)]
    unsafe fn q6_k_step(
        ql: *const u8,
        qh: *const u8,
        y: &[int8x16_t; 8],
        sc: &[int32x4_t; 2],
        mut sumi: int32x4_t,
    ) -> int32x4_t {
        let values = q6_k_values(ql, qh);
        for v in 0..8 {
            let p = Self::dot(vdupq_n_s32(0), vreinterpretq_s8_u8(values[v]), y[v]);
            sumi = mla_lane(sumi, p, sc[v / 4], v % 4);
        }
        sumi
    }
}

/// Any aarch64 CPU: GGML's emulation (llama.cpp built without dotprod),
/// widening multiplies of each half then pairwise adds. Its lanes hold the
/// products of bytes `2i, 2i + 1, 8 + 2i, 9 + 2i`.
pub(crate) struct Plain;

/// FEAT_DotProd's `sdot` (llama.cpp built with dotprod), whose lanes hold
/// the products of bytes `4i..4i + 4`. The intrinsic (`vdotq_s32`) is
/// unstable in the toolchains this crate supports; the instruction is not.
pub(crate) struct Sdot;

impl ByteDot for Plain {
    const SDOT: bool = false;
    const LANES: [[usize; 4]; 4] = [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]];

    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let hi = vmull_high_s8(a, b);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }

    #[inline(always)]
    unsafe fn dot2(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        // The first from its pairwise sums rather than from zero.
        let lo = vmull_s8(vget_low_s8(a0), vget_low_s8(b0));
        let hi = vmull_high_s8(a0, b0);
        Self::dot(vpadalq_s16(vpaddlq_s16(lo), hi), a1, b1)
    }

    #[inline(always)]
    unsafe fn dot2_small(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        // Both operand pairs' products of a byte summed in i16 (no overflow
        // by the contract), then the same pairwise sums.
        let lo = vmlal_s8(
            vmull_s8(vget_low_s8(a0), vget_low_s8(b0)),
            vget_low_s8(a1),
            vget_low_s8(b1),
        );
        let hi = vmlal_high_s8(vmull_high_s8(a0, b0), a1, b1);
        vpadalq_s16(vpaddlq_s16(lo), hi)
    }
}

impl ByteDot for Sdot {
    const SDOT: bool = true;

    /// Written out, the values made with shift-and-inserts: per half
    /// (`qh[h]`, `ql[h]`, `ql[2 + h]`), values `4 + h` and `h` from `ql[h]`'s
    /// high then low nibbles under `qh` bits 4, 5 and 0, 1, values `6 + h`
    /// and `2 + h` from `ql[2 + h]`'s under bits 6, 7 and 2, 3.
    #[inline(always)]
    unsafe fn q6_k_step(
        ql: *const u8,
        qh: *const u8,
        y: &[int8x16_t; 8],
        sc: &[int32x4_t; 2],
        mut sumi: int32x4_t,
    ) -> int32x4_t {
        asm!(
            "ldp {l0:q}, {l1:q}, [{ql}]",
            "ldp {l2:q}, {l3:q}, [{ql}, #32]",
            "ldp {h0:q}, {h1:q}, [{qh}]",
            // Half 0: v4 in a0, v0 in l0, v6 in c0, v2 in l2.
            "and {a0:v}.16b, {h0:v}.16b, {m30:v}.16b",
            "sri {a0:v}.16b, {l0:v}.16b, #4",
            "and {c0:v}.16b, {h0:v}.16b, {m3:v}.16b",
            "sli {l0:v}.16b, {c0:v}.16b, #4",
            "ushr {h0:v}.16b, {h0:v}.16b, #2",
            "and {c0:v}.16b, {h0:v}.16b, {m30:v}.16b",
            "sri {c0:v}.16b, {l2:v}.16b, #4",
            "and {h0:v}.16b, {h0:v}.16b, {m3:v}.16b",
            "sli {l2:v}.16b, {h0:v}.16b, #4",
            // Half 1: v5 in a1, v1 in l1, v7 in c1, v3 in l3.
            "and {a1:v}.16b, {h1:v}.16b, {m30:v}.16b",
            "sri {a1:v}.16b, {l1:v}.16b, #4",
            "and {c1:v}.16b, {h1:v}.16b, {m3:v}.16b",
            "sli {l1:v}.16b, {c1:v}.16b, #4",
            "ushr {h1:v}.16b, {h1:v}.16b, #2",
            "and {c1:v}.16b, {h1:v}.16b, {m30:v}.16b",
            "sri {c1:v}.16b, {l3:v}.16b, #4",
            "and {h1:v}.16b, {h1:v}.16b, {m3:v}.16b",
            "sli {l3:v}.16b, {h1:v}.16b, #4",
            // Each value vector's dot, times its scale.
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {l0:v}.16b, {y0:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s0:v}.s[0]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {l1:v}.16b, {y1:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s0:v}.s[1]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {l2:v}.16b, {y2:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s0:v}.s[2]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {l3:v}.16b, {y3:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s0:v}.s[3]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {a0:v}.16b, {y4:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s1:v}.s[0]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {a1:v}.16b, {y5:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s1:v}.s[1]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {c0:v}.16b, {y6:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s1:v}.s[2]",
            "movi {p:v}.4s, #0",
            "sdot {p:v}.4s, {c1:v}.16b, {y7:v}.16b",
            "mla {sumi:v}.4s, {p:v}.4s, {s1:v}.s[3]",
            ql = in(reg) ql, qh = in(reg) qh, sumi = inout(vreg) sumi,
            l0 = out(vreg) _, l1 = out(vreg) _, l2 = out(vreg) _, l3 = out(vreg) _,
            h0 = out(vreg) _, h1 = out(vreg) _, a0 = out(vreg) _, a1 = out(vreg) _,
            c0 = out(vreg) _, c1 = out(vreg) _, p = out(vreg) _,
            m3 = in(vreg) vdupq_n_u8(3), m30 = in(vreg) vdupq_n_u8(0x30),
            s0 = in(vreg) sc[0], s1 = in(vreg) sc[1],
            y0 = in(vreg) y[0], y1 = in(vreg) y[1], y2 = in(vreg) y[2], y3 = in(vreg) y[3],
            y4 = in(vreg) y[4], y5 = in(vreg) y[5], y6 = in(vreg) y[6], y7 = in(vreg) y[7],
            options(pure, readonly, nostack, preserves_flags)
        );
        sumi
    }

    /// Written out: LLVM would hoist every row's loads and spill.
    #[inline(always)]
    unsafe fn nibble_dots(q: *const u8, y: &[int8x16_t; 4]) -> (int32x4_t, int32x4_t) {
        let (p1, p2): (int32x4_t, int32x4_t);
        asm!(
            "ldp {a:q}, {b:q}, [{q}]",
            "and {l0:v}.16b, {a:v}.16b, {m4:v}.16b",
            "and {l1:v}.16b, {b:v}.16b, {m4:v}.16b",
            "ushr {a:v}.16b, {a:v}.16b, #4",
            "ushr {b:v}.16b, {b:v}.16b, #4",
            "movi {p1:v}.4s, #0",
            "movi {p2:v}.4s, #0",
            "sdot {p1:v}.4s, {l0:v}.16b, {y0:v}.16b",
            "sdot {p2:v}.4s, {a:v}.16b, {y2:v}.16b",
            "sdot {p1:v}.4s, {l1:v}.16b, {y1:v}.16b",
            "sdot {p2:v}.4s, {b:v}.16b, {y3:v}.16b",
            q = in(reg) q, a = out(vreg) _, b = out(vreg) _, l0 = out(vreg) _, l1 = out(vreg) _,
            p1 = out(vreg) p1, p2 = out(vreg) p2, m4 = in(vreg) vdupq_n_u8(0x0F),
            y0 = in(vreg) y[0], y1 = in(vreg) y[1], y2 = in(vreg) y[2], y3 = in(vreg) y[3],
            options(pure, readonly, nostack, preserves_flags)
        );
        (p1, p2)
    }
    const LANES: [[usize; 4]; 4] = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]];

    #[inline(always)]
    unsafe fn dot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // Inlined into `#[target_feature(enable = "dotprod")]` entry points only.
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
             options(pure, nomem, nostack, preserves_flags));
        acc
    }
}

/// The 32 quants of a legacy block as two vectors.
#[inline(always)]
unsafe fn load_q8(qs: &[i8; QK]) -> (int8x16_t, int8x16_t) {
    (vld1q_s8(qs.as_ptr()), vld1q_s8(qs.as_ptr().add(16)))
}

/// 16 bytes of nibbles → values 0..16 (low nibbles) and 16..32 (high).
#[inline(always)]
unsafe fn nibbles(qs: &[u8; QK / 2]) -> (int8x16_t, int8x16_t) {
    let v = vld1q_u8(qs.as_ptr());
    (
        vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
        vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
    )
}

/// Byte `j` (values 0..16 in the first vector, 16..32 in the second) is
/// 0xFF where bit `j` of `bits` is set, else 0: GGML's `table_b2b_*`
/// lookups without the table.
#[inline(always)]
unsafe fn bit_masks(bits: u32) -> (uint8x16_t, uint8x16_t) {
    bit_masks_v(vreinterpretq_u8_u32(vdupq_n_u32(bits)))
}

// ---------------------------------------------------------------------------
// Legacy 32-value blocks. Per block pair (2k, 2k + 1) of each output,
// `acc0` and `acc1` take one update each; a last odd block goes through the
// scalar tail after the reduction. The scales `dx · dy` of a pair's blocks
// are made for all rows at once (lane `r` of `s0`, `s1`; the same products).

/// `vaddvq(acc0) + vaddvq(acc1)` of every output: for each activation row,
/// the `R <= 4` weight rows in one vector (lane `r`), by pairwise adds that
/// make the same sums as `vaddvq`'s `(l0 + l1) + (l2 + l3)`.
#[inline(always)]
unsafe fn reduce_pairs<const R: usize, const T: usize>(
    acc0: &[[float32x4_t; T]; R],
    acc1: &[[float32x4_t; T]; R],
) -> [float32x4_t; T] {
    const { assert!(R <= 4) };
    std::array::from_fn(|t| {
        let sums = |acc: &[[float32x4_t; T]; R]| {
            let row = |r: usize| acc[r.min(R - 1)][t];
            vpaddq_f32(vpaddq_f32(row(0), row(1)), vpaddq_f32(row(2), row(3)))
        };
        vaddq_f32(sums(acc0), sums(acc1))
    })
}

/// The outputs of [`reduce_pairs`]-shaped vectors.
#[inline(always)]
unsafe fn row_outputs<const R: usize, const T: usize>(v: &[float32x4_t; T]) -> [[f32; T]; R] {
    std::array::from_fn(|r| std::array::from_fn(|t| lane(v[t], r)))
}

// ---------------------------------------------------------------------------
// One activation row (decode): the same arithmetic as the general bodies,
// with each row's blocks read in memory order through a moving pointer, so
// that the loads post-increment it (no address arithmetic), and the scales
// of all rows made in one vector.

/// A read position that moves past what it reads. The loads are written
/// out (post-indexed, so no address arithmetic) because LLVM turns the
/// intrinsics' loads into offsets from shared indices instead, which cost
/// an add per row and block.
#[derive(Clone, Copy)]
struct Cursor(*const u8);

impl Cursor {
    /// The f16 at the cursor into lane `lane` (1..4) of `v`.
    #[inline(always)]
    unsafe fn half(&mut self, mut v: uint16x4_t, lane: usize) -> uint16x4_t {
        macro_rules! ld1 {
            ($lane:literal) => {
                asm!(concat!("ld1 {{{v:v}.h}}[", $lane, "], [{p}], #2"), v = inout(vreg) v, p = inout(reg) self.0,
                     options(pure, readonly, nostack, preserves_flags))
            };
        }
        match lane {
            0 => return self.half0(),
            1 => ld1!(1),
            2 => ld1!(2),
            _ => ld1!(3),
        }
        v
    }

    /// The f16 at the cursor in lane 0, the other lanes zero.
    #[inline(always)]
    unsafe fn half0(&mut self) -> uint16x4_t {
        let v: uint16x4_t;
        asm!("ldr {v:h}, [{p}], #2", v = lateout(vreg) v, p = inout(reg) self.0,
             options(pure, readonly, nostack, preserves_flags));
        v
    }

    /// The 16 bytes at the cursor, moving on by `STEP`.
    #[inline(always)]
    unsafe fn bytes16<const STEP: usize>(&mut self) -> uint8x16_t {
        let v: uint8x16_t;
        macro_rules! ldr {
            ($step:literal) => {
                asm!(concat!("ldr {v:q}, [{p}], #", $step), v = lateout(vreg) v, p = inout(reg) self.0,
                     options(pure, readonly, nostack, preserves_flags))
            };
        }
        match STEP {
            4 => ldr!(4),
            16 => ldr!(16),
            _ => unreachable!(),
        }
        v
    }

    /// The 32 bytes at the cursor as two vectors.
    #[inline(always)]
    unsafe fn bytes32(&mut self) -> (int8x16_t, int8x16_t) {
        let (a, b): (int8x16_t, int8x16_t);
        asm!("ldp {a:q}, {b:q}, [{p}], #32", a = lateout(vreg) a, b = lateout(vreg) b, p = inout(reg) self.0,
             options(pure, readonly, nostack, preserves_flags));
        (a, b)
    }
}

/// `v * s[lane]` (`lane` < 4).
#[inline(always)]
unsafe fn mul_lane(v: float32x4_t, s: float32x4_t, lane: usize) -> float32x4_t {
    match lane {
        0 => vmulq_laneq_f32::<0>(v, s),
        1 => vmulq_laneq_f32::<1>(v, s),
        2 => vmulq_laneq_f32::<2>(v, s),
        _ => vmulq_laneq_f32::<3>(v, s),
    }
}

/// A legacy format as the decode bodies read it: per block, the scales,
/// then the values.
trait Legacy {
    type W: Copy;
    type A: Copy;
    /// The offset terms: none (0); Q4_1's `summs += m0 * s0 + m1 * s1`, the
    /// first product fused (1); Q5_1's one fused `summs += m * s` per
    /// accumulator (2).
    const OFFSETS: u8;

    /// Reads the scales at the start of a weight block at `c`: its `d` (and
    /// `m`) into lane `r` of `d` (`m`).
    ///
    /// # Safety
    /// `c` must point at a block of `W`.
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, m: &mut uint16x4_t, r: usize);

    /// Reads the rest of the weight block (after [`Self::scales`]): its
    /// values (0..16, 16..32).
    ///
    /// # Safety
    /// As [`Self::scales`].
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t);

    /// [`Self::values`] dotted with `(b0, b1)` by `sdot`
    /// (`Self::dot2::<Sdot>`), written out where LLVM would hoist every
    /// row's loads and spill.
    ///
    /// # Safety
    /// As [`Self::scales`], and the CPU must have FEAT_DotProd.
    #[inline(always)]
    unsafe fn values_sdot(c: &mut Cursor, b0: int8x16_t, b1: int8x16_t) -> int32x4_t {
        let (a0, a1) = Self::values(c);
        Self::dot2::<Sdot>(a0, b0, a1, b1)
    }

    /// Reads the activation block at `c`: its `d` in lane 0, `s` (Q8_1) in
    /// lane 1; its quants.
    ///
    /// # Safety
    /// `c` must point at a block of `A`.
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t);

    /// The block's lanes: `dot2`, or `dot2_small` where the values allow.
    ///
    /// # Safety
    /// As [`ByteDot::dot`].
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t;
}

/// Reads a Q8_0 activation block.
#[inline(always)]
unsafe fn q8_0_activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
    let d = c.half0();
    let (l, h) = c.bytes32();
    (d, l, h)
}

/// Reads a Q8_1 activation block.
#[inline(always)]
unsafe fn q8_1_activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
    let d = c.half0();
    let ds = c.half(d, 1);
    let (l, h) = c.bytes32();
    (ds, l, h)
}

/// 16 packed nibbles → values 0..16 (low nibbles) and 16..32 (high).
#[inline(always)]
unsafe fn split_nibbles(v: uint8x16_t) -> (int8x16_t, int8x16_t) {
    (
        vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
        vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
    )
}

/// [`bit_masks`]'s lookup tables: which `qh` byte, and which bit of it.
const MASK_LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
const MASK_HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
const MASK_BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];

/// The 5th bits as masks ([`bit_masks`]) from the four `qh` bytes at the
/// start of `v`, where set.
#[inline(always)]
unsafe fn bit_masks_v(v: uint8x16_t) -> (uint8x16_t, uint8x16_t) {
    let bits = vld1q_u8(MASK_BITS.as_ptr());
    (
        vtstq_u8(vqtbl1q_u8(v, vld1q_u8(MASK_LO.as_ptr())), bits),
        vtstq_u8(vqtbl1q_u8(v, vld1q_u8(MASK_HI.as_ptr())), bits),
    )
}

struct FmtQ4_0;
struct FmtQ4_1;
struct FmtQ5_0;
struct FmtQ5_1;
struct FmtQ8_0;

/// `sdot` of the 16 bytes of nibbles at the cursor `$c` (low nibbles, then
/// high; minus 8 with `minus8`) with `$b0`, `$b1`, from zero.
macro_rules! nibbles_sdot {
    ($c:expr, $b0:expr, $b1:expr) => {
        nibbles_sdot!(@ $c, $b0, $b1, "", "")
    };
    ($c:expr, $b0:expr, $b1:expr, minus8) => {
        nibbles_sdot!(@ $c, $b0, $b1, "sub {a:v}.16b, {a:v}.16b, {s8:v}.16b", "sub {q:v}.16b, {q:v}.16b, {s8:v}.16b",
                      s8 = in(vreg) vdupq_n_s8(8),)
    };
    (@ $c:expr, $b0:expr, $b1:expr, $sub_lo:literal, $sub_hi:literal $(, $($extra:tt)*)?) => {{
        let acc: int32x4_t;
        asm!(
            "ldr {q:q}, [{p}], #16",
            "and {a:v}.16b, {q:v}.16b, {m4:v}.16b",
            "ushr {q:v}.16b, {q:v}.16b, #4",
            $sub_lo,
            $sub_hi,
            "movi {acc:v}.4s, #0",
            "sdot {acc:v}.4s, {a:v}.16b, {b0:v}.16b",
            "sdot {acc:v}.4s, {q:v}.16b, {b1:v}.16b",
            p = inout(reg) $c.0, q = out(vreg) _, a = out(vreg) _, acc = out(vreg) acc,
            m4 = in(vreg) vdupq_n_u8(0x0F), b0 = in(vreg) $b0, b1 = in(vreg) $b1,
            $($($extra)*)?
            options(pure, readonly, nostack, preserves_flags)
        );
        acc
    }};
}

impl Legacy for FmtQ4_0 {
    type W = BlockQ4_0;
    type A = BlockQ8_0;
    const OFFSETS: u8 = 0;

    #[inline(always)]
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, _: &mut uint16x4_t, r: usize) {
        *d = c.half(*d, r);
    }

    #[inline(always)]
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t) {
        let (l, h) = split_nibbles(c.bytes16::<16>());
        let s8b = vdupq_n_s8(8);
        (vsubq_s8(l, s8b), vsubq_s8(h, s8b))
    }

    #[inline(always)]
    unsafe fn values_sdot(c: &mut Cursor, b0: int8x16_t, b1: int8x16_t) -> int32x4_t {
        nibbles_sdot!(c, b0, b1, minus8)
    }

    #[inline(always)]
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
        q8_0_activations(c)
    }

    #[inline(always)]
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        D::dot2_small(a0, b0, a1, b1)
    }
}

impl Legacy for FmtQ4_1 {
    type W = BlockQ4_1;
    type A = BlockQ8_1;
    const OFFSETS: u8 = 1;

    #[inline(always)]
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, m: &mut uint16x4_t, r: usize) {
        *d = c.half(*d, r);
        *m = c.half(*m, r);
    }

    #[inline(always)]
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t) {
        split_nibbles(c.bytes16::<16>())
    }

    #[inline(always)]
    unsafe fn values_sdot(c: &mut Cursor, b0: int8x16_t, b1: int8x16_t) -> int32x4_t {
        nibbles_sdot!(c, b0, b1)
    }

    #[inline(always)]
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
        q8_1_activations(c)
    }

    #[inline(always)]
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        D::dot2_small(a0, b0, a1, b1)
    }
}

impl Legacy for FmtQ5_0 {
    type W = BlockQ5_0;
    type A = BlockQ8_0;
    const OFFSETS: u8 = 0;

    #[inline(always)]
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, _: &mut uint16x4_t, r: usize) {
        *d = c.half(*d, r);
    }

    /// Masks where the 5th bit is clear (from `qh` and the first 12 quant
    /// bytes), then the nibbles with 0xF0 (minus 16) inserted there.
    #[inline(always)]
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t) {
        let (cl, ch) = bit_masks_v(vmvnq_u8(c.bytes16::<4>()));
        let v = c.bytes16::<16>();
        (
            vreinterpretq_s8_u8(vsliq_n_u8::<4>(v, cl)),
            vreinterpretq_s8_u8(vsriq_n_u8::<4>(ch, v)),
        )
    }

    #[inline(always)]
    unsafe fn values_sdot(c: &mut Cursor, b0: int8x16_t, b1: int8x16_t) -> int32x4_t {
        let acc: int32x4_t;
        asm!(
            "ldr {h:q}, [{p}], #4",
            "mvn {h:v}.16b, {h:v}.16b",
            "tbl {ml:v}.16b, {{{h:v}.16b}}, {lo:v}.16b",
            "tbl {mh:v}.16b, {{{h:v}.16b}}, {hi:v}.16b",
            "ldr {q:q}, [{p}], #16",
            "cmtst {ml:v}.16b, {ml:v}.16b, {bits:v}.16b",
            "cmtst {mh:v}.16b, {mh:v}.16b, {bits:v}.16b",
            "sri {mh:v}.16b, {q:v}.16b, #4",
            "sli {q:v}.16b, {ml:v}.16b, #4",
            "movi {acc:v}.4s, #0",
            "sdot {acc:v}.4s, {q:v}.16b, {b0:v}.16b",
            "sdot {acc:v}.4s, {mh:v}.16b, {b1:v}.16b",
            p = inout(reg) c.0, h = out(vreg) _, q = out(vreg) _, ml = out(vreg) _, mh = out(vreg) _,
            acc = out(vreg) acc,
            lo = in(vreg) vld1q_u8(MASK_LO.as_ptr()), hi = in(vreg) vld1q_u8(MASK_HI.as_ptr()),
            bits = in(vreg) vld1q_u8(MASK_BITS.as_ptr()), b0 = in(vreg) b0, b1 = in(vreg) b1,
            options(pure, readonly, nostack, preserves_flags)
        );
        acc
    }

    #[inline(always)]
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
        q8_0_activations(c)
    }

    #[inline(always)]
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        D::dot2_small(a0, b0, a1, b1)
    }
}

impl Legacy for FmtQ5_1 {
    type W = BlockQ5_1;
    type A = BlockQ8_1;
    const OFFSETS: u8 = 2;

    #[inline(always)]
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, m: &mut uint16x4_t, r: usize) {
        *d = c.half(*d, r);
        *m = c.half(*m, r);
    }

    #[inline(always)]
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t) {
        let (ml, mh) = bit_masks_v(c.bytes16::<4>());
        let v = c.bytes16::<16>();
        (
            vreinterpretq_s8_u8(vsliq_n_u8::<4>(v, vshrq_n_u8::<7>(ml))),
            vreinterpretq_s8_u8(vsriq_n_u8::<4>(vandq_u8(mh, vdupq_n_u8(0x10)), v)),
        )
    }

    #[inline(always)]
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
        q8_1_activations(c)
    }

    #[inline(always)]
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        D::dot2_small(a0, b0, a1, b1)
    }
}

impl Legacy for FmtQ8_0 {
    type W = BlockQ8_0;
    type A = BlockQ8_0;
    const OFFSETS: u8 = 0;

    #[inline(always)]
    unsafe fn scales(c: &mut Cursor, d: &mut uint16x4_t, _: &mut uint16x4_t, r: usize) {
        *d = c.half(*d, r);
    }

    #[inline(always)]
    unsafe fn values(c: &mut Cursor) -> (int8x16_t, int8x16_t) {
        c.bytes32()
    }

    #[inline(always)]
    unsafe fn values_sdot(c: &mut Cursor, b0: int8x16_t, b1: int8x16_t) -> int32x4_t {
        let acc: int32x4_t;
        asm!(
            "ldp {a:q}, {b:q}, [{p}], #32",
            "movi {acc:v}.4s, #0",
            "sdot {acc:v}.4s, {a:v}.16b, {b0:v}.16b",
            "sdot {acc:v}.4s, {b:v}.16b, {b1:v}.16b",
            p = inout(reg) c.0, a = out(vreg) _, b = out(vreg) _, acc = out(vreg) acc,
            b0 = in(vreg) b0, b1 = in(vreg) b1,
            options(pure, readonly, nostack, preserves_flags)
        );
        acc
    }

    #[inline(always)]
    unsafe fn activations(c: &mut Cursor) -> (uint16x4_t, int8x16_t, int8x16_t) {
        q8_0_activations(c)
    }

    #[inline(always)]
    unsafe fn dot2<D: ByteDot>(a0: int8x16_t, b0: int8x16_t, a1: int8x16_t, b1: int8x16_t) -> int32x4_t {
        D::dot2(a0, b0, a1, b1)
    }
}

/// The block pairs of `R <= 4` weight rows against one activation row: the
/// outputs after the pairs' reduction and offset sums (the bodies add the
/// scalar tail), and the blocks done. Row `r`'s scales are lane `r`.
#[inline(always)]
unsafe fn decode_pairs<D: ByteDot, F: Legacy, const R: usize, const T: usize>(
    xs: &[&[F::W]; R],
    y: &[F::A],
    nb: usize,
) -> ([[f32; T]; R], usize) {
    const { assert!(R <= 4) };
    let mut px: [Cursor; R] = std::array::from_fn(|r| Cursor(xs[r].as_ptr().cast()));
    let mut py = Cursor(y.as_ptr().cast());
    let mut acc = [[vdupq_n_f32(0.0); R]; 2];
    let mut summs = [vdupq_n_f32(0.0); 2];
    for _ in 0..nb / 2 {
        let mut d = [vdup_n_u16(0); 2];
        let mut m = [vdup_n_u16(0); 2];
        let mut ya = [vdupq_n_f32(0.0); 2];
        unroll!(k in 0..2 => {
            let (yd, yl, yh) = F::activations(&mut py);
            let mut p = [vdupq_n_s32(0); R];
            unroll!(r in 0..R => {
                F::scales(&mut px[r], &mut d[k], &mut m[k], r);
                p[r] = if D::SDOT {
                    F::values_sdot(&mut px[r], yl, yh)
                } else {
                    let v = F::values(&mut px[r]);
                    F::dot2::<D>(v.0, yl, v.1, yh)
                };
            });
            ya[k] = widen_f16x4(yd);
            // `dx * dy` of every row.
            let s = vmulq_laneq_f32::<0>(widen_f16x4(d[k]), ya[k]);
            unroll!(r in 0..R => {
                acc[k][r] = vaddq_f32(acc[k][r], mul_lane(vcvtq_f32_s32(p[r]), s, r));
            });
        });
        match F::OFFSETS {
            1 => {
                let (m0, m1) = (widen_f16x4(m[0]), widen_f16x4(m[1]));
                let pair = vfmaq_laneq_f32::<1>(vmulq_laneq_f32::<1>(m1, ya[1]), m0, ya[0]);
                summs[0] = vaddq_f32(summs[0], pair);
            }
            2 => {
                summs[0] = vfmaq_laneq_f32::<1>(summs[0], widen_f16x4(m[0]), ya[0]);
                summs[1] = vfmaq_laneq_f32::<1>(summs[1], widen_f16x4(m[1]), ya[1]);
            }
            _ => {}
        }
    }
    let acc0: [[float32x4_t; 1]; R] = std::array::from_fn(|r| [acc[0][r]]);
    let acc1: [[float32x4_t; 1]; R] = std::array::from_fn(|r| [acc[1][r]]);
    let sums = reduce_pairs(&acc0, &acc1)[0];
    let sums = match F::OFFSETS {
        1 => vaddq_f32(sums, summs[0]),
        2 => vaddq_f32(vaddq_f32(sums, summs[0]), summs[1]),
        _ => sums,
    };
    let mut out = [[0.0f32; T]; R];
    for (r, out) in out.iter_mut().enumerate() {
        out[0] = lane(sums, r);
    }
    (out, nb & !1)
}

/// Q4_0's values as signed bytes (`nibble - 8`).
#[inline(always)]
unsafe fn q4_0_values(xb: &BlockQ4_0) -> (int8x16_t, int8x16_t) {
    let (l, h) = nibbles(&xb.qs);
    let s8b = vdupq_n_s8(8);
    (vsubq_s8(l, s8b), vsubq_s8(h, s8b))
}

#[inline(always)]
unsafe fn q4_0_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ4_0]; R],
    ys: [&[BlockQ8_0]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let (mut out, ib) = if T == 1 {
        decode_pairs::<D, FmtQ4_0, R, T>(&xs, ys[0], nb)
    } else {
        let mut acc0 = [[vdupq_n_f32(0.0); T]; R];
        let mut acc1 = [[vdupq_n_f32(0.0); T]; R];
        let mut ib = 0;
        while ib + 1 < nb {
            let dx0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).d);
            let dx1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).d);
            unroll!(r in 0..R => {
                let (x0l, x0h) = q4_0_values(xs[r].get_unchecked(ib));
                let (x1l, x1h) = q4_0_values(xs[r].get_unchecked(ib + 1));
                unroll!(t in 0..T => {
                    let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                    let (y0l, y0h) = load_q8(&y0.qs);
                    let (y1l, y1h) = load_q8(&y1.qs);
                    let s0 = vmulq_n_f32(dx0, fp16(y0.d));
                    let s1 = vmulq_n_f32(dx1, fp16(y1.d));
                    acc0[r][t] = mla_n(acc0[r][t], D::dot2_small(x0l, y0l, x0h, y0h), lane(s0, r));
                    acc1[r][t] = mla_n(acc1[r][t], D::dot2_small(x1l, y1l, x1h, y1h), lane(s1, r));
                });
            });
            ib += 2;
        }
        (row_outputs::<R, T>(&reduce_pairs(&acc0, &acc1)), ib)
    };
    if ib < nb {
        // The scalar tail: `sumf += sumi * dx * dy`, fused.
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let (xl, xh) = q4_0_values(xb);
            let dx = fp16(xb.d);
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                let (yl, yh) = load_q8(&yb.qs);
                let sumi = vaddvq_s32(D::dot2_small(xl, yl, xh, yh));
                out[r][t] = (sumi as f32 * dx).mul_add(fp16(yb.d), out[r][t]);
            }
        }
    }
    out
}

#[inline(always)]
unsafe fn q4_1_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ4_1]; R],
    ys: [&[BlockQ8_1]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let (mut out, ib) = if T == 1 {
        decode_pairs::<D, FmtQ4_1, R, T>(&xs, ys[0], nb)
    } else {
        let mut acc0 = [[vdupq_n_f32(0.0); T]; R];
        let mut acc1 = [[vdupq_n_f32(0.0); T]; R];
        // The offset sums of all rows, lane `r` (GGML's scalar `summs`).
        let mut summs = [vdupq_n_f32(0.0); T];
        let mut ib = 0;
        while ib + 1 < nb {
            let dx0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).d);
            let dx1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).d);
            let m0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).m);
            let m1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).m);
            unroll!(t in 0..T => {
                let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                // `summs += m0 * s0 + m1 * s1`: the first product fused.
                let (s0, s1) = (fp16(y0.s), fp16(y1.s));
                summs[t] = vaddq_f32(summs[t], vfmaq_n_f32(vmulq_n_f32(m1, s1), m0, s0));
            });
            unroll!(r in 0..R => {
                let (x0l, x0h) = nibbles(&xs[r].get_unchecked(ib).qs);
                let (x1l, x1h) = nibbles(&xs[r].get_unchecked(ib + 1).qs);
                unroll!(t in 0..T => {
                    let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                    let (y0l, y0h) = load_q8(&y0.qs);
                    let (y1l, y1h) = load_q8(&y1.qs);
                    let s0 = vmulq_n_f32(dx0, fp16(y0.d));
                    let s1 = vmulq_n_f32(dx1, fp16(y1.d));
                    acc0[r][t] = mla_n(acc0[r][t], D::dot2_small(x0l, y0l, x0h, y0h), lane(s0, r));
                    acc1[r][t] = mla_n(acc1[r][t], D::dot2_small(x1l, y1l, x1h, y1h), lane(s1, r));
                });
            });
            ib += 2;
        }
        let mut sums = reduce_pairs(&acc0, &acc1);
        for (sums, summs) in sums.iter_mut().zip(summs) {
            *sums = vaddq_f32(*sums, summs);
        }
        (row_outputs::<R, T>(&sums), ib)
    };
    if ib < nb {
        // `sumf += (dx * dy) * sumi + m * s`: the first product fused.
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let (xl, xh) = nibbles(&xb.qs);
            let (dx, m) = (fp16(xb.d), fp16(xb.m));
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                let (yl, yh) = load_q8(&yb.qs);
                let sumi = vaddvq_s32(D::dot2_small(xl, yl, xh, yh));
                out[r][t] += (dx * fp16(yb.d)).mul_add(sumi as f32, m * fp16(yb.s));
            }
        }
    }
    out
}

/// Q5_0's values as signed bytes, `value - 16`: the nibble where the 5th
/// bit is set, the nibble with 0xF0 (minus 16) where it is clear, which is
/// one shift-and-insert of the clear-bit masks per half.
#[inline(always)]
unsafe fn q5_0_values(xb: &BlockQ5_0) -> (int8x16_t, int8x16_t) {
    let v = vld1q_u8(xb.qs.as_ptr());
    let (cl, ch) = bit_masks(!u32::from_le_bytes(xb.qh));
    (
        vreinterpretq_s8_u8(vsliq_n_u8::<4>(v, cl)),
        vreinterpretq_s8_u8(vsriq_n_u8::<4>(ch, v)),
    )
}

#[inline(always)]
unsafe fn q5_0_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ5_0]; R],
    ys: [&[BlockQ8_0]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let (mut out, ib) = if T == 1 {
        decode_pairs::<D, FmtQ5_0, R, T>(&xs, ys[0], nb)
    } else {
        let mut acc0 = [[vdupq_n_f32(0.0); T]; R];
        let mut acc1 = [[vdupq_n_f32(0.0); T]; R];
        let mut ib = 0;
        while ib + 1 < nb {
            let dx0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).d);
            let dx1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).d);
            unroll!(r in 0..R => {
                let (x0l, x0h) = q5_0_values(xs[r].get_unchecked(ib));
                let (x1l, x1h) = q5_0_values(xs[r].get_unchecked(ib + 1));
                unroll!(t in 0..T => {
                    let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                    let (y0l, y0h) = load_q8(&y0.qs);
                    let (y1l, y1h) = load_q8(&y1.qs);
                    let s0 = vmulq_n_f32(dx0, fp16(y0.d));
                    let s1 = vmulq_n_f32(dx1, fp16(y1.d));
                    acc0[r][t] = mla_n(acc0[r][t], D::dot2_small(x0l, y0l, x0h, y0h), lane(s0, r));
                    acc1[r][t] = mla_n(acc1[r][t], D::dot2_small(x1l, y1l, x1h, y1h), lane(s1, r));
                });
            });
            ib += 2;
        }
        (row_outputs::<R, T>(&reduce_pairs(&acc0, &acc1)), ib)
    };
    if ib < nb {
        // `sumf += (dx * dy) * sumi`, fused.
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let (xl, xh) = q5_0_values(xb);
            let dx = fp16(xb.d);
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                let (yl, yh) = load_q8(&yb.qs);
                let sumi = vaddvq_s32(D::dot2_small(xl, yl, xh, yh));
                out[r][t] = (dx * fp16(yb.d)).mul_add(sumi as f32, out[r][t]);
            }
        }
    }
    out
}

/// Q5_1's values (0..32): the nibble with 0x10 where the 5th bit is set.
#[inline(always)]
unsafe fn q5_1_values(xb: &BlockQ5_1) -> (int8x16_t, int8x16_t) {
    let v = vld1q_u8(xb.qs.as_ptr());
    let (ml, mh) = bit_masks(u32::from_le_bytes(xb.qh));
    (
        vreinterpretq_s8_u8(vsliq_n_u8::<4>(v, vshrq_n_u8::<7>(ml))),
        vreinterpretq_s8_u8(vsriq_n_u8::<4>(vandq_u8(mh, vdupq_n_u8(0x10)), v)),
    )
}

#[inline(always)]
unsafe fn q5_1_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ5_1]; R],
    ys: [&[BlockQ8_1]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let (mut out, ib) = if T == 1 {
        decode_pairs::<D, FmtQ5_1, R, T>(&xs, ys[0], nb)
    } else {
        let mut acc0 = [[vdupq_n_f32(0.0); T]; R];
        let mut acc1 = [[vdupq_n_f32(0.0); T]; R];
        // GGML keeps one offset sum per accumulator here, each `+= m * s` fused
        // (all rows at once, lane `r`).
        let mut summs0 = [vdupq_n_f32(0.0); T];
        let mut summs1 = [vdupq_n_f32(0.0); T];
        let mut ib = 0;
        while ib + 1 < nb {
            let dx0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).d);
            let dx1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).d);
            let m0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).m);
            let m1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).m);
            unroll!(t in 0..T => {
                let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                let (s0, s1) = (fp16(y0.s), fp16(y1.s));
                summs0[t] = vfmaq_n_f32(summs0[t], m0, s0);
                summs1[t] = vfmaq_n_f32(summs1[t], m1, s1);
            });
            unroll!(r in 0..R => {
                let (x0l, x0h) = q5_1_values(xs[r].get_unchecked(ib));
                let (x1l, x1h) = q5_1_values(xs[r].get_unchecked(ib + 1));
                unroll!(t in 0..T => {
                    let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                    let (y0l, y0h) = load_q8(&y0.qs);
                    let (y1l, y1h) = load_q8(&y1.qs);
                    let s0 = vmulq_n_f32(dx0, fp16(y0.d));
                    let s1 = vmulq_n_f32(dx1, fp16(y1.d));
                    acc0[r][t] = mla_n(acc0[r][t], D::dot2_small(x0l, y0l, x0h, y0h), lane(s0, r));
                    acc1[r][t] = mla_n(acc1[r][t], D::dot2_small(x1l, y1l, x1h, y1h), lane(s1, r));
                });
            });
            ib += 2;
        }
        let mut sums = reduce_pairs(&acc0, &acc1);
        for (t, sums) in sums.iter_mut().enumerate() {
            *sums = vaddq_f32(vaddq_f32(*sums, summs0[t]), summs1[t]);
        }
        (row_outputs::<R, T>(&sums), ib)
    };
    if ib < nb {
        // `sumf += (dx * dy) * sumi + m * s`: the first product fused.
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let (xl, xh) = q5_1_values(xb);
            let (dx, m) = (fp16(xb.d), fp16(xb.m));
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                let (yl, yh) = load_q8(&yb.qs);
                let sumi = vaddvq_s32(D::dot2_small(xl, yl, xh, yh));
                out[r][t] += (dx * fp16(yb.d)).mul_add(sumi as f32, m * fp16(yb.s));
            }
        }
    }
    out
}

#[inline(always)]
unsafe fn q8_0_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ8_0]; R],
    ys: [&[BlockQ8_0]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let (mut out, ib) = if T == 1 {
        decode_pairs::<D, FmtQ8_0, R, T>(&xs, ys[0], nb)
    } else {
        let mut acc0 = [[vdupq_n_f32(0.0); T]; R];
        let mut acc1 = [[vdupq_n_f32(0.0); T]; R];
        let mut ib = 0;
        while ib + 1 < nb {
            let dx0 = row_scales::<R>(|r| &xs[r].get_unchecked(ib).d);
            let dx1 = row_scales::<R>(|r| &xs[r].get_unchecked(ib + 1).d);
            unroll!(r in 0..R => {
                let (x0l, x0h) = load_q8(&xs[r].get_unchecked(ib).qs);
                let (x1l, x1h) = load_q8(&xs[r].get_unchecked(ib + 1).qs);
                unroll!(t in 0..T => {
                    let (y0, y1) = (ys[t].get_unchecked(ib), ys[t].get_unchecked(ib + 1));
                    let (y0l, y0h) = load_q8(&y0.qs);
                    let (y1l, y1h) = load_q8(&y1.qs);
                    let s0 = vmulq_n_f32(dx0, fp16(y0.d));
                    let s1 = vmulq_n_f32(dx1, fp16(y1.d));
                    acc0[r][t] = mla_n(acc0[r][t], D::dot2(x0l, y0l, x0h, y0h), lane(s0, r));
                    acc1[r][t] = mla_n(acc1[r][t], D::dot2(x1l, y1l, x1h, y1h), lane(s1, r));
                });
            });
            ib += 2;
        }
        (row_outputs::<R, T>(&reduce_pairs(&acc0, &acc1)), ib)
    };
    if ib < nb {
        // `sumf += sumi * (dx * dy)`, fused.
        for r in 0..R {
            let xb = xs[r].get_unchecked(ib);
            let (xl, xh) = load_q8(&xb.qs);
            let dx = fp16(xb.d);
            for t in 0..T {
                let yb = ys[t].get_unchecked(ib);
                let (yl, yh) = load_q8(&yb.qs);
                let sumi = vaddvq_s32(D::dot2(xl, yl, xh, yh));
                out[r][t] = (sumi as f32).mul_add(dx * fp16(yb.d), out[r][t]);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------
// K super-blocks. GGML sums `vaddvq_s32(dot) * scale` per sub-block in
// scalar registers; here the lanes are scaled and summed as vectors and
// reduced once per super-block, which is the same exact integer (no sum can
// leave i32: at most 256 · 63 · 128 · 127 in magnitude). Only lane sums
// matter, so both forms give the same results.

/// The eight 6-bit scales and mins of a Q4_K/Q5_K block (GGML's `kmask`
/// unpacking, as `unpack_scales_mins_k4`).
#[inline(always)]
fn k4_scales_mins(scales: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let [u0, u1, u2]: [u32; 3] = bytemuck::cast(*scales);
    let mins_lo = u1 & KMASK1;
    let mins_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let scales_lo = u0 & KMASK1;
    let scales_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    (
        bytemuck::cast([scales_lo, scales_hi]),
        bytemuck::cast([mins_lo, mins_hi]),
    )
}

/// `Σ_s mins[s] * (bsums[2s] + bsums[2s + 1])`, exact.
#[inline(always)]
unsafe fn k4_min_sum(mins: &[u8; 8], yb: &BlockQ8K) -> i32 {
    let q8sums = vpaddq_s16(vld1q_s16(yb.bsums.as_ptr()), vld1q_s16(yb.bsums.as_ptr().add(8)));
    let mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mins.as_ptr())));
    let prod = vaddq_s32(
        vmull_s16(vget_low_s16(q8sums), vget_low_s16(mins)),
        vmull_high_s16(q8sums, mins),
    );
    vaddvq_s32(prod)
}

/// The 64 activation quants `64 j..64 j + 64` of a Q8_K block.
#[inline(always)]
unsafe fn load_q8k_64(yb: &BlockQ8K, j: usize) -> [int8x16_t; 4] {
    let p = yb.qs.as_ptr().add(64 * j);
    [
        vld1q_s8(p),
        vld1q_s8(p.add(16)),
        vld1q_s8(p.add(32)),
        vld1q_s8(p.add(48)),
    ]
}

/// `v`, through an empty `asm` block so that LLVM cannot see where it came
/// from (no instructions).
#[inline(always)]
unsafe fn opaque(mut v: int32x4_t) -> int32x4_t {
    asm!("/* {v:v} */", v = inout(vreg) v, options(pure, nomem, nostack, preserves_flags));
    v
}

/// `[Σ v[0], .., Σ v[R - 1]]` (lanes past `R` repeat the last), exact.
#[inline(always)]
unsafe fn row_sums<const R: usize>(v: &[int32x4_t; R]) -> int32x4_t {
    let row = |r: usize| v[r.min(R - 1)];
    vpaddq_s32(vpaddq_s32(row(0), row(1)), vpaddq_s32(row(2), row(3)))
}

/// The f16 at `p` into lane `lane` (< 4) of `v`.
#[inline(always)]
unsafe fn half_lane(p: &f16, v: uint16x4_t, lane: usize) -> uint16x4_t {
    let p = p as *const f16 as *const u16;
    match lane {
        0 => vld1_lane_u16::<0>(p, v),
        1 => vld1_lane_u16::<1>(p, v),
        2 => vld1_lane_u16::<2>(p, v),
        _ => vld1_lane_u16::<3>(p, v),
    }
}

/// `acc + p * v[lane]` (`lane` < 4).
#[inline(always)]
unsafe fn mla_lane(acc: int32x4_t, p: int32x4_t, v: int32x4_t, lane: usize) -> int32x4_t {
    match lane {
        0 => vmlaq_laneq_s32::<0>(acc, p, v),
        1 => vmlaq_laneq_s32::<1>(acc, p, v),
        2 => vmlaq_laneq_s32::<2>(acc, p, v),
        _ => vmlaq_laneq_s32::<3>(acc, p, v),
    }
}

/// [`k4_scales_mins`] in vector registers: the 12 bytes (and the first 4
/// quant bytes, unused) as one vector `[b0..b12, ..]`; the low 6 bits of
/// `b0..b4` (scales 0..4) and `b4..b8` (mins 0..4); and for scales and mins
/// 4..8 the nibbles of `b8..b12` (low, high) with the top 2 bits of
/// `b0..b4`, `b4..b8` above them.
#[inline(always)]
unsafe fn k4_scales_mins_v(xb: &BlockQ4K) -> (uint8x8_t, uint8x8_t) {
    const SPREAD: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11];
    const NIBBLE: [i8; 8] = [0, 0, 0, 0, -4, -4, -4, -4];
    let v = vqtbl1q_u8(vld1q_u8(xb.scales.as_ptr()), vld1q_u8(SPREAD.as_ptr()));
    // [s0..4, m0..4] and [s4..8, m4..8].
    let low = vand_u8(vget_low_u8(v), vdup_n_u8(63));
    let nibbles = vand_u8(vshl_u8(vget_high_u8(v), vld1_s8(NIBBLE.as_ptr())), vdup_n_u8(0x0F));
    let high = vsli_n_u8::<4>(nibbles, vshr_n_u8::<6>(vget_low_u8(v)));
    let (low, high) = (vreinterpret_u32_u8(low), vreinterpret_u32_u8(high));
    (
        vreinterpret_u8_u32(vzip1_u32(low, high)),
        vreinterpret_u8_u32(vzip2_u32(low, high)),
    )
}

/// `q4_k_body` with one activation row and `R <= 4` weight rows (the
/// decode tiles): the same integers and float updates, the rows' integer
/// sums reduced together and their float updates made together (lane `r`).
#[inline(always)]
unsafe fn q4_k_decode<D: ByteDot, const R: usize, const T: usize>(
    xs: &[&[BlockQ4K]; R],
    y: &[BlockQ8K],
    nb: usize,
) -> [[f32; T]; R] {
    const { assert!(R <= 4) };
    let mut sumf = vdupq_n_f32(0.0);
    for i in 0..nb {
        let yb = y.get_unchecked(i);
        let q8sums = vpaddq_s16(vld1q_s16(yb.bsums.as_ptr()), vld1q_s16(yb.bsums.as_ptr().add(8)));
        let mut scales = [[vdupq_n_s32(0); 2]; R];
        let mut mins = [vdupq_n_s32(0); R];
        let (mut xd, mut xdmin) = (vdup_n_u16(0), vdup_n_u16(0));
        unroll!(r in 0..R => {
            let xb = xs[r].get_unchecked(i);
            xd = half_lane(&xb.d, xd, r);
            xdmin = half_lane(&xb.dmin, xdmin, r);
            let (sc, mn) = k4_scales_mins_v(xb);
            let sc = vmovl_u8(sc);
            // Opaque, or LLVM makes each lane a vector of its own
            // (`dup` and `uxtl`) for the multiplies by lane below.
            scales[r] = [
                opaque(vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(sc)))),
                opaque(vreinterpretq_s32_u32(vmovl_high_u16(sc))),
            ];
            // `k4_min_sum`'s products, summed below.
            let mn = vreinterpretq_s16_u16(vmovl_u8(mn));
            mins[r] = vaddq_s32(vmull_s16(vget_low_s16(q8sums), vget_low_s16(mn)), vmull_high_s16(q8sums, mn));
        });
        let mut sumi = [vdupq_n_s32(0); R];
        unroll!(j in 0..QK_K / 64 => {
            let q8 = load_q8k_64(yb, j);
            unroll!(r in 0..R => {
                let (p1, p2) = D::nibble_dots(xs[r].get_unchecked(i).qs.as_ptr().add(32 * j), &q8);
                sumi[r] = mla_lane(sumi[r], p1, scales[r][j / 2], (2 * j) % 4);
                sumi[r] = mla_lane(sumi[r], p2, scales[r][j / 2], (2 * j + 1) % 4);
            });
        });
        let d = vmulq_n_f32(widen_f16x4(xd), yb.d);
        let dmin = vmulq_n_f32(widen_f16x4(xdmin), yb.d);
        // `sumf -= dmin * mins` then `sumf += d * sumi`, each fused.
        sumf = vfmsq_f32(sumf, dmin, vcvtq_f32_s32(row_sums(&mins)));
        sumf = vfmaq_f32(sumf, d, vcvtq_f32_s32(row_sums(&sumi)));
    }
    let mut out = [[0.0f32; T]; R];
    for (r, out) in out.iter_mut().enumerate() {
        out[0] = lane(sumf, r);
    }
    out
}

#[inline(always)]
unsafe fn q4_k_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ4K]; R],
    ys: [&[BlockQ8K]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    if T == 1 {
        return q4_k_decode::<D, R, T>(&xs, ys[0], nb);
    }
    let m4b = vdupq_n_u8(0x0F);
    let mut sumf = [[0.0f32; T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let (scales, mins) = k4_scales_mins(&xb.scales);
            let mut sumi = [vdupq_n_s32(0); T];
            for j in 0..QK_K / 64 {
                let q = xb.qs.as_ptr().add(32 * j);
                let (b0, b1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
                let lo = [
                    vreinterpretq_s8_u8(vandq_u8(b0, m4b)),
                    vreinterpretq_s8_u8(vandq_u8(b1, m4b)),
                ];
                let hi = [
                    vreinterpretq_s8_u8(vshrq_n_u8::<4>(b0)),
                    vreinterpretq_s8_u8(vshrq_n_u8::<4>(b1)),
                ];
                for t in 0..T {
                    let q8 = load_q8k_64(ys[t].get_unchecked(i), j);
                    let p1 = D::dot2_small(lo[0], q8[0], lo[1], q8[1]);
                    let p2 = D::dot2_small(hi[0], q8[2], hi[1], q8[3]);
                    sumi[t] = vmlaq_n_s32(sumi[t], p1, scales[2 * j] as i32);
                    sumi[t] = vmlaq_n_s32(sumi[t], p2, scales[2 * j + 1] as i32);
                }
            }
            let (xd, xdmin) = (fp16(xb.d), fp16(xb.dmin));
            for t in 0..T {
                let yb = ys[t].get_unchecked(i);
                let d = yb.d * xd;
                let dmin = yb.d * xdmin;
                // `sumf -= dmin * mins` then `sumf += d * sumi`, each fused.
                sumf[r][t] = (-dmin).mul_add(k4_min_sum(&mins, yb) as f32, sumf[r][t]);
                sumf[r][t] = d.mul_add(vaddvq_s32(sumi[t]) as f32, sumf[r][t]);
            }
        }
    }
    sumf
}

#[inline(always)]
unsafe fn q5_k_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ5K]; R],
    ys: [&[BlockQ8K]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    let m4b = vdupq_n_u8(0x0F);
    let mone = vdupq_n_u8(1);
    let mtwo = vdupq_n_u8(2);
    let mut sumf = [[0.0f32; T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let (scales, mins) = k4_scales_mins(&xb.scales);
            let mut qh = [vld1q_u8(xb.qh.as_ptr()), vld1q_u8(xb.qh.as_ptr().add(16))];
            let mut sumi = [vdupq_n_s32(0); T];
            for j in 0..QK_K / 64 {
                let q = xb.qs.as_ptr().add(32 * j);
                let (b0, b1) = (vld1q_u8(q), vld1q_u8(q.add(16)));
                let h = [
                    vshlq_n_u8::<4>(vandq_u8(mone, qh[0])),
                    vshlq_n_u8::<4>(vandq_u8(mone, qh[1])),
                    vshlq_n_u8::<3>(vandq_u8(mtwo, qh[0])),
                    vshlq_n_u8::<3>(vandq_u8(mtwo, qh[1])),
                ];
                qh = [vshrq_n_u8::<2>(qh[0]), vshrq_n_u8::<2>(qh[1])];
                let v = [
                    vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b0, m4b), h[0])),
                    vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b1, m4b), h[1])),
                    vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(b0), h[2])),
                    vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(b1), h[3])),
                ];
                for t in 0..T {
                    let q8 = load_q8k_64(ys[t].get_unchecked(i), j);
                    let p1 = D::dot2(v[0], q8[0], v[1], q8[1]);
                    let p2 = D::dot2(v[2], q8[2], v[3], q8[3]);
                    sumi[t] = vmlaq_n_s32(sumi[t], p1, scales[2 * j] as i32);
                    sumi[t] = vmlaq_n_s32(sumi[t], p2, scales[2 * j + 1] as i32);
                }
            }
            let (xd, xdmin) = (fp16(xb.d), fp16(xb.dmin));
            for t in 0..T {
                let yb = ys[t].get_unchecked(i);
                let d = yb.d * xd;
                let dmin = yb.d * xdmin;
                // `sumf += d * sumi - dmin * mins`: the first product fused
                // with the second (rounded) subtracted, then the add.
                let mins = dmin * k4_min_sum(&mins, yb) as f32;
                sumf[r][t] += d.mul_add(vaddvq_s32(sumi[t]) as f32, -mins);
            }
        }
    }
    sumf
}

/// Q6_K's unsigned 6-bit values of one 128-value step, 16 per vector in
/// GGML's order: vector `v` holds 16 low nibbles (`v < 4`) or high nibbles
/// of `ql[v % 4]`, with the bits `2 (v / 2) .. 2 (v / 2) + 2` of
/// `qh[v % 2]` above them.
#[inline(always)]
unsafe fn q6_k_values(ql: *const u8, qh: *const u8) -> [uint8x16_t; 8] {
    let m4b = vdupq_n_u8(0x0F);
    let mthree = vdupq_n_u8(3);
    let qh = [vld1q_u8(qh), vld1q_u8(qh.add(16))];
    let ql = [
        vld1q_u8(ql),
        vld1q_u8(ql.add(16)),
        vld1q_u8(ql.add(32)),
        vld1q_u8(ql.add(48)),
    ];
    // Bits 2k, 2k + 1 of qh are the high bits of quarter k (of 32 values).
    let high = |k: usize, half: usize| -> uint8x16_t {
        let bits = match k {
            0 => qh[half],
            1 => vshrq_n_u8::<2>(qh[half]),
            2 => vshrq_n_u8::<4>(qh[half]),
            _ => vshrq_n_u8::<6>(qh[half]),
        };
        vshlq_n_u8::<4>(vandq_u8(mthree, bits))
    };
    [
        vorrq_u8(vandq_u8(ql[0], m4b), high(0, 0)),
        vorrq_u8(vandq_u8(ql[1], m4b), high(0, 1)),
        vorrq_u8(vandq_u8(ql[2], m4b), high(1, 0)),
        vorrq_u8(vandq_u8(ql[3], m4b), high(1, 1)),
        vorrq_u8(vshrq_n_u8::<4>(ql[0]), high(2, 0)),
        vorrq_u8(vshrq_n_u8::<4>(ql[1]), high(2, 1)),
        vorrq_u8(vshrq_n_u8::<4>(ql[2]), high(3, 0)),
        vorrq_u8(vshrq_n_u8::<4>(ql[3]), high(3, 1)),
    ]
}

/// `q6_k_body` with one activation row and `R <= 4` weight rows (the
/// decode tiles): the same integers and float updates, the rows' integer
/// sums reduced together and their float updates made together (lane `r`).
#[inline(always)]
unsafe fn q6_k_decode<D: ByteDot, const R: usize, const T: usize>(
    xs: &[&[BlockQ6K]; R],
    y: &[BlockQ8K],
    nb: usize,
) -> [[f32; T]; R] {
    const { assert!(R <= 4) };
    let mut sum = vdupq_n_f32(0.0);
    for i in 0..nb {
        let yb = y.get_unchecked(i);
        let mut sumi = [vdupq_n_s32(0); R];
        let mut prod = [vdupq_n_s32(0); R];
        let mut xd = vdup_n_u16(0);
        let (b_lo, b_hi) = (vld1q_s16(yb.bsums.as_ptr()), vld1q_s16(yb.bsums.as_ptr().add(8)));
        unroll!(r in 0..R => {
            let xb = xs[r].get_unchecked(i);
            xd = half_lane(&xb.d, xd, r);
            let scales = vld1q_s8(xb.scales.as_ptr());
            let (s_lo, s_hi) = (vmovl_s8(vget_low_s8(scales)), vmovl_high_s8(scales));
            prod[r] = vaddq_s32(
                vaddq_s32(vmull_s16(vget_low_s16(b_lo), vget_low_s16(s_lo)), vmull_high_s16(b_lo, s_lo)),
                vaddq_s32(vmull_s16(vget_low_s16(b_hi), vget_low_s16(s_hi)), vmull_high_s16(b_hi, s_hi)),
            );
        });
        unroll!(j in 0..QK_K / 128 => {
            let lo = load_q8k_64(yb, 2 * j);
            let hi = load_q8k_64(yb, 2 * j + 1);
            let q8 = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
            unroll!(r in 0..R => {
                let xb = xs[r].get_unchecked(i);
                // This step's eight scales as i32 lanes (opaque: see `q4_k_decode`).
                let sc = vmovl_s8(vld1_s8(xb.scales.as_ptr().add(8 * j)));
                let sc = [opaque(vmovl_s16(vget_low_s16(sc))), opaque(vmovl_high_s16(sc))];
                sumi[r] = D::q6_k_step(xb.ql.as_ptr().add(64 * j), xb.qh.as_ptr().add(32 * j), &q8, &sc, sumi[r]);
            });
        });
        // `isum - 32 * isum_mins`, then `sum += d_all * y.d * that`, the
        // last product fused.
        let isum = vsubq_s32(row_sums(&sumi), vshlq_n_s32::<5>(row_sums(&prod)));
        let d = vmulq_n_f32(widen_f16x4(xd), yb.d);
        sum = vfmaq_f32(sum, d, vcvtq_f32_s32(isum));
    }
    let mut out = [[0.0f32; T]; R];
    for (r, out) in out.iter_mut().enumerate() {
        out[0] = lane(sum, r);
    }
    out
}

#[inline(always)]
unsafe fn q6_k_body<D: ByteDot, const R: usize, const T: usize>(
    xs: [&[BlockQ6K]; R],
    ys: [&[BlockQ8K]; T],
) -> [[f32; T]; R] {
    let nb = common_len(&xs, &ys);
    if T == 1 {
        return q6_k_decode::<D, R, T>(&xs, ys[0], nb);
    }
    let mut sum = [[0.0f32; T]; R];
    for i in 0..nb {
        for r in 0..R {
            let xb = xs[r].get_unchecked(i);
            let mut sumi = [vdupq_n_s32(0); T];
            for j in 0..QK_K / 128 {
                let values = q6_k_values(xb.ql.as_ptr().add(64 * j), xb.qh.as_ptr().add(32 * j));
                for t in 0..T {
                    let lo = load_q8k_64(ys[t].get_unchecked(i), 2 * j);
                    let hi = load_q8k_64(ys[t].get_unchecked(i), 2 * j + 1);
                    let q8 = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                    for v in 0..8 {
                        let p = D::dot(vdupq_n_s32(0), vreinterpretq_s8_u8(values[v]), q8[v]);
                        sumi[t] = vmlaq_n_s32(sumi[t], p, *xb.scales.get_unchecked(8 * j + v) as i32);
                    }
                }
            }
            let d_all = fp16(xb.d);
            let scales = vld1q_s8(xb.scales.as_ptr());
            let (s_lo, s_hi) = (vmovl_s8(vget_low_s8(scales)), vmovl_high_s8(scales));
            for t in 0..T {
                let yb = ys[t].get_unchecked(i);
                let (b_lo, b_hi) = (vld1q_s16(yb.bsums.as_ptr()), vld1q_s16(yb.bsums.as_ptr().add(8)));
                let prod = vaddq_s32(
                    vaddq_s32(
                        vmull_s16(vget_low_s16(b_lo), vget_low_s16(s_lo)),
                        vmull_high_s16(b_lo, s_lo),
                    ),
                    vaddq_s32(
                        vmull_s16(vget_low_s16(b_hi), vget_low_s16(s_hi)),
                        vmull_high_s16(b_hi, s_hi),
                    ),
                );
                let isum = vaddvq_s32(sumi[t]) - 32 * vaddvq_s32(prod);
                // `sum += d_all * y.d * (isum - 32 * isum_mins)`: the last product fused.
                sum[r][t] = (d_all * yb.d).mul_add(isum as f32, sum[r][t]);
            }
        }
    }
    sum
}

// ---------------------------------------------------------------------------
// Float rows: `GGML_F32_STEP` 16 with four `float32x4_t` accumulators
// (`vfmaq_f32`), `GGML_F32x4_REDUCE`: (0 + 2), (1 + 3), then their sum,
// then `vaddvq_f32`.

#[inline(always)]
unsafe fn reduce_4x4(sum: [float32x4_t; 4]) -> f32 {
    let s02 = vaddq_f32(sum[0], sum[2]);
    let s13 = vaddq_f32(sum[1], sum[3]);
    vaddvq_f32(vaddq_f32(s02, s13))
}

/// `ggml_vec_dot_f32` (NEON). The tail `sumf += x[i] * y[i]`, as GCC
/// compiles it: runs of 4 have their products rounded before the in-order
/// adds (a vectorized multiply), the last `n % 4` are fused.
unsafe fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !15;
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut sum = [vdupq_n_f32(0.0); 4];
    for i in (0..np).step_by(16) {
        for (j, s) in sum.iter_mut().enumerate() {
            *s = vfmaq_f32(*s, vld1q_f32(xp.add(i + 4 * j)), vld1q_f32(yp.add(i + 4 * j)));
        }
    }
    let mut sumf = reduce_4x4(sum);
    let unfused = n & !3;
    for i in np..unfused {
        sumf += x.get_unchecked(i) * y.get_unchecked(i);
    }
    for i in unfused..n {
        sumf = x.get_unchecked(i).mul_add(*y.get_unchecked(i), sumf);
    }
    sumf
}

/// `ggml_vec_dot_f16` (NEON without FP16 arithmetic): as the f32 dot on
/// widened halves, the reduced sum and the tail accumulated in f64.
unsafe fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !15;
    let (xp, yp) = (x.as_ptr(), y.as_ptr());
    let mut sum = [vdupq_n_f32(0.0); 4];
    for i in (0..np).step_by(16) {
        for (j, s) in sum.iter_mut().enumerate() {
            *s = vfmaq_f32(*s, load_f16x4(xp.add(i + 4 * j)), load_f16x4(yp.add(i + 4 * j)));
        }
    }
    let mut sumf = reduce_4x4(sum) as f64;
    for i in np..n {
        sumf += (fp16(*x.get_unchecked(i)) * fp16(*y.get_unchecked(i))) as f64;
    }
    sumf as f32
}

#[cfg(test)]
mod tests {
    //! Both forms against each other and against single dots bit for bit,
    //! each against its scalar twin within rounding. Under
    //! `QEMU_CPU=cortex-a72` only the plain form runs; the `sdot` checks say
    //! so and skip.

    use bytemuck::Pod;

    use super::*;
    use crate::dequant::dequantize_row;
    use crate::dot::{has_neon_dotprod, scalar, TileFn};
    use crate::quantize::quantize_row;
    use crate::GgmlType;

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Bytes at the edges of the byte products' range (-128 · -128 and the
    /// like), or random ones.
    fn fill(bytes: &mut [u8], rng: &mut Rng) {
        let mode = rng.next() % 6;
        for b in bytes.iter_mut() {
            let r = rng.next() as u8;
            *b = match mode {
                0 => 0x80,
                1 => 0x7F,
                2 => 0x81,
                3 => [0x80, 0x7F, 0x81, 0xFF, 0x00, 0x01][(r % 6) as usize],
                _ => r,
            };
        }
    }

    /// Where a block type keeps its scales: f16 fields at `f16s`, f32 at `f32s`.
    fn scale_fields(ty: GgmlType) -> (&'static [usize], &'static [usize]) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => (&[0], &[]),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 | GgmlType::Q4K | GgmlType::Q5K => (&[0, 2], &[]),
            GgmlType::Q6K => (&[208], &[]),
            GgmlType::Q8K => (&[], &[0]),
            _ => unreachable!("{ty}"),
        }
    }

    /// `count` blocks of `ty` with arbitrary quants and finite scales.
    fn raw_blocks<B: Pod>(ty: GgmlType, count: usize, rng: &mut Rng) -> Vec<B> {
        let mut blocks = vec![B::zeroed(); count];
        let scales = [1.0f32, -0.5, 0.0123, 3.0, 6.0e-8, -3.0e-3, 0.0];
        let (f16s, f32s) = scale_fields(ty);
        for block in blocks.iter_mut() {
            let bytes = bytemuck::bytes_of_mut(block);
            fill(bytes, rng);
            for &o in f16s {
                let d = f16::from_f32(scales[(rng.next() % scales.len() as u64) as usize]);
                bytes[o..o + 2].copy_from_slice(&d.to_le_bytes());
            }
            for &o in f32s {
                let d = scales[(rng.next() % scales.len() as u64) as usize] / 100.0;
                bytes[o..o + 4].copy_from_slice(&d.to_le_bytes());
            }
        }
        blocks
    }

    /// Each form of one format, tiled every way a caller can ask (1..=5 rows
    /// by 1..=9 activation rows, odd and even block counts), against single
    /// dots of the same form, bit for bit; and, where `same` (the formats
    /// that do not depend on lanes), the two forms against each other.
    fn check_forms<W: Pod, A: Pod>(ty: GgmlType, plain: TileFn<W, A>, dotprod: TileFn<W, A>, same: bool) {
        let dot_ty = ty.vec_dot_type();
        let forms: &[(&str, TileFn<W, A>)] = if has_neon_dotprod() {
            &[("plain", plain), ("sdot", dotprod)]
        } else {
            eprintln!("{ty}: no FEAT_DotProd on this CPU, the sdot form is not checked");
            &[("plain", plain)]
        };
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ty.block_size() as u64);
        for blocks in [1usize, 2, 3, 8] {
            for rows in 1..=5 {
                for tokens in 1..=9 {
                    let ws: Vec<Vec<W>> = (0..rows).map(|_| raw_blocks(ty, blocks, &mut rng)).collect();
                    let ys: Vec<Vec<A>> = (0..tokens).map(|_| raw_blocks(dot_ty, blocks, &mut rng)).collect();
                    let ws: Vec<&[W]> = ws.iter().map(|w| &w[..]).collect();
                    let ys: Vec<&[A]> = ys.iter().map(|y| &y[..]).collect();
                    let mut plain_single = Vec::new();
                    for &(form, kernel) in forms {
                        let mut single = vec![0.0f32; rows * tokens];
                        for r in 0..rows {
                            for t in 0..tokens {
                                let mut out = [f32::NAN];
                                // SAFETY: the sdot form only where the CPU has it.
                                unsafe { kernel(&[ws[r]], &[ys[t]], &mut out) };
                                single[r * tokens + t] = out[0];
                            }
                        }
                        let mut got = vec![f32::NAN; rows * tokens];
                        // SAFETY: as above.
                        unsafe { kernel(&ws, &ys, &mut got) };
                        for (i, (s, g)) in single.iter().zip(&got).enumerate() {
                            assert_eq!(
                                s.to_bits(),
                                g.to_bits(),
                                "{ty} {form}: {blocks} blocks, {rows}x{tokens} tile, output {i}: {g} vs single {s}"
                            );
                        }
                        if form == "plain" {
                            plain_single = single;
                        } else if same {
                            for (i, (p, g)) in plain_single.iter().zip(&single).enumerate() {
                                assert_eq!(
                                    p.to_bits(),
                                    g.to_bits(),
                                    "{ty}: {blocks} blocks, output {i}: sdot {g} vs plain {p}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_agree_with_single_dots_bit_for_bit() {
        check_forms(GgmlType::Q4_0, q4_0_q8_0, q4_0_q8_0_dotprod, false);
        check_forms(GgmlType::Q4_1, q4_1_q8_1, q4_1_q8_1_dotprod, false);
        check_forms(GgmlType::Q5_0, q5_0_q8_0, q5_0_q8_0_dotprod, false);
        check_forms(GgmlType::Q5_1, q5_1_q8_1, q5_1_q8_1_dotprod, false);
        check_forms(GgmlType::Q8_0, q8_0_q8_0, q8_0_q8_0_dotprod, false);
        check_forms(GgmlType::Q4K, q4_k_q8_k, q4_k_q8_k_dotprod, true);
        check_forms(GgmlType::Q5K, q5_k_q8_k, q5_k_q8_k_dotprod, true);
        check_forms(GgmlType::Q6K, q6_k_q8_k, q6_k_q8_k_dotprod, true);
    }

    /// A weight row of `ty` with arbitrary quants and scales in a realistic
    /// range, activations quantized from random values as the engine does.
    fn realistic_pair(ty: GgmlType, n: usize, rng: &mut Rng) -> (Vec<u64>, Vec<u64>, Vec<f32>) {
        let w_bytes = ty.row_bytes(n).unwrap();
        let a_bytes = ty.vec_dot_type().row_bytes(n).unwrap();
        let mut w = vec![0u64; w_bytes.div_ceil(8)];
        let mut a = vec![0u64; a_bytes.div_ceil(8)];
        let x: Vec<f32> = (0..n)
            .map(|_| {
                let v = rng.unit();
                if rng.next().is_multiple_of(64) {
                    20.0 * v
                } else {
                    v
                }
            })
            .collect();
        let wb = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..w_bytes];
        match ty {
            GgmlType::F32 | GgmlType::F16 => {
                let v: Vec<f32> = (0..n).map(|_| 3.0 * rng.unit()).collect();
                quantize_row(ty, &v, wb).unwrap();
            }
            _ => {
                for b in wb.iter_mut() {
                    *b = rng.next() as u8;
                }
                let block_bytes = ty.row_bytes(ty.block_size()).unwrap();
                let (f16s, _) = scale_fields(ty);
                for block in wb.chunks_mut(block_bytes) {
                    for &o in f16s {
                        let d = f16::from_f32(rng.unit() * [1.0, 0.05, 2e-3][(rng.next() % 3) as usize]);
                        block[o..o + 2].copy_from_slice(&d.to_le_bytes());
                    }
                }
            }
        }
        quantize_row(
            ty.vec_dot_type(),
            &x,
            &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a)[..a_bytes],
        )
        .unwrap();
        (w, a, x)
    }

    /// Σ |w_i · a_i| in f64 over the dequantized rows, the scale rounding is
    /// measured against; plus, for the K formats, the offset terms apart
    /// (`dmin · m · a`), which GGML and the twins sum on their own.
    fn magnitude(ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f64 {
        let mut wf = vec![0.0f32; n];
        let mut af = vec![0.0f32; n];
        dequantize_row(ty, w, &mut wf).unwrap();
        dequantize_row(ty.vec_dot_type(), a, &mut af).unwrap();
        let mut mag: f64 = wf.iter().zip(&af).map(|(&p, &q)| (p as f64 * q as f64).abs()).sum();
        if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
            let bytes = if ty == GgmlType::Q4K { 144 } else { 176 };
            for (b, block) in w.chunks_exact(bytes).enumerate() {
                let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32() as f64;
                let (_, mins) = unpack_scales_mins_k4(block[4..16].try_into().unwrap());
                for (e, &q) in af[256 * b..256 * (b + 1)].iter().enumerate() {
                    mag += (dmin * mins[e / 32] as f64 * q as f64).abs();
                }
            }
        }
        mag
    }

    /// Each form of one format against its scalar twin on realistic rows:
    /// they sum in other orders, so to rounding: `(n / 16 + 16)` ulps of the
    /// magnitude (an add per block or per 16 values, plus the reductions).
    fn check_scalar<W: Pod, A: Pod>(ty: GgmlType, forms: &[(&str, TileFn<W, A>)], twin: fn(&[W], &[A]) -> f32) {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ ty.block_size() as u64);
        let lens: Vec<usize> = match ty {
            GgmlType::F32 | GgmlType::F16 => (1..=70).chain([255, 1000, 4099]).collect(),
            _ => [1usize, 2, 3, 4, 7, 16, 33]
                .iter()
                .map(|b| b * ty.block_size())
                .collect(),
        };
        for n in lens {
            for _ in 0..6 {
                let (w, a, _) = realistic_pair(ty, n, &mut rng);
                let wb = &bytemuck::cast_slice::<u64, u8>(&w)[..ty.row_bytes(n).unwrap()];
                let ab = &bytemuck::cast_slice::<u64, u8>(&a)[..ty.vec_dot_type().row_bytes(n).unwrap()];
                let wr: &[W] = cast_blocks(wb, "w").unwrap();
                let ar: &[A] = cast_blocks(ab, "a").unwrap();
                let want = twin(wr, ar);
                let tol = (n / 16 + 16) as f64 * f32::EPSILON as f64 * magnitude(ty, wb, ab, n);
                for &(form, kernel) in forms {
                    let mut got = [f32::NAN];
                    // SAFETY: the sdot form is only listed where the CPU has it.
                    unsafe { kernel(&[wr], &[ar], &mut got) };
                    let diff = (got[0] as f64 - want as f64).abs();
                    assert!(
                        diff <= tol,
                        "{ty} {form} n={n}: {} vs scalar twin {want} (diff {diff:e}, allowed {tol:e})",
                        got[0]
                    );
                }
            }
        }
    }

    fn both<W, A>(plain: TileFn<W, A>, dotprod: TileFn<W, A>) -> Vec<(&'static str, TileFn<W, A>)> {
        let mut forms = vec![("plain", plain)];
        if has_neon_dotprod() {
            forms.push(("sdot", dotprod));
        } else {
            eprintln!("no FEAT_DotProd on this CPU: the sdot form is not checked");
        }
        forms
    }

    #[test]
    fn kernels_agree_with_scalar_twins_to_rounding() {
        check_scalar(GgmlType::Q4_0, &both(q4_0_q8_0, q4_0_q8_0_dotprod), scalar::q4_0_q8_0);
        check_scalar(GgmlType::Q4_1, &both(q4_1_q8_1, q4_1_q8_1_dotprod), scalar::q4_1_q8_1);
        check_scalar(GgmlType::Q5_0, &both(q5_0_q8_0, q5_0_q8_0_dotprod), scalar::q5_0_q8_0);
        check_scalar(GgmlType::Q5_1, &both(q5_1_q8_1, q5_1_q8_1_dotprod), scalar::q5_1_q8_1);
        check_scalar(GgmlType::Q8_0, &both(q8_0_q8_0, q8_0_q8_0_dotprod), scalar::q8_0_q8_0);
        check_scalar(GgmlType::Q4K, &both(q4_k_q8_k, q4_k_q8_k_dotprod), scalar::q4_k_q8_k);
        check_scalar(GgmlType::Q5K, &both(q5_k_q8_k, q5_k_q8_k_dotprod), scalar::q5_k_q8_k);
        check_scalar(GgmlType::Q6K, &both(q6_k_q8_k, q6_k_q8_k_dotprod), scalar::q6_k_q8_k);
        check_scalar(GgmlType::F32, &[("neon", f32_f32 as TileFn<f32, f32>)], scalar::f32_f32);
        check_scalar(GgmlType::F16, &[("neon", f16_f16 as TileFn<f16, f16>)], scalar::f16_f16);
    }

    /// `acc + dot(a, b)` with lane `i` summing the products of bytes `lanes[i]`.
    fn model_lanes(lanes: [[usize; 4]; 4], acc: [i32; 4], a: &[i8; 16], b: &[i8; 16]) -> [i32; 4] {
        std::array::from_fn(|i| acc[i] + lanes[i].iter().map(|&k| a[k] as i32 * b[k] as i32).sum::<i32>())
    }

    fn lanes(v: int32x4_t) -> [i32; 4] {
        let mut out = [0i32; 4];
        // SAFETY: four lanes into four values.
        unsafe { vst1q_s32(out.as_mut_ptr(), v) };
        out
    }

    /// `dot(acc, a0, b0)`, `dot2` and `dot2_small` of `D`.
    #[inline(always)]
    unsafe fn form_lanes<D: ByteDot>(acc: int32x4_t, v: [int8x16_t; 4]) -> [[i32; 4]; 3] {
        [
            lanes(D::dot(acc, v[0], v[1])),
            lanes(D::dot2(v[0], v[1], v[2], v[3])),
            lanes(D::dot2_small(v[0], v[1], v[2], v[3])),
        ]
    }

    #[target_feature(enable = "dotprod")]
    unsafe fn sdot_lanes(acc: int32x4_t, v: [int8x16_t; 4]) -> [[i32; 4]; 3] {
        form_lanes::<Sdot>(acc, v)
    }

    /// Each byte dot's lanes are those of its llama.cpp build's
    /// `ggml_vdotq_s32`: GGML's emulation (bytes `2i, 2i + 1, 8 + 2i, 9 + 2i`)
    /// for the plain form, `sdot`'s (bytes `4i..4i + 4`) for the other; and
    /// `dot2`, `dot2_small` (where its contract holds) are two chained dots.
    #[test]
    fn byte_dots_have_their_builds_lanes() {
        assert_eq!(
            Plain::LANES,
            [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
        );
        assert_eq!(
            Sdot::LANES,
            [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
        );
        let mut rng = Rng(77);
        let dotprod = has_neon_dotprod();
        if !dotprod {
            eprintln!("no FEAT_DotProd on this CPU: sdot's lanes are not checked");
        }
        for round in 0..4000 {
            let mut bytes = [0u8; 68];
            fill(&mut bytes, &mut rng);
            let mut v: [[i8; 16]; 4] = std::array::from_fn(|j| {
                bytemuck::cast::<[u8; 16], [i8; 16]>(bytes[16 * j..16 * j + 16].try_into().unwrap())
            });
            // Half the rounds with weights in -32..=32, where `dot2_small` applies.
            let small = round % 2 == 0;
            if small {
                for j in [0, 2] {
                    for b in v[j].iter_mut() {
                        *b = (*b as i32 % 33) as i8;
                    }
                }
            }
            let acc = [(rng.next() % 100_000) as i32 - 50_000, 7, -3, bytes[64] as i32];
            for (name, lanes_of, got) in [
                ("plain", Plain::LANES, Some(unsafe_lanes::<Plain>(acc, &v))),
                // SAFETY: sdot only where detected.
                (
                    "sdot",
                    Sdot::LANES,
                    dotprod.then(|| unsafe { sdot_lanes(load(&acc), v.map(|x| vld1q_s8(x.as_ptr()))) }),
                ),
            ] {
                let Some([one, two, two_small]) = got else { continue };
                assert_eq!(one, model_lanes(lanes_of, acc, &v[0], &v[1]), "{name} dot {v:?}");
                let first = model_lanes(lanes_of, [0; 4], &v[0], &v[1]);
                let want2 = model_lanes(lanes_of, first, &v[2], &v[3]);
                assert_eq!(two, want2, "{name} dot2 {v:?}");
                if small {
                    assert_eq!(two_small, want2, "{name} dot2_small {v:?}");
                }
            }
        }
    }

    fn load(acc: &[i32; 4]) -> int32x4_t {
        // SAFETY: four values into four lanes.
        unsafe { vld1q_s32(acc.as_ptr()) }
    }

    fn unsafe_lanes<D: ByteDot>(acc: [i32; 4], v: &[[i8; 16]; 4]) -> [[i32; 4]; 3] {
        // SAFETY: only called with `Plain`, plain NEON.
        unsafe { form_lanes::<D>(load(&acc), v.map(|x| vld1q_s8(x.as_ptr()))) }
    }

    #[test]
    fn half_conversions_are_exact() {
        for bits in 0..=u16::MAX {
            let h = f16::from_bits(bits);
            let want = h.to_f32();
            let got = fp16(h);
            let widened = {
                let mut out = [0.0f32; 4];
                // SAFETY: four lanes into four values.
                unsafe { vst1q_f32(out.as_mut_ptr(), widen_f16x4(vdup_n_u16(bits))) };
                out
            };
            if want.is_nan() {
                assert!(got.is_nan() && widened.iter().all(|v| v.is_nan()), "{bits:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
                assert!(widened.iter().all(|v| v.to_bits() == want.to_bits()), "{bits:#06x}");
            }
        }
    }
}
