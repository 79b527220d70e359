//! Helpers shared by the crate's tests (each test binary uses a part).
#![allow(dead_code)]

use half::f16;
use leanstream_kernels::quantize::{quantize_row_q4_0, quantize_row_q8_0};
use leanstream_kernels::GgmlType;

/// xorshift64*: deterministic test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1).
    pub fn float(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    pub fn floats(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.float()).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The weight types the GPU kernels take (BF16 has none yet).
pub const GPU_WEIGHT_TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F16,
    GgmlType::F32,
];

/// `n_ff` random neuron bundles of an `n_embd`-wide layer: Q4_0 gate and up
/// rows and a Q8_0 down column, each quantized from uniform values.
pub fn random_bundles(rng: &mut Rng, n_embd: usize, n_ff: usize) -> Vec<Vec<u8>> {
    let mut row = |ty: GgmlType| {
        let x = rng.floats(n_embd);
        let mut out = vec![0u8; ty.row_bytes(n_embd).unwrap()];
        match ty {
            GgmlType::Q4_0 => quantize_row_q4_0(&x, &mut out).unwrap(),
            _ => quantize_row_q8_0(&x, &mut out).unwrap(),
        }
        out
    };
    (0..n_ff)
        .map(|_| [row(GgmlType::Q4_0), row(GgmlType::Q4_0), row(GgmlType::Q8_0)].concat())
        .collect()
}

/// A random `rows × cols` matrix of `ty` with sane block scales.
pub fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    match ty {
        GgmlType::F32 => return bytemuck::cast_slice(&rng.floats(rows * cols)).to_vec(),
        GgmlType::F16 => {
            let h: Vec<u16> = rng
                .floats(rows * cols)
                .iter()
                .map(|&v| f16::from_f32(v).to_bits())
                .collect();
            return bytemuck::cast_slice(&h).to_vec();
        }
        _ => {}
    }
    let mut w: Vec<u8> = (0..ty.row_bytes(cols).unwrap() * rows)
        .map(|_| rng.next() as u8)
        .collect();
    // Offsets of each block's f16 scales (`kernels/src/blocks.rs`).
    let scales: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        other => panic!("{other}"),
    };
    for block in w.chunks_exact_mut(ty.type_size()) {
        for &at in scales {
            let d = f16::from_f32(0.001 + 0.02 * rng.float().abs());
            block[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    w
}
