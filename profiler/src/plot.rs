//! Hand-written SVG line charts: latency CDFs by request size and
//! throughput against queue depth (I/O runs), latency CDFs by kernel size
//! (compute runs).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use polars::prelude::DataFrame;

use crate::summary::{latencies_by, ConditionSummary};
use crate::units::format_size;
use crate::{ProfileError, Result};

/// (engine, pattern, block size, workers) of a throughput line.
type LineKey = (String, String, u64, u32);

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.abs() < 0.01 {
        format!("{v:.0e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// A line chart; `xlog` puts x on a log10 scale (x must be > 0).
/// `ymax` fixes the top of the y axis (e.g. 1 for a CDF).
pub fn line_chart(title: &str, xlabel: &str, ylabel: &str, xlog: bool, ymax: Option<f64>, series: &[Series]) -> String {
    let (w, h) = (900.0, 540.0);
    let (l, r, t, b) = (80.0, 230.0, 50.0, 60.0);
    let (pw, ph) = (w - l - r, h - t - b);
    let tx = |x: f64| if xlog { x.max(1e-12).log10() } else { x };
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for &(x, y) in pts {
        x0 = x0.min(tx(x));
        x1 = x1.max(tx(x));
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if xlog {
        x0 = x0.floor();
        x1 = x1.ceil();
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= 0.0 {
        y1 = 1.0;
    }
    let y1 = ymax.unwrap_or(y1 * 1.05);
    let sx = |x: f64| l + (tx(x) - x0) / (x1 - x0) * pw;
    let sy = |y: f64| t + ph - y / y1 * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
        l + pw / 2.0,
        esc(title)
    );
    // Grid and ticks.
    let xticks: Vec<f64> = if xlog {
        (x0 as i32..=x1 as i32).map(|e| 10f64.powi(e)).collect()
    } else {
        (0..=5).map(|i| x0 + (x1 - x0) * f64::from(i) / 5.0).collect()
    };
    for x in xticks {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{t}" x2="{px:.1}" y2="{}" stroke="#ddd"/>"##,
            t + ph
        );
        let _ = writeln!(
            s,
            r#"<text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"#,
            t + ph + 18.0,
            fmt_tick(x)
        );
    }
    for i in 0..=5 {
        let y = y1 * f64::from(i) / 5.0;
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{l}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#ddd"/>"##,
            l + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            l - 6.0,
            py + 4.0,
            fmt_tick(y)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{l}" y="{t}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        l + pw / 2.0,
        h - 15.0,
        esc(xlabel)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(20,{}) rotate(-90)" text-anchor="middle">{}</text>"#,
        t + ph / 2.0,
        esc(ylabel)
    );
    for (i, se) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = se
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        if se.points.len() <= 16 {
            for &(x, y) in &se.points {
                let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, sx(x), sy(y));
            }
        }
        let ly = t + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/>"#,
            l + pw + 12.0,
            l + pw + 32.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            l + pw + 38.0,
            ly + 4.0,
            esc(&se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

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

fn write(path: &Path, svg: &str) -> Result<PathBuf> {
    std::fs::write(path, svg).map_err(|e| ProfileError::io(path, e))?;
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
            &line_chart(
                &title,
                "latency (µs, log)",
                "fraction of reads ≤ latency",
                true,
                Some(1.0),
                &series,
            ),
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
            &line_chart(
                "Read throughput against queue depth",
                "queue depth per worker (log)",
                "MiB/s",
                true,
                None,
                &series,
            ),
        )?);
    }
    if rows.iter().any(|r| r.sweep == "compute") {
        // Sparse FFN stage latency by neuron count, quiet, per thread count.
        let by = latencies_by(df, rows, |r| {
            (r.kernel == "ffn_stage" && !r.background_io).then_some((r.threads, r.neurons))
        })?;
        let series: Vec<Series> = by
            .into_iter()
            .take(COLORS.len())
            .map(|((t, n), v)| Series {
                name: format!("{n} neurons, {t} thr"),
                points: cdf(v),
            })
            .collect();
        written.push(write(
            &out.join("ffn_stage_latency_cdf.svg"),
            &line_chart(
                "Sparse FFN stage latency CDF (no background I/O)",
                "latency (µs, log)",
                "fraction ≤ latency",
                true,
                Some(1.0),
                &series,
            ),
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
            &line_chart(
                "Layer split into K stages: p50 latency",
                "stages K (log)",
                "p50 µs",
                true,
                None,
                &series,
            ),
        )?);
    }
    Ok(written)
}
