//! Empirical distributions from the profiler's Parquet traces.
//!
//! A traces directory is either one profiler run (it has `manifest.json`) or
//! a folder of runs (each subfolder with a `manifest.json`). Only committed
//! shards (listed in the manifest, SHA-256 checked by the profiler's shard
//! store) are read. Samples of even rounds are fitted; odd rounds are held
//! out for [`crate::sim`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use leanstream_profiler::shard::ShardStore;
use leanstream_runtime::control::{fingerprint_from_parts, TraceHash};
use polars::prelude::*;

use crate::error::{Result, SynthError};

/// A sorted sample of a random quantity.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Empirical {
    pub sorted: Vec<f64>,
}

impl Empirical {
    pub fn new(mut v: Vec<f64>) -> Self {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        Self { sorted: v }
    }
    pub fn len(&self) -> usize {
        self.sorted.len()
    }
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
    /// The `u`-quantile (u in [0,1)), inverse-CDF sampling with linear interpolation.
    pub fn quantile(&self, u: f64) -> f64 {
        let n = self.sorted.len();
        if n == 0 {
            return f64::NAN;
        }
        let x = u.clamp(0.0, 1.0) * (n - 1) as f64;
        let i = x.floor() as usize;
        let j = (i + 1).min(n - 1);
        let f = x - i as f64;
        self.sorted[i] * (1.0 - f) + self.sorted[j] * f
    }
    pub fn median(&self) -> f64 {
        self.quantile(0.5)
    }
    /// The fraction of the distribution at or below `x`: the inverse of
    /// [`Empirical::quantile`] (linear between samples; 0 when empty).
    pub fn cdf(&self, x: f64) -> f64 {
        let v = &self.sorted;
        let n = v.len();
        if n == 0 || x < v[0] {
            return 0.0;
        }
        if x >= v[n - 1] {
            return 1.0;
        }
        // v[i] <= x < v[i + 1]
        let i = v.partition_point(|&y| y <= x) - 1;
        let f = (x - v[i]) / (v[i + 1] - v[i]);
        (i as f64 + f) / (n - 1) as f64
    }
    pub fn mean(&self) -> f64 {
        self.sorted.iter().sum::<f64>() / self.sorted.len().max(1) as f64
    }
}

/// One half (fit or held out) of the fitted distributions.
#[derive(Clone, Debug, Default)]
pub struct Dists {
    /// Read latency in µs by (request bytes, queue depth): io_uring, random, 1 worker.
    pub read_lat_us: BTreeMap<(u64, u32), Empirical>,
    /// Per-visit throughput in bytes/s by (request bytes, queue depth).
    pub read_bw: BTreeMap<(u64, u32), Empirical>,
    /// Compute time per neuron, ns (`ffn_stage`, the largest neuron count, most threads, quiet).
    pub ns_per_neuron: Empirical,
    /// `ffn_split` latency of K stages over the median K = 1 latency, by K.
    pub split_ratio: BTreeMap<u32, Empirical>,
}

/// What the traces yielded.
#[derive(Clone, Debug)]
pub struct Fitted {
    pub fit: Dists,
    pub held_out: Dists,
    pub traces: Vec<TraceHash>,
    pub device_fingerprint: String,
    /// The directory fitted (for error messages).
    pub dir: PathBuf,
}

const MIN_SAMPLES: usize = 20;

/// The conditions the control model needs.
#[derive(Clone, Debug)]
pub struct Needs {
    pub block: u64,
    pub queue_depths: Vec<u32>,
    pub stages: Vec<u32>,
}

impl Fitted {
    /// Fails, naming every missing condition, unless each needed condition has
    /// at least 20 samples in both the fitted and the held-out half.
    pub fn check(&self, needs: &Needs) -> Result<()> {
        let mut missing = Vec::new();
        for (half, d) in [("fit", &self.fit), ("held-out", &self.held_out)] {
            for &q in &needs.queue_depths {
                let ok = d
                    .read_lat_us
                    .get(&(needs.block, q))
                    .is_some_and(|e| e.len() >= MIN_SAMPLES)
                    && d.read_bw.get(&(needs.block, q)).is_some_and(|e| !e.is_empty());
                if !ok {
                    missing.push(format!("{half}: io io_uring/random/{}B/qd{q}/w1", needs.block));
                }
            }
            if d.ns_per_neuron.len() < MIN_SAMPLES {
                missing.push(format!("{half}: compute ffn_stage (quiet)"));
            }
            for &k in &needs.stages {
                if d.split_ratio.get(&k).is_none_or(|e| e.len() < MIN_SAMPLES) {
                    missing.push(format!("{half}: compute ffn_split k{k} (and k1)"));
                }
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(SynthError::MissingConditions {
                path: self.dir.clone(),
                missing: missing.join(", "),
            })
        }
    }
}

const COLUMNS: [&str; 13] = [
    "sweep",
    "round",
    "engine",
    "pattern",
    "block_size",
    "queue_depth",
    "workers",
    "kernel",
    "neurons",
    "stages",
    "threads",
    "background_io",
    "latency_ns",
];

fn run_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.join("manifest.json").is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let rd = std::fs::read_dir(dir).map_err(|e| SynthError::io(dir, e))?;
    let mut out = Vec::new();
    for e in rd {
        let p = e.map_err(|e| SynthError::io(dir, e))?.path();
        if p.join("manifest.json").is_file() {
            out.push(p);
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(SynthError::Trace {
            path: dir.to_path_buf(),
            reason: "no profiler run here (no manifest.json in it or its subfolders)".into(),
        });
    }
    Ok(out)
}

fn device_fingerprint_of(run: &Path) -> Result<String> {
    let p = run.join("device.json");
    let text = std::fs::read(&p).map_err(|e| SynthError::io(&p, e))?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| SynthError::Trace {
        path: p.clone(),
        reason: format!("not JSON: {e}"),
    })?;
    let cpu = &v["cpu"];
    let (Some(arch), Some(model), Some(cpus), Some(mem)) = (
        cpu["arch"].as_str(),
        cpu["model"].as_str(),
        cpu["logical_cpus"].as_u64(),
        v["memory"]["total_bytes"].as_u64(),
    ) else {
        return Err(SynthError::Trace {
            path: p,
            reason: "missing cpu.arch, cpu.model, cpu.logical_cpus or memory.total_bytes".into(),
        });
    };
    Ok(fingerprint_from_parts(arch, model, cpus as usize, mem))
}

fn hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[derive(Default)]
struct Raw {
    lat: BTreeMap<(u64, u32), Vec<f64>>,
    /// (block, qd) -> per-visit (bytes, ns) as round -> (Σ bytes, Σ latency / qd).
    visits: BTreeMap<(u64, u32), BTreeMap<u32, (f64, f64)>>,
    stage: BTreeMap<(u32, u32), Vec<f64>>,
    split: BTreeMap<(u32, u32, u32), Vec<f64>>,
}

/// Reads every run under `dir` and fits the distributions.
pub fn fit_traces(dir: &Path) -> Result<Fitted> {
    let mut raw = [Raw::default(), Raw::default()];
    let mut traces = Vec::new();
    let mut fingerprint = None;
    for run in run_dirs(dir)? {
        let store = ShardStore::open(&run)?;
        let (df, problems, good) = store.load_columns(Some(&COLUMNS))?;
        if let Some(p) = problems.first() {
            return Err(SynthError::Trace {
                path: run.clone(),
                reason: format!("bad shard: {p:?}"),
            });
        }
        for e in &good {
            let sha = hex32(&e.sha256).ok_or_else(|| SynthError::Trace {
                path: run.join("manifest.json"),
                reason: format!("shard {}: bad sha256", e.file),
            })?;
            let name = format!("{}/{}", run.file_name().unwrap_or_default().to_string_lossy(), e.file);
            traces.push(TraceHash { name, sha256: sha });
        }
        if fingerprint.is_none() {
            fingerprint = Some(device_fingerprint_of(&run)?);
        }
        collect(&df, &mut raw).map_err(|e| SynthError::Trace {
            path: run.clone(),
            reason: e.to_string(),
        })?;
    }
    let [even, odd] = raw;
    Ok(Fitted {
        fit: finish(even),
        held_out: finish(odd),
        traces,
        device_fingerprint: fingerprint.unwrap_or_default(),
        dir: dir.to_path_buf(),
    })
}

fn collect(df: &DataFrame, raw: &mut [Raw; 2]) -> PolarsResult<()> {
    let sweep = df.column("sweep")?.str()?;
    let round = df.column("round")?.u32()?;
    let engine = df.column("engine")?.str()?;
    let pattern = df.column("pattern")?.str()?;
    let block = df.column("block_size")?.u64()?;
    let qd = df.column("queue_depth")?.u32()?;
    let workers = df.column("workers")?.u32()?;
    let kernel = df.column("kernel")?.str()?;
    let neurons = df.column("neurons")?.u32()?;
    let stages = df.column("stages")?.u32()?;
    let threads = df.column("threads")?.u32()?;
    let bg = df.column("background_io")?.bool()?;
    let lat = df.column("latency_ns")?.u64()?;
    for i in 0..df.height() {
        let (Some(r), Some(l)) = (round.get(i), lat.get(i)) else {
            continue;
        };
        let half = &mut raw[(r % 2) as usize];
        let l = l as f64;
        match sweep.get(i) {
            Some("io") => {
                if engine.get(i) != Some("io_uring") || pattern.get(i) != Some("random") || workers.get(i) != Some(1) {
                    continue;
                }
                let key = (block.get(i).unwrap_or(0), qd.get(i).unwrap_or(0));
                half.lat.entry(key).or_default().push(l / 1000.0);
                let v = half.visits.entry(key).or_default().entry(r).or_default();
                v.0 += key.0 as f64;
                v.1 += l / key.1.max(1) as f64;
            }
            Some("compute") => {
                if bg.get(i) != Some(false) {
                    continue;
                }
                let (n, k, t) = (
                    neurons.get(i).unwrap_or(0),
                    stages.get(i).unwrap_or(0),
                    threads.get(i).unwrap_or(0),
                );
                match kernel.get(i) {
                    Some("ffn_stage") if n > 0 => half.stage.entry((t, n)).or_default().push(l / n as f64),
                    Some("ffn_split") => half.split.entry((t, n, k)).or_default().push(l),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn finish(raw: Raw) -> Dists {
    let read_lat_us = raw.lat.into_iter().map(|(k, v)| (k, Empirical::new(v))).collect();
    // Throughput of a visit: bytes / (Σ latency / qd), the time the reads
    // occupied with qd in flight.
    let read_bw = raw
        .visits
        .into_iter()
        .map(|(k, v)| (k, Empirical::new(v.values().map(|(b, ns)| b / (ns * 1e-9)).collect())))
        .collect();
    // Most threads, then the largest neuron count.
    let ns_per_neuron = raw
        .stage
        .into_iter()
        .max_by_key(|(k, _)| *k)
        .map(|(_, v)| Empirical::new(v))
        .unwrap_or_default();
    let mut split_ratio = BTreeMap::new();
    if let Some(&(t, n, _)) = raw.split.keys().filter(|(_, _, k)| *k == 1).max() {
        let base = Empirical::new(raw.split.get(&(t, n, 1)).cloned().unwrap_or_default()).median();
        for ((tt, nn, k), v) in &raw.split {
            if (*tt, *nn) == (t, n) && base > 0.0 {
                split_ratio.insert(*k, Empirical::new(v.iter().map(|x| x / base).collect()));
            }
        }
    }
    Dists {
        read_lat_us,
        read_bw,
        ns_per_neuron,
        split_ratio,
    }
}

#[cfg(test)]
mod tests {
    use super::Empirical;

    #[test]
    fn cdf_inverts_quantile() {
        let e = Empirical::new(vec![40.0, 10.0, 20.0, 30.0, 50.0]);
        assert_eq!(e.cdf(5.0), 0.0);
        assert_eq!(e.cdf(50.0), 1.0);
        assert_eq!(e.cdf(99.0), 1.0);
        for u in [0.0, 0.1, 0.25, 0.6, 0.99] {
            assert!((e.cdf(e.quantile(u)) - u).abs() < 1e-12, "u = {u}");
        }
        assert_eq!(Empirical::new(vec![]).cdf(1.0), 0.0);
    }
}
