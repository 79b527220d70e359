//! Where kernels run. Callers match on `Device` without any `cfg`: the CUDA
//! variant exists everywhere, and the `leanstream-cuda` crate, which opens
//! it, reports "no CUDA device" where none is present.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU, with SIMD chosen at run time.
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

/// A user's device name: `cpu`, `cuda` (device 0) or `cuda:N`; the one
/// parser of `--device` everywhere. Parsing opens nothing: whether the
/// device is there is for its backend to say.
impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(ordinal)) => Ok(Self::Cuda(ordinal)),
                _ => Err(format!("{other:?}: expected cpu, cuda or cuda:N")),
            },
        }
    }
}

impl Device {
    /// The CUDA ordinal, `None` for the CPU.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            Self::Cpu => None,
            Self::Cuda(n) => Some(n),
        }
    }

    /// The SIMD level the CPU kernels dispatch to on this machine: on x86_64
    /// the AVX2 set and the VNNI form its products take, then `+avx512` where
    /// the AVX-512 prompt kernels run too (a CPU with both VNNI forms takes
    /// the VEX one for the AVX2 kernels, so the VNNI form alone does not
    /// say); on aarch64 `neon`, or `neon+dotprod` where the byte dots use
    /// `sdot`; else `portable`.
    pub fn cpu_features() -> &'static str {
        if cfg!(target_arch = "aarch64") {
            return if crate::dot::has_neon_dotprod() {
                "neon+dotprod"
            } else {
                "neon"
            };
        }
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

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn device_names_parse_and_bad_ones_are_named() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        for bad in ["tpu", "cuda:", "cuda:x", "CUDA", "cuda:-1"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert_eq!(e, format!("{bad:?}: expected cpu, cuda or cuda:N"));
        }
    }
}
