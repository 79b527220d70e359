//! Test helpers: a small deterministic RNG, aligned byte buffers, and random
//! but well-formed rows of every type.

#![allow(dead_code)]

use half::f16;
use leanstream_kernels::blocks::*;
use leanstream_kernels::GgmlType;

/// xorshift64*: deterministic and dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }

    /// Activation-like values: mostly small, a few outliers.
    pub fn activations(&mut self, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let v = self.unit();
                if self.byte() < 4 {
                    v * 20.0
                } else {
                    v
                }
            })
            .collect()
    }
}

/// Bytes with 8-byte alignment, as GGUF mmaps and `ActBuffer` provide.
pub struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    pub fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut a = Self::zeroed(bytes.len());
        a.as_mut().copy_from_slice(bytes);
        a
    }

    pub fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn as_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}

fn scale(rng: &mut Rng, magnitude: f32) -> f16 {
    f16::from_f32(rng.unit() * magnitude)
}

fn blocks_from_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

fn blocks_to_bytes<T: bytemuck::Pod>(blocks: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(blocks).to_vec()
}

/// A random, well-formed weight row of `n` values of type `ty`: random quant
/// bits with finite, realistic scales.
pub fn random_weight_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Aligned {
    let nb = n / ty.block_size();
    let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
    for b in bytes.iter_mut() {
        *b = rng.byte();
    }
    let bytes = match ty {
        GgmlType::F32 => (0..n).flat_map(|_| rng.unit().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16::from_f32(rng.unit()).to_le_bytes()).collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f32(rng.unit()).to_le_bytes())
            .collect(),
        GgmlType::Q4_0 => {
            let mut blocks: Vec<BlockQ4_0> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| b.d = scale(rng, 0.05));
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q4_1 => {
            let mut blocks: Vec<BlockQ4_1> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| {
                b.d = scale(rng, 0.02);
                b.m = scale(rng, 0.2);
            });
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q5_0 => {
            let mut blocks: Vec<BlockQ5_0> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| b.d = scale(rng, 0.02));
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q5_1 => {
            let mut blocks: Vec<BlockQ5_1> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| {
                b.d = scale(rng, 0.01);
                b.m = scale(rng, 0.2);
            });
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let mut blocks: Vec<BlockQ8_0> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| {
                b.d = scale(rng, 0.002);
                // GGML's quantizer never emits -128.
                b.qs.iter_mut().for_each(|q| *q = (*q).max(-127));
            });
            if ty == GgmlType::Q8_1 {
                bytes
            } else {
                blocks_to_bytes(&blocks)
            }
        }
        GgmlType::Q4K => {
            let mut blocks: Vec<BlockQ4K> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| {
                b.d = scale(rng, 0.002);
                b.dmin = scale(rng, 0.002);
            });
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q5K => {
            let mut blocks: Vec<BlockQ5K> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| {
                b.d = scale(rng, 0.001);
                b.dmin = scale(rng, 0.002);
            });
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q6K => {
            let mut blocks: Vec<BlockQ6K> = blocks_from_bytes(&bytes);
            blocks.iter_mut().for_each(|b| b.d = scale(rng, 0.0005));
            blocks_to_bytes(&blocks)
        }
        GgmlType::Q8K => bytes,
    };
    assert_eq!(bytes.len(), ty.row_bytes(nb * ty.block_size()).unwrap());
    Aligned::from_bytes(&bytes)
}

/// Every weight type that has a dot kernel.
pub const WEIGHT_TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// A row length every type accepts (a multiple of 256).
pub const COLS: usize = 512;
