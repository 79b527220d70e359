//! The byte-level GGUF parser: a bounds-checked cursor over the mapped file.

use std::collections::HashMap;
use std::path::Path;

use leanstream_kernels::GgmlType;

use super::{MetaArray, MetaValue, TensorInfo};
use crate::{Result, RuntimeError};

pub(super) struct Parsed {
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;

struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, what: &str) -> RuntimeError {
        RuntimeError::Corrupt {
            path: self.path.to_path_buf(),
            problem: format!("{what} (at byte {} of {})", self.pos, self.bytes.len()),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.corrupt(&format!("truncated while reading {what}: need {n} bytes")));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each at least `min_item_bytes` long: checked against
    /// the bytes left so a hostile count cannot make us allocate.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let max = (self.remaining() / min_item_bytes.max(1)) as u64;
        if n > max {
            return Err(self.corrupt(&format!("{what} is {n}, but only {} bytes remain", self.remaining())));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(1, &format!("length of {what}"))?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.corrupt(&format!("{what} is not valid UTF-8")))
    }
}

fn min_size(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

fn read_value(c: &mut Cursor, ty: u32, key: &str, depth: u32) -> Result<MetaValue> {
    Ok(match ty {
        0 => MetaValue::U8(c.array::<1>(key)?[0]),
        1 => MetaValue::I8(c.array::<1>(key)?[0] as i8),
        2 => MetaValue::U16(u16::from_le_bytes(c.array(key)?)),
        3 => MetaValue::I16(i16::from_le_bytes(c.array(key)?)),
        4 => MetaValue::U32(c.u32(key)?),
        5 => MetaValue::I32(i32::from_le_bytes(c.array(key)?)),
        6 => MetaValue::F32(f32::from_le_bytes(c.array(key)?)),
        7 => match c.array::<1>(key)?[0] {
            0 => MetaValue::Bool(false),
            1 => MetaValue::Bool(true),
            b => return Err(c.corrupt(&format!("metadata '{key}': bool byte {b}"))),
        },
        8 => MetaValue::String(c.string(key)?),
        9 => MetaValue::Array(read_array(c, key, depth)?),
        10 => MetaValue::U64(c.u64(key)?),
        11 => MetaValue::I64(i64::from_le_bytes(c.array(key)?)),
        12 => MetaValue::F64(f64::from_le_bytes(c.array(key)?)),
        other => return Err(c.corrupt(&format!("metadata '{key}': unknown value type {other}"))),
    })
}

fn read_array(c: &mut Cursor, key: &str, depth: u32) -> Result<MetaArray> {
    if depth > 2 {
        return Err(c.corrupt(&format!("metadata '{key}': arrays nested too deeply")));
    }
    let elem = c.u32(key)?;
    let n = c.count(min_size(elem), &format!("element count of '{key}'"))?;
    macro_rules! prim {
        ($variant:ident, $t:ty) => {{
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(<$t>::from_le_bytes(c.array(key)?));
            }
            MetaArray::$variant(v)
        }};
    }
    Ok(match elem {
        0 => prim!(U8, u8),
        1 => prim!(I8, i8),
        2 => prim!(U16, u16),
        3 => prim!(I16, i16),
        4 => prim!(U32, u32),
        5 => prim!(I32, i32),
        6 => prim!(F32, f32),
        10 => prim!(U64, u64),
        11 => prim!(I64, i64),
        12 => prim!(F64, f64),
        7 => {
            let raw = c.take(n, key)?;
            let mut v = Vec::with_capacity(n);
            for &b in raw {
                match b {
                    0 | 1 => v.push(b == 1),
                    _ => return Err(c.corrupt(&format!("metadata '{key}': bool byte {b}"))),
                }
            }
            MetaArray::Bool(v)
        }
        8 => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(c.string(key)?);
            }
            MetaArray::String(v)
        }
        9 => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_array(c, key, depth + 1)?);
            }
            MetaArray::Array(v)
        }
        other => return Err(c.corrupt(&format!("metadata '{key}': unknown array element type {other}"))),
    })
}

pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { path, bytes, pos: 0 };
    if bytes.len() < 4 {
        return Err(c.corrupt("file too short for a GGUF header"));
    }
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(RuntimeError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
        });
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err(c.corrupt("GGUF version 1 is not supported (convert the file to v3)")),
        v if v.swap_bytes() <= 3 => {
            return Err(c.corrupt("big-endian GGUF files are not supported"));
        }
        v => return Err(c.corrupt(&format!("unsupported GGUF version {v}"))),
    }
    // A tensor entry is at least name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    let n_tensors = c.count(32, "tensor count")?;
    let n_kv = c.count(13, "metadata count")?;

    let mut metadata = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32(&key)?;
        let value = read_value(&mut c, ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(c.corrupt(&format!("duplicate metadata key '{key}'")));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => return Err(c.corrupt("general.alignment must be a power of two")),
        },
    };

    struct RawTensor {
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
        rel_offset: u64,
        n_bytes: usize,
    }
    let mut raw = Vec::with_capacity(n_tensors);
    let mut seen = std::collections::HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let tensor_err = |problem: String| RuntimeError::Tensor {
            path: path.to_path_buf(),
            name: name.clone(),
            problem,
        };
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(tensor_err(format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dimension")?);
        }
        let ty_id = c.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id).map_err(|e| tensor_err(e.to_string()))?;
        let rel_offset = c.u64("tensor offset")?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n > 0 && n <= bytes.len() as u64 * 8)
            .ok_or_else(|| tensor_err(format!("implausible shape {dims:?}")))?;
        let row = usize::try_from(dims[0]).map_err(|_| tensor_err("row too long".into()))?;
        let row_bytes = ty.row_bytes(row).map_err(|e| tensor_err(e.to_string()))?;
        let n_bytes = (n_elements / dims[0])
            .checked_mul(row_bytes as u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| tensor_err("size overflows".into()))?;
        if !rel_offset.is_multiple_of(alignment) {
            return Err(tensor_err(format!(
                "data offset {rel_offset} is not {alignment}-byte aligned"
            )));
        }
        if !seen.insert(name.clone()) {
            return Err(tensor_err("appears twice in the tensor directory".into()));
        }
        raw.push(RawTensor {
            name,
            dims,
            ty,
            rel_offset,
            n_bytes,
        });
    }

    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let end = data_start
            .checked_add(t.rel_offset)
            .and_then(|o| o.checked_add(t.n_bytes as u64))
            .filter(|&end| end <= bytes.len() as u64);
        if end.is_none() {
            return Err(RuntimeError::Tensor {
                path: path.to_path_buf(),
                name: t.name,
                problem: format!(
                    "data at offset {} + {} bytes runs past the end of the file ({} bytes): truncated?",
                    data_start + t.rel_offset,
                    t.n_bytes,
                    bytes.len()
                ),
            });
        }
        tensors.push(TensorInfo {
            name: t.name,
            dims: t.dims,
            ty: t.ty,
            offset: (data_start + t.rel_offset) as usize,
            n_bytes: t.n_bytes,
        });
    }
    Ok(Parsed {
        version,
        metadata,
        tensors,
    })
}
