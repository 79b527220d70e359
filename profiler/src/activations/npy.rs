//! The subset of NumPy's `.npy` format the traces use: version 1.0, C order,
//! little-endian `f2` / `f4` / `u4` / `u1`, any rank. `numpy.load(path,
//! mmap_mode="r")` reads every file written here.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use half::f16;

use crate::{ProfileError, Result};

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Element types of trace arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F16,
    F32,
    U32,
    U8,
}

impl Dtype {
    pub fn descr(self) -> &'static str {
        match self {
            Self::F16 => "<f2",
            Self::F32 => "<f4",
            Self::U32 => "<u4",
            Self::U8 => "|u1",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 | Self::U32 => 4,
            Self::U8 => 1,
        }
    }

    fn parse(descr: &str) -> Option<Self> {
        Some(match descr {
            "<f2" => Self::F16,
            "<f4" => Self::F32,
            "<u4" => Self::U32,
            "|u1" | "<u1" => Self::U8,
            _ => return None,
        })
    }
}

fn header(dtype: Dtype, shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        dtype.descr()
    );
    // Data starts 64-byte aligned, as numpy writes it; the header ends in '\n'.
    let unpadded = MAGIC.len() + 4 + dict.len() + 1;
    dict.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    dict.push('\n');
    let mut out = Vec::with_capacity(dict.len() + 10);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes `data` (already little-endian element bytes) as an array of `shape`.
pub fn write_bytes(path: &Path, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<()> {
    let n: usize = shape.iter().product();
    if n * dtype.size() != data.len() {
        return Err(ProfileError::Invalid(format!(
            "{}: {} bytes for shape {shape:?} of {}",
            path.display(),
            data.len(),
            dtype.descr()
        )));
    }
    let io = |e| ProfileError::io(path, e);
    let mut w = BufWriter::new(File::create(path).map_err(io)?);
    w.write_all(&header(dtype, shape)).map_err(io)?;
    w.write_all(data).map_err(io)?;
    let f = w.into_inner().map_err(|e| ProfileError::io(path, e.into_error()))?;
    f.sync_all().map_err(io)
}

pub fn write_f16(path: &Path, shape: &[usize], data: &[f16]) -> Result<()> {
    write_bytes(path, Dtype::F16, shape, bytemuck::cast_slice(data))
}

pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_bytes(path, Dtype::F32, shape, &bytes)
}

pub fn write_u32(path: &Path, shape: &[usize], data: &[u32]) -> Result<()> {
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_bytes(path, Dtype::U32, shape, &bytes)
}

/// An opened array: its type, shape and where its data starts.
#[derive(Debug)]
pub struct NpyFile {
    file: File,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    data_offset: u64,
}

fn bad(path: &Path, problem: impl Into<String>) -> ProfileError {
    ProfileError::Invalid(format!("{}: {}", path.display(), problem.into()))
}

/// Value of `'key': value` in a numpy header dict (value up to the next `,` at depth 0).
fn dict_value<'h>(dict: &'h str, key: &str) -> Option<&'h str> {
    let at = dict.find(&format!("'{key}':"))? + key.len() + 3;
    let rest = dict[at..].trim_start();
    let mut depth = 0;
    for (i, ch) in rest.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' | '}' if depth == 0 => return Some(rest[..i].trim()),
            _ => {}
        }
    }
    None
}

impl NpyFile {
    /// Opens `path`, checking the header and that the file holds exactly the data it declares.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |e| ProfileError::io(path, e);
        let mut file = File::open(path).map_err(io)?;
        let mut pre = [0u8; 10];
        file.read_exact(&mut pre)
            .map_err(|_| bad(path, "shorter than a .npy header"))?;
        if &pre[..6] != MAGIC {
            return Err(bad(path, "not a .npy file (bad magic)"));
        }
        let (len, skip) = match pre[6] {
            1 => (u16::from_le_bytes([pre[8], pre[9]]) as usize, 10),
            2 | 3 => {
                let mut more = [0u8; 2];
                file.read_exact(&mut more).map_err(|_| bad(path, "truncated header"))?;
                (u32::from_le_bytes([pre[8], pre[9], more[0], more[1]]) as usize, 12)
            }
            v => return Err(bad(path, format!(".npy version {v} is not supported"))),
        };
        if len > 1 << 16 {
            return Err(bad(path, format!("header of {len} bytes")));
        }
        let mut dict = vec![0u8; len];
        file.read_exact(&mut dict).map_err(|_| bad(path, "truncated header"))?;
        let dict = String::from_utf8(dict).map_err(|_| bad(path, "header is not text"))?;
        let descr = dict_value(&dict, "descr").ok_or_else(|| bad(path, "header has no descr"))?;
        let descr = descr.trim_matches('\'');
        let dtype = Dtype::parse(descr).ok_or_else(|| bad(path, format!("dtype {descr} is not supported")))?;
        if dict_value(&dict, "fortran_order") != Some("False") {
            return Err(bad(path, "only C-order arrays are supported"));
        }
        let shape_s = dict_value(&dict, "shape").ok_or_else(|| bad(path, "header has no shape"))?;
        let shape = shape_s
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<usize>().map_err(|_| bad(path, format!("shape {shape_s}"))))
            .collect::<Result<Vec<_>>>()?;
        let data_offset = (skip + len) as u64;
        let want = shape
            .iter()
            .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(path, format!("shape {shape:?} overflows")))?;
        let have = file.metadata().map_err(io)?.len().saturating_sub(data_offset);
        if have != want {
            return Err(bad(
                path,
                format!(
                    "shape {shape:?} of {descr} needs {want} data bytes, the file has {have} (truncated or corrupt)"
                ),
            ));
        }
        Ok(Self {
            file,
            dtype,
            shape,
            data_offset,
        })
    }

    /// Checks type and shape against what the caller expects.
    pub fn expect(&self, path: &Path, dtype: Dtype, shape: &[usize]) -> Result<()> {
        if self.dtype != dtype || self.shape != shape {
            return Err(bad(
                path,
                format!(
                    "holds {:?} of {}, expected {shape:?} of {}",
                    self.shape,
                    self.dtype.descr(),
                    dtype.descr()
                ),
            ));
        }
        Ok(())
    }

    /// Reads `count` elements starting at element `start` as raw bytes.
    pub fn read_elements(&mut self, path: &Path, start: usize, count: usize, out: &mut Vec<u8>) -> Result<()> {
        let size = self.dtype.size();
        out.resize(count * size, 0);
        self.file
            .seek(SeekFrom::Start(self.data_offset + (start * size) as u64))
            .and_then(|_| self.file.read_exact(out))
            .map_err(|e| ProfileError::io(path, e))
    }
}

/// Reads a whole `f16` or `f32` array as `f32`.
pub fn read_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let mut f = NpyFile::open(path)?;
    let n: usize = f.shape.iter().product();
    let mut bytes = Vec::new();
    f.read_elements(path, 0, n, &mut bytes)?;
    let data = match f.dtype {
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        d => return Err(bad(path, format!("expected floats, found {}", d.descr()))),
    };
    Ok((f.shape, data))
}

/// Reads a whole `u8` array.
pub fn read_u8(path: &Path) -> Result<(Vec<usize>, Vec<u8>)> {
    let mut f = NpyFile::open(path)?;
    if f.dtype != Dtype::U8 {
        return Err(bad(path, format!("expected |u1, found {}", f.dtype.descr())));
    }
    let n: usize = f.shape.iter().product();
    let mut bytes = Vec::new();
    f.read_elements(path, 0, n, &mut bytes)?;
    Ok((f.shape, bytes))
}

/// Reads a whole `u32` array.
pub fn read_u32(path: &Path) -> Result<(Vec<usize>, Vec<u32>)> {
    let mut f = NpyFile::open(path)?;
    if f.dtype != Dtype::U32 {
        return Err(bad(path, format!("expected <u4, found {}", f.dtype.descr())));
    }
    let n: usize = f.shape.iter().product();
    let mut bytes = Vec::new();
    f.read_elements(path, 0, n, &mut bytes)?;
    Ok((
        f.shape,
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_64_byte_aligned_and_round_trips() {
        let dir = std::env::temp_dir().join(format!("npy-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        let data: Vec<f16> = (0..24).map(|i| f16::from_f32(i as f32 * 0.5)).collect();
        write_f16(&p, &[2, 3, 4], &data).unwrap();
        let f = NpyFile::open(&p).unwrap();
        assert_eq!(f.data_offset % 64, 0);
        assert_eq!(f.shape, vec![2, 3, 4]);
        let (shape, back) = read_f32(&p).unwrap();
        assert_eq!(shape, vec![2, 3, 4]);
        assert_eq!(back[5], 2.5);
        write_u32(&p, &[3], &[7, 8, 9]).unwrap();
        assert_eq!(read_u32(&p).unwrap().1, vec![7, 8, 9]);
        // Truncation is named.
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let err = NpyFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("a.npy") && err.contains("truncated"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
