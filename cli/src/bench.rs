//! `leanstream bench`: llama-bench-style prompt (pp) and decode (tg) speed on
//! random tokens, optionally running llama.cpp's llama-bench in the same
//! invocation so the two are compared under the same machine conditions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use leanstream_cuda::engine::GpuModel;
use leanstream_cuda::model::DeviceModel;
use leanstream_runtime::engine::{CachePolicy, EngineOptions, FlashModel, Policy, Speculation};
use leanstream_runtime::flash::{pagecache, SparsityLevel};
use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::model::{FlashAttn, Model, RunState};
use leanstream_runtime::perplexity::{perplexity_decoding, perplexity_in_batches, Perplexity};

use leanstream_plot::{LineChart, Series};
use leanstream_runtime::engine::Decisions;
use leanstream_runtime::session::{Session, StreamSettings};
use serde_json::{json, Value};

#[derive(Args)]
pub struct BenchArgs {
    #[arg(long)]
    model: String,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Repetitions of each test (after one warm-up).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON object (the default prints it too; kept for scripts).
    #[arg(long)]
    json: bool,
    /// Path of llama.cpp's llama-bench: run it on the same GGUF and report ratios.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    #[command(flatten)]
    flash: crate::FlashArgs,
    #[command(flatten)]
    quality: QualityArgs,
    /// Run every policy at every budget (each in its own process, so each
    /// peak RSS is its own) and write sweep.json and sweep.svg to --out.
    #[arg(long, requires = "out")]
    sweep: bool,
    /// FFN budgets of the sweep.
    #[arg(long, value_delimiter = ',', default_value = "10%,25%,50%,100%")]
    sweep_budgets: Vec<String>,
    /// Policies of the sweep (dense runs once: it holds the whole FFN).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dense,dense-stream,oracle,gate-first,speculate,dejavu,llm-in-a-flash,powerinfer2"
    )]
    sweep_policies: Vec<Policy>,
    /// Output folder of --sweep.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the model runs: cpu, or cuda[:N] (the dense engine of a GGUF
    /// model on CUDA device N; with --llama-bench, give it a CUDA build).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Every run and its references are scored as they decode, one token at
/// a time. A predictor's choice for a batch is a union over its rows,
/// wider than any one token's, so predicting policies must be; and
/// batched and decoded scoring differ by more than the policies do
/// (Gemma 3's packed file, one chunk of 256, dense: perplexity 12.63
/// batched, 12.83 decoded; at sparsity 0.5 `dense-stream` batched 1.121x
/// its batched reference, decoded 1.073x, the same bits as `speculate`
/// at breadth 2.5), so ratios taken in different modes compared the
/// modes, not the policies.
const DECODE: usize = 1;

/// What quality is measured on, and against what.
#[derive(Args)]
pub struct QualityArgs {
    /// Real text to measure quality against dense on (.lsflash models):
    /// perplexity and top-1 agreement at the run's sparsity and policy; on
    /// `--device cuda`, the device run's perplexity, decoded, against the
    /// CPU's dense engine of the reference GGUF (a GGUF is its own).
    #[arg(long = "quality-file")]
    file: Option<PathBuf>,
    #[arg(long = "quality-ctx", default_value_t = 256)]
    ctx: usize,
    #[arg(long = "quality-chunks", default_value_t = 4)]
    chunks: usize,
    /// The GGUF the `.lsflash` was packed from (checked by its SHA-256):
    /// quality is also reported against its dense engine, bit-exact with
    /// llama.cpp, which counts what the packed down columns cost too.
    #[arg(long = "quality-reference", requires = "file")]
    reference: Option<PathBuf>,
}

pub use leanstream_runtime::cache::peak_rss_bytes;

/// Mean and sample deviation; (0, 0) for no runs (a test not measured).
fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// The median of `ours[i] / theirs[i]` over repetitions measured side by
/// side: each pair saw the same machine load, so the median resists drift
/// and outliers that a ratio of means does not. None without full pairs.
pub(crate) fn paired_median_ratio(ours: &[f64], theirs: &[f64]) -> Option<f64> {
    if ours.is_empty() || ours.len() != theirs.len() || theirs.iter().any(|&t| t <= 0.0) {
        return None;
    }
    let mut ratios: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| o / t).collect();
    ratios.sort_by(f64::total_cmp);
    let mid = ratios.len() / 2;
    Some(if ratios.len() % 2 == 1 {
        ratios[mid]
    } else {
        (ratios[mid - 1] + ratios[mid]) / 2.0
    })
}

fn random_tokens(rng: &mut Rng, n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % n_vocab as u64) as u32).collect()
}

/// Tokens per second of processing `n` prompt tokens from an empty context.
fn prompt_speed(loaded: &mut Session, st: &mut RunState, tokens: &[u32]) -> Result<f64> {
    let (model, ffn) = loaded.parts()?;
    let t = Instant::now();
    leanstream_runtime::generate::ingest_with(model, st, tokens, 0, ffn)?;
    model.logits(st, 0, 1)?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

/// Tokens per second of decoding `n` tokens one at a time from an empty context.
fn decode_speed(loaded: &mut Session, st: &mut RunState, tokens: &[u32]) -> Result<f64> {
    let (model, ffn) = loaded.parts()?;
    let t = Instant::now();
    for (pos, &tok) in tokens.iter().enumerate() {
        model.forward_with(st, &[tok], pos, 0..1, ffn)?;
        model.logits(st, 0, 1)?;
    }
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

/// Prompt and decode token sequences of each repetition (repetition 0 warms up).
type Plan = Vec<(Vec<u32>, Vec<u32>)>;

fn make_plan(reps: usize, prompt_tokens: usize, gen_tokens: usize, n_vocab: usize) -> Plan {
    let mut rng = Rng::new(1234);
    (0..=reps)
        .map(|_| {
            let p = random_tokens(&mut rng, prompt_tokens, n_vocab);
            let g = random_tokens(&mut rng, gen_tokens, n_vocab);
            (p, g)
        })
        .collect()
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_tokens == 0 && a.gen_tokens == 0 {
        bail!("nothing to measure: --prompt-tokens and --gen-tokens are both 0");
    }
    let ordinal = crate::gpu::ordinal(&a.device)?;
    if a.sweep {
        if ordinal.is_some() {
            bail!("--sweep runs the CPU engine; it has no --device");
        }
        return sweep(&a);
    }
    let path = leanstream_runtime::fetch::resolve_model(&a.model)?;
    if let Some(ordinal) = ordinal {
        return device_bench(&a, &path, ordinal);
    }
    let t0 = Instant::now();
    let state_tokens = a.prompt_tokens.max(a.gen_tokens).max(1);
    let settings = a.flash.settings()?;
    let (mut loaded, mut st) = Session::open(&path, &settings, |m| {
        Ok(m.new_state(state_tokens, a.prompt_tokens.clamp(1, 512), 1))
    })?;
    if a.llama_bench.is_some() && matches!(loaded, Session::Flash(..)) {
        bail!("--llama-bench needs a GGUF model, not a .lsflash file");
    }
    let c = loaded.model().config.clone();
    let weights_bytes = loaded.model().weights.matrix_bytes();
    let reps = a.reps.max(1);
    let plan = make_plan(reps, a.prompt_tokens, a.gen_tokens, c.n_vocab);
    // The oracle first records the active sets of exactly this plan.
    loaded.record_oracle(&settings, &mut st, |loaded, st| -> Result<()> {
        for (p, g) in &plan {
            if !p.is_empty() {
                prompt_speed(loaded, st, p)?;
            }
            if !g.is_empty() {
                decode_speed(loaded, st, g)?;
            }
        }
        Ok(())
    })?;
    let load_s = t0.elapsed().as_secs_f64();

    let threads = rayon::current_num_threads();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut theirs_pp = Vec::new();
    let mut theirs_tg = Vec::new();
    let mut theirs_build = Value::Null;
    let t_run = Instant::now();
    for (rep, (ptoks, gtoks)) in plan.iter().enumerate() {
        // Repetition 0 warms caches and page mappings and is not counted.
        if !ptoks.is_empty() {
            let s = prompt_speed(&mut loaded, &mut st, ptoks)?;
            if rep > 0 {
                pp.push(s);
            }
        }
        if !gtoks.is_empty() {
            let s = decode_speed(&mut loaded, &mut st, gtoks)?;
            if rep > 0 {
                tg.push(s);
            }
        }
        // The baseline runs interleaved with ours, one repetition at a time, so
        // both see the same drift in machine load.
        if let (Some(bin), true) = (&a.llama_bench, rep > 0) {
            let r = llama_bench(bin, &path, a.prompt_tokens, a.gen_tokens, threads, settings.flash_attn)?;
            theirs_pp.extend(r.prompt_tok_s);
            theirs_tg.extend(r.decode_tok_s);
            theirs_build = r.build;
        }
    }
    let run_s = t_run.elapsed().as_secs_f64();
    let mut report = speed_report(&path, c.arch.name(), &a, (&pp, &tg), load_s, weights_bytes);
    report["threads"] = json!(threads);
    report["cpu_features"] = json!(leanstream_kernels::Device::cpu_features());
    report["state_bytes"] = json!(st.bytes());
    report["flash_attn"] = json!(settings.flash_attn.to_string());
    report["flash_attn_enabled"] = json!(st.flash_attn());
    if let Some((fm, engine)) = loaded.flash() {
        let s = engine.stats();
        let tokens = s.tokens.max(1) as f64;
        let mem = fm.memory(&st, engine);
        let (cached, file_len) = pagecache::cached_bytes(fm.flash.path())?;
        report["policy"] = json!(engine.policy().to_string());
        report["cache_policy"] = json!(engine.cache_policy_name());
        report["hot_set_scattered"] = json!(engine.hot_set_scattered());
        report["ffn_held_whole"] = json!(engine.whole_layers());
        report["io_direct"] = json!(engine.io_direct());
        report["bytes_requested_per_token"] = json!(s.bytes_requested as f64 / tokens);
        report["sparsity"] = json!(engine.sparsity());
        report["skipped_fraction"] = json!(s.skipped_fraction());
        report["rows_computed_per_token"] = json!(s.rows_computed as f64 / tokens);
        report["ffn_budget_bytes"] = json!(engine.ffn_budget_bytes());
        report["ffn_total_bytes"] = json!(fm.ffn_bytes());
        report["mem_budget"] = json!(a.flash.mem_budget);
        report["bytes_read_per_token"] = json!(s.bytes_read as f64 / tokens);
        report["reads_per_token"] = json!(s.reads as f64 / tokens);
        report["read_bw_bytes_s"] = json!(s.bytes_read as f64 / run_s);
        report["cache_miss_ratio"] = json!(s.cache_miss_ratio());
        report["io_mean_depth"] = json!(s.io_mean_depth);
        // Over every token row the FFN ran (prompt and decode): compute is
        // FFN time not spent blocked on reads; overlap is I/O busy time that
        // compute did not wait for.
        report["time_per_token"] = json!({
            "ffn_s": s.ffn_seconds / tokens,
            "compute_s": (s.ffn_seconds - s.io_wait_seconds).max(0.0) / tokens,
            "io_wait_s": s.io_wait_seconds / tokens,
            "io_busy_s": s.io_busy_seconds / tokens,
            "overlap_s": s.overlap_seconds() / tokens,
        });
        report["memory"] = json!({
            "resident_weights": mem.resident_weights,
            "kv_cache": mem.kv_cache,
            "ffn_cache": mem.ffn_cache,
            "io_buffers": mem.io_buffers,
            "predictor": mem.predictor,
            "tokenizer": mem.tokenizer,
            "other": mem.other,
            "total": mem.total(),
        });
        if let Some(d) = engine.decisions() {
            report["speculate"] = decisions_json(&d, s.late_skipped);
            report["speculate"]["late_skipped_per_token"] = json!(s.late_skipped as f64 / tokens);
        }
        if let Some(p) = engine.predictor_name() {
            report["predictor"] = json!(p);
        }
        if engine.policy().is_prior_system() {
            report["prior_breadth"] = json!(settings.prior_breadth.unwrap_or(Speculation::PRIOR_BREADTH));
        }
        if let Some(l) = engine.read_latencies() {
            report["read_latency"] = json!(l);
        }
        report["page_cache_bytes"] = json!(cached);
        report["file_bytes"] = json!(file_len);
    }
    // Peak RSS before the quality runs, which hold engines of their own.
    report["peak_rss_bytes"] = json!(peak_rss_bytes());
    if let (Some(file), Some((fm, engine))) = (&a.quality.file, loaded.flash()) {
        let cache_bytes = engine.ffn_budget_bytes();
        report["quality"] = quality(fm, engine.policy(), &settings, cache_bytes, file, &a.quality)?;
    } else if a.quality.file.is_some() {
        bail!("--quality-file applies to .lsflash models");
    }
    if a.llama_bench.is_some() {
        add_llama_cpp(&mut report, (&pp, &tg), (&theirs_pp, &theirs_tg), theirs_build);
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Perplexity of the device engine's run (its policy and sparsity) on
/// `file`, decoded as it generates, against the CPU's dense engine of the
/// reference GGUF (`--quality-reference`, checked against a packed model;
/// a GGUF is its own reference).
fn device_quality(loaded: &DeviceModel, g: &mut GpuModel, file: &Path, q: &QualityArgs) -> Result<Value> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let ours = perplexity_decoding(loaded.model(), &text, q.ctx, Some(q.chunks), false, g)?;
    let own;
    let reference = match (q.reference.as_deref(), loaded) {
        (Some(path), _) => {
            let fm = match loaded {
                DeviceModel::Flash(fm, _) => Some(fm),
                DeviceModel::Gguf(_) => None,
            };
            own = load_reference(path, fm, loaded.model().flash_attn)?;
            Some((path.display().to_string(), &own))
        }
        // A GGUF is its own reference, with the same attention path.
        (None, DeviceModel::Gguf(m)) => Some(("the model".to_string(), m)),
        (None, DeviceModel::Flash(..)) => None,
    };
    let reference = match reference {
        None => Value::Null,
        Some((name, model)) => {
            let p = dense_perplexity(model, &text, q)?;
            let r = ours.ratio_to(&p);
            json!({
                "file": name,
                "ppl": p.ppl,
                "ppl_ratio": r.ratio,
                "ppl_ratio_stderr": r.stderr,
                "top1_agreement": ours.top1_agreement(&p),
            })
        }
    };
    Ok(json!({
        "file": file.display().to_string(),
        "ctx": q.ctx,
        "chunks": ours.chunks,
        "tokens_scored": ours.tokens_scored,
        "ppl": ours.ppl,
        "ppl_stderr": ours.ppl_stderr,
        "reference_cpu_dense": reference,
    }))
}

/// `bench --device cuda[:N]`: the same plan of random tokens through the
/// device's dense engine (the logits copied back after each step, as a
/// sampler needs them), with llama-bench interleaved as on the CPU.
fn device_bench(a: &BenchArgs, path: &Path, ordinal: usize) -> Result<()> {
    let t0 = Instant::now();
    let loaded = crate::gpu::load(path, &a.flash)?;
    if a.llama_bench.is_some() && matches!(loaded, leanstream_cuda::model::DeviceModel::Flash(..)) {
        bail!("--llama-bench needs a GGUF model, not a .lsflash file");
    }
    let model = loaded.model();
    let c = model.config.clone();
    let quality_ctx = if a.quality.file.is_some() { a.quality.ctx } else { 0 };
    let ctx = a.prompt_tokens.max(a.gen_tokens).max(quality_ctx).max(1);
    if ctx > c.context_length {
        bail!("{ctx} tokens exceed the model's context of {}", c.context_length);
    }
    let (mut g, device) = loaded.open(ordinal, ctx, a.prompt_tokens)?;
    let load_s = t0.elapsed().as_secs_f64();
    let reps = a.reps.max(1);
    let plan = make_plan(reps, a.prompt_tokens, a.gen_tokens, c.n_vocab);
    let threads = rayon::current_num_threads();
    let (mut pp, mut tg, mut theirs_pp, mut theirs_tg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut theirs_build = Value::Null;
    for (rep, (ptoks, gtoks)) in plan.iter().enumerate() {
        // Repetition 0 compiles nothing (NVRTC ran at open) but warms the
        // device's clocks and caches; it is not counted.
        if !ptoks.is_empty() {
            let t = Instant::now();
            let mut pos = 0;
            for chunk in ptoks.chunks(g.max_batch) {
                g.forward(chunk, pos)?;
                pos += chunk.len();
            }
            g.logits()?;
            if rep > 0 {
                pp.push(ptoks.len() as f64 / t.elapsed().as_secs_f64());
            }
        }
        if !gtoks.is_empty() {
            let t = Instant::now();
            for (pos, &tok) in gtoks.iter().enumerate() {
                g.forward(&[tok], pos)?;
                g.logits()?;
            }
            if rep > 0 {
                tg.push(gtoks.len() as f64 / t.elapsed().as_secs_f64());
            }
        }
        if let (Some(bin), true) = (&a.llama_bench, rep > 0) {
            let flash_attn = a.flash.flash_attn;
            let r = llama_bench(bin, path, a.prompt_tokens, a.gen_tokens, threads, flash_attn)?;
            theirs_pp.extend(r.prompt_tok_s);
            theirs_tg.extend(r.decode_tok_s);
            theirs_build = r.build;
        }
    }
    let weights_bytes = loaded.weight_bytes();
    let mut report = speed_report(path, c.arch.name(), a, (&pp, &tg), load_s, weights_bytes);
    report["device"] = json!(device);
    if let Some(s) = g.streamed() {
        let (fed, io) = (s.fed, s.streamer().stats());
        let e = s.engine();
        report["ffn_stream"] = json!({
            "policy": e.policy().to_string(),
            "sparsity": e.sparsity(),
            "predictor": e.predictor_name(),
            "speculate": e.decisions().map(|d| decisions_json(&d, io.late_skipped)),
            "cache_policy": s.streamer().cache_policy_name(),
            "cache_budget_bytes": s.streamer().budget_bytes(),
            "device_cache_bytes": s.device_cache_bytes(),
            "bundles_in_place": fed.in_place,
            "bundles_from_cache": fed.hits,
            "bundles_read": fed.read,
            "bundles_skipped_late": fed.missing,
            "bundles_cancelled": fed.cancelled,
            "bytes_read": io.bytes_read,
            "reads": io.reads,
        });
    }
    if let Some(file) = &a.quality.file {
        report["quality"] = device_quality(&loaded, &mut g, file, &a.quality)?;
    }
    if a.llama_bench.is_some() {
        add_llama_cpp(&mut report, (&pp, &tg), (&theirs_pp, &theirs_tg), theirs_build);
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// What every bench report starts with: the model, the plan, and the
/// prompt and decode speeds (mean and deviation over the counted runs).
fn speed_report(
    path: &Path,
    arch: &str,
    a: &BenchArgs,
    (pp, tg): (&[f64], &[f64]),
    load_s: f64,
    weights_bytes: usize,
) -> Value {
    let ((pp_mean, pp_std), (tg_mean, tg_std)) = (mean_std(pp), mean_std(tg));
    json!({
        "model": path.display().to_string(),
        "arch": arch,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "reps": a.reps.max(1),
        "prompt_tok_s": pp_mean,
        "prompt_tok_s_std": pp_std,
        "decode_tok_s": tg_mean,
        "decode_tok_s_std": tg_std,
        "load_s": load_s,
        "weights_bytes": weights_bytes,
    })
}

/// llama-bench's speeds and our ratios to them (means and paired medians).
fn add_llama_cpp(report: &mut Value, ours: (&[f64], &[f64]), theirs: (&[f64], &[f64]), build: Value) {
    let ((pp, _), (tg, _)) = (mean_std(ours.0), mean_std(ours.1));
    let ((tpp, tpp_std), (ttg, ttg_std)) = (mean_std(theirs.0), mean_std(theirs.1));
    let ratio = |ours: f64, theirs: f64| (theirs > 0.0).then(|| ours / theirs);
    report["llama_cpp"] = json!({
        "prompt_tok_s": tpp,
        "prompt_tok_s_std": tpp_std,
        "decode_tok_s": ttg,
        "decode_tok_s_std": ttg_std,
        "build": build,
    });
    report["ratio_prompt"] = json!(ratio(pp, tpp));
    report["ratio_decode"] = json!(ratio(tg, ttg));
    report["ratio_prompt_paired_median"] = json!(paired_median_ratio(ours.0, theirs.0));
    report["ratio_decode_paired_median"] = json!(paired_median_ratio(ours.1, theirs.1));
}

/// Perplexity and top-1 agreement of `policy` at `sparsity` against dense,
/// through the streaming engine. The dense reference streams too (it is
/// bit-identical to `dense`, tested); the oracle's numbers are those of
/// `dense-stream` at the same thresholds, which keeps the same neurons.
/// With `reference` (the source GGUF), both are also scored against that
/// model's dense engine.
fn quality(
    fm: &FlashModel,
    policy: Policy,
    settings: &StreamSettings,
    cache_bytes: u64,
    file: &Path,
    q: &QualityArgs,
) -> Result<Value> {
    let (ctx, chunks) = (q.ctx, q.chunks);
    let sparsity = settings.sparsity;
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    // Policies that decide what to read by prediction run themselves; the
    // others keep what dense-stream keeps at the same thresholds.
    let same_as = match policy {
        p if p == Policy::GateFirst || p.predicts() => p,
        _ => Policy::DenseStream,
    };
    // The policy's run is audited: beside perplexity, the share of the true
    // active mass (what dense keeps at the policy's own state) it skipped.
    let eval = |policy: Policy, level: SparsityLevel, audit: bool| -> Result<_> {
        let speculation = settings.speculation(fm, policy)?;
        let mut e = fm.engine_with(EngineOptions {
            policy,
            cache_bytes,
            cache_policy: CachePolicy::Lru,
            merge_gap_bytes: leanstream_runtime::engine::DEFAULT_MERGE_GAP,
            staging_bytes: None,
            level,
            record: false,
            trace: None,
            speculation,
            retention: None,
        })?;
        if audit {
            fm.audit(&mut e)?;
        }
        let p = perplexity_in_batches(&fm.model, &text, ctx, Some(chunks), false, &mut e, DECODE)?;
        Ok((p, e.stats()))
    };
    let (dense, _) = eval(Policy::DenseStream, SparsityLevel::dense(fm.flash.n_layer()), false)?;
    let (ours, stats) = eval(same_as, fm.sparsity_level(sparsity)?, true)?;
    let reference = match q.reference.as_deref() {
        None => Value::Null,
        Some(path) => {
            let model = load_reference(path, Some(fm), fm.model.flash_attn)?;
            let p = dense_perplexity(&model, &text, q)?;
            let r = ours.ratio_to(&p);
            json!({
                "file": path.display().to_string(),
                "ppl": p.ppl,
                "ppl_ratio": r.ratio,
                "ppl_ratio_stderr": r.stderr,
                "top1_agreement": ours.top1_agreement(&p),
                "ppl_dense_ratio": dense.ppl / p.ppl,
                "top1_agreement_dense": dense.top1_agreement(&p),
            })
        }
    };
    let to_dense = ours.ratio_to(&dense);
    Ok(json!({
        "file": file.display().to_string(),
        "ctx": ctx,
        "chunks": ours.chunks,
        "tokens_scored": ours.tokens_scored,
        "ppl": ours.ppl,
        "ppl_stderr": ours.ppl_stderr,
        "ppl_dense": dense.ppl,
        "ppl_ratio": to_dense.ratio,
        "ppl_ratio_stderr": to_dense.stderr,
        "top1_agreement": ours.top1_agreement(&dense),
        "skipped_fraction": stats.skipped_fraction(),
        "skipped_mass": stats.skipped_mass(),
        "reference": reference,
    }))
}

/// The quality reference at `path`, a GGUF (checked to be `fm`'s source
/// where there is a packed model), on the attention path `flash_attn`.
fn load_reference(path: &Path, fm: Option<&FlashModel>, flash_attn: FlashAttn) -> Result<Model> {
    if let Some(fm) = fm {
        leanstream_runtime::artifacts::check_source_gguf(path, fm)?;
    }
    let mut model = Model::load(path).with_context(|| format!("loading the quality reference {}", path.display()))?;
    model.flash_attn = flash_attn;
    Ok(model)
}

/// The CPU's dense engine's perplexity of `model` on `text` at `q`'s
/// context and chunks, decoded as every quality run is: what quality is
/// scored against.
fn dense_perplexity(model: &Model, text: &str, q: &QualityArgs) -> Result<Perplexity> {
    Ok(perplexity_in_batches(
        model,
        text,
        q.ctx,
        Some(q.chunks),
        false,
        &mut leanstream_runtime::model::DenseFfn,
        DECODE,
    )?)
}

/// `--sweep`: each (policy, budget) in a child `leanstream bench`, then the
/// JSON of all and the plot.
fn sweep(a: &BenchArgs) -> Result<()> {
    let out = a.out.as_ref().context("--sweep needs --out")?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let exe = std::env::current_exe().context("locating the leanstream binary")?;
    let mut runs = Vec::new();
    for &policy in &a.sweep_policies {
        let budgets: Vec<&str> = if policy == Policy::Dense {
            vec!["100%"]
        } else {
            a.sweep_budgets.iter().map(String::as_str).collect()
        };
        for budget in budgets {
            let mut cmd = Command::new(&exe);
            cmd.arg("bench")
                .args(["--model", &a.model])
                .args(["--policy", &policy.to_string()])
                .args(["--ffn-budget", budget])
                .args(["--sparsity", &a.flash.sparsity.to_string()])
                .args(["--prompt-tokens", &a.prompt_tokens.to_string()])
                .args(["--gen-tokens", &a.gen_tokens.to_string()])
                .args(["--reps", &a.reps.to_string()]);
            if let Some(c) = a.flash.cache_policy {
                cmd.args(["--cache-policy", &c.to_string()]);
            }
            if let Some(p) = &a.flash.predictor {
                cmd.arg("--predictor").arg(p);
            }
            if let Some(c) = &a.flash.controller {
                cmd.args(["--controller", c]);
            }
            if let Some(e) = &a.flash.eviction {
                cmd.arg("--eviction").arg(e);
            }
            if let Some(g) = &a.flash.merge_gap {
                cmd.args(["--merge-gap", g]);
            }
            if let Some(g) = &a.flash.staging {
                cmd.args(["--staging", g]);
            }
            if let (Some(b), true) = (a.flash.prior_breadth, policy.is_prior_system()) {
                cmd.args(["--prior-breadth", &b.to_string()]);
            }
            if let Some(q) = &a.quality.file {
                cmd.arg("--quality-file").arg(q);
                cmd.args(["--quality-ctx", &a.quality.ctx.to_string()]);
                cmd.args(["--quality-chunks", &a.quality.chunks.to_string()]);
                if let Some(r) = &a.quality.reference {
                    cmd.arg("--quality-reference").arg(r);
                }
            }
            eprintln!("sweep: {policy} at {budget} ...");
            let o = cmd.output().with_context(|| format!("starting {}", exe.display()))?;
            if !o.status.success() {
                bail!(
                    "sweep run {policy} at {budget} failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
            }
            let mut r: Value = serde_json::from_slice(&o.stdout).context("parsing a sweep run's JSON")?;
            r["ffn_budget"] = json!(budget);
            eprintln!(
                "sweep: {policy} at {budget}: {:.2} tok/s decode, {:.1} MiB accounted, peak RSS {:.1} MiB",
                r["decode_tok_s"].as_f64().unwrap_or(0.0),
                r["memory"]["total"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
                r["peak_rss_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64
            );
            runs.push(r);
        }
    }
    let json_path = out.join("sweep.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&runs)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let mut series: Vec<Series> = Vec::new();
    for r in &runs {
        let name = r["policy"].as_str().unwrap_or("?").to_string();
        let x = r["memory"]["total"].as_f64().unwrap_or(0.0) / (1 << 20) as f64;
        let y = r["decode_tok_s"].as_f64().unwrap_or(0.0);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((x, y)),
            None => series.push(Series {
                name,
                points: vec![(x, y)],
            }),
        }
    }
    let title = format!(
        "{} — decode tokens/s against memory, sparsity {}",
        Path::new(&a.model)
            .file_name()
            .map_or(a.model.clone(), |f| f.to_string_lossy().into_owned()),
        a.flash.sparsity
    );
    let svg = LineChart {
        title: &title,
        x_label: "accounted memory (MiB: weights, tokenizer, KV, cache, I/O, predictor)",
        y_label: "decode (tokens/s)",
        x_log: false,
        y_min: None,
        y_max: None,
        series: &series,
    }
    .to_svg()?;
    let svg_path = out.join("sweep.svg");
    std::fs::write(&svg_path, svg).with_context(|| format!("writing {}", svg_path.display()))?;
    let summary = sweep_summary(&runs);
    eprintln!("sweep: {}", serde_json::to_string(&summary)?);
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({"runs": runs, "summary": summary, "json": json_path, "plot": svg_path}))?
    );
    Ok(())
}

/// One sweep run: policy, budget, accounted bytes, decode tokens/s, and
/// the share of neuron computations it skipped.
struct SweepPoint<'a> {
    policy: &'a str,
    budget: &'a str,
    memory: f64,
    tok_s: f64,
    skipped: Option<f64>,
}

/// How much more of the neurons a baseline may skip than `speculate` and
/// still count as running at its sparsity (the level's thresholds decide
/// the same neurons for both; a policy that also skips what its predictor
/// missed computes less, and is faster for it).
const SAME_SPARSITY_SLACK: f64 = 0.02;

/// `speculate` against the best baseline (neither `speculate`, `oracle`
/// nor `dense`): the speed ratio at each budget, the same against the best
/// baseline at `speculate`'s sparsity (skipping at most
/// [`SAME_SPARSITY_SLACK`] more of the neurons), and the memory ratio at
/// matched throughput: the memory of the baseline run with the highest
/// tokens/s over the memory at which `speculate` first reaches that speed
/// (interpolated linearly between its runs in order of memory; null when it
/// never does, with its peak's share of that speed instead).
fn sweep_summary(runs: &[Value]) -> Value {
    let points: Vec<SweepPoint> = runs
        .iter()
        .filter_map(|r| {
            Some(SweepPoint {
                policy: r["policy"].as_str()?,
                budget: r["ffn_budget"].as_str()?,
                memory: r["memory"]["total"].as_f64()?,
                tok_s: r["decode_tok_s"].as_f64()?,
                skipped: r["skipped_fraction"].as_f64(),
            })
        })
        .collect();
    let is_baseline = |p: &SweepPoint| !matches!(p.policy, "speculate" | "oracle" | "dense");
    let mut ours: Vec<&SweepPoint> = points.iter().filter(|p| p.policy == "speculate").collect();
    ours.sort_by(|a, b| a.memory.total_cmp(&b.memory));
    let per_budget: Vec<Value> = ours
        .iter()
        .filter_map(|o| {
            let fastest = |same_sparsity: bool| {
                points
                    .iter()
                    .filter(|p| is_baseline(p) && p.budget == o.budget)
                    .filter(|p| {
                        !same_sparsity
                            || matches!((p.skipped, o.skipped), (Some(b), Some(s)) if b <= s + SAME_SPARSITY_SLACK)
                    })
                    .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s))
            };
            let best = fastest(false)?;
            let same = fastest(true);
            Some(json!({
                "ffn_budget": o.budget,
                "speculate_tok_s": o.tok_s,
                "speculate_skipped": o.skipped,
                "best_baseline": best.policy,
                "best_baseline_tok_s": best.tok_s,
                "best_baseline_skipped": best.skipped,
                "ratio": o.tok_s / best.tok_s,
                "best_baseline_at_sparsity": same.map(|p| p.policy),
                "best_baseline_at_sparsity_tok_s": same.map(|p| p.tok_s),
                "ratio_at_sparsity": same.map(|p| o.tok_s / p.tok_s),
            }))
        })
        .collect();
    let Some(peak) = points
        .iter()
        .filter(|p| is_baseline(p))
        .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s))
    else {
        return json!({ "per_budget": per_budget });
    };
    // The first crossing of the peak speed, walking speculate's runs by memory.
    let mut reached = None;
    for (i, o) in ours.iter().enumerate() {
        if o.tok_s >= peak.tok_s {
            reached = Some(match i.checked_sub(1).map(|j| ours[j]) {
                Some(prev) => {
                    prev.memory + (peak.tok_s - prev.tok_s) / (o.tok_s - prev.tok_s) * (o.memory - prev.memory)
                }
                None => o.memory,
            });
            break;
        }
    }
    let best_ours = ours.iter().map(|o| o.tok_s).fold(0.0, f64::max);
    json!({
        "per_budget": per_budget,
        "matched_throughput": {
            "baseline": peak.policy,
            "baseline_ffn_budget": peak.budget,
            "baseline_tok_s": peak.tok_s,
            "baseline_memory_bytes": peak.memory,
            "speculate_memory_bytes": reached,
            "memory_ratio": reached.map(|m| peak.memory / m),
            "speculate_peak_share": (reached.is_none() && peak.tok_s > 0.0).then(|| best_ours / peak.tok_s),
        },
    })
}

/// One llama-bench repetition's speeds.
struct LlamaBench {
    prompt_tok_s: Option<f64>,
    decode_tok_s: Option<f64>,
    build: Value,
}

/// Runs one repetition of llama-bench with matching settings.
fn llama_bench(
    bin: &Path,
    model: &Path,
    p: usize,
    g: usize,
    threads: usize,
    flash_attn: FlashAttn,
) -> Result<LlamaBench> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &p.to_string(), "-n", &g.to_string(), "-t", &threads.to_string()])
        .args(["-fa", &flash_attn.to_string()])
        .args(["-r", "1", "-o", "json"])
        .output()
        .with_context(|| format!("starting {}", bin.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
    }
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).context("parsing llama-bench JSON")?;
    let speed = |want_prompt: bool| {
        rows.iter()
            .find(|r| {
                let n_prompt = r["n_prompt"].as_u64().unwrap_or(0);
                let n_gen = r["n_gen"].as_u64().unwrap_or(0);
                if want_prompt {
                    n_prompt > 0 && n_gen == 0
                } else {
                    n_gen > 0 && n_prompt == 0
                }
            })
            .and_then(|r| r["avg_ts"].as_f64())
    };
    Ok(LlamaBench {
        prompt_tok_s: speed(true),
        decode_tok_s: speed(false),
        build: rows.first().map_or(Value::Null, |r| r["build_commit"].clone()),
    })
}

/// The decisions of a `speculate` run: the controller, a histogram of the
/// actions taken, refinement counts, and the bundles skipped late.
pub fn decisions_json(d: &Decisions, late_skipped: u64) -> Value {
    let actions: Vec<Value> = d
        .actions
        .iter()
        .map(|a| {
            json!({
                "code": a.code,
                "stages": a.action.stages,
                "queue_depth": a.action.queue_depth,
                "prefetch_breadth": a.action.prefetch_breadth,
                "deadline_factor": if a.action.deadline_factor.is_finite() { json!(a.action.deadline_factor) } else { json!("inf") },
                "layers": a.layers,
            })
        })
        .collect();
    json!({
        "controller": d.controller,
        "predictor": d.predictor,
        "actions": actions,
        "refinements": d.refinements,
        "refine_added_neurons": d.refine_added,
        "refine_cancelled_reads": d.refine_cancelled,
        "unranked_layers": d.unranked,
        "late_skipped_bundles": late_skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::{paired_median_ratio, sweep_summary};
    use serde_json::{json, Value};

    fn run(policy: &str, budget: &str, memory: f64, tok_s: f64) -> Value {
        json!({"policy": policy, "ffn_budget": budget, "memory": {"total": memory}, "decode_tok_s": tok_s})
    }

    fn skipping(mut r: Value, skipped: f64) -> Value {
        r["skipped_fraction"] = json!(skipped);
        r
    }

    #[test]
    fn the_sweep_summary_compares_at_the_same_sparsity_too() {
        let runs = [
            skipping(run("speculate", "25%", 200.0, 3.0), 0.52),
            // Faster for computing a quarter of the neurons, where the level keeps half.
            skipping(run("powerinfer2", "25%", 200.0, 4.0), 0.74),
            skipping(run("dejavu", "25%", 200.0, 3.5), 0.535),
            skipping(run("dense-stream", "25%", 200.0, 2.0), 0.52),
            skipping(run("speculate", "100%", 400.0, 6.0), 0.52),
            skipping(run("powerinfer2", "100%", 400.0, 8.0), 0.74),
        ];
        let b = &sweep_summary(&runs)["per_budget"];
        assert_eq!(b[0]["best_baseline"], "powerinfer2");
        assert_eq!(b[0]["ratio"], 0.75);
        assert_eq!(b[0]["best_baseline_at_sparsity"], "dejavu");
        assert_eq!(b[0]["ratio_at_sparsity"], 3.0 / 3.5);
        // No baseline at its sparsity at 100%.
        assert!(b[1]["best_baseline_at_sparsity"].is_null() && b[1]["ratio_at_sparsity"].is_null());
        // Runs without the field compare only by speed.
        let b = &sweep_summary(&[run("speculate", "25%", 1.0, 1.0), run("dejavu", "25%", 1.0, 2.0)])["per_budget"];
        assert_eq!(b[0]["ratio"], 0.5);
        assert!(b[0]["ratio_at_sparsity"].is_null());
    }

    #[test]
    fn the_sweep_summary_matches_throughput_between_runs() {
        let runs = [
            run("dense", "100%", 500.0, 9.0),
            run("oracle", "25%", 200.0, 50.0),
            run("dejavu", "25%", 200.0, 2.0),
            run("dejavu", "100%", 400.0, 4.0),
            run("powerinfer2", "25%", 200.0, 3.0),
            run("speculate", "25%", 200.0, 3.0),
            run("speculate", "100%", 400.0, 5.0),
        ];
        let s = sweep_summary(&runs);
        let b = &s["per_budget"];
        assert_eq!(b[0]["best_baseline"], "powerinfer2");
        assert_eq!(b[0]["ratio"], 1.0);
        assert_eq!(b[1]["ratio"], 1.25);
        // dejavu's peak (4 tok/s at 400) is reached halfway from 200 to 400.
        let m = &s["matched_throughput"];
        assert_eq!(m["baseline"], "dejavu");
        assert_eq!(m["speculate_memory_bytes"], 300.0);
        assert_eq!(m["memory_ratio"], 400.0 / 300.0);
        assert!(m["speculate_peak_share"].is_null());
        // Never reached: the share of the peak speculate gets to.
        let slow = [run("dejavu", "25%", 200.0, 8.0), run("speculate", "25%", 200.0, 2.0)];
        let m = &sweep_summary(&slow)["matched_throughput"];
        assert!(m["memory_ratio"].is_null());
        assert_eq!(m["speculate_peak_share"], 0.25);
    }

    #[test]
    fn paired_median_ratio_takes_the_middle_pair_and_needs_full_pairs() {
        // Ratios 2, 0.5 (a slow outlier repetition) and 1.5: the median is 1.5.
        assert_eq!(paired_median_ratio(&[4.0, 1.0, 3.0], &[2.0, 2.0, 2.0]), Some(1.5));
        assert_eq!(paired_median_ratio(&[1.0, 3.0], &[1.0, 1.0]), Some(2.0));
        assert_eq!(paired_median_ratio(&[1.0], &[]), None);
        assert_eq!(paired_median_ratio(&[1.0], &[0.0]), None);
    }
}
