use crate::GgmlType;

/// Errors of the kernel crate: shape and type mismatches caught before any
/// arithmetic runs, so a bad tensor never turns into silent garbage.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("unsupported tensor type {0}")]
    UnsupportedType(String),
    #[error("unknown GGML type id {0}")]
    UnknownTypeId(u32),
    #[error("row of {cols} values is not a multiple of the {ty:?} block size {block}")]
    RaggedRow { ty: GgmlType, cols: usize, block: usize },
    #[error("{what}: expected {expected} bytes, got {got}")]
    ByteLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("{what}: expected {expected} values, got {got}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("{what}: data not aligned to {align} bytes")]
    Misaligned { what: &'static str, align: usize },
    #[error("{what}: expected {expected:?} operand, got {got:?}")]
    TypeMismatch {
        what: &'static str,
        expected: GgmlType,
        got: GgmlType,
    },
    #[error("activation buffer too small: needs {needed} bytes, capacity {capacity}")]
    ActBufferCapacity { needed: usize, capacity: usize },
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
}
