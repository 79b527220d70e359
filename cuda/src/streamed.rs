//! A packed model's FFN streamed to the device from flash under any of the
//! CPU engine's streaming policies: the runtime's [`FlashEngine`] decides
//! each layer (its policy, predictor, controller and neuron cache in host
//! memory; [`FlashEngine::plan_device_call`]) and its streamer reads the
//! bundles; the host lands each bundle in pinned, mapped staging and
//! publishes its flag ([`crate::stream::feed`]), while the streaming
//! kernels, launched before the first bundle lands, poll the flags and
//! compute in arrival order, keeping what the policy keeps. The host never
//! synchronizes the device between a layer's bundles; a policy that reads
//! the layer's rows (a predictor's input) gets them copied back once a
//! layer, before its FFN is planned.
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
use leanstream_runtime::engine::{DeviceCall, FlashEngine, FlashModel, Streamer};

use crate::device::{check_down_columns, DevPtr, Gpu, Keep, MappedFlags, MappedMemory};
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
    /// Per row, the policy's bitmap of what it keeps (where it gives one).
    keep: MappedMemory,
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
    call: DeviceCall,
    plan: SlotPlan,
    epoch: u32,
    set: usize,
    fed: bool,
}

pub struct StreamedFfn {
    /// The policy and its streamer (never the resident `dense`).
    engine: FlashEngine,
    formats: Vec<BundleFormat>,
    n_ff: usize,
    max_batch: usize,
    sets: [Set; 2],
    /// The neuron cache's copy on the device (`None`: the streamer has no cache).
    cache: Option<OnDevice>,
    /// The set the next layer takes (they alternate).
    next_set: usize,
    /// `0..n_ff`: the slots are in neuron order, and stage 2 sums in it.
    order: CudaSlice<u32>,
    epochs: Epochs,
    /// Bundles not landed this long after a layer's first launch are
    /// skipped (`None`: every one is waited for, unless the policy sets a
    /// deadline; the sooner of the two applies).
    pub deadline: Option<Duration>,
    current: Option<Current>,
    /// What was landed, over every layer so far.
    pub fed: Fed,
}

impl StreamedFfn {
    /// Streams `fm`'s bundles under `engine`'s policy (made for `fm`, a
    /// streaming policy with a budget that does not hold every layer whole:
    /// those are uploaded resident instead), for calls of up to `max_batch`
    /// rows. The down parts must be Q8_0 or F16 columns.
    pub fn new(gpu: &Gpu, fm: &FlashModel, engine: FlashEngine, max_batch: usize) -> Result<Self> {
        let path = fm.flash.path().display();
        let Some(streamer) = engine.streamer() else {
            return Err(CudaError::Invalid(format!(
                "{path}: the {} policy holds its bundles in memory; upload them resident instead",
                engine.policy()
            )));
        };
        if streamer.holds_whole() {
            return Err(CudaError::Invalid(format!(
                "{path}: the budget holds every layer whole; load the bundles resident (no budget) instead"
            )));
        }
        for (l, f) in fm.formats.iter().enumerate() {
            check_down_columns(f).map_err(|e| CudaError::Invalid(format!("{path}: layer {l}: {e}")))?;
        }
        let n_ff = fm.flash.n_ff();
        let max_batch = max_batch.max(1);
        let widest = fm.formats.iter().map(BundleFormat::bundle_bytes).max().unwrap_or(0);
        let set = || -> Result<Set> {
            Ok(Set {
                staging: MappedMemory::new(gpu, n_ff * widest)?,
                flags: MappedFlags::new(gpu, n_ff)?,
                table: MappedMemory::new(gpu, n_ff * std::mem::size_of::<Slot>())?,
                fills: MappedMemory::new(gpu, n_ff * 2 * std::mem::size_of::<u64>())?,
                keep: MappedMemory::new(gpu, max_batch * n_ff.div_ceil(64) * std::mem::size_of::<u64>())?,
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
            engine,
            formats: fm.formats.clone(),
            n_ff,
            max_batch,
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
        match self.engine.streamer() {
            Some(s) => s,
            None => unreachable!("`new` takes streaming engines only"),
        }
    }

    /// The policy's engine (its decisions, predictor and streamer).
    pub fn engine(&self) -> &FlashEngine {
        &self.engine
    }

    /// Whether the policy reads each layer's rows: pass them to
    /// [`begin`](Self::begin).
    pub fn reads_rows(&self) -> bool {
        self.engine.reads_rows()
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

    /// Before layer `layer`'s attention: its input rows `x`, `[n][n_embd]`,
    /// for a policy that [`reads_rows`](Self::reads_rows).
    pub fn layer_input(&mut self, layer: usize, x: &[f32], n: usize) -> Result<()> {
        Ok(self.engine.device_layer_input(layer, x, n)?)
    }

    /// Layer `layer`'s call of `n` rows: the policy decides what it keeps
    /// and asks for those bundles (and reads ahead), from `rows` (the
    /// residual and the normed FFN input, `[n][n_embd]` each, where
    /// [`reads_rows`](Self::reads_rows)); then, once its set is free, its
    /// slot table is written: one slot per neuron asked for, in neuron order.
    pub fn begin(&mut self, layer: usize, n: usize, rows: Option<(&[f32], &[f32])>) -> Result<()> {
        let bb = self.format(layer)?.bundle_bytes();
        if n > self.max_batch {
            return Err(CudaError::Invalid(format!(
                "layer {layer}: {n} rows, the streamed FFN was made for {}",
                self.max_batch
            )));
        }
        let (resid, xb) = rows.unwrap_or_default();
        let call = self.engine.plan_device_call(layer, n, resid, xb)?;
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
        let streamer = match self.engine.streamer() {
            Some(s) => s,
            None => unreachable!("`new` takes streaming engines only"),
        };
        let plan = SlotPlan::new(streamer, layer, self.n_ff, bb, at, cache);
        // SAFETY: the set's last kernels are done (the event above), and no
        // kernel of this layer is launched yet.
        unsafe {
            set.table
                .write_at(set.table.device_ptr(), bytemuck::cast_slice(&plan.slots))?;
            if let Some(bits) = &call.rows {
                set.keep.write_at(set.keep.device_ptr(), bytemuck::cast_slice(bits))?;
            }
        };
        self.current = Some(Current {
            call,
            plan,
            epoch: self.epochs.advance()?,
            set: k,
            fed: false,
        });
        Ok(())
    }

    /// The sooner of the set deadline (from now) and the policy's.
    fn deadline_at(&self, call: &DeviceCall) -> Option<Instant> {
        call.deadline
            .into_iter()
            .chain(self.deadline.map(|d| Instant::now() + d))
            .min()
    }

    /// Row `t`'s stage 1 and stage 2 over the current layer's slots,
    /// launched (asynchronously): `act[s]` for each slot as its flag turns,
    /// kept or dropped as the policy says, then `y += Σ act[s] · down_s` in
    /// neuron order. The first row's launch is followed by
    /// [`feed`](Self::feed); the later rows are launched after it and
    /// compute what had landed by then (with a deadline, they skip the
    /// rest at once rather than wait for it again).
    pub fn stage(&self, gpu: &Gpu, t: usize, row: RowFfn) -> Result<()> {
        let c = self.current()?;
        let format = &self.formats[c.plan.layer];
        let set = &self.sets[c.set];
        let slots = DevPtr(set.table.device_ptr());
        let deadline_ns = match self
            .deadline_at(&c.call)
            .map(|at| at.saturating_duration_since(Instant::now()))
        {
            None => 0,
            Some(d) if t == 0 => d.as_nanos().max(1) as u64,
            Some(_) => 1,
        };
        let keep = match &c.call.rows {
            Some(_) => Keep {
                threshold: 0.0,
                rows: DevPtr(set.keep.device_ptr() + (t * c.call.words * std::mem::size_of::<u64>()) as u64),
            },
            None => Keep {
                threshold: c.call.threshold,
                rows: DevPtr(0),
            },
        };
        let table = SlotTable {
            slots,
            order: gpu.ptr(&self.order),
            n: c.plan.slots.len(),
        };
        table.launch(gpu, format, c.epoch, deadline_ns, keep, row)
    }

    /// Lands the current layer's bundles while its first row's kernels run
    /// (hits at once, reads in arrival order), until all have landed or
    /// the deadline passes.
    pub fn feed(&mut self) -> Result<Fed> {
        let deadline = self.deadline_at(&self.current()?.call);
        let c = self
            .current
            .as_mut()
            .ok_or_else(|| CudaError::Invalid("feed before begin".into()))?;
        if c.fed {
            return Err(CudaError::Invalid(format!("layer {} was fed already", c.plan.layer)));
        }
        c.fed = true;
        let landing = self.sets[c.set].landing(c.epoch);
        let streamer = match self.engine.streamer_mut() {
            Some(s) => s,
            None => unreachable!("`new` takes streaming engines only"),
        };
        let fed = feed(streamer, &c.plan, deadline, &landing)?;
        self.fed.in_place += fed.in_place;
        self.fed.hits += fed.hits;
        self.fed.read += fed.read;
        self.fed.missing += fed.missing;
        self.fed.cancelled += fed.cancelled;
        Ok(fed)
    }

    /// After the current layer's last launch: copies the hits landed from
    /// the host into the device's cache, marks the set busy until the
    /// device is done with it, and lets the policy and streamer go on.
    pub fn end(&mut self, gpu: &Gpu) -> Result<()> {
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
        self.engine.finish_device_call(c.plan.layer);
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
