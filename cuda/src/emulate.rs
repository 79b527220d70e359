//! The streaming FFN's device kernels (`kernels/cuda/ffn_stream.cu`) run on
//! CPU threads against the same slot table and flags: the hand-off's test
//! bench on machines without a GPU.
//!
//! Each emulated warp does what its CUDA twin does: the first to start
//! stamps the layer's start time; a warp takes the next slot in index order
//! (the order thread blocks are scheduled in), polls the slot's flag with
//! acquire loads until it reaches the epoch or the deadline passes, then
//! computes the neuron's activation from the bundle, or records the slot as
//! skipped. Stage 2 sums the down columns in the host's order. The
//! arithmetic is the CPU engine's (`leanstream_kernels::sparse_ffn`), so a
//! GPU run differs from this only in rounding, while what is computed, what
//! is skipped, and the order of the sums are the protocol's and equal.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use leanstream_kernels::sparse_ffn::{axpy_down, neuron_activation, BundleFormat, DownLayout, FfnActivation, FfnInput};
use leanstream_runtime::engine::keeps;

use crate::flags::{FlagBoard, Slot};
use crate::stream::{CacheFill, Landing};
use crate::{CudaError, Result};

/// Bundle bytes written by storage workers and read by the compute side,
/// ordered only by the flags, as pinned memory is between host and GPU.
pub struct Staging {
    bytes: Box<[UnsafeCell<u8>]>,
}

// SAFETY: access is ordered by the flag protocol (see `write` and `read`);
// the bytes themselves carry no invariant.
unsafe impl Sync for Staging {}

impl Staging {
    /// `len` bytes, all `fill` (tests fill with garbage, so a read that
    /// beats its write shows).
    pub fn new(len: usize, fill: u8) -> Self {
        Self {
            bytes: (0..len).map(|_| UnsafeCell::new(fill)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn range(&self, offset: u64, len: usize) -> Result<usize> {
        let start = usize::try_from(offset)
            .ok()
            .filter(|&s| s.checked_add(len).is_some_and(|e| e <= self.len()));
        start.ok_or_else(|| {
            CudaError::Invalid(format!(
                "staging bytes {offset}..+{len} outside a buffer of {}",
                self.len()
            ))
        })
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// Nobody reads these bytes until their slot's flag is published after
    /// this call, and nobody else writes them in the same epoch.
    pub unsafe fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let start = self.range(offset, data.len())?;
        // SAFETY: in bounds (checked); the cells permit writes through a
        // shared reference, and the caller guarantees no concurrent access.
        unsafe {
            let dst = UnsafeCell::raw_get(self.bytes.as_ptr().add(start));
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
        }
        Ok(())
    }

    /// The `len` bytes at `offset`.
    ///
    /// # Safety
    /// The slot's flag was seen ready (acquire) for the current epoch, so
    /// its write happened before, and no write to them runs until the
    /// returned slice is dropped.
    pub unsafe fn read(&self, offset: u64, len: usize) -> Result<&[u8]> {
        let start = self.range(offset, len)?;
        // SAFETY: in bounds; no concurrent writer (caller's guarantee).
        Ok(unsafe { std::slice::from_raw_parts(UnsafeCell::raw_get(self.bytes.as_ptr().add(start)), len) })
    }
}

/// One layer's FFN as the stage-1 kernel sees it.
#[derive(Clone, Copy)]
pub struct StreamLayer<'a> {
    /// Bundles with down columns (the per-neuron layout the kernel reads).
    pub format: BundleFormat,
    pub input: FfnInput<'a>,
    pub act: FfnActivation,
    /// What the row keeps (the kernel's `threshold` and `keep`): the
    /// neurons set in this bitmap over neuron ids where given, else those
    /// with `|a|` not below the threshold.
    pub threshold: f32,
    pub keep: Option<&'a [u64]>,
}

impl StreamLayer<'_> {
    /// Neuron `i`'s activation `a` as stage 1 leaves it: `a`, or 0 if dropped.
    fn kept(&self, i: u32, a: f32) -> f32 {
        if keeps(self.threshold, self.keep, i as usize, a) {
            a
        } else {
            0.0
        }
    }
}

/// What stage 1 leaves: per slot, its activation (0 when skipped) and
/// whether it was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage1 {
    pub act: Vec<f32>,
    pub skipped: Vec<bool>,
}

/// Stage 1 (`ffn_stream_activations`) on `warps` threads. `deadline`
/// counts from the first warp's start; `None` waits for every slot.
pub fn activations(
    layer: &StreamLayer,
    slots: &[Slot],
    epoch: u32,
    board: &FlagBoard,
    staging: &Staging,
    deadline: Option<Duration>,
    warps: usize,
) -> Result<Stage1> {
    if layer.format.down_layout != DownLayout::Columns {
        return Err(CudaError::Invalid(
            "the streaming kernel reads down columns; tiles go through the dense path".into(),
        ));
    }
    let bundle_bytes = layer.format.bundle_bytes();
    let act: Vec<AtomicU32> = slots.iter().map(|_| AtomicU32::new(0)).collect();
    let skipped: Vec<AtomicBool> = slots.iter().map(|_| AtomicBool::new(false)).collect();
    let next = AtomicUsize::new(0);
    let start = OnceLock::new();
    let failure: Mutex<Option<CudaError>> = Mutex::new(None);
    let warp = || -> Result<()> {
        let start: Instant = *start.get_or_init(Instant::now);
        loop {
            let s = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(s) else { return Ok(()) };
            let flag = usize::try_from(slot.flag)
                .map_err(|_| CudaError::Invalid(format!("slot {s}: flag index {}", slot.flag)))?;
            let ready = loop {
                if board.is_ready(flag, epoch)? {
                    break true;
                }
                if deadline.is_some_and(|d| start.elapsed() > d) {
                    break false;
                }
                // The device sleeps ~200 ns between polls; a thread yields.
                std::thread::yield_now();
            };
            if !ready {
                skipped[s].store(true, Ordering::Relaxed);
                continue;
            }
            // SAFETY: the flag was seen ready (acquire) for this epoch.
            let bundle = unsafe { staging.read(slot.bundle, bundle_bytes)? };
            // One row's vec-dot: the device's order wherever the CPU's tail
            // takes it (every 32-value format; not a repacked or tiled K-quant
            // gate or up matrix, which the emulated tests do not use).
            let a = neuron_activation(&layer.format, &layer.input, layer.act, bundle)?;
            act[s].store(layer.kept(slot.neuron, a).to_bits(), Ordering::Relaxed);
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..warps.max(1) {
            scope.spawn(|| {
                if let Err(e) = warp() {
                    failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                    // Stop the other warps taking new slots.
                    next.store(usize::MAX / 2, Ordering::Relaxed);
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(Stage1 {
        act: act.into_iter().map(|a| f32::from_bits(a.into_inner())).collect(),
        skipped: skipped.into_iter().map(AtomicBool::into_inner).collect(),
    })
}

/// Stage 2 (`ffn_stream_down`): `y += Σ act[s] · down_s` over the slots in
/// `order` (the host sorts them by neuron id), skipping zero activations.
pub fn down(
    format: &BundleFormat,
    slots: &[Slot],
    order: &[u32],
    act: &[f32],
    staging: &Staging,
    y: &mut [f32],
) -> Result<()> {
    let offset = (format.gate_bytes() + format.up_bytes()) as u64;
    for &s in order {
        let s = s as usize;
        let (Some(slot), Some(&a)) = (slots.get(s), act.get(s)) else {
            return Err(CudaError::Invalid(format!("order names slot {s} of {}", slots.len())));
        };
        if a == 0.0 {
            continue;
        }
        // SAFETY: a non-zero activation means stage 1 saw the flag ready,
        // and the stage-1 threads were joined before this runs.
        let column = unsafe { staging.read(slot.bundle + offset, format.down_bytes())? };
        axpy_down(format.down_ty, a, column, y)?;
    }
    Ok(())
}

/// The device cache taking bundles (`ffn_cache_fill`): each fill copies
/// `bytes` within `staging` (the emulation keeps its device cache there too).
///
/// # Safety
/// As on the device, this runs after the layer's stage 2, with no warp
/// running and no landing in flight for those bytes.
pub unsafe fn cache_fill(staging: &Staging, fills: &[CacheFill], bytes: usize) -> Result<()> {
    for f in fills {
        // SAFETY: nothing else touches staging now (the caller's guarantee);
        // the copy goes through a buffer, so overlap cannot corrupt it.
        unsafe {
            let from = staging.read(f.from, bytes)?.to_vec();
            staging.write(f.to, &from)?;
        }
    }
    Ok(())
}

/// Landings into the emulation's staging and flag board, for `epoch`.
pub struct EmulatedLanding<'a> {
    pub staging: &'a Staging,
    pub board: &'a FlagBoard<'a>,
    pub epoch: u32,
}

impl Landing for EmulatedLanding<'_> {
    fn land(&self, slot: &Slot, bundle: &[u8]) -> Result<()> {
        // SAFETY: a slot lands once an epoch, before its flag is published
        // (below), and no warp reads it before seeing the flag.
        unsafe { self.staging.write(slot.bundle, bundle)? };
        self.release(slot)
    }

    fn release(&self, slot: &Slot) -> Result<()> {
        let flag = usize::try_from(slot.flag).map_err(|_| CudaError::Invalid(format!("flag index {}", slot.flag)))?;
        self.board.publish(flag, self.epoch)
    }
}

/// One layer through the emulated device as the device engine runs it:
/// stage 1 on `warps` threads polls the flags while `feed` lands bundles on
/// this thread, then stage 2 adds `Σ act · down` over `slots` in `order`
/// into `y`. Returns stage 1's result and what `feed` returned.
#[allow(clippy::too_many_arguments)]
pub fn stream_layer<T>(
    layer: &StreamLayer,
    slots: &[Slot],
    order: &[u32],
    landing: &EmulatedLanding,
    deadline: Option<Duration>,
    warps: usize,
    y: &mut [f32],
    feed: impl FnOnce(&EmulatedLanding) -> Result<T>,
) -> Result<(Stage1, T)> {
    let (stage1, fed) = std::thread::scope(|scope| {
        let device = scope.spawn(|| {
            activations(
                layer,
                slots,
                landing.epoch,
                landing.board,
                landing.staging,
                deadline,
                warps,
            )
        });
        let fed = feed(landing);
        let stage1 = device
            .join()
            .unwrap_or_else(|_| Err(CudaError::Invalid("an emulated warp panicked".into())));
        (stage1, fed)
    });
    let (stage1, fed) = (stage1?, fed?);
    down(&layer.format, slots, order, &stage1.act, landing.staging, y)?;
    Ok((stage1, fed))
}
