//! `leanstream bench`: llama-bench-style prompt (pp) and decode (tg) speed on
//! random tokens, optionally running llama.cpp's llama-bench in the same
//! invocation so the two are compared under the same machine conditions.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::model::{FfnStep, RunState};

use crate::Loaded;
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
}

pub use leanstream_runtime::cache::peak_rss_bytes;

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

fn random_tokens(rng: &mut Rng, n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % n_vocab as u64) as u32).collect()
}

/// Tokens per second of processing `n` prompt tokens from an empty context.
fn prompt_speed(loaded: &mut Loaded, st: &mut RunState, tokens: &[u32]) -> Result<f64> {
    let (model, ffn) = loaded.parts();
    let t = Instant::now();
    leanstream_runtime::generate::ingest_with(model, st, tokens, 0, ffn)?;
    model.logits(st, 0, 1)?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

/// Tokens per second of decoding `n` tokens one at a time from an empty context.
fn decode_speed(loaded: &mut Loaded, st: &mut RunState, tokens: &[u32]) -> Result<f64> {
    let (model, mut ffn) = loaded.parts();
    let t = Instant::now();
    for (pos, &tok) in tokens.iter().enumerate() {
        model.forward_with(
            st,
            &[tok],
            pos,
            0..1,
            ffn.as_mut().map(|f| &mut **f as &mut dyn FfnStep),
        )?;
        model.logits(st, 0, 1)?;
    }
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_tokens == 0 && a.gen_tokens == 0 {
        bail!("nothing to measure: --prompt-tokens and --gen-tokens are both 0");
    }
    let path = leanstream_runtime::fetch::resolve_model(&a.model)?;
    let t0 = Instant::now();
    let mut loaded = Loaded::open(&path, &a.flash)?;
    let load_s = t0.elapsed().as_secs_f64();
    if a.llama_bench.is_some() && matches!(loaded, Loaded::Flash(..)) {
        bail!("--llama-bench needs a GGUF model, not a .lsflash file");
    }
    let c = loaded.model().config.clone();
    let weights_bytes = loaded.model().weights.matrix_bytes();
    let mut st = loaded
        .model()
        .new_state(a.prompt_tokens.max(a.gen_tokens).max(1), 512, 1);
    let mut rng = Rng::new(1234);
    let reps = a.reps.max(1);

    let threads = rayon::current_num_threads();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut theirs_pp = Vec::new();
    let mut theirs_tg = Vec::new();
    let mut theirs_build = Value::Null;
    let t_run = Instant::now();
    for rep in 0..=reps {
        // Repetition 0 warms caches and page mappings and is not counted.
        if a.prompt_tokens > 0 {
            let toks = random_tokens(&mut rng, a.prompt_tokens, c.n_vocab);
            let s = prompt_speed(&mut loaded, &mut st, &toks)?;
            if rep > 0 {
                pp.push(s);
            }
        }
        if a.gen_tokens > 0 {
            let toks = random_tokens(&mut rng, a.gen_tokens, c.n_vocab);
            let s = decode_speed(&mut loaded, &mut st, &toks)?;
            if rep > 0 {
                tg.push(s);
            }
        }
        // The baseline runs interleaved with ours, one repetition at a time, so
        // both see the same drift in machine load.
        if let (Some(bin), true) = (&a.llama_bench, rep > 0) {
            let r = llama_bench(bin, &path, a.prompt_tokens, a.gen_tokens, threads)?;
            theirs_pp.extend(r.prompt_tok_s);
            theirs_tg.extend(r.decode_tok_s);
            theirs_build = r.build;
        }
    }
    let stats = |xs: &[f64]| if xs.is_empty() { (0.0, 0.0) } else { mean_std(xs) };
    let ((pp_mean, pp_std), (tg_mean, tg_std)) = (stats(&pp), stats(&tg));
    let mut report = json!({
        "model": path.display().to_string(),
        "arch": c.arch.name(),
        "threads": threads,
        "cpu_features": leanstream_kernels::Device::cpu_features(),
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "reps": reps,
        "prompt_tok_s": pp_mean,
        "prompt_tok_s_std": pp_std,
        "decode_tok_s": tg_mean,
        "decode_tok_s_std": tg_std,
        "load_s": load_s,
        "weights_bytes": weights_bytes,
        "state_bytes": st.bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    });
    if let Loaded::Flash(fm, engine) = &loaded {
        let s = engine.stats();
        let tokens = s.tokens.max(1) as f64;
        let io_s = t_run.elapsed().as_secs_f64();
        let mem = fm.memory(&st, engine);
        report["policy"] = json!(engine.policy.to_string());
        report["ffn_budget_bytes"] = json!(engine.ffn_budget_bytes());
        report["ffn_total_bytes"] = json!(fm.ffn_bytes());
        report["bytes_read_per_token"] = json!(s.bytes_read as f64 / tokens);
        report["reads_per_token"] = json!(s.reads as f64 / tokens);
        report["read_bw_bytes_s"] = json!(s.bytes_read as f64 / io_s);
        report["cache_miss_ratio"] = json!(s.cache_miss_ratio());
        report["memory"] = json!({
            "resident_weights": mem.resident_weights,
            "kv_cache": mem.kv_cache,
            "ffn_cache": mem.ffn_cache,
            "io_buffers": mem.io_buffers,
            "predictor": mem.predictor,
            "other": mem.other,
            "total": mem.total(),
        });
    }
    if a.llama_bench.is_some() {
        let ((tpp, tpp_std), (ttg, ttg_std)) = (stats(&theirs_pp), stats(&theirs_tg));
        let ratio = |ours: f64, theirs: f64| (theirs > 0.0).then(|| ours / theirs);
        report["llama_cpp"] = json!({
            "prompt_tok_s": tpp,
            "prompt_tok_s_std": tpp_std,
            "decode_tok_s": ttg,
            "decode_tok_s_std": ttg_std,
            "build": theirs_build,
        });
        report["ratio_prompt"] = json!(ratio(pp_mean, tpp));
        report["ratio_decode"] = json!(ratio(tg_mean, ttg));
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// One llama-bench repetition's speeds.
struct LlamaBench {
    prompt_tok_s: Option<f64>,
    decode_tok_s: Option<f64>,
    build: Value,
}

/// Runs one repetition of llama-bench with matching settings.
fn llama_bench(bin: &PathBuf, model: &PathBuf, p: usize, g: usize, threads: usize) -> Result<LlamaBench> {
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &p.to_string(), "-n", &g.to_string(), "-t", &threads.to_string()])
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
