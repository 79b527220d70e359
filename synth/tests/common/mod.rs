//! Helpers shared by the synth integration tests: temp dirs, the SmolLM2
//! model when present, and a small real activation trace.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

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
