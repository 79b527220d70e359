//! Reading hostile little-endian binary files (`.lstab`, `.lspred`): every
//! read is bounds-checked before anything is allocated, and a failure names
//! the file and the field, in the caller's own error type. Also what their
//! provenance JSON says of the model they were made for.

use std::marker::PhantomData;
use std::path::Path;

use sha2::{Digest, Sha256};

/// How a format's error type says what went wrong.
pub trait FieldError {
    fn truncated(path: &Path, field: &'static str, needed: u64, left: u64) -> Self;
    fn invalid(path: &Path, field: &'static str, reason: String) -> Self;
    fn magic(path: &Path) -> Self;
    fn version(path: &Path, found: u32, expected: u32) -> Self;
    fn checksum(path: &Path) -> Self;
}

/// Implements [`FieldError`] for an error enum with the variants `Truncated
/// { path, field, needed, left }`, `Invalid { path, field, reason }`, `Magic
/// { path }`, `Version { path, found, expected }` and `Checksum { path }`.
#[macro_export]
macro_rules! impl_field_error {
    ($t:ty) => {
        impl $crate::binread::FieldError for $t {
            fn truncated(path: &std::path::Path, field: &'static str, needed: u64, left: u64) -> Self {
                Self::Truncated {
                    path: path.to_path_buf(),
                    field,
                    needed,
                    left,
                }
            }
            fn invalid(path: &std::path::Path, field: &'static str, reason: String) -> Self {
                Self::Invalid {
                    path: path.to_path_buf(),
                    field,
                    reason,
                }
            }
            fn magic(path: &std::path::Path) -> Self {
                Self::Magic {
                    path: path.to_path_buf(),
                }
            }
            fn version(path: &std::path::Path, found: u32, expected: u32) -> Self {
                Self::Version {
                    path: path.to_path_buf(),
                    found,
                    expected,
                }
            }
            fn checksum(path: &std::path::Path) -> Self {
                Self::Checksum {
                    path: path.to_path_buf(),
                }
            }
        }
    };
}

/// The SHA-256 (lowercase hex) a provenance JSON names as `model.sha256`.
pub fn model_sha256(provenance: &serde_json::Value) -> Option<String> {
    provenance["model"]["sha256"].as_str().map(str::to_ascii_lowercase)
}

/// Checks the 8-byte magic, the u32 version and the trailing SHA-256 of
/// every byte before it; returns a reader over what lies between. The
/// checksum comes first: nothing after looks at bytes a flipped bit could
/// have changed.
pub fn checked_body<'a, E: FieldError>(
    bytes: &'a [u8],
    path: &'a Path,
    magic: &[u8; 8],
    version: u32,
) -> Result<Reader<'a, E>, E> {
    let mut r = Reader::new(bytes, 0, path);
    if r.take(8, "magic")? != magic {
        return Err(E::magic(path));
    }
    let found = r.u32("version")?;
    if found != version {
        return Err(E::version(path, found, version));
    }
    if bytes.len() < 12 + 32 {
        return Err(r.truncated("checksum", 32));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body).as_slice() != sum {
        return Err(E::checksum(path));
    }
    Ok(Reader::new(body, 12, path))
}

pub struct Reader<'a, E> {
    b: &'a [u8],
    pub pos: usize,
    path: &'a Path,
    _error: PhantomData<E>,
}

impl<'a, E: FieldError> Reader<'a, E> {
    /// Reads `b` from byte `pos`; `path` names the file in errors.
    pub fn new(b: &'a [u8], pos: usize, path: &'a Path) -> Self {
        Self {
            b,
            pos,
            path,
            _error: PhantomData,
        }
    }

    pub fn left(&self) -> usize {
        self.b.len() - self.pos.min(self.b.len())
    }

    pub fn truncated(&self, field: &'static str, needed: u64) -> E {
        E::truncated(self.path, field, needed, self.left() as u64)
    }

    pub fn invalid(&self, field: &'static str, reason: String) -> E {
        E::invalid(self.path, field, reason)
    }

    pub fn need(&self, n: u64, field: &'static str) -> Result<(), E> {
        if n > self.left() as u64 {
            Err(self.truncated(field, n))
        } else {
            Ok(())
        }
    }

    pub fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], E> {
        self.need(n as u64, field)?;
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], E> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, field)?);
        Ok(a)
    }

    pub fn u8(&mut self, field: &'static str) -> Result<u8, E> {
        Ok(self.array::<1>(field)?[0])
    }
    pub fn u32(&mut self, field: &'static str) -> Result<u32, E> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    pub fn u64(&mut self, field: &'static str) -> Result<u64, E> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    pub fn f32(&mut self, field: &'static str) -> Result<f32, E> {
        Ok(f32::from_le_bytes(self.array(field)?))
    }
    pub fn f64(&mut self, field: &'static str) -> Result<f64, E> {
        Ok(f64::from_le_bytes(self.array(field)?))
    }

    /// A u32 length, then that many bytes of UTF-8 (at most `max`).
    pub fn string(&mut self, field: &'static str, max: usize) -> Result<String, E> {
        let n = self.u32(field)? as usize;
        if n > max {
            return Err(self.invalid(field, format!("string of {n} bytes (at most {max})")));
        }
        let s = self.take(n, field)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.invalid(field, "not UTF-8".into()))
    }

    /// A u32 count of records of at least `min_record` bytes each, checked
    /// against the bytes left before anything is allocated.
    pub fn count(&mut self, field: &'static str, max: usize, min_record: u64) -> Result<usize, E> {
        let n = self.u32(field)? as usize;
        if n > max {
            return Err(self.invalid(field, format!("{n} entries (at most {max})")));
        }
        self.need(n as u64 * min_record, field)?;
        Ok(n)
    }

    // The vector readers take (and so bounds-check) the bytes before allocating.
    pub fn i8s(&mut self, n: usize, field: &'static str) -> Result<Vec<i8>, E> {
        Ok(self.take(n, field)?.iter().map(|&x| x as i8).collect())
    }
    pub fn f32s(&mut self, n: usize, field: &'static str) -> Result<Vec<f32>, E> {
        let s = self.take(n.saturating_mul(4), field)?;
        Ok(s.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    pub fn u64s(&mut self, n: usize, field: &'static str) -> Result<Vec<u64>, E> {
        let s = self.take(n.saturating_mul(8), field)?;
        Ok(s.chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
}
