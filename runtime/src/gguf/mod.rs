//! GGUF v2/v3 reader. The file is treated as hostile: every count, length and
//! offset is checked against the bytes actually present before anything is
//! allocated or sliced, and each error names the file and the field.

mod reader;
mod value;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use leanstream_kernels::{GgmlType, QMatrix};
use memmap2::Mmap;

use crate::{Result, RuntimeError};
pub use value::{MetaArray, MetaValue};
pub use writer::{GgufStreamWriter, GgufWriter, TensorDesc};

/// One tensor's directory entry, with its data range already validated.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the row length (contiguous), `dims[1]` the row count.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A memory-mapped GGUF file with parsed metadata and tensor directory.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| RuntimeError::io(&path, e))?;
        // SAFETY: the map is read-only; a file truncated underneath us by another
        // process is outside what any mmap-based loader can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| RuntimeError::io(&path, e))?;
        Self::from_mmap(path, mmap)
    }

    /// A GGUF image embedded in a larger file at `offset..offset + len` (the
    /// resident part of an `.lsflash` file). Tensor offsets, [`Self::data`] and
    /// [`Self::file_len`] are relative to the embedded image; errors name `path`.
    /// The caller checks that the range lies inside the file.
    ///
    /// The image is *copied* into anonymous memory and its pages dropped from
    /// the page cache: the resident part then counts where it belongs (the
    /// process, not the kernel's file cache), and the file can be replaced
    /// while it runs.
    pub fn open_range(path: impl AsRef<Path>, offset: u64, len: usize) -> Result<Self> {
        use std::os::unix::fs::FileExt;
        let path = path.as_ref().to_path_buf();
        let file = crate::flash::pagecache::open_uncached(&path).map_err(|e| RuntimeError::io(&path, e))?;
        if len == 0 {
            return Err(RuntimeError::Corrupt {
                path,
                problem: "empty GGUF image".into(),
            });
        }
        let mut image = memmap2::MmapMut::map_anon(len).map_err(|e| RuntimeError::io(&path, e))?;
        file.read_exact_at(&mut image[..len], offset)
            .map_err(|e| RuntimeError::io(&path, e))?;
        crate::flash::pagecache::drop_cached(&file);
        let mmap = image.make_read_only().map_err(|e| RuntimeError::io(&path, e))?;
        Self::from_mmap(path, mmap)
    }

    fn from_mmap(path: PathBuf, mmap: Mmap) -> Result<Self> {
        let parsed = reader::parse(&path, &mmap)?;
        let by_name = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole mapped file; tensor offsets index into it.
    pub fn data(&self) -> &[u8] {
        &self.mmap
    }

    /// Size of the mapped file in bytes.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Raw bytes of a tensor (range validated at open).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.offset..info.offset + info.n_bytes]
    }

    fn tensor_error(&self, name: &str, problem: impl Into<String>) -> RuntimeError {
        RuntimeError::Tensor {
            path: self.path.clone(),
            name: name.to_string(),
            problem: problem.into(),
        }
    }

    /// A tensor that must exist with exactly these GGML dims.
    pub fn tensor(&self, name: &str, dims: &[u64]) -> Result<(&TensorInfo, &[u8])> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| self.tensor_error(name, "missing"))?;
        if info.dims != dims {
            return Err(self.tensor_error(name, format!("shape {:?}, expected {:?}", info.dims, dims)));
        }
        Ok((info, self.tensor_bytes(info)))
    }

    /// A 2-D weight matrix of `rows` × `cols` (GGML dims `[cols, rows]`).
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix<'_>> {
        let (info, bytes) = self.tensor(name, &[cols as u64, rows as u64])?;
        QMatrix::new(info.ty, rows, cols, bytes).map_err(|e| self.tensor_error(name, e.to_string()))
    }

    /// A 1-D F32 tensor of length `n`, copied out (norm weights and biases are small).
    pub fn vector_f32(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let (info, bytes) = self.tensor(name, &[n as u64])?;
        let mut out = vec![0.0f32; n];
        leanstream_kernels::dequant::dequantize_row(info.ty, bytes, &mut out)
            .map_err(|e| self.tensor_error(name, e.to_string()))?;
        Ok(out)
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn meta_error(&self, key: &str, problem: impl Into<String>) -> RuntimeError {
        RuntimeError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            problem: problem.into(),
        }
    }

    fn required(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| self.meta_error(key, "missing"))
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.meta_error(key, format!("expected a string, found {}", v.type_name())))
            })
            .transpose()
    }

    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.meta_error(key, "missing"))
    }

    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    self.meta_error(key, format!("expected an unsigned integer, found {}", v.type_name()))
                })
            })
            .transpose()
    }

    pub fn req_u64(&self, key: &str) -> Result<u64> {
        let v = self.required(key)?;
        v.as_u64()
            .ok_or_else(|| self.meta_error(key, format!("expected an unsigned integer, found {}", v.type_name())))
    }

    /// An unsigned count that must fit comfortably in memory-sized arithmetic.
    pub fn req_usize(&self, key: &str) -> Result<usize> {
        let v = self.req_u64(key)?;
        usize::try_from(v)
            .ok()
            .filter(|&n| n <= 1 << 40)
            .ok_or_else(|| self.meta_error(key, format!("value {v} is out of range")))
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_f32()
                    .ok_or_else(|| self.meta_error(key, format!("expected a number, found {}", v.type_name())))
            })
            .transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.meta_error(key, format!("expected a bool, found {}", v.type_name())))
            })
            .transpose()
    }

    /// An array metadata value; `None` when absent, an error when of another kind.
    pub fn get_array(&self, key: &str) -> Result<Option<&MetaArray>> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.meta_error(key, format!("expected an array, found {}", v.type_name()))),
        }
    }

    /// Error constructor for callers validating metadata semantics.
    pub fn bad_metadata(&self, key: &str, problem: impl Into<String>) -> RuntimeError {
        self.meta_error(key, problem)
    }
}
