//! The steps of a tune run: what each reads (its inputs, hashed into the
//! manifest), what it writes, and how it sizes its work from its share of
//! the budget.

use std::path::{Path, PathBuf};

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::record::{record, RecordOptions};
use leanstream_profiler::plan::{Engine, Pattern, Repetition};
use leanstream_profiler::runner::{self, Outcome};
use leanstream_profiler::sweeps::{self, ComputeGrid, IoGrid, RunSettings};
use leanstream_runtime::flash::{self, LsFlash};
use serde_json::{json, Value};

use super::layout::*;
use super::verify::VerifyPlan;
use super::{remove, Ctx, Profiling};
use crate::error::{Result, SynthError};

/// Sparsities stored in the packed file (the operating one among them).
const SPARSITIES: [f32; 3] = [0.5, 0.7, 0.8];
/// Trace windows (tokens), as the predictors were designed with.
const TRACE_CTX: usize = 256;
/// The predictor's training epochs.
const EPOCHS: usize = 4;
/// Measured on SmolLM2 with 2 threads of this project's
/// machines: tokens/s of tracing (forward pass plus writing ~200 KB a
/// token) and of a calibration prefill; seconds of predictor training per
/// token, epoch, layer and neuron. Work scales with them, so a budget buys
/// about the same share of time on other models and core counts.
const TRACE_TOK_S: f64 = 240.0;
const CALIB_TOK_S: f64 = 400.0;
/// Held-out tokens/s of the eviction step's replay (every policy, Belady's bound among them).
const REPLAY_TOK_S: f64 = 50.0;
const TRAIN_S_PER_UNIT: f64 = 80e-9;
/// Decode tokens/s of `speculate` on SmolLM2 at the 25% FFN budget and
/// sparsity 0.5 with 2 threads (17.7 to 19.1 measured): the engine probe's
/// sizing before it has measured anything. Reads and compute both scale with
/// the FFN, so `speed` carries it to other models (on the Mistral-7B shape
/// it predicts 0.27 tok/s; the probe measured 0.38 to 0.53).
const ENGINE_TOK_S: f64 = 18.0;
/// Bytes/s of opening a packed file and filling its cache (the Mistral-7B
/// shape's 5.0 GB file loaded in 8.4 s).
const LOAD_BYTES_S: f64 = 500e6;
/// Decoded tokens of an engine probe run, fewest and most.
const PROBE_TOKENS: (usize, usize) = (4, 48);
/// Of the engine probe's share, what its audited recall runs take (the
/// queue-depth runs take the rest).
const RECALL_SHARE: f64 = 0.4;
/// Held-out tokens an audited recall run scores, fewest and most.
const RECALL_TOKENS_RANGE: (usize, usize) = (16, 256);
/// Seconds the recall runs may overrun their share at the floor.
const RECALL_OVERRUN_S: f64 = 10.0;
/// The adaptive profile takes this fraction of the uniform profiles' shares
/// (`scripts/bench_adaptive_profile.sh` compared tables at that ratio)...
const ADAPTIVE_FRACTION: f64 = 1.0 / 45.0;
/// ...and at least this long: its pilot must sample every condition the
/// table reads before the sensitivity rounds have anything to resample.
const ADAPTIVE_MIN_S: f64 = 30.0;
/// Tokens the controller step simulates the table against fixed actions
/// on: at 40, one table's cost varied by up to 8% between seeds; at 2000,
/// by 0.6% (about 10 s).
const SIM_TOKENS: usize = 1000;
/// SmolLM2's layers × n_ff × n_embd.
const REFERENCE_FFN_PARAMS: f64 = (30 * 1536 * 576) as f64;

fn round_to(x: f64, step: usize, lo: usize, hi: usize) -> usize {
    let v = ((x / step as f64).floor() as usize) * step;
    v.clamp(lo, hi.max(lo))
}

fn text_sha(paths: &[PathBuf]) -> Result<Vec<String>> {
    paths
        .iter()
        .map(|p| Ok(leanstream_runtime::fetch::sha256_file(p)?))
        .collect()
}

/// Decoded tokens of each of `runs` engine probe runs sharing `share_s`:
/// what fits at `tok_s` after each run's `load_s` (a run decodes them twice,
/// warm-up and measured), never fewer than the fit needs (a token is
/// thousands of reads) nor more than it uses.
fn probe_tokens_for(share_s: f64, runs: usize, load_s: f64, tok_s: f64) -> usize {
    let per_run = share_s / runs.max(1) as f64 - load_s;
    let tokens = (per_run * tok_s / 2.0).floor().max(0.0) as usize;
    tokens.clamp(PROBE_TOKENS.0, PROBE_TOKENS.1)
}

/// Held-out tokens each of `runs` audited recall runs scores in `share_s`:
/// what fits at half `tok_s` (the audit computes every layer twice) after
/// each run's `load_s`; the floor where fewer fit but the floor's runs take
/// at most four times the share or [`RECALL_OVERRUN_S`] (small budgets
/// overrun, as elsewhere); else 0: not measured, and the control model
/// keeps the predictor's offline recall.
fn recall_tokens_for(share_s: f64, runs: usize, load_s: f64, tok_s: f64) -> usize {
    let runs = runs.max(1) as f64;
    let fit = ((share_s / runs - load_s) * tok_s / 2.0).floor().max(0.0) as usize;
    let (lo, hi) = RECALL_TOKENS_RANGE;
    if fit >= lo {
        fit.min(hi)
    } else if runs * (load_s + 2.0 * lo as f64 / tok_s) <= (4.0 * share_s).max(RECALL_OVERRUN_S) {
        lo
    } else {
        0
    }
}

impl Step {
    // The predictor comes before the profiles: the control model's recall
    // is measured from it, and the adaptive profile's sensitivity analysis
    // solves with that model.
    const UNIFORM: [Step; 12] = [
        Step::Text,
        Step::Activations,
        Step::Placement,
        Step::Pack,
        Step::Predictor,
        Step::ProfileIo,
        Step::ProfileCompute,
        Step::EngineProbe,
        Step::Controller,
        Step::Eviction,
        Step::Verify,
        Step::Report,
    ];
    const ADAPTIVE: [Step; 11] = [
        Step::Text,
        Step::Activations,
        Step::Placement,
        Step::Pack,
        Step::Predictor,
        Step::ProfileAdaptive,
        Step::EngineProbe,
        Step::Controller,
        Step::Eviction,
        Step::Verify,
        Step::Report,
    ];

    /// The steps of a run, in order.
    pub fn pipeline(profiling: Profiling) -> &'static [Step] {
        match profiling {
            Profiling::Uniform => &Self::UNIFORM,
            Profiling::Adaptive => &Self::ADAPTIVE,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Step::Text => "text",
            Step::Activations => "activations",
            Step::Placement => "placement",
            Step::Pack => "pack",
            Step::ProfileIo => "profile-io",
            Step::ProfileCompute => "profile-compute",
            Step::ProfileAdaptive => "profile-adaptive",
            Step::Controller => "controller",
            Step::Predictor => "predictor",
            Step::EngineProbe => "engine-probe",
            Step::Eviction => "eviction",
            Step::Verify => "verify",
            Step::Report => "report",
        }
    }

    /// The step's share of the budget (a pipeline's sum to 1).
    pub fn share(self) -> f64 {
        match self {
            Step::Text => 0.0,
            Step::Activations => 0.12,
            Step::Placement => 0.04,
            Step::Pack => 0.04,
            Step::ProfileIo => 0.155,
            Step::ProfileCompute => 0.115,
            // The two above; it uses ADAPTIVE_FRACTION of it, and the run ends early.
            Step::ProfileAdaptive => 0.27,
            Step::EngineProbe => 0.03,
            Step::Controller => 0.05,
            Step::Predictor => 0.22,
            Step::Eviction => 0.05,
            Step::Verify => 0.15,
            Step::Report => 0.03,
        }
    }

    /// What the step leaves in the output directory (removed before it
    /// starts afresh).
    fn products(self) -> &'static [&'static str] {
        match self {
            Step::Text => &["work/text"],
            Step::Activations => &[ACTS],
            Step::Placement => &[PLACEMENT],
            Step::Pack => &[MODEL],
            Step::ProfileIo => &[IO_TRACES],
            Step::ProfileCompute => &[COMPUTE_TRACES],
            Step::ProfileAdaptive => &[ADAPTIVE_TRACES],
            Step::Controller => &[CONTROLLER],
            Step::Predictor => &[PREDICTOR, LOW_RANK],
            Step::EngineProbe => &[ENGINE_RUNS],
            Step::Eviction => &[EVICTION],
            Step::Verify => &[VERIFY],
            Step::Report => &[REPORT, PLOTS],
        }
    }

    pub(super) fn clear(self, ctx: &Ctx) -> Result<()> {
        for p in self.products() {
            remove(&ctx.out.join(p))?;
        }
        Ok(())
    }

    /// Tokens/s of model-sized work relative to the reference measurement,
    /// by the FFN's size (not the file's: Gemma 3's 262k-token embedding is
    /// most of its file and little of its work).
    fn speed(ctx: &Ctx) -> f64 {
        let s = &ctx.shape;
        REFERENCE_FFN_PARAMS / (s.n_layer * s.n_ff * s.n_embd).max(1) as f64 * ctx.cores as f64 / 2.0
    }

    /// Tokens traced in each split.
    pub fn trace_tokens(ctx: &Ctx) -> usize {
        // The recorder first calibrates on the training tokens (a prefill),
        // then traces both splits.
        let per_token = (1.0 / CALIB_TOK_S + 2.0 / TRACE_TOK_S) / Self::speed(ctx);
        round_to(
            ctx.budget_of(Step::Activations) / per_token,
            256,
            512,
            ctx.opts.max_trace_tokens,
        )
    }

    /// Held-out tokens the eviction step replays for its Table 4.
    pub fn replay_tokens(ctx: &Ctx) -> usize {
        let t = ctx.budget_of(Step::Eviction) * 0.8 * REPLAY_TOK_S * Self::speed(ctx);
        round_to(t, 256, 256, Self::trace_tokens(ctx))
    }

    pub fn calib_tokens(ctx: &Ctx) -> usize {
        // Calibration is about half of the pack step.
        round_to(
            ctx.budget_of(Step::Pack) * 0.5 * CALIB_TOK_S * Self::speed(ctx),
            256,
            256,
            4096,
        )
    }

    pub fn train_tokens(ctx: &Ctx) -> usize {
        let unit =
            EPOCHS as f64 * (ctx.shape.n_layer * ctx.shape.n_ff) as f64 * TRAIN_S_PER_UNIT * 2.0 / ctx.cores as f64;
        round_to(ctx.budget_of(Step::Predictor) / unit, 256, 256, Self::trace_tokens(ctx))
    }

    /// Decode tokens/s of `speculate` on this model, estimated from its shape.
    fn estimated_tok_s(ctx: &Ctx) -> f64 {
        ENGINE_TOK_S * Self::speed(ctx)
    }

    /// Decode tokens/s of `speculate` as the engine probe measured it (its
    /// slowest queue depth), else the estimate. Only for steps after the
    /// probe: the probe's own inputs must not change once it has run.
    fn measured_tok_s(ctx: &Ctx) -> f64 {
        let measured = ctx.summary_of(Step::EngineProbe).and_then(|s| {
            s["runs"]
                .as_array()?
                .iter()
                .filter_map(|r| r["decode_tok_s"].as_f64())
                .filter(|v| v.is_finite() && *v > 0.0)
                .min_by(f64::total_cmp)
        });
        measured.unwrap_or_else(|| Self::estimated_tok_s(ctx))
    }

    /// Seconds one `leanstream bench` process spends before it decodes:
    /// opening the packed file and filling its cache.
    fn load_s(ctx: &Ctx) -> Result<f64> {
        let path = ctx.out.join(MODEL);
        let bytes = std::fs::metadata(&path).map_err(|e| SynthError::io(&path, e))?.len();
        Ok(bytes as f64 / LOAD_BYTES_S)
    }

    /// Decoded tokens of each engine probe run at a queue depth (see
    /// [`probe_tokens_for`]).
    pub fn probe_tokens(ctx: &Ctx) -> Result<usize> {
        let runs = crate::model::ActionSpace::default().queue_depths.len();
        Ok(probe_tokens_for(
            ctx.budget_of(Step::EngineProbe) * (1.0 - RECALL_SHARE),
            runs,
            Self::load_s(ctx)?,
            Self::estimated_tok_s(ctx),
        ))
    }

    /// Held-out tokens of each engine probe run at a prefetch breadth (see
    /// [`recall_tokens_for`]; 0: none).
    pub fn recall_tokens(ctx: &Ctx) -> Result<usize> {
        let runs = crate::model::ActionSpace::default().prefetch_breadths.len();
        Ok(recall_tokens_for(
            ctx.budget_of(Step::EngineProbe) * RECALL_SHARE,
            runs,
            Self::load_s(ctx)?,
            Self::estimated_tok_s(ctx),
        ))
    }

    /// The largest verification plan that fits the step's share at the
    /// engine probe's measured speed (see [`VerifyPlan::pick`]).
    pub fn verify_plan(ctx: &Ctx) -> Result<VerifyPlan> {
        Ok(VerifyPlan::pick(
            &ctx.opts.ffn_budget,
            ctx.budget_of(Step::Verify),
            Self::measured_tok_s(ctx),
            Self::load_s(ctx)?,
        ))
    }

    /// The packed file's request sizes: one bundle (in 4 KiB pages), the
    /// engine's merged runs at its default merge gap, and four times that.
    fn block_sizes(ctx: &Ctx) -> Result<Vec<u64>> {
        let f = LsFlash::open(ctx.out.join(MODEL))?;
        let bundle = (0..f.n_layer())
            .map(|l| f.layout(l).bundle_bytes())
            .max()
            .unwrap_or(4096) as u64;
        let merged = leanstream_runtime::engine::DEFAULT_MERGE_GAP as u64;
        let mut v = vec![bundle.div_ceil(4096) * 4096, merged, 4 * merged];
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }

    /// The I/O data file: 1 GiB, or 256 MiB when the run is too short to
    /// write that much first.
    fn io_file_size(ctx: &Ctx) -> u64 {
        if ctx.opts.budget_s * Step::ProfileIo.share() < 120.0 {
            256 << 20
        } else {
            1 << 30
        }
    }

    /// Seconds of the adaptive profile.
    pub fn adaptive_budget(ctx: &Ctx) -> f64 {
        (ctx.budget_of(Step::ProfileAdaptive) * ADAPTIVE_FRACTION).max(ADAPTIVE_MIN_S)
    }

    fn io_grid(ctx: &Ctx) -> Result<IoGrid> {
        Ok(IoGrid {
            dir: ctx.out.join(IO_SCRATCH),
            file_size: Self::io_file_size(ctx),
            block_sizes: Self::block_sizes(ctx)?,
            // The controller's codebook of queue depths.
            queue_depths: vec![1, 4, 16],
            workers: vec![1],
            patterns: vec![Pattern::Random],
            engines: vec![Engine::IoUring],
            lsflash: None,
            replay_fraction: 0.1,
        })
    }

    fn compute_grid(ctx: &Ctx) -> ComputeGrid {
        ComputeGrid {
            model: ctx.out.join(MODEL),
            neurons: None,
            stages: vec![1, 2, 4, 8],
            split_neurons: None,
            ctx: vec![256],
            threads: Some(vec![ctx.cores as u32]),
            background_io: vec![false],
            io_file: None,
            layer: 0,
            device: None,
        }
    }

    fn run_settings(ctx: &Ctx, step: Step) -> RunSettings {
        let budget_s = ctx.budget_of(step);
        RunSettings {
            budget_s,
            // Short budgets commit often, so a kill loses little.
            flush_every_s: (budget_s / 8.0).clamp(2.0, 30.0),
            // Tight enough that the share, not the precision, ends the
            // compute profile. At the profiler's ±5% a SmolLM2 compute
            // profile stopped after 13-20 s of its 207 s, and the table
            // cost 0.987-1.038 of the best fixed action from profile to
            // profile; at ±1% (the whole share) 0.974-0.993 (README,
            // "Why the profiles use their whole share").
            repetition: Repetition::Adaptive {
                precision: 0.01,
                min_samples: 200,
                max_samples: 200_000,
            },
            ..RunSettings::default()
        }
    }

    /// Scenarios of the sample average: with 8, a deadline that makes
    /// reads late in one layer out of fifty looked free and the table lost
    /// to a fixed action in the simulator; 64 cost SmolLM2 about 30 s on
    /// two cores.
    fn scenarios(ctx: &Ctx) -> usize {
        if ctx.budget_of(Step::Controller) < 60.0 {
            24
        } else {
            64
        }
    }

    /// Settings and the hashes of what the step reads.
    pub(super) fn inputs(self, ctx: &Ctx) -> Result<Value> {
        let o = ctx.opts;
        Ok(match self {
            Step::Text => json!({
                "text": text_sha(&o.text)?,
                "heldout": text_sha(&o.heldout)?,
                "heldout_share": if o.heldout.is_empty() { 0.2 } else { 0.0 },
            }),
            Step::Activations => json!({
                "model": ctx.shape.sha256,
                "train": ctx.hash_of(TRAIN_TEXT)?,
                "heldout": ctx.hash_of(HELDOUT_TEXT)?,
                "max_tokens": Self::trace_tokens(ctx),
                "ctx": TRACE_CTX,
                "hot_fraction": 0.25,
            }),
            Step::Placement => json!({
                "acts": ctx.hash_of(&format!("{ACTS}/manifest.json"))?,
                "sparsity": o.sparsity,
            }),
            Step::Pack => json!({
                "model": ctx.shape.sha256,
                "placement": ctx.hash_of(PLACEMENT)?,
                // The static hot set at this budget (at least half) goes
                // first in each layer.
                "hot_prefix_budget": o.ffn_budget,
                "hot_prefix_at_least": flash::pack::HOT_PREFIX_AT_LEAST,
                "calibration_text": ctx.hash_of(TRAIN_TEXT)?,
                "calibration_tokens": Self::calib_tokens(ctx),
                "sparsities": SPARSITIES,
            }),
            Step::ProfileIo => {
                let g = Self::io_grid(ctx)?;
                json!({
                    "device": ctx.manifest.device,
                    "block_sizes": g.block_sizes,
                    "queue_depths": g.queue_depths,
                    "file_size": g.file_size,
                    "budget_s": ctx.budget_of(self),
                    "repetition": Self::run_settings(ctx, self).repetition,
                })
            }
            Step::ProfileCompute => json!({
                "device": ctx.manifest.device,
                "flash": ctx.hash_of(MODEL)?,
                "stages": Self::compute_grid(ctx).stages,
                "threads": ctx.cores,
                "budget_s": ctx.budget_of(self),
                "repetition": Self::run_settings(ctx, self).repetition,
                "profiler": ctx.code.profiler,
            }),
            Step::ProfileAdaptive => json!({
                "device": ctx.manifest.device,
                "flash": ctx.hash_of(MODEL)?,
                "file_size": Self::io_file_size(ctx),
                "threads": ctx.cores,
                "scenarios": Self::scenarios(ctx),
                "w_skip_us": o.w_skip_us,
                "budget_s": Self::adaptive_budget(ctx),
                "predictor": ctx.hash_of(PREDICTOR)?,
                "profiler": ctx.code.profiler,
            }),
            Step::EngineProbe => json!({
                "engine": ctx.code.engine,
                "flash": ctx.hash_of(MODEL)?,
                "predictor": ctx.hash_of(PREDICTOR)?,
                "sparsity": o.sparsity,
                "ffn_budget": o.ffn_budget,
                "queue_depths": crate::model::ActionSpace::default().queue_depths,
                "gen_tokens": Self::probe_tokens(ctx)?,
                "prefetch_breadths": crate::model::ActionSpace::default().prefetch_breadths,
                "recall_tokens": Self::recall_tokens(ctx)?,
                "recall_gen_tokens": super::verify::RECALL_GEN_TOKENS,
                "heldout": ctx.hash_of(HELDOUT_TEXT)?,
            }),
            Step::Controller => match o.profiling {
                Profiling::Uniform => json!({
                    "io": ctx.hash_of(&format!("{IO_TRACES}/manifest.json"))?,
                    "compute": ctx.hash_of(&format!("{COMPUTE_TRACES}/manifest.json"))?,
                    "flash": ctx.hash_of(MODEL)?,
                    "scenarios": Self::scenarios(ctx),
                    "w_skip_us": o.w_skip_us,
                    "predictor": ctx.hash_of(PREDICTOR)?,
                    "engine": ctx.outputs_of(Step::EngineProbe)?,
                    // The control model and the solver are compiled into this binary.
                    "synthesizer": ctx.code.profiler,
                }),
                Profiling::Adaptive => json!({
                    "adaptive": ctx.outputs_of(Step::ProfileAdaptive)?,
                    "flash": ctx.hash_of(MODEL)?,
                    "scenarios": Self::scenarios(ctx),
                    "w_skip_us": o.w_skip_us,
                    "predictor": ctx.hash_of(PREDICTOR)?,
                    "engine": ctx.outputs_of(Step::EngineProbe)?,
                    // The control model and the solver are compiled into this binary.
                    "synthesizer": ctx.code.profiler,
                }),
            },
            Step::Predictor => json!({
                "acts": ctx.hash_of(&format!("{ACTS}/manifest.json"))?,
                "sparsity": o.sparsity,
                "tokens": Self::train_tokens(ctx),
                "epochs": EPOCHS,
            }),
            Step::Eviction => json!({
                "acts": ctx.hash_of(&format!("{ACTS}/manifest.json"))?,
                "sparsity": o.sparsity,
                "replay_tokens": Self::replay_tokens(ctx),
            }),
            Step::Verify => json!({
                "engine": ctx.code.engine,
                "flash": ctx.hash_of(MODEL)?,
                "controller": ctx.hash_of(CONTROLLER)?,
                "predictor": ctx.hash_of(PREDICTOR)?,
                "eviction": ctx.hash_of(EVICTION)?,
                "heldout": ctx.hash_of(HELDOUT_TEXT)?,
                "sparsity": o.sparsity,
                "plan": Self::verify_plan(ctx)?,
            }),
            Step::Report => {
                let pipeline = Self::pipeline(o.profiling);
                let keys: serde_json::Map<String, Value> = ctx
                    .manifest
                    .steps
                    .iter()
                    .filter(|(n, _)| n.as_str() != self.name() && pipeline.iter().any(|s| s.name() == n.as_str()))
                    .map(|(n, r)| (n.clone(), json!(r.inputs_key)))
                    .collect();
                json!({ "steps": keys, "verify": ctx.hash_of(VERIFY)? })
            }
        })
    }

    /// Runs the step; returns the files to record (relative to the output
    /// directory) and what it measured.
    pub(super) fn run(self, ctx: &Ctx) -> Result<(Vec<String>, Value)> {
        match self {
            Step::Text => split_text(ctx),
            Step::Activations => activations(ctx),
            Step::Placement => placement(ctx),
            Step::Pack => pack(ctx),
            Step::ProfileIo | Step::ProfileCompute => profile(ctx, self),
            Step::ProfileAdaptive => adaptive_profile(ctx),
            Step::Controller => controller(ctx),
            Step::Predictor => predictor(ctx),
            Step::EngineProbe => super::verify::engine_probe(ctx),
            Step::Eviction => eviction(ctx),
            Step::Verify => super::verify::verify(ctx),
            Step::Report => super::report::write(ctx),
        }
    }
}

fn read_text(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).map_err(|e| SynthError::io(p, e))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| SynthError::io(d, e))?;
    }
    leanstream_profiler::shard::write_atomic(path, bytes)?;
    Ok(())
}

/// The training text, and the held-out text: the named files, else the
/// last fifth of the paragraphs (a contiguous tail, so no paragraph's
/// neighbours leak into training).
fn split_text(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    let o = ctx.opts;
    let join = |ps: &[PathBuf]| -> Result<String> {
        let mut s = String::new();
        for p in ps {
            s += &read_text(p)?;
            s.push('\n');
        }
        Ok(s)
    };
    let all = join(&o.text)?;
    let (train, heldout) = if o.heldout.is_empty() {
        let paras: Vec<&str> = all.split("\n\n").filter(|p| !p.trim().is_empty()).collect();
        if paras.len() < 5 {
            return Err(SynthError::Settings(format!(
                "the text has {} paragraphs; to hold out a fifth it needs at least 5 (or name --heldout files)",
                paras.len()
            )));
        }
        let cut = paras.len() - paras.len() / 5;
        (paras[..cut].join("\n\n"), paras[cut..].join("\n\n"))
    } else {
        (all, join(&o.heldout)?)
    };
    write_file(&ctx.out.join(TRAIN_TEXT), train.as_bytes())?;
    write_file(&ctx.out.join(HELDOUT_TEXT), heldout.as_bytes())?;
    Ok((
        vec![TRAIN_TEXT.into(), HELDOUT_TEXT.into()],
        json!({"train_bytes": train.len(), "heldout_bytes": heldout.len()}),
    ))
}

fn activations(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    // The recorder continues a trace it finds with the same settings.
    let m = record(&RecordOptions {
        model: ctx.opts.model.clone(),
        train: vec![ctx.out.join(TRAIN_TEXT)],
        heldout: vec![ctx.out.join(HELDOUT_TEXT)],
        out: ctx.out.join(ACTS),
        ctx: TRACE_CTX,
        shard_tokens: 1024,
        max_tokens: Some(Step::trace_tokens(ctx)),
        hot_fraction: 0.25,
        progress: false,
    })?;
    let tokens: Vec<Value> = m
        .splits
        .iter()
        .map(|s| json!({"split": s.name, "tokens": s.recorded_tokens()}))
        .collect();
    Ok((vec![format!("{ACTS}/manifest.json")], json!({ "splits": tokens })))
}

fn placement(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use crate::placement::{compare, learn, PlacementOptions};
    let trace = Trace::open(&ctx.out.join(ACTS))?;
    let p = learn(
        &trace,
        &PlacementOptions {
            sparsity: ctx.opts.sparsity,
            ..PlacementOptions::default()
        },
    )?;
    p.save(&ctx.out.join(PLACEMENT))?;
    let reads = compare(&trace, &p.layers, ctx.opts.sparsity, false)?;
    Ok((vec![PLACEMENT.into()], json!({ "heldout_reads": reads })))
}

/// The share of the FFN's neurons the static hot cache holds at `budget`
/// (what the engine's cache would make of it: slots of the widest bundle).
fn hot_fraction(model: &leanstream_runtime::model::Model, down: flash::DownType, budget: &str) -> Result<f64> {
    use leanstream_runtime::cache::{CacheShape, FfnBudget};
    let layouts = flash::pack::bundle_layouts(&model.gguf, &model.config, down)?;
    let shape = CacheShape {
        n_ff: model.config.n_ff,
        bundle_bytes: layouts.iter().map(|l| l.bundle_bytes()).collect(),
    };
    let b = FfnBudget::parse(budget).map_err(|e| SynthError::Settings(format!("--ffn-budget {budget}: {e}")))?;
    Ok(shape.budget_share(b))
}

fn pack(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use leanstream_runtime::sparsity::{calibrate_run, CalibrationRun};
    let model = leanstream_runtime::model::Model::load(&ctx.opts.model)?;
    let text = read_text(&ctx.out.join(TRAIN_TEXT))?;
    let t = std::time::Instant::now();
    let c = calibrate_run(
        &model,
        &text,
        CalibrationRun {
            ctx: 512,
            max_tokens: Some(Step::calib_tokens(ctx)),
            progress: false,
        },
        &SPARSITIES,
    )?;
    let calib_s = t.elapsed().as_secs_f64();
    let n_layer = model.config.n_layer;
    let down = flash::DownType::Q8_0;
    // At least half: every budget the verification sweeps short of 100%
    // (which holds the FFN whole) then finds its hot set in one piece.
    let hot = hot_fraction(&model, down, &ctx.opts.ffn_budget)?.max(flash::pack::HOT_PREFIX_AT_LEAST);
    drop(model);
    let sparsity = c
        .levels
        .iter()
        .map(|t| t.for_layers(n_layer))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let learned = flash::pack::load_placement(&ctx.out.join(PLACEMENT))?;
    let opts = flash::PackOptions {
        down,
        placement: Some(flash::pack::hot_prefix(&learned, &c.neuron_scores, hot)?),
        sparsity,
        neuron_scores: c.neuron_scores,
        progress: false,
    };
    let r = flash::pack(&ctx.opts.model, ctx.out.join(MODEL), &opts)?;
    Ok((
        vec![MODEL.into()],
        json!({
            "calibration_tokens": c.tokens,
            "calibration_s": calib_s,
            "file_bytes": r.file_len,
            "resident_bytes": r.resident_len,
            "bundle_bytes": r.bundle_len,
            "pack_s": r.seconds,
        }),
    ))
}

/// A profile sweep, continued from its committed shards when it was killed.
fn profile(ctx: &Ctx, step: Step) -> Result<(Vec<String>, Value)> {
    let (dir, rel) = match step {
        Step::ProfileIo => (ctx.out.join(IO_TRACES), IO_TRACES),
        _ => (ctx.out.join(COMPUTE_TRACES), COMPUTE_TRACES),
    };
    runner::install_signal_handlers();
    let outcome = if sweeps::is_run(&dir) {
        sweeps::resume(&dir, false, |_| {})
    } else {
        remove(&dir)?;
        let settings = Step::run_settings(ctx, step);
        let plan = match step {
            Step::ProfileIo => sweeps::io_plan(&Step::io_grid(ctx)?, &settings)?,
            _ => sweeps::compute_plan(&Step::compute_grid(ctx), &settings)?,
        };
        sweeps::start(&plan, &dir, false)
    };
    runner::reset_signal_handlers();
    match outcome? {
        Outcome::Interrupted => Err(SynthError::Interrupted(format!(
            "{}: interrupted; the samples committed so far are kept, and the same command continues",
            dir.display()
        ))),
        Outcome::Finished(f) => {
            if step == Step::ProfileIo {
                remove(&ctx.out.join(IO_SCRATCH))?;
            }
            let store = leanstream_profiler::shard::ShardStore::open(&dir)?;
            let rows: u64 = store.manifest.shards.iter().map(|s| s.rows).sum();
            let repetition = match runner::read_plan(&dir)?.repetition {
                Repetition::Fixed { reps } => format!("fixed {reps}"),
                Repetition::Adaptive { precision, .. } => format!("adaptive ±{precision}"),
            };
            Ok((
                vec![format!("{rel}/manifest.json")],
                json!({"samples": rows, "finish": format!("{f:?}"), "spent_s": store.manifest.spent_s, "repetition": repetition}),
            ))
        }
    }
}

/// The adaptive profile, from scratch: each round depends on the ones
/// before, so a killed profile is redone rather than continued (it is
/// short).
fn adaptive_profile(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use crate::adaptive::{profile, AdaptiveOptions};
    let dir = ctx.out.join(ADAPTIVE_TRACES);
    remove(&dir)?;
    // Before the engine probe: the predictor's offline recall.
    let cfg = controller_config(ctx)?;
    let budget_s = Step::adaptive_budget(ctx);
    let o = AdaptiveOptions {
        budget_s,
        io_dir: ctx.out.join(IO_SCRATCH),
        io_file_size: Step::io_file_size(ctx),
        model: ctx.out.join(MODEL),
        threads: ctx.cores as u32,
        seed: cfg.seed,
        cfg,
        pilot_share: 0.3,
        rounds: 3,
        probe_states: 96,
        replicates: 2,
    };
    runner::install_signal_handlers();
    let log = profile(&dir, &o);
    runner::reset_signal_handlers();
    let log = log?;
    remove(&ctx.out.join(IO_SCRATCH))?;
    let mut run_dirs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| SynthError::io(&dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    run_dirs.sort();
    let mut runs = Vec::new();
    let mut samples = 0u64;
    for run in &run_dirs {
        let store = leanstream_profiler::shard::ShardStore::open(run)?;
        samples += store.manifest.shards.iter().map(|s| s.rows).sum::<u64>();
        let name = run.file_name().unwrap_or_default().to_string_lossy();
        runs.push(format!("{ADAPTIVE_TRACES}/{name}/manifest.json"));
    }
    Ok((
        runs.clone(),
        json!({"budget_s": budget_s, "runs": runs.len(), "samples": samples, "rounds": log}),
    ))
}

/// Held-out rows the predictor's recall per breadth is measured on.
const RECALL_TOKENS: usize = 512;

/// The synthesis settings of this run (the adaptive profile's sensitivity
/// analysis solves with them too), with the predictor's offline recall at
/// each breadth of the codebook: the mass of the top b × need on the
/// held-out trace. The controller step replaces it with the engine's own
/// where the engine probe audited it, since the offline recall misses what
/// merged reads and the cache add (Gemma 3: 0.72 and 0.88 at breadth 1 and
/// 1.5 offline, 0.93 and 0.997 in the engine).
fn controller_config(ctx: &Ctx) -> Result<crate::synth::SynthConfig> {
    let mut cfg = crate::synth::SynthConfig::for_flash(&ctx.out.join(MODEL))?;
    cfg.solver.scenarios = Step::scenarios(ctx);
    cfg.params.w_skip_us = ctx.opts.w_skip_us;
    // Both callers run after the predictor step (the pipelines' order).
    let trace = Trace::open(&ctx.out.join(ACTS))?;
    let p = leanstream_runtime::predict::Predictor::load(&ctx.out.join(PREDICTOR))?;
    let breadths: Vec<f64> = cfg.space.prefetch_breadths.iter().map(|&b| b as f64).collect();
    cfg.params.recall_by_breadth =
        crate::eval::breadth_recall(&trace, &p, "heldout", ctx.opts.sparsity, &breadths, RECALL_TOKENS)?;
    Ok(cfg)
}

fn controller(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use crate::sim::{compare, SimConfig};
    let mut cfg = controller_config(ctx)?;
    let offline = cfg.params.recall_by_breadth.clone();
    let recall_source = match super::verify::probe_recall(ctx) {
        Some(engine) => {
            cfg.params.recall_by_breadth = engine;
            "engine"
        }
        None => "offline",
    };
    cfg.params.read_share_by_breadth = super::verify::probe_read_share(ctx).unwrap_or_default();
    let traces = match ctx.opts.profiling {
        Profiling::Uniform => TRACES,
        Profiling::Adaptive => ADAPTIVE_TRACES,
    };
    let mut fitted = crate::fit::fit_traces(&ctx.out.join(traces))?;
    let engine = crate::engine_fit::fit_engine(&super::verify::probe_runs(ctx)?, cfg.params.n_layers, cfg.params.n_ff)?;
    engine.apply_to(&mut fitted, &mut cfg.params);
    let table = crate::synth::synthesize(&cfg, &fitted, false)?;
    table.save(&ctx.out.join(CONTROLLER))?;
    let rows = compare(
        &table,
        &cfg,
        &fitted,
        &SimConfig {
            tokens: SIM_TOKENS,
            seed: cfg.seed,
            truth: Default::default(),
        },
        false,
    )?;
    Ok((
        vec![CONTROLLER.into()],
        json!({"states": table.n_states(), "actions": table.codebook.len(), "sim_tokens": SIM_TOKENS, "simulated": rows,
               "recall_by_breadth": cfg.params.recall_by_breadth, "recall_source": recall_source,
               "offline_recall_by_breadth": offline, "read_share_by_breadth": cfg.params.read_share_by_breadth,
               "engine_fit": {
                   "block": engine.block, "ns_per_neuron": engine.ns_per_neuron, "resident_rows": engine.resident_rows,
                   "latency_us_median": engine.latency_us.iter().map(|(q, l)| (q, l[l.len() / 2])).collect::<Vec<_>>()}}),
    ))
}

fn predictor(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use crate::predictor::{train, TrainOptions};
    let trace = Trace::open(&ctx.out.join(ACTS))?;
    let trained = train(
        &trace,
        &TrainOptions {
            sparsity: ctx.opts.sparsity,
            epochs: EPOCHS,
            max_tokens: Some(Step::train_tokens(ctx)),
            ..TrainOptions::default()
        },
    )?;
    trained.hashing.save(&ctx.out.join(PREDICTOR))?;
    trained.low_rank.save(&ctx.out.join(LOW_RANK))?;
    let n = trained.losses.len().max(1) as f32;
    let before = trained.losses.iter().map(|l| l.hashing_before).sum::<f32>() / n;
    let after = trained.losses.iter().map(|l| l.hashing_after).sum::<f32>() / n;
    Ok((
        vec![PREDICTOR.into(), LOW_RANK.into()],
        json!({"tokens": Step::train_tokens(ctx), "hashing_loss_before": before, "hashing_loss_after": after,
               "weight_bytes": trained.hashing.weight_bytes()}),
    ))
}

fn eviction(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    use crate::eviction::{learn, table4, EvictionOptions};
    let trace = Trace::open(&ctx.out.join(ACTS))?;
    let trained = learn(
        &trace,
        &EvictionOptions {
            sparsity: ctx.opts.sparsity,
            ..EvictionOptions::default()
        },
    )?;
    trained.table.save(&ctx.out.join(EVICTION))?;
    let replay = Step::replay_tokens(ctx);
    let rows = table4(&trace, &trained, "heldout", ctx.opts.sparsity, 0.25, 4, Some(replay))?;
    Ok((
        vec![EVICTION.into()],
        json!({"table4": rows, "budget_share": 0.25, "replay_tokens": replay}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_tokens_fit_the_share_or_take_the_floor_or_none() {
        // 4.5 s a run after 0.5 s of loading, at 20 tok/s halved by the audit.
        assert_eq!(recall_tokens_for(13.5, 3, 0.5, 20.0), 40);
        assert_eq!(recall_tokens_for(600.0, 3, 0.5, 20.0), RECALL_TOKENS_RANGE.1);
        // A 60 s tune's share fits less than the floor, which costs seconds.
        assert_eq!(recall_tokens_for(0.7, 3, 0.2, 18.0), RECALL_TOKENS_RANGE.0);
        // A 7B shape at 0.4 tok/s: the floor would take minutes.
        assert_eq!(recall_tokens_for(18.0, 3, 10.0, 0.4), 0);
    }

    #[test]
    fn probe_tokens_fit_the_share() {
        // SmolLM2 at a 30-minute budget: 54 s for 3 runs at ~18 tok/s, capped.
        assert_eq!(probe_tokens_for(54.0, 3, 0.2, 18.0), PROBE_TOKENS.1);
        // 2 s at 18 tok/s: 5 tokens decoded twice.
        assert_eq!(probe_tokens_for(3.0 * 0.7, 3, 0.2, 18.0), 4);
        assert_eq!(probe_tokens_for(3.0 * 1.5, 3, 0.2, 18.0), 11);
        // The Mistral-7B shape at a 25-minute budget: 45 s, 10 s to load, 0.27 tok/s.
        assert_eq!(probe_tokens_for(45.0, 3, 10.0, 0.27), PROBE_TOKENS.0);
    }
}
