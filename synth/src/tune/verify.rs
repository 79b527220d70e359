//! The tune's runs of the real engine, each in its own `leanstream bench`
//! process (so each peak RSS is its own): the engine probe the control
//! model is fitted to, and the verification benchmark: the tuned model
//! (speculate, driven by the table and predictor beside it) against what
//! the same file does untuned (dense-stream, no artifacts).

use std::process::Command;

use serde_json::{json, Value};

use super::layout::{Step, ENGINE_RUNS, HELDOUT_TEXT, MODEL, VERIFY};
use super::Ctx;
use crate::error::{Result, SynthError};

/// What the verification runs: sweep budgets, tokens, quality settings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VerifyPlan {
    pub budgets: Vec<String>,
    pub gen_tokens: usize,
    pub reps: usize,
    /// Times every run is repeated, in rounds that interleave the runs, so
    /// a slow spell of the disk or CPU hits tuned and default alike; each
    /// run reports its median round. One 32-token process per run measured
    /// `dense-stream` on SmolLM2 at 55.7 tok/s in one tune and 27.9 in the
    /// next.
    pub rounds: usize,
    pub quality_ctx: usize,
    pub quality_chunks: usize,
    /// Deadline factors of the speed-quality curve (empty: none).
    pub deadlines: Vec<String>,
}

impl VerifyPlan {
    /// Plans from the largest to the smallest, `op` the operating FFN budget.
    fn ladder(op: &str) -> [VerifyPlan; 5] {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        [
            VerifyPlan {
                budgets: strings(&["10%", "25%", "50%", "100%"]),
                gen_tokens: 32,
                reps: 1,
                rounds: 3,
                quality_ctx: 256,
                quality_chunks: 1,
                deadlines: strings(&["2", "8", "inf"]),
            },
            VerifyPlan {
                budgets: strings(&["10%", "25%", "50%", "100%"]),
                gen_tokens: 32,
                reps: 1,
                rounds: 1,
                quality_ctx: 256,
                quality_chunks: 1,
                deadlines: strings(&["2", "8", "inf"]),
            },
            VerifyPlan {
                budgets: if op == "100%" {
                    strings(&[op])
                } else {
                    strings(&[op, "100%"])
                },
                gen_tokens: 16,
                reps: 1,
                rounds: 1,
                quality_ctx: 128,
                quality_chunks: 1,
                deadlines: strings(&["2", "inf"]),
            },
            VerifyPlan {
                budgets: strings(&[op]),
                gen_tokens: 8,
                reps: 1,
                rounds: 1,
                quality_ctx: 64,
                quality_chunks: 1,
                deadlines: Vec::new(),
            },
            // Speed only: on a 7B model at well under a token a second, one
            // perplexity chunk costs more than the step's whole share.
            VerifyPlan {
                budgets: strings(&[op]),
                gen_tokens: 4,
                reps: 1,
                rounds: 1,
                quality_ctx: 0,
                quality_chunks: 0,
                deadlines: Vec::new(),
            },
        ]
    }

    /// The largest plan whose estimate fits `share_s`; the smallest if none does.
    pub(super) fn pick(op: &str, share_s: f64, tok_s: f64, load_s: f64) -> VerifyPlan {
        let [a, b, c, d, e] = Self::ladder(op);
        [a, b, c, d]
            .into_iter()
            .find(|p| p.seconds(tok_s, load_s) <= share_s)
            .unwrap_or(e)
    }

    /// Whether the runs at the operating budget measure quality.
    pub fn measures_quality(&self) -> bool {
        self.quality_ctx > 0 && self.quality_chunks > 0
    }

    /// Estimated seconds: each run loads, then decodes its tokens reps + 1
    /// times (the first warms up), once a round; a quality run (the
    /// operating budget's two and each deadline's, first round only)
    /// decodes its chunks token by token and streams the dense reference,
    /// counted as about as much again.
    fn seconds(&self, tok_s: f64, load_s: f64) -> f64 {
        let runs = (2 * self.budgets.len() + self.deadlines.len()) as f64;
        let decode = ((self.reps + 1) * self.gen_tokens) as f64 / tok_s;
        let quality_runs = if self.measures_quality() {
            2 + self.deadlines.len()
        } else {
            0
        };
        let quality = quality_runs as f64 * 2.0 * (self.quality_ctx * self.quality_chunks) as f64 / tok_s;
        self.rounds as f64 * runs * (load_s + decode) + quality
    }
}

/// One bench run: its label, the arguments that differ, whether it measures quality.
struct Run {
    label: String,
    config: &'static str,
    budget: String,
    args: Vec<String>,
    quality: bool,
}

pub(super) fn verify(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    let bin = super::leanstream_bin(ctx.opts)?;
    let plan = Step::verify_plan(ctx)?;
    let mut runs = Vec::new();
    for b in &plan.budgets {
        let at_op = plan.measures_quality() && (*b == ctx.opts.ffn_budget || plan.budgets.len() == 1);
        for (config, policy) in [("tuned", "speculate"), ("default", "dense-stream")] {
            runs.push(Run {
                label: format!("{config} {b}"),
                config,
                budget: b.clone(),
                args: vec!["--policy".into(), policy.into()],
                quality: at_op,
            });
        }
    }
    // The speed-quality curve: the tuned predictor under fixed deadlines.
    for d in &plan.deadlines {
        runs.push(Run {
            label: format!("deadline {d}"),
            config: "deadline",
            budget: ctx.opts.ffn_budget.clone(),
            args: vec![
                "--policy".into(),
                "speculate".into(),
                "--controller".into(),
                format!("fixed:K=2,b=1.5,d={d},q=16"),
            ],
            quality: plan.measures_quality(),
        });
    }
    let heldout = ctx.out.join(HELDOUT_TEXT);
    let mut rows = Vec::new();
    let mut speeds = vec![Vec::new(); runs.len()];
    for round in 0..plan.rounds.max(1) {
        for (i, r) in runs.iter().enumerate() {
            // Quality is scored in the first round only: one perplexity
            // chunk costs more than a round of decodes.
            let quality = r.quality && round == 0;
            let v = bench_run(ctx, &bin, &plan, r, quality, &heldout)?;
            speeds[i].push(v["decode_tok_s"].as_f64().unwrap_or(f64::NAN));
            if round == 0 {
                rows.push(v);
            }
        }
    }
    for (v, s) in rows.iter_mut().zip(&speeds) {
        v["decode_tok_s"] = json!(crate::fit::Empirical::new(s.clone()).median());
        v["decode_tok_s_rounds"] = json!(s);
    }
    let report = json!({ "plan": plan, "runs": rows });
    let path = ctx.out.join(VERIFY);
    let text = serde_json::to_vec_pretty(&report).map_err(|e| SynthError::Settings(e.to_string()))?;
    leanstream_profiler::shard::write_atomic(&path, &text)?;
    Ok((vec![VERIFY.into()], summarize(&rows)))
}

/// One verification run, labelled; with `quality`, scored on the held-out text.
fn bench_run(
    ctx: &Ctx,
    bin: &std::path::Path,
    plan: &VerifyPlan,
    r: &Run,
    quality: bool,
    heldout: &std::path::Path,
) -> Result<Value> {
    let mut extra = r.args.clone();
    if quality {
        extra.extend([
            "--quality-file".into(),
            heldout.display().to_string(),
            "--quality-ctx".into(),
            plan.quality_ctx.to_string(),
            "--quality-chunks".into(),
            plan.quality_chunks.to_string(),
            // Scored against the source model too: the packed down
            // columns are not its arithmetic.
            "--quality-reference".into(),
            ctx.opts.model.display().to_string(),
        ]);
    }
    let mut v = bench(ctx, bin, &r.label, &r.budget, plan.gen_tokens, plan.reps, &extra)?;
    v["label"] = json!(r.label);
    v["config"] = json!(r.config);
    v["budget"] = json!(r.budget);
    Ok(v)
}

/// One `leanstream bench` run of the tuned file at the tune's sparsity,
/// decode only; its JSON report.
fn bench(
    ctx: &Ctx,
    bin: &std::path::Path,
    label: &str,
    budget: &str,
    gen_tokens: usize,
    reps: usize,
    args: &[String],
) -> Result<Value> {
    let out = Command::new(bin)
        .arg("bench")
        .arg("--model")
        .arg(ctx.out.join(MODEL))
        .args(["--sparsity", &ctx.opts.sparsity.to_string()])
        .args(["--ffn-budget", budget])
        .args(["--prompt-tokens", "0"])
        .args(["--gen-tokens", &gen_tokens.to_string()])
        .args(["--reps", &reps.to_string()])
        .args(args)
        .output()
        .map_err(|e| SynthError::io(bin, e))?;
    if !out.status.success() {
        return Err(SynthError::Settings(format!(
            "bench run `{label}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| SynthError::Settings(format!("bench run `{label}`: it printed no JSON ({e})")))
}

/// The fixed action of the engine probe at queue depth `q`: no deadline,
/// so every read lands and is timed.
fn probe_action(q: u16) -> String {
    format!("fixed:K=1,b=1.5,d=inf,q={q}")
}

/// The engine probe's report at queue depth `q`, relative to the output directory.
fn probe_file(q: u16) -> String {
    format!("{ENGINE_RUNS}/q{q}.json")
}

/// The engine probe's audited run at prefetch breadth `b`: the deepest
/// queue, no deadline, so what it skips is what the breadth misses.
fn recall_action(b: f32) -> String {
    let q = crate::model::ActionSpace::default()
        .queue_depths
        .into_iter()
        .max()
        .unwrap_or(16);
    format!("fixed:K=1,b={b},d=inf,q={q}")
}

fn recall_file(b: f32) -> String {
    format!("{ENGINE_RUNS}/recall-b{b}.json")
}

/// Tokens each audited recall run decodes (after its warm-up) to measure
/// the bytes a token reads at its breadth.
pub(super) const RECALL_GEN_TOKENS: usize = 4;

/// `(breadth, field)` of each of this run's engine probe runs at a
/// breadth, from the probe's summary in the manifest; `None` where it did
/// not measure them.
fn probe_breadth_points(ctx: &Ctx, field: &str) -> Option<Vec<(f64, f64)>> {
    let rows = ctx.summary_of(Step::EngineProbe)?["recall"].as_array()?;
    let points: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r["breadth"].as_f64()?, r[field].as_f64()?)))
        .collect();
    (!points.is_empty() && points.len() == rows.len()).then_some(points)
}

/// The engine's recall at each prefetch breadth as this run's engine probe
/// measured it: 1 − the audited skipped mass on the held-out text.
pub(super) fn probe_recall(ctx: &Ctx) -> Option<Vec<(f64, f64)>> {
    probe_breadth_points(ctx, "recall")
}

/// Bytes a token read at each breadth over those at the widest, as this
/// run's engine probe measured them; `None` without them or where the
/// widest read nothing (a cache that holds every layer).
pub(super) fn probe_read_share(ctx: &Ctx) -> Option<Vec<(f64, f64)>> {
    let bytes = probe_breadth_points(ctx, "bytes_read_per_token")?;
    let widest = bytes.last()?.1;
    (widest > 0.0).then(|| bytes.iter().map(|&(b, v)| (b, (v / widest).min(1.0))).collect())
}

/// The engine probe's reports, one per queue depth of the codebook.
pub(super) fn probe_runs(ctx: &Ctx) -> Result<Vec<std::path::PathBuf>> {
    let runs: Vec<_> = crate::model::ActionSpace::default()
        .queue_depths
        .iter()
        .map(|&q| ctx.out.join(probe_file(q)))
        .collect();
    match runs.iter().find(|p| !p.is_file()) {
        Some(p) => Err(SynthError::Settings(format!(
            "{}: missing; the engine-probe step makes it",
            p.display()
        ))),
        None => Ok(runs),
    }
}

/// `speculate` with the tuned predictor at each queue depth of the
/// codebook, the rest of the action fixed: the engine's read latencies per
/// depth and its compute time per neuron; then at each prefetch breadth,
/// audited on the held-out text: the engine's recall and the bytes a token
/// reads. The controller step fits the control model to all of them.
pub(super) fn engine_probe(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    let bin = super::leanstream_bin(ctx.opts)?;
    let dir = ctx.out.join(ENGINE_RUNS);
    std::fs::create_dir_all(&dir).map_err(|e| SynthError::io(&dir, e))?;
    let (mut files, mut brief) = (Vec::new(), Vec::new());
    for q in crate::model::ActionSpace::default().queue_depths {
        let action = probe_action(q);
        let args = ["--policy", "speculate", "--controller", &action].map(String::from);
        let v = bench(
            ctx,
            &bin,
            &action,
            &ctx.opts.ffn_budget,
            Step::probe_tokens(ctx)?,
            1,
            &args,
        )?;
        let rel = probe_file(q);
        let text = serde_json::to_vec_pretty(&v).map_err(|e| SynthError::Settings(e.to_string()))?;
        leanstream_profiler::shard::write_atomic(&ctx.out.join(&rel), &text)?;
        files.push(rel);
        brief.push(
            json!({"queue_depth": q, "decode_tok_s": v["decode_tok_s"], "read_latency": v["read_latency"]
            .as_array().into_iter().flatten().map(|d| json!({"queue_depth": d["queue_depth"], "reads": d["reads"],
            "mean_bytes": d["mean_bytes"], "median_us": d["latency_us"][50]})).collect::<Vec<_>>()}),
        );
    }
    // The engine's recall per breadth: audited quality runs on held-out
    // text, each layer also computed whole, so the share of the true active
    // mass a breadth leaves out is measured, not inferred from the
    // predictor's ranking alone (merged reads and the cache add neurons).
    let tokens = Step::recall_tokens(ctx)?;
    let mut recall = Vec::new();
    if tokens > 0 {
        let heldout = ctx.out.join(HELDOUT_TEXT).display().to_string();
        for b in crate::model::ActionSpace::default().prefetch_breadths {
            let action = recall_action(b);
            let args = [
                "--policy",
                "speculate",
                "--controller",
                &action,
                "--quality-file",
                &heldout,
                "--quality-ctx",
                &tokens.to_string(),
                "--quality-chunks",
                "1",
            ]
            .map(String::from);
            let v = bench(ctx, &bin, &action, &ctx.opts.ffn_budget, RECALL_GEN_TOKENS, 1, &args)?;
            let skipped = v["quality"]["skipped_mass"].as_f64().ok_or_else(|| {
                SynthError::Settings(format!(
                    "bench run `{action}`: no audited skipped mass in its quality report"
                ))
            })?;
            let rel = recall_file(b);
            let text = serde_json::to_vec_pretty(&v).map_err(|e| SynthError::Settings(e.to_string()))?;
            leanstream_profiler::shard::write_atomic(&ctx.out.join(&rel), &text)?;
            files.push(rel);
            recall.push(
                json!({"breadth": b, "recall": 1.0 - skipped, "ppl_ratio": v["quality"]["ppl_ratio"],
                "top1_agreement": v["quality"]["top1_agreement"], "bytes_read_per_token": v["bytes_read_per_token"]}),
            );
        }
    }
    Ok((
        files,
        json!({ "runs": brief, "recall_tokens": tokens, "recall": recall }),
    ))
}

/// Tokens/s, skipped share and quality of each run, for the manifest.
fn summarize(rows: &[Value]) -> Value {
    let brief: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "label": r["label"],
                "decode_tok_s": r["decode_tok_s"],
                "decode_tok_s_rounds": r["decode_tok_s_rounds"],
                "skipped_fraction": r["skipped_fraction"],
                "memory_total": r["memory"]["total"],
                "ppl_ratio": r["quality"]["ppl_ratio"],
                "ppl_ratio_stderr": r["quality"]["ppl_ratio_stderr"],
                "top1_agreement": r["quality"]["top1_agreement"],
                "skipped_mass": r["quality"]["skipped_mass"],
                "ppl_ratio_source": r["quality"]["reference"]["ppl_ratio"],
            })
        })
        .collect();
    json!({ "runs": brief })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verify_plan_shrinks_with_the_speed() {
        // SmolLM2 at a 30-minute budget (the probe's slowest run 28.6 tok/s,
        // a 110 MB file): three interleaved rounds.
        let full = VerifyPlan::pick("25%", 270.0, 28.6, 0.22);
        assert_eq!((full.budgets.len(), full.rounds), (4, 3));
        assert!(full.measures_quality() && full.deadlines.len() == 3);
        assert!(full.seconds(28.6, 0.22) <= 270.0);
        // Slower: the same runs once.
        let once = VerifyPlan::pick("25%", 270.0, 15.0, 0.2);
        assert_eq!((once.budgets.len(), once.rounds), (4, 1));
        assert!(once.seconds(15.0, 0.2) <= 270.0);
        // A 12-minute budget's 108 s: the operating budget and 100%, a shorter curve.
        let mid = VerifyPlan::pick("25%", 108.0, 18.0, 0.2);
        assert_eq!(mid.budgets, ["25%", "100%"]);
        assert!(mid.seconds(18.0, 0.2) <= 108.0);
        // The Mistral-7B shape (0.38 tok/s measured, 10 s to load): speed only.
        let slow = VerifyPlan::pick("25%", 225.0, 0.38, 10.0);
        assert!(!slow.measures_quality());
        assert_eq!((slow.budgets.len(), slow.gen_tokens), (1, 4));
        assert!(slow.seconds(0.38, 10.0) <= 225.0);
        // Every rung costs less than the one above it.
        let ladder = VerifyPlan::ladder("25%");
        for w in ladder.windows(2) {
            assert!(w[1].seconds(1.0, 1.0) < w[0].seconds(1.0, 1.0));
        }
    }
}
