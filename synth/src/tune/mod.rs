//! `leanstream-synth tune`: the whole toolchain for one model on this
//! device, as one resumable run that honours a time budget.
//!
//! ```text
//! text ─▶ activations ─▶ placement ─▶ pack ─▶ profile-io ─▶ profile-compute ─▶ controller
//!                    └─▶ predictor, eviction                     verify ─▶ report
//! ```
//!
//! With `--profiling adaptive`, one `profile-adaptive` step (a 45th of the
//! two profiles' shares, `crate::adaptive`) takes the two profiles' place.
//!
//! The output directory is what a device ships: `model.lsflash`,
//! `controller.lstab`, `predictor.lspred` (and `predictor.lowrank.lspred`
//! for the prior systems' policies), `eviction.lsevict`, `report.md` with
//! its plots, and `tune.json` (see [`manifest`]); intermediate data goes
//! under `work/`. `leanstream run --model DIR/model.lsflash` finds the
//! artifacts beside the model by their names.
//!
//! Each step gets a fixed share of the budget ([`Step::share`]); what a step
//! does with it (tokens traced, tokens trained on, seconds profiled) is
//! derived from the budget and the model's shape alone, never from how long
//! earlier steps took, so that a resumed run computes the same inputs and
//! skips what is done.

mod layout;
pub mod manifest;
mod progress;
mod report;
mod steps;
mod verify;

use std::path::{Path, PathBuf};
use std::time::Instant;

pub use layout::Step;

use crate::error::{Result, SynthError};
use manifest::{key_of, outputs_intact, Manifest, Pending, StepRecord};

/// How the device is profiled for the controller table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profiling {
    /// Every condition of the tune's grids in turn, each profile until its
    /// share is spent or its latencies settle.
    #[default]
    Uniform,
    /// Samples where the table's decisions are sensitive, for a 45th of
    /// the time (see README, "Profiling cost").
    Adaptive,
}

impl std::str::FromStr for Profiling {
    type Err = SynthError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "adaptive" => Ok(Self::Adaptive),
            other => Err(SynthError::Settings(format!(
                "--profiling {other:?}: expected uniform or adaptive"
            ))),
        }
    }
}

/// What `tune` is asked to do.
#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// The GGUF model.
    pub model: PathBuf,
    /// Real prose the model will see: traced, trained and calibrated on.
    pub text: Vec<PathBuf>,
    /// Held-out prose, never trained on (default: the last fifth of `text`'s paragraphs).
    pub heldout: Vec<PathBuf>,
    pub out: PathBuf,
    /// Seconds for the whole run.
    pub budget_s: f64,
    /// Operating sparsity of the predictor, eviction and placement.
    pub sparsity: f32,
    /// FFN cache budget the verification runs at (besides its sweep).
    pub ffn_budget: String,
    /// Cap on each split's traced tokens (the trace takes ~200 KB a token).
    pub max_trace_tokens: usize,
    /// The controller's cost of skipping a layer's whole active mass, µs
    /// (the objective's weight of quality against time).
    pub w_skip_us: f64,
    pub profiling: Profiling,
    /// The `leanstream` binary the verification runs (default: beside this one).
    pub leanstream_bin: Option<PathBuf>,
    pub progress: bool,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TuneOutcome {
    /// Per step: name, whether it ran this session (else skipped), seconds.
    pub steps: Vec<(String, bool, f64)>,
    pub report: PathBuf,
}

/// Everything a step needs: the options, the model's shape, the manifest.
pub struct Ctx<'a> {
    pub opts: &'a TuneOptions,
    pub out: PathBuf,
    pub shape: ModelShape,
    pub manifest: Manifest,
    pub cores: usize,
    pub code: CodeHashes,
}

/// The code whose speed a step measures, by the SHA-256 of its binary: a
/// timing taken by another build says nothing about this one (the engine
/// probe found the table of a tune made before an engine change ranked
/// 56th of 82 actions, a fresh tune's 4th). Steps that compute rather than
/// time (traces, placement, pack, predictor) do not depend on it: their
/// results are fixed by the formats, which carry versions of their own.
#[derive(Debug, Clone)]
pub struct CodeHashes {
    /// The `leanstream` binary the engine probe and the verification run.
    pub engine: String,
    /// This binary: the compute kernels the compute profiles time are
    /// compiled into it.
    pub profiler: String,
}

impl CodeHashes {
    fn of(opts: &TuneOptions) -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| SynthError::io("current executable", e))?;
        Ok(Self {
            engine: leanstream_runtime::fetch::sha256_file(&leanstream_bin(opts)?)?,
            profiler: leanstream_runtime::fetch::sha256_file(&exe)?,
        })
    }
}

/// What sizing needs to know of the model.
#[derive(Debug, Clone)]
pub struct ModelShape {
    pub n_layer: usize,
    pub n_ff: usize,
    pub n_embd: usize,
    pub sha256: String,
}

impl Ctx<'_> {
    /// The recorded hash of `rel`, an output of an earlier step.
    pub fn hash_of(&self, rel: &str) -> Result<String> {
        self.manifest
            .steps
            .values()
            .flat_map(|s| &s.outputs)
            .find(|o| o.path == rel)
            .map(|o| o.sha256.clone())
            .ok_or_else(|| SynthError::Settings(format!("{rel}: no step has produced it yet")))
    }

    /// The step's share of the budget, seconds.
    pub fn budget_of(&self, step: Step) -> f64 {
        self.opts.budget_s * step.share()
    }

    /// The SHA-256 of every output an earlier step recorded.
    pub fn outputs_of(&self, step: Step) -> Result<Vec<String>> {
        self.manifest
            .steps
            .get(step.name())
            .map(|r| r.outputs.iter().map(|o| o.sha256.clone()).collect())
            .ok_or_else(|| SynthError::Settings(format!("step {} has not run yet", step.name())))
    }

    /// The summary an earlier step recorded.
    pub fn summary_of(&self, step: Step) -> Option<&serde_json::Value> {
        self.manifest.steps.get(step.name()).map(|r| &r.summary)
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Runs (or continues) the pipeline into `opts.out`.
pub fn tune(opts: &TuneOptions) -> Result<TuneOutcome> {
    if opts.budget_s.is_nan() || opts.budget_s <= 0.0 {
        return Err(SynthError::Settings("--budget must be positive".into()));
    }
    if opts.text.is_empty() {
        return Err(SynthError::Settings(
            "give at least one --text file of real prose".into(),
        ));
    }
    let out = opts.out.clone();
    let work = out.join("work");
    std::fs::create_dir_all(&work).map_err(|e| SynthError::io(&work, e))?;
    let g = leanstream_runtime::gguf::GgufFile::open(&opts.model)?;
    let c = leanstream_runtime::model::Config::from_gguf(&g)?;
    let shape = ModelShape {
        n_layer: c.n_layer,
        n_ff: c.n_ff,
        n_embd: c.n_embd,
        sha256: leanstream_runtime::fetch::sha256_file(&opts.model)?,
    };
    let device = leanstream_runtime::control::device_fingerprint();
    // Before any step: a missing engine binary stops the run now, not
    // hours later at the verification.
    let code = CodeHashes::of(opts)?;
    let mut manifest = match Manifest::load(&out)? {
        Some(m) if m.model_sha256 == shape.sha256 => m,
        Some(m) => {
            return Err(SynthError::Settings(format!(
                "{}: this directory was tuned for another model ({}, SHA-256 {}); give another --out",
                out.join(manifest::FILE).display(),
                m.model,
                m.model_sha256
            )))
        }
        None => Manifest::new(&opts.model, &shape.sha256, &device, opts.budget_s),
    };
    manifest.sessions += 1;
    manifest.budget_s = opts.budget_s;
    manifest.device = device;
    manifest.save(&out)?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut ctx = Ctx {
        opts,
        out: out.clone(),
        shape,
        manifest,
        cores,
        code,
    };

    let pipeline = Step::pipeline(opts.profiling);
    let display = progress::Display::new(opts.progress, opts.budget_s, pipeline);
    let mut done = Vec::new();
    let t_run = Instant::now();
    for (i, &step) in pipeline.iter().enumerate() {
        let inputs = step.inputs(&ctx)?;
        let key = key_of(&inputs);
        let skip = ctx
            .manifest
            .steps
            .get(step.name())
            .is_some_and(|r| r.inputs_key == key && outputs_intact(&ctx.out, r));
        if skip {
            done.push((step.name().to_string(), false, 0.0));
            continue;
        }
        // Partial state of a resumable step continues only under the inputs it began with.
        let sessions = match &ctx.manifest.pending {
            Some(p) if p.step == step.name() && p.inputs_key == key => p.sessions + 1,
            _ => {
                step.clear(&ctx)?;
                1
            }
        };
        ctx.manifest.steps.remove(step.name());
        ctx.manifest.pending = Some(Pending {
            step: step.name().into(),
            inputs_key: key.clone(),
            sessions,
        });
        ctx.manifest.save(&ctx.out)?;
        display.start_step(i, pipeline.len(), step, ctx.budget_of(step));
        let t = Instant::now();
        let (outputs, summary) = step.run(&ctx)?;
        let seconds = t.elapsed().as_secs_f64();
        let outputs = outputs
            .iter()
            .map(|p| manifest::output(&ctx.out, p))
            .collect::<Result<Vec<_>>>()?;
        ctx.manifest.steps.insert(
            step.name().into(),
            StepRecord {
                inputs_key: key,
                inputs,
                outputs,
                seconds,
                budget_s: ctx.budget_of(step),
                sessions,
                finished_unix: unix_now(),
                summary,
            },
        );
        ctx.manifest.pending = None;
        ctx.manifest.save(&ctx.out)?;
        display.finish_step(step, seconds);
        done.push((step.name().to_string(), true, seconds));
    }
    display.finish(t_run.elapsed().as_secs_f64());
    Ok(TuneOutcome {
        steps: done,
        report: out.join("report.md"),
    })
}

/// The `leanstream` binary: named, or beside the running one.
pub fn leanstream_bin(opts: &TuneOptions) -> Result<PathBuf> {
    if let Some(p) = &opts.leanstream_bin {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().map_err(|e| SynthError::io("current executable", e))?;
    let p = exe.with_file_name("leanstream");
    if p.is_file() {
        return Ok(p);
    }
    Err(SynthError::Settings(format!(
        "{}: the verification step runs the leanstream binary, which is not there; build it \
         (cargo build --release --bin leanstream) or name it with --leanstream-bin",
        p.display()
    )))
}

/// Removes `path` (file or directory) if it exists.
pub(crate) fn remove(path: &Path) -> Result<()> {
    let r = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SynthError::io(path, e)),
        _ => Ok(()),
    }
}
