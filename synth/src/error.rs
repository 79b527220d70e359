//! The crate's error type.

use std::path::PathBuf;

pub type Result<T, E = SynthError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Trace { path: PathBuf, reason: String },
    #[error("{path}: missing profiled conditions: {missing}")]
    MissingConditions { path: PathBuf, missing: String },
    #[error(transparent)]
    Profile(#[from] leanstream_profiler::ProfileError),
    #[error(transparent)]
    Control(#[from] leanstream_runtime::control::ControlError),
    #[error(transparent)]
    Runtime(#[from] leanstream_runtime::RuntimeError),
    #[error(transparent)]
    Predict(#[from] leanstream_runtime::predict::PredictError),
    #[error(transparent)]
    Retention(#[from] leanstream_runtime::cache::retention::RetentionError),
    #[error(transparent)]
    Plot(#[from] leanstream_plot::PlotError),
    #[error("polars: {0}")]
    Polars(#[from] polars::error::PolarsError),
    #[error("solver failed: {0}")]
    Solver(String),
    /// Ctrl-C or SIGTERM stopped a step; what it committed is kept.
    #[error("{0}")]
    Interrupted(String),
    #[error("invalid setting: {0}")]
    Settings(String),
}

impl SynthError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
