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

/// `e` and its sources on one line, `a: b: c`, each cause left out where
/// the text before it already ends with it (an error that quotes its
/// source, as [`RuntimeError::Io`] does). The binaries print this for a
/// failed command rather than a `Debug` dump, whose "Caused by" repeats the
/// quoted cause and which grows a backtrace wherever `RUST_BACKTRACE` is set.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut cause = Some(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.ends_with(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("tuning {what}")]
    struct Step {
        what: &'static str,
        #[source]
        source: RuntimeError,
    }

    #[test]
    fn the_chain_is_one_line_without_a_quoted_cause_twice() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let e = Step {
            what: "text",
            source: RuntimeError::io("/tmp/t.txt", io),
        };
        assert_eq!(error_chain(&e), "tuning text: /tmp/t.txt: No such file or directory");
    }
}
