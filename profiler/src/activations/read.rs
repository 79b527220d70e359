//! Reading a trace directory: the manifest, and one layer of one array over
//! every shard of a split (what a trainer holds in memory at a time).

use std::fs;
use std::path::{Path, PathBuf};

use half::f16;

use super::npy::{self, Dtype, NpyFile};
use super::{Array, Manifest, Split, FORMAT, VERSION};
use crate::{ProfileError, Result};

/// A row-major `rows × cols` matrix of f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Rows {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

pub struct Trace {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl Trace {
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join("manifest.json");
        let bytes = fs::read(&path).map_err(|e| ProfileError::io(&path, e))?;
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| ProfileError::Json {
            path: path.clone(),
            source: e,
        })?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(ProfileError::Invalid(format!(
                "{}: format {} version {}, expected {FORMAT} version {VERSION}",
                path.display(),
                manifest.format,
                manifest.version
            )));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    pub fn n_layer(&self) -> usize {
        self.manifest.model.n_layer
    }
    pub fn n_embd(&self) -> usize {
        self.manifest.model.n_embd
    }
    pub fn n_ff(&self) -> usize {
        self.manifest.model.n_ff
    }

    pub fn split(&self, name: &str) -> Result<&Split> {
        let s = self
            .manifest
            .splits
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| ProfileError::Invalid(format!("{}: no split {name:?}", self.dir.display())))?;
        if s.shards.is_empty() {
            return Err(ProfileError::Invalid(format!(
                "{}: split {name:?} has no recorded shard yet",
                self.dir.display()
            )));
        }
        Ok(s)
    }

    /// Layer `layer` of `array` over every shard of `split`, as `[tokens][width]`.
    pub fn layer(&self, split: &str, array: Array, layer: usize) -> Result<Rows> {
        let s = self.split(split)?;
        let (l, width) = (
            self.n_layer(),
            if array == Array::Act {
                self.n_ff()
            } else {
                self.n_embd()
            },
        );
        if layer >= l {
            return Err(ProfileError::Invalid(format!("layer {layer} of a {l}-layer trace")));
        }
        // Every shard's file is checked against the manifest before anything
        // is sized by the manifest's counts: the files bound them.
        let mut files = Vec::with_capacity(s.shards.len());
        for shard in &s.shards {
            let path = self.dir.join(&shard.dir).join(array.file_name());
            let f = NpyFile::open(&path)?;
            f.expect(&path, Dtype::F16, &[l, shard.tokens, width])?;
            files.push((path, f, shard.tokens));
        }
        let mut data = Vec::with_capacity(s.recorded_tokens() * width);
        let mut bytes = Vec::new();
        for (path, mut f, tokens) in files {
            f.read_elements(&path, layer * tokens * width, tokens * width, &mut bytes)?;
            data.extend(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()));
        }
        Ok(Rows {
            rows: s.recorded_tokens(),
            cols: width,
            data,
        })
    }

    /// Token ids of `split`, in recording order.
    pub fn tokens(&self, split: &str) -> Result<Vec<u32>> {
        let s = self.split(split)?;
        // Not sized by the manifest's counts: the files are checked one by one.
        let mut out = Vec::new();
        for shard in &s.shards {
            let path = self.dir.join(&shard.dir).join("tokens.npy");
            let (shape, t) = npy::read_u32(&path)?;
            if shape != [shard.tokens] {
                return Err(ProfileError::Invalid(format!(
                    "{}: shape {shape:?}, the manifest says {} tokens",
                    path.display(),
                    shard.tokens
                )));
            }
            out.extend(t);
        }
        Ok(out)
    }

    /// Per neuron mean |act(g)·u| on the training split, `[L][n_ff]`.
    pub fn scores(&self) -> Result<Rows> {
        let path = self.dir.join("scores.npy");
        let (shape, data) = npy::read_f32(&path)?;
        if shape != [self.n_layer(), self.n_ff()] {
            return Err(ProfileError::Invalid(format!("{}: shape {shape:?}", path.display())));
        }
        Ok(Rows {
            rows: shape[0],
            cols: shape[1],
            data,
        })
    }

    /// The hot set whose output `partial` holds, `[L][n_ff]` of 0/1.
    pub fn hot(&self) -> Result<Rows> {
        let path = self.dir.join("hot.npy");
        let (shape, bytes) = npy::read_u8(&path)?;
        if shape != [self.n_layer(), self.n_ff()] {
            return Err(ProfileError::Invalid(format!("{}: shape {shape:?}", path.display())));
        }
        Ok(Rows {
            rows: self.n_layer(),
            cols: self.n_ff(),
            data: bytes.iter().map(|&b| b as f32).collect(),
        })
    }
}
