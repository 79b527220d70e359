//! Where kernels run. Callers match on `Device` without any `cfg`: the CUDA
//! variant exists everywhere and reports "no device" where none is present.

use crate::KernelError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU, with SIMD chosen at run time.
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl Device {
    /// Resolves a user's device name (`cpu`, `cuda`, `cuda:N`).
    pub fn parse(name: &str) -> Result<Self, KernelError> {
        match name {
            "cpu" => Ok(Self::Cpu),
            "cuda" => cuda::open(0).map(|_| Self::Cuda(0)),
            other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(ordinal) => cuda::open(ordinal).map(|_| Self::Cuda(ordinal)),
                None => Err(KernelError::UnsupportedType(format!("device '{other}'"))),
            },
        }
    }

    /// The SIMD level the CPU kernels dispatch to on this machine.
    pub fn cpu_features() -> &'static str {
        if crate::dot::has_avx2() {
            match crate::dot::vnni() {
                crate::dot::Vnni::None => "avx2+fma",
                crate::dot::Vnni::Avx => "avx2+fma+avxvnni",
                crate::dot::Vnni::Avx512 => "avx2+fma+avx512vnni",
            }
        } else {
            "portable"
        }
    }
}

/// The CUDA backend's entry point. This build carries no CUDA backend, so it
/// says so as an ordinary error instead of failing at link or load time.
mod cuda {
    use crate::KernelError;

    pub fn open(ordinal: usize) -> Result<(), KernelError> {
        Err(KernelError::NoCudaDevice(format!(
            "device {ordinal} requested, but this build has no CUDA backend"
        )))
    }
}
