//! Learned retention priorities (`.lsevict`, made by `leanstream-synth
//! eviction` from activation traces): for every neuron of every layer, the
//! probability that it is used in the next token given how many tokens ago
//! it was last used. Frequency and recency in one number: a neuron that is
//! always on scores high at every age; a bursty one scores high just after
//! use and low once its burst is over; a rare one scores low everywhere.
//! [`Learned`](super::Learned) evicts by it.
//!
//! # File layout (little-endian)
//!
//! `LSEVICT\n`, u32 version, u32-length provenance (JSON naming the model's
//! SHA-256 as `model.sha256`), u32 `n_layer`, u32 `n_ff`, u32 buckets `B`,
//! `B - 1` u32 upper age bounds (increasing; the last bucket is open), then
//! `n_layer × n_ff × B` u16 probabilities (× 1/65535), neuron-major, and the
//! SHA-256 of everything before it.

use std::path::{Path, PathBuf};

use crate::binread;

pub const MAGIC: [u8; 8] = *b"LSEVICT\n";
pub const VERSION: u32 = 1;

/// Upper bounds (inclusive) of the age buckets, in tokens since the last
/// use: ages 0, 1, 2, 3-4, 5-8, 9-16, 17-64 and over 64.
pub const AGE_BOUNDS: [u32; 7] = [0, 1, 2, 4, 8, 16, 64];
pub const N_BUCKETS: usize = AGE_BOUNDS.len() + 1;

const MAX_PROVENANCE: usize = 1 << 20;
const MAX_NEURONS: u64 = 1 << 28;

#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error("{path}: cannot read or write retention file: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a retention (.lsevict) file (bad magic)")]
    Magic { path: PathBuf },
    #[error("{path}: unsupported retention file version {found} (this build reads version {expected})")]
    Version { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: checksum mismatch: the file is corrupt")]
    Checksum { path: PathBuf },
    #[error("{path}: truncated retention file: field `{field}` needs {needed} bytes, {left} left")]
    Truncated {
        path: PathBuf,
        field: &'static str,
        needed: u64,
        left: u64,
    },
    #[error("{path}: invalid field `{field}`: {reason}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
}

crate::impl_field_error!(RetentionError);

/// The bucket of a neuron last used `age` tokens ago.
#[inline]
pub fn age_bucket(age: u64) -> usize {
    AGE_BOUNDS
        .iter()
        .position(|&b| age <= b as u64)
        .unwrap_or(AGE_BOUNDS.len())
}

/// Per neuron and age bucket, the probability of use in the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct RetentionTable {
    /// JSON: the model (`model.sha256`), the trace, the settings.
    pub provenance: String,
    pub n_layer: usize,
    pub n_ff: usize,
    /// `[layer][neuron][bucket]`, probability × 65535.
    pub prob: Vec<u16>,
}

impl RetentionTable {
    /// A table from probabilities `[layer][neuron][bucket]` in `0..=1`.
    pub fn from_probabilities(provenance: String, n_layer: usize, n_ff: usize, p: &[f32]) -> Self {
        assert_eq!(p.len(), n_layer * n_ff * N_BUCKETS, "retention probabilities");
        Self {
            provenance,
            n_layer,
            n_ff,
            prob: p
                .iter()
                .map(|&v| (v.clamp(0.0, 1.0) * 65535.0).round() as u16)
                .collect(),
        }
    }

    /// Priority of keeping (`layer`, `neuron`) last used `age` tokens ago.
    #[inline]
    pub fn priority(&self, layer: usize, neuron: usize, age: u64) -> u16 {
        self.prob[(layer * self.n_ff + neuron) * N_BUCKETS + age_bucket(age)]
    }

    /// The SHA-256 (hex) of the model the provenance names.
    pub fn model_sha(&self) -> Option<String> {
        binread::model_sha256(&serde_json::from_str(&self.provenance).ok()?)
    }

    /// Bytes of the table in memory.
    pub fn bytes(&self) -> u64 {
        (self.prob.len() * 2 + self.provenance.len()) as u64
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.provenance.len() + self.prob.len() * 2);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.provenance.len() as u32).to_le_bytes());
        b.extend_from_slice(self.provenance.as_bytes());
        for v in [self.n_layer, self.n_ff, N_BUCKETS] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        for v in AGE_BOUNDS {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in &self.prob {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let sum = <sha2::Sha256 as sha2::Digest>::digest(&b);
        b.extend_from_slice(&sum);
        b
    }

    /// Decodes the bytes of a `.lsevict` file; `path` names it in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, RetentionError> {
        let mut r: binread::Reader<RetentionError> = binread::checked_body(bytes, path, &MAGIC, VERSION)?;
        let provenance = r.string("provenance", MAX_PROVENANCE)?;
        let n_layer = r.u32("n_layer")? as usize;
        let n_ff = r.u32("n_ff")? as usize;
        if n_layer == 0 || n_ff == 0 || (n_layer as u64 * n_ff as u64) > MAX_NEURONS {
            return Err(r.invalid("n_layer", format!("{n_layer} layers × {n_ff} neurons")));
        }
        let buckets = r.u32("buckets")? as usize;
        if buckets != N_BUCKETS {
            return Err(r.invalid("buckets", format!("{buckets} (this build uses {N_BUCKETS})")));
        }
        for (i, &want) in AGE_BOUNDS.iter().enumerate() {
            let got = r.u32("age_bounds")?;
            if got != want {
                return Err(r.invalid("age_bounds", format!("bound {i} is {got}, this build uses {want}")));
            }
        }
        let n = n_layer * n_ff * N_BUCKETS;
        let raw = r.take(n * 2, "probabilities")?;
        let prob = raw.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        if r.left() != 0 {
            return Err(r.invalid("probabilities", format!("{} bytes after the table", r.left())));
        }
        Ok(Self {
            provenance,
            n_layer,
            n_ff,
            prob,
        })
    }

    pub fn load(path: &Path) -> Result<Self, RetentionError> {
        let bytes = std::fs::read(path).map_err(|source| RetentionError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, path)
    }

    /// Writes the file whole or not at all ([`crate::durable`]).
    pub fn save(&self, path: &Path) -> Result<(), RetentionError> {
        crate::durable::write(path, &self.to_bytes()).map_err(|source| RetentionError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RetentionTable {
        let p: Vec<f32> = (0..2 * 3 * N_BUCKETS).map(|i| (i % 7) as f32 / 6.0).collect();
        RetentionTable::from_probabilities(r#"{"model":{"sha256":"AB"}}"#.into(), 2, 3, &p)
    }

    #[test]
    fn buckets_follow_the_bounds() {
        let got: Vec<usize> = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 1 << 40]
            .iter()
            .map(|&a| age_bucket(a))
            .collect();
        assert_eq!(got, [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]);
    }

    #[test]
    fn round_trips_and_names_the_model() {
        let t = table();
        let back = RetentionTable::from_bytes(&t.to_bytes(), Path::new("t.lsevict")).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.model_sha().as_deref(), Some("ab"));
        assert_eq!(t.priority(1, 2, 100), t.prob[(5 * N_BUCKETS) + 7]);
    }

    #[test]
    fn corruption_and_truncation_are_named() {
        let b = table().to_bytes();
        let p = Path::new("x.lsevict");
        let mut flipped = b.clone();
        flipped[30] ^= 1;
        assert!(matches!(
            RetentionTable::from_bytes(&flipped, p),
            Err(RetentionError::Checksum { .. })
        ));
        let e = RetentionTable::from_bytes(&b[..b.len() / 2], p).unwrap_err();
        assert!(e.to_string().contains("x.lsevict"), "{e}");
        let mut magic = b.clone();
        magic[0] = b'X';
        assert!(matches!(
            RetentionTable::from_bytes(&magic, p),
            Err(RetentionError::Magic { .. })
        ));
    }
}
