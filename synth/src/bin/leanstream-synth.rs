//! `leanstream-synth`: controller tables from profiled traces.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use leanstream_profiler::activations::read::Trace;
use leanstream_runtime::control::{AxisKind, ControlState, ControlTable};
use leanstream_runtime::predict::Predictor;
use leanstream_synth::eval::{evaluate, EvalOptions};
use leanstream_synth::fit::fit_traces;
use leanstream_synth::inspect::{describe, heatmap_svg};
use leanstream_synth::model::{GridSpec, ModelParams};
use leanstream_synth::predictor::{train as train_predictors, LayerLoss, TrainOptions};
use leanstream_synth::sim::{compare, simulate_policy, Half, Policy, SimConfig};
use leanstream_synth::solve::{Solver, SolverSettings};
use leanstream_synth::synth::{synthesize, SynthConfig};

#[derive(Parser)]
#[command(
    version,
    about = "Offline synthesis from profiled traces: the controller table (.lstab)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::ValueEnum, Clone, Copy)]
enum TruthArg {
    Fit,
    HeldOut,
}

#[derive(clap::Args, Clone)]
struct EngineArgs {
    /// `leanstream bench --json` reports of `speculate` with one action
    /// pinned per codebook queue depth (what tune's engine-probe step
    /// writes to work/engine/): the model takes the engine's read size,
    /// read latencies and compute speed from them instead of the profile's.
    #[arg(long, num_args = 1..)]
    engine_runs: Vec<PathBuf>,
}

impl EngineArgs {
    /// The traces fitted, and the engine's runs put in place where given
    /// (which sets the model's request size and reference depth in `cfg`).
    fn fit(&self, traces: &Path, cfg: &mut SynthConfig) -> Result<leanstream_synth::fit::Fitted> {
        let mut fitted = fit_traces(traces)?;
        if !self.engine_runs.is_empty() {
            let engine =
                leanstream_synth::engine_fit::fit_engine(&self.engine_runs, cfg.params.n_layers, cfg.params.n_ff)?;
            engine.apply_to(&mut fitted, &mut cfg.params);
        }
        Ok(fitted)
    }
}

#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// A packed model (.lsflash): its layers, neurons and bundle bytes replace
    /// --layers, --n-ff and --bundle-bytes, and the table records the SHA-256
    /// of its source GGUF, so the runtime refuses the table for other models.
    #[arg(long)]
    flash: Option<PathBuf>,
    /// Layers in the stack.
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// FFN neurons per layer.
    #[arg(long, default_value_t = 1536)]
    n_ff: usize,
    /// Bytes per neuron bundle.
    #[arg(long, default_value_t = 1856.0)]
    bundle_bytes: f64,
    /// Request size of the engine's reads (must be profiled), bytes.
    #[arg(long, default_value_t = 65536)]
    block: u64,
    /// Predictor recall at prefetch breadth 1.
    #[arg(long, default_value_t = 0.85)]
    recall: f64,
    /// Measured mass recall per breadth, `B:R,...` (e.g. 1:0.66,1.5:0.85,2.5:1,
    /// what `tune` records as `recall_by_breadth`); replaces --recall.
    #[arg(long)]
    recall_by_breadth: Option<String>,
    /// Bytes read per token at each breadth over those at the widest, as
    /// the engine measured them, `B:S,...` (what `tune` records as
    /// `read_share_by_breadth`): a narrow breadth reads at least that share.
    #[arg(long)]
    read_share_by_breadth: Option<String>,
    /// Cost of skipping the whole active mass of a layer, µs.
    #[arg(long, default_value_t = 2000.0)]
    w_skip_us: f64,
    /// Cost of one wasted MiB, µs.
    #[arg(long, default_value_t = 100.0)]
    w_waste_us_per_mib: f64,
    /// MPC horizon in layers.
    #[arg(long, default_value_t = 3)]
    horizon: usize,
    /// Scenarios of the sample average.
    #[arg(long, default_value_t = 24)]
    scenarios: usize,
    /// How each instance is solved: dp (backward induction; ties to the
    /// deepest queue), milp (good_lp + microlp) or enumerate (a check,
    /// exponential in the horizon). All three reach the same optimum.
    #[arg(long, default_value = "dp")]
    solver: Solver,
    /// Bins of the queued-bytes axis.
    #[arg(long, default_value_t = 4)]
    queued_bins: usize,
    /// Bins of the missing-bytes axis.
    #[arg(long, default_value_t = 12)]
    missing_bins: usize,
    /// Bins of the read-bandwidth axis.
    #[arg(long, default_value_t = 4)]
    bw_bins: usize,
    /// Bins of the compute-time axis.
    #[arg(long, default_value_t = 3)]
    compute_bins: usize,
    /// Bins of the layer-position axis.
    #[arg(long, default_value_t = 3)]
    position_bins: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// `B:R,...` with breadths ascending and recalls in [0, 1].
/// `B:V,...` points of a per-breadth curve in [0, 1] (`flag` names it in errors).
fn parse_curve(flag: &str, s: &str) -> Result<Vec<(f64, f64)>> {
    let pts = s
        .split(',')
        .map(|p| {
            let (b, r) = p
                .split_once(':')
                .with_context(|| format!("--{flag} {p:?}: expected B:V"))?;
            let (b, r): (f64, f64) = (
                b.trim().parse().with_context(|| format!("--{flag} {p:?}: breadth"))?,
                r.trim().parse().with_context(|| format!("--{flag} {p:?}: value"))?,
            );
            if !(b > 0.0 && (0.0..=1.0).contains(&r)) {
                bail!("--{flag} {p:?}: breadth must be > 0 and the value in [0, 1]");
            }
            Ok((b, r))
        })
        .collect::<Result<Vec<_>>>()?;
    if pts.windows(2).any(|w| w[1].0 <= w[0].0) {
        bail!("--{flag} {s:?}: breadths must ascend");
    }
    Ok(pts)
}

impl ModelArgs {
    fn config(&self) -> Result<SynthConfig> {
        let shape = match &self.flash {
            Some(path) => Some(SynthConfig::for_flash(path)?),
            None => None,
        };
        let (n_layers, n_ff, bundle_bytes, model_sha256) = match &shape {
            Some(c) => (
                c.params.n_layers,
                c.params.n_ff,
                c.params.bundle_bytes,
                c.model_sha256.clone(),
            ),
            None => (self.layers, self.n_ff, self.bundle_bytes, None),
        };
        Ok(SynthConfig {
            model_sha256,
            params: ModelParams {
                n_layers,
                n_ff,
                bundle_bytes,
                block: self.block,
                recall_at_1: self.recall,
                recall_by_breadth: match &self.recall_by_breadth {
                    Some(s) => parse_curve("recall-by-breadth", s)?,
                    None => Vec::new(),
                },
                read_share_by_breadth: match &self.read_share_by_breadth {
                    Some(s) => parse_curve("read-share-by-breadth", s)?,
                    None => Vec::new(),
                },
                w_skip_us: self.w_skip_us,
                w_waste_us_per_mib: self.w_waste_us_per_mib,
                ..ModelParams::default()
            },
            solver: SolverSettings {
                horizon: self.horizon,
                scenarios: self.scenarios,
                solver: self.solver,
            },
            grid: GridSpec {
                queued: self.queued_bins,
                missing: self.missing_bins,
                bandwidth: self.bw_bins,
                compute: self.compute_bins,
                position: self.position_bins,
            },
            seed: self.seed,
            ..SynthConfig::default()
        })
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// The whole toolchain for one model on this device, resumable: traces,
    /// placement, pack, I/O and compute profiles, controller table,
    /// predictor, eviction, a verification benchmark and report.md, all in
    /// --out. Killed or interrupted, the same command continues.
    Tune {
        /// GGUF model (or a known name: smollm2, gemma3).
        #[arg(long)]
        model: String,
        /// Real prose to trace, train and calibrate on.
        #[arg(long, num_args = 1.., required = true)]
        text: Vec<PathBuf>,
        /// Held-out prose (default: the last fifth of --text's paragraphs).
        #[arg(long, num_args = 1..)]
        heldout: Vec<PathBuf>,
        #[arg(short, long)]
        out: PathBuf,
        /// Time for the whole run (90s, 30m, 8h), split across the steps.
        #[arg(long, default_value = "30m")]
        budget: String,
        #[arg(long, default_value_t = 0.5)]
        sparsity: f32,
        /// FFN cache budget of the verification runs.
        #[arg(long, default_value = "25%")]
        ffn_budget: String,
        /// Cap on each split's traced tokens (a trace takes ~200 KB a token).
        #[arg(long, default_value_t = 16384)]
        max_trace_tokens: usize,
        /// The controller's cost of skipping a layer's whole active mass,
        /// µs. High by default: at 100 ms, skipping 1% of a layer's mass
        /// costs about a layer's compute time, which keeps deadline skips
        /// rare and perplexity near dense.
        #[arg(long, default_value_t = 100_000.0)]
        w_skip_us: f64,
        /// How the device is profiled: `uniform` (every condition of the
        /// grids, 27% of the budget) or `adaptive` (where the table's
        /// decisions are sensitive, a 45th of that, at least 30 s).
        #[arg(long, default_value = "uniform")]
        profiling: leanstream_synth::tune::Profiling,
        /// The leanstream binary the engine probe and the verification run
        /// (default: beside this one); its SHA-256 is among their inputs.
        #[arg(long)]
        leanstream_bin: Option<PathBuf>,
        /// No progress bar (one line per step instead).
        #[arg(long)]
        quiet: bool,
    },
    /// Profile this device for the controller adaptively: a pilot of the
    /// conditions the table reads, then rounds that give the read and the
    /// compute sweep time by how much their uncertainty changes the table's
    /// decisions (bootstrap sensitivity at probe states). Writes profiler
    /// runs into --out (`controller --traces` reads them) and prints the
    /// rounds as JSON.
    AdaptiveProfile {
        /// Output directory (new).
        #[arg(short, long)]
        out: PathBuf,
        /// Directory on the device under test for the I/O data file.
        #[arg(long)]
        io_dir: PathBuf,
        #[arg(long, default_value = "256m")]
        file_size: String,
        /// Time for the whole profile, analysis included.
        #[arg(long, default_value = "60s")]
        budget: String,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long, default_value_t = 0.3)]
        pilot_share: f64,
        /// Grid states at which decisions are compared.
        #[arg(long, default_value_t = 96)]
        probe_states: usize,
        /// Bootstrap replicates per condition and round.
        #[arg(long, default_value_t = 2)]
        replicates: usize,
        /// Threads of the compute runs (default: all cores).
        #[arg(long)]
        threads: Option<u32>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Fit the traces, solve the stochastic MPC for every grid state, write the table.
    Controller {
        #[arg(long)]
        traces: PathBuf,
        #[arg(short, long)]
        out: PathBuf,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        quiet: bool,
    },
    /// Print a table and write SVG heatmaps of its actions (FILE.svg unless --svg).
    Inspect {
        file: PathBuf,
        #[arg(long)]
        svg: Option<PathBuf>,
    },
    /// Replay held-out trace samples: table vs best fixed action vs greedy vs online MPC.
    Simulate {
        #[arg(long)]
        table: PathBuf,
        #[arg(long)]
        traces: PathBuf,
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        model: ModelArgs,
        /// Simulated tokens (each one pass over the layers).
        #[arg(long, default_value_t = 40)]
        tokens: usize,
        /// Codebook actions to report besides the best fixed one, as
        /// `leanstream --controller` writes them (`fixed:K=2,b=2.5,d=2,q=16`).
        #[arg(long, num_args = 1..)]
        fixed: Vec<String>,
        /// Skip online MPC (slow).
        #[arg(long)]
        no_mpc: bool,
        /// The half of the traces that plays the device: `held-out` (the
        /// samples the table was not built from) or `fit` (the ones it was:
        /// a loss there is the control model's, not the profile's noise).
        #[arg(long, value_enum, default_value = "held-out")]
        truth: TruthArg,
        #[arg(long)]
        json: bool,
    },
    /// Learn a flash placement from an activation trace; print held-out reads
    /// of identity / frequency / learned orders at merge gaps 0, 4 KiB, 64 KiB.
    Placement {
        /// Trace directory (`leanstream-profile activations`).
        #[arg(long)]
        acts: PathBuf,
        /// Placement JSON to write (`pack --placement`).
        #[arg(short, long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0.5)]
        sparsity: f32,
        #[arg(long, default_value_t = 16)]
        dim: usize,
        #[arg(long, default_value_t = 5)]
        epochs: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Keep the embedding chain as it is (no 2-opt on co-activation).
        #[arg(long)]
        no_refine: bool,
        /// Print the evaluation as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Learn the neuron cache's retention priorities (.lsevict) from an
    /// activation trace; print Table 4, the held-out miss ratio of LRU,
    /// window, hot and learned eviction.
    Eviction {
        /// Trace directory (`leanstream-profile activations`).
        #[arg(long)]
        acts: PathBuf,
        /// The retention table to write (`leanstream run --eviction`, or
        /// beside the model as <stem>.lsevict).
        #[arg(short, long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0.5)]
        sparsity: f32,
        /// Cache size for Table 4, as a share of all neurons.
        #[arg(long, default_value_t = 0.25)]
        budget: f64,
        /// Tokens of the sliding window compared.
        #[arg(long, default_value_t = 4)]
        window: usize,
        /// Train on the first N tokens of the training split.
        #[arg(long)]
        max_tokens: Option<usize>,
        /// Replay the first N held-out tokens (default: all).
        #[arg(long)]
        eval_tokens: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Train the stacked hashing activation predictor (and, at the same
    /// size, the low-rank baseline) for both uses on an activation trace.
    Predictor {
        /// Trace directory (`leanstream-profile activations`).
        #[arg(long)]
        acts: PathBuf,
        /// The hashing predictor (.lspred).
        #[arg(short, long)]
        out: PathBuf,
        /// Also write the low-rank baseline here.
        #[arg(long)]
        baseline: Option<PathBuf>,
        #[arg(long, default_value_t = 0.5)]
        sparsity: f32,
        /// Neurons per predicted group.
        #[arg(long, default_value_t = 1)]
        group: usize,
        /// Projection width.
        #[arg(long, default_value_t = 32)]
        dim: usize,
        /// Bits per hash.
        #[arg(long, default_value_t = 16)]
        tau: usize,
        /// Keys (LUT rows) per stage.
        #[arg(long, default_value_t = 8)]
        keys: usize,
        #[arg(long, default_value_t = 4)]
        stages: usize,
        #[arg(long, default_value_t = 4)]
        epochs: usize,
        /// Hashing: leading epochs trained on the soft key mixture.
        #[arg(long, default_value_t = 0)]
        soft_epochs: usize,
        #[arg(long, default_value_t = 1e-2)]
        lr: f32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Train on the first N tokens of the training split.
        #[arg(long)]
        max_tokens: Option<usize>,
        #[arg(long)]
        quiet: bool,
    },
    /// Judge predictors (and a placement) on the trace's held-out split:
    /// recall, perplexity with predicted sets, size, latency; prints JSON.
    Eval {
        #[arg(long)]
        acts: PathBuf,
        /// .lspred files (hashing and/or low-rank).
        #[arg(long, num_args = 1..)]
        predictor: Vec<PathBuf>,
        /// Operating sparsities.
        #[arg(long, value_delimiter = ',', default_value = "0.5,0.7")]
        sparsities: Vec<f32>,
        /// Held-out tokens for recall and latency (default: all).
        #[arg(long)]
        max_tokens: Option<usize>,
        /// Perplexity chunks of the held-out text (0: skip perplexity).
        #[arg(long, default_value_t = 8)]
        ppl_chunks: usize,
        #[arg(long, default_value_t = 256)]
        ctx: usize,
        /// Also size and time a random predictor of each configuration at Mistral-7B shape.
        #[arg(long)]
        shape_7b: bool,
        /// A placement (`leanstream-synth placement`): held-out reads per
        /// token against identity and frequency order, at each sparsity.
        #[arg(long)]
        placement: Option<PathBuf>,
    },
    /// Time the runtime's table lookup; prints JSON.
    Bench {
        file: PathBuf,
        #[arg(long, default_value_t = 2_000_000)]
        lookups: usize,
    },
}

/// Writes to stdout; a closed pipe (`| head`) ends the output quietly.
fn out(s: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(s.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn load(path: &Path) -> Result<(ControlTable, usize)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok((ControlTable::from_bytes(&bytes, path)?, bytes.len()))
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", leanstream_runtime::error_chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::AdaptiveProfile {
            out: dir,
            io_dir,
            file_size,
            budget,
            rounds,
            pilot_share,
            probe_states,
            replicates,
            threads,
            model,
        } => {
            use leanstream_synth::adaptive::{profile, AdaptiveOptions};
            let Some(flash) = model.flash.clone() else {
                anyhow::bail!("--flash M.lsflash: the adaptive profile measures that model's kernels");
            };
            let cores = std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1);
            let o = AdaptiveOptions {
                budget_s: leanstream_profiler::units::parse_duration(&budget)?.as_secs_f64(),
                io_dir,
                io_file_size: leanstream_profiler::units::parse_size(&file_size)?,
                model: flash,
                threads: threads.unwrap_or(cores),
                cfg: model.config()?,
                pilot_share,
                rounds,
                probe_states,
                replicates,
                seed: model.seed,
            };
            let t0 = Instant::now();
            let log = profile(&dir, &o)?;
            eprintln!("profiled {} in {:.1}s", dir.display(), t0.elapsed().as_secs_f64());
            out(&format!("{}\n", serde_json::to_string_pretty(&log)?))?;
        }
        Cmd::Tune {
            model,
            text,
            heldout,
            out: dir,
            budget,
            sparsity,
            ffn_budget,
            max_trace_tokens,
            w_skip_us,
            profiling,
            leanstream_bin,
            quiet,
        } => {
            use std::io::IsTerminal;
            let opts = leanstream_synth::tune::TuneOptions {
                model: leanstream_runtime::fetch::resolve_model(&model)?,
                text,
                heldout,
                out: dir,
                budget_s: leanstream_profiler::units::parse_duration(&budget)?.as_secs_f64(),
                sparsity,
                ffn_budget,
                max_trace_tokens,
                w_skip_us,
                profiling,
                leanstream_bin,
                progress: !quiet && std::io::stderr().is_terminal(),
            };
            match leanstream_synth::tune::tune(&opts) {
                Ok(o) => {
                    let ran = o.steps.iter().filter(|s| s.1).count();
                    eprintln!(
                        "{} steps ran, {} were already done; report: {}",
                        ran,
                        o.steps.len() - ran,
                        o.report.display()
                    );
                }
                Err(e @ leanstream_synth::SynthError::Interrupted(_)) => {
                    eprintln!("{e}");
                    std::process::exit(130);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Cmd::Eval {
            acts,
            predictor,
            sparsities,
            max_tokens,
            ppl_chunks,
            ctx,
            shape_7b,
            placement,
        } => {
            let trace = Trace::open(&acts)?;
            let reads = match &placement {
                Some(path) => {
                    let learned = leanstream_runtime::flash::pack::load_placement(path)?;
                    let mut all = Vec::new();
                    for &s in &sparsities {
                        all.push(serde_json::json!({
                            "sparsity": s,
                            "reads": leanstream_synth::placement::compare(&trace, &learned, s, false)?,
                        }));
                    }
                    Some(all)
                }
                None => None,
            };
            let predictors = predictor
                .iter()
                .map(|p| Ok((p.clone(), Predictor::load(p)?)))
                .collect::<Result<Vec<_>>>()?;
            let report = evaluate(
                &trace,
                &predictors,
                &EvalOptions {
                    sparsities,
                    max_tokens,
                    ppl_chunks,
                    ctx,
                    shape_7b,
                },
            )?;
            let mut v = serde_json::to_value(&report)?;
            v["placement"] = serde_json::json!({
                "file": placement.map(|p| p.display().to_string()),
                "heldout": reads,
            });
            out(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
        }
        Cmd::Predictor {
            acts,
            out: path,
            baseline,
            sparsity,
            group,
            dim,
            tau,
            keys,
            stages,
            epochs,
            lr,
            seed,
            max_tokens,
            quiet,
            soft_epochs,
        } => {
            let trace = Trace::open(&acts)?;
            let opts = TrainOptions {
                soft_epochs,
                sparsity,
                group,
                d: dim,
                tau,
                keys,
                stages,
                epochs,
                lr,
                seed,
                max_tokens,
                progress: !quiet,
                ..TrainOptions::default()
            };
            let t0 = Instant::now();
            let trained = train_predictors(&trace, &opts)?;
            let secs = t0.elapsed().as_secs_f64();
            trained.hashing.save(&path)?;
            eprintln!(
                "wrote {} ({} bytes of weights)",
                path.display(),
                trained.hashing.weight_bytes()
            );
            if let Some(b) = &baseline {
                trained.low_rank.save(b)?;
                eprintln!(
                    "wrote {} (rank {}, {} bytes of weights)",
                    b.display(),
                    trained.low_rank.config.rank,
                    trained.low_rank.weight_bytes()
                );
            }
            let mean = |f: &dyn Fn(&LayerLoss) -> f32| {
                trained.losses.iter().map(f).sum::<f32>() / trained.losses.len().max(1) as f32
            };
            out(&format!(
                "{}\n",
                serde_json::json!({
                    "train_seconds": secs,
                    "hashing_loss_before": mean(&|l| l.hashing_before),
                    "hashing_loss_after": mean(&|l| l.hashing_after),
                    "low_rank_loss_last_epoch": mean(&|l| *l.low_rank_epochs.last().unwrap_or(&f32::NAN)),
                    "layers": trained.losses,
                })
            ))?;
        }
        Cmd::Controller {
            traces,
            out,
            engine,
            model,
            quiet,
        } => {
            let mut cfg = model.config()?;
            let t0 = Instant::now();
            let fitted = engine.fit(&traces, &mut cfg)?;
            let t_fit = t0.elapsed().as_secs_f64();
            let table = synthesize(&cfg, &fitted, !quiet)?;
            let t_all = t0.elapsed().as_secs_f64();
            table.save(&out)?;
            let size = std::fs::metadata(&out)
                .with_context(|| out.display().to_string())?
                .len();
            eprintln!(
                "wrote {}: {} bytes, {} states, {} actions; fit {:.1}s, synthesis total {:.1}s ({} threads)",
                out.display(),
                size,
                table.n_states(),
                table.codebook.len(),
                t_fit,
                t_all,
                rayon::current_num_threads()
            );
        }
        Cmd::Inspect { file, svg } => {
            let (t, n) = load(&file)?;
            out(&describe(&t, n))?;
            let svg = svg.unwrap_or_else(|| file.with_extension("svg"));
            std::fs::write(&svg, heatmap_svg(&t)?).with_context(|| format!("writing {}", svg.display()))?;
            out(&format!("heatmaps: {}\n", svg.display()))?;
        }
        Cmd::Simulate {
            table,
            traces,
            engine,
            model,
            tokens,
            fixed,
            no_mpc,
            truth,
            json,
        } => {
            let (t, _) = load(&table)?;
            let mut cfg = model.config()?;
            let fitted = engine.fit(&traces, &mut cfg)?;
            let sim = SimConfig {
                tokens,
                seed: cfg.seed,
                truth: match truth {
                    TruthArg::Fit => Half::Fit,
                    TruthArg::HeldOut => Half::HeldOut,
                },
            };
            let mut rows = compare(&t, &cfg, &fitted, &sim, !no_mpc)?;
            for spec in &fixed {
                let action = leanstream_runtime::engine::controller::Controller::parse_fixed(spec)?.codebook()[0];
                let Some(i) = t.codebook.iter().position(|a| *a == action) else {
                    bail!("--fixed {spec}: not an action of the table's codebook");
                };
                rows.push(simulate_policy(
                    &format!("fixed ({})", t.codebook[i]),
                    &Policy::Fixed(i),
                    &cfg,
                    &fitted,
                    &sim,
                )?);
            }
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&rows)?))?;
            } else {
                let mut s = format!(
                    "{:<60} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12} {:>10}\n",
                    "policy", "mean_cost", "layer_us", "p99_us", "skipped", "late", "wasted_B", "decide_us"
                );
                for r in &rows {
                    s += &format!(
                        "{:<60} {:>10.1} {:>10.1} {:>10.1} {:>8.4} {:>8.4} {:>12.0} {:>10.2}\n",
                        r.policy,
                        r.mean_cost,
                        r.mean_layer_us,
                        r.p99_layer_us,
                        r.skipped_mass,
                        r.late_fraction,
                        r.wasted_bytes,
                        r.decide_us
                    );
                }
                out(&s)?;
            }
        }
        Cmd::Eviction {
            acts,
            out: path,
            sparsity,
            budget,
            window,
            max_tokens,
            eval_tokens,
            json,
        } => {
            use leanstream_synth::eviction::{self, EvictionOptions};

            let trace = leanstream_profiler::activations::read::Trace::open(&acts)?;
            let opts = EvictionOptions {
                sparsity,
                max_tokens,
                progress: true,
                ..EvictionOptions::default()
            };
            let t0 = Instant::now();
            let trained = eviction::learn(&trace, &opts)?;
            trained.table.save(&path)?;
            eprintln!(
                "wrote {} ({} training tokens) in {:.1}s; replaying held-out text ...",
                path.display(),
                trained.tokens,
                t0.elapsed().as_secs_f64()
            );
            let rows = eviction::table4(&trace, &trained, "heldout", sparsity, budget, window, eval_tokens)?;
            if json {
                let v = serde_json::json!({
                    "retention": path.display().to_string(),
                    "split": "heldout",
                    "sparsity": sparsity,
                    "budget_share": budget,
                    "rows": rows,
                });
                out(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
            } else {
                let lru = rows.first().map_or(1.0, |r| r.miss_ratio);
                let mut t = format!(
                    "held-out miss ratio, cache {:.0}% of neurons, sparsity {sparsity}\n| policy | lookups | miss ratio | vs LRU |\n|---|---|---|---|\n",
                    budget * 100.0
                );
                for r in &rows {
                    t += &format!(
                        "| {} | {} | {:.4} | {:.2}x |\n",
                        r.policy,
                        r.lookups,
                        r.miss_ratio,
                        r.miss_ratio / lru.max(1e-12)
                    );
                }
                out(&t)?;
            }
        }
        Cmd::Placement {
            acts,
            out: path,
            sparsity,
            dim,
            epochs,
            seed,
            no_refine,
            json,
        } => {
            use leanstream_synth::placement::{self, PlacementOptions};

            let trace = leanstream_profiler::activations::read::Trace::open(&acts)?;
            let opts = PlacementOptions {
                sparsity,
                dim,
                epochs,
                seed,
                refine: !no_refine,
                progress: true,
                ..PlacementOptions::default()
            };
            let t0 = Instant::now();
            let p = placement::learn(&trace, &opts)?;
            p.save(&path)?;
            let first: f32 = p.stats.iter().map(|s| s.loss[0]).sum::<f32>() / p.stats.len().max(1) as f32;
            let last: f32 = p.stats.iter().filter_map(|s| s.loss.last()).sum::<f32>() / p.stats.len().max(1) as f32;
            let cost = |f: fn(&placement::LayerStats) -> u64| p.stats.iter().map(f).sum::<u64>();
            eprintln!(
                "wrote {} in {:.1}s ({} threads); mean loss {first:.4} -> {last:.4}; adjacent co-activation distance: frequency {}, chain {}, final {}",
                path.display(),
                t0.elapsed().as_secs_f64(),
                rayon::current_num_threads(),
                cost(|s| s.frequency_cost),
                cost(|s| s.chain_cost),
                cost(|s| s.final_cost),
            );
            let rows = placement::compare(&trace, &p.layers, sparsity, true)?;
            if json {
                let v = serde_json::json!({"placement": path.display().to_string(), "split": "heldout", "sparsity": sparsity, "reads": rows});
                out(&format!("{}\n", serde_json::to_string_pretty(&v)?))?;
            } else {
                let mut s = format!(
                    "held-out split, sparsity {sparsity}, per token (all layers)\n{:<10} {:>8} {:>12} {:>14} {:>14} {:>8}\n",
                    "order", "gap", "reads", "bytes_read", "bytes_needed", "amplif"
                );
                for r in &rows {
                    s += &format!(
                        "{:<10} {:>8} {:>12.1} {:>14.0} {:>14.0} {:>8.3}\n",
                        r.order,
                        r.merge_gap_bytes,
                        r.reads_per_token,
                        r.bytes_read_per_token,
                        r.bytes_needed_per_token,
                        r.read_amplification
                    );
                }
                out(&s)?;
            }
        }
        Cmd::Bench { file, lookups } => {
            let (t, _) = load(&file)?;
            // Pre-generated states spread over (and beyond) the grid.
            let mut states = Vec::with_capacity(1024);
            let mut z = 0x1234_5678_u64;
            let mut u = || {
                z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (z >> 11) as f64 / (1u64 << 53) as f64
            };
            // Each axis spans from half its first center to 1.5x its last.
            let span = |k: AxisKind, u: f64| {
                t.axes.iter().find(|a| a.kind == k).map_or(u, |a| {
                    let c = &a.centers;
                    c[0] * 0.5 + u * (c[c.len() - 1] * 1.5 - c[0] * 0.5)
                })
            };
            for _ in 0..1024 {
                states.push(ControlState {
                    queued_bytes: span(AxisKind::QueuedBytes, u()),
                    missing_bytes: span(AxisKind::MissingBytes, u()),
                    read_bw_bytes_s: span(AxisKind::ReadBandwidth, u()),
                    compute_ns_per_neuron: span(AxisKind::ComputeNsPerNeuron, u()),
                    layer_position: u(),
                });
            }
            let mut acc = 0u64;
            let t0 = Instant::now();
            for i in 0..lookups {
                let a = t.lookup(std::hint::black_box(&states[i & 1023]));
                acc = acc.wrapping_add(a.queue_depth as u64);
            }
            let ns = t0.elapsed().as_nanos() as f64 / lookups as f64;
            std::hint::black_box(acc);
            out(&format!(
                "{}\n",
                serde_json::json!({"file": file.display().to_string(), "lookups": lookups, "ns_per_lookup": ns})
            ))?;
        }
    }
    Ok(())
}
