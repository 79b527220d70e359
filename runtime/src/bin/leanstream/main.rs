//! `leanstream`: run, tokenize, evaluate and benchmark GGUF models.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use leanstream_runtime::cache::{fmt_bytes, FfnBudget};
use leanstream_runtime::engine::{
    is_lsflash, ActiveTrace, CachePolicy, EngineOptions, FlashEngine, FlashModel, Policy, DEFAULT_MERGE_GAP,
};
use leanstream_runtime::fetch::{self, resolve_model};
use leanstream_runtime::flash;
use leanstream_runtime::generate::{generate_with, ChatTemplate, Sampler, SamplerConfig};
use leanstream_runtime::model::{FfnStep, Model, RunState};
use leanstream_runtime::perplexity::perplexity_with_hook;
use leanstream_runtime::sparsity::{calibrate, Calibration, FfnHook};
use leanstream_runtime::synthetic;
use leanstream_runtime::tokenizer::StreamDecoder;

mod bench;
mod plot;

#[derive(Parser)]
#[command(
    name = "leanstream",
    version,
    about = "Run LLMs larger than memory by streaming FFN weights from flash"
)]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a continuation of a prompt; only the new text goes to stdout.
    Run {
        /// GGUF path, or a known model name (smollm2, gemma3) fetched on first use.
        #[arg(long)]
        model: String,
        #[arg(long)]
        prompt: String,
        /// Tokens to generate.
        #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
        n: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.8)]
        temp: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        /// Wrap the prompt in the model's chat template as a user turn.
        #[arg(long)]
        chat: bool,
        /// Context size (default: prompt plus n, within the model's limit).
        #[arg(long)]
        ctx: Option<usize>,
        #[command(flatten)]
        flash: FlashArgs,
    },
    /// Print the token ids of TEXT as a JSON array (BOS added when the model asks for it).
    Tokenize {
        #[arg(long)]
        model: String,
        text: String,
    },
    /// Perplexity of a text file, computed as llama-perplexity does; prints JSON.
    Perplexity {
        #[arg(long)]
        model: String,
        #[arg(long)]
        file: PathBuf,
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Evaluate at most this many chunks.
        #[arg(long)]
        chunks: Option<usize>,
        /// Calibration file (from `leanstream calibrate`): skip FFN neurons below its thresholds.
        #[arg(long, requires = "sparsity")]
        thresholds: Option<PathBuf>,
        /// Which calibrated sparsity level of --thresholds to apply.
        #[arg(long, requires = "thresholds")]
        sparsity: Option<f32>,
    },
    /// Calibrate per-layer activation-sparsity thresholds on real text; writes JSON.
    Calibrate {
        #[arg(long)]
        model: String,
        /// Calibration text (keep it apart from evaluation text).
        #[arg(long)]
        file: PathBuf,
        /// Target fractions of neurons to skip, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "0.5,0.7,0.8")]
        sparsity: Vec<f32>,
        #[arg(long, default_value_t = 256)]
        ctx: usize,
        #[arg(short = 'o', long)]
        output: PathBuf,
    },
    /// Measure prompt and decode speed; with --llama-bench, llama.cpp's too, in the same run.
    Bench(bench::BenchArgs),
    /// Pack a GGUF model into an .lsflash file (FFN neuron bundles for flash streaming).
    Pack {
        /// GGUF path, or a known model name (smollm2, gemma3) fetched on first use.
        #[arg(long)]
        model: String,
        /// Output .lsflash path.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
        /// Type of the stored down columns: q8_0 or f16.
        #[arg(long, default_value = "q8_0")]
        down: leanstream_runtime::flash::DownType,
        /// Neuron placement, JSON {"layers": [[neuron ids...], ...]} (default: identity).
        #[arg(long)]
        placement: Option<PathBuf>,
        /// Calibrate sparsity thresholds on this real text and store them in the header.
        #[arg(long, conflicts_with = "calibration")]
        calibrate: Option<PathBuf>,
        /// Sparsity levels to calibrate with --calibrate.
        #[arg(long, value_delimiter = ',', default_value = "0.5,0.7,0.8")]
        sparsities: Vec<f32>,
        /// Context of the calibration windows.
        #[arg(long, default_value_t = 256)]
        calib_ctx: usize,
        /// Store the thresholds of a calibration file (from `leanstream calibrate`).
        #[arg(long)]
        calibration: Option<PathBuf>,
        /// Order each layer's bundles by calibrated score, highest first, so the
        /// hot set and most active neurons sit in one contiguous range.
        #[arg(long, conflicts_with = "placement")]
        hot_first: bool,
    },
    /// Write a GGUF of a published model's shape with seeded random weights (streamed to disk).
    Synthetic {
        /// mistral-7b, llama2-7b or qwen2.5-7b
        #[arg(long)]
        shape: String,
        /// Type of the 2-D weights: q4_0, q8_0 or f16.
        #[arg(long, default_value = "q4_0")]
        quant: String,
        /// Output .gguf path (written as PATH.tmp, then renamed).
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Override the layer count (for quick tests).
        #[arg(long)]
        layers: Option<usize>,
    },
    /// Download a known model into the cache and print its path.
    Fetch {
        /// smollm2 or gemma3
        name: String,
    },
}

/// How a `.lsflash` model streams its FFN.
#[derive(clap::Args, Clone, Default)]
pub(crate) struct FlashArgs {
    /// FFN policy of a .lsflash model: dense, dense-stream, oracle or gate-first.
    #[arg(long)]
    pub(crate) policy: Option<Policy>,
    /// Neuron cache budget: bytes (512MiB) or a share of the FFN (25%). Default 25%.
    #[arg(long, conflicts_with = "mem_budget")]
    pub(crate) ffn_budget: Option<String>,
    /// Total memory for the whole process (bytes, e.g. 300MiB): the neuron
    /// cache gets what the resident weights, run state and I/O buffers leave.
    #[arg(long)]
    pub(crate) mem_budget: Option<String>,
    /// Fraction of FFN neurons to skip: a level calibrated at pack time (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) sparsity: f32,
    /// Neuron cache eviction: lru, hot (calibrated hot set) or window[:K].
    /// Default: hot when the file has calibrated scores, else lru.
    #[arg(long)]
    pub(crate) cache_policy: Option<CachePolicy>,
    /// Unneeded bytes one read may span between two needed bundles (bytes,
    /// e.g. 64KiB): larger trades bandwidth for fewer requests.
    #[arg(long)]
    pub(crate) merge_gap: Option<String>,
}

impl FlashArgs {
    fn is_set(&self) -> bool {
        self.policy.is_some()
            || self.ffn_budget.is_some()
            || self.mem_budget.is_some()
            || self.sparsity != 0.0
            || self.cache_policy.is_some()
            || self.merge_gap.is_some()
    }

    pub(crate) fn policy(&self) -> Policy {
        self.policy.unwrap_or(Policy::Dense)
    }

    /// Bytes of the neuron cache for `policy` on `fm` with run state `st`
    /// (and, for the oracle, a trace of `trace_bytes`).
    pub(crate) fn cache_bytes(&self, fm: &FlashModel, policy: Policy, st: &RunState, trace_bytes: u64) -> Result<u64> {
        let Some(mem) = &self.mem_budget else {
            let b = self.ffn_budget.as_deref().unwrap_or("25%");
            let budget = FfnBudget::parse(b).map_err(|e| anyhow::anyhow!("--ffn-budget: {e}"))?;
            return Ok(budget.resolve(fm.ffn_bytes()));
        };
        let total = match FfnBudget::parse(mem).map_err(|e| anyhow::anyhow!("--mem-budget: {e}"))? {
            FfnBudget::Bytes(b) => b,
            FfnBudget::Percent(_) => bail!("--mem-budget takes bytes (e.g. 300MiB), not a percentage"),
        };
        let weights = fm.flash.resident_range().1 + fm.model.tokenizer.heap_bytes();
        let state = st.bytes() as u64;
        let engine = fm.engine_overhead_bytes(policy, st.max_batch) + trace_bytes;
        let fixed = weights + state + engine;
        if fixed > total {
            bail!(
                "--mem-budget {}: the resident parts alone need {} (weights and tokenizer {}, run state {}, {policy} buffers {}); \
                 nothing would be left for the neuron cache",
                fmt_bytes(total),
                fmt_bytes(fixed),
                fmt_bytes(weights),
                fmt_bytes(state),
                fmt_bytes(engine)
            );
        }
        Ok(total - fixed)
    }

    /// The engine for `fm` under these settings; `record` keeps the kept
    /// sets for an oracle replay.
    pub(crate) fn engine(
        &self,
        fm: &FlashModel,
        policy: Policy,
        st: &RunState,
        trace: Option<ActiveTrace>,
        record: bool,
    ) -> Result<FlashEngine> {
        let trace_bytes = trace.as_ref().map_or(0, |t| t.bytes());
        let has_scores = !fm.flash.header().neuron_scores.is_empty();
        let merge_gap_bytes = match self.merge_gap.as_deref().map(FfnBudget::parse) {
            None => DEFAULT_MERGE_GAP,
            Some(Ok(FfnBudget::Bytes(b))) => b as usize,
            Some(Ok(FfnBudget::Percent(_))) => bail!("--merge-gap takes bytes (e.g. 64KiB)"),
            Some(Err(e)) => bail!("--merge-gap: {e}"),
        };
        Ok(fm.engine_with(EngineOptions {
            policy,
            cache_bytes: self.cache_bytes(fm, policy, st, trace_bytes)?,
            cache_policy: self
                .cache_policy
                .unwrap_or(if has_scores { CachePolicy::Hot } else { CachePolicy::Lru }),
            merge_gap_bytes,
            level: fm.sparsity_level(self.sparsity)?,
            record,
            trace,
        })?)
    }
}

/// A GGUF model, or a `.lsflash` model with its FFN engine.
pub(crate) enum Loaded {
    Gguf(Box<Model>),
    /// The engine is `None` only while an oracle's replaces its recorder.
    Flash(Box<FlashModel>, Option<Box<FlashEngine>>),
}

impl Loaded {
    /// Opens the model at `path`, its run state from `state`, and (for a
    /// `.lsflash` model) the FFN engine sized for that state. An oracle
    /// engine starts without a trace: see [`Loaded::record_oracle`].
    pub(crate) fn open(
        path: &Path,
        flash: &FlashArgs,
        state: impl FnOnce(&Model) -> Result<RunState>,
    ) -> Result<(Self, RunState)> {
        if !path.exists() {
            bail!(
                "{}: no such model file (known model names: smollm2, gemma3)",
                path.display()
            );
        }
        if is_lsflash(path) {
            let fm = FlashModel::open(path)?;
            let st = state(&fm.model)?;
            // The oracle's engine is made once its trace is recorded; until
            // then a dense-stream engine of the same budget stands in.
            let policy = match flash.policy() {
                Policy::Oracle => Policy::DenseStream,
                p => p,
            };
            let engine = flash.engine(&fm, policy, &st, None, flash.policy() == Policy::Oracle)?;
            return Ok((Self::Flash(Box::new(fm), Some(Box::new(engine))), st));
        }
        if flash.is_set() {
            bail!(
                "--policy, --ffn-budget, --mem-budget and --sparsity apply to .lsflash models; {} is not one",
                path.display()
            );
        }
        let m = Model::load(path)?;
        let st = state(&m)?;
        Ok((Self::Gguf(Box::new(m)), st))
    }

    /// For `--policy oracle`: runs `job` once with the recording engine,
    /// then swaps in the oracle engine replaying what it recorded. `job`
    /// must do exactly what the measured run will do. Other policies: nothing.
    pub(crate) fn record_oracle(
        &mut self,
        flash: &FlashArgs,
        st: &mut RunState,
        job: impl FnOnce(&mut Self, &mut RunState) -> Result<()>,
    ) -> Result<()> {
        if flash.policy() != Policy::Oracle || !matches!(self, Self::Flash(..)) {
            return Ok(());
        }
        job(self, st)?;
        let Self::Flash(fm, engine) = self else {
            unreachable!("checked above")
        };
        let trace = engine
            .take()
            .and_then(|mut e| e.take_trace())
            .context("the recording engine kept no trace")?;
        // The recorder (and its cache) is gone before the oracle's is allocated.
        *engine = Some(Box::new(flash.engine(fm, Policy::Oracle, st, Some(trace), false)?));
        Ok(())
    }

    /// The flash model and its engine, for reports.
    pub(crate) fn flash(&self) -> Option<(&FlashModel, &FlashEngine)> {
        match self {
            Self::Flash(fm, Some(e)) => Some((fm, e)),
            _ => None,
        }
    }

    pub(crate) fn model(&self) -> &Model {
        match self {
            Self::Gguf(m) => m,
            Self::Flash(fm, _) => &fm.model,
        }
    }

    /// The model and, for a `.lsflash` model, its FFN step.
    pub(crate) fn parts(&mut self) -> (&Model, Option<&mut dyn FfnStep>) {
        match self {
            Self::Gguf(m) => (m, None),
            Self::Flash(fm, e) => (&fm.model, e.as_deref_mut().map(|e| e as &mut dyn FfnStep)),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Everything runs inside the pool: a caller outside it would hand each
    // matrix product over and sleep, which costs more than the product itself
    // at decode sizes.
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = cli.threads {
        pool = pool.num_threads(n);
    }
    let result = match pool.build() {
        Ok(pool) => pool.install(|| real_main(cli)),
        Err(e) => Err(anyhow::anyhow!("setting up the thread pool: {e}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Run {
            model,
            prompt,
            n,
            temp,
            seed,
            top_k,
            top_p,
            chat,
            ctx,
            flash,
        } => {
            let sampler = SamplerConfig {
                temperature: temp,
                top_k,
                top_p,
                seed,
            };
            run(&model, &prompt, n, sampler, chat, ctx, &flash)
        }
        Cmd::Tokenize { model, text } => {
            let model = load(&model)?;
            let ids = model.tokenizer.encode(&text, true, true);
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
        Cmd::Perplexity {
            model,
            file,
            ctx,
            chunks,
            thresholds,
            sparsity,
        } => {
            let model = load(&model)?;
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let hook = match (&thresholds, sparsity) {
                (Some(path), Some(s)) => {
                    let cal = Calibration::load(path)?;
                    let level = cal
                        .level(s)
                        .with_context(|| format!("{}: no thresholds for sparsity {s}", path.display()))?;
                    if level.per_layer.len() != model.config.n_layer {
                        bail!(
                            "{}: {} layers of thresholds for a {}-layer model",
                            path.display(),
                            level.per_layer.len(),
                            model.config.n_layer
                        );
                    }
                    FfnHook::sparsify(level.per_layer.clone())
                }
                _ => FfnHook::None,
            };
            let (p, hook) = perplexity_with_hook(&model, &text, ctx, chunks, true, hook)?;
            let mut report = serde_json::to_value(&p)?;
            if let Some(skipped) = hook.skipped_fraction() {
                report["sparsity_target"] = serde_json::json!(sparsity);
                report["skipped_fraction"] = serde_json::json!(skipped);
            }
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Calibrate {
            model: model_arg,
            file,
            sparsity,
            ctx,
            output,
        } => {
            let model = load(&model_arg)?;
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let c = calibrate(&model, &text, ctx, &sparsity)?;
            let tokens = c.tokens;
            let cal = Calibration {
                model: model.gguf.path().display().to_string(),
                text: file.display().to_string(),
                tokens,
                levels: c.levels,
                neuron_scores: c.neuron_scores,
            };
            std::fs::write(&output, serde_json::to_string_pretty(&cal)?)
                .with_context(|| format!("writing {}", output.display()))?;
            eprintln!(
                "calibrated {} sparsity levels on {tokens} tokens -> {}",
                cal.levels.len(),
                output.display()
            );
            Ok(())
        }
        Cmd::Bench(args) => bench::run(args),
        Cmd::Pack {
            model,
            out,
            down,
            placement,
            calibrate,
            sparsities,
            calib_ctx,
            calibration,
            hot_first,
        } => {
            let thresholds = ThresholdSource {
                text: calibrate,
                sparsities,
                ctx: calib_ctx,
                file: calibration,
            };
            pack(&model, &out, down, placement.as_deref(), &thresholds, hot_first)
        }
        Cmd::Synthetic {
            shape,
            quant,
            out,
            seed,
            layers,
        } => {
            let mut spec = synthetic::SyntheticSpec::shape(&shape)?;
            spec.weight_type = synthetic::parse_weight_type(&quant)?;
            spec.seed = seed;
            if let Some(n) = layers {
                spec.n_layer = n;
            }
            let r = spec.write_file(&out, std::io::stderr().is_terminal())?;
            eprintln!(
                "wrote {}: {} tensors, {:.1} MiB in {:.1} s",
                r.path.display(),
                r.tensors,
                r.bytes as f64 / (1 << 20) as f64,
                r.seconds
            );
            Ok(())
        }
        Cmd::Fetch { name } => {
            let m = fetch::known_model(&name).with_context(|| {
                let names: Vec<_> = fetch::KNOWN_MODELS.iter().map(|m| m.name).collect();
                format!("unknown model '{name}' (known: {})", names.join(", "))
            })?;
            let path = fetch::fetch(m)?;
            println!("{}", path.display());
            Ok(())
        }
    }
}

/// Where `pack` gets sparsity thresholds from.
struct ThresholdSource {
    text: Option<PathBuf>,
    sparsities: Vec<f32>,
    ctx: usize,
    file: Option<PathBuf>,
}

impl ThresholdSource {
    /// Sparsity levels and neuron scores to store (both empty without a source).
    fn levels(&self, gguf: &Path) -> Result<(Vec<flash::SparsityLevel>, Vec<Vec<f32>>)> {
        let (thresholds, scores) = match (&self.text, &self.file) {
            (Some(text_path), _) => {
                let model = load_path(gguf)?;
                let text =
                    std::fs::read_to_string(text_path).with_context(|| format!("reading {}", text_path.display()))?;
                let t = Instant::now();
                let c = calibrate(&model, &text, self.ctx, &self.sparsities)?;
                eprintln!(
                    "calibrated {} sparsity levels on {} tokens of {} in {:.1} s",
                    c.levels.len(),
                    c.tokens,
                    text_path.display(),
                    t.elapsed().as_secs_f64()
                );
                (c.levels, c.neuron_scores)
            }
            (None, Some(file)) => {
                let cal = Calibration::load(file)?;
                (cal.levels, cal.neuron_scores)
            }
            (None, None) => return Ok((Vec::new(), Vec::new())),
        };
        let n_layer =
            leanstream_runtime::model::Config::from_gguf(&leanstream_runtime::gguf::GgufFile::open(gguf)?)?.n_layer;
        let levels = thresholds
            .iter()
            .map(|t| Ok(flash::SparsityLevel::from_thresholds(t, n_layer)?))
            .collect::<Result<_>>()?;
        Ok((levels, scores))
    }
}

fn pack(
    model: &str,
    out: &Path,
    down: flash::DownType,
    placement: Option<&Path>,
    thresholds: &ThresholdSource,
    hot_first: bool,
) -> Result<()> {
    let path = resolve_model(model)?;
    let mut placement = placement.map(flash::pack::load_placement).transpose()?;
    let (sparsity, neuron_scores) = thresholds.levels(&path)?;
    if hot_first {
        if neuron_scores.is_empty() {
            bail!("--hot-first orders neurons by calibrated score: pass --calibrate TEXT or a --calibration file with scores");
        }
        placement = Some(flash::pack::order_by_score(&neuron_scores));
    }
    let opts = flash::PackOptions {
        down,
        placement,
        sparsity,
        neuron_scores,
        progress: std::io::stderr().is_terminal(),
    };
    let r = flash::pack(&path, out, &opts)?;
    eprintln!(
        "packed {} -> {}: {:.1} MiB ({:.1} MiB resident, {:.1} MiB bundles) in {:.1} s",
        path.display(),
        r.path.display(),
        r.file_len as f64 / (1 << 20) as f64,
        r.resident_len as f64 / (1 << 20) as f64,
        r.bundle_len as f64 / (1 << 20) as f64,
        r.seconds
    );
    Ok(())
}

pub(crate) fn load(arg: &str) -> Result<Model> {
    let path = resolve_model(arg)?;
    load_path(&path)
}

fn load_path(path: &Path) -> Result<Model> {
    if !path.exists() {
        bail!(
            "{}: no such model file (known model names: smollm2, gemma3)",
            path.display()
        );
    }
    Ok(Model::load(path)?)
}

fn run(
    model_arg: &str,
    prompt: &str,
    n: usize,
    sampler_cfg: SamplerConfig,
    chat: bool,
    ctx: Option<usize>,
    flash: &FlashArgs,
) -> Result<()> {
    let t0 = Instant::now();
    let prompt_ids = |model: &Model| -> Result<Vec<u32>> {
        let text = if chat {
            let template = model.gguf.get_str("tokenizer.chat_template")?;
            let t = ChatTemplate::detect(template, model.config.arch)
                .context("the model's chat template is not one LeanStream recognises")?;
            t.format_user(prompt)
        } else {
            prompt.to_string()
        };
        Ok(model.tokenizer.encode(&text, true, chat))
    };
    let path = resolve_model(model_arg)?;
    let (mut loaded, mut st) = Loaded::open(&path, flash, |model| {
        let ids = prompt_ids(model)?;
        let ctx = ctx.unwrap_or(ids.len() + n + 1).min(model.config.context_length);
        Ok(model.new_state(ctx, 512, 1))
    })?;
    let ids = prompt_ids(loaded.model())?;
    // The oracle replays a first, silent run of the same generation.
    loaded.record_oracle(flash, &mut st, |loaded, st| {
        let (model, ffn) = loaded.parts();
        let mut sampler = Sampler::new(sampler_cfg, model.config.n_vocab);
        generate_with(model, st, &ids, n, &mut sampler, ffn, |_| Ok(()))?;
        Ok(())
    })?;
    let load_time = t0.elapsed();
    let (model, ffn) = loaded.parts();
    let mut sampler = Sampler::new(sampler_cfg, model.config.n_vocab);
    let mut decoder = StreamDecoder::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let stats = generate_with(model, &mut st, &ids, n, &mut sampler, ffn, |tok| {
        let piece = decoder.push(&model.tokenizer, tok);
        out.write_all(piece.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| leanstream_runtime::RuntimeError::Invalid(format!("writing to stdout: {e}")))
    })?;
    out.write_all(decoder.finish().as_bytes())?;
    out.flush()?;
    eprintln!(
        "\nload {:.2} s | prompt {} tokens, {:.1} tok/s | decode {} tokens, {:.1} tok/s | peak RSS {:.1} MiB",
        load_time.as_secs_f64(),
        stats.prompt_tokens,
        stats.prompt_tok_s(),
        stats.generated_tokens,
        stats.decode_tok_s(),
        bench::peak_rss_bytes() as f64 / (1 << 20) as f64
    );
    if let Some((fm, engine)) = loaded.flash() {
        let s = engine.stats();
        let (cached, len) = flash::pagecache::cached_bytes(fm.flash.path())?;
        eprintln!(
            "{} | sparsity {} (skipped {:.1}%) | {:.1} MiB read/token | cache miss ratio {:.3} | memory: {} | {} of {} of the .lsflash file in the page cache",
            engine.policy,
            engine.sparsity(),
            100.0 * s.skipped_fraction(),
            s.bytes_read as f64 / s.tokens.max(1) as f64 / (1 << 20) as f64,
            s.cache_miss_ratio(),
            fm.memory(&st, engine),
            fmt_bytes(cached),
            fmt_bytes(len)
        );
    }
    Ok(())
}
