//! The profile's charts (SVG, drawn by `leanstream-plot`): latency CDFs by
//! request size and throughput against queue depth (I/O runs), latency CDFs
//! by kernel size and the cost of splitting a layer (compute runs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use polars::prelude::DataFrame;

use crate::summary::{latencies_by, ConditionSummary};
use crate::units::format_size;
use crate::{ProfileError, Result};
use leanstream_plot::{LineChart, Series};

/// (engine, pattern, block size, workers) of a throughput line.
type LineKey = (String, String, u64, u32);

/// Lines beyond this many would repeat colours.
const MAX_LINES: usize = 10;

/// Empirical CDF of `v` at up to 400 points.
pub fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = (n / 400).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    pts.push((v[n - 1], 1.0));
    pts
}

/// Draws `chart` (x on a log scale, y from 0) into `path`.
fn write(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    y_max: Option<f64>,
    series: &[Series],
) -> Result<PathBuf> {
    let chart = LineChart {
        title,
        x_label,
        y_label,
        x_log: true,
        y_min: None,
        y_max,
        series,
    };
    std::fs::write(path, chart.to_svg()?).map_err(|e| ProfileError::io(path, e))?;
    Ok(path.to_path_buf())
}

/// Writes the plots for a run into `out`; returns the files written.
pub fn write_plots(df: &DataFrame, rows: &[ConditionSummary], out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(|e| ProfileError::io(out, e))?;
    let mut written = Vec::new();
    let io: Vec<&ConditionSummary> = rows.iter().filter(|r| r.sweep == "io").collect();
    if !io.is_empty() {
        // CDFs by request size at one setting of the other axes: io_uring if
        // measured, random if measured, the fewest workers, the lowest QD.
        let pick = |f: &dyn Fn(&ConditionSummary) -> String, prefer: &str| -> String {
            if io.iter().any(|r| f(r) == prefer) {
                prefer.to_string()
            } else {
                f(io[0])
            }
        };
        let engine = pick(&|r| r.engine.clone(), "io_uring");
        let pattern = pick(&|r| r.pattern.clone(), "random");
        let sel: Vec<&ConditionSummary> = io
            .iter()
            .copied()
            .filter(|r| r.engine == engine && r.pattern == pattern)
            .collect();
        let workers = sel.iter().map(|r| r.workers).min().unwrap_or(1);
        let qd = sel
            .iter()
            .filter(|r| r.workers == workers)
            .map(|r| r.queue_depth)
            .min()
            .unwrap_or(1);
        let by = latencies_by(df, rows, |r| {
            (r.sweep == "io"
                && r.engine == engine
                && r.pattern == pattern
                && r.workers == workers
                && r.queue_depth == qd)
                .then_some(r.block_size)
        })?;
        let series: Vec<Series> = by
            .into_iter()
            .map(|(bs, v)| Series {
                name: format_size(bs),
                points: cdf(v),
            })
            .collect();
        let title = format!("Read latency CDF by request size ({engine}, {pattern}, QD {qd}, {workers} worker(s))");
        written.push(write(
            &out.join("latency_cdf_by_size.svg"),
            &title,
            "read latency (µs, log scale)",
            "fraction of reads at or below",
            Some(1.0),
            &series,
        )?);

        let mut lines: BTreeMap<LineKey, Vec<(f64, f64)>> = BTreeMap::new();
        for r in &io {
            lines
                .entry((r.engine.clone(), r.pattern.clone(), r.block_size, r.workers))
                .or_default()
                .push((f64::from(r.queue_depth), r.throughput_bytes_s / (1 << 20) as f64));
        }
        let series: Vec<Series> = lines
            .into_iter()
            .map(|((e, p, bs, w), mut pts)| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: format!("{e} {p} {} w{w}", format_size(bs)),
                    points: pts,
                }
            })
            .collect();
        written.push(write(
            &out.join("throughput_vs_qd.svg"),
            "Read throughput against queue depth",
            "queue depth per worker (reads in flight, log scale)",
            "read throughput (MiB/s)",
            None,
            &series,
        )?);
    }
    if rows.iter().any(|r| r.sweep == "compute") {
        // Sparse FFN stage latency by neuron count, quiet, per thread count.
        let by = latencies_by(df, rows, |r| {
            (r.kernel == "ffn_stage" && !r.background_io).then_some((r.threads, r.neurons))
        })?;
        let series: Vec<Series> = by
            .into_iter()
            .take(MAX_LINES)
            .map(|((t, n), v)| Series {
                name: format!("{n} neurons, {t} thr"),
                points: cdf(v),
            })
            .collect();
        written.push(write(
            &out.join("ffn_stage_latency_cdf.svg"),
            "Sparse FFN stage latency CDF (no background I/O)",
            "stage latency (µs, log scale)",
            "fraction of stages at or below",
            Some(1.0),
            &series,
        )?);
        // Cost of splitting a layer into K stages: p50 against K.
        let mut lines: BTreeMap<(u32, bool), Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.kernel == "ffn_split") {
            lines
                .entry((r.threads, r.background_io))
                .or_default()
                .push((f64::from(r.stages), r.lat_p50_us));
        }
        let series: Vec<Series> = lines
            .into_iter()
            .map(|((t, bg), mut pts)| {
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: format!("{t} thr{}", if bg { ", bg I/O" } else { "" }),
                    points: pts,
                }
            })
            .collect();
        written.push(write(
            &out.join("ffn_split_p50_vs_stages.svg"),
            "Layer split into K stages: median latency",
            "stages K (log scale)",
            "median layer latency (µs)",
            None,
            &series,
        )?);
    }
    Ok(written)
}
