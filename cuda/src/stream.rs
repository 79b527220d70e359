//! The streaming FFN's host side, the same for the device and for its CPU
//! emulation: a layer's wanted neurons become slots, then every bundle
//! *lands* (its bytes written to its slot's staging, then its flag
//! published): the neuron cache's hits at once, each read as the runtime's
//! [`Streamer`] reaps it, in arrival order. Meanwhile the device (or
//! [`crate::emulate`]) computes each slot whose flag has turned, so compute
//! starts on the first bundle that lands, not after the last.
//!
//! With a [`DeviceCache`] the device keeps its own copy of the neuron cache:
//! a hit whose copy is there is read in place and lands nothing, and a hit
//! landed from the host's cache is copied into the device's after the layer
//! ([`CacheFill`]), so a bundle that stays cached crosses the bus once.

use std::time::Instant;

use leanstream_runtime::engine::Streamer;

use crate::flags::Slot;
use crate::{CudaError, Result};

/// Where slot `s`'s bundle and flag are: `staging + s × bundle_bytes` and
/// `flags + s × flag_stride` (device addresses, or in the emulation an
/// offset into its staging and an index into its flag board).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddresses {
    pub staging: u64,
    pub flags: u64,
    pub flag_stride: u64,
}

/// Where landings go.
pub trait Landing {
    /// Writes `bundle` to `slot`'s staging and then publishes its flag
    /// (release): whoever sees the flag sees the bytes.
    fn land(&self, slot: &Slot, bundle: &[u8]) -> Result<()>;

    /// Publishes `slot`'s flag without bytes: only to let a kernel that
    /// waits without a deadline finish after the layer failed (its result
    /// is thrown away).
    fn release(&self, slot: &Slot) -> Result<()>;
}

/// The device's copy of the runtime's neuron cache: the host's cache slot
/// `s` is mirrored at `base + s × stride`. Which bundle a device slot holds
/// is tracked here, by (layer, neuron): bundles never change, so a copy is
/// good for as long as the host's cache keeps that bundle in that slot, and
/// a slot the host has given to another bundle simply stops matching.
#[derive(Debug, Clone)]
pub struct DeviceCache {
    /// Device address of slot 0 (in the emulation, an offset into its staging).
    pub base: u64,
    /// Bytes from one slot to the next (at least the widest bundle).
    pub stride: u64,
    /// A flag fixed at [`crate::flags::ALWAYS_READY`]: what every slot read
    /// in place points at (in the emulation, its index on the board).
    pub ready_flag: u64,
    /// Per host cache slot: the (layer, neuron) whose bundle the device copy holds.
    holds: Vec<Option<(u32, u32)>>,
}

/// A copy the device makes after a layer's kernels: a bundle landed from
/// the host's cache, from its staging into the device's cache slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFill {
    pub from: u64,
    pub to: u64,
}

impl DeviceCache {
    /// A device cache of `slots` slots (the streamer's
    /// [`cache_slots`](Streamer::cache_slots)), holding nothing yet.
    pub fn new(base: u64, stride: u64, ready_flag: u64, slots: usize) -> Self {
        Self {
            base,
            stride,
            ready_flag,
            holds: vec![None; slots],
        }
    }

    /// Device bytes for `slots` slots of `stride`.
    pub fn bytes(slots: usize, stride: u64) -> u64 {
        slots as u64 * stride
    }

    /// The (layer, neuron) whose bundle the device copy of host cache slot
    /// `slot` holds.
    pub fn held(&self, slot: usize) -> Option<(u32, u32)> {
        self.holds.get(slot).copied().flatten()
    }

    fn address(&self, slot: u32) -> u64 {
        self.base + slot as u64 * self.stride
    }

    /// Whether the device's copy of host cache slot `slot` is neuron `i` of layer `l`.
    fn holds(&self, slot: u32, l: usize, i: usize) -> bool {
        self.held(slot as usize) == Some((l as u32, i as u32))
    }

    /// After `plan` was fed without error (every hit landed first, before
    /// any deadline): `copy` puts its hits landed from the host into the
    /// device's cache (the device runs the copies in stream order, before
    /// any later layer's kernels); once it has, they are recorded as held.
    /// Returns how many there were.
    pub fn fill(&mut self, plan: &SlotPlan, copy: impl FnOnce(&[CacheFill]) -> Result<()>) -> Result<usize> {
        let fills: Vec<CacheFill> = plan
            .fills
            .iter()
            .map(|&(k, slot)| CacheFill {
                from: plan.slots[k as usize].bundle,
                to: self.address(slot),
            })
            .collect();
        copy(&fills)?;
        for &(k, slot) in &plan.fills {
            self.holds[slot as usize] = Some((plan.layer as u32, plan.slots[k as usize].neuron));
        }
        Ok(fills.len())
    }
}

/// One layer's slots: one per neuron the streamer was asked for, in
/// ascending neuron id, so stage 2 sums them in slot order, as the CPU
/// engine sums in neuron order.
#[derive(Debug, Clone)]
pub struct SlotPlan {
    pub layer: usize,
    pub bundle_bytes: usize,
    pub slots: Vec<Slot>,
    /// Per slot: read in place from the device's cache (nothing lands).
    pub in_place: Vec<bool>,
    /// Hits the device's cache does not hold yet: (slot, host cache slot).
    /// Only the streamer's pinned hits, which `feed` lands before anything
    /// else, so none of them can miss a deadline.
    fills: Vec<(u32, u32)>,
    /// By neuron id: its slot, or `u32::MAX` when not wanted.
    slot_of: Vec<u32>,
}

/// What [`feed`] landed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fed {
    /// Read in place from the device's copy of the neuron cache (not landed).
    pub in_place: usize,
    /// From the host's neuron cache.
    pub hits: usize,
    /// From reads.
    pub read: usize,
    /// Not landed by the deadline (the device skips them).
    pub missing: usize,
    /// Never coming (reads the policy cancelled): landed as zeros, which
    /// add nothing.
    pub cancelled: usize,
}

impl SlotPlan {
    /// The slots of layer `layer`, whose stage `streamer` holds (a policy
    /// asked for it), bundles of `bundle_bytes` at `at`; a hit that `cache`
    /// (the device's copy of the streamer's cache) holds is read in place.
    pub fn new(
        streamer: &Streamer,
        layer: usize,
        n_ff: usize,
        bundle_bytes: usize,
        at: SlotAddresses,
        cache: Option<&DeviceCache>,
    ) -> Self {
        let mut slot_of = vec![u32::MAX; n_ff];
        let (mut slots, mut in_place, mut fills) = (Vec::new(), Vec::new(), Vec::new());
        // A layer not requested has no wanted neurons, so no hits either.
        let mut pinned = vec![false; n_ff];
        for &i in streamer.hits(layer).unwrap_or_default() {
            if let Some(p) = pinned.get_mut(i) {
                *p = true;
            }
        }
        for (i, s) in slot_of.iter_mut().enumerate() {
            if !streamer.is_wanted(layer, i) {
                continue;
            }
            let k = slots.len() as u64;
            *s = k as u32;
            let mut slot = Slot {
                bundle: at.staging + k * bundle_bytes as u64,
                flag: at.flags + k * at.flag_stride,
                neuron: i as u32,
                pad: 0,
            };
            let cached = cache.zip(streamer.cache_slot(layer, i));
            let here = cached.is_some_and(|(c, cs)| c.holds(cs, layer, i));
            // A device copy is read in place whether or not the host pinned
            // the bundle: only a fill, after the layer, writes device slots.
            if let Some((c, cs)) = cached {
                if here {
                    (slot.bundle, slot.flag) = (c.address(cs), c.ready_flag);
                } else if pinned[i] {
                    fills.push((k as u32, cs));
                }
            }
            slots.push(slot);
            in_place.push(here);
        }
        Self {
            layer,
            bundle_bytes,
            slots,
            in_place,
            fills,
            slot_of,
        }
    }

    /// Stage 2's order: the slots are in neuron order already.
    pub fn down_order(&self) -> Vec<u32> {
        (0..self.slots.len() as u32).collect()
    }

    fn slot(&self, neuron: usize) -> Option<usize> {
        self.slot_of
            .get(neuron)
            .filter(|&&s| s != u32::MAX)
            .map(|&s| s as usize)
    }
}

/// Publishes every slot of `plan` without bytes, so kernels launched for
/// it finish; for a layer abandoned before it was fed (its result is
/// thrown away). Slots read in place are ready already.
pub fn release_all(plan: &SlotPlan, to: &dyn Landing) {
    let landing = plan.slots.iter().zip(&plan.in_place);
    release(to, landing.filter(|(_, &here)| !here).map(|(slot, _)| slot));
}

fn release<'a>(to: &dyn Landing, slots: impl IntoIterator<Item = &'a Slot>) {
    for slot in slots {
        // Best effort: the layer has already failed.
        let _ = to.release(slot);
    }
}

/// Landings of one layer: each wanted slot once (a hit is not landed again
/// by a read that merged over it).
struct Lander<'a> {
    plan: &'a SlotPlan,
    to: &'a dyn Landing,
    landed: Vec<bool>,
}

impl Lander<'_> {
    fn land(&mut self, neuron: usize, bundle: &[u8]) -> Result<bool> {
        let Some(s) = self.plan.slot(neuron).filter(|&s| !self.landed[s]) else {
            return Ok(false);
        };
        self.to.land(&self.plan.slots[s], bundle)?;
        self.landed[s] = true;
        Ok(true)
    }

    /// Lands zeros in every slot not landed: a zero bundle's activation is
    /// 0 in every format (zero scales), and stage 2 adds nothing for it.
    fn land_rest_as_zeros(&mut self) -> Result<()> {
        let zeros = vec![0u8; self.plan.bundle_bytes];
        for (s, landed) in self.landed.iter_mut().enumerate() {
            if !*landed {
                self.to.land(&self.plan.slots[s], &zeros)?;
                *landed = true;
            }
        }
        Ok(())
    }

    fn release_rest(&self) {
        let rest = self.plan.slots.iter().zip(&self.landed).filter(|(_, &l)| !l);
        release(self.to, rest.map(|(slot, _)| slot));
    }
}

/// Lands layer `plan.layer`'s bundles: the cache's hits, then each read
/// as it lands, until all have landed or `deadline` passes (the streamer
/// then cancels what is still out; the device skips those slots at its own
/// deadline). Slots whose reads the policy cancelled before the deadline
/// (a refined prediction) get zeros, so the device does not wait for them.
/// On an error every slot not landed is released so that no kernel waits
/// forever, and the error is returned.
pub fn feed(streamer: &mut Streamer, plan: &SlotPlan, deadline: Option<Instant>, to: &dyn Landing) -> Result<Fed> {
    // A slot read in place counts as landed: nothing may write over the
    // device's cache through it.
    let mut lander = Lander {
        plan,
        to,
        landed: plan.in_place.clone(),
    };
    let r = land_layer(streamer, &mut lander, deadline);
    if r.is_err() {
        lander.release_rest();
    }
    r
}

fn land_layer(streamer: &mut Streamer, lander: &mut Lander, deadline: Option<Instant>) -> Result<Fed> {
    let l = lander.plan.layer;
    if streamer.holds_whole() {
        return Err(CudaError::Invalid(format!(
            "layer {l}: the cache holds every layer whole; upload the bundles resident instead of streaming them"
        )));
    }
    let mut fed = Fed {
        in_place: lander.plan.in_place.iter().filter(|&&h| h).count(),
        ..Fed::default()
    };
    for &i in streamer.hits(l)? {
        let bundle = streamer.cached(l, i);
        if bundle.is_empty() {
            return Err(CudaError::Invalid(format!(
                "layer {l}: neuron {i} is a hit the cache does not hold"
            )));
        }
        fed.hits += lander.land(i, bundle)? as usize;
    }
    while let Some(run) = streamer.next_run_until(l, deadline)? {
        let bb = run.bytes.len() / run.neurons.len().max(1);
        for (j, &i) in run.neurons.iter().enumerate() {
            let i = i as usize;
            if run.requested.get(i).copied().unwrap_or(false) {
                fed.read += lander.land(i, &run.bytes[j * bb..(j + 1) * bb])? as usize;
            }
        }
    }
    let rest = lander.landed.iter().filter(|&&l| !l).count();
    if rest > 0 && deadline.is_none_or(|d| Instant::now() < d) {
        lander.land_rest_as_zeros()?;
        fed.cancelled = rest;
    } else {
        fed.missing = rest;
    }
    Ok(fed)
}
