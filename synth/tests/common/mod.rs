//! Helpers shared by the synth integration tests: temp dirs, the SmolLM2
//! model when present, and a small real activation trace.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use leanstream_runtime::generate::sampler::Rng;
use leanstream_synth::fit::{Dists, Empirical, Fitted};
use leanstream_synth::model::{ActionSpace, GridSpec, ModelParams};
use leanstream_synth::solve::SolverSettings;
use leanstream_synth::synth::SynthConfig;

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::record::{record, RecordOptions};

pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("synth-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// SmolLM2 from `$LEANSTREAM_SMOLLM2` or the fetch cache; a missing model
/// fails the test unless `LEANSTREAM_ALLOW_MISSING_MODELS=1` (then `None`).
pub fn smollm2() -> Option<PathBuf> {
    leanstream_runtime::fetch::reference_model("smollm2").unwrap_or_else(|e| panic!("{e}"))
}

pub fn record_trace(model: &Path, dir: &Path) -> Trace {
    let out = dir.join("acts");
    record(&RecordOptions {
        model: model.to_path_buf(),
        train: vec![repo().join("data/text/apache-2.0.txt")],
        heldout: vec![repo().join("data/text/gpl-3.0-excerpt.txt")],
        out: out.clone(),
        ctx: 128,
        shard_tokens: 256,
        max_tokens: Some(512),
        hot_fraction: 0.1,
        progress: false,
    })
    .unwrap();
    Trace::open(&out).unwrap()
}

/// Synthetic profiled distributions (a 65 KiB request at queue depths 1,
/// 4, 16; FFN stage and split ratios for K = 1, 2, 4).
pub fn spread(rng: &mut Rng, center: f64, rel: f64, n: usize) -> Empirical {
    Empirical::new((0..n).map(|_| center * (1.0 + rel * (rng.uniform() - 0.3))).collect())
}

pub fn dists(seed: u64) -> Dists {
    let mut r = Rng::with_stream(seed, 0);
    let mut d = Dists::default();
    for q in [1u32, 4, 16] {
        let lat = 150.0 + 40.0 * q as f64;
        d.read_lat_us.insert((65536, q), spread(&mut r, lat, 0.8, 400));
        let bw = 65536.0 * q as f64 / (lat * 1e-6);
        d.read_bw.insert((65536, q), spread(&mut r, bw, 0.3, 30));
    }
    d.ns_per_neuron = spread(&mut r, 120.0, 0.5, 400);
    let mut split = BTreeMap::new();
    for k in [1u32, 2, 4] {
        split.insert(k, spread(&mut r, 1.0 + 0.08 * (k - 1) as f64, 0.2, 400));
    }
    d.split_ratio = split;
    d
}

pub fn fitted() -> Fitted {
    Fitted {
        fit: dists(1),
        held_out: dists(2),
        traces: vec![],
        device_fingerprint: "x86_64/synthetic/2cpu/24GiB".into(),
        dir: PathBuf::from("/synthetic"),
    }
}

pub fn small_cfg() -> SynthConfig {
    SynthConfig {
        params: ModelParams {
            n_layers: 6,
            ..ModelParams::default()
        },
        space: ActionSpace {
            stages: vec![1, 4],
            queue_depths: vec![1, 16],
            prefetch_breadths: vec![1.0, 2.5],
            deadline_factors: vec![2.0, 16.0],
        },
        grid: GridSpec {
            queued: 3,
            missing: 3,
            bandwidth: 2,
            compute: 2,
            position: 3,
        },
        solver: SolverSettings {
            horizon: 3,
            scenarios: 4,
            ..SolverSettings::default()
        },
        seed: 3,
        model_sha256: None,
    }
}
