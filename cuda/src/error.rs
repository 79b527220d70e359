/// Errors of the GPU backend. A machine without CUDA gets `NoDevice` or
/// `NoNvrtc`, ordinary errors, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("NVRTC not found: {0}")]
    NoNvrtc(String),
    #[error("{source_name}: NVRTC failed for {arch}:\n{log}")]
    Compile {
        source_name: String,
        arch: String,
        log: String,
    },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("kernel source {0} is not one of kernels/cuda/")]
    UnknownSource(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Kernel(#[from] leanstream_kernels::KernelError),
    /// Reading a model (its file names itself in the message).
    #[error(transparent)]
    Model(#[from] leanstream_runtime::RuntimeError),
}

pub type Result<T> = std::result::Result<T, CudaError>;
