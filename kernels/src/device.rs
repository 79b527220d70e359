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

    /// The SIMD level the CPU kernels dispatch to on this machine: the AVX2
    /// set and the VNNI form its products take, then `+avx512` where the
    /// AVX-512 prompt kernels run too (a CPU with both VNNI forms takes the
    /// VEX one for the AVX2 kernels, so the VNNI form alone does not say).
    pub fn cpu_features() -> &'static str {
        if !crate::dot::has_avx2() {
            return "portable";
        }
        let avx512 = crate::dot::avx512_prompts();
        match (crate::dot::vnni(), avx512) {
            (crate::dot::Vnni::None, false) => "avx2+fma",
            (crate::dot::Vnni::None, true) => "avx2+fma+avx512",
            (crate::dot::Vnni::Avx, false) => "avx2+fma+avxvnni",
            (crate::dot::Vnni::Avx, true) => "avx2+fma+avxvnni+avx512",
            (crate::dot::Vnni::Avx512, false) => "avx2+fma+avx512vnni",
            (crate::dot::Vnni::Avx512, true) => "avx2+fma+avx512vnni+avx512",
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
