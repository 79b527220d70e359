//! A packed model's FFN held in device memory: each layer's neuron bundles
//! (gate row, up row, down column) uploaded whole, the neuron cache with
//! every neuron resident, computed by the streaming FFN kernels
//! (`ffn_stream.cu`) with every slot's flag already set. This is the
//! device engine's way into a `.lsflash` model, and what the compute
//! profile measures for a GPU (`leanstream-profile compute --device cuda`).

use cudarc::driver::CudaSlice;
use leanstream_kernels::sparse_ffn::BundleFormat;
use leanstream_runtime::engine::FlashModel;

use crate::device::{check_down_columns, DevPtr, Gpu, Keep, StreamInput};
use crate::flags::Slot;
use crate::{CudaError, Result};

/// The flag value of a slot that is always ready (`ffn_stream.cu`).
pub const ALWAYS_READY: u32 = u32::MAX;

/// One layer's bundles in device memory, by neuron id.
pub struct ResidentBundles {
    bundles: CudaSlice<u8>,
    /// Slot `i` holds neuron `i`, its flag always ready.
    slots: CudaSlice<Slot>,
    /// `0..n_ff`: stage 2 sums in neuron order, as the CPU does.
    order: CudaSlice<u32>,
    /// The flag every slot points at, holding [`ALWAYS_READY`].
    ready: CudaSlice<u32>,
    pub format: BundleFormat,
    pub n_ff: usize,
}

impl ResidentBundles {
    /// Reads layer `layer`'s bundles of `fm` and uploads them.
    pub fn upload(gpu: &Gpu, fm: &FlashModel, layer: usize) -> Result<Self> {
        let format = fm.formats[layer];
        check_down_columns(&format)
            .map_err(|e| CudaError::Invalid(format!("{}: layer {layer}: {e}", fm.flash.path().display())))?;
        let bytes = fm.flash.layer_by_neuron(layer)?;
        let bundles = gpu.upload(&bytes)?;
        let ready = gpu.upload(&[ALWAYS_READY])?;
        let n_ff = fm.flash.n_ff();
        let (base, flag) = (gpu.ptr(&bundles).0, gpu.ptr(&ready).0);
        let slots: Vec<Slot> = (0..n_ff).map(|i| slot_of(base, flag, &format, i)).collect();
        let order: Vec<u32> = (0..n_ff as u32).collect();
        Ok(Self {
            slots: gpu.upload(&slots)?,
            order: gpu.upload(&order)?,
            bundles,
            ready,
            format,
            n_ff,
        })
    }

    /// Neuron `i`'s slot (`i < n_ff`), always ready: a stage over any
    /// subset of neurons is a slot table of these.
    pub fn slot(&self, gpu: &Gpu, i: usize) -> Slot {
        slot_of(gpu.ptr(&self.bundles).0, gpu.ptr(&self.ready).0, &self.format, i)
    }

    /// The whole layer's FFN of one token: `act[i]` for every neuron, then
    /// `y += Σ act[i] * down_i` in neuron order (`y` zeroed by the caller).
    pub fn forward_row(&self, gpu: &Gpu, row: RowFfn) -> Result<()> {
        let table = SlotTable {
            slots: gpu.ptr(&self.slots),
            order: gpu.ptr(&self.order),
            n: self.n_ff,
        };
        self.stage(gpu, table, row)
    }

    /// One stage of one token over the slots of `table` (of this layer's
    /// [`slot`](Self::slot)s), asynchronously: stage 1's `act[s]`, then
    /// `y += Σ act[s] * down_s` in `table.order`.
    pub fn stage(&self, gpu: &Gpu, table: SlotTable, row: RowFfn) -> Result<()> {
        table.launch(gpu, &self.format, 1, 0, Keep::ALL, row)
    }
}

/// One token's row through the streaming kernels: its input in the gate
/// and up rows' dot types, the gated activation's kind and GELU table, the
/// kernels' scratch, where the activations go and the output it adds to.
#[derive(Debug, Clone, Copy)]
pub struct RowFfn {
    pub input: StreamInput,
    pub act_kind: i32,
    pub gelu_table: DevPtr,
    pub scratch: FfnScratch,
    pub act: DevPtr,
    pub y: DevPtr,
}

/// A slot table in device memory: `n` slots and the order stage 2 sums them in.
#[derive(Debug, Clone, Copy)]
pub struct SlotTable {
    pub slots: DevPtr,
    pub order: DevPtr,
    pub n: usize,
}

impl SlotTable {
    /// One stage of one token over these slots, launched asynchronously:
    /// stage 1's `act[s]` once slot `s`'s flag reaches `epoch` (or skipped
    /// `deadline_ns` after the first warp starts; 0: wait for every flag),
    /// keeping what `keep` says, then `y += Σ act[s] * down_s` in `order`.
    pub fn launch(
        &self,
        gpu: &Gpu,
        format: &BundleFormat,
        epoch: u32,
        deadline_ns: u64,
        keep: Keep,
        row: RowFfn,
    ) -> Result<()> {
        let scratch = row.scratch;
        gpu.zero_at(scratch.start_ns, 8)?;
        gpu.ffn_stream_activations(
            self.slots,
            self.n,
            epoch,
            row.input,
            format,
            row.act_kind,
            row.gelu_table,
            scratch.start_ns,
            deadline_ns,
            keep,
            row.act,
            scratch.skipped,
        )?;
        gpu.ffn_stream_down(self.slots, self.order, self.n, row.act, format, row.y)
    }
}

/// Neuron `i`'s slot in bundles at device address `base`, its flag at `flag`.
fn slot_of(base: u64, flag: u64, format: &BundleFormat, i: usize) -> Slot {
    Slot {
        bundle: base + (i * format.bundle_bytes()) as u64,
        flag,
        neuron: i as u32,
        pad: 0,
    }
}

/// Device scratch of the streaming kernels: the first warp's start time
/// (8 bytes) and per-slot skipped flags (`n_ff` bytes).
#[derive(Debug, Clone, Copy)]
pub struct FfnScratch {
    pub start_ns: DevPtr,
    pub skipped: DevPtr,
}
