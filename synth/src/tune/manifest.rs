//! `tune.json`: what each step of a tune run took in and put out. A step
//! is skipped when its recorded inputs equal this run's and its outputs are
//! still the bytes it wrote; otherwise it runs again. The file is replaced
//! atomically after each step, so a kill at any point loses at most the step
//! in progress, and a resumable step (the traces, the profiles) continues
//! from what it committed when its inputs are the ones it started with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, SynthError};

pub const FORMAT: &str = "leanstream-tune";
pub const VERSION: u32 = 1;
pub const FILE: &str = "tune.json";

/// One file a step wrote, relative to the output directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Output {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// A finished step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// SHA-256 of the canonical JSON of `inputs`.
    pub inputs_key: String,
    /// Settings and the hashes of the files the step read.
    pub inputs: serde_json::Value,
    pub outputs: Vec<Output>,
    /// Wall time of the session that finished it (a resumed step counts
    /// its last session only; `sessions` says how many it took).
    pub seconds: f64,
    /// The step's share of `--budget`.
    pub budget_s: f64,
    pub sessions: u32,
    pub finished_unix: u64,
    /// What the step measured (its report's numbers).
    pub summary: serde_json::Value,
}

/// A step that was started and not finished: its partial state belongs to
/// these inputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    pub step: String,
    pub inputs_key: String,
    pub sessions: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub model: String,
    pub model_sha256: String,
    pub device: String,
    pub budget_s: f64,
    /// Times the command was started on this directory.
    pub sessions: u32,
    pub pending: Option<Pending>,
    pub steps: BTreeMap<String, StepRecord>,
}

impl Manifest {
    pub fn new(model: &Path, model_sha256: &str, device: &str, budget_s: f64) -> Self {
        Self {
            format: FORMAT.into(),
            version: VERSION,
            model: model.display().to_string(),
            model_sha256: model_sha256.into(),
            device: device.into(),
            budget_s,
            sessions: 0,
            pending: None,
            steps: BTreeMap::new(),
        }
    }

    /// The manifest in `dir`, if there is one; a damaged one is an error
    /// naming it (delete it to start over).
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(SynthError::io(&path, e)),
        };
        let m: Self = serde_json::from_slice(&bytes).map_err(|e| SynthError::Trace {
            path: path.clone(),
            reason: format!("not a tune manifest ({e}); delete it to start the run over"),
        })?;
        if m.format != FORMAT || m.version != VERSION {
            return Err(SynthError::Trace {
                path,
                reason: format!("format {} version {}, expected {FORMAT} {VERSION}", m.format, m.version),
            });
        }
        Ok(Some(m))
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(|e| SynthError::Settings(e.to_string()))?;
        leanstream_profiler::shard::write_atomic(&dir.join(FILE), &json)?;
        Ok(())
    }
}

/// SHA-256 of a JSON value's text (serde_json writes object keys in order).
pub fn key_of(inputs: &serde_json::Value) -> String {
    leanstream_runtime::fetch::hex(&Sha256::digest(inputs.to_string().as_bytes()))
}

/// The record of `path` (relative to `dir`) as it is now.
pub fn output(dir: &Path, path: &str) -> Result<Output> {
    let full = dir.join(path);
    let bytes = std::fs::metadata(&full).map_err(|e| SynthError::io(&full, e))?.len();
    Ok(Output {
        path: path.into(),
        sha256: leanstream_runtime::fetch::sha256_file(&full)?,
        bytes,
    })
}

/// Whether every output of `rec` is still in `dir` with the bytes recorded
/// (size first: a changed size needs no hashing).
pub fn outputs_intact(dir: &Path, rec: &StepRecord) -> bool {
    rec.outputs.iter().all(|o| {
        let full: PathBuf = dir.join(&o.path);
        std::fs::metadata(&full).is_ok_and(|m| m.len() == o.bytes)
            && leanstream_runtime::fetch::sha256_file(&full).is_ok_and(|s| s == o.sha256)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run reads the manifest and writes it again: every number
    /// must come back bit for bit (without serde_json's `float_roundtrip`,
    /// -7.4940054162198085e-19 came back as -7.494005416219808e-19).
    #[test]
    fn a_saved_manifest_loads_back_bit_for_bit() {
        let dir = std::env::temp_dir().join(format!("leanstream-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = Manifest::new(Path::new("m.gguf"), "00", "dev", 60.0);
        let values: [f64; 5] = [
            -7.4940054162198085e-19,
            0.1 + 0.2,
            1.0 / 3.0,
            2.2250738585072014e-308,
            1e300 / 7.0,
        ];
        m.steps.insert(
            "controller".into(),
            StepRecord {
                inputs_key: "k".into(),
                inputs: serde_json::json!({}),
                outputs: vec![],
                seconds: 0.1 + 0.7,
                budget_s: 60.0,
                sessions: 1,
                finished_unix: 0,
                summary: serde_json::json!({ "values": values }),
            },
        );
        m.save(&dir).unwrap();
        let back = Manifest::load(&dir).unwrap().unwrap();
        assert_eq!(back, m);
        let got: Vec<f64> = serde_json::from_value(back.steps["controller"].summary["values"].clone()).unwrap();
        assert!(
            got.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{got:?}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
