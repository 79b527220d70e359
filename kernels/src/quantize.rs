//! Activation quantization into the vec-dot types, exactly as GGML's x86 CPU
//! backend does it, so dot products see the same integers as llama.cpp.
//!
//! Q8_0 and Q8_1 follow the AVX2 `quantize_row_q8_0/q8_1` of
//! `ggml-cpu/arch/x86/quants.c`, which differ from the portable reference in
//! two ways: the multiplier is `127 / amax` (not `1 / (amax / 127)`) and
//! rounding is to nearest-even (`_mm256_round_ps`), not half-away-from-zero
//! (`roundf`). Q8_K uses the reference `quantize_row_q8_K_ref`, which the x86
//! build also calls. We use these formulas on every architecture so results do
//! not depend on the machine.

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::blocks::*;
use crate::{GgmlType, KernelError};

/// Converts `x` into the dot type `ty` (F32, F16, BF16, Q8_0, Q8_1 or Q8_K),
/// writing exactly `ty.row_bytes(x.len())` bytes to `dst`. (Weights in
/// Q4_0 come from [`quantize_row_q4_0`].)
pub fn quantize_row(ty: GgmlType, x: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    match ty {
        GgmlType::F32 => copy_row_f32(x, dst),
        GgmlType::F16 => convert_row_f16(x, dst),
        GgmlType::BF16 => convert_row_bf16(x, dst),
        GgmlType::Q8_0 => quantize_row_q8_0(x, dst),
        GgmlType::Q8_1 => quantize_row_q8_1(x, dst),
        GgmlType::Q8K => quantize_row_q8_k(x, dst),
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
    check_lengths(GgmlType::Q8K, x, dst)?;
    for_each_block(x, QK_K, dst, quantize_block_q8_k);
    Ok(())
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
    let (d, multiplier) = q8_scale(xs);
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
    let (d, multiplier) = q8_scale(xs);
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
    for (q, &v) in block.qs.iter_mut().zip(xs) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (sum, group) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
        *sum = group.iter().map(|&q| q as i16).sum();
    }
    block.d = 1.0 / iscale;
}

/// The block scale `d = amax / 127` and the multiplier `127 / amax` of the
/// AVX2 path (0 for an all-zero block).
#[inline]
fn q8_scale(xs: &[f32]) -> (f32, f32) {
    let amax = xs.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    let d = amax / 127.0;
    let multiplier = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (d, multiplier)
}

/// Round to nearest, ties to even, by the float-add trick GGML uses
/// (`nearest_int`); equal to `_mm256_round_ps(_MM_ROUND_NEAREST)` for the
/// |v| <= 128 range quantization produces, and it vectorizes.
#[inline]
fn nearest_int(v: f32) -> i32 {
    let shifted = v + 12_582_912.0;
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
}
