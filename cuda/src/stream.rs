//! The streaming FFN's host side, the same for the device and for its CPU
//! emulation: a layer's wanted neurons become slots, then every bundle
//! *lands* (its bytes written to its slot's staging, then its flag
//! published): the neuron cache's hits at once, each read as the runtime's
//! [`Streamer`] reaps it, in arrival order. Meanwhile the device (or
//! [`crate::emulate`]) computes each slot whose flag has turned, so compute
//! starts on the first bundle that lands, not after the last.

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

/// One layer's slots: one per neuron the streamer was asked for, in
/// ascending neuron id, so stage 2 sums them in slot order, as the CPU
/// engine sums in neuron order.
#[derive(Debug, Clone)]
pub struct SlotPlan {
    pub layer: usize,
    pub slots: Vec<Slot>,
    /// By neuron id: its slot, or `u32::MAX` when not wanted.
    slot_of: Vec<u32>,
}

/// What [`feed`] landed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fed {
    /// From the neuron cache.
    pub hits: usize,
    /// From reads.
    pub read: usize,
    /// Not landed by the deadline (the device skips them).
    pub missing: usize,
}

impl SlotPlan {
    /// The slots of layer `layer`, whose stage `streamer` holds (a policy
    /// asked for it), bundles of `bundle_bytes` at `at`.
    pub fn new(streamer: &Streamer, layer: usize, n_ff: usize, bundle_bytes: usize, at: SlotAddresses) -> Self {
        let mut slot_of = vec![u32::MAX; n_ff];
        let mut slots = Vec::new();
        for (i, s) in slot_of.iter_mut().enumerate() {
            if streamer.is_wanted(layer, i) {
                let k = slots.len() as u64;
                *s = k as u32;
                slots.push(Slot {
                    bundle: at.staging + k * bundle_bytes as u64,
                    flag: at.flags + k * at.flag_stride,
                    neuron: i as u32,
                    pad: 0,
                });
            }
        }
        Self { layer, slots, slot_of }
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
/// thrown away).
pub fn release_all(plan: &SlotPlan, to: &dyn Landing) {
    release(to, &plan.slots);
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

    fn release_rest(&self) {
        let rest = self.plan.slots.iter().zip(&self.landed).filter(|(_, &l)| !l);
        release(self.to, rest.map(|(slot, _)| slot));
    }
}

/// Lands layer `plan.layer`'s bundles: the cache's hits, then each read
/// as it lands, until all have landed or `deadline` passes (the streamer
/// then cancels what is still out; the device skips those slots at its own
/// deadline). On an error every slot not landed is released so that no
/// kernel waits forever, and the error is returned.
pub fn feed(streamer: &mut Streamer, plan: &SlotPlan, deadline: Option<Instant>, to: &dyn Landing) -> Result<Fed> {
    let mut lander = Lander {
        plan,
        to,
        landed: vec![false; plan.slots.len()],
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
    let mut fed = Fed::default();
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
    fed.missing = lander.landed.iter().filter(|&&l| !l).count();
    Ok(fed)
}
