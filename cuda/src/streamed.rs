//! A packed model's FFN streamed to the device from flash: the runtime's
//! [`Streamer`] reads the bundles (its I/O thread, its neuron cache in host
//! memory) as `dense-stream` asks for them, every layer each token with the
//! next layers read ahead; the host lands each bundle in pinned, mapped
//! staging and publishes its flag ([`crate::stream::feed`]), while the
//! streaming kernels, launched before the first bundle lands, poll the
//! flags and compute in arrival order. The host never synchronizes the
//! device between a layer's bundles.
//!
//! Layers take turns with two sets of staging, flags and slot tables, so
//! layer l+1 lands while layer l's down kernel still reads its bundles; an
//! event per set says when its last layer is done with it.
//!
//! The neuron cache is mirrored in device memory ([`DeviceCache`]): a hit
//! the device holds is read in place; one it does not is landed from the
//! host's cache like a read and copied into the device's slot after the
//! layer, so a bundle that stays cached crosses the bus once, not each token.

use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice};
use leanstream_kernels::sparse_ffn::BundleFormat;
use leanstream_runtime::engine::{FlashModel, Streamer, Want, STAGES};

use crate::device::{check_down_columns, DevPtr, Gpu, MappedFlags, MappedMemory};
use crate::ffn::{RowFfn, SlotTable};
use crate::flags::{Epochs, FlagBoard, Slot, ALWAYS_READY};
use crate::stream::{feed, release_all, DeviceCache, Fed, Landing, SlotAddresses, SlotPlan};
use crate::{CudaError, Result};

/// Landings into mapped staging and flags, for one epoch.
struct MappedLanding<'a> {
    staging: &'a MappedMemory,
    flags: &'a MappedFlags,
    epoch: u32,
}

impl Landing for MappedLanding<'_> {
    fn land(&self, slot: &Slot, bundle: &[u8]) -> Result<()> {
        // SAFETY: a slot lands once an epoch, before its flag is published
        // (below); no kernel reads its bytes before seeing the flag, and the
        // set's previous layer is done with them (`StreamedFfn::begin`).
        unsafe { self.staging.write_at(slot.bundle, bundle)? };
        self.release(slot)
    }

    fn release(&self, slot: &Slot) -> Result<()> {
        let index = slot
            .flag
            .checked_sub(self.flags.device_ptr())
            .map(|o| (o / 4) as usize)
            .ok_or_else(|| CudaError::Invalid(format!("flag address {:#x} outside the board", slot.flag)))?;
        FlagBoard::new(self.flags.host()).publish(index, self.epoch)
    }
}

/// One set of what a layer in flight holds.
struct Set {
    staging: MappedMemory,
    flags: MappedFlags,
    /// The slot table, read by the kernels over the bus.
    table: MappedMemory,
    /// The device cache's (from, to) copies after the layer.
    fills: MappedMemory,
    /// Recorded after the last layer that used the set.
    done: Option<CudaEvent>,
}

impl Set {
    /// Landings into this set for `epoch`.
    fn landing(&self, epoch: u32) -> MappedLanding<'_> {
        MappedLanding {
            staging: &self.staging,
            flags: &self.flags,
            epoch,
        }
    }
}

/// The device's copy of the neuron cache.
struct OnDevice {
    /// Its slots, the host cache's slot `s` at `s × stride`.
    slots: CudaSlice<u8>,
    /// The flag in-place slots point at, fixed at [`ALWAYS_READY`].
    _ready: CudaSlice<u32>,
    map: DeviceCache,
}

/// The layer between [`StreamedFfn::begin`] and [`StreamedFfn::end`].
struct Current {
    plan: SlotPlan,
    epoch: u32,
    set: usize,
    fed: bool,
}

pub struct StreamedFfn {
    streamer: Streamer,
    formats: Vec<BundleFormat>,
    n_ff: usize,
    sets: [Set; 2],
    /// The neuron cache's copy on the device (`None`: the streamer has no cache).
    cache: Option<OnDevice>,
    /// The set the next layer takes (they alternate).
    next_set: usize,
    /// `0..n_ff`: the slots are in neuron order, and stage 2 sums in it.
    order: CudaSlice<u32>,
    epochs: Epochs,
    /// Bundles not landed this long after a layer's first launch are
    /// skipped (`None`: every one is waited for).
    pub deadline: Option<Duration>,
    current: Option<Current>,
    /// What was landed, over every layer so far.
    pub fed: Fed,
}

impl StreamedFfn {
    /// Streams `fm`'s bundles through `streamer` (made for `fm`, with a
    /// budget that does not hold every layer whole: those are uploaded
    /// resident instead). The down parts must be Q8_0 or F16 columns.
    pub fn new(gpu: &Gpu, fm: &FlashModel, streamer: Streamer) -> Result<Self> {
        let path = fm.flash.path().display();
        if streamer.holds_whole() {
            return Err(CudaError::Invalid(format!(
                "{path}: the budget holds every layer whole; load the bundles resident (no budget) instead"
            )));
        }
        for (l, f) in fm.formats.iter().enumerate() {
            check_down_columns(f).map_err(|e| CudaError::Invalid(format!("{path}: layer {l}: {e}")))?;
        }
        let n_ff = fm.flash.n_ff();
        let widest = fm.formats.iter().map(BundleFormat::bundle_bytes).max().unwrap_or(0);
        let set = || -> Result<Set> {
            Ok(Set {
                staging: MappedMemory::new(gpu, n_ff * widest)?,
                flags: MappedFlags::new(gpu, n_ff)?,
                table: MappedMemory::new(gpu, n_ff * std::mem::size_of::<Slot>())?,
                fills: MappedMemory::new(gpu, n_ff * 2 * std::mem::size_of::<u64>())?,
                done: None,
            })
        };
        let cache = match streamer.cache_slots() {
            0 => None,
            n => {
                let stride = widest as u64;
                let slots = gpu.zeros::<u8>(DeviceCache::bytes(n, stride) as usize)?;
                let ready = gpu.upload(&[ALWAYS_READY])?;
                let map = DeviceCache::new(gpu.ptr(&slots).0, stride, gpu.ptr(&ready).0, n);
                Some(OnDevice {
                    slots,
                    _ready: ready,
                    map,
                })
            }
        };
        let order: Vec<u32> = (0..n_ff as u32).collect();
        Ok(Self {
            streamer,
            formats: fm.formats.clone(),
            n_ff,
            sets: [set()?, set()?],
            cache,
            next_set: 0,
            order: gpu.upload(&order)?,
            epochs: Epochs::new(),
            deadline: None,
            current: None,
            fed: Fed::default(),
        })
    }

    pub fn streamer(&self) -> &Streamer {
        &self.streamer
    }

    /// Device memory the neuron cache's copy takes.
    pub fn device_cache_bytes(&self) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.slots.len() as u64)
    }

    pub fn format(&self, layer: usize) -> Result<&BundleFormat> {
        self.formats
            .get(layer)
            .ok_or_else(|| CudaError::Invalid(format!("layer {layer} of {}", self.formats.len())))
    }

    /// Asks for layer `layer` (and reads the next ones ahead, as
    /// `dense-stream` does), waits until its set is free, and writes its
    /// slot table: one slot per neuron, in neuron order.
    pub fn begin(&mut self, layer: usize) -> Result<()> {
        let n_layer = self.formats.len();
        let bb = self.format(layer)?.bundle_bytes();
        self.streamer.ensure(layer, Want::All)?;
        for ahead in 1..STAGES.min(n_layer) {
            self.streamer.prefetch((layer + ahead) % n_layer, Want::All)?;
        }
        let k = self.next_set;
        self.next_set ^= 1;
        let set = &mut self.sets[k];
        if let Some(done) = set.done.take() {
            done.synchronize()
                .map_err(|e| CudaError::Driver(format!("waiting on layer {layer}'s staging: {e}")))?;
        }
        let at = SlotAddresses {
            staging: set.staging.device_ptr(),
            flags: set.flags.device_ptr(),
            flag_stride: 4,
        };
        let cache = self.cache.as_ref().map(|c| &c.map);
        let plan = SlotPlan::new(&self.streamer, layer, self.n_ff, bb, at, cache);
        // SAFETY: the set's last kernels are done (the event above), and no
        // kernel of this layer is launched yet.
        unsafe {
            set.table
                .write_at(set.table.device_ptr(), bytemuck::cast_slice(&plan.slots))?
        };
        self.current = Some(Current {
            plan,
            epoch: self.epochs.advance()?,
            set: k,
            fed: false,
        });
        Ok(())
    }

    /// One row's stage 1 and stage 2 over the current layer's slots,
    /// launched (asynchronously): `act[s]` for each slot as its flag turns,
    /// then `y += Σ act[s] · down_s` in neuron order. The first row's launch
    /// is followed by [`feed`](Self::feed); the later rows are launched
    /// after it and compute what had landed by then (with a deadline, they
    /// skip the rest at once rather than wait for it again).
    pub fn stage(&self, gpu: &Gpu, first_row: bool, row: RowFfn) -> Result<()> {
        let c = self.current()?;
        let format = &self.formats[c.plan.layer];
        let slots = DevPtr(self.sets[c.set].table.device_ptr());
        let deadline_ns = match self.deadline {
            None => 0,
            Some(d) if first_row => d.as_nanos().max(1) as u64,
            Some(_) => 1,
        };
        let table = SlotTable {
            slots,
            order: gpu.ptr(&self.order),
            n: c.plan.slots.len(),
        };
        table.launch(gpu, format, c.epoch, deadline_ns, row)
    }

    /// Lands the current layer's bundles while its first row's kernels run
    /// (hits at once, reads in arrival order), until all have landed or
    /// the deadline passes.
    pub fn feed(&mut self) -> Result<Fed> {
        let deadline = self.deadline.map(|d| Instant::now() + d);
        let c = self
            .current
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("feed before begin".into()))?;
        if c.fed {
            return Err(CudaError::Invalid(format!("layer {} was fed already", c.plan.layer)));
        }
        c.fed = true;
        let landing = self.sets[c.set].landing(c.epoch);
        let fed = feed(&mut self.streamer, &c.plan, deadline, &landing)?;
        self.fed.in_place += fed.in_place;
        self.fed.hits += fed.hits;
        self.fed.read += fed.read;
        self.fed.missing += fed.missing;
        Ok(fed)
    }

    /// After the current layer's last launch: copies the hits landed from
    /// the host into the device's cache, marks the set busy until the
    /// device is done with it, and lets the streamer go on.
    pub fn end(&mut self, gpu: &Gpu, end_of_token: bool) -> Result<()> {
        let c = self
            .current
            .take()
            .ok_or_else(|| CudaError::Invalid("end before begin".into()))?;
        if !c.fed {
            return Err(CudaError::Invalid(format!(
                "layer {} ended without landing",
                c.plan.layer
            )));
        }
        if let Some(cache) = &mut self.cache {
            let set = &self.sets[c.set];
            let bb = self.formats[c.plan.layer].bundle_bytes() as u64;
            cache.map.fill(&c.plan, |fills| {
                let pairs: Vec<u64> = fills.iter().flat_map(|f| [f.from, f.to]).collect();
                // SAFETY: the set's previous layer is done with its fill list
                // (`begin` waited on its event), and the copy kernel that
                // reads it is launched after this write, in stream order
                // after the layer's kernels, which saw every staged flag.
                unsafe {
                    set.fills
                        .write_at(set.fills.device_ptr(), bytemuck::cast_slice(&pairs))?
                };
                gpu.ffn_cache_fill(DevPtr(set.fills.device_ptr()), fills.len(), bb)
            })?;
        }
        let event = gpu
            .stream
            .record_event(None)
            .map_err(|e| CudaError::Driver(format!("record event: {e}")))?;
        self.sets[c.set].done = Some(event);
        self.streamer.finish(c.plan.layer, end_of_token);
        Ok(())
    }

    /// After an error inside the current layer: if its bundles were never
    /// fed, publishes every flag so the kernels already launched finish
    /// (on garbage, thrown away) instead of polling forever; the layer is
    /// dropped.
    pub fn abandon(&mut self) {
        let Some(c) = self.current.take() else { return };
        if !c.fed {
            release_all(&c.plan, &self.sets[c.set].landing(c.epoch));
        }
    }

    fn current(&self) -> Result<&Current> {
        self.current
            .as_ref()
            .ok_or_else(|| CudaError::Invalid("a stage launched before begin".into()))
    }
}
