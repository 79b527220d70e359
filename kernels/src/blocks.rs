//! GGML quantization blocks, laid out byte for byte as in `ggml-common.h`.
//!
//! Every struct is `#[repr(C)]` with no padding (checked at compile time), so a
//! GGUF tensor's bytes can be viewed as a slice of blocks without copying.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::KernelError;

/// Values per block of the legacy formats (Q4_0 … Q8_1).
pub const QK: usize = 32;
/// Values per super-block of the K formats.
pub const QK_K: usize = 256;

/// 4-bit, symmetric: `x = d * (q - 8)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    /// Value `j` in the low nibble of byte `j`, value `j + 16` in its high nibble.
    pub qs: [u8; QK / 2],
}

/// 4-bit with offset: `x = d * q + m`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// 5-bit, symmetric: `x = d * (q - 16)`; bit 4 of value `j` is bit `j` of `qh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// 5-bit with offset: `x = d * q + m`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// 8-bit, symmetric: `x = d * q`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// 8-bit activations for the `_1` formats; `s = d * sum(qs)` feeds their offset term.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}

/// 4-bit super-block: eight sub-blocks of 32 with 6-bit scales and mins
/// packed into `scales` (see [`scale_min_k4`]); `x = d * sc * q - dmin * m`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// 5-bit super-block: Q4_K plus one high bit per value in `qh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// 6-bit super-block: sixteen sub-blocks of 16 with signed 8-bit scales;
/// `x = d * scale * (q - 32)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits of each value.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of each value.
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// 8-bit activations for the K formats, with per-16 sums for their min terms.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 quants.
    pub bsums: [i16; QK_K / 16],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);

/// Views `bytes` as a slice of `T` (blocks, `f32`, `f16`, …).
///
/// GGUF data is aligned in the file and mmapped at page alignment, so this is
/// a free cast in practice; a misaligned or ragged slice is an error, never a
/// panic or a silent copy.
pub fn cast_blocks<'a, T: Pod>(bytes: &'a [u8], what: &'static str) -> Result<&'a [T], KernelError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(KernelError::ByteLength {
            what,
            expected: bytes.len() / size * size,
            got: bytes.len(),
        });
    }
    bytemuck::try_cast_slice(bytes).map_err(|_| KernelError::Misaligned {
        what,
        align: std::mem::align_of::<T>(),
    })
}

/// Mutable twin of [`cast_blocks`].
pub fn cast_blocks_mut<'a, T: Pod>(bytes: &'a mut [u8], what: &'static str) -> Result<&'a mut [T], KernelError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(KernelError::ByteLength {
            what,
            expected: bytes.len() / size * size,
            got: bytes.len(),
        });
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| KernelError::Misaligned {
        what,
        align: std::mem::align_of::<T>(),
    })
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block: the
/// first four are the low 6 bits of bytes 0..4 / 4..8, the last four are
/// split between the nibbles of bytes 8..12 and the top bits of bytes 0..8.
#[inline]
pub fn scale_min_k4(j: usize, scales: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// All eight (scales, mins) of a Q4_K/Q5_K super-block, unpacked.
#[inline]
pub fn unpack_scales_mins_k4(scales: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = scale_min_k4(j, scales);
    }
    (sc, mn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_reject_ragged_and_accept_exact() {
        let bytes = vec![0u8; 3 * 18];
        assert_eq!(cast_blocks::<BlockQ4_0>(&bytes, "t").unwrap().len(), 3);
        assert!(matches!(
            cast_blocks::<BlockQ4_0>(&bytes[..50], "t"),
            Err(KernelError::ByteLength { .. })
        ));
    }

    #[test]
    fn casts_report_misalignment() {
        let words = vec![0u32; 20];
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        // One byte in: misaligned for f16-led blocks (align 2).
        let shifted = &bytes[1..1 + 18];
        assert!(matches!(
            cast_blocks::<BlockQ4_0>(shifted, "t"),
            Err(KernelError::Misaligned { align: 2, .. })
        ));
    }

    #[test]
    fn scale_min_k4_matches_ggml_utmp_trick() {
        // GGML's vec_dot unpacks the same 12 bytes with 32-bit masks; both
        // must agree on every byte pattern.
        let mut state = 0x1234_5678u32;
        for _ in 0..200 {
            let mut s = [0u8; 12];
            for b in &mut s {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                *b = state as u8;
            }
            let mut utmp = [0u32; 4];
            for (i, w) in utmp.iter_mut().take(3).enumerate() {
                *w = u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            }
            const KMASK1: u32 = 0x3f3f3f3f;
            const KMASK2: u32 = 0x0f0f0f0f;
            const KMASK3: u32 = 0x03030303;
            utmp[3] = ((utmp[2] >> 4) & KMASK2) | (((utmp[1] >> 6) & KMASK3) << 4);
            let uaux = utmp[1] & KMASK1;
            utmp[1] = (utmp[2] & KMASK2) | (((utmp[0] >> 6) & KMASK3) << 4);
            utmp[2] = uaux;
            utmp[0] &= KMASK1;
            let bytes: [u8; 16] = bytemuck::cast(utmp);
            let (sc, mn) = unpack_scales_mins_k4(&s);
            assert_eq!(&bytes[..8], &sc);
            assert_eq!(&bytes[8..], &mn);
        }
    }
}
