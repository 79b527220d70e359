//! The streaming engine over a `.lsflash` file: the resident part (attention,
//! norms, embeddings) runs the dense code of `model::forward`; the FFN of each
//! layer is computed from neuron bundles ([`leanstream_kernels::sparse_ffn`])
//! that a policy supplies.
//!
//! Policies:
//! - [`Policy::Dense`]: every bundle read once at open into memory; each token
//!   uses all neurons.
//! - [`Policy::DenseStream`]: each token streams all bundles of each layer
//!   through the [`IoEngine`] (O_DIRECT), prefetching layer l+1 while layer l
//!   computes; a [`NeuronCache`] (LRU, under a byte budget) serves hits and
//!   keeps what fits (see [`stream`]).
//!
//! Both compute the same arithmetic on the same bytes in the same order
//! (activations per neuron, then the down sum in ascending neuron id), so
//! their logits are bit-identical.

mod stream;

use std::os::unix::fs::FileExt;
use std::path::Path;

use leanstream_kernels::sparse_ffn::{accumulate_down, neuron_activation, BundleFormat, FfnInput, LayerActivations};
use leanstream_kernels::ActBuffer;
use rayon::prelude::*;

use crate::cache::{CacheShape, FfnBudget, MemoryReport};
use crate::flash::format::LsFlash;
use crate::gguf::GgufFile;
use crate::model::{FfnActivation, FfnStep, Model, RunState};
use crate::{Result, RuntimeError};

pub use stream::Streamer;

/// How the FFN bundles reach compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Dense,
    DenseStream,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "dense" => Ok(Self::Dense),
            "dense-stream" => Ok(Self::DenseStream),
            other => Err(format!("unknown policy '{other}' (expected dense or dense-stream)")),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dense => "dense",
            Self::DenseStream => "dense-stream",
        })
    }
}

/// Whether `path` is a `.lsflash` file (by extension, else by magic).
pub fn is_lsflash(path: &Path) -> bool {
    if path.extension().is_some_and(|e| e == "lsflash") {
        return true;
    }
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut magic, 0))
        .is_ok_and(|_| &magic == b"LSFLASH\0")
}

/// A `.lsflash` model: the resident part as a [`Model`] without FFN
/// matrices, and the bundle format of each layer.
pub struct FlashModel {
    pub flash: LsFlash,
    pub model: Model,
    pub formats: Vec<BundleFormat>,
}

impl FlashModel {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let flash = LsFlash::open(path)?;
        let (off, len) = flash.resident_range();
        let gguf = GgufFile::open_range(flash.path(), off, len as usize)?;
        let model = Model::from_gguf_without_ffn(gguf)?;
        let formats = (0..flash.n_layer())
            .map(|l| {
                let b = flash.layout(l);
                BundleFormat::new(b.gate_type, b.up_type, b.down_type, model.config.n_embd).map_err(RuntimeError::from)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { flash, model, formats })
    }

    /// Bytes of all FFN bundles.
    pub fn ffn_bytes(&self) -> u64 {
        CacheShape::from_flash(&self.flash).total_ffn_bytes()
    }

    /// An FFN engine under `policy`; `budget` sizes the neuron cache of
    /// `DenseStream` (ignored by `Dense`, which holds everything).
    pub fn engine(&self, policy: Policy, budget: FfnBudget) -> Result<FlashEngine> {
        let source = match policy {
            Policy::Dense => Source::Resident(self.read_all()?),
            Policy::DenseStream => Source::Stream(Box::new(Streamer::new(self, budget.resolve(self.ffn_bytes()))?)),
        };
        let c = &self.model.config;
        Ok(FlashEngine {
            policy,
            formats: self.formats.clone(),
            act: match c.ffn_activation {
                FfnActivation::Silu => leanstream_kernels::sparse_ffn::FfnActivation::Silu,
                FfnActivation::GeluTanh => leanstream_kernels::sparse_ffn::FfnActivation::GeluTanh,
            },
            n_embd: c.n_embd,
            gate_acts: ActBuffer::with_capacity(c.n_embd, 1),
            up_acts: ActBuffer::with_capacity(c.n_embd, 1),
            layer_acts: LayerActivations::new(c.n_ff),
            a: vec![0.0; c.n_ff],
            source,
            tokens: 0,
        })
    }

    /// Every layer's bundles in neuron order (one read per layer).
    fn read_all(&self) -> Result<Vec<Vec<u8>>> {
        let file = std::fs::File::open(self.flash.path()).map_err(|e| RuntimeError::io(self.flash.path(), e))?;
        (0..self.flash.n_layer())
            .map(|l| {
                let (off, len) = self.flash.layer_extent(l);
                let mut stored = vec![0u8; len as usize];
                file.read_exact_at(&mut stored, off)
                    .map_err(|e| RuntimeError::io(self.flash.path(), e))?;
                let bb = self.flash.layout(l).bundle_bytes();
                let mut by_id = vec![0u8; stored.len()];
                for (pos, b) in stored.chunks_exact(bb).enumerate() {
                    let i = self.flash.neuron_at(l, pos);
                    by_id[i * bb..(i + 1) * bb].copy_from_slice(b);
                }
                Ok(by_id)
            })
            .collect()
    }

    /// Runs `tokens` at `pos0..` (as `Model::forward_outputs`) with the FFN from `engine`.
    pub fn forward(
        &self,
        st: &mut RunState,
        engine: &mut FlashEngine,
        tokens: &[u32],
        pos0: usize,
        outputs: std::ops::Range<usize>,
    ) -> Result<()> {
        self.model.forward_with(st, tokens, pos0, outputs, Some(engine))
    }

    /// Memory by category for `st` and `engine`.
    pub fn memory(&self, st: &RunState, engine: &FlashEngine) -> MemoryReport {
        let (ffn_cache, io_buffers) = match &engine.source {
            Source::Resident(layers) => (layers.iter().map(|l| l.len() as u64).sum(), 0),
            Source::Stream(s) => (s.cache_bytes(), s.buffer_bytes()),
        };
        MemoryReport {
            resident_weights: self.flash.resident_range().1,
            kv_cache: st.kv.bytes() as u64,
            ffn_cache,
            io_buffers,
            predictor: 0,
            other: (st.bytes() - st.kv.bytes()) as u64,
        }
    }
}

/// Counters of an engine since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Token rows whose FFN ran (counted at layer 0).
    pub tokens: u64,
    /// Bytes and reads the I/O engine issued (0 for `Dense` after open).
    pub bytes_read: u64,
    pub reads: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl EngineStats {
    /// misses / lookups; 0 without lookups (`Dense` holds every bundle).
    pub fn cache_miss_ratio(&self) -> f64 {
        let n = self.cache_hits + self.cache_misses;
        if n == 0 {
            0.0
        } else {
            self.cache_misses as f64 / n as f64
        }
    }
}

enum Source {
    /// Per layer, all bundles in neuron order.
    Resident(Vec<Vec<u8>>),
    Stream(Box<Streamer>),
}

/// The FFN of a [`FlashModel`] under one policy; pass it to
/// [`FlashModel::forward`] (it is the model's [`FfnStep`]).
pub struct FlashEngine {
    pub policy: Policy,
    formats: Vec<BundleFormat>,
    act: leanstream_kernels::sparse_ffn::FfnActivation,
    n_embd: usize,
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    layer_acts: LayerActivations,
    /// Activation of each neuron (scratch of the parallel stage 1).
    a: Vec<f32>,
    source: Source,
    tokens: u64,
}

impl FlashEngine {
    pub fn stats(&self) -> EngineStats {
        let mut s = match &self.source {
            Source::Resident(_) => EngineStats::default(),
            Source::Stream(st) => st.stats(),
        };
        s.tokens = self.tokens;
        s
    }

    /// Bytes of the neuron cache's budget (all FFN bytes for `Dense`).
    pub fn ffn_budget_bytes(&self) -> u64 {
        match &self.source {
            Source::Resident(layers) => layers.iter().map(|l| l.len() as u64).sum(),
            Source::Stream(s) => s.budget_bytes(),
        }
    }
}

impl FfnStep for FlashEngine {
    fn ffn(&mut self, layer: usize, xb: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        if layer == 0 {
            self.tokens += n as u64;
        }
        let format = self.formats[layer];
        let (bb, n_ff) = (format.bundle_bytes(), self.a.len());
        let mut compute = RowCompute {
            format: &format,
            act: self.act,
            n_embd: self.n_embd,
            gate_acts: &mut self.gate_acts,
            up_acts: &mut self.up_acts,
            layer_acts: &mut self.layer_acts,
            a: &mut self.a,
        };
        match &mut self.source {
            Source::Resident(layers) => {
                let bundles: Vec<&[u8]> = layers[layer].chunks_exact(bb).collect();
                compute.run(xb, n, out, &bundles)
            }
            Source::Stream(s) => {
                let view = s.load_layer(layer)?;
                let bundles: Vec<&[u8]> = (0..n_ff).map(|i| view.bundle(i)).collect();
                compute.run(xb, n, out, &bundles)?;
                s.finish_layer(layer);
                Ok(())
            }
        }
    }
}

/// All neurons of one layer, token row by token row.
struct RowCompute<'a> {
    format: &'a BundleFormat,
    act: leanstream_kernels::sparse_ffn::FfnActivation,
    n_embd: usize,
    gate_acts: &'a mut ActBuffer,
    up_acts: &'a mut ActBuffer,
    layer_acts: &'a mut LayerActivations,
    a: &'a mut [f32],
}

impl RowCompute<'_> {
    /// `bundles[i]` is neuron i's bundle. Stage 1 (the activations, a pure
    /// function of each bundle) runs in parallel over neurons; stage 2 sums in
    /// ascending neuron id, so the result does not depend on the threads.
    fn run(&mut self, xb: &[f32], n: usize, out: &mut [f32], bundles: &[&[u8]]) -> Result<()> {
        let d = self.n_embd;
        let f = self.format;
        let act = self.act;
        let (gate_ty, up_ty) = (f.gate_ty.vec_dot_type(), f.up_ty.vec_dot_type());
        for t in 0..n {
            let x = &xb[t * d..(t + 1) * d];
            self.gate_acts.quantize(gate_ty, x, 1, d)?;
            if up_ty != gate_ty {
                self.up_acts.quantize(up_ty, x, 1, d)?;
            }
            let up_acts = if up_ty == gate_ty {
                &*self.gate_acts
            } else {
                &*self.up_acts
            };
            let input = FfnInput::new(f, self.gate_acts, up_acts, 0)?;
            self.a
                .par_chunks_mut(NEURON_CHUNK)
                .zip(bundles.par_chunks(NEURON_CHUNK))
                .try_for_each(|(a, b)| {
                    a.iter_mut()
                        .zip(b)
                        .try_for_each(|(ai, bundle)| neuron_activation(f, &input, act, bundle).map(|v| *ai = v))
                })?;
            self.layer_acts.clear();
            for (i, &ai) in self.a.iter().enumerate() {
                self.layer_acts.set(i, ai)?;
            }
            let y = &mut out[t * d..(t + 1) * d];
            y.fill(0.0);
            accumulate_down(f, self.layer_acts, |i| bundles[i], y)?;
        }
        Ok(())
    }
}

/// Neurons per parallel task of stage 1.
const NEURON_CHUNK: usize = 256;
