//! What the golden tests share with the C harnesses in scripts/golden/ that
//! recorded llama.cpp's outputs: their pseudo-random generator, value for
//! value, and the compact bit hashes they store.

#![allow(dead_code)]

/// The LCG of scripts/golden/golden_common.h.
pub struct Lcg(pub u64);

impl Lcg {
    fn step(&mut self) {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
    }

    /// A value in [-1, 1), every 61st or so an outlier in [-20, 20), as real activations have.
    pub fn next_value(&mut self) -> f32 {
        self.step();
        let u = (self.0 >> 40) as f32 / 16777216.0 - 0.5;
        if (self.0 >> 20).is_multiple_of(61) {
            u * 40.0
        } else {
            u * 2.0
        }
    }

    pub fn next_u32(&mut self) -> u32 {
        self.step();
        (self.0 >> 32) as u32
    }
}

pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes
        .into_iter()
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// FNV-1a over the bits of `values`, as the harnesses record outputs.
pub fn bits_fnv(values: &[f32]) -> u64 {
    fnv1a(values.iter().flat_map(|v| v.to_bits().to_le_bytes()))
}

/// Bytes in u64 storage, so a matrix view over them is aligned.
pub fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
    words
}

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Rows of `out` (`rows` outputs per activation row) whose bits differ from
/// the recorded per-row hashes and leading values, each described after `label`.
pub fn output_mismatches(out: &[f32], rows: usize, want: &[(u64, Vec<u32>)], label: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (t, (fnv, head)) in want.iter().enumerate() {
        let row = &out[t * rows..(t + 1) * rows];
        if bits_fnv(row) == *fnv {
            continue;
        }
        let first_bad = head.iter().zip(row).position(|(&w, g)| w != g.to_bits());
        let detail = match first_bad {
            Some(i) => format!("output {i}: ours {:e}, llama.cpp {:e}", row[i], f32::from_bits(head[i])),
            None => format!("first {} outputs agree, a later one differs", head.len()),
        };
        found.push(format!("{label} row {t}: {detail}"));
    }
    found
}
