//! `leanstream`: run, tokenize, evaluate, pack, benchmark, serve and chat.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use leanstream_runtime::cache::{fmt_bytes, FfnBudget};
use leanstream_runtime::engine::{CachePolicy, Policy};
use leanstream_runtime::fetch::{self, resolve_model};
use leanstream_runtime::flash;
use leanstream_runtime::generate::chat::render_located;
use leanstream_runtime::generate::draft::{self, DraftKind, DraftLen, Drafting};
use leanstream_runtime::generate::{ChatMessage, ChatTemplate, CpuDecoder, Sampler, SamplerConfig};
use leanstream_runtime::model::{DenseFfn, FlashAttn, LayerHook, Model};
use leanstream_runtime::perplexity::perplexity_in_batches;
use leanstream_runtime::session::{Session, StreamSettings};
use leanstream_runtime::sparsity::{calibrate_run, Calibration, CalibrationRun, Sparsifier};
use leanstream_runtime::synthetic;
use leanstream_runtime::tokenizer::StreamDecoder;
use leanstream_server::terminal::ChatOptions;
use leanstream_server::{Engine, EngineOptions, ServeOptions};

mod bench;
mod bench_draft;
mod gpu;

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
        #[arg(long, default_value_t = 0.8, value_parser = temperature)]
        temp: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0.95, value_parser = probability)]
        top_p: f32,
        /// Wrap the prompt in the model's chat template as a user turn.
        #[arg(long)]
        chat: bool,
        /// Context size (default: prompt plus n, within the model's limit).
        #[arg(long)]
        ctx: Option<usize>,
        /// Never sample an end-of-generation token: run all N tokens
        /// (llama.cpp's --ignore-eos), e.g. for a long soak.
        #[arg(long)]
        ignore_eos: bool,
        /// Every N generated tokens, print a JSON line {"token", "rss_bytes"}
        /// on stderr (the resident set then), to watch memory over a long run.
        #[arg(long, value_name = "N")]
        rss_every: Option<usize>,
        /// Where the model runs: cpu, or cuda[:N] (the dense engine of a
        /// GGUF model on CUDA device N; an error naming why where there is none).
        #[arg(long, default_value = "cpu")]
        device: String,
        #[command(flatten)]
        flash: FlashArgs,
        #[command(flatten)]
        draft: DraftArgs,
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
        /// Attention path: auto (flash attention on a CPU, llama.cpp's default), on or off.
        #[arg(long, default_value = "auto")]
        flash_attn: FlashAttn,
        /// Tokens per forward pass: 512 as llama-perplexity runs; 1 scores
        /// the text as generation decodes it (other kernels and attention
        /// routes, so other rounding).
        #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=512))]
        batch: u64,
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
        /// Run at most this many tokens of the text (calibration costs a dense prefill of them).
        #[arg(long)]
        max_tokens: Option<usize>,
        #[arg(short = 'o', long)]
        output: PathBuf,
    },
    /// Measure prompt and decode speed; with --llama-bench, llama.cpp's too, in the same run.
    Bench(bench::BenchArgs),
    /// Drafting against plain decoding on real text or chat questions, in
    /// one run: identical tokens, acceptance, tokens per pass, speed ratio
    /// and bytes read per token; prints JSON.
    BenchDraft(bench_draft::BenchDraftArgs),
    /// Pack a GGUF model into an .lsflash file (FFN neuron bundles for flash streaming).
    Pack {
        /// GGUF path, or a known model name (smollm2, gemma3) fetched on first use.
        #[arg(long)]
        model: String,
        /// Output .lsflash path.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
        /// How the down matrices are stored: source (the model's own blocks,
        /// exact, fewest bytes, read 32 or 256 neurons at a time), q8_0 or f16
        /// (per-neuron columns: sparse policies read neuron by neuron).
        /// Default: source, or q8_0 with sparsity thresholds (--calibrate,
        /// --calibration), which are for sparse policies.
        #[arg(long)]
        down: Option<leanstream_runtime::flash::DownType>,
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
        /// Calibrate on at most this many tokens of the text (the cost is a
        /// dense prefill of them: ~4 minutes for 2k tokens at 7B on 2 cores).
        #[arg(long, default_value_t = 4096)]
        calib_tokens: usize,
        /// Store the thresholds of a calibration file (from `leanstream calibrate`).
        #[arg(long)]
        calibration: Option<PathBuf>,
        /// Order each layer's bundles by calibrated score, highest first, so the
        /// hot set and most active neurons sit in one contiguous range: the
        /// default whenever the file gets scores (--calibrate, --calibration)
        /// and no --placement is given. With a --placement, by default the hot
        /// set of half the FFN goes first and the rest keeps its order.
        #[arg(long, conflicts_with_all = ["placement", "keep_order"])]
        hot_first: bool,
        /// Store the --placement (or identity) order as given even when the file
        /// gets scores: the static hot cache's neurons then sit scattered in
        /// each layer, and reads merged over them read them again.
        #[arg(long)]
        keep_order: bool,
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
    /// The flash I/O engine's read throughput at one request size and queue depth (JSON).
    BenchIo {
        /// Any file (an .lsflash file, a GGUF).
        #[arg(long)]
        file: PathBuf,
        /// Bytes per request (a multiple of 4 KiB).
        #[arg(long, default_value = "4KiB")]
        bs: String,
        /// Requests outstanding at once.
        #[arg(long, default_value_t = 32)]
        depth: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Read front to back instead of at random aligned offsets.
        #[arg(long)]
        sequential: bool,
        /// auto, uring or pread.
        #[arg(long, default_value = "auto")]
        backend: leanstream_runtime::flash::io::BackendKind,
    },
    /// The cost of handing a 7B-shape layer's FFN from I/O to compute in K
    /// stages: ready flags against a barrier per stage (the paper's Table 3,
    /// CPU twin; JSON).
    BenchStages {
        /// Stage counts K.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
        stages: Vec<usize>,
        /// Repetitions per K (after one warm-up; medians reported).
        #[arg(long, default_value_t = 9)]
        reps: usize,
    },
    /// Serve the model over an OpenAI-compatible HTTP API:
    /// /v1/chat/completions and /v1/completions (streamed as server-sent
    /// events with "stream": true), /v1/models, /health and /metrics.
    Serve {
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// 0 picks a free port; the address is printed on stderr.
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Require "Authorization: Bearer KEY" on /v1 (not on /health, /metrics).
        #[arg(long)]
        api_key: Option<String>,
        /// Requests that may wait while one generates; more are refused with 503.
        #[arg(long, default_value_t = 32)]
        queue: usize,
        /// Requests that generate together on the CPU, sharing each forward
        /// pass and each flash read (continuous batching); each has its own
        /// KV cache of --ctx tokens, counted in --mem-budget. Default 4, or
        /// under --mem-budget as many (1 to 4) as a quarter of it holds the
        /// caches of; 1 with --draft or a CUDA device.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
        parallel: Option<u64>,
        /// Requests generating together share the batched matrix kernels:
        /// faster where compute binds (everything in memory), but a
        /// request's greedy text may then differ from its text served alone
        /// in the last bits (by default each row gets the bits it would get
        /// alone).
        #[arg(long)]
        batched_kernels: bool,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Chat with the model in the terminal: one message per line, /reset
    /// starts over, /quit or end of input ends.
    Chat {
        /// Tokens per reply at most (default: until the model ends its turn).
        #[arg(short = 'n', long = "n-predict")]
        n: Option<usize>,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.8, value_parser = temperature)]
        temp: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        #[arg(long, default_value_t = 0.95, value_parser = probability)]
        top_p: f32,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Download a known model into the cache and print its path.
    Fetch {
        /// smollm2 or gemma3
        name: String,
    },
}

/// What `serve` and `chat` open: the model with its context, prompt cache
/// and streaming settings.
#[derive(clap::Args)]
struct EngineArgs {
    /// GGUF or .lsflash path, or a known model name (smollm2, gemma3).
    #[arg(long)]
    model: String,
    /// Tokens of a request's prompt and completion, or of a chat's whole
    /// conversation (default 2048, at most the model's).
    #[arg(long)]
    ctx: Option<usize>,
    /// Run every prompt whole, instead of reusing the KV cache of the
    /// prefix it shares with earlier requests' tokens (which makes greedy
    /// text equal `run`'s bit for bit).
    #[arg(long)]
    no_prompt_cache: bool,
    /// MiB of earlier prompts' keys and values kept to start later requests
    /// that begin the same way (default 16; 0 with --mem-budget, which it
    /// would exceed).
    #[arg(long)]
    prompt_cache_mib: Option<usize>,
    /// Where the model runs: cpu, or cuda[:N] (the dense engine of a GGUF
    /// model on CUDA device N, without prompt reuse; an error naming why
    /// where there is none).
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    flash: FlashArgs,
    #[command(flatten)]
    draft: DraftArgs,
}

impl EngineArgs {
    /// Opens the engine with room for `queue` waiting requests and
    /// `parallel` generating together.
    fn start(&self, queue: usize, parallel: Option<usize>, batched_kernels: bool) -> Result<Engine> {
        let model = resolve_model(&self.model)?;
        let device = gpu::ordinal(&self.device)?;
        if device.is_some() {
            gpu::check_device_options(&model, &self.flash)?;
        }
        Ok(Engine::start(EngineOptions {
            model,
            settings: self.flash.settings()?,
            ctx: self.ctx,
            queue,
            threads: rayon::current_num_threads().into(),
            device,
            prompt_cache: !self.no_prompt_cache,
            prompt_cache_bytes: self.prompt_cache_mib.map(|mib| mib << 20),
            draft: self.draft.draft.clone(),
            draft_len: self.draft.draft_len,
            parallel,
            batched_kernels,
        })?)
    }
}

/// Drafting: several tokens checked per forward pass.
#[derive(clap::Args, Clone)]
pub(crate) struct DraftArgs {
    /// What guesses the next tokens, checked several per pass (each bundle
    /// read once for all): none, lookup (n-grams of the context), or
    /// model:PATH (a small model with the same vocabulary). Greedy output
    /// is the same token for token; sampled output has the same distribution.
    #[arg(long, default_value = "none")]
    pub(crate) draft: DraftKind,
    /// Tokens drafted per pass: N (at most 15), or auto[:MAX] (default MAX 6), chosen from
    /// the acceptance and pass times measured as it runs (none where
    /// drafting does not pay).
    #[arg(long, default_value = "auto")]
    pub(crate) draft_len: DraftLen,
}

/// How a `.lsflash` model streams its FFN, and any model's attention path.
#[derive(clap::Args, Clone, Default)]
pub(crate) struct FlashArgs {
    /// Attention path, as llama.cpp's --flash-attn: auto (llama.cpp's
    /// default, flash attention on a CPU), on or off. Each matches
    /// llama.cpp's output for the same setting bit for bit.
    #[arg(long, default_value = "auto")]
    pub(crate) flash_attn: FlashAttn,
    /// FFN policy of a .lsflash model: dense, dense-stream, oracle,
    /// gate-first, speculate, or the prior systems dejavu, llm-in-a-flash,
    /// powerinfer2. Default: speculate where a predictor is named or sits
    /// beside the model (a tune's output), else dense.
    #[arg(long)]
    pub(crate) policy: Option<Policy>,
    /// The predictor (.lspred) of the predicting policies. Default: <model
    /// stem>.lspred or predictor.lspred beside the model (dejavu and
    /// llm-in-a-flash: <model stem>.lowrank.lspred first).
    #[arg(long)]
    pub(crate) predictor: Option<PathBuf>,
    /// speculate: a controller table (.lstab) or one action for every layer,
    /// fixed:K=4,b=1.5,d=8,q=16 (d=inf: no deadline). Default: <model
    /// stem>.lstab or controller.lstab beside the model, else the built-in table.
    #[arg(long)]
    pub(crate) controller: Option<String>,
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
    /// Neuron cache eviction: lru, hot (a static set: the calibrated hot
    /// set, or each layer's leading bundles in a file without scores),
    /// learned (retention table) or window[:K]. Default: llm-in-a-flash
    /// window:5, dejavu lru, otherwise hot.
    #[arg(long)]
    pub(crate) cache_policy: Option<CachePolicy>,
    /// The learned cache policy's retention table (.lsevict); naming one
    /// selects that policy. Default: <model stem>.lsevict or
    /// eviction.lsevict beside the model.
    #[arg(long)]
    pub(crate) eviction: Option<PathBuf>,
    /// Unneeded bytes one read may span between two needed bundles (bytes,
    /// e.g. 64KiB): larger trades bandwidth for fewer requests.
    #[arg(long)]
    pub(crate) merge_gap: Option<String>,
    /// I/O staging (bytes, e.g. 8MiB): the read buffers that hold reads in
    /// flight and landed bundles not yet computed, the only staging the
    /// flash path has. Default: about four layers (the stages streamed at once), 2 to 16 MiB.
    #[arg(long)]
    pub(crate) staging: Option<String>,
    /// dejavu, llm-in-a-flash, powerinfer2: read each row's top B × need
    /// predicted neurons, need the share the sparsity level keeps. Default
    /// 1, a predictor sized to the level as the originals size theirs,
    /// which misses part of the active set; wider reads more and misses less.
    #[arg(long)]
    pub(crate) prior_breadth: Option<f32>,
}

impl FlashArgs {
    /// The settings these flags name (sizes parsed, errors naming the flag).
    pub(crate) fn settings(&self) -> Result<StreamSettings> {
        let bytes = |flag: &str, v: &Option<String>| -> Result<Option<u64>> {
            match v.as_deref().map(FfnBudget::parse) {
                None => Ok(None),
                Some(Ok(FfnBudget::Bytes(b))) => Ok(Some(b)),
                Some(Ok(FfnBudget::Percent(_))) => bail!("{flag} takes bytes (e.g. 300MiB), not a percentage"),
                Some(Err(e)) => bail!("{flag}: {e}"),
            }
        };
        let ffn_budget = match self.ffn_budget.as_deref().map(FfnBudget::parse) {
            None => None,
            Some(Ok(b)) => Some(b),
            Some(Err(e)) => bail!("--ffn-budget: {e}"),
        };
        Ok(StreamSettings {
            policy: self.policy,
            ffn_budget,
            mem_budget: bytes("--mem-budget", &self.mem_budget)?,
            sparsity: self.sparsity,
            cache_policy: self.cache_policy,
            eviction: self.eviction.clone(),
            merge_gap: bytes("--merge-gap", &self.merge_gap)?.map(|b| b as usize),
            staging: bytes("--staging", &self.staging)?,
            predictor: self.predictor.clone(),
            controller: self.controller.clone(),
            flash_attn: self.flash_attn,
            prior_breadth: self.prior_breadth,
        })
    }
}

/// `--temp`: a finite number, at least 0 (0 is greedy). NaN would pass
/// every comparison the sampler makes and sample garbage.
fn temperature(s: &str) -> Result<f32, String> {
    bounded_f32(s, 0.0, f32::MAX)
}

/// `--top-p`: a probability, 0 to 1.
fn probability(s: &str) -> Result<f32, String> {
    bounded_f32(s, 0.0, 1.0)
}

fn bounded_f32(s: &str, lo: f32, hi: f32) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("{e}"))?;
    if !(lo..=hi).contains(&v) {
        let hi = if hi == f32::MAX {
            String::new()
        } else {
            format!(" and at most {hi}")
        };
        return Err(format!("{v} is not a number of at least {lo}{hi}"));
    }
    Ok(v)
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
            eprintln!("error: {}", leanstream_runtime::error_chain(e.as_ref()));
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
            ignore_eos,
            rss_every,
            device,
            flash,
            draft,
        } => {
            let sampler = SamplerConfig {
                temperature: temp,
                top_k,
                top_p,
                seed,
            };
            let gen = Generation {
                n,
                sampler,
                ignore_eos,
                rss_every,
            };
            match gpu::ordinal(&device)? {
                Some(_) if draft.draft != DraftKind::None => {
                    bail!("--draft runs on the CPU engine; the CUDA engine verifies one token a pass")
                }
                Some(ordinal) => gpu::run(&model, &prompt, &gen, chat, ctx, ordinal, &flash),
                None => run(&model, &prompt, &gen, chat, ctx, &flash, &draft),
            }
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
            flash_attn,
            batch,
        } => {
            let batch = batch as usize;
            let mut model = load(&model)?;
            model.flash_attn = flash_attn;
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let mut sparsifier = None;
            if let (Some(path), Some(s)) = (&thresholds, sparsity) {
                let cal = Calibration::load(path)?;
                let level = cal
                    .level(s)
                    .with_context(|| format!("{}: no thresholds for sparsity {s}", path.display()))?;
                if level.full.len() != model.config.n_layer {
                    bail!(
                        "{}: {} layers of thresholds for a {}-layer model",
                        path.display(),
                        level.full.len(),
                        model.config.n_layer
                    );
                }
                sparsifier = Some(Sparsifier::new(level.full.clone()));
            }
            let hook: &mut dyn LayerHook = match &mut sparsifier {
                Some(s) => s,
                None => &mut DenseFfn,
            };
            let p = perplexity_in_batches(&model, &text, ctx, chunks, true, hook, batch)?;
            let mut report = serde_json::to_value(&p)?;
            report["batch"] = serde_json::json!(batch);
            if let Some(skipped) = sparsifier.as_ref().and_then(|s| s.skipped_fraction()) {
                // The cost is what thresholds are measured for: the same
                // text dense, paired chunk by chunk.
                let dense = perplexity_in_batches(&model, &text, ctx, chunks, true, &mut DenseFfn, batch)?;
                let r = p.ratio_to(&dense);
                report["sparsity_target"] = serde_json::json!(sparsity);
                report["skipped_fraction"] = serde_json::json!(skipped);
                report["ppl_dense"] = serde_json::json!(dense.ppl);
                report["ppl_ratio"] = serde_json::json!(r.ratio);
                report["ppl_ratio_stderr"] = serde_json::json!(r.stderr);
                report["top1_agreement"] = serde_json::json!(p.top1_agreement(&dense));
            }
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Calibrate {
            model: model_arg,
            file,
            sparsity,
            ctx,
            max_tokens,
            output,
        } => {
            let model = load(&model_arg)?;
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let run = CalibrationRun {
                ctx,
                max_tokens,
                progress: std::io::stderr().is_terminal(),
            };
            let c = calibrate_run(&model, &text, run, &sparsity)?;
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
        Cmd::BenchDraft(args) => bench_draft::run(args),
        Cmd::Pack {
            model,
            out,
            down,
            placement,
            calibrate,
            sparsities,
            calib_ctx,
            calib_tokens,
            calibration,
            hot_first,
            keep_order,
        } => {
            let thresholds = ThresholdSource {
                text: calibrate,
                sparsities,
                run: CalibrationRun {
                    ctx: calib_ctx,
                    max_tokens: Some(calib_tokens),
                    progress: std::io::stderr().is_terminal(),
                },
                file: calibration,
            };
            let order = PackOrder { hot_first, keep_order };
            pack(&model, &out, down, placement.as_deref(), &thresholds, order)
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
        Cmd::BenchIo {
            file,
            bs,
            depth,
            seconds,
            sequential,
            backend,
        } => {
            let request_bytes = leanstream_runtime::cache::parse_bytes(&bs).with_context(|| format!("--bs {bs}"))?;
            let b = leanstream_runtime::flash::io::ReadBench {
                request_bytes: request_bytes as usize,
                depth,
                duration: std::time::Duration::try_from_secs_f64(seconds)
                    .map_err(|_| anyhow::anyhow!("--seconds {seconds}: not a duration"))?,
                sequential,
                backend,
                seed: 1,
            };
            let r = leanstream_runtime::flash::io::read_benchmark(&file, &b)?;
            println!("{}", serde_json::to_string_pretty(&r)?);
            Ok(())
        }
        Cmd::BenchStages { stages, reps } => {
            use leanstream_runtime::engine::handoff::{measure, HandoffShape};
            let rows = measure(HandoffShape::MISTRAL_7B, &stages, reps)?;
            let rows: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "stages": r.stages,
                        "flags_us": r.flags_us,
                        "barrier_us": r.barrier_us,
                        "land_only_us": r.land_only_us,
                        "compute_only_us": r.compute_only_us,
                        "flags_overhead_us": r.flags_overhead_us(),
                        "barrier_overhead_us": r.barrier_overhead_us(),
                    })
                })
                .collect();
            let report = serde_json::json!({
                "layer": "Mistral-7B shape: 4096 x 14336, Q4_0 gate/up rows, Q8_0 down columns",
                "threads": rayon::current_num_threads(),
                "reps": reps,
                "rows": rows,
            });
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Cmd::Serve {
            host,
            port,
            api_key,
            queue,
            parallel,
            batched_kernels,
            engine,
        } => {
            let engine = engine.start(queue, parallel.map(|n| n as usize), batched_kernels)?;
            leanstream_server::serve(engine, ServeOptions { host, port, api_key })?;
            Ok(())
        }
        Cmd::Chat {
            n,
            temp,
            seed,
            top_k,
            top_p,
            engine,
        } => {
            let engine = engine.start(1, Some(1), false)?;
            let opts = ChatOptions {
                sampling: SamplerConfig {
                    temperature: temp,
                    top_k,
                    top_p,
                    seed,
                },
                max_tokens: n,
                interactive: std::io::stdin().is_terminal(),
            };
            leanstream_server::terminal::chat(&engine, std::io::stdin().lock(), std::io::stdout().lock(), &opts)?;
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
    run: CalibrationRun,
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
                let c = calibrate_run(&model, &text, self.run, &self.sparsities)?;
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
            .map(|t| Ok(t.for_layers(n_layer)?))
            .collect::<Result<_>>()?;
        Ok((levels, scores))
    }
}

/// `pack`'s ordering flags.
#[derive(Debug, Clone, Copy)]
struct PackOrder {
    hot_first: bool,
    keep_order: bool,
}

fn pack(
    model: &str,
    out: &Path,
    down: Option<flash::DownType>,
    placement: Option<&Path>,
    thresholds: &ThresholdSource,
    order: PackOrder,
) -> Result<()> {
    let path = resolve_model(model)?;
    let placement = placement.map(flash::pack::load_placement).transpose()?;
    let (sparsity, neuron_scores) = thresholds.levels(&path)?;
    let down = down.unwrap_or(if sparsity.is_empty() {
        flash::DownType::Source
    } else {
        flash::DownType::Q8_0
    });
    if order.hot_first && neuron_scores.is_empty() {
        bail!(
            "--hot-first orders neurons by calibrated score: pass --calibrate TEXT or a --calibration file with scores"
        );
    }
    // The static hot cache (the default) holds the best-scored neurons: kept
    // in one piece at the front of each layer, reads skip them instead of
    // merging over them.
    let placement = if order.keep_order || neuron_scores.is_empty() {
        placement
    } else {
        let groups = flash::pack::neuron_groups(&path, down)?;
        match placement {
            None => Some(flash::pack::order_groups_by_score(&neuron_scores, &groups)),
            Some(p) if groups.iter().all(|&g| g == 1) => Some(flash::pack::hot_prefix(
                &p,
                &neuron_scores,
                flash::pack::HOT_PREFIX_AT_LEAST,
            )?),
            // Down tiles: the placement's groups stay as given.
            Some(p) => Some(p),
        }
    };
    let opts = flash::PackOptions {
        down,
        placement,
        sparsity,
        neuron_scores,
        progress: std::io::stderr().is_terminal(),
    };
    let r = flash::pack(&path, out, &opts)?;
    eprintln!(
        "packed {} -> {} (down: {down}): {:.1} MiB ({:.1} MiB resident, {:.1} MiB bundles) in {:.1} s",
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
    model_exists(path)?;
    Ok(Model::load(path)?)
}

/// An error naming the known models when `path` does not exist.
fn model_exists(path: &Path) -> Result<()> {
    if !path.exists() {
        bail!(
            "{}: no such model file (known model names: smollm2, gemma3)",
            path.display()
        );
    }
    Ok(())
}

/// The prompt's tokens, wrapped in the model's chat template as a user
/// turn when `chat` (control tokens written in the prompt stay text either
/// way, as in `serve`).
pub(crate) fn prompt_ids(model: &Model, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    if !chat {
        return Ok(model.tokenizer.encode(prompt, true, false));
    }
    let template = model.gguf.get_str("tokenizer.chat_template")?;
    let t = ChatTemplate::detect(template, model.config.arch)
        .context("the model's chat template is not one LeanStream recognises")?;
    let turn = [ChatMessage::new("user", prompt)];
    let (text, content) = render_located(&turn, |m| Ok::<_, std::convert::Infallible>(t.format(m)))?;
    Ok(model.tokenizer.encode_chat(&text, &content))
}

/// What `run` generates after the prompt.
struct Generation {
    n: usize,
    sampler: SamplerConfig,
    ignore_eos: bool,
    rss_every: Option<usize>,
}

impl Generation {
    fn sampler(&self, model: &Model) -> Sampler {
        let s = Sampler::new(self.sampler, model.config.n_vocab);
        match self.ignore_eos {
            true => s.banning(model.tokenizer.end_of_generation_ids()),
            false => s,
        }
    }
}

fn run(
    model_arg: &str,
    prompt: &str,
    gen: &Generation,
    chat: bool,
    ctx: Option<usize>,
    flash: &FlashArgs,
    drafting: &DraftArgs,
) -> Result<()> {
    let n = gen.n;
    let t0 = Instant::now();
    let prompt_ids = |model: &Model| prompt_ids(model, prompt, chat);
    let path = resolve_model(model_arg)?;
    let settings = flash.settings()?;
    let rows = Drafting::rows(&drafting.draft, drafting.draft_len);
    let (mut loaded, mut st) = Session::open(&path, &settings, |model| {
        let ids = prompt_ids(model).map_err(|e| leanstream_runtime::RuntimeError::Invalid(format!("{e:#}")))?;
        let ctx = ctx.unwrap_or(ids.len() + n + 1).min(model.config.context_length);
        // Batches as large as the prompt (up to 512): a longer one is split
        // there anyway, and a shorter prompt needs no room for one.
        Ok(model.new_state(ctx, ids.len().clamp(rows, 512), 1))
    })?;
    let ids = prompt_ids(loaded.model())?;
    let n_vocab = loaded.model().config.n_vocab;
    let ctx_tokens = st.ctx;
    let open_draft = || Drafting::new(&drafting.draft, drafting.draft_len, ctx_tokens, n_vocab);
    // The oracle replays a first, silent run of the same generation.
    loaded.record_oracle(&settings, &mut st, |loaded, st| -> Result<()> {
        let (model, hook) = loaded.parts()?;
        let mut sampler = gen.sampler(model);
        let mut dec = CpuDecoder { model, st, hook };
        let mut d = open_draft()?;
        draft::decode(&mut dec, &model.tokenizer, &ids, 0, n, &mut sampler, &mut d, |_| {
            Ok(ControlFlow::Continue(()))
        })?;
        Ok(())
    })?;
    let mut d = open_draft()?;
    let load_time = t0.elapsed();
    let (model, hook) = loaded.parts()?;
    let mut sampler = gen.sampler(model);
    let mut decoder = StreamDecoder::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut generated = 0usize;
    let mut dec = CpuDecoder {
        model,
        st: &mut st,
        hook,
    };
    let stats = draft::decode(&mut dec, &model.tokenizer, &ids, 0, n, &mut sampler, &mut d, |tok| {
        generated += 1;
        if gen.rss_every.is_some_and(|k| k > 0 && generated.is_multiple_of(k)) {
            let rss = leanstream_runtime::cache::rss_bytes();
            eprintln!("{}", serde_json::json!({"token": generated, "rss_bytes": rss}));
        }
        let piece = decoder.push(&model.tokenizer, tok);
        out.write_all(piece.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| leanstream_runtime::RuntimeError::Invalid(format!("writing to stdout: {e}")))
            .map(|()| ControlFlow::Continue(()))
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
    if let Some(p) = d.proposer.as_ref() {
        let r = &stats.draft;
        eprintln!(
            "draft {} | {} passes for {} tokens ({:.2} a pass) | {} drafted, {:.1}% accepted",
            p.name(),
            r.passes,
            stats.generated_tokens,
            stats.generated_tokens as f64 / r.passes.max(1) as f64,
            r.drafted,
            100.0 * r.acceptance()
        );
    }
    if let Some((fm, engine)) = loaded.flash() {
        let s = engine.stats();
        let (cached, len) = flash::pagecache::cached_bytes(fm.flash.path())?;
        eprintln!(
            "{} | sparsity {} (skipped {:.1}%) | {:.1} MiB read/token | cache miss ratio {:.3} | memory: {} | {} of {} of the .lsflash file in the page cache",
            engine.policy(),
            engine.sparsity(),
            100.0 * s.skipped_fraction(),
            s.bytes_read as f64 / s.tokens.max(1) as f64 / (1 << 20) as f64,
            s.cache_miss_ratio(),
            fm.memory(&st, engine),
            fmt_bytes(cached),
            fmt_bytes(len)
        );
        if let Some(share) = engine.hot_set_scattered().filter(|&s| s > SCATTERED_NOTE) {
            eprintln!(
                "note: {:.0}% of the static hot set lies outside its layers' leading bundles in {}, so reads merge \
                 over cached bundles and read them again; re-pack it (`leanstream pack` stores calibrated files \
                 hottest first) or run `leanstream-synth tune` again",
                100.0 * share,
                fm.flash.path().display()
            );
        }
    }
    Ok(())
}

/// Above this share of the hot set outside each layer's leading bundles,
/// `run` says the file streams more than its cache leaves out.
const SCATTERED_NOTE: f64 = 0.1;
