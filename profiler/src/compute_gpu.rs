//! The compute sweep on a CUDA device (`leanstream-profile compute --device
//! cuda[:N]`): the CPU sweep's conditions (`compute_sweep.rs`) measured on
//! the GPU backend's kernels, into the same shards, so the controller
//! table can be synthesized for a GPU device.
//!
//! - `ffn_stage`: the streaming FFN kernels (`ffn_stream.cu`) over
//!   `neurons` random neurons of a layer held in device memory, one token:
//!   the host writes the slot table, then stage 1 and stage 2 run; timed to
//!   the device's completion.
//! - `ffn_split`: the same neurons in `stages` stages, each its own launch
//!   pair, the host synchronizing the device between stages (the hand-off
//!   that the flags of Table 3 replace).
//! - `decode`: one decode step of the device engine over the packed model
//!   (attention over the cache, projections, the FFN from resident bundles)
//!   at context `ctx_len`, logits copied back as a sampler needs them.
//!
//! The device runs its own threads: the plan holds one thread count, and
//! `background_io` keeps its meaning (host reads run during the visit).

use std::collections::HashMap;
use std::fs::File;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use leanstream_cuda::device::{activation_id, Gpu, StreamInput};
use leanstream_cuda::engine::GpuModel;
use leanstream_cuda::ffn::{FfnScratch, ResidentBundles, RowFfn, SlotTable};
use leanstream_cuda::flags::{down_order, Slot};
use leanstream_runtime::engine::FlashModel;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::compute_sweep::{stage_chunks, timed_visit, ComputeSetup, Opened, Visit};
use crate::plan::{ComputeCondition, Condition, ConditionKind, Kernel};
use crate::runner::{Executor, Measured};
use crate::{ProfileError, Result};

fn device(e: leanstream_cuda::CudaError) -> ProfileError {
    ProfileError::Device(e.to_string())
}

/// Runs compute conditions on a CUDA device.
pub struct GpuComputeExecutor {
    fm: FlashModel,
    /// Dropped before `gpu`'s context: declared first.
    decode: HashMap<u32, GpuModel>,
    layer: ResidentBundles,
    x_gate: CudaSlice<u8>,
    x_up: CudaSlice<u8>,
    slots: CudaSlice<Slot>,
    order: CudaSlice<u32>,
    act: CudaSlice<f32>,
    skipped: CudaSlice<u8>,
    start_ns: CudaSlice<u64>,
    y: CudaSlice<f32>,
    gelu: CudaSlice<f32>,
    act_kind: i32,
    gpu: Gpu,
    ordinal: usize,
    bg: (File, u64),
    rng: StdRng,
}

impl GpuComputeExecutor {
    pub fn new(setup: &ComputeSetup, seed: u64, ordinal: usize) -> Result<Self> {
        let Opened { fm, x, rng, bg } = setup.open(seed)?;
        let l = setup.layer;
        let gpu = Gpu::open(ordinal).map_err(device)?;
        let layer = ResidentBundles::upload(&gpu, &fm, l).map_err(device)?;
        let c = &fm.model.config;
        let (n_embd, n_ff) = (c.n_embd, c.n_ff);
        let dx = gpu.upload(&x).map_err(device)?;
        let f = layer.format;
        let quantized = |ty: leanstream_kernels::GgmlType| -> Result<CudaSlice<u8>> {
            let dot = ty.vec_dot_type();
            let mut out = gpu.zeros::<u8>(dot.row_bytes(n_embd)?).map_err(device)?;
            gpu.quantize(dot, &dx, n_embd, &mut out).map_err(device)?;
            Ok(out)
        };
        let (x_gate, x_up) = (quantized(f.gate_ty)?, quantized(f.up_ty)?);
        let act_kind = activation_id(c.ffn_activation);
        Ok(Self {
            slots: gpu.zeros(n_ff).map_err(device)?,
            order: gpu.zeros(n_ff).map_err(device)?,
            act: gpu.zeros(n_ff).map_err(device)?,
            skipped: gpu.zeros(n_ff).map_err(device)?,
            start_ns: gpu.zeros(1).map_err(device)?,
            y: gpu.zeros(n_embd).map_err(device)?,
            gelu: gpu.upload(leanstream_kernels::ops::gelu_table()).map_err(device)?,
            x_gate,
            x_up,
            act_kind,
            layer,
            decode: HashMap::new(),
            gpu,
            ordinal,
            bg,
            rng,
            fm,
        })
    }

    /// One FFN stage over `ids` on the device (asynchronous), adding its
    /// partial output to `self.y`.
    fn stage(&mut self, ids: &[usize]) -> Result<()> {
        let g = &self.gpu;
        let slots: Vec<Slot> = ids.iter().map(|&i| self.layer.slot(g, i)).collect();
        let order = down_order(&slots);
        let copy = |e| device(leanstream_cuda::CudaError::Driver(format!("slot table: {e}")));
        g.stream.memcpy_htod(&slots, &mut self.slots).map_err(copy)?;
        g.stream.memcpy_htod(&order, &mut self.order).map_err(copy)?;
        // One token's call, as the engine's decode step makes it.
        let input = StreamInput::new(
            g.ptr(&self.x_gate),
            g.ptr(&self.x_up),
            &self.layer.format,
            self.layer.n_ff,
            0,
            1,
        );
        let table = SlotTable {
            slots: g.ptr(&self.slots),
            order: g.ptr(&self.order),
            n: ids.len(),
        };
        let scratch = FfnScratch {
            start_ns: g.ptr(&self.start_ns),
            skipped: g.ptr(&self.skipped),
        };
        let row = RowFfn {
            input,
            act_kind: self.act_kind,
            gelu_table: g.ptr(&self.gelu),
            scratch,
            act: g.ptr(&self.act),
            y: g.ptr(&self.y),
        };
        self.layer.stage(g, table, row).map_err(device)
    }

    /// One timed call of `c`, finished on the device; returns bytes of
    /// weights it touched.
    fn call(&mut self, c: &ComputeCondition, ids: &[usize]) -> Result<u64> {
        match c.kernel {
            Kernel::FfnStage | Kernel::FfnSplit => {
                let g = &self.gpu;
                g.zero_at(g.ptr(&self.y), self.y.len() * 4).map_err(device)?;
                for chunk in stage_chunks(c, ids) {
                    self.stage(chunk)?;
                    self.gpu.synchronize().map_err(device)?;
                }
                Ok((ids.len() * self.layer.format.bundle_bytes()) as u64)
            }
            Kernel::Decode => {
                let g = self.decode.get_mut(&c.ctx_len).expect("decode state prepared");
                let tok = [1u32 + (c.ctx_len % 64)];
                g.forward(&tok, c.ctx_len as usize).map_err(device)?;
                g.logits().map_err(device)?;
                Ok(0)
            }
        }
    }

    fn prepare_decode(&mut self, ctx: u32) -> Result<()> {
        if self.decode.contains_key(&ctx) {
            return Ok(());
        }
        let gpu = Gpu::open(self.ordinal).map_err(device)?;
        let mut g = GpuModel::from_flash(gpu, &self.fm, ctx as usize + 1, 64).map_err(device)?;
        let vocab = self.fm.model.config.n_vocab.max(2) as u32;
        let tokens: Vec<u32> = (0..ctx).map(|_| self.rng.random_range(1..vocab)).collect();
        g.ingest(&tokens, 0).map_err(device)?;
        self.decode.insert(ctx, g);
        Ok(())
    }

    fn run(&mut self, c: &ComputeCondition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        if c.kernel == Kernel::Decode {
            self.prepare_decode(c.ctx_len)?;
        }
        let visit = Visit::new(c, self.layer.n_ff, &self.bg, n, deadline)?;
        let mut rng = std::mem::replace(&mut self.rng, StdRng::seed_from_u64(0));
        let out = timed_visit(&mut rng, visit, stop, |ids| self.call(c, ids));
        self.rng = rng;
        out
    }
}

impl Executor for GpuComputeExecutor {
    fn visit(&mut self, cond: &Condition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        match &cond.kind {
            ConditionKind::Compute(c) => self.run(c, n, deadline, stop),
            ConditionKind::Io(_) => Err(ProfileError::Invalid("I/O condition in a compute run".into())),
        }
    }
}
