//! Helpers shared by the crate's tests (each test binary uses a part).
#![allow(dead_code)]

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
