//! Fuzz targets for every reader of bytes that come from outside: model and
//! artifact files, traces, profiles, JSON side files, tokenizer input and the
//! server's request bodies.
//!
//! A target takes arbitrary bytes and must return, never panic, hang or ask
//! for unbounded memory: an `Err` is the reader rejecting bad input, which is
//! what it should do. The same function runs under AFL++
//! (`src/bin/afl.rs`, `scripts/fuzz.sh`) and in `tests/corpus.rs`, which
//! replays every seed and every input a fuzzer ever crashed on, kept under
//! `data/fuzz/<target>/`.

mod targets;

use std::path::{Path, PathBuf};

pub use targets::run;

/// One reader under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A GGUF model: header, metadata, tensor table, then config, tokenizer,
    /// weights and one forward step.
    Gguf,
    /// An `.lsflash` file: preamble, meta, layer table, resident image, bundles.
    Lsflash,
    /// A controller table (`.lstab`).
    Lstab,
    /// An activation predictor (`.lspred`).
    Lspred,
    /// Eviction priorities (`.lsevict`).
    Lsevict,
    /// One `.npy` array as the activation traces store them.
    Npy,
    /// An activation trace's `manifest.json`, over a real trace's shards.
    TraceManifest,
    /// One profiler shard (Parquet), listed in a manifest that matches it.
    ProfileShard,
    /// A profiler run's `manifest.json`, over a real run's shard.
    ProfileManifest,
    /// A calibration JSON (`leanstream calibrate`).
    Calibration,
    /// A placement JSON (`leanstream-synth placement`).
    Placement,
    /// Text through both real tokenizers, and token ids back to text.
    Tokenizer,
    /// A `POST /v1/chat/completions` body.
    ChatRequest,
    /// A `POST /v1/completions` body.
    CompletionRequest,
}

impl Target {
    pub const ALL: [Target; 14] = [
        Target::Gguf,
        Target::Lsflash,
        Target::Lstab,
        Target::Lspred,
        Target::Lsevict,
        Target::Npy,
        Target::TraceManifest,
        Target::ProfileShard,
        Target::ProfileManifest,
        Target::Calibration,
        Target::Placement,
        Target::Tokenizer,
        Target::ChatRequest,
        Target::CompletionRequest,
    ];

    /// The name on the command line and of its folder under `data/fuzz/`.
    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Lsflash => "lsflash",
            Target::Lstab => "lstab",
            Target::Lspred => "lspred",
            Target::Lsevict => "lsevict",
            Target::Npy => "npy",
            Target::TraceManifest => "trace-manifest",
            Target::ProfileShard => "profile-shard",
            Target::ProfileManifest => "profile-manifest",
            Target::Calibration => "calibration",
            Target::Placement => "placement",
            Target::Tokenizer => "tokenizer",
            Target::ChatRequest => "chat-request",
            Target::CompletionRequest => "completion-request",
        }
    }

    pub fn parse(name: &str) -> Option<Target> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Whether the target needs the base files of [`Scratch::prepare`] (a
    /// real trace or profile run the fuzzed file is dropped into).
    fn needs_base(self) -> bool {
        matches!(
            self,
            Target::TraceManifest | Target::ProfileShard | Target::ProfileManifest
        )
    }
}

/// A per-process directory the file readers are handed their input in.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    /// A fresh scratch directory for `target`, with its base files copied in
    /// from `corpus` (`data/fuzz/<target>`).
    pub fn prepare(target: Target, corpus: &Path) -> std::io::Result<Scratch> {
        let root = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = root.join(format!("leanstream-fuzz-{}-{}", target.name(), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        if target.needs_base() {
            copy_tree(&corpus.join("base"), &dir.join("base"))?;
        }
        Ok(Scratch { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `data` to `name` in the scratch directory and returns its path.
    fn file(&self, name: &str, data: &[u8]) -> Result<PathBuf, String> {
        let p = self.dir.join(name);
        std::fs::write(&p, data).map_err(|e| format!("scratch {}: {e}", p.display()))?;
        Ok(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Copies the directory tree `from` to `to`.
pub fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &dest)?;
        } else {
            std::fs::copy(e.path(), dest)?;
        }
    }
    Ok(())
}

/// `data/fuzz` of this repository.
pub fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/fuzz")
}
