//! The verification benchmark: the tuned model (speculate, driven by the
//! table and predictor beside it) against what the same file does untuned
//! (dense-stream, no artifacts), in the real engine, each run in its own
//! `leanstream bench` process so each peak RSS is its own.

use std::process::Command;

use serde_json::{json, Value};

use super::steps::{Step, HELDOUT_TEXT, MODEL, VERIFY};
use super::Ctx;
use crate::error::{Result, SynthError};

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
    let plan = Step::verify_plan(ctx);
    let mut runs = Vec::new();
    for b in &plan.budgets {
        let at_op = *b == ctx.opts.ffn_budget || plan.budgets.len() == 1;
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
            quality: true,
        });
    }
    let model = ctx.out.join(MODEL);
    let heldout = ctx.out.join(HELDOUT_TEXT);
    let mut rows = Vec::new();
    for r in &runs {
        let mut cmd = Command::new(&bin);
        cmd.arg("bench")
            .arg("--model")
            .arg(&model)
            .args(["--sparsity", &ctx.opts.sparsity.to_string()])
            .args(["--ffn-budget", &r.budget])
            .args(["--prompt-tokens", "0"])
            .args(["--gen-tokens", &plan.gen_tokens.to_string()])
            .args(["--reps", &plan.reps.to_string()])
            .args(&r.args);
        if r.quality {
            cmd.arg("--quality-file")
                .arg(&heldout)
                .args(["--quality-ctx", &plan.quality_ctx.to_string()])
                .args(["--quality-chunks", &plan.quality_chunks.to_string()]);
        }
        let out = cmd.output().map_err(|e| SynthError::io(&bin, e))?;
        if !out.status.success() {
            return Err(SynthError::Settings(format!(
                "verification run `{}` failed ({}): {}",
                r.label,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let mut v: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            SynthError::Settings(format!("verification run `{}`: bench printed no JSON ({e})", r.label))
        })?;
        v["label"] = json!(r.label);
        v["config"] = json!(r.config);
        v["budget"] = json!(r.budget);
        rows.push(v);
    }
    let report = json!({ "plan": plan, "runs": rows });
    let path = ctx.out.join(VERIFY);
    let text = serde_json::to_vec_pretty(&report).map_err(|e| SynthError::Settings(e.to_string()))?;
    leanstream_profiler::shard::write_atomic(&path, &text)?;
    Ok((vec![VERIFY.into()], summarize(&rows)))
}

/// Tokens/s, skipped share and quality of each run, for the manifest.
fn summarize(rows: &[Value]) -> Value {
    let brief: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "label": r["label"],
                "decode_tok_s": r["decode_tok_s"],
                "skipped_fraction": r["skipped_fraction"],
                "memory_total": r["memory"]["total"],
                "ppl_ratio": r["quality"]["ppl_ratio"],
                "top1_agreement": r["quality"]["top1_agreement"],
            })
        })
        .collect();
    json!({ "runs": brief })
}
