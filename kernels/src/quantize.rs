//! Activation quantization into the vec-dot types, exactly as GGML's CPU
//! backend for this machine does it, so dot products see the same integers as
//! llama.cpp.
//!
//! On x86_64, Q8_0 and Q8_1 follow the AVX2 `quantize_row_q8_0/q8_1` of
//! `ggml-cpu/arch/x86/quants.c`, which differ from the portable reference in
//! two ways: the multiplier is `127 / amax` (not `1 / (amax / 127)`) and
//! rounding is to nearest-even (`_mm256_round_ps`), not half-away-from-zero
//! (`roundf`). On aarch64 they follow the NEON code of
//! `ggml-cpu/arch/arm/quants.c`: the multiplier is the reference's
//! `1 / (amax / 127)` (0 when that is 0) and rounding is to nearest-even
//! (`vcvtnq_s32_f32`); the largest magnitude is the same whatever the order
//! of `vmaxq_f32`. The two multipliers differ by an ulp now and then, which
//! moves a value sitting near a rounding boundary to the next integer, so the
//! bytes (and the dot products) depend on the machine as llama.cpp's do;
//! [`q8_multiplier`] names both. Q8_K uses the reference
//! `quantize_row_q8_K_ref`, which both builds call (ARM's
//! `quantize_row_q8_K` is a wrapper around it), but not with the same
//! arithmetic: GCC for aarch64 contracts its `nearest_int(iscale * x)`,
//! i.e. `iscale * x + 12582912.0f`, into one fused multiply-add (`fmla`),
//! so the product is not rounded to f32 before it is rounded to an integer
//! (see [`quantize_block_q8_k_as`]).

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::blocks::*;
use crate::{GgmlType, KernelError};

/// Converts `x` into the dot type `ty` (F32, F16, BF16, Q8_0, Q8_1 or Q8_K),
/// writing exactly `ty.row_bytes(x.len())` bytes to `dst`. (Weights in
/// Q4_0 come from [`quantize_row_q4_0`].)
pub fn quantize_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    quantize_row_as(GgmlBuild::NATIVE, ty, x, dst)
}

/// [`quantize_row`] with the arithmetic of `build`'s llama.cpp, whatever the
/// machine: for bytes that must not depend on where they were made (files),
/// as against activations, which follow this machine's build.
pub fn quantize_row_as(build: GgmlBuild, ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    match ty {
        GgmlType::F32 => copy_row_f32(x, dst),
        GgmlType::F16 => convert_row_f16(x, dst),
        GgmlType::BF16 => convert_row_bf16(x, dst),
        GgmlType::Q8_0 => {
            check_lengths(GgmlType::Q8_0, x, dst)?;
            for_each_block(x, QK, dst, |xs, b| quantize_block_q8_0_as(build, xs, b));
            Ok(())
        }
        GgmlType::Q8_1 => {
            check_lengths(GgmlType::Q8_1, x, dst)?;
            for_each_block(x, QK, dst, |xs, b| quantize_block_q8_1_as(build, xs, b));
            Ok(())
        }
        GgmlType::Q8K => {
            check_lengths(GgmlType::Q8K, x, dst)?;
            for_each_block(x, QK_K, dst, |xs, b| quantize_block_q8_k_as(build, xs, b));
            Ok(())
        }
        other => Err(KernelError::UnsupportedType(format!(
            "{other} as an activation (dot) type"
        ))),
    }
}

/// Quantizes `x` into Q8_0 blocks (bytes of `[BlockQ8_0]`).
pub fn quantize_row_q8_0(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::Q8_0, x, dst)?;
    for_each_block(x, QK, dst, quantize_block_q8_0);
    Ok(())
}

/// Quantizes `x` into Q8_1 blocks (bytes of `[BlockQ8_1]`).
pub fn quantize_row_q8_1(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::Q8_1, x, dst)?;
    for_each_block(x, QK, dst, quantize_block_q8_1);
    Ok(())
}

/// Quantizes `x` into Q8_K super-blocks (bytes of `[BlockQ8K]`).
pub fn quantize_row_q8_k(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    quantize_row(GgmlType::Q8K, x, dst)
}

/// Quantizes `x` into Q4_0 blocks (bytes of `[BlockQ4_0]`) as GGML's
/// `quantize_row_q4_0_ref` does, which is also what `ggml_quantize_chunk`
/// (and so `llama-quantize` without an importance matrix) uses for Q4_0.
pub fn quantize_row_q4_0(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::Q4_0, x, dst)?;
    for_each_block(x, QK, dst, quantize_block_q4_0);
    Ok(())
}

/// Converts `x` to IEEE half precision (round to nearest even, as F16C does).
pub fn convert_row_f16(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::F16, x, dst)?;
    match bytemuck::try_cast_slice_mut::<u8, f16>(dst) {
        Ok(halves) => halves.convert_from_f32_slice(x),
        Err(_) => {
            for (bytes, &v) in dst.chunks_exact_mut(2).zip(x) {
                bytes.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Converts `x` to bfloat16 with GGML's rounding (see [`f32_to_bf16`]).
pub fn convert_row_bf16(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::BF16, x, dst)?;
    for (bytes, &v) in dst.chunks_exact_mut(2).zip(x) {
        bytes.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
    }
    Ok(())
}

/// Copies `x` as little-endian f32 bytes (the F32 "dot type").
pub fn copy_row_f32(x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_lengths(GgmlType::F32, x, dst)?;
    for (bytes, &v) in dst.chunks_exact_mut(4).zip(x) {
        bytes.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

/// GGML's `ggml_compute_fp32_to_bf16`: round to nearest even, NaNs kept
/// quiet. Written out rather than taken from `half` so the rule is GGML's.
pub fn f32_to_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_bits(((bits >> 16) | 64) as u16);
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    bf16::from_bits((bits.wrapping_add(rounding) >> 16) as u16)
}

/// One Q8_0 block from 32 values.
pub fn quantize_block_q8_0(xs: &[f32], block: &mut BlockQ8_0) {
    quantize_block_q8_0_as(GgmlBuild::NATIVE, xs, block)
}

/// One Q8_0 block from 32 values as `build` quantizes it.
pub fn quantize_block_q8_0_as(build: GgmlBuild, xs: &[f32], block: &mut BlockQ8_0) {
    #[cfg(target_arch = "aarch64")]
    if build == GgmlBuild::Aarch64 && xs.len() == QK {
        // SAFETY: NEON is part of the aarch64 baseline; 32 values.
        let (d, _) = unsafe { neon::q8_block(xs, &mut block.qs) };
        block.d = f16::from_f32(d);
        return;
    }
    let (d, multiplier) = q8_scale(xs, build);
    block.d = f16::from_f32(d);
    for (q, &v) in block.qs.iter_mut().zip(xs) {
        *q = nearest_int(v * multiplier) as i8;
    }
}

/// One Q4_0 block from 32 values: the value of largest magnitude, with its
/// sign, maps to -8 (`d = max / -8`); the others to `trunc(x / d + 8.5)`
/// clamped to 15, so the opposite extreme may land one step short.
pub fn quantize_block_q4_0(xs: &[f32], block: &mut BlockQ4_0) {
    // GGML keeps the first value of largest magnitude.
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in xs {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    block.d = f16::from_f32(d);
    let (lo, hi) = xs.split_at(QK / 2);
    for ((q, &x0), &x1) in block.qs.iter_mut().zip(lo).zip(hi) {
        // `(int8_t)(v + 8.5f)` truncates; v + 8.5 is at least 0.5 here.
        let q0 = ((x0 * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x1 * id + 8.5) as i8).min(15) as u8;
        *q = q0 | (q1 << 4);
    }
}

/// One Q8_1 block from 32 values; `s` is `d` times the sum of the quantized
/// values (not of the inputs), as GGML computes it.
pub fn quantize_block_q8_1(xs: &[f32], block: &mut BlockQ8_1) {
    quantize_block_q8_1_as(GgmlBuild::NATIVE, xs, block)
}

/// One Q8_1 block from 32 values as `build` quantizes it.
pub fn quantize_block_q8_1_as(build: GgmlBuild, xs: &[f32], block: &mut BlockQ8_1) {
    #[cfg(target_arch = "aarch64")]
    if build == GgmlBuild::Aarch64 && xs.len() == QK {
        // SAFETY: NEON is part of the aarch64 baseline; 32 values.
        let (d, sum) = unsafe { neon::q8_block(xs, &mut block.qs) };
        block.d = f16::from_f32(d);
        block.s = f16::from_f32(d * sum as f32);
        return;
    }
    let (d, multiplier) = q8_scale(xs, build);
    block.d = f16::from_f32(d);
    let mut sum = 0i32;
    for (q, &v) in block.qs.iter_mut().zip(xs) {
        let qi = nearest_int(v * multiplier);
        *q = qi as i8;
        sum += qi;
    }
    block.s = f16::from_f32(d * sum as f32);
}

/// One Q8_K super-block from 256 values (`quantize_row_q8_K_ref`): the scale
/// comes from the value of largest magnitude *with its sign*, which maps to -127.
pub fn quantize_block_q8_k(xs: &[f32], block: &mut BlockQ8K) {
    quantize_block_q8_k_as(GgmlBuild::NATIVE, xs, block)
}

/// [`quantize_block_q8_k`] with `build`'s arithmetic. ggml-base built by GCC
/// for aarch64 fuses `iscale * x + 12582912.0f` (`nearest_int`'s shift) into
/// one multiply-add: the exact product is rounded once, to an integer, where
/// the x86 build first rounds it to f32. A product within half an f32 ulp of
/// a half-integer then lands on the other integer (a model's activations
/// meet one every few thousand values).
pub fn quantize_block_q8_k_as(build: GgmlBuild, xs: &[f32], block: &mut BlockQ8K) {
    // GGML keeps the first value of largest magnitude; finding the magnitude
    // first and then that value gives the same answer and vectorizes.
    let amax = xs.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    let max = xs.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
    if amax == 0.0 {
        // GGML leaves bsums untouched here; zeros are what they would sum to.
        *block = BlockQ8K::zeroed();
        return;
    }
    let iscale = -127.0f32 / max;
    match build {
        GgmlBuild::X86 => {
            for (q, &v) in block.qs.iter_mut().zip(xs) {
                *q = nearest_int(iscale * v).min(127) as i8;
            }
        }
        GgmlBuild::Aarch64 => {
            for (q, &v) in block.qs.iter_mut().zip(xs) {
                *q = nearest_int_fused(iscale, v).min(127) as i8;
            }
        }
    }
    for (sum, group) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
        *sum = group.iter().map(|&q| q as i16).sum();
    }
    block.d = 1.0 / iscale;
}

/// Which llama.cpp CPU build's arithmetic to reproduce where the builds
/// differ (here: Q8_0 / Q8_1 activation quantization and Q8_K's rounding;
/// in `dequant`, GCC's contraction of `x * d + m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlBuild {
    /// x86_64 (AVX2 / AVX-512): multiplier `127 / amax`; ggml-base without FMA.
    X86,
    /// aarch64 (NEON, GCC): multiplier `1 / (amax / 127)`; ggml-base with
    /// fused multiply-adds.
    Aarch64,
}

impl GgmlBuild {
    /// The arithmetic of the files LeanStream writes (`.lsflash` down
    /// columns, synthetic GGUFs): the same bytes whichever machine packs.
    pub const FILES: Self = Self::X86;

    /// The build whose bits this machine's kernels give.
    pub const NATIVE: Self = if cfg!(target_arch = "aarch64") {
        Self::Aarch64
    } else {
        Self::X86
    };
}

/// The multiplier a Q8_0 / Q8_1 block of largest magnitude `amax` is scaled
/// by before rounding, as `build` computes it (0 for an all-zero block).
#[inline]
pub fn q8_multiplier(amax: f32, build: GgmlBuild) -> f32 {
    match build {
        GgmlBuild::X86 => {
            if amax != 0.0 {
                127.0 / amax
            } else {
                0.0
            }
        }
        GgmlBuild::Aarch64 => {
            let d = amax / 127.0;
            if d != 0.0 {
                1.0 / d
            } else {
                0.0
            }
        }
    }
}

/// The block scale `d = amax / 127` and `build`'s multiplier.
#[inline]
fn q8_scale(xs: &[f32], build: GgmlBuild) -> (f32, f32) {
    let amax = xs.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    (amax / 127.0, q8_multiplier(amax, build))
}

/// NEON code of `quantize_row_q8_0` / `q8_1` (`ggml-cpu/arch/arm/quants.c`).
#[cfg(target_arch = "aarch64")]
mod neon {
    use core::arch::aarch64::*;

    /// Quantizes 32 values into `qs`; returns `d` and the sum of the quants.
    #[inline]
    pub unsafe fn q8_block(xs: &[f32], qs: &mut [i8; 32]) -> (f32, i32) {
        debug_assert_eq!(xs.len(), 32);
        let p = xs.as_ptr();
        // SAFETY: 32 values.
        let v: [float32x4_t; 8] = std::array::from_fn(|j| vld1q_f32(p.add(4 * j)));
        let a = v.map(|x| vabsq_f32(x));
        let m = [
            vmaxq_f32(a[0], a[1]),
            vmaxq_f32(a[2], a[3]),
            vmaxq_f32(a[4], a[5]),
            vmaxq_f32(a[6], a[7]),
        ];
        let amax = vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut acc = vdupq_n_s32(0);
        for j in (0..8).step_by(2) {
            let lo = vcvtnq_s32_f32(vmulq_n_f32(v[j], id));
            let hi = vcvtnq_s32_f32(vmulq_n_f32(v[j + 1], id));
            acc = vaddq_s32(acc, vaddq_s32(lo, hi));
            // |q| <= 127, so narrowing keeps the values.
            let q = vmovn_s16(vcombine_s16(vmovn_s32(lo), vmovn_s32(hi)));
            vst1_s8(qs.as_mut_ptr().add(4 * j), q);
        }
        (d, vaddvq_s32(acc))
    }
}

/// Round to nearest, ties to even, by the float-add trick GGML uses
/// (`nearest_int`); equal to `_mm256_round_ps(_MM_ROUND_NEAREST)` for the
/// |v| <= 128 range quantization produces, and it vectorizes.
#[inline]
fn nearest_int(v: f32) -> i32 {
    let shifted = v + 12_582_912.0;
    (shifted.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `nearest_int(a * b)` as GCC for aarch64 compiles it: the product and the
/// shift in one fused multiply-add (on aarch64 a single `fmadd`/`fmla`).
#[inline]
fn nearest_int_fused(a: f32, b: f32) -> i32 {
    let shifted = a.mul_add(b, 12_582_912.0);
    (shifted.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn check_lengths(ty: GgmlType, x: &[f32], dst: &[u8]) -> Result<(), KernelError> {
    let expected = ty.row_bytes(x.len())?;
    if dst.len() != expected {
        return Err(KernelError::ByteLength {
            what: "quantize destination",
            expected,
            got: dst.len(),
        });
    }
    Ok(())
}

/// Quantizes each `per_block` values of `x` into one block of `dst`. A
/// misaligned caller buffer goes through a stack copy of each block instead
/// of failing.
fn for_each_block<T: Pod>(x: &[f32], per_block: usize, dst: &mut [u8], quantize_one: impl Fn(&[f32], &mut T)) {
    match bytemuck::try_cast_slice_mut::<u8, T>(dst) {
        Ok(blocks) => {
            for (block, xs) in blocks.iter_mut().zip(x.chunks_exact(per_block)) {
                quantize_one(xs, block);
            }
        }
        Err(_) => {
            let size = std::mem::size_of::<T>();
            for (bytes, xs) in dst.chunks_exact_mut(size).zip(x.chunks_exact(per_block)) {
                let mut block = T::zeroed();
                quantize_one(xs, &mut block);
                bytes.copy_from_slice(bytemuck::bytes_of(&block));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::dequantize_row;

    fn pseudo_random(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn round_trips_stay_within_half_a_step() {
        let x = pseudo_random(512, 99);
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
            let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            let mut back = vec![0.0f32; x.len()];
            dequantize_row(ty, &bytes, &mut back).unwrap();
            for (block_x, block_back) in x.chunks(ty.block_size()).zip(back.chunks(ty.block_size())) {
                let amax = block_x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // Half a quantization step, plus the f16 rounding of the scale.
                let tol = amax / 127.0 * 0.5 + amax * 1e-3;
                for (a, b) in block_x.iter().zip(block_back) {
                    assert!((a - b).abs() <= tol, "{ty}: {a} -> {b}");
                }
            }
        }
        for ty in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
            let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            let mut back = vec![0.0f32; x.len()];
            dequantize_row(ty, &bytes, &mut back).unwrap();
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= a.abs() * 4e-3, "{ty}: {a} -> {b}");
            }
        }
    }

    #[test]
    fn q4_0_round_trip_is_within_half_a_step() {
        let mut x = pseudo_random(1024, 41);
        x[64..96].fill(0.0); // an all-zero block
        let mut bytes = vec![0u8; GgmlType::Q4_0.row_bytes(x.len()).unwrap()];
        quantize_row_q4_0(&x, &mut bytes).unwrap();
        let mut back = vec![0.0f32; x.len()];
        dequantize_row(GgmlType::Q4_0, &bytes, &mut back).unwrap();
        let blocks: &[BlockQ4_0] = bytemuck::cast_slice(&bytes);
        for ((block_x, block_back), block) in x.chunks(QK).zip(back.chunks(QK)).zip(blocks) {
            let amax = block_x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let step = amax / 8.0;
            for (j, (a, b)) in block_x.iter().zip(block_back).enumerate() {
                let q = if j < QK / 2 {
                    block.qs[j] & 15
                } else {
                    block.qs[j - QK / 2] >> 4
                };
                // Half a step plus the f16 rounding of d; a value clamped to
                // 15 (the extreme opposite the signed maximum) up to one step.
                let tol = if q == 15 { step } else { step * 0.5 } + amax * 1e-3;
                assert!((a - b).abs() <= tol, "{a} -> {b} (q {q}, step {step})");
            }
        }
        assert!(back[64..96].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q4_0_maps_signed_max_to_zero_nibble() {
        let mut x = [0.0f32; 32];
        x[3] = -2.0; // largest magnitude, negative: d = 0.25
        x[20] = 1.0; // 1 / 0.25 + 8.5 = 12.5 -> 12
        x[5] = 0.125; // 0.5 + 8.5 = 9.0 -> 9 (truncation, not rounding)
        x[6] = 0.12; // 8.98 -> 8
        let mut block = BlockQ4_0::zeroed();
        quantize_block_q4_0(&x, &mut block);
        assert_eq!(block.d.to_f32(), 0.25);
        assert_eq!(block.qs[3] & 15, 0);
        assert_eq!(block.qs[4] >> 4, 12);
        assert_eq!(block.qs[5] & 15, 9);
        assert_eq!(block.qs[6] & 15, 8);
        assert_eq!(block.qs[0], 0x88);
        // A positive maximum also maps to 0 with a negative scale; -max clamps to 15.
        let mut y = [0.0f32; 32];
        y[0] = 1.0;
        y[1] = -1.0;
        quantize_block_q4_0(&y, &mut block);
        assert_eq!(block.d.to_f32(), -0.125);
        assert_eq!(block.qs[0] & 15, 0);
        assert_eq!(block.qs[1] & 15, 15);
    }

    #[test]
    fn q8_0_rounds_ties_to_even_like_avx2() {
        // amax = 127 makes the multiplier exactly 1, so these are exact ties.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1..6].copy_from_slice(&[0.5, 1.5, 2.5, -0.5, -3.5]);
        let mut block = BlockQ8_0::zeroed();
        quantize_block_q8_0(&x, &mut block);
        assert_eq!(block.d.to_f32(), 1.0);
        // roundf would give 1, 2, 3, -1, -4.
        assert_eq!(&block.qs[..6], &[127, 0, 2, 2, 0, -4]);
    }

    #[test]
    fn q8_1_sum_is_scale_times_quant_sum() {
        let x = pseudo_random(32, 5);
        let mut block = BlockQ8_1::zeroed();
        quantize_block_q8_1(&x, &mut block);
        let sum: i32 = block.qs.iter().map(|&q| q as i32).sum();
        let d = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        assert_eq!(block.s, f16::from_f32(d * sum as f32));
    }

    #[test]
    fn q8_k_maps_signed_max_to_minus_127() {
        let mut x = pseudo_random(256, 17);
        x[10] = -3.0; // largest magnitude, negative
        let mut block = BlockQ8K::zeroed();
        quantize_block_q8_k(&x, &mut block);
        assert_eq!(block.qs[10], -127);
        assert_eq!(block.d, 1.0 / (-127.0f32 / -3.0));
        assert!(block.d > 0.0);
        for (j, &s) in block.bsums.iter().enumerate() {
            assert_eq!(
                s as i32,
                block.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum::<i32>()
            );
        }
        // A positive maximum also maps to -127, with a negative scale.
        x[10] = 3.0;
        quantize_block_q8_k(&x, &mut block);
        assert_eq!(block.qs[10], -127);
        assert!(block.d < 0.0);

        let zeros = [0.0f32; 256];
        quantize_block_q8_k(&zeros, &mut block);
        assert_eq!(block.d, 0.0);
        assert!(block.qs.iter().all(|&q| q == 0) && block.bsums.iter().all(|&s| s == 0));
    }

    /// Values whose product with the scale lies within half an f32 ulp of a
    /// half-integer: rounded to f32 first (x86) it lands on the tie or
    /// across it, fused (GCC for aarch64) it does not. The aarch64 quants
    /// are `quantize_row_q8_K_ref` of ggml-base cross-built for aarch64
    /// (llama-cpp-python 0.3.36, -march=armv8-a), run under qemu.
    #[test]
    fn q8_k_rounding_of_the_two_builds() {
        let mut x = [0.0f32; 256];
        x[0] = 3.0; // scale -127 / 3
        let bits = [
            0x3e35_6ad6u32,
            0xbe35_6ad6,
            0x3e4d_9b37,
            0xbe4d_9b37,
            0x3e65_cb97,
            0xbe65_cb97,
            0x3e7d_fbf9,
            0xbe7d_fbf9,
        ];
        for (v, b) in x[1..].iter_mut().zip(bits) {
            *v = f32::from_bits(b);
        }
        let mut block = BlockQ8K::zeroed();
        quantize_block_q8_k_as(GgmlBuild::Aarch64, &x, &mut block);
        assert_eq!(block.qs[..9], [-127, -7, 7, -9, 9, -9, 9, -11, 11]);
        assert_eq!(block.bsums[0], -127);
        assert_eq!(block.d.to_bits(), 0xbcc1_8306);
        quantize_block_q8_k_as(GgmlBuild::X86, &x, &mut block);
        assert_eq!(block.qs[..9], [-127, -8, 8, -8, 8, -10, 10, -10, 10]);
        assert_eq!(block.d.to_bits(), 0xbcc1_8306);
        // A row takes this machine's build.
        let mut row = vec![0u8; GgmlType::Q8K.row_bytes(256).unwrap()];
        quantize_row_q8_k(&x, &mut row).unwrap();
        quantize_block_q8_k_as(GgmlBuild::NATIVE, &x, &mut block);
        assert_eq!(row, bytemuck::bytes_of(&block));
    }

    #[test]
    fn q8_multipliers_of_the_two_builds() {
        // 127 / amax and 1 / (amax / 127) differ by an ulp for some amax.
        let differ = (1..10_000)
            .map(|i| 0.01 + i as f32 * 0.000_37)
            .filter(|&a| q8_multiplier(a, GgmlBuild::X86) != q8_multiplier(a, GgmlBuild::Aarch64))
            .count();
        assert!(differ > 100, "{differ}");
        for b in [GgmlBuild::X86, GgmlBuild::Aarch64] {
            assert_eq!(q8_multiplier(0.0, b), 0.0);
            assert_eq!(q8_multiplier(127.0, b), 1.0);
        }
        // This machine's blocks use its build's multiplier.
        let mut x = pseudo_random(32 * 64, 8);
        for (blk, (amax, v)) in FLIPS.iter().enumerate() {
            let b = &mut x[32 * blk..32 * blk + 32];
            b.fill(0.0);
            b[0] = f32::from_bits(*amax);
            b[1] = f32::from_bits(*v);
        }
        let mut other_differs = 0;
        for xs in x.chunks_exact(32) {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let id = q8_multiplier(amax, GgmlBuild::NATIVE);
            let mut block = BlockQ8_0::zeroed();
            quantize_block_q8_0(xs, &mut block);
            let mut block1 = BlockQ8_1::zeroed();
            quantize_block_q8_1(xs, &mut block1);
            let want: Vec<i8> = xs.iter().map(|&v| nearest_int(v * id) as i8).collect();
            assert_eq!(&block.qs[..], &want[..]);
            assert_eq!(&block1.qs[..], &want[..]);
            assert_eq!(block.d, f16::from_f32(amax / 127.0));
            let sum: i32 = want.iter().map(|&q| q as i32).sum();
            assert_eq!(block1.s, f16::from_f32(amax / 127.0 * sum as f32));
            // Each build's block at any machine: the portable formula.
            for build in [GgmlBuild::X86, GgmlBuild::Aarch64] {
                let id = q8_multiplier(amax, build);
                let want: Vec<i8> = xs.iter().map(|&v| nearest_int(v * id) as i8).collect();
                let mut b0 = BlockQ8_0::zeroed();
                quantize_block_q8_0_as(build, xs, &mut b0);
                let mut b1 = BlockQ8_1::zeroed();
                quantize_block_q8_1_as(build, xs, &mut b1);
                assert_eq!(&b0.qs[..], &want[..]);
                assert_eq!(&b1.qs[..], &want[..]);
                other_differs += (build != GgmlBuild::NATIVE && b0.qs != block.qs) as usize;
            }
        }
        assert!(
            other_differs >= FLIPS.len(),
            "the builds gave the same bytes on a constructed block"
        );
    }

    /// `(amax, v)` bit patterns for which `v * 127 / amax` and
    /// `v * (1 / (amax / 127))` round to different integers.
    const FLIPS: [(u32, u32); 3] = [
        (0x3f00_0735, 0x3c61_d03d),
        (0x3f00_0885, 0x3c61_d28d),
        (0x3f00_092d, 0x3c61_d3b6),
    ];

    #[test]
    fn bf16_rounding_matches_ggml() {
        // Ties to even on the dropped 16 bits, NaN stays NaN (quiet).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)).to_bits(), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)).to_bits(), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)).to_bits(), 0x3f81);
        assert!(f32_to_bf16(f32::NAN).is_nan());
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)).to_bits(), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::INFINITY).to_bits(), 0x7f80);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let x = [0.0f32; 40];
        let mut dst = [0u8; 64];
        assert!(matches!(
            quantize_row_q8_0(&x, &mut dst),
            Err(KernelError::RaggedRow { .. })
        ));
        assert!(matches!(
            quantize_row_q8_0(&x[..32], &mut dst),
            Err(KernelError::ByteLength { .. })
        ));
        assert!(matches!(
            quantize_row_q8_k(&x[..32], &mut dst),
            Err(KernelError::RaggedRow { .. })
        ));
        assert!(matches!(
            convert_row_f16(&x, &mut dst),
            Err(KernelError::ByteLength { .. })
        ));
        assert!(quantize_row(GgmlType::Q4K, &[0.0; 256], &mut [0u8; 144]).is_err());
    }

    #[test]
    fn misaligned_destination_gets_the_same_bytes() {
        let x = pseudo_random(64, 3);
        let mut aligned = [0u16; 35];
        let mut shifted = [0u16; 36];
        let a: &mut [u8] = bytemuck::cast_slice_mut(&mut aligned);
        quantize_row_q8_0(&x, &mut a[..68]).unwrap();
        let s: &mut [u8] = bytemuck::cast_slice_mut(&mut shifted);
        quantize_row_q8_0(&x, &mut s[1..69]).unwrap();
        assert_eq!(&a[..68], &s[1..69]);
    }

    /// Q8_0, Q8_1 and Q8_K rows of ggml built for aarch64 (see `f16dot::golden`).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn matches_ggml_built_for_aarch64() {
        use crate::f16dot::golden::{fnv, wide};
        let mut x = wide(1024, 7);
        x[64..96].fill(0.0);
        for (i, v) in x.iter_mut().enumerate().take(128).skip(96) {
            *v = (i as f32 - 110.0) * 0.5;
        }
        for (blk, (amax, v)) in FLIPS.iter().enumerate() {
            let b = &mut x[128 + 32 * blk..160 + 32 * blk];
            b.fill(0.0);
            b[0] = f32::from_bits(*amax);
            b[1] = f32::from_bits(*v);
        }
        for (ty, hash) in [
            (GgmlType::Q8_0, 0x001aa7948f1a8179u64),
            (GgmlType::Q8_1, 0x7cd077aa965aac88),
            (GgmlType::Q8K, 0x6681413fdf562dcb),
        ] {
            let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            assert_eq!(fnv(&bytes), hash, "{ty}");
            // The x86 formula gives other bytes: the test can tell them apart.
            quantize_row_as(GgmlBuild::X86, ty, &x, &mut bytes).unwrap();
            assert_eq!(fnv(&bytes) == hash, ty == GgmlType::Q8K, "{ty}");
        }
    }
}
