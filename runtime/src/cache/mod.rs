//! The neuron cache: FFN neuron bundles (gate row + up row + down column)
//! kept in memory under a byte budget, with pluggable eviction.
//!
//! # Layout
//!
//! One slab, allocated once with its base aligned to 4096 bytes, is cut into
//! `budget / stride` equal slots. The stride is the *largest* bundle size over
//! all layers, rounded up to the slot alignment (64 bytes by default, a cache
//! line; pass 4096 to [`NeuronCache::with_slot_align`] when O_DIRECT reads
//! should land straight in slots). Layers whose bundles are smaller waste the
//! difference in each slot they occupy; [`CacheStats::slot_bytes`] minus
//! [`CacheStats::resident_bytes`] is that waste. We take it rather than
//! per-layer slabs because (a) in practice the per-layer sizes of one model
//! differ little (the packer writes one down type for all layers, and gate/up
//! types vary only in a few layers), (b) one pool of equal slots lets the
//! eviction policy trade neurons across layers freely, where per-layer slabs
//! would fix each layer's share of the budget in advance, and (c) a slot
//! index is all the bookkeeping a bundle needs.
//!
//! # Hot path
//!
//! `(layer, neuron)` maps to its slot through a flat `Vec<u32>` indexed by
//! `layer * n_ff + neuron` (`u32::MAX` = absent): no hashing. Policies keep
//! their state in per-slot arrays made at construction; every operation is
//! O(1) and allocates nothing.
//!
//! # Protocol
//!
//! `lookup` (counts a hit or a miss; touches on a hit) → on a miss, `insert`
//! reserves a slot (evicting per the policy) and hands back its bytes to fill
//! → `pin` while compute uses a bundle, `unpin` after → `end_token` after
//! each token. A reserved slot reads as resident at once: the caller must
//! fill it (or `remove` it) before anyone reads it. Pinned bundles are never
//! evicted; `insert` returns `None` when every evictable slot is pinned.

mod budget;
mod hot;
mod learned;
mod lru;
mod memory;
pub mod retention;
mod slab;
mod window;

pub use budget::{parse_bytes, BudgetError, FfnBudget};
pub use hot::{relative_ranking, sort_ranking, NeuronFreq, StaticHot};
pub use learned::Learned;
pub use lru::Lru;
pub use memory::{fmt_bytes, peak_rss_bytes, rss_bytes, MemoryReport};
pub use retention::RetentionTable;
pub use slab::SLAB_ALIGN;
pub use window::SlidingWindow;

use crate::flash::format::LsFlash;
use slab::Slab;

const EMPTY: u32 = u32::MAX;

/// Default alignment of the slot stride: one cache line.
pub const SLOT_ALIGN: usize = 64;

/// What a policy decides for a bundle about to be inserted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Take a free slot (only when the cache reports one).
    Free,
    /// Evict this slot (resident and unpinned) and reuse it.
    Evict(u32),
    /// Do not cache this bundle.
    Reject,
}

/// An eviction policy. The cache calls these hooks on every change of a
/// slot's state; a policy keeps what it needs in per-slot arrays sized in
/// `init`. Pinned slots are announced with `pinned`/`unpinned` so a policy
/// can take them out of its candidate structures and never has to skip them.
pub trait EvictionPolicy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Called once, by [`NeuronCache::new`], before any other hook.
    fn init(&mut self, n_slots: usize, n_layer: usize, n_ff: usize) -> Result<(), String>;
    /// Where the bundle of (`layer`, `neuron`), not resident, should go;
    /// `free` is the number of free slots.
    fn place(&mut self, layer: u32, neuron: u32, free: usize) -> Choice;
    /// `slot` now holds (`layer`, `neuron`), unpinned.
    fn inserted(&mut self, slot: u32, layer: u32, neuron: u32);
    /// `slot` (unpinned) was evicted or removed and is free.
    fn removed(&mut self, slot: u32);
    /// The bundle in `slot` was used.
    fn touched(&mut self, slot: u32);
    /// `slot` got its first pin: it must not be chosen until `unpinned`.
    fn pinned(&mut self, slot: u32);
    /// `slot` lost its last pin.
    fn unpinned(&mut self, slot: u32);
    /// A token has been processed.
    fn end_token(&mut self) {}
    /// After `end_token`: a slot to free now, asked for until `None`.
    fn expired(&mut self) -> Option<u32> {
        None
    }
    /// Neurons the engine should load up front, best first.
    fn prefill_list(&self) -> Vec<(u32, u32)> {
        Vec::new()
    }
}

/// Why a cache could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    #[error("neuron cache: {0}")]
    Shape(String),
    #[error("neuron cache policy: {0}")]
    Policy(String),
}

/// The shape of a model's FFN as the cache sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheShape {
    pub n_ff: usize,
    /// Bundle size of each layer, in bytes.
    pub bundle_bytes: Vec<usize>,
}

impl CacheShape {
    pub fn uniform(n_layer: usize, n_ff: usize, bundle_bytes: usize) -> Self {
        Self {
            n_ff,
            bundle_bytes: vec![bundle_bytes; n_layer],
        }
    }

    pub fn from_flash(flash: &LsFlash) -> Self {
        Self {
            n_ff: flash.n_ff(),
            bundle_bytes: (0..flash.n_layer()).map(|l| flash.layout(l).bundle_bytes()).collect(),
        }
    }

    pub fn n_layer(&self) -> usize {
        self.bundle_bytes.len()
    }

    /// Bytes of all FFN bundles.
    pub fn total_ffn_bytes(&self) -> u64 {
        self.bundle_bytes.iter().map(|&b| b as u64 * self.n_ff as u64).sum()
    }

    /// The share of every neuron's slot that `budget` pays for, at most 1
    /// (what the static hot cache holds of the FFN's neurons).
    pub fn budget_share(&self, budget: FfnBudget) -> f64 {
        let total = self.total_slot_bytes();
        (budget.resolve(total) as f64 / total.max(1) as f64).min(1.0)
    }

    /// Bytes of the slots that hold every neuron (each bundle in a slot of
    /// [`NeuronCache::new`]'s stride): what a percentage budget is a share
    /// of, so that 100% holds the whole FFN.
    pub fn total_slot_bytes(&self) -> u64 {
        let max_bundle = self.bundle_bytes.iter().copied().max().unwrap_or(0);
        let stride = max_bundle.max(1).next_multiple_of(SLOT_ALIGN) as u64;
        stride * (self.n_layer() * self.n_ff) as u64
    }
}

/// Counters since construction (or the last `reset_stats`), and the current
/// occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `lookup`s that found the bundle.
    pub hits: u64,
    /// `lookup`s that did not.
    pub misses: u64,
    /// Bundles given a slot by `insert`.
    pub inserts: u64,
    /// Bundles evicted to make room for another.
    pub evictions: u64,
    /// `insert`s refused (every candidate slot pinned, or policy said no).
    pub rejections: u64,
    /// Bundles freed by the policy at `end_token` (sliding window, eager).
    pub released: u64,
    /// Slots holding a bundle now.
    pub resident_slots: u64,
    /// Bytes of the bundles held now (their true sizes).
    pub resident_bytes: u64,
    /// Bytes of the slots held now (`resident_slots * stride`).
    pub slot_bytes: u64,
    /// Slots pinned now.
    pub pinned_slots: u64,
}

impl CacheStats {
    /// hits / (hits + misses); 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// Neuron bundles in memory under a byte budget. See the module docs.
pub struct NeuronCache {
    slab: Slab,
    stride: usize,
    n_slots: usize,
    n_ff: usize,
    bundle_bytes: Vec<usize>,
    /// `layer * n_ff + neuron` → slot, or `EMPTY`.
    map: Vec<u32>,
    /// slot → `layer * n_ff + neuron`, or `EMPTY`.
    slot_key: Vec<u32>,
    pins: Vec<u32>,
    /// Resident bundles per layer (a layer is whole in memory at `n_ff`).
    per_layer: Vec<u32>,
    /// Free slots, a stack (capacity `n_slots`, never reallocates).
    free: Vec<u32>,
    policy: Box<dyn EvictionPolicy>,
    stats: CacheStats,
}

impl std::fmt::Debug for NeuronCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeuronCache")
            .field("policy", &self.policy.name())
            .field("n_slots", &self.n_slots)
            .field("stride", &self.stride)
            .field("stats", &self.stats)
            .finish()
    }
}

impl NeuronCache {
    /// A cache of `budget_bytes / stride` slots (at most one per neuron), the
    /// stride being the largest bundle rounded up to [`SLOT_ALIGN`].
    pub fn new(shape: &CacheShape, budget_bytes: u64, policy: Box<dyn EvictionPolicy>) -> Result<Self, CacheError> {
        Self::with_slot_align(shape, budget_bytes, policy, SLOT_ALIGN)
    }

    /// As [`new`](Self::new), the stride rounded up to `slot_align` (a power
    /// of two, at most [`SLAB_ALIGN`]) instead.
    pub fn with_slot_align(
        shape: &CacheShape,
        budget_bytes: u64,
        mut policy: Box<dyn EvictionPolicy>,
        slot_align: usize,
    ) -> Result<Self, CacheError> {
        let n_layer = shape.n_layer();
        let n_ff = shape.n_ff;
        if !slot_align.is_power_of_two() || slot_align > SLAB_ALIGN {
            return Err(CacheError::Shape(format!(
                "slot alignment {slot_align} is not a power of two up to {SLAB_ALIGN}"
            )));
        }
        let n_keys = n_layer
            .checked_mul(n_ff)
            .filter(|&n| n < EMPTY as usize)
            .ok_or_else(|| {
                CacheError::Shape(format!("{n_layer} layers of {n_ff} neurons do not fit 32-bit indices"))
            })?;
        let max_bundle = shape.bundle_bytes.iter().copied().max().unwrap_or(0);
        if max_bundle == 0 && n_keys > 0 {
            return Err(CacheError::Shape("bundles of 0 bytes".into()));
        }
        let stride = max_bundle.max(1).next_multiple_of(slot_align);
        let n_slots = (budget_bytes / stride as u64).min(n_keys as u64) as usize;
        policy.init(n_slots, n_layer, n_ff).map_err(CacheError::Policy)?;
        Ok(Self {
            slab: Slab::new(n_slots, stride),
            stride,
            n_slots,
            n_ff,
            bundle_bytes: shape.bundle_bytes.clone(),
            map: vec![EMPTY; n_keys],
            slot_key: vec![EMPTY; n_slots],
            pins: vec![0; n_slots],
            per_layer: vec![0; n_layer],
            free: (0..n_slots as u32).rev().collect(),
            policy,
            stats: CacheStats::default(),
        })
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Bytes from one slot to the next.
    pub fn slot_stride(&self) -> usize {
        self.stride
    }

    /// Bytes of the slots (what counts against the budget).
    pub fn capacity_bytes(&self) -> u64 {
        self.n_slots as u64 * self.stride as u64
    }

    /// Base of the slab (4096-aligned); slot `s` starts `s * slot_stride()`
    /// bytes later.
    pub fn slab_ptr(&self) -> *const u8 {
        self.slab.base()
    }

    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Zeroes the counters; the occupancy figures stay.
    pub fn reset_stats(&mut self) {
        self.stats = CacheStats {
            resident_slots: self.stats.resident_slots,
            resident_bytes: self.stats.resident_bytes,
            slot_bytes: self.stats.slot_bytes,
            pinned_slots: self.stats.pinned_slots,
            ..CacheStats::default()
        };
    }

    /// Neurons the policy wants loaded up front (static hot set), best first.
    pub fn prefill_list(&self) -> Vec<(u32, u32)> {
        self.policy.prefill_list()
    }

    #[inline]
    fn key(&self, layer: usize, neuron: usize) -> usize {
        assert!(neuron < self.n_ff, "neuron {neuron} out of range");
        layer * self.n_ff + neuron
    }

    /// The slot of a resident bundle, with no side effects.
    #[inline]
    pub fn slot_of(&self, layer: usize, neuron: usize) -> Option<u32> {
        let s = self.map[self.key(layer, neuron)];
        (s != EMPTY).then_some(s)
    }

    /// Neurons of `layer` resident.
    pub fn resident_in(&self, layer: usize) -> usize {
        self.per_layer.get(layer).map_or(0, |&n| n as usize)
    }

    /// Whether every neuron of `layer` is resident (its FFN needs no reads).
    pub fn holds_layer(&self, layer: usize) -> bool {
        self.resident_in(layer) == self.n_ff
    }

    pub fn contains(&self, layer: usize, neuron: usize) -> bool {
        self.slot_of(layer, neuron).is_some()
    }

    /// The bundle, counting a hit (and touching it) or a miss.
    pub fn lookup(&mut self, layer: usize, neuron: usize) -> Option<&[u8]> {
        match self.slot_of(layer, neuron) {
            Some(s) => {
                self.stats.hits += 1;
                self.policy.touched(s);
                Some(self.slab.slot(s as usize, self.bundle_bytes[layer]))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// The bundle, with no side effects.
    pub fn peek(&self, layer: usize, neuron: usize) -> Option<&[u8]> {
        self.slot_of(layer, neuron)
            .map(|s| self.slab.slot(s as usize, self.bundle_bytes[layer]))
    }

    /// Marks a resident bundle used; false when not resident.
    pub fn touch(&mut self, layer: usize, neuron: usize) -> bool {
        match self.slot_of(layer, neuron) {
            Some(s) => {
                self.policy.touched(s);
                true
            }
            None => false,
        }
    }

    /// Reserves a slot for the bundle and returns its bytes to fill (exactly
    /// one bundle long). A resident bundle is touched and its bytes returned.
    /// `None` when the policy finds no slot (all candidates pinned).
    pub fn insert(&mut self, layer: usize, neuron: usize) -> Option<&mut [u8]> {
        let s = self.insert_slot(layer, neuron)?;
        Some(self.slab.slot_mut(s as usize, self.bundle_bytes[layer]))
    }

    /// As [`insert`](Self::insert), returning the slot index.
    pub fn insert_slot(&mut self, layer: usize, neuron: usize) -> Option<u32> {
        let key = self.key(layer, neuron);
        if let Some(s) = self.slot_of(layer, neuron) {
            self.policy.touched(s);
            return Some(s);
        }
        let slot = match self.policy.place(layer as u32, neuron as u32, self.free.len()) {
            Choice::Free => self.free.pop(),
            Choice::Evict(s) => {
                assert!(
                    (s as usize) < self.n_slots && self.slot_key[s as usize] != EMPTY && self.pins[s as usize] == 0,
                    "policy {} chose slot {s}, which is not an evictable slot",
                    self.policy.name()
                );
                self.vacate(s);
                self.free.pop();
                self.stats.evictions += 1;
                Some(s)
            }
            Choice::Reject => None,
        };
        let Some(slot) = slot else {
            self.stats.rejections += 1;
            return None;
        };
        self.map[key] = slot;
        self.slot_key[slot as usize] = key as u32;
        self.per_layer[layer] += 1;
        self.stats.inserts += 1;
        self.stats.resident_slots += 1;
        self.stats.resident_bytes += self.bundle_bytes[layer] as u64;
        self.stats.slot_bytes += self.stride as u64;
        self.policy.inserted(slot, layer as u32, neuron as u32);
        Some(slot)
    }

    /// Empties an occupied, unpinned slot and pushes it on the free stack.
    fn vacate(&mut self, s: u32) {
        let key = self.slot_key[s as usize] as usize;
        let layer = key / self.n_ff;
        self.map[key] = EMPTY;
        self.slot_key[s as usize] = EMPTY;
        self.per_layer[layer] -= 1;
        self.stats.resident_slots -= 1;
        self.stats.resident_bytes -= self.bundle_bytes[layer] as u64;
        self.stats.slot_bytes -= self.stride as u64;
        self.policy.removed(s);
        self.free.push(s);
    }

    /// Drops a resident, unpinned bundle (e.g. a read that failed); false
    /// when not resident or pinned.
    pub fn remove(&mut self, layer: usize, neuron: usize) -> bool {
        match self.slot_of(layer, neuron) {
            Some(s) if self.pins[s as usize] == 0 => {
                self.vacate(s);
                true
            }
            _ => false,
        }
    }

    /// Bytes of slot `slot` (one bundle of the layer it holds); `None` when
    /// the slot is free.
    pub fn slot_data(&self, slot: u32) -> Option<&[u8]> {
        let key = *self.slot_key.get(slot as usize)?;
        (key != EMPTY).then(|| {
            let layer = key as usize / self.n_ff;
            self.slab.slot(slot as usize, self.bundle_bytes[layer])
        })
    }

    /// Slots `first..first + count` as one slice (bundle k at
    /// `k * slot_stride()`), when each holds a bundle of `layer`; `None`
    /// otherwise. Lets a run of resident bundles be computed where it lies.
    pub fn slot_span(&self, layer: usize, first: u32, count: usize) -> Option<&[u8]> {
        let (first, bb) = (first as usize, *self.bundle_bytes.get(layer)?);
        let keys = self.slot_key.get(first..first.checked_add(count)?)?;
        let held = |&k: &u32| k != EMPTY && k as usize / self.n_ff == layer;
        (count > 0 && keys.iter().all(held)).then(|| self.slab.span(first, count, bb))
    }

    /// Mutable bytes of an occupied slot (to fill it after `insert_slot`).
    pub fn slot_data_mut(&mut self, slot: u32) -> Option<&mut [u8]> {
        let key = *self.slot_key.get(slot as usize)?;
        if key == EMPTY {
            return None;
        }
        let layer = key as usize / self.n_ff;
        Some(self.slab.slot_mut(slot as usize, self.bundle_bytes[layer]))
    }

    /// Pins a resident bundle (pins nest); false when not resident.
    pub fn pin(&mut self, layer: usize, neuron: usize) -> bool {
        let Some(s) = self.slot_of(layer, neuron) else {
            return false;
        };
        let p = &mut self.pins[s as usize];
        *p += 1;
        if *p == 1 {
            self.stats.pinned_slots += 1;
            self.policy.pinned(s);
        }
        true
    }

    /// Drops one pin; false when not resident or not pinned.
    pub fn unpin(&mut self, layer: usize, neuron: usize) -> bool {
        let Some(s) = self.slot_of(layer, neuron) else {
            return false;
        };
        let p = &mut self.pins[s as usize];
        if *p == 0 {
            return false;
        }
        *p -= 1;
        if *p == 0 {
            self.stats.pinned_slots -= 1;
            self.policy.unpinned(s);
        }
        true
    }

    pub fn is_pinned(&self, layer: usize, neuron: usize) -> bool {
        self.slot_of(layer, neuron).is_some_and(|s| self.pins[s as usize] > 0)
    }

    /// Tells the policy a token is done; returns how many bundles it freed.
    pub fn end_token(&mut self) -> usize {
        self.policy.end_token();
        let mut n = 0;
        while let Some(s) = self.policy.expired() {
            assert!(
                self.slot_key[s as usize] != EMPTY && self.pins[s as usize] == 0,
                "policy {} released slot {s}, which is not an evictable slot",
                self.policy.name()
            );
            self.vacate(s);
            n += 1;
        }
        self.stats.released += n as u64;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lru(n_slots: usize) -> NeuronCache {
        NeuronCache::new(
            &CacheShape::uniform(2, 8, 64),
            64 * n_slots as u64,
            Box::new(Lru::new()),
        )
        .unwrap()
    }

    #[test]
    fn slots_follow_budget_and_stride() {
        let shape = CacheShape {
            n_ff: 100,
            bundle_bytes: vec![1000, 1100, 900],
        };
        // stride = 1100 rounded up to 64 = 1152
        let c = NeuronCache::new(&shape, 10_000, Box::new(Lru::new())).unwrap();
        assert_eq!(c.slot_stride(), 1152);
        assert_eq!(c.n_slots(), 8);
        assert_eq!(c.capacity_bytes(), 8 * 1152);
        assert_eq!(c.slab_ptr() as usize % 4096, 0);
        // Never more slots than neurons.
        let c = NeuronCache::new(&shape, u64::MAX, Box::new(Lru::new())).unwrap();
        assert_eq!(c.n_slots(), 300);
        // A zero budget is a valid, empty cache.
        let mut c = NeuronCache::new(&shape, 0, Box::new(Lru::new())).unwrap();
        assert_eq!(c.n_slots(), 0);
        assert!(c.insert(0, 0).is_none());
        let c = NeuronCache::with_slot_align(&shape, 1 << 20, Box::new(Lru::new()), 4096).unwrap();
        assert_eq!(c.slot_stride(), 4096);
        assert!(NeuronCache::with_slot_align(&shape, 0, Box::new(Lru::new()), 3).is_err());
        assert_eq!(shape.total_ffn_bytes(), 300_000);
        // A budget of every slot's bytes holds every neuron, raw bytes do not.
        assert_eq!(shape.total_slot_bytes(), 300 * 1152);
        let c = NeuronCache::new(&shape, shape.total_slot_bytes(), Box::new(Lru::new())).unwrap();
        assert_eq!(c.n_slots(), 300);
        let c = NeuronCache::new(&shape, shape.total_ffn_bytes(), Box::new(Lru::new())).unwrap();
        assert!(c.n_slots() < 300);
    }

    #[test]
    fn bundle_lengths_follow_their_layer() {
        let shape = CacheShape {
            n_ff: 4,
            bundle_bytes: vec![10, 30],
        };
        let mut c = NeuronCache::new(&shape, 1 << 10, Box::new(Lru::new())).unwrap();
        c.insert(0, 1).unwrap().fill(7);
        c.insert(1, 2).unwrap().fill(9);
        assert_eq!(c.peek(0, 1).unwrap(), &[7u8; 10][..]);
        assert_eq!(c.peek(1, 2).unwrap(), &[9u8; 30][..]);
        let s = c.stats();
        assert_eq!((s.resident_bytes, s.slot_bytes), (40, 128));
    }

    #[test]
    fn a_layer_is_held_when_all_its_neurons_are() {
        // 2 layers of 8 neurons, 9 slots: layer 0 fits whole, then an
        // insert into layer 1 evicts from it.
        let mut c = lru(9);
        for n in 0..8 {
            assert!(!c.holds_layer(0));
            c.insert(0, n).unwrap();
        }
        assert!(c.holds_layer(0) && !c.holds_layer(1));
        c.insert(1, 0).unwrap();
        assert!(c.holds_layer(0));
        c.insert(1, 1).unwrap();
        assert!(!c.holds_layer(0), "the least recent neuron of layer 0 was evicted");
        assert!(c.remove(1, 1) && !c.holds_layer(1));
        assert!(!c.holds_layer(2), "no such layer");
    }

    #[test]
    fn lru_evicts_least_recent_and_counts() {
        let mut c = lru(3);
        for n in 0..3 {
            c.insert(0, n).unwrap().fill(n as u8);
        }
        assert!(c.lookup(0, 0).is_some()); // 1 is now the oldest
        assert!(c.lookup(0, 5).is_none());
        c.insert(0, 5).unwrap();
        assert!(!c.contains(0, 1));
        assert!(c.contains(0, 0) && c.contains(0, 2) && c.contains(0, 5));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.inserts, s.evictions), (1, 1, 4, 1));
        assert_eq!(s.resident_slots, 3);
    }

    #[test]
    fn pins_block_eviction() {
        let mut c = lru(2);
        c.insert(1, 0).unwrap();
        c.insert(1, 1).unwrap();
        assert!(c.pin(1, 0) && c.pin(1, 1) && c.pin(1, 1));
        assert!(c.insert(1, 2).is_none());
        assert_eq!(c.stats().rejections, 1);
        assert!(c.unpin(1, 1));
        assert!(c.insert(1, 2).is_none(), "still pinned once");
        assert!(c.unpin(1, 1));
        assert!(!c.unpin(1, 1));
        assert!(c.insert(1, 2).is_some());
        assert!(c.contains(1, 0) && !c.contains(1, 1));
        assert!(!c.remove(1, 0), "pinned bundles cannot be removed");
        assert!(c.unpin(1, 0) && c.remove(1, 0));
        assert_eq!(c.free_slots(), 1);
    }
}
