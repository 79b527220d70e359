//! The compute sweep: latency of the runtime's own kernels at the sizes the
//! streaming engine uses, per thread count, quiet and under concurrent I/O.
//!
//! - `ffn_stage`: one sparse FFN stage over `neurons` random neurons of a
//!   layer whose bundles are resident: stage 1 ([`neuron_activation`] in
//!   parallel chunks, as the engine does) and stage 2 ([`accumulate_down`]).
//! - `ffn_split`: `neurons` neurons split into `stages` equal stages, each a
//!   full stage; against `stages = 1` this is the cost of splitting a layer.
//! - `decode`: one decode step of the runtime's forward pass
//!   ([`FlashModel::forward`], FFN resident) with `ctx_len` tokens in the KV
//!   cache. Attention is the part that grows with `ctx_len`; the runtime keeps
//!   its attention kernel private, so the profiler measures it in place.
//!
//! Each visit runs one untimed call first (caches, thread wake-up); with
//! `background_io` an O_DIRECT reader (128 KiB random reads, QD 8) runs on
//! another thread for the whole visit.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use leanstream_kernels::sparse_ffn::{
    accumulate_down, neuron_activation, BundleFormat, FfnActivation, FfnInput, LayerActivations,
};
use leanstream_kernels::ActBuffer;
use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{FlashEngine, FlashModel, Policy};
use leanstream_runtime::model::RunState;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::io_sweep::{background_reads, open_direct};
use crate::plan::{ComputeCondition, Condition, ConditionKind, Kernel};
use crate::runner::{Executor, Measured, Sample};
use crate::{ProfileError, Result};

/// Settings of a compute run (stored in the plan).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComputeSetup {
    /// The packed model (`.lsflash`).
    pub model: PathBuf,
    /// The layer whose bundles the FFN kernels use.
    pub layer: usize,
    /// The file the background reader reads (default: the model file).
    pub io_file: PathBuf,
    /// CUDA device ordinal whose kernels are measured (`compute_gpu.rs`);
    /// `None`: the CPU's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<usize>,
}

/// Neurons per parallel task of stage 1.
const CHUNK: usize = 32;

/// Runs compute conditions.
pub struct ComputeExecutor {
    fm: FlashModel,
    /// The layer's bundles by neuron id.
    bundles: Vec<u8>,
    bundle_bytes: usize,
    format: BundleFormat,
    act: FfnActivation,
    gate_acts: ActBuffer,
    up_acts: ActBuffer,
    layer_acts: LayerActivations,
    a: Vec<f32>,
    y: Vec<f32>,
    pools: HashMap<u32, rayon::ThreadPool>,
    decode: HashMap<u32, (RunState, FlashEngine)>,
    bg: (File, u64),
    rng: StdRng,
}

/// What both executors (this one and `compute_gpu.rs`) start from.
pub(crate) struct Opened {
    pub fm: FlashModel,
    /// The FFN input every stage computes on (random, from the seed).
    pub x: Vec<f32>,
    pub rng: StdRng,
    /// The background reader's file (O_DIRECT) and its size.
    pub bg: (File, u64),
}

impl ComputeSetup {
    /// Opens the packed model (checking the layer), draws the input and
    /// opens the background reader's file.
    pub(crate) fn open(&self, seed: u64) -> Result<Opened> {
        let fm = FlashModel::open(&self.model)?;
        if self.layer >= fm.flash.n_layer() {
            return Err(ProfileError::Invalid(format!(
                "layer {} of a model with {} layers",
                self.layer,
                fm.flash.n_layer()
            )));
        }
        let mut rng = StdRng::seed_from_u64(seed ^ 0xc0);
        let x: Vec<f32> = (0..fm.model.config.n_embd)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let file = open_direct(&self.io_file)?;
        let size = file.metadata().map_err(|e| ProfileError::io(&self.io_file, e))?.len();
        Ok(Opened {
            fm,
            x,
            rng,
            bg: (file, size),
        })
    }
}

impl ComputeExecutor {
    pub fn new(setup: &ComputeSetup, seed: u64) -> Result<Self> {
        let Opened { fm, x, rng, bg } = setup.open(seed)?;
        let l = setup.layer;
        let bb = fm.flash.layout(l).bundle_bytes();
        let bundles = fm.flash.layer_by_neuron(l)?;
        let c = &fm.model.config;
        let format = fm.formats[l];
        let act: FfnActivation = c.ffn_activation;
        let mut gate_acts = ActBuffer::with_capacity(c.n_embd, 1);
        let mut up_acts = ActBuffer::with_capacity(c.n_embd, 1);
        gate_acts.quantize(format.gate_ty.vec_dot_type(), &x, 1, c.n_embd)?;
        up_acts.quantize(format.up_ty.vec_dot_type(), &x, 1, c.n_embd)?;
        Ok(Self {
            bundle_bytes: bb,
            format,
            act,
            gate_acts,
            up_acts,
            layer_acts: LayerActivations::new(c.n_ff),
            a: vec![0.0; c.n_ff],
            y: vec![0.0; c.n_embd],
            pools: HashMap::new(),
            decode: HashMap::new(),
            bg,
            bundles,
            fm,
            rng,
        })
    }

    pub fn n_ff(&self) -> usize {
        self.fm.model.config.n_ff
    }

    /// One FFN stage over `ids`, adding its partial output to `self.y`.
    fn stage(&mut self, ids: &[usize]) -> Result<()> {
        let (f, act, bb) = (&self.format, self.act, self.bundle_bytes);
        let bundles = &self.bundles;
        let input = FfnInput::new(f, &self.gate_acts, &self.up_acts, 0)?;
        let a = &mut self.a[..ids.len()];
        a.par_chunks_mut(CHUNK)
            .zip(ids.par_chunks(CHUNK))
            .try_for_each(|(a, ids)| {
                a.iter_mut().zip(ids).try_for_each(|(ai, &i)| {
                    neuron_activation(f, &input, act, &bundles[i * bb..(i + 1) * bb]).map(|v| *ai = v)
                })
            })?;
        self.layer_acts.clear();
        for (&i, &ai) in ids.iter().zip(a.iter()) {
            self.layer_acts.set(i, ai)?;
        }
        accumulate_down(f, &self.layer_acts, |i| &bundles[i * bb..(i + 1) * bb], &mut self.y)?;
        Ok(())
    }

    /// One timed call of `c`; returns bytes of weights it touched.
    fn call(&mut self, c: &ComputeCondition, ids: &[usize]) -> Result<u64> {
        match c.kernel {
            Kernel::FfnStage | Kernel::FfnSplit => {
                self.y.fill(0.0);
                for chunk in stage_chunks(c, ids) {
                    self.stage(chunk)?;
                }
                std::hint::black_box(&self.y);
                Ok((ids.len() * self.bundle_bytes) as u64)
            }
            Kernel::Decode => {
                let (st, engine) = self.decode.get_mut(&c.ctx_len).expect("decode state prepared");
                let tok = [1u32 + (c.ctx_len % 64)];
                self.fm.forward(st, engine, &tok, c.ctx_len as usize, 0..1)?;
                Ok(0)
            }
        }
    }

    fn prepare_decode(&mut self, ctx: u32) -> Result<()> {
        if self.decode.contains_key(&ctx) {
            return Ok(());
        }
        let mut st = self.fm.model.new_state(ctx as usize + 1, 64, 1);
        let mut engine = self.fm.engine(Policy::Dense, FfnBudget::Percent(100.0))?;
        let vocab = self.fm.model.config.n_vocab.max(2) as u32;
        let tokens: Vec<u32> = (0..ctx).map(|_| self.rng.random_range(1..vocab)).collect();
        for (b, chunk) in tokens.chunks(64).enumerate() {
            self.fm
                .forward(&mut st, &mut engine, chunk, b * 64, chunk.len() - 1..chunk.len())?;
        }
        self.decode.insert(ctx, (st, engine));
        Ok(())
    }

    fn run(&mut self, c: &ComputeCondition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        let threads = c.threads.max(1);
        let pool = match self.pools.remove(&threads) {
            Some(p) => p,
            None => rayon::ThreadPoolBuilder::new()
                .num_threads(threads as usize)
                .build()
                .map_err(|e| ProfileError::Invalid(format!("thread pool of {threads}: {e}")))?,
        };
        let out = pool.install(|| self.run_in_pool(c, n, deadline, stop));
        self.pools.insert(threads, pool);
        out
    }

    fn run_in_pool(
        &mut self,
        c: &ComputeCondition,
        n: usize,
        deadline: Instant,
        stop: &AtomicBool,
    ) -> Result<Measured> {
        if c.kernel == Kernel::Decode {
            self.prepare_decode(c.ctx_len)?;
        }
        let n_ff = self.n_ff();
        let visit = Visit::new(c, n_ff, &self.bg, n, deadline)?;
        let mut rng = std::mem::replace(&mut self.rng, StdRng::seed_from_u64(0));
        let out = timed_visit(&mut rng, visit, stop, |ids| self.call(c, ids));
        self.rng = rng;
        out
    }
}

/// One visit's plan: `n` timed calls over `neurons` random neurons of
/// `n_ff`, before `deadline`, with O_DIRECT reads of `background` (a file
/// and its size) running meanwhile when given.
pub(crate) struct Visit {
    pub n_ff: usize,
    pub neurons: usize,
    pub background: Option<(File, u64)>,
    pub n: usize,
    pub deadline: Instant,
}

impl Visit {
    /// The visit of condition `c` over a layer of `n_ff` neurons, the
    /// background file `background` (a file and its size) read when `c` asks.
    pub(crate) fn new(
        c: &ComputeCondition,
        n_ff: usize,
        background: &(File, u64),
        n: usize,
        deadline: Instant,
    ) -> Result<Self> {
        let background = if c.background_io {
            Some((background.0.try_clone().map_err(ProfileError::Sys)?, background.1))
        } else {
            None
        };
        Ok(Self {
            n_ff,
            neurons: c.neurons as usize,
            background,
            n,
            deadline,
        })
    }
}

/// `ids` cut into the stages of an `ffn_stage` (one) or `ffn_split` (K) condition.
pub(crate) fn stage_chunks<'a>(c: &ComputeCondition, ids: &'a [usize]) -> std::slice::Chunks<'a, usize> {
    let k = if c.kernel == Kernel::FfnStage {
        1
    } else {
        c.stages.max(1) as usize
    };
    ids.chunks(ids.len().div_ceil(k).max(1))
}

/// Runs `visit`: one untimed warm-up call, then timed calls of `call` (which
/// returns the bytes of weights it touched) on fresh random neuron sets
/// until `n` are done, the deadline passes or `stop` is set. Shared by the
/// CPU and the GPU executors.
pub(crate) fn timed_visit(
    rng: &mut StdRng,
    visit: Visit,
    stop: &AtomicBool,
    mut call: impl FnMut(&[usize]) -> Result<u64>,
) -> Result<Measured> {
    let want = visit.neurons.min(visit.n_ff);
    let mut all: Vec<usize> = (0..visit.n_ff).collect();
    let bg_stop = AtomicBool::new(false);
    let mut samples = Vec::with_capacity(visit.n);
    let mut wall = 0u64;
    std::thread::scope(|s| -> Result<()> {
        let reader = visit.background.map(|(f, size)| {
            let bg_stop = &bg_stop;
            s.spawn(move || background_reads(&f, size, 128 << 10, 8, bg_stop))
        });
        let body = (|| -> Result<()> {
            all.shuffle(rng);
            call(&all[..want])?; // untimed warm-up
            let t_visit = Instant::now();
            for _ in 0..visit.n {
                if stop.load(Ordering::Relaxed) || Instant::now() >= visit.deadline {
                    break;
                }
                all.shuffle(rng);
                let t0 = Instant::now();
                let bytes = call(&all[..want])?;
                samples.push(Sample::now(bytes, t0.elapsed().as_nanos() as u64));
            }
            wall = t_visit.elapsed().as_nanos() as u64;
            Ok(())
        })();
        bg_stop.store(true, Ordering::Relaxed);
        if let Some(h) = reader {
            h.join().expect("background reader panicked")?;
        }
        body
    })?;
    Ok(Measured {
        samples,
        wall_ns: wall,
        device_read_bytes: None,
    })
}

impl Executor for ComputeExecutor {
    fn visit(&mut self, cond: &Condition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        match &cond.kind {
            ConditionKind::Compute(c) => self.run(c, n, deadline, stop),
            ConditionKind::Io(_) => Err(ProfileError::Invalid("I/O condition in a compute run".into())),
        }
    }
}
