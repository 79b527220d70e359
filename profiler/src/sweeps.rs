//! The two device sweeps as plans: the grid of conditions each sweeps, and
//! starting or continuing a run of one in its directory. The
//! `leanstream-profile` binary and `leanstream-synth tune` both go through
//! here, so a tuned device is profiled exactly as a hand-run profile is.

use std::path::{Path, PathBuf};

use crate::compute_gpu::GpuComputeExecutor;
use crate::compute_sweep::{ComputeExecutor, ComputeSetup};
use crate::io_sweep::{prepare_file, replay_block_size, IoExecutor, IoSetup};
use crate::plan::{ComputeCondition, Condition, ConditionKind, Engine, IoCondition, Kernel, Pattern, Plan, Repetition};
use crate::runner::{self, Executor, Outcome};
use crate::shard::ShardStore;
use crate::{ProfileError, Result};

/// How a run samples, whatever it sweeps.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSettings {
    pub budget_s: f64,
    pub repetition: Repetition,
    /// Seed of the round order and of the offsets.
    pub seed: u64,
    /// Commit buffered samples as a shard at this interval, seconds.
    pub flush_every_s: f64,
    /// Target length of one visit of a condition, seconds.
    pub visit_s: f64,
    /// Samples of a condition's first visit (and the least per visit).
    pub min_batch: u64,
    pub max_batch: u64,
}

impl Default for RunSettings {
    fn default() -> Self {
        Self {
            budget_s: 600.0,
            repetition: Repetition::Adaptive {
                precision: 0.05,
                min_samples: 200,
                max_samples: 200_000,
            },
            seed: 1,
            flush_every_s: 30.0,
            visit_s: 0.25,
            min_batch: 32,
            max_batch: 8192,
        }
    }
}

/// The I/O sweep's grid: every engine × pattern × request size × queue depth × workers.
#[derive(Debug, Clone, PartialEq)]
pub struct IoGrid {
    /// Directory on the device under test (the data file is made there).
    pub dir: PathBuf,
    pub file_size: u64,
    pub block_sizes: Vec<u64>,
    pub queue_depths: Vec<u32>,
    pub workers: Vec<u32>,
    pub patterns: Vec<Pattern>,
    pub engines: Vec<Engine>,
    /// A packed model whose bundle read sets `Pattern::Replay` reads (adds the pattern).
    pub lsflash: Option<PathBuf>,
    /// Share of a layer's neurons in one replayed read set.
    pub replay_fraction: f64,
}

/// The compute sweep's grid over one packed model's kernels.
#[derive(Debug, Clone, PartialEq)]
pub struct ComputeGrid {
    pub model: PathBuf,
    /// Neuron counts of a sparse FFN stage (default: 32 … n_ff).
    pub neurons: Option<Vec<u32>>,
    pub stages: Vec<u32>,
    /// Neurons of the split layer (default: half the layer).
    pub split_neurons: Option<u32>,
    pub ctx: Vec<u32>,
    /// Thread counts (default: 1 and all cores).
    pub threads: Option<Vec<u32>>,
    /// Background I/O off and/or on.
    pub background_io: Vec<bool>,
    /// File for the background reads (default: the model file).
    pub io_file: Option<PathBuf>,
    pub layer: usize,
    /// CUDA device ordinal (`None`: the CPU's kernels).
    pub device: Option<usize>,
}

fn invalid(msg: impl Into<String>) -> ProfileError {
    ProfileError::Invalid(msg.into())
}

/// Plans store absolute paths so that a resumed run works from any directory.
fn absolute(p: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(p).map_err(|e| ProfileError::io(p, e))
}

fn plan_of(s: &RunSettings, sweep: &str, kinds: Vec<ConditionKind>, setup: serde_json::Value) -> Result<Plan> {
    if let Repetition::Adaptive { precision, .. } = s.repetition {
        if !(precision > 0.0 && precision < 1.0) {
            return Err(invalid("the adaptive precision must be in (0, 1)"));
        }
    }
    if kinds.is_empty() {
        return Err(invalid("the grid is empty"));
    }
    let repetition = match s.repetition {
        Repetition::Adaptive {
            precision,
            min_samples,
            max_samples,
        } => Repetition::Adaptive {
            precision,
            min_samples,
            max_samples: max_samples.max(min_samples),
        },
        r => r,
    };
    Ok(Plan {
        sweep: sweep.into(),
        seed: s.seed,
        budget_s: s.budget_s,
        repetition,
        max_batch: s.max_batch.max(1),
        min_batch: s.min_batch.clamp(1, s.max_batch.max(1)),
        visit_target_s: s.visit_s,
        flush_interval_s: s.flush_every_s,
        conditions: kinds
            .into_iter()
            .enumerate()
            .map(|(i, kind)| Condition { id: i as u32, kind })
            .collect(),
        setup,
    })
}

/// The I/O plan of `grid`; makes (or reuses) the data file it reads.
pub fn io_plan(grid: &IoGrid, settings: &RunSettings) -> Result<Plan> {
    for &bs in &grid.block_sizes {
        if bs == 0 || !bs.is_multiple_of(4096) || bs > grid.file_size {
            return Err(invalid(format!(
                "block size {bs}: must be a multiple of 4096 and at most the file size"
            )));
        }
    }
    if grid.queue_depths.contains(&0) || grid.workers.contains(&0) {
        return Err(invalid("queue depths and worker counts start at 1"));
    }
    let mut patterns = grid.patterns.clone();
    if grid.lsflash.is_some() && !patterns.contains(&Pattern::Replay) {
        patterns.push(Pattern::Replay);
    }
    let replay_bs = match &grid.lsflash {
        Some(p) => Some(replay_block_size(&leanstream_runtime::flash::format::LsFlash::open(p)?)),
        None if patterns.contains(&Pattern::Replay) => return Err(invalid("the replay pattern needs a .lsflash file")),
        None => None,
    };
    let mut kinds = Vec::new();
    for &engine in &grid.engines {
        for &pattern in &patterns {
            let sizes = match (pattern, replay_bs) {
                (Pattern::Replay, Some(bs)) => vec![bs],
                _ => grid.block_sizes.clone(),
            };
            for &block_size in &sizes {
                for &queue_depth in &grid.queue_depths {
                    for &workers in &grid.workers {
                        kinds.push(ConditionKind::Io(IoCondition {
                            engine,
                            pattern,
                            block_size,
                            queue_depth,
                            workers,
                        }));
                    }
                }
            }
        }
    }
    let file = absolute(&prepare_file(&grid.dir, grid.file_size)?)?;
    let setup = IoSetup {
        file_size: std::fs::metadata(&file).map_err(|e| ProfileError::io(&file, e))?.len(),
        file,
        lsflash: grid.lsflash.as_deref().map(absolute).transpose()?,
        replay_fraction: grid.replay_fraction,
    };
    let setup = serde_json::to_value(&setup).map_err(|e| invalid(e.to_string()))?;
    plan_of(settings, "io", kinds, setup)
}

/// The compute plan of `grid`.
pub fn compute_plan(grid: &ComputeGrid, settings: &RunSettings) -> Result<Plan> {
    let flash = leanstream_runtime::flash::format::LsFlash::open(&grid.model)?;
    let n_ff = flash.n_ff() as u32;
    let mut neurons = grid
        .neurons
        .clone()
        .unwrap_or_else(|| vec![32, 64, 128, 256, 512, 1024, 2048, 4096, n_ff]);
    neurons.retain(|&n| n > 0 && n <= n_ff);
    neurons.sort_unstable();
    neurons.dedup();
    let split_n = grid.split_neurons.unwrap_or(n_ff / 2).clamp(1, n_ff);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    // A device runs its own threads: one host thread count.
    let default_threads = if grid.device.is_some() { vec![1] } else { vec![1, cores] };
    let mut threads = grid.threads.clone().unwrap_or(default_threads);
    threads.dedup();
    let mut kinds = Vec::new();
    for &t in &threads {
        for &bg in &grid.background_io {
            let c = |kernel, neurons, stages, ctx_len| {
                ConditionKind::Compute(ComputeCondition {
                    kernel,
                    neurons,
                    stages,
                    ctx_len,
                    threads: t,
                    background_io: bg,
                })
            };
            kinds.extend(neurons.iter().map(|&n| c(Kernel::FfnStage, n, 1, 0)));
            kinds.extend(grid.stages.iter().map(|&k| c(Kernel::FfnSplit, split_n, k.max(1), 0)));
            kinds.extend(grid.ctx.iter().map(|&l| c(Kernel::Decode, 0, 0, l)));
        }
    }
    let setup = ComputeSetup {
        model: absolute(&grid.model)?,
        layer: grid.layer,
        io_file: absolute(grid.io_file.as_ref().unwrap_or(&grid.model))?,
        device: grid.device,
    };
    let setup = serde_json::to_value(&setup).map_err(|e| invalid(e.to_string()))?;
    plan_of(settings, "compute", kinds, setup)
}

fn executor(plan: &Plan) -> Result<(Box<dyn Executor>, PathBuf)> {
    let bad = |e: serde_json::Error| invalid(format!("plan.json setup: {e}"));
    match plan.sweep.as_str() {
        "io" => {
            let setup: IoSetup = serde_json::from_value(plan.setup.clone()).map_err(bad)?;
            let target = setup.file.clone();
            Ok((Box::new(IoExecutor::new(setup, plan.seed)?), target))
        }
        "compute" => {
            let setup: ComputeSetup = serde_json::from_value(plan.setup.clone()).map_err(bad)?;
            let target = setup.io_file.clone();
            match setup.device {
                Some(ordinal) => Ok((Box::new(GpuComputeExecutor::new(&setup, plan.seed, ordinal)?), target)),
                None => Ok((Box::new(ComputeExecutor::new(&setup, plan.seed)?), target)),
            }
        }
        s => Err(invalid(format!("unknown sweep {s:?} in plan.json"))),
    }
}

fn run_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{t}-{}", std::process::id())
}

/// Starts `plan` in the new run directory `out`.
pub fn start(plan: &Plan, out: &Path, progress: bool) -> Result<Outcome> {
    let mut store = ShardStore::create(out, &run_id())?;
    let (mut exec, target) = executor(plan)?;
    runner::write_run_files(out, plan, &target, 1)?;
    runner::run(plan, &mut store, exec.as_mut(), progress)
}

/// What [`resume`] found in the run directory before continuing it.
#[derive(Debug, Clone)]
pub struct Resumed {
    pub session: u32,
    pub committed_samples: usize,
    pub shards: usize,
    pub spent_s: f64,
    pub budget_s: f64,
    /// Shards that failed their checks and were moved to `quarantine/`.
    pub quarantined: Vec<String>,
}

/// Continues the run in `dir` under the plan stored there. `report` is
/// told what was found before sampling goes on.
pub fn resume(dir: &Path, progress: bool, report: impl FnOnce(&Resumed)) -> Result<Outcome> {
    let plan = runner::read_plan(dir)?;
    let mut store = ShardStore::open(dir)?;
    let (committed, problems) = store.recover()?;
    report(&Resumed {
        session: store.manifest.sessions,
        committed_samples: committed.height(),
        shards: store.manifest.shards.len(),
        spent_s: store.manifest.spent_s,
        budget_s: plan.budget_s,
        quarantined: problems.iter().map(|p| p.to_string()).collect(),
    });
    let (mut exec, target) = executor(&plan)?;
    runner::write_run_files(dir, &plan, &target, store.manifest.sessions)?;
    runner::run(&plan, &mut store, exec.as_mut(), progress)
}

/// Whether `dir` holds a run that [`resume`] can continue.
pub fn is_run(dir: &Path) -> bool {
    dir.join("plan.json").is_file() && dir.join("manifest.json").is_file()
}
