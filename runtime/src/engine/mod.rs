//! The streaming engine over a `.lsflash` file: the resident part (attention,
//! norms, embeddings) runs the dense code of `model::forward`; the FFN of each
//! layer is computed from neuron bundles ([`leanstream_kernels::sparse_ffn`])
//! that a policy supplies.
//!
//! Each policy is a type under [`policy`] (dense, dense-stream, oracle,
//! gate-first): per FFN call it decides what the layer keeps and asks the
//! source for those bundles (and queues the next layer's); the shared tail
//! ([`tail`]) then takes bundles as they become available — resident, cache
//! hits, runs in arrival order from the I/O thread ([`stream`]) — and runs
//! the blocked stage kernels.
//!
//! With a sparsity level, `dense`, `dense-stream` and `oracle` keep the
//! neurons with `|act(g)·u|` at or above the layer's calibrated threshold;
//! `gate-first` keeps those with `|act(g)|` at or above the gate threshold.
//! All policies compute the same arithmetic on the same bytes in the same
//! order ([`tail`]), so policies that keep the same neurons give
//! bit-identical logits, whatever order the bundles arrive in.

mod audit;
pub mod controller;
mod device_call;
pub mod handoff;
mod plan;
pub mod policy;
mod resident;
mod source;
mod stream;
mod tail;
pub mod trace;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use leanstream_kernels::sparse_ffn::{tiles, BundleFormat, DownLayout};

use crate::cache::{CacheShape, FfnBudget, MemoryReport, RetentionTable};
use crate::flash::format::{LsFlash, SparsityLevel};
use crate::flash::io::{Backend, IoConfig};
use crate::model::{FfnBy, LayerAt, LayerHook, Model, RunState};
use crate::predict::Predictor;
use crate::{Result, RuntimeError};
use audit::Audit;
pub use controller::{Controller, Decisions};
pub use device_call::DeviceCall;
pub use plan::keeps;

pub use policy::Policy;
use policy::{FfnPolicy, LayerCall};
use resident::Resident;
use source::Source;
pub use stream::{CachePolicy, LandedRun, Streamer, Want, STAGES};
use tail::Tail;
pub use trace::{ActiveTrace, TraceCursor};

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
    /// Bytes of I/O staging (the read buffers that hold reads in flight and
    /// landed runs not yet computed); `None`: about the four layers a streamer
    /// keeps requested at once, 2 to 16 MiB.
    pub staging_bytes: Option<u64>,
    /// Thresholds (all zero: no sparsity).
    pub level: SparsityLevel,
    /// Record each FFN call's kept sets (`dense` and `dense-stream` only),
    /// for an `oracle` replay.
    pub record: bool,
    /// The recorded run an `oracle` engine replays.
    pub trace: Option<ActiveTrace>,
    /// What drives `speculate`: its predictor and controller.
    pub speculation: Option<Speculation>,
    /// The retention table of [`CachePolicy::Learned`].
    pub retention: Option<Arc<RetentionTable>>,
}

/// The artifacts of a `speculate` engine.
#[derive(Debug, Clone)]
pub struct Speculation {
    pub predictor: Arc<Predictor>,
    /// Where the predictor came from (for errors and reports).
    pub predictor_name: String,
    pub controller: Controller,
    /// The prior systems' predicted set: each input row's top `prior_breadth
    /// × need` neurons, `need` the level's share of the layer
    /// ([`Speculation::PRIOR_BREADTH`] by default). `speculate` takes its
    /// breadth from its controller instead.
    pub prior_breadth: f32,
}

impl Speculation {
    /// The top `need` neurons: a predictor sized to the sparsity level, as
    /// the originals size theirs. An imperfect predictor then misses part
    /// of the active set, so the prior systems compute fewer neurons than
    /// the level keeps; a wider breadth reads more to miss less.
    pub const PRIOR_BREADTH: f32 = 1.0;
}

/// Makes the I/O backend of a streaming engine from its settings.
pub type BackendFactory = Box<dyn FnOnce(&IoConfig) -> std::io::Result<Box<dyn Backend>>>;

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
            .map(|l| flash.layout(l).format(model.config.n_embd))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { flash, model, formats })
    }

    /// Bytes of all FFN bundles.
    pub fn ffn_bytes(&self) -> u64 {
        CacheShape::from_flash(&self.flash).total_ffn_bytes()
    }

    /// The neuron cache's bytes under `budget`: a percentage is a share of
    /// the slots that hold the whole FFN (bundles padded to the slot stride),
    /// so 100% caches every neuron.
    pub fn cache_budget_bytes(&self, budget: FfnBudget) -> u64 {
        budget.resolve(CacheShape::from_flash(&self.flash).total_slot_bytes())
    }

    /// An FFN engine under `policy` without sparsity; `budget` sizes the
    /// neuron cache of the streaming policies (`Dense` holds everything).
    pub fn engine(&self, policy: Policy, budget: FfnBudget) -> Result<FlashEngine> {
        self.engine_with(EngineOptions {
            policy,
            cache_bytes: self.cache_budget_bytes(budget),
            cache_policy: CachePolicy::Lru,
            merge_gap_bytes: DEFAULT_MERGE_GAP,
            staging_bytes: None,
            level: SparsityLevel::dense(self.flash.n_layer()),
            record: false,
            trace: None,
            speculation: None,
            retention: None,
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
    /// staging (`staging_bytes`, or the default), resident gate rows, or all
    /// bundles for `Dense`; the FFN scratch and the policy's for batches of
    /// up to `max_batch` rows. With the resident weights and the run state,
    /// what a `--mem-budget` must cover before the cache gets anything.
    pub fn engine_overhead_bytes(&self, policy: Policy, max_batch: usize, staging_bytes: Option<u64>) -> u64 {
        let n_ff = self.flash.n_ff() as u64;
        let streamed = policy != Policy::Dense;
        let tail = Tail::bytes_for(&self.formats, self.flash.n_ff(), max_batch, streamed);
        let stream = Streamer::overhead_bytes(self, staging_bytes);
        tail + match policy {
            Policy::Dense => self.ffn_bytes(),
            Policy::DenseStream | Policy::Oracle => stream,
            Policy::Speculate | Policy::DejaVu | Policy::LlmInAFlash | Policy::PowerInfer2 => {
                // Per row its group scores, the urgency and rank scratch, and
                // two rows of residual and estimate (the predictor's own
                // weights are counted where it is loaded).
                let scratch = max_batch as u64 * (n_ff * 4 + 2 * self.model.config.n_embd as u64 * 4) + n_ff * 8;
                stream + scratch
            }
            Policy::GateFirst => {
                // Per row its gate values and candidate bitmap, and the union.
                let scratch = (max_batch as u64 + 1) * (n_ff * 4 + n_ff.div_ceil(64) * 8);
                stream + self.gate_rows_bytes() + scratch
            }
        }
    }

    fn gate_rows_bytes(&self) -> u64 {
        (0..self.flash.n_layer())
            .map(|l| (self.flash.layout(l).gate_bytes * self.flash.n_ff()) as u64)
            .sum()
    }

    pub fn engine_with(&self, o: EngineOptions) -> Result<FlashEngine> {
        self.engine_on(o, None)
    }

    /// [`engine_with`](Self::engine_with) reading through the backend that
    /// `backend` makes for the engine's I/O settings (e.g. a
    /// [`FaultyBackend`](crate::flash::io::FaultyBackend)), not the default.
    pub fn engine_on(&self, o: EngineOptions, backend: Option<BackendFactory>) -> Result<FlashEngine> {
        let n_layer = self.flash.n_layer();
        if o.level.full.len() != n_layer || o.level.gate.len() != n_layer {
            return Err(RuntimeError::Invalid(format!(
                "sparsity level {} has thresholds for {} layers, the model has {n_layer}",
                o.level.sparsity,
                o.level.full.len()
            )));
        }
        let (c, words) = (&self.model.config, self.flash.n_ff().div_ceil(64));
        let mut held = None;
        let (policy, recorder): (Box<dyn FfnPolicy>, _) = match (o.policy, o.trace, o.record) {
            (Policy::Oracle, Some(t), false) if t.n_ff() == self.flash.n_ff() => {
                (Box::new(policy::Oracle::new(TraceCursor::new(t), words)), None)
            }
            (Policy::Oracle, _, _) => {
                return Err(RuntimeError::Invalid(
                    "the oracle policy replays a recorded run: pass the trace of a dense or dense-stream run \
                     of this model at the same sparsity"
                        .into(),
                ))
            }
            (p @ (Policy::Dense | Policy::DenseStream), None, record) => {
                let recorder = record.then(|| ActiveTrace::new(self.flash.n_ff()));
                let policy: Box<dyn FfnPolicy> = match p {
                    Policy::Dense => Box::new(policy::Dense),
                    _ => Box::new(policy::DenseStream),
                };
                (policy, recorder)
            }
            (Policy::GateFirst, None, false) => {
                let rows = Arc::new(self.read_gate_rows()?);
                held = Some(Arc::clone(&rows));
                (
                    Box::new(policy::GateFirst::new(rows, self.formats.clone(), c.n_embd)) as Box<dyn FfnPolicy>,
                    None,
                )
            }
            (p, None, false) if p.predicts() => {
                let sp = o.speculation.clone().ok_or_else(|| {
                    RuntimeError::Invalid(format!(
                        "{}: the {p} policy needs a predictor (--predictor FILE, or a .lspred beside the model)",
                        self.flash.path().display()
                    ))
                })?;
                let shape = policy::Shape {
                    n_layer,
                    n_embd: c.n_embd,
                    n_ff: c.n_ff,
                    post_ffn_norm: self.model.has_ffn_post_norm(),
                };
                let ranking = policy::Ranking::new(sp.predictor, sp.predictor_name, shape, o.level.sparsity)?;
                let breadth = sp.prior_breadth;
                let policy: Box<dyn FfnPolicy> = match p {
                    Policy::DejaVu => Box::new(policy::DejaVu::new(ranking, n_layer, breadth)?),
                    Policy::LlmInAFlash | Policy::PowerInfer2 => {
                        Box::new(policy::CurrentLayer::new(p, ranking, breadth)?)
                    }
                    _ => {
                        let bundle_bytes = (0..n_layer).map(|l| self.flash.layout(l).bundle_bytes()).collect();
                        Box::new(policy::Speculate::new(ranking, sp.controller, shape, bundle_bytes)?)
                    }
                };
                (policy, None)
            }
            (p, _, _) => {
                return Err(RuntimeError::Invalid(format!(
                    "policy {p} neither records nor replays an active-set trace"
                )))
            }
        };
        let (source, formats) = match o.policy {
            Policy::Dense => {
                let resident = self.read_all()?;
                let formats = resident.formats.clone();
                (Source::Resident(resident), formats)
            }
            _ => {
                let mut s = Streamer::new(
                    self,
                    o.cache_bytes,
                    o.cache_policy,
                    o.retention.clone(),
                    o.merge_gap_bytes,
                    o.staging_bytes,
                    backend,
                )?;
                if let Some(h) = held {
                    s.hold_prefix(h)?;
                }
                if o.policy == Policy::Speculate {
                    s.use_spans();
                }
                (Source::Stream(Box::new(s)), self.formats.clone())
            }
        };
        Ok(FlashEngine {
            plan: policy,
            level: o.level,
            formats,
            tail: Tail::new(c.ffn_activation, c.n_embd, c.n_ff),
            source,
            recorder,
            n_layer,
            tokens: 0,
            pending: None,
            retention_bytes: o.retention.as_ref().map_or(0, |t| t.bytes()),
            audit: None,
        })
    }

    /// Audits `engine`: from now on each FFN call is checked against the
    /// layer computed whole (the `audit` module), and its stats count the true
    /// active mass and what the policy skipped of it. Holds a second copy
    /// of the whole FFN and computes every layer twice: for measurement
    /// runs, not timed ones.
    pub fn audit(&self, engine: &mut FlashEngine) -> Result<()> {
        let resident = self.read_all()?;
        let formats = resident.formats.clone();
        let c = &self.model.config;
        engine.audit = Some(Box::new(Audit::new(
            Source::Resident(resident),
            formats,
            Tail::new(c.ffn_activation, c.n_embd, c.n_ff),
        )));
        Ok(())
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

    /// Every layer's bundles in neuron order, and the down matrices of
    /// tiled layers gathered once (their bundles then keep gate and up rows
    /// only), so `dense` runs the source's product straight from memory and
    /// moves the GGUF engine's bytes (with the formats the tail then
    /// computes with).
    pub(crate) fn read_all(&self) -> Result<Resident> {
        let n_ff = self.flash.n_ff();
        let mut bundles = (0..self.flash.n_layer())
            .map(|l| self.flash.layer_by_neuron(l))
            .collect::<Result<Vec<_>>>()?;
        let mut down = Vec::with_capacity(bundles.len());
        let mut down_len = Vec::with_capacity(bundles.len());
        for (f, all) in self.formats.iter().zip(bundles.iter_mut()) {
            if f.down_layout != DownLayout::Tiles {
                down.push(Vec::new());
                down_len.push(0);
                continue;
            }
            let len = f.n_embd * f.down_ty.row_bytes(n_ff)?;
            let mut m = vec![0u64; len.div_ceil(8)];
            let groups: Vec<u32> = (0..(n_ff / f.group()) as u32).collect();
            let bb = f.bundle_bytes();
            let bundle = |i: usize| &all[i * bb..(i + 1) * bb];
            tiles::gather(
                f,
                n_ff,
                &groups,
                &bundle,
                &mut bytemuck::cast_slice_mut(&mut m)[..len],
                true,
            )?;
            // The gate rows, then the up rows: the source's two matrices.
            let (gb, ub) = (f.gate_bytes(), f.up_bytes());
            let mut split = Vec::with_capacity(n_ff * (gb + ub));
            all.chunks_exact(bb).for_each(|b| split.extend_from_slice(&b[..gb]));
            all.chunks_exact(bb)
                .for_each(|b| split.extend_from_slice(&b[gb..gb + ub]));
            *all = split;
            down.push(m);
            down_len.push(len);
        }
        Ok(Resident {
            bundles,
            down,
            down_len,
            formats: self.formats.iter().map(BundleFormat::resident).collect(),
        })
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
        self.model.forward_with(st, tokens, pos0, outputs, engine)
    }

    /// Memory by category for `st` and `engine`. The predictor category
    /// holds what a policy knows beyond the cache: gate-first's resident gate
    /// rows, the oracle's trace, a predictor, the learned cache's retention table.
    pub fn memory(&self, st: &RunState, engine: &FlashEngine) -> MemoryReport {
        let (ffn_cache, io_buffers) = match &engine.source {
            Source::Resident(r) => (r.bytes(), 0),
            Source::Stream(s) => (s.cache_bytes(), s.buffer_bytes()),
        };
        let recorded = engine.recorder.as_ref().map_or(0, |t| t.bytes());
        MemoryReport {
            resident_weights: self.flash.resident_range().1,
            kv_cache: st.kv_bytes() as u64,
            ffn_cache,
            io_buffers,
            predictor: engine.plan.held_bytes() + recorded + engine.retention_bytes,
            tokenizer: self.model.tokenizer.heap_bytes(),
            other: (st.bytes() - st.kv_bytes()) as u64 + engine.plan.scratch_bytes() + engine.tail.bytes(),
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
    /// Neuron rows computed (gate and up products), over all rows: what
    /// the controller's compute time per neuron is measured against.
    pub rows_computed: u64,
    /// Wall time inside FFN calls, and of that the time compute was blocked
    /// waiting for bundles to land.
    pub ffn_seconds: f64,
    pub io_wait_seconds: f64,
    /// Time the I/O thread had at least one read in flight.
    pub io_busy_seconds: f64,
    /// Reads in flight on average over that time.
    pub io_mean_depth: f64,
    /// Bundles requested for a layer that had not landed by its deadline
    /// (skipped, not waited for).
    pub late_skipped: u64,
    /// An audited engine ([`FlashModel::audit`]): the |act(g)·u| mass of
    /// the neurons `dense` would keep at the policy's own state, and of
    /// that what the policy did not keep (0 without an audit).
    pub active_mass: f64,
    pub missed_mass: f64,
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

    /// Of the true active mass, the share the policy skipped (mispredicted
    /// or late); `None` without an audit.
    pub fn skipped_mass(&self) -> Option<f64> {
        (self.active_mass > 0.0).then(|| self.missed_mass / self.active_mass)
    }

    /// Time the I/O thread was busy while compute was not waiting on it:
    /// reads hidden behind compute.
    pub fn overlap_seconds(&self) -> f64 {
        (self.io_busy_seconds - self.io_wait_seconds).max(0.0)
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

/// The FFN of a [`FlashModel`] under one policy; pass it to
/// [`FlashModel::forward`] (it is the model's [`LayerHook`]).
pub struct FlashEngine {
    plan: Box<dyn FfnPolicy>,
    level: SparsityLevel,
    formats: Vec<BundleFormat>,
    tail: Tail,
    source: Source,
    /// Each call's kept sets, for an oracle replay (`record`).
    recorder: Option<ActiveTrace>,
    n_layer: usize,
    tokens: u64,
    /// An error of a hook that cannot return one (`layer_input`), returned
    /// by the layer's FFN call.
    pending: Option<RuntimeError>,
    /// Bytes of the learned cache policy's retention table (0 without one).
    retention_bytes: u64,
    /// The reference computation of an audited engine.
    audit: Option<Box<Audit>>,
}

impl FlashEngine {
    pub fn policy(&self) -> Policy {
        self.plan.kind()
    }

    pub fn stats(&self) -> EngineStats {
        let mut s = match &self.source {
            Source::Resident(_) => EngineStats::default(),
            Source::Stream(st) => st.stats(),
        };
        s.tokens = self.tokens;
        s.kept = self.tail.kept;
        s.considered = self.tail.considered;
        s.rows_computed = self.tail.stage1_rows;
        s.ffn_seconds = self.tail.seconds;
        if let Some(a) = &self.audit {
            (s.active_mass, s.missed_mass) = (a.active_mass, a.missed_mass);
        }
        s
    }

    /// Bytes of the neuron cache's budget (all FFN bytes for `Dense`).
    pub fn ffn_budget_bytes(&self) -> u64 {
        match &self.source {
            Source::Resident(r) => r.bytes(),
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

    /// Read latencies per queue depth (`None` for `Dense`): what the
    /// controller's model is fitted to.
    pub fn read_latencies(&self) -> Option<Vec<crate::flash::io::DepthLatency>> {
        match &self.source {
            Source::Resident(_) => None,
            Source::Stream(s) => Some(s.read_latencies()),
        }
    }

    /// Whether every layer's FFN is held whole in memory, in the source's
    /// matrices (`Dense`, or a streaming policy whose cache has room for
    /// every neuron): nothing is read after open.
    pub fn whole_layers(&self) -> bool {
        match &self.source {
            Source::Resident(_) => true,
            Source::Stream(s) => s.whole().is_some(),
        }
    }

    /// Of the static hot set, the share outside its layers' leading
    /// bundles (`None` without one; see [`Streamer::hot_set_scattered`]).
    pub fn hot_set_scattered(&self) -> Option<f64> {
        match &self.source {
            Source::Resident(_) => None,
            Source::Stream(s) => s.hot_set_scattered(),
        }
    }

    /// The neuron cache's eviction policy (`None` for `Dense`).
    pub fn cache_policy_name(&self) -> Option<&'static str> {
        match &self.source {
            Source::Resident(_) => None,
            Source::Stream(s) => Some(s.cache_policy_name()),
        }
    }

    /// Sets the reads and bytes the I/O thread keeps in flight (0 bytes: no
    /// byte limit); nothing for `Dense`.
    pub fn set_io_depth(&self, reads: usize, bytes: u64) {
        if let Source::Stream(s) = &self.source {
            s.set_depth(reads, bytes);
        }
    }

    /// The trace recorded so far (an engine made with `record`), leaving it empty.
    pub fn take_trace(&mut self) -> Option<ActiveTrace> {
        let t = self.recorder.as_mut()?;
        let n_ff = t.n_ff();
        Some(std::mem::replace(t, ActiveTrace::new(n_ff)))
    }

    /// FFN calls replayed so far (oracle).
    pub fn replayed_calls(&self) -> Option<usize> {
        self.plan.replayed_calls()
    }

    /// What the policy decided so far (`speculate`: the controller, the
    /// actions taken and the refinements).
    pub fn decisions(&self) -> Option<Decisions> {
        self.plan.decisions()
    }

    /// The predictor the policy reads, if any.
    pub fn predictor_name(&self) -> Option<&str> {
        self.plan.predictor_name()
    }
}

impl LayerHook for FlashEngine {
    fn rows_alone(&mut self, on: bool) {
        self.tail.set_rows_alone(on);
    }

    fn layer_input(&mut self, at: &LayerAt, x: &[f32]) {
        if self.pending.is_none() {
            if let Err(e) = self.plan.layer_input(at.layer, x, at.n(), &mut self.source) {
                self.pending = Some(e);
            }
        }
    }

    fn ffn(&mut self, at: &LayerAt, resid: &[f32], xb: &[f32], out: &mut [f32]) -> Result<FfnBy> {
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        let (layer, n) = (at.layer, at.n());
        let f = self.formats[layer];
        let call = self.layer_call(layer, n, resid, xb);
        let plan = self.plan.plan(&call, &mut self.source, &self.tail)?;
        let record = self.recorder.as_mut().map(|t| t.begin_call(layer, n));
        self.tail.run(&f, layer, xb, n, out, &mut self.source, plan, record)?;
        if let Some(a) = &mut self.audit {
            a.check(layer, xb, n, self.level.full[layer], self.tail.kept_acts(n))?;
        }
        self.finish_call(layer);
        Ok(FfnBy::Hook)
    }
}

impl FlashEngine {
    /// Layer `layer`'s FFN call of `n` rows as the policy sees it (a token
    /// counted at layer 0).
    fn layer_call<'a>(&mut self, layer: usize, n: usize, resid: &'a [f32], xb: &'a [f32]) -> LayerCall<'a> {
        if layer == 0 {
            self.tokens += n as u64;
        }
        LayerCall {
            layer,
            n_layer: self.n_layer,
            xb,
            resid,
            n,
            threshold: self.level.full[layer],
            gate_threshold: self.level.gate[layer],
        }
    }

    /// After layer `layer`'s call: the policy's bookkeeping, then the streamer goes on.
    fn finish_call(&mut self, layer: usize) {
        self.plan.finished(layer, &self.tail);
        if let Source::Stream(s) = &mut self.source {
            s.finish(layer, layer + 1 == self.n_layer);
        }
    }
}
