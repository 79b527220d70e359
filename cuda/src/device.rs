//! A CUDA device with the kernels loaded: its context, one stream, and
//! every kernel of `kernels/cuda/` compiled by NVRTC for its architecture,
//! with typed launches (argument lists as the `.cu` signatures have them).
//!
//! Opening a device on a machine without CUDA is an ordinary error
//! ([`CudaError::NoDevice`]): the driver library is looked for before cudarc
//! is called, since cudarc panics without it.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use leanstream_kernels::flash_attn::{self, Route};
use leanstream_kernels::sparse_ffn::{BundleFormat, DownLayout, FfnActivation};
use leanstream_kernels::GgmlType;

use crate::flags::Slot;
use crate::order::CpuOrder;
use crate::{library, nvrtc, sources, CudaError, Result};

// SAFETY: `Slot` is `#[repr(C)]` plain data laid out as `ffn_stream.cu`'s.
unsafe impl DeviceRepr for Slot {}
// SAFETY: integers only; all zeros is a slot at address 0 (never launched on).
unsafe impl cudarc::driver::ValidAsZeroBits for Slot {}

fn driver_error(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e}"))
}

/// Threads per block of the row kernels (whole warps).
const ROW_BLOCK: u32 = 128;
/// Matvec rows per block there: a group of [`CPU_LANES`] threads a row.
const ROWS_PER_BLOCK: u32 = ROW_BLOCK / CPU_LANES;
/// Threads per matvec row, one per lane of the CPU kernel (`CPU_LANES` in
/// `cpu_order.cuh`).
const CPU_LANES: u32 = 8;
/// Tokens one matvec group takes (`TOKENS` in `matvec.cu`).
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

    /// The first `len` values of `data` (after the work queued before).
    pub fn download_prefix<T: DeviceRepr>(&self, data: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        let view = data
            .try_slice(..len)
            .ok_or_else(|| CudaError::Invalid(format!("{len} values of a buffer of {}", data.len())))?;
        self.stream.clone_dtoh(&view).map_err(driver_error("copy from device"))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_error("synchronize"))
    }

    /// The device address of `s` (launches below take addresses, so one
    /// buffer can be both input and output, or be used at an offset; all
    /// work runs on the one stream, in order).
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr {
        let (p, _record) = s.device_ptr(&self.stream);
        DevPtr(p)
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[&dyn Arg]) -> Result<()> {
        let f = self.function(name)?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            a.push(&mut b);
        }
        // SAFETY: every wrapper below checks its sizes against what the
        // kernel indexes, and addresses come from live allocations.
        unsafe { b.launch(cfg) }.map_err(driver_error(name))?;
        Ok(())
    }

    /// `n` values at `x` into dot type `ty` (Q8_0, Q8_1, Q8_K or F16) at
    /// `out`, as `leanstream_kernels::quantize::quantize_row` does.
    pub fn quantize_at(&self, ty: GgmlType, x: DevPtr, n: usize, out: DevPtr) -> Result<()> {
        let blocks = (n / ty.block_size()) as i32;
        match ty {
            GgmlType::Q8_0 | GgmlType::Q8_1 => {
                let name = if ty == GgmlType::Q8_0 {
                    "quantize_q8_0"
                } else {
                    "quantize_q8_1"
                };
                self.launch(name, grid_1d(blocks as u64 * 32, ROW_BLOCK), &[&x, &out, &blocks])
            }
            GgmlType::Q8K => self.launch("quantize_q8_k", blocks_of(blocks as u32, 256), &[&x, &out, &blocks]),
            GgmlType::F16 => self.launch("convert_f16", grid_1d(n as u64, 256), &[&x, &out, &(n as u64)]),
            other => Err(CudaError::Invalid(format!("{other} is not an activation type"))),
        }
    }

    /// [`quantize_at`](Self::quantize_at) between slices, sizes checked.
    pub fn quantize(&self, ty: GgmlType, x: &CudaSlice<f32>, n: usize, out: &mut CudaSlice<u8>) -> Result<()> {
        if n > x.len() || ty.row_bytes(n)? > out.len() {
            return Err(CudaError::Invalid(format!(
                "{ty}: {n} values from {} into {} bytes",
                x.len(),
                out.len()
            )));
        }
        self.quantize_at(ty, self.ptr(x), n, self.ptr(out))
    }

    /// `y[t][r] = W[r] · x[t]` for `n_tokens` rows at `x` in `ty`'s dot type
    /// (`matvec.cu`), each output in the float order the CPU engine's
    /// `matmul` takes for this matrix and batch ([`CpuOrder`]); `y` has row
    /// stride `rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_at(
        &self,
        ty: GgmlType,
        w: DevPtr,
        rows: usize,
        cols: usize,
        x: DevPtr,
        n_tokens: usize,
        y: DevPtr,
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
        if rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        let order = CpuOrder::of(ty, rows, n_tokens);
        let (cols_i, order_i, gemm_rows) = (cols as i32, order.id(), order.gemm_rows() as i32);
        let cfg = LaunchConfig {
            grid_dim: (
                (rows as u32).div_ceil(ROWS_PER_BLOCK),
                (n_tokens as u32).div_ceil(MATVEC_TOKENS),
                1,
            ),
            block_dim: (ROW_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows_i, tokens_i, y_stride) = (rows as i32, n_tokens as i32, rows as u64);
        self.launch(
            name,
            cfg,
            &[
                &w, &w_row, &x, &x_row, &y, &y_stride, &rows_i, &tokens_i, &cols_i, &order_i, &gemm_rows,
            ],
        )
    }

    /// [`matvec_at`](Self::matvec_at) between slices, sizes checked.
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
        let (w_row, x_row) = (ty.row_bytes(cols)?, ty.vec_dot_type().row_bytes(cols)?);
        if w.len() < w_row * rows || x.len() < x_row * n_tokens || y.len() < rows * n_tokens {
            return Err(CudaError::Invalid(format!(
                "{ty} matvec: buffers of {}, {} and {} for {rows}x{cols} and {n_tokens} tokens",
                w.len(),
                x.len(),
                y.len()
            )));
        }
        self.matvec_at(ty, self.ptr(w), rows, cols, self.ptr(x), n_tokens, self.ptr(y))
    }

    /// RMS norm of `rows` rows of `d` at `x` into `out` (may be `x`).
    pub fn rms_norm(&self, x: DevPtr, weight: DevPtr, out: DevPtr, rows: usize, d: usize, eps: f32) -> Result<()> {
        self.launch(
            "rms_norm_rows",
            blocks_of(rows as u32, 256),
            &[&x, &weight, &out, &(d as i32), &eps],
        )
    }

    /// RoPE in place over `n_tokens` rows of `heads` heads, the table `[t][cos.., sin..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: DevPtr,
        table: DevPtr,
        n_tokens: usize,
        heads: usize,
        head_dim: usize,
        n_rot: usize,
        neox: bool,
    ) -> Result<()> {
        self.launch(
            "rope",
            grid_1d((n_tokens * heads * n_rot / 2) as u64, 128),
            &[
                &x,
                &table,
                &(n_tokens as i32),
                &(heads as i32),
                &(head_dim as i32),
                &(n_rot as i32),
                &(neox as i32),
            ],
        )
    }

    pub fn scale(&self, x: DevPtr, s: f32, n: usize) -> Result<()> {
        self.launch("scale", grid_1d(n as u64, 256), &[&x, &s, &(n as u64)])
    }

    pub fn softcap(&self, x: DevPtr, cap: f32, n: usize) -> Result<()> {
        self.launch("softcap", grid_1d(n as u64, 256), &[&x, &cap, &(n as u64)])
    }

    pub fn add_assign(&self, y: DevPtr, x: DevPtr, n: usize) -> Result<()> {
        self.launch("add_assign", grid_1d(n as u64, 256), &[&y, &x, &(n as u64)])
    }

    /// `y[t][i] += b[i]` over `total` values in rows of `n`.
    pub fn add_bias(&self, y: DevPtr, b: DevPtr, n: usize, total: usize) -> Result<()> {
        self.launch(
            "add_bias",
            grid_1d(total as u64, 256),
            &[&y, &b, &(n as i32), &(total as u64)],
        )
    }

    /// `gate = act(gate) * up` over `n` values (act 0: SiLU, 1: GELU-tanh via `table`).
    pub fn gated(&self, gate: DevPtr, up: DevPtr, table: DevPtr, n: usize, act: i32) -> Result<()> {
        self.launch(
            "gated_activation",
            grid_1d(n as u64, 256),
            &[&gate, &up, &table, &(n as u64), &act],
        )
    }

    /// Rows `tokens[..n]` of a `ty` table into `out`, times `scale` (0: none).
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        table: DevPtr,
        row_bytes: usize,
        ty: GgmlType,
        tokens: DevPtr,
        n: usize,
        out: DevPtr,
        n_embd: usize,
        scale: f32,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: ((n_embd as u32).div_ceil(256), n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "embed",
            cfg,
            &[
                &table,
                &(row_bytes as u64),
                &(ty.id() as i32),
                &tokens,
                &out,
                &(n_embd as i32),
                &scale,
            ],
        )
    }

    /// Keys and values of `n` tokens into a layer's f16 cache at `pos0`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        k: DevPtr,
        v: DevPtr,
        k_cache: DevPtr,
        v_cache: DevPtr,
        kv_dim: usize,
        pos0: usize,
        n: usize,
    ) -> Result<()> {
        self.launch(
            "kv_store",
            grid_1d((n * kv_dim) as u64, 256),
            &[
                &k,
                &v,
                &k_cache,
                &v_cache,
                &(kv_dim as i32),
                &(pos0 as i32),
                &(n as i32),
            ],
        )
    }

    /// Attention of `n` query rows at positions `pos0..` over a layer's
    /// cache, by the route the CPU engine takes for the shape
    /// ([`flash_attn::route`] over `cells`, its cache view, and `threads`,
    /// its thread count), with that route's numerics (`attention.cu`).
    /// `partials` is scratch of [`partials_len`](Self::partials_len) floats
    /// for the split route.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: DevPtr,
        k_cache: DevPtr,
        v_cache: DevPtr,
        out: DevPtr,
        n: usize,
        heads: AttentionHeads,
        at: AttentionAt,
        partials: &CudaSlice<f32>,
    ) -> Result<()> {
        let AttentionHeads {
            n_head,
            n_head_kv,
            head_dim,
        } = heads;
        if head_dim > 256 {
            return Err(CudaError::Invalid(format!(
                "head size {head_dim} (the attention kernel takes up to 256)"
            )));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(CudaError::Invalid(format!(
                "{n_head} query heads over {n_head_kv} kv heads"
            )));
        }
        let (route, chunks) = match flash_attn::route(n, at.cells, at.threads) {
            Route::Vector => (0i32, 1usize),
            Route::Split { chunks } => (1, chunks),
            Route::Tiled => (2, 1),
        };
        if route == 1 && partials.len() < Self::partials_len(heads, chunks) {
            return Err(CudaError::Invalid(format!(
                "attention scratch of {} floats for {chunks} split chunks",
                partials.len()
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (n_head as u32, n as u32, chunks as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let scratch = self.ptr(partials);
        self.launch(
            "attention",
            cfg,
            &[
                &q,
                &k_cache,
                &v_cache,
                &out,
                &(n_head as i32),
                &(n_head_kv as i32),
                &(head_dim as i32),
                &(at.pos0 as i32),
                &(at.window as i32),
                &at.kq_scale,
                &route,
                &(at.cells as i32),
                &(chunks as i32),
                &scratch,
            ],
        )?;
        if route != 1 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (n_head as u32, n as u32, 1),
            block_dim: (head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "attention_merge",
            cfg,
            &[&scratch, &out, &(n_head as i32), &(head_dim as i32), &(chunks as i32)],
        )
    }

    /// `bytes` bytes from `from` to `to`, in stream order.
    pub fn copy_at(&self, to: DevPtr, from: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: callers pass addresses and a length inside live allocations.
        unsafe { cudarc::driver::result::memcpy_dtod_async(to.0, from.0, bytes, self.stream.cu_stream()) }
            .map_err(driver_error("copy"))
    }

    /// `bytes` zero bytes at `at`, in stream order.
    pub fn zero_at(&self, at: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: callers pass an address and length inside a live allocation.
        unsafe { cudarc::driver::result::memset_d8_async(at.0, 0, bytes, self.stream.cu_stream()) }
            .map_err(driver_error("memset"))
    }

    /// Stage 1 of the streaming FFN (`ffn_stream_activations`): for each of
    /// `n_slots` slots, once its flag reaches `epoch` (or at `deadline_ns`
    /// from the first group's start, 0: never), `act[s] = act(gate·x) *
    /// (up·x)`, the dots in the CPU tail's float order (`input`'s).
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_stream_activations(
        &self,
        slots: DevPtr,
        n_slots: usize,
        epoch: u32,
        input: StreamInput,
        format: &BundleFormat,
        act_kind: i32,
        gelu_table: DevPtr,
        start_ns: DevPtr,
        deadline_ns: u64,
        keep: Keep,
        act: DevPtr,
        skipped: DevPtr,
    ) -> Result<()> {
        self.launch(
            "ffn_stream_activations",
            grid_1d(n_slots as u64 * CPU_LANES as u64, ROW_BLOCK),
            &[
                &slots,
                &(n_slots as i32),
                &epoch,
                &input.gate,
                &input.up,
                &(format.gate_ty.id() as i32),
                &(format.up_ty.id() as i32),
                &(format.n_embd as i32),
                &input.gate_order,
                &input.up_order,
                &(format.gate_bytes() as u64),
                &act_kind,
                &gelu_table,
                &start_ns,
                &deadline_ns,
                &keep.threshold,
                &keep.rows,
                &act,
                &skipped,
            ],
        )
    }

    /// Stage 2 of the streaming FFN (`ffn_stream_down`): `y += Σ act[s] *
    /// down_s` over the slots in `order`; the down columns must be Q8_0 or F16.
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_stream_down(
        &self,
        slots: DevPtr,
        order: DevPtr,
        n_slots: usize,
        act: DevPtr,
        format: &BundleFormat,
        y: DevPtr,
    ) -> Result<()> {
        check_down_columns(format)?;
        self.launch(
            "ffn_stream_down",
            grid_1d(format.n_embd as u64, ROW_BLOCK),
            &[
                &slots,
                &order,
                &(n_slots as i32),
                &act,
                &((format.gate_bytes() + format.up_bytes()) as u64),
                &(format.down_ty.id() as i32),
                &y,
                &(format.n_embd as i32),
            ],
        )
    }

    /// The device's neuron cache taking bundles (`ffn_cache_fill`): `n`
    /// copies of `bytes` each, `pairs` holding (from, to) device addresses.
    pub fn ffn_cache_fill(&self, pairs: DevPtr, n: usize, bytes: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "ffn_cache_fill",
            blocks_of(n as u32, ROW_BLOCK),
            &[&pairs, &(n as i32), &bytes],
        )
    }

    /// Floats of split-route scratch for one query of `heads` in `chunks` parts.
    pub fn partials_len(heads: AttentionHeads, chunks: usize) -> usize {
        heads.n_head * chunks * (heads.head_dim + 2)
    }
}

/// Where an attention call's queries sit and what the CPU engine would
/// decide there: positions from `pos0`, the layer's window (0: none), the
/// score scale, the CPU's cache view and thread count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionAt {
    pub pos0: usize,
    pub window: usize,
    pub kq_scale: f32,
    pub cells: usize,
    pub threads: usize,
}

/// The kernels' id of a gated activation (`ACT_SILU`, `ACT_GELU_TANH` in `common.cuh`).
pub fn activation_id(act: FfnActivation) -> i32 {
    match act {
        FfnActivation::Silu => 0,
        FfnActivation::GeluTanh => 1,
    }
}

/// The device's streaming FFN reads per-neuron down columns in Q8_0 or F16.
pub fn check_down_columns(format: &BundleFormat) -> Result<()> {
    if format.down_layout != DownLayout::Columns || !matches!(format.down_ty, GgmlType::Q8_0 | GgmlType::F16) {
        return Err(CudaError::Invalid(format!(
            "down parts as {:?} {}: the device's FFN takes Q8_0 or F16 columns (pack with --down q8_0)",
            format.down_layout, format.down_ty
        )));
    }
    Ok(())
}

/// What the streaming FFN's stage 1 keeps of a row (the CPU tail's rule):
/// the neurons set in the bitmap over neuron ids at `rows` (device memory,
/// or mapped host memory), or with no bitmap (`DevPtr(0)`), those with
/// `|a|` not below `threshold`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Keep {
    pub threshold: f32,
    pub rows: DevPtr,
}

impl Keep {
    /// Every neuron computed.
    pub const ALL: Keep = Keep {
        threshold: 0.0,
        rows: DevPtr(0),
    };
}

/// The FFN input of one token in the gate and up rows' vec-dot types, and
/// the float order ([`CpuOrder::id_for_token`]) the CPU's tail gives this
/// token's gate and up dots: `matmul`'s over the layer's matrices for the
/// call's rows (`FfnRows::as_matrix_of`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamInput {
    pub gate: DevPtr,
    pub up: DevPtr,
    pub gate_order: i32,
    pub up_order: i32,
}

impl StreamInput {
    /// Token `t` of a call of `n` rows into a layer of `n_ff` neurons.
    pub fn new(gate: DevPtr, up: DevPtr, format: &BundleFormat, n_ff: usize, t: usize, n: usize) -> Self {
        Self {
            gate,
            up,
            gate_order: CpuOrder::of(format.gate_ty, n_ff, n).id_for_token(t),
            up_order: CpuOrder::of(format.up_ty, n_ff, n).id_for_token(t),
        }
    }
}

/// The head shape of an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionHeads {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// A device address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// `bytes` further on.
    pub fn offset(self, bytes: usize) -> Self {
        Self(self.0 + bytes as u64)
    }
}

/// A kernel argument: pushed by reference, as the launch reads it then.
trait Arg {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>);
}

impl Arg for DevPtr {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.0);
    }
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
                b.arg(self);
            }
        }
    )*};
}
scalar_arg!(i32, u32, u64, f32);

/// Pinned host memory mapped into the device's address space: the host
/// writes it while kernels read it at [`MappedMemory::device_ptr`], over
/// the bus, without a copy.
pub struct MappedMemory {
    host: *mut u8,
    device: u64,
    bytes: usize,
    _ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned by this value; who writes what when is the
// users' protocol (flags published by release stores).
unsafe impl Send for MappedMemory {}
unsafe impl Sync for MappedMemory {}

impl MappedMemory {
    /// `bytes` bytes, all 0.
    pub fn new(gpu: &Gpu, bytes: usize) -> Result<Self> {
        use cudarc::driver::{result, sys};
        gpu.ctx.bind_to_thread().map_err(driver_error("bind context"))?;
        let bytes = bytes.max(4);
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
            host: host as *mut u8,
            device,
            bytes,
            _ctx: gpu.ctx.clone(),
        })
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Its address on the device.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Copies `data` to the bytes at device address `at`.
    ///
    /// # Safety
    /// No kernel reads those bytes until the host publishes them (a flag
    /// stored after this call), and no other thread writes them meanwhile.
    pub unsafe fn write_at(&self, at: u64, data: &[u8]) -> Result<()> {
        let start = at
            .checked_sub(self.device)
            .and_then(|o| usize::try_from(o).ok())
            .filter(|&o| o.checked_add(data.len()).is_some_and(|e| e <= self.bytes));
        let Some(start) = start else {
            return Err(CudaError::Invalid(format!(
                "mapped bytes {at:#x}..+{} outside {:#x}..+{}",
                data.len(),
                self.device,
                self.bytes
            )));
        };
        // SAFETY: in bounds (checked); exclusive by the caller's guarantee.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.host.add(start), data.len()) };
        Ok(())
    }
}

impl Drop for MappedMemory {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; no kernel may still
        // read it (callers synchronize before dropping).
        unsafe {
            let _ = cudarc::driver::result::free_host(self.host as *mut std::ffi::c_void);
        }
    }
}

/// Flags in mapped memory: the host publishes them
/// ([`FlagBoard`](crate::flags::FlagBoard) over [`MappedFlags::host`])
/// while a kernel polls them at [`MappedFlags::device_ptr`].
pub struct MappedFlags {
    memory: MappedMemory,
    len: usize,
}

impl MappedFlags {
    /// `len` flags, all 0.
    pub fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        Ok(Self {
            memory: MappedMemory::new(gpu, len.max(1) * 4)?,
            len,
        })
    }

    /// The flags as the host sees them.
    pub fn host(&self) -> &[std::sync::atomic::AtomicU32] {
        // SAFETY: `len` u32s owned by `memory`, 4-byte aligned (page-aligned
        // allocation); AtomicU32 has u32's layout, and every access to them
        // is atomic.
        unsafe { std::slice::from_raw_parts(self.memory.host as *const std::sync::atomic::AtomicU32, self.len) }
    }

    /// Their address on the device.
    pub fn device_ptr(&self) -> u64 {
        self.memory.device
    }

    /// Flag `i`'s address on the device.
    pub fn flag_ptr(&self, i: usize) -> u64 {
        self.memory.device + 4 * i as u64
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
