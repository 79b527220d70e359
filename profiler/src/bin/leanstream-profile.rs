//! `leanstream-profile`: resumable I/O and compute profiling into Parquet.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use leanstream_profiler::activations::record::{record, RecordOptions};
use leanstream_profiler::plan::{Engine, Pattern, Plan, Repetition};
use leanstream_profiler::runner::{self, Outcome};
use leanstream_profiler::shard::ShardStore;
use leanstream_profiler::sweeps::{self, ComputeGrid, IoGrid, RunSettings};
use leanstream_profiler::units::{parse_duration, parse_list, parse_size};
use leanstream_profiler::{plot, summary};

#[derive(Parser)]
#[command(
    name = "leanstream-profile",
    version,
    about = "Resumable device profiling (I/O and compute) into Parquet shards"
)]
struct Cli {
    /// Continue the killed, crashed or interrupted run in DIR (its plan.json decides what runs).
    #[arg(long, value_name = "DIR", global = true)]
    resume: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Read latency and throughput over size × queue depth × workers × pattern × engine (O_DIRECT).
    Io(IoArgs),
    /// Latency of the runtime's kernels (sparse FFN stages, K-stage split, decode at context lengths).
    Compute(ComputeArgs),
    /// Per-condition counts and quantiles of a run, as a table or JSON, and SVG plots.
    Summary(SummaryArgs),
    /// Activation traces of a model on real text (training and held-out), as .npy shards.
    Activations(ActivationsArgs),
}

/// Run the same command again to continue an interrupted recording.
#[derive(Args)]
struct ActivationsArgs {
    /// GGUF model file (or a known model name such as smollm2).
    #[arg(long)]
    model: String,
    /// Training texts (real prose).
    #[arg(long, num_args = 1.., required = true)]
    text: Vec<PathBuf>,
    /// Held-out texts, never trained on.
    #[arg(long, num_args = 1.., required = true)]
    heldout: Vec<PathBuf>,
    /// Output trace directory.
    #[arg(short, long)]
    out: PathBuf,
    /// Context window: texts are cut into windows of this many tokens.
    #[arg(long, default_value_t = 256)]
    ctx: usize,
    /// Tokens per shard (whole windows).
    #[arg(long, default_value_t = 1024)]
    shard_tokens: usize,
    /// Cap on the tokens of each split.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Fraction of each layer's neurons (by mean |activation| on the training text) whose output `partial` records.
    #[arg(long, default_value_t = 0.25)]
    hot_fraction: f32,
}

#[derive(Args, Clone)]
struct Common {
    /// Output (run) directory; must not hold a run yet.
    #[arg(long)]
    out: PathBuf,
    /// Time budget, e.g. 90s, 10m, 8h, 90h.
    #[arg(long, default_value = "10m")]
    budget: String,
    /// Fixed repetition: exactly N samples per condition (default: adaptive).
    #[arg(long)]
    reps: Option<u64>,
    /// Adaptive repetition: stop a condition when the 95% CIs of p50 and p99 are within ±this (relative).
    #[arg(long, default_value_t = 0.05)]
    precision: f64,
    #[arg(long, default_value_t = 200)]
    min_samples: u64,
    #[arg(long, default_value_t = 200_000)]
    max_samples: u64,
    /// Seed of the round order and of the offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Commit buffered samples as a shard at this interval.
    #[arg(long, default_value = "30s")]
    flush_every: String,
    /// Target length of one visit of a condition.
    #[arg(long, default_value = "250ms")]
    visit: String,
    /// Samples of a condition's first visit (and the least per visit).
    #[arg(long, default_value_t = 32)]
    min_batch: u64,
    /// Most samples per visit.
    #[arg(long, default_value_t = 8192)]
    max_batch: u64,
}

#[derive(Args)]
struct IoArgs {
    /// Directory on the device under test (the data file is created there).
    #[arg(long)]
    dir: PathBuf,
    /// Size of the data file.
    #[arg(long, default_value = "1g")]
    file_size: String,
    #[arg(long, default_value = "4k,16k,64k,128k,512k,1m,4m")]
    block_sizes: String,
    #[arg(long, default_value = "1,2,4,8,16,32,64")]
    queue_depths: String,
    #[arg(long, default_value = "1,2")]
    workers: String,
    /// sequential, random, strided, replay (replay needs --lsflash).
    #[arg(long, default_value = "sequential,random,strided")]
    patterns: String,
    /// io_uring, pread.
    #[arg(long, default_value = "io_uring,pread")]
    engines: String,
    /// A packed model whose bundle read sets the `replay` pattern reads (adds `replay` to the patterns).
    #[arg(long)]
    lsflash: Option<PathBuf>,
    /// Share of a layer's neurons in one replayed read set.
    #[arg(long, default_value_t = 0.1)]
    replay_fraction: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct ComputeArgs {
    /// A packed model (.lsflash; make one with `leanstream pack --model M.gguf -o M.lsflash`).
    #[arg(long)]
    model: PathBuf,
    /// Neuron counts of a sparse FFN stage (capped at n_ff; default: 32 … n_ff).
    #[arg(long)]
    neurons: Option<String>,
    /// Stage counts K of the layer split.
    #[arg(long, default_value = "1,2,4,8,16")]
    stages: String,
    /// Neurons of the split layer (default: half the layer).
    #[arg(long)]
    split_neurons: Option<u32>,
    /// Context lengths of the decode step.
    #[arg(long, default_value = "64,256,1024")]
    ctx: String,
    /// Thread counts (default: 1 and all cores).
    #[arg(long)]
    threads: Option<String>,
    /// Concurrent background I/O: off, on or both.
    #[arg(long, default_value = "both")]
    background_io: String,
    /// File for the background reads (default: the model file).
    #[arg(long)]
    io_file: Option<PathBuf>,
    /// Layer whose bundles the FFN kernels use.
    #[arg(long, default_value_t = 0)]
    layer: usize,
    /// Kernel backend: `cpu`, or `cuda` / `cuda:N` (the GPU backend's
    /// streaming FFN kernels and device engine; needs a packed model with
    /// Q8_0 or F16 down columns).
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct SummaryArgs {
    /// The run directory.
    dir: PathBuf,
    /// An array of per-condition objects instead of a table.
    #[arg(long)]
    json: bool,
    /// Where to write the SVG plots (default: DIR/plots).
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Do not write plots.
    #[arg(long)]
    no_plots: bool,
}

fn u32_list(s: &str) -> Result<Vec<u32>> {
    Ok(parse_list(s, |p| {
        p.parse::<u32>()
            .map_err(|_| leanstream_profiler::ProfileError::Invalid(format!("{p:?} is not a count")))
    })?)
}

impl Common {
    fn settings(&self) -> Result<RunSettings> {
        let repetition = match self.reps {
            Some(reps) => Repetition::Fixed { reps },
            None => Repetition::Adaptive {
                precision: self.precision,
                min_samples: self.min_samples,
                max_samples: self.max_samples,
            },
        };
        Ok(RunSettings {
            budget_s: parse_duration(&self.budget)?.as_secs_f64(),
            repetition,
            seed: self.seed,
            flush_every_s: parse_duration(&self.flush_every)?.as_secs_f64(),
            visit_s: parse_duration(&self.visit)?.as_secs_f64(),
            min_batch: self.min_batch,
            max_batch: self.max_batch,
        })
    }
}

fn io_plan(a: &IoArgs) -> Result<Plan> {
    let patterns = parse_list(&a.patterns, |p| match p {
        "sequential" | "seq" => Ok(Pattern::Sequential),
        "random" | "rand" => Ok(Pattern::Random),
        "strided" => Ok(Pattern::Strided),
        "replay" => Ok(Pattern::Replay),
        _ => Err(leanstream_profiler::ProfileError::Invalid(format!(
            "unknown pattern {p:?}"
        ))),
    })?;
    let engines = parse_list(&a.engines, |p| match p {
        "io_uring" | "uring" => Ok(Engine::IoUring),
        "pread" => Ok(Engine::Pread),
        _ => Err(leanstream_profiler::ProfileError::Invalid(format!(
            "unknown engine {p:?}"
        ))),
    })?;
    let grid = IoGrid {
        dir: a.dir.clone(),
        file_size: parse_size(&a.file_size)?,
        block_sizes: parse_list(&a.block_sizes, parse_size)?,
        queue_depths: u32_list(&a.queue_depths)?,
        workers: u32_list(&a.workers)?,
        patterns,
        engines,
        lsflash: a.lsflash.clone(),
        replay_fraction: a.replay_fraction,
    };
    eprintln!("preparing {} of data in {} ...", a.file_size, a.dir.display());
    Ok(sweeps::io_plan(&grid, &a.common.settings()?)?)
}

fn compute_plan(a: &ComputeArgs) -> Result<Plan> {
    let device = a
        .device
        .parse::<leanstream_kernels::Device>()
        .map_err(|e| anyhow::anyhow!("--device {e}"))?
        .cuda_ordinal();
    leanstream_runtime::flash::format::LsFlash::open(&a.model)
        .with_context(|| format!("{}: compute needs a packed .lsflash model", a.model.display()))?;
    let background_io = match a.background_io.as_str() {
        "off" => vec![false],
        "on" => vec![true],
        "both" => vec![false, true],
        o => bail!("--background-io {o:?}: expected off, on or both"),
    };
    let grid = ComputeGrid {
        model: a.model.clone(),
        neurons: a.neurons.as_deref().map(u32_list).transpose()?,
        stages: u32_list(&a.stages)?,
        split_neurons: a.split_neurons,
        ctx: u32_list(&a.ctx)?,
        threads: a.threads.as_deref().map(u32_list).transpose()?,
        background_io,
        io_file: a.io_file.clone(),
        layer: a.layer,
        device,
    };
    Ok(sweeps::compute_plan(&grid, &a.common.settings()?)?)
}

fn start(plan: Plan, out: &Path, quiet: bool) -> Result<ExitCode> {
    eprintln!(
        "{} conditions, budget {:.0}s, {:?}; run directory {}",
        plan.conditions.len(),
        plan.budget_s,
        plan.repetition,
        out.display()
    );
    finish(sweeps::start(&plan, out, !quiet)?, out)
}

fn resume(dir: &Path, quiet: bool) -> Result<ExitCode> {
    let outcome = sweeps::resume(dir, !quiet, |r| {
        for p in &r.quarantined {
            eprintln!("warning: {p} (moved to quarantine/)");
        }
        eprintln!(
            "resuming {} (session {}): {} committed samples in {} shards, {:.0}s of {:.0}s budget spent",
            dir.display(),
            r.session,
            r.committed_samples,
            r.shards,
            r.spent_s,
            r.budget_s
        );
    })?;
    finish(outcome, dir)
}

fn finish(outcome: Outcome, dir: &Path) -> Result<ExitCode> {
    let store = ShardStore::open(dir)?;
    let rows: u64 = store.manifest.shards.iter().map(|s| s.rows).sum();
    match outcome {
        Outcome::Interrupted => {
            eprintln!(
                "interrupted: {rows} samples committed in {}; continue with `leanstream-profile --resume {}`",
                dir.display(),
                dir.display()
            );
            Ok(ExitCode::from(130))
        }
        Outcome::Finished(f) => {
            eprintln!("done ({f:?}): {rows} samples in {}", dir.display());
            eprintln!("summary: leanstream-profile summary {}", dir.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn summarize(a: &SummaryArgs) -> Result<ExitCode> {
    let loaded = summary::load(&a.dir)?;
    for p in &loaded.problems {
        eprintln!("warning: skipped shard {p}");
    }
    let rows = summary::summarize(&loaded.frame, &loaded.plan.conditions)?;
    let text = if a.json {
        serde_json::to_string_pretty(&rows)? + "\n"
    } else {
        summary::table(&rows)
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()) {
        // `| head` closing the pipe is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(ExitCode::SUCCESS),
        r => r.context("writing the summary")?,
    }
    if !a.no_plots {
        let dir = a.plots.clone().unwrap_or_else(|| a.dir.join("plots"));
        for p in plot::write_plots(&loaded.frame, &rows, &dir)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    run(Cli::parse()).unwrap_or_else(|e| {
        eprintln!("error: {}", leanstream_runtime::error_chain(e.as_ref()));
        ExitCode::FAILURE
    })
}

fn run(cli: Cli) -> Result<ExitCode> {
    runner::install_signal_handlers();
    if let Some(dir) = &cli.resume {
        if cli.cmd.is_some() {
            bail!("--resume DIR continues the plan stored in DIR; give no subcommand");
        }
        return resume(dir, cli.quiet);
    }
    match &cli.cmd {
        Some(Cmd::Io(a)) => {
            let plan = io_plan(a)?;
            start(plan, &a.common.out, cli.quiet)
        }
        Some(Cmd::Compute(a)) => {
            let plan = compute_plan(a)?;
            start(plan, &a.common.out, cli.quiet)
        }
        Some(Cmd::Summary(a)) => summarize(a),
        Some(Cmd::Activations(a)) => {
            let m = record(&RecordOptions {
                model: leanstream_runtime::fetch::resolve_model(&a.model)?,
                train: a.text.clone(),
                heldout: a.heldout.clone(),
                out: a.out.clone(),
                ctx: a.ctx,
                shard_tokens: a.shard_tokens,
                max_tokens: a.max_tokens,
                hot_fraction: a.hot_fraction,
                progress: !cli.quiet,
            })?;
            for s in &m.splits {
                eprintln!(
                    "{}: {} tokens in {} shards",
                    s.name,
                    s.recorded_tokens(),
                    s.shards.len()
                );
            }
            eprintln!("wrote {}", a.out.display());
            Ok(ExitCode::SUCCESS)
        }
        None => bail!("give a subcommand (io, compute, summary, activations) or --resume DIR"),
    }
}
