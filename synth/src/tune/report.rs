//! `report.md`: what was made, how long each step took, and what the tuned
//! model does against the untuned default, with SVG plots under `plots/`.

use std::fmt::Write as _;
use std::path::Path;

use leanstream_plot::{LineChart, Series};
use serde_json::Value;

use super::layout::{Step, ADAPTIVE_TRACES, COMPUTE_TRACES, CONTROLLER, IO_TRACES, PLOTS, REPORT, VERIFY};
use super::Ctx;
use super::Profiling;
use crate::error::{Result, SynthError};

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// A number to `digits` places, or a dash where the run did not measure it.
fn cell(v: &Value, digits: usize) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.digits$}"))
}

/// A perplexity ratio with its standard error (bench's `ppl_ratio_stderr`)
/// where there is one: near a 3% line the error decides what the ratio says.
fn ratio_cell(quality: &Value) -> String {
    match quality["ppl_ratio_stderr"].as_f64().filter(|e| *e > 0.0) {
        Some(e) => format!("{} ± {e:.3}", cell(&quality["ppl_ratio"], 3)),
        None => cell(&quality["ppl_ratio"], 3),
    }
}

/// `x` to three significant digits: 0.501 on a 7B model, 19.3 on SmolLM2.
fn three_digits(x: f64) -> String {
    let digits = if x.is_finite() && x > 0.0 {
        (2 - x.log10().floor() as i32).clamp(0, 6) as usize
    } else {
        1
    };
    format!("{x:.digits$}")
}

/// A run's decode speed: the median round, with the slowest and fastest
/// where there were several rounds.
fn speed_cell(run: &Value) -> String {
    let median = three_digits(f(&run["decode_tok_s"]));
    let rounds = crate::fit::Empirical::new(
        run["decode_tok_s_rounds"]
            .as_array()
            .map(|a| a.iter().map(f).collect())
            .unwrap_or_default(),
    );
    match rounds.sorted[..] {
        [lo, .., hi] => format!("{median} ({}–{})", three_digits(lo), three_digits(hi)),
        _ => median,
    }
}

fn save(ctx: &Ctx, name: &str, svg: &str, files: &mut Vec<String>) -> Result<String> {
    let rel = format!("{PLOTS}/{name}");
    let path = ctx.out.join(&rel);
    std::fs::write(&path, svg).map_err(|e| SynthError::io(&path, e))?;
    files.push(rel.clone());
    Ok(rel)
}

/// The profiler's own latency plots (CDFs, throughput) of one run, copied under plots/.
fn profile_plots(ctx: &Ctx, run: &str, sub: &str, files: &mut Vec<String>) -> Result<Vec<String>> {
    let loaded = leanstream_profiler::summary::load(&ctx.out.join(run))?;
    let rows = leanstream_profiler::summary::summarize(&loaded.frame, &loaded.plan.conditions)?;
    let dir = ctx.out.join(PLOTS).join(sub);
    let written = leanstream_profiler::plot::write_plots(&loaded.frame, &rows, &dir)?;
    let mut rels = Vec::new();
    for p in written {
        if let Some(name) = p.file_name() {
            let rel = format!("{PLOTS}/{sub}/{}", name.to_string_lossy());
            files.push(rel.clone());
            rels.push(rel);
        }
    }
    Ok(rels)
}

pub(super) fn write(ctx: &Ctx) -> Result<(Vec<String>, Value)> {
    let plots = ctx.out.join(PLOTS);
    std::fs::create_dir_all(&plots).map_err(|e| SynthError::io(&plots, e))?;
    let mut files = vec![REPORT.to_string()];
    let m = &ctx.manifest;
    let mut r = String::new();
    let _ = writeln!(r, "# LeanStream tune report\n");
    let _ = writeln!(r, "- model: `{}` (SHA-256 `{}`)", m.model, m.model_sha256);
    let _ = writeln!(r, "- device: `{}`, {} threads", m.device, ctx.cores);
    let _ = writeln!(r, "- budget: {:.0} s; sessions of this run: {}", m.budget_s, m.sessions);
    let _ = writeln!(
        r,
        "- use: `leanstream run --model {}/model.lsflash --policy speculate --sparsity {} --mem-budget ...` \
         finds the controller, predictor and retention table beside the model\n",
        ctx.out.display(),
        ctx.opts.sparsity
    );

    let _ = writeln!(
        r,
        "## Steps\n\n| step | share of budget (s) | wall (s) | sessions |\n|---|---|---|---|"
    );
    let mut total = 0.0;
    for &s in Step::pipeline(ctx.opts.profiling) {
        if let Some(rec) = m.steps.get(s.name()) {
            total += rec.seconds;
            let _ = writeln!(
                r,
                "| {} | {:.0} | {:.1} | {} |",
                s.name(),
                rec.budget_s,
                rec.seconds,
                rec.sessions
            );
        } else if s == Step::Report {
            let _ = writeln!(r, "| report | {:.0} | (this file) | |", ctx.budget_of(s));
        }
    }
    let _ = writeln!(r, "\nSteps before the report: {total:.1} s.\n");

    let _ = writeln!(r, "## Artifacts\n\n| file | bytes | SHA-256 |\n|---|---|---|");
    for &s in Step::pipeline(ctx.opts.profiling) {
        if let Some(rec) = m.steps.get(s.name()) {
            for o in rec.outputs.iter().filter(|o| !o.path.starts_with("work/")) {
                let _ = writeln!(r, "| `{}` | {} | `{}` |", o.path, o.bytes, &o.sha256[..16]);
            }
        }
    }

    // Tuned against default.
    let verify: Value = {
        let p = ctx.out.join(VERIFY);
        let bytes = std::fs::read(&p).map_err(|e| SynthError::io(&p, e))?;
        serde_json::from_slice(&bytes).map_err(|e| SynthError::Settings(format!("{}: {e}", p.display())))?
    };
    let runs = verify["runs"].as_array().cloned().unwrap_or_default();
    let _ = writeln!(
        r,
        "\n## Tuned against default, in the real engine\n\n`tuned` is `speculate` with this run's table and \
         predictor; `default` is `dense-stream`, what the same file does without them. Sparsity {}, decode of \
         {} tokens after one warm-up, each run its own process{}. Perplexity is held-out text's, against the \
         packed file's dense run (ppl ratio ± its standard error over the chunks, top-1) and against the \
         source GGUF's dense engine, which also counts the packed down columns' rounding. `skipped` is the \
         share of neurons not computed while decoding random tokens; `skipped mass`, measured on the \
         held-out text, the share of the true active mass (what dense keeps at the run's own state) that \
         the run did not compute, mispredicted or late.\n",
        ctx.opts.sparsity,
        verify["plan"]["gen_tokens"],
        match verify["plan"]["rounds"].as_u64().unwrap_or(1) {
            0 | 1 => String::new(),
            n => format!(
                "; tokens/s is the median of {n} rounds that take the runs in turn (slowest–fastest in brackets)"
            ),
        }
    );
    if verify["plan"]["quality_chunks"].as_u64() == Some(0) {
        let _ = writeln!(
            r,
            "Quality was not measured: at the engine probe's speed one perplexity chunk takes longer than the \
             step's share of the budget (a larger `--budget` measures it).\n"
        );
    }
    let _ = writeln!(
        r,
        "| run | FFN budget | memory (MiB) | decode tok/s | MiB read/token | skipped | skipped mass | ppl ratio | top-1 | ppl ratio to the source |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    let mib = |v: &Value| f(v) / (1u64 << 20) as f64;
    for v in &runs {
        let _ = writeln!(
            r,
            "| {} | {} | {:.1} | {} | {:.2} | {:.3} | {} | {} | {} | {} |",
            v["label"].as_str().unwrap_or("?"),
            v["budget"].as_str().unwrap_or("?"),
            mib(&v["memory"]["total"]),
            speed_cell(v),
            mib(&v["bytes_read_per_token"]),
            f(&v["skipped_fraction"]),
            cell(&v["quality"]["skipped_mass"], 4),
            ratio_cell(&v["quality"]),
            cell(&v["quality"]["top1_agreement"], 3),
            ratio_cell(&v["quality"]["reference"]),
        );
    }
    // Points in run order: by budget for the memory sweep, by deadline factor for the curve.
    let series = |config: &str, name: &str, x: &dyn Fn(&Value) -> f64, y: &dyn Fn(&Value) -> f64| Series {
        name: name.to_string(),
        points: runs
            .iter()
            .filter(|v| v["config"] == config)
            .map(|v| (x(v), y(v)))
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .collect(),
    };
    let mem = [
        series("tuned", "tuned", &|v| mib(&v["memory"]["total"]), &|v| {
            f(&v["decode_tok_s"])
        }),
        series("default", "default", &|v| mib(&v["memory"]["total"]), &|v| {
            f(&v["decode_tok_s"])
        }),
    ];
    if mem.iter().all(|s| s.points.len() > 1) {
        let svg = LineChart {
            title: "Decode speed against memory: tuned vs default",
            x_label: "memory accounted (MiB)",
            y_label: "decode tokens/s",
            x_log: false,
            y_min: Some(0.0),
            y_max: None,
            series: &mem,
        }
        .to_svg()?;
        let rel = save(ctx, "memory.svg", &svg, &mut files)?;
        let _ = writeln!(r, "\n![tokens/s against memory]({rel})");
    }
    let name = format!(
        "deadline factor {}",
        verify["plan"]["deadlines"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_str()).collect::<Vec<_>>().join(" → "))
            .unwrap_or_default()
    );
    let deadline = series("deadline", &name, &|v| f(&v["decode_tok_s"]), &|v| {
        f(&v["quality"]["ppl_ratio"])
    });
    if deadline.points.len() > 1 {
        let _ = writeln!(
            r,
            "\n### Speed against quality\n\n`speculate` at K=2, b=1.5, q=16 with deadline factors {} (the \
             table's deadline is one of its knobs; here it is pinned to show the curve).\n",
            verify["plan"]["deadlines"]
        );
        let svg = LineChart {
            title: "Speed against quality (deadline factor varied)",
            x_label: "decode tokens/s",
            y_label: "perplexity / dense perplexity",
            x_log: false,
            y_min: None,
            y_max: None,
            series: &[deadline],
        }
        .to_svg()?;
        let rel = save(ctx, "speed_quality.svg", &svg, &mut files)?;
        let _ = writeln!(r, "![speed against quality]({rel})");
    }

    // The controller.
    let table = leanstream_runtime::control::ControlTable::load(&ctx.out.join(CONTROLLER))?;
    let rel = save(ctx, "controller.svg", &crate::inspect::heatmap_svg(&table)?, &mut files)?;
    let _ = writeln!(r, "\n## Controller\n");
    if let Some(s) = ctx.summary_of(Step::Controller) {
        let _ = writeln!(
            r,
            "{} grid states, {} actions. Simulated on the held-out half of the profile ({} tokens); \
             `best_fixed` is the fixed action picked on that half in hindsight, `fit_fixed` the one \
             picked on the half the table was built from:\n\n\
             | policy | mean cost | layer µs | skipped mass |\n|---|---|---|---|",
            s["states"], s["actions"], s["sim_tokens"]
        );
        for row in s["simulated"].as_array().into_iter().flatten() {
            let _ = writeln!(
                r,
                "| {} | {:.1} | {:.1} | {:.4} |",
                row["policy"].as_str().unwrap_or("?"),
                f(&row["mean_cost"]),
                f(&row["mean_layer_us"]),
                f(&row["skipped_mass"])
            );
        }
        // The recall the table was solved with, and where it came from.
        let curve = |v: &Value| {
            v.as_array()
                .into_iter()
                .flatten()
                .map(|p| format!("{} at breadth {}", cell(&p[1], 3), cell(&p[0], 1)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            r,
            "\nRecall (share of the true active mass computed) the table was solved with, {}: {}; the \
             predictor's offline recall of the top b × need: {}.",
            match s["recall_source"].as_str() {
                Some("engine") => "the engine's, audited on the held-out text by the engine probe",
                _ => "the predictor's offline recall (the engine probe did not measure it)",
            },
            curve(&s["recall_by_breadth"]),
            curve(&s["offline_recall_by_breadth"]),
        );
    }
    let _ = writeln!(r, "\n![controller actions]({rel})");

    let _ = writeln!(r, "\n## Device profile\n");
    match ctx.opts.profiling {
        Profiling::Uniform => {
            for (run, sub, step) in [
                (IO_TRACES, "io", Step::ProfileIo),
                (COMPUTE_TRACES, "compute", Step::ProfileCompute),
            ] {
                if let Some(s) = ctx.summary_of(step) {
                    let _ = writeln!(
                        r,
                        "- {}: {} samples in {:.0} s ({}, {})",
                        step.name(),
                        s["samples"],
                        f(&s["spent_s"]),
                        s["repetition"].as_str().unwrap_or("?"),
                        s["finish"].as_str().unwrap_or("?")
                    );
                }
                for rel in profile_plots(ctx, run, sub, &mut files)? {
                    let _ = writeln!(r, "\n  ![{sub}]({rel})");
                }
            }
        }
        Profiling::Adaptive => {
            if let Some(s) = ctx.summary_of(Step::ProfileAdaptive) {
                let _ = writeln!(
                    r,
                    "Adaptive: {} samples in {} profiler runs, {:.0} s. Per round, each condition's \
                     sensitivity (the share of probe states whose action changes when its samples are \
                     resampled), and the seconds the round gave the read and the compute sweep (each \
                     samples all its conditions, interleaved):\n",
                    s["samples"],
                    s["runs"],
                    f(&s["budget_s"])
                );
                for round in s["rounds"].as_array().into_iter().flatten() {
                    let conditions: Vec<String> = round["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|c| {
                            let sens = c[1].as_f64().map(|x| format!(" {x:.3}")).unwrap_or_default();
                            format!("{}{sens}", c[0].as_str().unwrap_or("?"))
                        })
                        .collect();
                    let _ = writeln!(
                        r,
                        "- round {}: {}; reads {:.1} s, compute {:.1} s",
                        round["round"],
                        conditions.join(", "),
                        f(&round["io_s"]),
                        f(&round["compute_s"])
                    );
                }
            }
            // The pilot sampled every condition the table reads.
            for (sub, kind) in [("io", "io"), ("compute", "compute")] {
                let run = format!("{ADAPTIVE_TRACES}/round-00-{kind}");
                if ctx.out.join(&run).is_dir() {
                    for rel in profile_plots(ctx, &run, sub, &mut files)? {
                        let _ = writeln!(r, "\n  ![{sub}, the pilot]({rel})");
                    }
                }
            }
        }
    }

    if let Some(s) = ctx.summary_of(Step::Eviction) {
        let _ = writeln!(
            r,
            "\n## Cache eviction (held-out miss ratio, cache {:.0}% of neurons)\n\n| policy | miss ratio |\n|---|---|",
            f(&s["budget_share"]) * 100.0
        );
        for row in s["table4"].as_array().into_iter().flatten() {
            let _ = writeln!(
                r,
                "| {} | {:.4} |",
                row["policy"].as_str().unwrap_or("?"),
                f(&row["miss_ratio"])
            );
        }
    }
    if let Some(s) = ctx.summary_of(Step::Predictor) {
        let _ = writeln!(
            r,
            "\n## Predictor\n\nTrained on {} tokens; mean hashing loss {:.4} → {:.4}; {} bytes of weights.",
            s["tokens"],
            f(&s["hashing_loss_before"]),
            f(&s["hashing_loss_after"]),
            s["weight_bytes"]
        );
    }
    let path = ctx.out.join(REPORT);
    write_text(&path, &r)?;
    let plots = files.len() - 1;
    Ok((files, serde_json::json!({ "plots": plots })))
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    leanstream_profiler::shard::write_atomic(path, text.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_speed_cell_shows_the_rounds_spread_when_there_are_several() {
        let one = json!({"decode_tok_s": 27.94, "decode_tok_s_rounds": [27.94]});
        assert_eq!(speed_cell(&one), "27.9");
        let three = json!({"decode_tok_s": 29.3, "decode_tok_s_rounds": [55.7, 29.3, 27.9]});
        assert_eq!(speed_cell(&three), "29.3 (27.9–55.7)");
        // Before rounds were recorded: the one number.
        assert_eq!(speed_cell(&json!({"decode_tok_s": 4.25})), "4.25");
    }
}
