use std::path::PathBuf;

use leanstream_kernels::KernelError;

/// Errors of the runtime library. Every variant that concerns a file names it,
/// and the part of it that is wrong, so a user can act on the message.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A read of `len` bytes at byte `offset` of `path` failed.
    #[error("{path}: read of {len} bytes at offset {offset}: {source}")]
    Read {
        path: PathBuf,
        offset: u64,
        len: u64,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: {problem}")]
    Corrupt { path: PathBuf, problem: String },
    #[error("{path}: metadata '{key}': {problem}")]
    Metadata {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("{path}: tensor '{name}': {problem}")]
    Tensor {
        path: PathBuf,
        name: String,
        problem: String,
    },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("fetch: {0}")]
    Fetch(String),
    #[error("{0}")]
    Invalid(String),
    /// A device backend's error (`leanstream-cuda`), as it worded it.
    #[error("{0}")]
    Device(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

impl RuntimeError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
