//! The streaming engine over a `.lsflash` file: the resident part (attention,
//! norms, embeddings) runs the dense code of `model::forward`; the FFN of each
//! layer is computed from neuron bundles ([`leanstream_kernels::sparse_ffn`])
//! that a policy supplies.
//!
//! Policies (none needs a predictor):
//! - [`Policy::Dense`]: every bundle read once at open into memory (the
//!   reference).
//! - [`Policy::DenseStream`]: each token streams all bundles of each layer
//!   through the [`IoEngine`](crate::flash::io::IoEngine) (O_DIRECT),
//!   prefetching layer l+1 while layer l computes; a neuron cache under a byte
//!   budget serves hits and keeps what fits ([`stream`]).
//! - [`Policy::Oracle`]: the true active set of every layer is known in
//!   advance (replayed from a recorded run, [`trace`]) and only those bundles
//!   are loaded, one layer ahead: the upper bound for any predictor.
//! - [`Policy::GateFirst`]: gate rows resident; after attention the exact
//!   `|act(g)|` of every neuron decides which bundles to load, then compute
//!   waits for them: no cross-layer overlap, the cost of precise decisions.
//!
//! With a sparsity level, `dense`, `dense-stream` and `oracle` keep the
//! neurons with `|act(g)·u|` at or above the layer's calibrated threshold;
//! `gate-first` keeps those with `|act(g)|` at or above the gate threshold.
//! All policies compute the same arithmetic on the same bytes in the same
//! order ([`compute`]), so policies that keep the same neurons give
//! bit-identical logits.

mod compute;
mod stream;
pub mod trace;

use std::os::unix::fs::FileExt;
use std::path::Path;

use leanstream_kernels::sparse_ffn::BundleFormat;

use crate::cache::{CacheShape, FfnBudget, MemoryReport};
use crate::flash::format::{LsFlash, SparsityLevel};
use crate::model::{Ffn, FfnStep, Model, RunState};
use crate::{Result, RuntimeError};

use compute::{Compute, Select};
pub use stream::{CachePolicy, Streamer, Want};
pub use trace::{ActiveTrace, TraceCursor};

/// How the FFN bundles reach compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Dense,
    DenseStream,
    Oracle,
    GateFirst,
}

impl Policy {
    pub const ALL: [Policy; 4] = [Self::Dense, Self::DenseStream, Self::Oracle, Self::GateFirst];

    /// Whether bundles come from flash while the model runs.
    pub fn streams(self) -> bool {
        self != Self::Dense
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "dense" => Ok(Self::Dense),
            "dense-stream" => Ok(Self::DenseStream),
            "oracle" => Ok(Self::Oracle),
            "gate-first" => Ok(Self::GateFirst),
            other => Err(format!(
                "unknown policy '{other}' (expected dense, dense-stream, oracle or gate-first)"
            )),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dense => "dense",
            Self::DenseStream => "dense-stream",
            Self::Oracle => "oracle",
            Self::GateFirst => "gate-first",
        })
    }
}

/// Default of [`EngineOptions::merge_gap_bytes`]. On the development disk
/// (fio, O_DIRECT, QD16) a random read costs about as much device time as
/// 140 KB of sequential transfer, so reading a gap of up to 64 KiB is cheaper
/// than issuing a second request; the profiler measures this per device.
pub const DEFAULT_MERGE_GAP: usize = 64 << 10;

/// How to build a [`FlashEngine`].
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub policy: Policy,
    /// Bytes of the neuron cache of the streaming policies, and how it evicts.
    pub cache_bytes: u64,
    pub cache_policy: CachePolicy,
    /// Unneeded bytes between two needed bundles that one read may span
    /// ([`DEFAULT_MERGE_GAP`] unless tuned for the device).
    pub merge_gap_bytes: usize,
    /// Thresholds (all zero: no sparsity).
    pub level: SparsityLevel,
    /// Record each FFN call's kept sets (`dense` and `dense-stream` only),
    /// for an `oracle` replay.
    pub record: bool,
    /// The recorded run an `oracle` engine replays.
    pub trace: Option<ActiveTrace>,
}

/// Whether `path` is a `.lsflash` file (by extension, else by magic).
pub fn is_lsflash(path: &Path) -> bool {
    if path.extension().is_some_and(|e| e == "lsflash") {
        return true;
    }
    let mut magic = [0u8; 8];
    crate::flash::pagecache::open_uncached(path)
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
        let mut flash = LsFlash::open(path)?;
        let gguf = flash
            .take_resident()
            .expect("a freshly opened file has its resident image");
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

    /// An FFN engine under `policy` without sparsity; `budget` sizes the
    /// neuron cache of the streaming policies (`Dense` holds everything).
    pub fn engine(&self, policy: Policy, budget: FfnBudget) -> Result<FlashEngine> {
        self.engine_with(EngineOptions {
            policy,
            cache_bytes: budget.resolve(self.ffn_bytes()),
            cache_policy: CachePolicy::Lru,
            merge_gap_bytes: DEFAULT_MERGE_GAP,
            level: SparsityLevel::dense(self.flash.n_layer()),
            record: false,
            trace: None,
        })
    }

    /// The thresholds stored for `sparsity` (0 needs none); the error lists
    /// the levels the file has.
    pub fn sparsity_level(&self, sparsity: f32) -> Result<SparsityLevel> {
        self.flash.header().level(sparsity).ok_or_else(|| {
            let have: Vec<String> = self.flash.header().sparsity.iter().map(|l| l.sparsity.to_string()).collect();
            RuntimeError::Invalid(format!(
                "{}: no thresholds for sparsity {sparsity} (it has: {}); re-pack with --calibrate TEXT --sparsities ...",
                self.flash.path().display(),
                if have.is_empty() { "none".to_string() } else { have.join(", ") }
            ))
        })
    }

    /// Bytes an engine under `policy` holds besides its neuron cache: I/O
    /// staging and read buffers, resident gate rows, or all bundles for
    /// `Dense`; gate-first's scratch for batches of up to `max_batch` rows.
    /// With the resident weights and the run state, what a `--mem-budget`
    /// must cover before the cache gets anything.
    pub fn engine_overhead_bytes(&self, policy: Policy, max_batch: usize) -> u64 {
        let n_ff = self.flash.n_ff() as u64;
        match policy {
            Policy::Dense => self.ffn_bytes(),
            Policy::DenseStream | Policy::Oracle => Streamer::overhead_bytes(self),
            Policy::GateFirst => {
                let scratch = max_batch as u64 * (n_ff * 4 + n_ff.div_ceil(64) * 8);
                Streamer::overhead_bytes(self) + self.gate_rows_bytes() + scratch
            }
        }
    }

    fn gate_rows_bytes(&self) -> u64 {
        (0..self.flash.n_layer())
            .map(|l| (self.flash.layout(l).gate_bytes * self.flash.n_ff()) as u64)
            .sum()
    }

    pub fn engine_with(&self, o: EngineOptions) -> Result<FlashEngine> {
        let n_layer = self.flash.n_layer();
        if o.level.full.len() != n_layer || o.level.gate.len() != n_layer {
            return Err(RuntimeError::Invalid(format!(
                "sparsity level {} has thresholds for {} layers, the model has {n_layer}",
                o.level.sparsity,
                o.level.full.len()
            )));
        }
        let trace = match (o.policy, o.trace, o.record) {
            (Policy::Oracle, Some(t), false) if t.n_ff() == self.flash.n_ff() => TraceMode::Replay(TraceCursor::new(t)),
            (Policy::Oracle, _, _) => {
                return Err(RuntimeError::Invalid(
                    "the oracle policy replays a recorded run: pass the trace of a dense or dense-stream run \
                     of this model at the same sparsity"
                        .into(),
                ))
            }
            (Policy::Dense | Policy::DenseStream, None, true) => TraceMode::Record(ActiveTrace::new(self.flash.n_ff())),
            (_, None, false) => TraceMode::Off,
            (p, _, _) => {
                return Err(RuntimeError::Invalid(format!(
                    "policy {p} neither records nor replays an active-set trace"
                )))
            }
        };
        let source = match o.policy {
            Policy::Dense => Source::Resident(self.read_all()?),
            _ => Source::Stream(Box::new(Streamer::new(
                self,
                o.cache_bytes,
                o.cache_policy,
                o.merge_gap_bytes,
            )?)),
        };
        let gate_rows = match o.policy {
            Policy::GateFirst => self.read_gate_rows()?,
            _ => Vec::new(),
        };
        let c = &self.model.config;
        let words = c.n_ff.div_ceil(64);
        Ok(FlashEngine {
            policy: o.policy,
            level: o.level,
            formats: self.formats.clone(),
            compute: Compute::new(c.ffn_activation, c.n_embd, c.n_ff),
            source,
            gate_rows,
            trace,
            gate_values: Vec::new(),
            row_bits: Vec::new(),
            union: vec![0; words],
            next_union: vec![0; words],
            n_layer,
            n_ff: c.n_ff,
            tokens: 0,
        })
    }

    /// Each layer's gate rows in neuron order (for `gate-first`).
    fn read_gate_rows(&self) -> Result<Vec<Vec<u8>>> {
        let n_ff = self.flash.n_ff();
        (0..self.flash.n_layer())
            .map(|l| {
                let gb = self.flash.layout(l).gate_bytes;
                let mut rows = vec![0u8; n_ff * gb];
                self.flash
                    .for_each_bundle(l, 0..n_ff, |i, b| rows[i * gb..(i + 1) * gb].copy_from_slice(&b[..gb]))?;
                Ok(rows)
            })
            .collect()
    }

    /// Every layer's bundles in neuron order.
    fn read_all(&self) -> Result<Vec<Vec<u8>>> {
        let n_ff = self.flash.n_ff();
        (0..self.flash.n_layer())
            .map(|l| {
                let bb = self.flash.layout(l).bundle_bytes();
                let mut by_id = vec![0u8; n_ff * bb];
                self.flash
                    .for_each_bundle(l, 0..n_ff, |i, b| by_id[i * bb..(i + 1) * bb].copy_from_slice(b))?;
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
        self.model.forward_with(st, tokens, pos0, outputs, Ffn::Step(engine))
    }

    /// Memory by category for `st` and `engine`. The predictor category
    /// holds what a policy knows beyond the cache: gate-first's resident gate
    /// rows, the oracle's trace.
    pub fn memory(&self, st: &RunState, engine: &FlashEngine) -> MemoryReport {
        let (ffn_cache, io_buffers) = match &engine.source {
            Source::Resident(layers) => (layers.iter().map(|l| l.len() as u64).sum(), 0),
            Source::Stream(s) => (s.cache_bytes(), s.buffer_bytes()),
        };
        let trace = match &engine.trace {
            TraceMode::Off => 0,
            TraceMode::Record(t) => t.bytes(),
            TraceMode::Replay(c) => c.bytes(),
        };
        let scratch = (engine.gate_values.capacity() * 4 + engine.row_bits.capacity() * 8) as u64;
        MemoryReport {
            resident_weights: self.flash.resident_range().1,
            kv_cache: st.kv.bytes() as u64,
            ffn_cache,
            io_buffers,
            predictor: engine.gate_rows.iter().map(|r| r.len() as u64).sum::<u64>() + trace,
            tokenizer: self.model.tokenizer.heap_bytes(),
            other: (st.bytes() - st.kv.bytes()) as u64 + scratch,
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
    /// Bytes of the bundles asked for; `bytes_read` exceeds it by the
    /// alignment and coalescing padding (read amplification).
    pub bytes_requested: u64,
    pub reads: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Neurons computed / neurons the layers have, over all rows.
    pub kept: u64,
    pub considered: u64,
}

impl EngineStats {
    /// Fraction of neurons skipped (the achieved sparsity).
    pub fn skipped_fraction(&self) -> f64 {
        if self.considered == 0 {
            0.0
        } else {
            1.0 - self.kept as f64 / self.considered as f64
        }
    }

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

enum TraceMode {
    Off,
    Record(ActiveTrace),
    Replay(TraceCursor),
}

/// The FFN of a [`FlashModel`] under one policy; pass it to
/// [`FlashModel::forward`] (it is the model's [`FfnStep`]).
pub struct FlashEngine {
    pub policy: Policy,
    level: SparsityLevel,
    formats: Vec<BundleFormat>,
    compute: Compute,
    source: Source,
    /// Gate-first: per layer, the gate rows in neuron order.
    gate_rows: Vec<Vec<u8>>,
    trace: TraceMode,
    /// Gate-first scratch: gate values and candidate bitmaps of a call's rows.
    gate_values: Vec<f32>,
    row_bits: Vec<u64>,
    /// Union of this call's row sets, and of the next call's (oracle).
    union: Vec<u64>,
    next_union: Vec<u64>,
    n_layer: usize,
    n_ff: usize,
    tokens: u64,
}

impl FlashEngine {
    pub fn stats(&self) -> EngineStats {
        let mut s = match &self.source {
            Source::Resident(_) => EngineStats::default(),
            Source::Stream(st) => st.stats(),
        };
        s.tokens = self.tokens;
        s.kept = self.compute.kept;
        s.considered = self.compute.considered;
        s
    }

    /// Bytes of the neuron cache's budget (all FFN bytes for `Dense`).
    pub fn ffn_budget_bytes(&self) -> u64 {
        match &self.source {
            Source::Resident(layers) => layers.iter().map(|l| l.len() as u64).sum(),
            Source::Stream(s) => s.budget_bytes(),
        }
    }

    pub fn sparsity(&self) -> f32 {
        self.level.sparsity
    }

    /// Whether streamed reads bypass the page cache (`None` for `Dense`).
    pub fn io_direct(&self) -> Option<bool> {
        match &self.source {
            Source::Resident(_) => None,
            Source::Stream(s) => Some(s.is_direct()),
        }
    }

    /// The neuron cache's eviction policy (`None` for `Dense`).
    pub fn cache_policy_name(&self) -> Option<&'static str> {
        match &self.source {
            Source::Resident(_) => None,
            Source::Stream(s) => Some(s.cache_policy_name()),
        }
    }

    /// The trace recorded so far (an engine made with `record`), leaving it empty.
    pub fn take_trace(&mut self) -> Option<ActiveTrace> {
        match &mut self.trace {
            TraceMode::Record(t) => {
                let n_ff = t.n_ff();
                Some(std::mem::replace(t, ActiveTrace::new(n_ff)))
            }
            _ => None,
        }
    }

    /// FFN calls replayed so far (oracle).
    pub fn replayed_calls(&self) -> Option<usize> {
        match &self.trace {
            TraceMode::Replay(c) => Some(c.position()),
            _ => None,
        }
    }
}

/// The layer after `layer` in run order (the next token's layer 0 after the last).
fn next_layer(layer: usize, n_layer: usize) -> usize {
    (layer + 1) % n_layer
}

impl FfnStep for FlashEngine {
    fn ffn(&mut self, layer: usize, xb: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        if layer == 0 {
            self.tokens += n as u64;
        }
        let f = self.formats[layer];
        let last = layer + 1 == self.n_layer;
        let words = self.compute.words();
        let threshold = self.level.full[layer];
        let Self {
            policy,
            level,
            compute,
            source,
            gate_rows,
            trace,
            gate_values,
            row_bits,
            union,
            next_union,
            n_layer,
            n_ff,
            ..
        } = self;
        let record = match trace {
            TraceMode::Record(t) => Some(t.begin_call(layer, n)),
            _ => None,
        };
        match (policy, source) {
            (Policy::Dense, Source::Resident(layers)) => {
                let bb = f.bundle_bytes();
                let bundles: Vec<&[u8]> = layers[layer].chunks_exact(bb).collect();
                compute.run(&f, xb, n, out, &bundles, Select::Threshold(threshold), record)
            }
            (Policy::DenseStream, Source::Stream(s)) => {
                s.ensure(layer, Want::All)?;
                s.prefetch(next_layer(layer, *n_layer), Want::All)?;
                let view = s.wait(layer)?;
                let bundles: Vec<&[u8]> = (0..*n_ff).map(|i| view.bundle(i)).collect();
                compute.run(&f, xb, n, out, &bundles, Select::Threshold(threshold), record)?;
                s.finish(layer, last);
                Ok(())
            }
            (Policy::Oracle, Source::Stream(s)) => {
                let TraceMode::Replay(cursor) = trace else {
                    unreachable!("checked at construction")
                };
                let k = cursor.advance(layer, n)?;
                s.ensure(layer, Want::Set(cursor.union()))?;
                if let Some(next) = cursor.peek_next(next_union) {
                    s.prefetch(next, Want::Set(next_union))?;
                }
                let view = s.wait(layer)?;
                let bundles: Vec<&[u8]> = (0..*n_ff).map(|i| view.bundle(i)).collect();
                compute.run(&f, xb, n, out, &bundles, Select::Rows(cursor.rows(k)), None)?;
                s.finish(layer, last);
                Ok(())
            }
            (Policy::GateFirst, Source::Stream(s)) => {
                let n_ff = *n_ff;
                gate_values.resize(n * n_ff, 0.0);
                row_bits.resize(n * words, 0);
                compute.gate_decide(
                    &f,
                    xb,
                    n,
                    &gate_rows[layer],
                    level.gate[layer],
                    gate_values,
                    row_bits,
                    union,
                )?;
                s.ensure(layer, Want::Set(union))?;
                let view = s.wait(layer)?;
                let bundles: Vec<&[u8]> = (0..n_ff).map(|i| view.bundle(i)).collect();
                compute.run(
                    &f,
                    xb,
                    n,
                    out,
                    &bundles,
                    Select::RowsWithGate(row_bits, gate_values),
                    None,
                )?;
                s.finish(layer, last);
                Ok(())
            }
            (p, _) => Err(RuntimeError::Invalid(format!("policy {p} has no FFN source"))),
        }
    }
}
