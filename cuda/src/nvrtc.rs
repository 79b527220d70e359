//! Run-time compilation of the kernel sources with NVRTC.
//!
//! Options are the numerics contract of `kernels/cuda/common.cuh`:
//! `--fmad=false` (no contraction of a * b + c: the CPU kernels round twice
//! unless they call a fused multiply-add, which the sources spell `fmaf`),
//! IEEE division and square root (NVRTC's defaults), C++17.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::sources;
use crate::{library, CudaError, Result};

/// Virtual architectures the kernels are written for, oldest first: Turing
/// and later (dp4a, `__nanosleep`, acquire loads at system scope). 8.7 is
/// Jetson Orin, 9.0 Hopper (H100/H200).
pub const ARCHS: &[(u32, &str)] = &[
    (75, "compute_75"),
    (80, "compute_80"),
    (86, "compute_86"),
    (87, "compute_87"),
    (89, "compute_89"),
    (90, "compute_90"),
];

/// The newest of [`ARCHS`] a device of compute capability `major.minor` runs.
pub fn arch_for(major: u32, minor: u32) -> Result<&'static str> {
    let cc = major * 10 + minor;
    ARCHS
        .iter()
        .rev()
        .find(|(a, _)| *a <= cc)
        .map(|(_, name)| *name)
        .ok_or_else(|| {
            CudaError::NoDevice(format!(
                "compute capability {major}.{minor} is older than the kernels' minimum, 7.5"
            ))
        })
}

/// Compiles embedded source `name` (headers spliced in) to PTX for `arch`.
pub fn compile(name: &str, arch: &'static str) -> Result<Ptx> {
    compile_text(name, &sources::expand(name)?, arch)
}

/// Compiles already expanded `text`, reporting failures with NVRTC's log.
pub fn compile_text(name: &str, text: &str, arch: &'static str) -> Result<Ptx> {
    library::nvrtc()?;
    if text.contains('\0') {
        return Err(CudaError::Invalid(format!("{name}: source text contains a NUL byte")));
    }
    let opts = CompileOptions {
        fmad: Some(false),
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some(name.into()),
        ..Default::default()
    };
    compile_ptx_with_opts(text, opts).map_err(|e| {
        let log = match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        CudaError::Compile {
            source_name: name.into(),
            arch: arch.into(),
            log,
        }
    })
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32)> {
    library::nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loadable (checked above); both pointers are valid.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::NoNvrtc(format!("nvrtcVersion failed: {status:?}")));
    }
    Ok((major, minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_is_the_newest_the_device_runs() {
        assert_eq!(arch_for(8, 7).unwrap(), "compute_87");
        assert_eq!(arch_for(9, 0).unwrap(), "compute_90");
        assert_eq!(arch_for(12, 0).unwrap(), "compute_90");
        assert_eq!(arch_for(8, 8).unwrap(), "compute_87");
        assert!(matches!(arch_for(7, 2), Err(CudaError::NoDevice(_))));
    }
}
