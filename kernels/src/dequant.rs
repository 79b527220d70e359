//! Row dequantization with GGML's reference formulas (`dequantize_row_*` in
//! `ggml-quants.c`), operation for operation, so the floats match bit for bit.
//!
//! The same code serves aarch64: there GCC contracts Q4_1 / Q5_1's
//! `x * d + m` and Q4_K / Q5_K's `d1 * q - m1` into fused multiply-adds
//! (ggml-base on x86 is built without FMA), but every product here is exact
//! in f32 (an f16 scale, times a 6-bit sub-block scale for the K-quants,
//! times an integer of at most 5 bits: at most 22 significant bits), so
//! fused and separate operations round the same. The test against ggml built
//! for aarch64 checks it.

use bytemuck::Pod;
use half::{bf16, f16};

use crate::blocks::*;
use crate::{GgmlType, KernelError};

/// Dequantizes one row: `src` holds `dst.len()` values of type `ty`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    let expected = ty.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(KernelError::ByteLength {
            what: "dequantize_row source",
            expected,
            got: src.len(),
        });
    }
    match ty {
        GgmlType::F32 => {
            for (out, bytes) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *out = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            }
        }
        GgmlType::F16 => {
            for (out, bytes) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *out = f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (out, bytes) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *out = bf16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => for_each_block(src, dst, QK, dequant_q4_0),
        GgmlType::Q4_1 => for_each_block(src, dst, QK, dequant_q4_1),
        GgmlType::Q5_0 => for_each_block(src, dst, QK, dequant_q5_0),
        GgmlType::Q5_1 => for_each_block(src, dst, QK, dequant_q5_1),
        GgmlType::Q8_0 => for_each_block(src, dst, QK, dequant_q8_0),
        GgmlType::Q8_1 => for_each_block(src, dst, QK, dequant_q8_1),
        GgmlType::Q4K => for_each_block(src, dst, QK_K, dequant_q4_k),
        GgmlType::Q5K => for_each_block(src, dst, QK_K, dequant_q5_k),
        GgmlType::Q6K => for_each_block(src, dst, QK_K, dequant_q6_k),
        GgmlType::Q8K => for_each_block(src, dst, QK_K, dequant_q8_k),
    }
    Ok(())
}

/// Runs `f` on each block of `src` and its `per_block` outputs. Aligned data is
/// viewed in place; misaligned data (possible only for caller-made buffers) is
/// read block by block instead of failing.
fn for_each_block<T: Pod>(src: &[u8], dst: &mut [f32], per_block: usize, f: impl Fn(&T, &mut [f32])) {
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(blocks) => {
            for (block, out) in blocks.iter().zip(dst.chunks_exact_mut(per_block)) {
                f(block, out);
            }
        }
        Err(_) => {
            let size = std::mem::size_of::<T>();
            for (bytes, out) in src.chunks_exact(size).zip(dst.chunks_exact_mut(per_block)) {
                f(&bytemuck::pod_read_unaligned(bytes), out);
            }
        }
    }
}

fn dequant_q4_0(b: &BlockQ4_0, out: &mut [f32]) {
    let d = b.d.to_f32();
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
        *l = ((q & 0x0F) as i32 - 8) as f32 * d;
        *h = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequant_q4_1(b: &BlockQ4_1, out: &mut [f32]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
        *l = (q & 0x0F) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

/// The 5th bits of a Q5 block's 32 values: bit `j` of `qh` belongs to value `j`.
#[inline]
fn q5_high_bits(qh: [u8; 4], j: usize) -> (u8, u8) {
    let qh = u32::from_le_bytes(qh);
    let low_half = ((qh >> j) << 4) as u8 & 0x10;
    let high_half = (qh >> (j + 12)) as u8 & 0x10;
    (low_half, high_half)
}

fn dequant_q5_0(b: &BlockQ5_0, out: &mut [f32]) {
    let d = b.d.to_f32();
    for j in 0..QK / 2 {
        let (h0, h1) = q5_high_bits(b.qh, j);
        out[j] = (((b.qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
        out[j + QK / 2] = (((b.qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

fn dequant_q5_1(b: &BlockQ5_1, out: &mut [f32]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    for j in 0..QK / 2 {
        let (h0, h1) = q5_high_bits(b.qh, j);
        out[j] = ((b.qs[j] & 0x0F) | h0) as f32 * d + m;
        out[j + QK / 2] = ((b.qs[j] >> 4) | h1) as f32 * d + m;
    }
}

fn dequant_q8_0(b: &BlockQ8_0, out: &mut [f32]) {
    let d = b.d.to_f32();
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}

fn dequant_q8_1(b: &BlockQ8_1, out: &mut [f32]) {
    let d = b.d.to_f32();
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}

fn dequant_q4_k(b: &BlockQ4K, out: &mut [f32]) {
    let d = b.d.to_f32();
    let min = b.dmin.to_f32();
    // Four chunks of 64 values: 32 low nibbles then 32 high nibbles of 32 bytes.
    for (chunk, (qs, out)) in b.qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc_lo, m_lo) = scale_min_k4(2 * chunk, &b.scales);
        let (sc_hi, m_hi) = scale_min_k4(2 * chunk + 1, &b.scales);
        let (d1, m1) = (d * sc_lo as f32, min * m_lo as f32);
        let (d2, m2) = (d * sc_hi as f32, min * m_hi as f32);
        let (lo, hi) = out.split_at_mut(32);
        for ((&q, l), h) in qs.iter().zip(lo).zip(hi) {
            *l = d1 * (q & 0x0F) as f32 - m1;
            *h = d2 * (q >> 4) as f32 - m2;
        }
    }
}

fn dequant_q5_k(b: &BlockQ5K, out: &mut [f32]) {
    let d = b.d.to_f32();
    let min = b.dmin.to_f32();
    for (chunk, (qs, out)) in b.qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (sc_lo, m_lo) = scale_min_k4(2 * chunk, &b.scales);
        let (sc_hi, m_hi) = scale_min_k4(2 * chunk + 1, &b.scales);
        let (d1, m1) = (d * sc_lo as f32, min * m_lo as f32);
        let (d2, m2) = (d * sc_hi as f32, min * m_hi as f32);
        // Chunk c takes its high bits from bits 2c and 2c+1 of each qh byte.
        let (bit_lo, bit_hi) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        let (lo, hi) = out.split_at_mut(32);
        for ((&q, &h), (lo, hi)) in qs.iter().zip(&b.qh).zip(lo.iter_mut().zip(hi)) {
            let high_lo = if h & bit_lo != 0 { 16 } else { 0 };
            let high_hi = if h & bit_hi != 0 { 16 } else { 0 };
            *lo = d1 * ((q & 0x0F) + high_lo) as f32 - m1;
            *hi = d2 * ((q >> 4) + high_hi) as f32 - m2;
        }
    }
}

fn dequant_q6_k(b: &BlockQ6K, out: &mut [f32]) {
    let d = b.d.to_f32();
    // Two halves of 128 values, each from 64 `ql` bytes, 32 `qh` bytes and 8 scales.
    for half in 0..2 {
        let ql = &b.ql[64 * half..64 * half + 64];
        let qh = &b.qh[32 * half..32 * half + 32];
        let sc = &b.scales[8 * half..8 * half + 8];
        let out = &mut out[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * sc[is] as f32 * q1 as f32;
            out[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
            out[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
            out[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
        }
    }
}

fn dequant_q8_k(b: &BlockQ8K, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(&b.qs) {
        *o = b.d * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_ragged_inputs_are_errors() {
        let mut out = vec![0.0f32; 64];
        let short = vec![0u8; 18];
        assert!(matches!(
            dequantize_row(GgmlType::Q4_0, &short, &mut out),
            Err(KernelError::ByteLength { .. })
        ));
        let mut ragged = vec![0.0f32; 40];
        assert!(matches!(
            dequantize_row(GgmlType::Q4_0, &short, &mut ragged),
            Err(KernelError::RaggedRow { .. })
        ));
        let mut k_ragged = vec![0.0f32; 32];
        assert!(dequantize_row(GgmlType::Q4K, &[0u8; 144], &mut k_ragged).is_err());
    }

    #[test]
    fn q4_0_known_block() {
        // d = 0.5, byte j holds (lo = j % 16, hi = 15 - j % 16).
        let mut bytes = vec![0u8; 18];
        bytes[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..16 {
            bytes[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0.0f32; 32];
        dequantize_row(GgmlType::Q4_0, &bytes, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], (7.0 - j as f32) * 0.5);
        }
    }

    #[test]
    fn misaligned_source_still_dequantizes() {
        let mut block = [0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        for j in 0..32 {
            block[2 + j] = (j as i8 - 16) as u8;
        }
        // u32 backing: offset 0 is aligned, offset 1 is not.
        let mut words = [0u32; 10];
        for offset in [0usize, 1] {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
            bytes[offset..offset + 34].copy_from_slice(&block);
            let mut out = [0.0f32; 32];
            dequantize_row(GgmlType::Q8_0, &bytes[offset..offset + 34], &mut out).unwrap();
            for (j, &v) in out.iter().enumerate() {
                assert_eq!(v, (j as f32 - 16.0) * 2.0);
            }
        }
    }

    /// `to_float` of ggml-base built for aarch64 (see `f16dot::golden`) on
    /// random blocks with sane scales.
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn matches_ggml_built_for_aarch64() {
        use crate::f16dot::golden::{fnv_f32, wide};
        let cases = [
            (GgmlType::Q4_0, 0x8579e7c8a912e333u64),
            (GgmlType::Q4_1, 0x8f71c596032e7721),
            (GgmlType::Q5_0, 0xee366ac979b4cb60),
            (GgmlType::Q5_1, 0x6aa8e77230e93c97),
            (GgmlType::Q8_0, 0x00057038f091f35c),
            (GgmlType::Q4K, 0x78ceae3b342402e9),
            (GgmlType::Q5K, 0xd62feaae6caffadd),
            (GgmlType::Q6K, 0xef0c00ed5d2ff490),
        ];
        for (k, (ty, hash)) in cases.into_iter().enumerate() {
            let n = 512;
            let bytes_len = ty.row_bytes(n).unwrap();
            let mut st = 21 + k as u32;
            let mut q: Vec<u8> = (0..bytes_len)
                .map(|_| {
                    st ^= st << 13;
                    st ^= st >> 17;
                    st ^= st << 5;
                    (st >> 24) as u8
                })
                .collect();
            let bs = bytes_len / (n / ty.block_size());
            for (blk, p) in q.chunks_exact_mut(bs).enumerate() {
                let a = wide(2, 31 + blk as u32);
                let (h0, h1) = (f16::from_f32(a[0] * 0.01), f16::from_f32(a[1] * 0.01));
                if ty == GgmlType::Q6K {
                    p[bs - 2..].copy_from_slice(&h0.to_le_bytes());
                } else {
                    p[..2].copy_from_slice(&h0.to_le_bytes());
                    if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K) {
                        p[2..4].copy_from_slice(&h1.to_le_bytes());
                    }
                }
            }
            let mut out = vec![0.0f32; n];
            dequantize_row(ty, &q, &mut out).unwrap();
            assert_eq!(fnv_f32(&out), hash, "{ty}");
        }
    }
}
