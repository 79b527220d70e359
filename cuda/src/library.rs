//! Finding CUDA's shared libraries before cudarc loads them.
//!
//! cudarc (dynamic loading) opens a library by name the first time one of
//! its functions is called, and panics when no candidate name loads. So the
//! backend first tries the same candidates itself and reports a missing
//! library as an ordinary error. NVRTC can also come from an explicit path
//! (`LEANSTREAM_NVRTC`, or the `nvidia-cuda-nvrtc` Python wheel that
//! `scripts/test.sh` installs under `$LEANSTREAM_HOME/nvrtc`): that library
//! is loaded here and kept loaded, and the dynamic loader then hands cudarc
//! the same library for its name (`libnvrtc.so.12`, the library's soname).

use std::path::PathBuf;
use std::sync::OnceLock;

use libloading::Library;

use crate::{CudaError, Result};

/// Where `scripts/test.sh` installs NVRTC's wheel, relative to `$LEANSTREAM_HOME`.
pub const NVRTC_WHEEL_LIB: &str = "nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12";

/// Explicit places to load NVRTC from, in order: `$LEANSTREAM_NVRTC`, then
/// the wheel under `$LEANSTREAM_HOME` (default `~/.cache/leanstream`).
pub fn nvrtc_paths() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(p) = std::env::var_os("LEANSTREAM_NVRTC") {
        paths.push(PathBuf::from(p));
    }
    let home = std::env::var_os("LEANSTREAM_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/leanstream")));
    if let Some(home) = home {
        paths.push(home.join(NVRTC_WHEEL_LIB));
    }
    paths
}

/// Libraries loaded from explicit paths, kept for the process's lifetime
/// (cudarc's handles to the same objects must stay valid).
static PINNED: OnceLock<Vec<Library>> = OnceLock::new();

/// Opens `path` if it exists.
fn open(path: &std::path::Path) -> Option<Library> {
    if !path.is_file() {
        return None;
    }
    // SAFETY: loading a shared library runs its initializers; these are
    // NVIDIA's CUDA libraries, which have no initializers with preconditions.
    unsafe { Library::new(path) }.ok()
}

/// Whether one of cudarc's candidate names for `lib` ("nvrtc", "cuda") loads.
fn loads_by_name(lib: &str) -> Option<String> {
    cudarc::get_lib_name_candidates(lib).into_iter().find(|name| {
        // SAFETY: as in `open`.
        unsafe { Library::new(name) }.is_ok()
    })
}

/// Makes NVRTC loadable for cudarc, or says why it is not.
pub fn nvrtc() -> Result<()> {
    static FOUND: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let pinned = PINNED.get_or_init(|| nvrtc_paths().iter().filter_map(|p| open(p)).take(1).collect());
        loads_by_name("nvrtc").ok_or_else(|| {
            let tried: Vec<String> = nvrtc_paths().iter().map(|p| p.display().to_string()).collect();
            format!(
                "no libnvrtc.so on the loader's path{} (set LEANSTREAM_NVRTC to the library, install the \
                 nvidia-cuda-nvrtc-cu12 wheel as scripts/test.sh does, or put a CUDA toolkit's lib64, which \
                 has a libnvrtc.so of any version, on LD_LIBRARY_PATH; looked at {})",
                if pinned.is_empty() {
                    ""
                } else {
                    " matching the library loaded"
                },
                tried.join(", ")
            )
        })
    });
    found.as_ref().map(|_| ()).map_err(|e| CudaError::NoNvrtc(e.clone()))
}

/// Makes the CUDA driver library loadable for cudarc, or says why it is not.
pub fn driver() -> Result<()> {
    static FOUND: OnceLock<Option<String>> = OnceLock::new();
    FOUND
        .get_or_init(|| loads_by_name("cuda"))
        .as_ref()
        .map(|_| ())
        .ok_or_else(|| CudaError::NoDevice("no CUDA driver library (libcuda.so.1) on this machine".into()))
}
