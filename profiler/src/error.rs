//! The library's single error type.

use std::path::PathBuf;

/// Everything the profiler's library can fail with. Errors about files name the file.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(transparent)]
    Plot(#[from] leanstream_plot::PlotError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Sys(#[from] std::io::Error),
    #[error("{path}: parquet: {source}")]
    Parquet {
        path: PathBuf,
        #[source]
        source: polars::error::PolarsError,
    },
    #[error("polars: {0}")]
    Polars(#[from] polars::error::PolarsError),
    #[error("{path}: json: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("{0} reads failed: {1}")]
    Read(String, String),
    #[error("runtime: {0}")]
    Runtime(#[from] leanstream_runtime::RuntimeError),
    #[error("kernel: {0}")]
    Kernel(#[from] leanstream_kernels::KernelError),
    /// The GPU backend (no device, a driver error, a model it cannot hold).
    #[error("device: {0}")]
    Device(String),
}

impl ProfileError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, ProfileError>;
