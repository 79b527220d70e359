//! A CUDA device with the kernels loaded: its context, one stream, and
//! every kernel of `kernels/cuda/` compiled by NVRTC for its architecture,
//! with typed launches (argument lists as the `.cu` signatures have them).
//!
//! Opening a device on a machine without CUDA is an ordinary error
//! ([`CudaError::NoDevice`]): the driver library is looked for before cudarc
//! is called, since cudarc panics without it.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use leanstream_kernels::GgmlType;

use crate::flags::Slot;
use crate::{library, nvrtc, sources, CudaError, Result};

// SAFETY: `Slot` is `#[repr(C)]` plain data laid out as `ffn_stream.cu`'s.
unsafe impl DeviceRepr for Slot {}

fn driver_error(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e}"))
}

/// Threads per block of the one-warp-per-row kernels.
const ROW_BLOCK: u32 = 128;
/// Rows (warps) per block there.
const ROWS_PER_BLOCK: u32 = ROW_BLOCK / 32;
/// Tokens one matvec warp takes (`TOKENS` in `matvec.cu`).
const MATVEC_TOKENS: u32 = 8;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (u32, u32),
    pub arch: &'static str,
    functions: HashMap<String, CudaFunction>,
}

impl Gpu {
    /// Device `ordinal`, with every kernel compiled and loaded.
    pub fn open(ordinal: usize) -> Result<Self> {
        library::driver()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("cuInit: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice(format!("device {ordinal}: {e}")))?;
        let name = ctx.name().map_err(driver_error("device name"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_error("compute capability"))?;
        let compute_capability = (major.max(0) as u32, minor.max(0) as u32);
        let arch = nvrtc::arch_for(compute_capability.0, compute_capability.1)?;
        let mut functions = HashMap::new();
        for source in sources::KERNELS {
            let text = sources::expand(source.name)?;
            let ptx = nvrtc::compile_text(source.name, &text, arch)?;
            let module = ctx.load_module(ptx).map_err(driver_error(source.name))?;
            for kernel in sources::kernel_names(&text) {
                let f = module.load_function(&kernel).map_err(driver_error(&kernel))?;
                functions.insert(kernel, f);
            }
        }
        let stream = ctx.default_stream();
        Ok(Self {
            ctx,
            stream,
            name,
            compute_capability,
            arch,
            functions,
        })
    }

    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::Invalid(format!("no kernel {name} is loaded")))
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(driver_error("copy to device"))
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(len.max(1)).map_err(driver_error("allocate"))
    }

    pub fn download<T: DeviceRepr>(&self, data: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(data).map_err(driver_error("copy from device"))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error("synchronize"))
    }

    /// `n` values of `x` into `out` in dot type `ty` (Q8_0, Q8_1, Q8_K or
    /// F16), as `leanstream_kernels::quantize::quantize_row`.
    pub fn quantize(&self, ty: GgmlType, x: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<u8>) -> Result<()> {
        let blocks = (n / ty.block_size()) as i32;
        let (name, cfg) = match ty {
            GgmlType::Q8_0 | GgmlType::Q8_1 => (
                if ty == GgmlType::Q8_0 {
                    "quantize_q8_0"
                } else {
                    "quantize_q8_1"
                },
                grid_1d((blocks as u64) * 32, ROW_BLOCK),
            ),
            GgmlType::Q8K => ("quantize_q8_k", blocks_of(blocks as u32, 256)),
            GgmlType::F16 => ("convert_f16", grid_1d(n as u64, 256)),
            other => return Err(CudaError::Invalid(format!("{other} is not an activation type"))),
        };
        if ty.row_bytes(n)? > out.len() {
            return Err(CudaError::Invalid(format!(
                "{ty} output of {} bytes for {n} values",
                out.len()
            )));
        }
        let f = self.function(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(out);
        let count = n as u64;
        if ty == GgmlType::F16 {
            b.arg(&count);
        } else {
            b.arg(&blocks);
        }
        // SAFETY: lengths checked above; the kernel reads n values and
        // writes the blocks of `out` they make.
        unsafe { b.launch(cfg) }.map_err(driver_error(name))?;
        Ok(())
    }

    /// `y[t][r] = W[r] · x[t]` for `n_tokens` activation rows in `ty`'s dot
    /// type (`matvec.cu`); `y` has row stride `rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
        x: &CudaSlice<u8>,
        n_tokens: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let name = match ty {
            GgmlType::Q4_0 => "matvec_q4_0",
            GgmlType::Q4_1 => "matvec_q4_1",
            GgmlType::Q5_0 => "matvec_q5_0",
            GgmlType::Q5_1 => "matvec_q5_1",
            GgmlType::Q8_0 => "matvec_q8_0",
            GgmlType::Q4K => "matvec_q4_k",
            GgmlType::Q5K => "matvec_q5_k",
            GgmlType::Q6K => "matvec_q6_k",
            GgmlType::F16 => "matvec_f16",
            GgmlType::F32 => "matvec_f32",
            other => return Err(CudaError::Invalid(format!("no GPU matvec for {other} weights"))),
        };
        let w_row = ty.row_bytes(cols)? as u64;
        let x_row = ty.vec_dot_type().row_bytes(cols)? as u64;
        let units = match ty {
            GgmlType::F16 | GgmlType::F32 => cols / 8,
            _ => cols / ty.block_size(),
        } as i32;
        if w.len() < (w_row as usize) * rows || x.len() < (x_row as usize) * n_tokens || y.len() < rows * n_tokens {
            return Err(CudaError::Invalid(format!(
                "{name}: buffers of {}, {} and {} for {rows}x{cols} and {n_tokens} tokens",
                w.len(),
                x.len(),
                y.len()
            )));
        }
        let (rows_i, tokens_i, y_stride) = (rows as i32, n_tokens as i32, rows as u64);
        let f = self.function(name)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(w)
            .arg(&w_row)
            .arg(x)
            .arg(&x_row)
            .arg(y)
            .arg(&y_stride)
            .arg(&rows_i)
            .arg(&tokens_i)
            .arg(&units);
        let cfg = LaunchConfig {
            grid_dim: (
                (rows as u32).div_ceil(ROWS_PER_BLOCK),
                (n_tokens as u32).div_ceil(MATVEC_TOKENS),
                1,
            ),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffer sizes checked above against what the kernel indexes.
        unsafe { b.launch(cfg) }.map_err(driver_error(name))?;
        Ok(())
    }
}

/// Flags in pinned host memory mapped into the device's address space:
/// the host publishes them ([`FlagBoard`](crate::flags::FlagBoard) over
/// [`MappedFlags::host`]) while a kernel polls them at [`MappedFlags::device_ptr`].
pub struct MappedFlags {
    host: *mut std::sync::atomic::AtomicU32,
    device: u64,
    len: usize,
    _ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned by this value and accessed through atomics.
unsafe impl Send for MappedFlags {}
unsafe impl Sync for MappedFlags {}

impl MappedFlags {
    /// `len` flags, all 0.
    pub fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        use cudarc::driver::{result, sys};
        gpu.ctx.bind_to_thread().map_err(driver_error("bind context"))?;
        let bytes = len.max(1) * 4;
        // SAFETY: a fresh allocation of `bytes`, zeroed before any use.
        let host = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(driver_error("cuMemHostAlloc"))?;
        // SAFETY: `host` points at `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
        let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: allocated above, not used since.
            unsafe {
                let _ = result::free_host(host);
            }
            return Err(CudaError::Driver(format!("cuMemHostGetDevicePointer: {status:?}")));
        }
        Ok(Self {
            host: host as *mut std::sync::atomic::AtomicU32,
            device,
            len,
            _ctx: gpu.ctx.clone(),
        })
    }

    /// The flags as the host sees them.
    pub fn host(&self) -> &[std::sync::atomic::AtomicU32] {
        // SAFETY: `len` u32s owned by self, 4-byte aligned (page-aligned
        // allocation); AtomicU32 has u32's layout.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    /// Their address on the device.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }
}

impl Drop for MappedFlags {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; no kernel may still
        // poll it (callers synchronize before dropping).
        unsafe {
            let _ = cudarc::driver::result::free_host(self.host as *mut std::ffi::c_void);
        }
    }
}

/// Enough blocks of `block` threads for `n` threads.
pub fn grid_1d(n: u64, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(block as u64).max(1) as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `blocks` blocks of `threads` threads.
pub fn blocks_of(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
