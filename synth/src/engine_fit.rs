//! The control model fitted to the engine itself: read latencies per queue
//! depth as `speculate` saw them (`leanstream bench --json`'s
//! `read_latency`, from runs with one action pinned per queue depth), and
//! the engine's compute time per neuron.
//!
//! Why: the profiler measures fixed-size blocks on an idle machine, the
//! engine issues merged runs of bundles of other sizes, reaped by a thread
//! that shares the cores with compute. Solved on the profile alone, the
//! table chose one read in flight where every good action in the engine
//! keeps sixteen (README, "Does the table earn its place").

use std::path::{Path, PathBuf};

use leanstream_runtime::flash::io::DepthLatency;
use serde::Serialize;

use crate::error::{Result, SynthError};
use crate::fit::{Dists, Empirical, Fitted};
use crate::model::ModelParams;

/// What the engine runs showed.
#[derive(Clone, Debug, Serialize)]
pub struct EngineFit {
    /// Mean bytes per read over every depth, rounded up to 4 KiB: the
    /// model's request size.
    pub block: u64,
    /// Latency percentiles (µs) per queue depth, runs at the same depth merged.
    pub latency_us: Vec<(u32, Vec<f64>)>,
    /// Median compute time per computed neuron row in the engine (ns), if
    /// the runs reported it.
    pub ns_per_neuron: Option<f64>,
    /// Median neuron rows per layer the engine computed besides those it
    /// read (its neuron cache's), if the runs reported their rows.
    pub resident_rows: Option<f64>,
    pub runs: Vec<PathBuf>,
}

/// What one run adds to the fit.
struct Run {
    latency: Vec<DepthLatency>,
    ns_per_neuron: Option<f64>,
    resident_rows: Option<f64>,
}

/// One `bench --json` report's share of the fit, for a model of
/// `n_layers × n_ff` neurons.
fn read_run(path: &Path, n_layers: usize, n_ff: usize) -> Result<Run> {
    let text = std::fs::read_to_string(path).map_err(|e| SynthError::io(path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| SynthError::Trace {
        path: path.into(),
        reason: format!("not a bench JSON report: {e}"),
    })?;
    let latency: Vec<DepthLatency> =
        serde_json::from_value(v["read_latency"].clone()).map_err(|e| SynthError::Trace {
            path: path.into(),
            reason: format!("no `read_latency` (a streaming policy's bench report has one): {e}"),
        })?;
    // Compute seconds per token over the neuron rows computed per token:
    // what the engine's controller measures as its compute state (reports
    // from before that count: the kept neurons instead).
    let neurons = (n_layers * n_ff) as f64;
    let compute_s = v["time_per_token"]["compute_s"].as_f64();
    let rows = v["rows_computed_per_token"].as_f64();
    let per_row = rows.or_else(|| v["skipped_fraction"].as_f64().map(|s| (1.0 - s) * neurons));
    let ns_per_neuron = match (compute_s, per_row) {
        (Some(c), Some(k)) if c > 0.0 && k > 0.0 => Some(c * 1e9 / k),
        _ => None,
    };
    // Rows computed but not read came from the cache.
    let bundle = v["ffn_total_bytes"].as_f64().map(|b| b / neurons);
    let resident_rows = match (rows, v["bytes_requested_per_token"].as_f64(), bundle) {
        (Some(r), Some(req), Some(b)) if b > 0.0 => Some(((r - req / b) / n_layers as f64).max(0.0)),
        _ => None,
    };
    Ok(Run {
        latency,
        ns_per_neuron,
        resident_rows,
    })
}

/// Fits `runs` (bench JSON reports of a model with `n_layers × n_ff` neurons).
pub fn fit_engine(runs: &[PathBuf], n_layers: usize, n_ff: usize) -> Result<EngineFit> {
    let mut by_q: std::collections::BTreeMap<u32, Vec<f64>> = Default::default();
    let (mut bytes, mut reads) = (0.0f64, 0.0f64);
    let (mut ns, mut resident) = (Vec::new(), Vec::new());
    for p in runs {
        let run = read_run(p, n_layers, n_ff)?;
        for d in run.latency {
            bytes += d.mean_bytes * d.reads as f64;
            reads += d.reads as f64;
            by_q.entry(d.queue_depth).or_default().extend(d.latency_us);
        }
        ns.extend(run.ns_per_neuron);
        resident.extend(run.resident_rows);
    }
    if reads == 0.0 {
        return Err(SynthError::Settings(format!(
            "engine fit: no reads in {} run(s) ({})",
            runs.len(),
            runs.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let block = ((bytes / reads / 4096.0).ceil() as u64).max(1) * 4096;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    Ok(EngineFit {
        block,
        latency_us: by_q.into_iter().collect(),
        ns_per_neuron: median(ns),
        resident_rows: median(resident),
        runs: runs.to_vec(),
    })
}

impl EngineFit {
    /// Queue depths the runs covered.
    pub fn queue_depths(&self) -> Vec<u32> {
        self.latency_us.iter().map(|(q, _)| *q).collect()
    }

    /// The probed depth nearest `wanted`: the bandwidth axis is read at a
    /// reference depth, which must be one the probe ran.
    pub fn reference_depth(&self, wanted: u32) -> u32 {
        self.queue_depths()
            .into_iter()
            .min_by_key(|q| q.abs_diff(wanted))
            .unwrap_or(wanted)
    }

    /// Puts the engine's latencies in place of the profile's at the
    /// engine's request size (the throughput at each depth follows from
    /// them: q reads of `block` bytes per latency), and scales the profiled
    /// compute time per neuron to the engine's median, keeping its spread.
    /// Returns the request size the model must use.
    fn apply(&self, d: &mut Dists) -> u64 {
        for (q, lat) in &self.latency_us {
            let e = Empirical::new(lat.clone());
            let bw = e
                .sorted
                .iter()
                .map(|&us| *q as f64 * self.block as f64 / (us.max(1e-3) * 1e-6))
                .collect();
            d.read_lat_us.insert((self.block, *q), e);
            d.read_bw.insert((self.block, *q), Empirical::new(bw));
        }
        if let Some(ns) = self.ns_per_neuron {
            let m = d.ns_per_neuron.median();
            if m.is_finite() && m > 0.0 {
                let scale = ns / m;
                d.ns_per_neuron = Empirical::new(d.ns_per_neuron.sorted.iter().map(|x| x * scale).collect());
            } else {
                d.ns_per_neuron = Empirical::new(vec![ns; 32]);
            }
        }
        self.block
    }

    /// Applies the fit to both halves of `fitted` and to the model's
    /// settings: the engine's request size, a probed reference depth and
    /// the rows its cache adds to each layer's compute.
    pub fn apply_to(&self, fitted: &mut Fitted, params: &mut ModelParams) {
        self.apply(&mut fitted.fit);
        params.block = self.apply(&mut fitted.held_out);
        params.ref_qd = self.reference_depth(params.ref_qd);
        if let Some(r) = self.resident_rows {
            params.resident_rows = r;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of this test process for the test `name`.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leanstream-engine-fit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn report(dir: &Path, name: &str, q: u32, lat: f64, bytes: f64, compute_s: f64) -> PathBuf {
        let p = dir.join(name);
        let v = serde_json::json!({
            "read_latency": [{"queue_depth": q, "reads": 100, "mean_bytes": bytes,
                              "latency_us": vec![lat; 101]}],
            "time_per_token": {"compute_s": compute_s},
            "skipped_fraction": 0.5,
        });
        std::fs::write(&p, v.to_string()).unwrap();
        p
    }

    #[test]
    fn engine_latencies_replace_the_profile_at_the_engine_request_size() {
        let dir = scratch("latencies");
        let runs = vec![
            report(&dir, "q1.json", 1, 100.0, 20000.0, 0.010),
            report(&dir, "q16.json", 16, 400.0, 20000.0, 0.030),
        ];
        // 2 layers × 1000 neurons, half kept: 1000 neurons per token.
        let f = fit_engine(&runs, 2, 1000).unwrap();
        assert_eq!(f.block, 20480);
        assert_eq!(f.queue_depths(), vec![1, 16]);
        assert_eq!(f.ns_per_neuron, Some(30000.0));
        let mut d = Dists {
            read_lat_us: Default::default(),
            read_bw: Default::default(),
            ns_per_neuron: Empirical::new(vec![10.0, 20.0, 30.0]),
            split_ratio: Default::default(),
        };
        assert_eq!(f.apply(&mut d), 20480);
        assert_eq!(d.read_lat_us[&(20480, 16)].median(), 400.0);
        // 16 reads of 20 KiB per 400 µs.
        let bw16 = d.read_bw[&(20480, 16)].median();
        assert!((bw16 - 16.0 * 20480.0 / 400e-6).abs() < 1.0, "{bw16}");
        // The profile's spread, moved to the engine's median.
        assert_eq!(d.ns_per_neuron.sorted, vec![15000.0, 30000.0, 45000.0]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn counted_rows_give_the_compute_per_row_and_the_cache_rows() {
        let dir = scratch("rows");
        let p = dir.join("q4.json");
        // 2 layers × 1000 neurons of 100 bytes; 1200 rows computed per
        // token, 800 of them read: 200 per layer from the cache.
        let v = serde_json::json!({
            "read_latency": [{"queue_depth": 4, "reads": 10, "mean_bytes": 8000.0, "latency_us": vec![50.0; 101]}],
            "time_per_token": {"compute_s": 0.0012},
            "skipped_fraction": 0.5,
            "rows_computed_per_token": 1200.0,
            "bytes_requested_per_token": 80000.0,
            "ffn_total_bytes": 200000.0,
        });
        std::fs::write(&p, v.to_string()).unwrap();
        let f = fit_engine(std::slice::from_ref(&p), 2, 1000).unwrap();
        assert!(
            (f.ns_per_neuron.unwrap() - 1000.0).abs() < 1e-6,
            "{:?}",
            f.ns_per_neuron
        );
        assert!((f.resident_rows.unwrap() - 200.0).abs() < 1e-9, "{:?}", f.resident_rows);
        let mut params = ModelParams::default();
        let mut fitted = Fitted {
            fit: Dists::default(),
            held_out: Dists::default(),
            traces: vec![],
            device_fingerprint: String::new(),
            dir: dir.clone(),
        };
        f.apply_to(&mut fitted, &mut params);
        assert_eq!((params.block, params.ref_qd, params.resident_rows), (8192, 4, 200.0));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_report_without_latencies_is_refused_by_name() {
        let dir = scratch("bad");
        let p = dir.join("dense.json");
        std::fs::write(&p, r#"{"decode_tok_s": 10}"#).unwrap();
        let e = fit_engine(std::slice::from_ref(&p), 2, 10).unwrap_err().to_string();
        assert!(e.contains("dense.json") && e.contains("read_latency"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
