//! Append-only Parquet shards and the manifest that commits them.
//!
//! A run directory holds `plan.json`, `device*.json`, `manifest.json` and
//! `shards/shard-NNNNNN.parquet`. Committing a shard:
//!
//! 1. write `shards/shard-NNNNNN.parquet.tmp`, `fsync` it;
//! 2. rename it to `shard-NNNNNN.parquet`, `fsync` the directory;
//! 3. write `manifest.json.tmp` listing the shard with its row count, byte
//!    length and SHA-256, `fsync`, rename over `manifest.json`, `fsync` the
//!    directory.
//!
//! A sample exists once step 3 is done. A kill before that leaves a file the
//! manifest does not list; resume moves it to `quarantine/` and measures its
//! samples again. A listed shard whose length, checksum or Parquet footer is
//! wrong (truncated, bit rot) is reported by name and skipped; the other
//! shards stay usable.

use std::fs;
use std::path::{Path, PathBuf};

use polars::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{ProfileError, Result};

/// One measured sample: one read request (I/O) or one kernel call (compute).
/// The Parquet columns carry these names and types (see the README).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleRow {
    pub run_id: String,
    pub sweep: String,
    pub condition_id: u32,
    pub condition: String,
    pub round: u32,
    pub sample_idx: u64,
    pub engine: String,
    pub pattern: String,
    pub block_size: u64,
    pub queue_depth: u32,
    pub workers: u32,
    pub kernel: String,
    pub neurons: u32,
    pub stages: u32,
    pub ctx_len: u32,
    pub threads: u32,
    pub background_io: bool,
    pub worker: u32,
    pub offset: u64,
    pub bytes: u64,
    pub latency_ns: u64,
    pub unix_ns: u64,
    pub batch_wall_ns: u64,
    pub batch_bytes: u64,
    pub batch_samples: u32,
    pub device_read_bytes: Option<u64>,
    pub temp_c: Option<f32>,
}

/// Rows → DataFrame with the documented schema.
pub fn to_frame(rows: &[SampleRow]) -> Result<DataFrame> {
    macro_rules! col {
        ($name:literal, $f:ident) => {
            Column::new(
                $name.into(),
                rows.iter().map(|r| r.$f.clone()).collect::<Vec<_>>(),
            )
        };
    }
    let cols = vec![
        col!("run_id", run_id),
        col!("sweep", sweep),
        col!("condition_id", condition_id),
        col!("condition", condition),
        col!("round", round),
        col!("sample_idx", sample_idx),
        col!("engine", engine),
        col!("pattern", pattern),
        col!("block_size", block_size),
        col!("queue_depth", queue_depth),
        col!("workers", workers),
        col!("kernel", kernel),
        col!("neurons", neurons),
        col!("stages", stages),
        col!("ctx_len", ctx_len),
        col!("threads", threads),
        col!("background_io", background_io),
        col!("worker", worker),
        col!("offset", offset),
        col!("bytes", bytes),
        col!("latency_ns", latency_ns),
        col!("unix_ns", unix_ns),
        col!("batch_wall_ns", batch_wall_ns),
        col!("batch_bytes", batch_bytes),
        col!("batch_samples", batch_samples),
        col!("device_read_bytes", device_read_bytes),
        col!("temp_c", temp_c),
    ];
    Ok(DataFrame::new(rows.len(), cols)?)
}

/// A committed shard as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// Relative to the run directory.
    pub file: String,
    pub rows: u64,
    pub bytes: u64,
    pub sha256: String,
    pub first_round: u32,
    pub last_round: u32,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub run_id: String,
    /// Budget seconds spent by all sessions up to the last commit.
    pub spent_s: f64,
    /// Highest round of any committed sample.
    pub last_round: u32,
    /// Sessions that wrote to this run (1 + resumes).
    pub sessions: u32,
    /// Set when the plan finished (complete or out of budget).
    pub finished: Option<String>,
    pub shards: Vec<ShardEntry>,
}

pub const MANIFEST: &str = "manifest.json";
pub const SHARDS: &str = "shards";
pub const QUARANTINE: &str = "quarantine";

/// Writes `bytes` to `path` whole or not at all
/// ([`leanstream_runtime::durable`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    leanstream_runtime::durable::write(path, bytes).map_err(|e| ProfileError::io(path, e))
}

/// A problem with one shard, found while loading.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardProblem {
    pub path: PathBuf,
    pub problem: String,
}

impl std::fmt::Display for ShardProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.problem)
    }
}

/// The shard store of one run directory.
pub struct ShardStore {
    dir: PathBuf,
    pub manifest: Manifest,
}

impl ShardStore {
    /// Creates the layout for a new run (fails if a manifest exists).
    pub fn create(dir: &Path, run_id: &str) -> Result<Self> {
        fs::create_dir_all(dir.join(SHARDS)).map_err(|e| ProfileError::io(dir, e))?;
        if dir.join(MANIFEST).exists() {
            return Err(ProfileError::Invalid(format!(
                "{} already holds a run; use --resume {} to continue it",
                dir.display(),
                dir.display()
            )));
        }
        let store = Self {
            dir: dir.to_path_buf(),
            manifest: Manifest {
                format: "leanstream-profile".into(),
                version: 1,
                run_id: run_id.into(),
                spent_s: 0.0,
                last_round: 0,
                sessions: 1,
                finished: None,
                shards: Vec::new(),
            },
        };
        store.write_manifest()?;
        Ok(store)
    }

    /// Opens an existing run directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = fs::read(&path).map_err(|e| ProfileError::io(&path, e))?;
        let manifest: Manifest = serde_json::from_slice(&text).map_err(|source| ProfileError::Json { path, source })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn write_manifest(&self) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(&self.manifest).map_err(|source| ProfileError::Json {
            path: self.dir.join(MANIFEST),
            source,
        })?;
        write_atomic(&self.dir.join(MANIFEST), &bytes)
    }

    /// Commits `rows` as the next shard and records `spent_s` (steps 1–3 above).
    pub fn commit(&mut self, rows: &[SampleRow], spent_s: f64) -> Result<()> {
        self.commit_frame(to_frame(rows)?, spent_s)
    }

    /// [`Self::commit`] of a frame with the [`to_frame`] schema.
    pub fn commit_frame(&mut self, mut df: DataFrame, spent_s: f64) -> Result<()> {
        self.manifest.spent_s = spent_s;
        if df.height() == 0 {
            return self.write_manifest();
        }
        if df.schema() != to_frame(&[])?.schema() {
            return Err(ProfileError::Invalid(
                "shard frame does not have the trace schema".into(),
            ));
        }
        let n = self
            .manifest
            .shards
            .iter()
            .filter_map(|s| {
                s.file
                    .strip_prefix("shards/shard-")?
                    .strip_suffix(".parquet")?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .map_or(0, |m| m + 1);
        let rel = format!("{SHARDS}/shard-{n:06}.parquet");
        let path = self.dir.join(&rel);
        let mut buf = Vec::new();
        ParquetWriter::new(&mut buf)
            .finish(&mut df)
            .map_err(|source| ProfileError::Parquet {
                path: path.clone(),
                source,
            })?;
        write_atomic(&path, &buf)?;
        let rounds = df.column("round")?.u32()?;
        let first_round = rounds.min().unwrap_or(0);
        let last_round = rounds.max().unwrap_or(0);
        self.manifest.last_round = self.manifest.last_round.max(last_round);
        self.manifest.shards.push(ShardEntry {
            file: rel,
            rows: df.height() as u64,
            bytes: buf.len() as u64,
            sha256: leanstream_runtime::fetch::hex(&Sha256::digest(&buf)),
            first_round,
            last_round,
        });
        self.write_manifest()
    }

    /// Reads and checks one listed shard.
    fn load_one(&self, s: &ShardEntry, columns: Option<&[&str]>) -> std::result::Result<DataFrame, String> {
        let path = self.dir.join(&s.file);
        let bytes = fs::read(&path).map_err(|e| format!("unreadable: {e}"))?;
        if bytes.len() as u64 != s.bytes {
            return Err(format!(
                "truncated or altered: {} bytes, manifest says {}",
                bytes.len(),
                s.bytes
            ));
        }
        let sum = leanstream_runtime::fetch::hex(&Sha256::digest(&bytes));
        if sum != s.sha256 {
            return Err(format!("checksum mismatch (sha256 {sum}, manifest says {})", s.sha256));
        }
        // The Parquet reader panics on some damaged files (found by fuzzing,
        // e.g. a thrift field of the wrong type); that is a bad shard too.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::parquet_check::check(&bytes, s.rows)?;
            ParquetReader::new(std::io::Cursor::new(bytes))
                .with_columns(columns.map(|c| c.iter().map(|s| s.to_string()).collect()))
                .finish()
        }));
        let df = match read {
            Ok(r) => r.map_err(|e| format!("not a readable Parquet file: {e}"))?,
            Err(panic) => {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                return Err(format!("not a readable Parquet file (the reader failed: {why})"));
            }
        };
        // Same column order as requested, whatever the reader returns.
        let df = match columns {
            Some(c) => df
                .select(c.iter().copied())
                .map_err(|e| format!("missing columns: {e}"))?,
            None => df,
        };
        if df.height() as u64 != s.rows {
            return Err(format!("{} rows, manifest says {}", df.height(), s.rows));
        }
        Ok(df)
    }

    /// All committed samples of valid shards as one frame, plus the problems
    /// of the shards that were skipped.
    pub fn load(&self) -> Result<(DataFrame, Vec<ShardProblem>, Vec<ShardEntry>)> {
        self.load_columns(None)
    }

    /// [`Self::load`] reading only `columns` (all when `None`); every shard
    /// is still checked in full (length and SHA-256).
    pub fn load_columns(&self, columns: Option<&[&str]>) -> Result<(DataFrame, Vec<ShardProblem>, Vec<ShardEntry>)> {
        let mut frames = Vec::new();
        let mut problems = Vec::new();
        let mut good = Vec::new();
        for s in &self.manifest.shards {
            match self.load_one(s, columns) {
                Ok(df) => {
                    frames.push(df);
                    good.push(s.clone());
                }
                Err(problem) => problems.push(ShardProblem {
                    path: self.dir.join(&s.file),
                    problem,
                }),
            }
        }
        let mut all = to_frame(&[])?;
        if let Some(c) = columns {
            all = all.select(c.iter().copied())?;
        }
        for df in frames {
            all.vstack_mut(&df)?;
        }
        Ok((all, problems, good))
    }

    /// Before resuming: moves bad shards and files no manifest entry lists
    /// (interrupted commits) to `quarantine/`, drops bad entries from the
    /// manifest, and returns the valid samples and what was moved.
    pub fn recover(&mut self) -> Result<(DataFrame, Vec<ShardProblem>)> {
        let (df, mut problems, good) = self.load_columns(Some(&["condition_id", "sample_idx", "latency_ns"]))?;
        let q = self.dir.join(QUARANTINE);
        let listed: std::collections::HashSet<String> = good.iter().map(|s| s.file.clone()).collect();
        let shard_dir = self.dir.join(SHARDS);
        let mut entries: Vec<_> = fs::read_dir(&shard_dir)
            .map_err(|e| ProfileError::io(&shard_dir, e))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        entries.sort();
        for name in entries {
            let rel = format!("{SHARDS}/{name}");
            if listed.contains(&rel) {
                continue;
            }
            let from = shard_dir.join(&name);
            if !problems.iter().any(|p| p.path == from) {
                problems.push(ShardProblem {
                    path: from.clone(),
                    problem: "not in the manifest (interrupted commit); its samples will be measured again".into(),
                });
            }
            fs::create_dir_all(&q).map_err(|e| ProfileError::io(&q, e))?;
            let to = q.join(format!("{}-{name}", self.manifest.sessions));
            fs::rename(&from, &to).map_err(|e| ProfileError::io(&from, e))?;
        }
        self.manifest.shards = good;
        self.manifest.sessions += 1;
        self.write_manifest()?;
        Ok((df, problems))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn rows(n: u64, round: u32) -> Vec<SampleRow> {
        (0..n)
            .map(|i| SampleRow {
                run_id: "t".into(),
                sweep: "io".into(),
                condition_id: (i % 2) as u32,
                round,
                sample_idx: i / 2 + u64::from(round) * 100,
                latency_ns: 1000 + i,
                device_read_bytes: if i % 3 == 0 { None } else { Some(i) },
                temp_c: Some(40.5),
                ..Default::default()
            })
            .collect()
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lsprof-shard-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn commit_and_reload_round_trip() {
        let d = tmpdir("rt");
        let mut s = ShardStore::create(&d, "t").unwrap();
        s.commit(&rows(10, 0), 1.0).unwrap();
        s.commit(&rows(6, 1), 2.0).unwrap();
        let s = ShardStore::open(&d).unwrap();
        assert_eq!(s.manifest.shards.len(), 2);
        assert_eq!(s.manifest.spent_s, 2.0);
        let (df, problems, _) = s.load().unwrap();
        assert!(problems.is_empty());
        assert_eq!(df.height(), 16);
        let lat = df.column("latency_ns").unwrap().u64().unwrap().get(3);
        assert_eq!(lat, Some(1003));
        assert_eq!(df.column("device_read_bytes").unwrap().null_count(), 6);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corrupt_and_truncated_shards_are_reported_and_skipped() {
        let d = tmpdir("bad");
        let mut s = ShardStore::create(&d, "t").unwrap();
        for r in 0..4 {
            s.commit(&rows(10, r), f64::from(r)).unwrap();
        }
        // Truncate shard 1, flip a byte in shard 2, leave an uncommitted tmp file.
        let p1 = d.join(&s.manifest.shards[1].file);
        let len = fs::metadata(&p1).unwrap().len();
        File::options().write(true).open(&p1).unwrap().set_len(len / 2).unwrap();
        let p2 = d.join(&s.manifest.shards[2].file);
        let mut b = fs::read(&p2).unwrap();
        b[len as usize / 3] ^= 0x40;
        fs::write(&p2, b).unwrap();
        fs::write(d.join("shards/shard-000009.parquet.tmp"), b"partial").unwrap();

        let s = ShardStore::open(&d).unwrap();
        let (df, problems, _) = s.load().unwrap();
        assert_eq!(df.height(), 20, "shards 0 and 3 stay usable");
        assert_eq!(problems.len(), 2);
        assert_eq!(problems[0].path, p1);
        assert!(problems[0].problem.contains("truncated"), "{}", problems[0]);
        assert_eq!(problems[1].path, p2);
        assert!(problems[1].problem.contains("checksum"), "{}", problems[1]);

        let mut s = ShardStore::open(&d).unwrap();
        let (df, problems) = s.recover().unwrap();
        assert_eq!(df.height(), 20);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert_eq!(s.manifest.shards.len(), 2);
        assert!(d.join(QUARANTINE).read_dir().unwrap().count() == 3);
        // A new commit after recovery does not reuse a listed name.
        s.commit(&rows(4, 5), 9.0).unwrap();
        let (df, problems, _) = ShardStore::open(&d).unwrap().load().unwrap();
        assert!(problems.is_empty());
        assert_eq!(df.height(), 24);
        fs::remove_dir_all(&d).unwrap();
    }
}
