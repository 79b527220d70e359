//! Static hot set: the most frequently activated neurons (from calibration)
//! own a fixed share of the slots and are never evicted; the rest is LRU.

use super::lru::LruList;
use super::{Choice, EvictionPolicy};

/// Calibrated activation frequency of one neuron.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NeuronFreq {
    pub layer: u32,
    pub neuron: u32,
    pub freq: f32,
}

/// The static hot set's ranking from calibrated scores (per layer, each
/// neuron's mean |activation|, as a `.lsflash` header stores them): each
/// score relative to its layer's mean, so that layers with larger
/// activations do not take every slot.
pub fn relative_ranking(scores: &[Vec<f32>]) -> Vec<NeuronFreq> {
    scores
        .iter()
        .enumerate()
        .flat_map(|(l, row)| {
            let mean = (row.iter().map(|&v| v as f64).sum::<f64>() / row.len().max(1) as f64).max(1e-30);
            row.iter().enumerate().map(move |(i, &v)| NeuronFreq {
                layer: l as u32,
                neuron: i as u32,
                freq: (v as f64 / mean) as f32,
            })
        })
        .collect()
}

/// `ranking` best first, as the hot set takes it: by frequency, highest
/// first; ties (and NaNs, which [`StaticHot`] refuses) keep the given order.
pub fn sort_ranking(ranking: &mut [NeuronFreq]) {
    ranking.sort_by(|a, b| b.freq.partial_cmp(&a.freq).unwrap_or(std::cmp::Ordering::Equal));
}

/// The top-ranked neurons fill `(1 - lru_fraction)` of the slots and are never
/// evicted once inserted (the engine loads them up front from
/// [`EvictionPolicy::prefill_list`]); every other neuron competes LRU-style
/// for the remaining slots, plus any hot slots the ranking leaves unused.
/// With `lru_fraction` 0 (the default) and a full ranking, cold neurons are
/// never cached.
///
/// Invariant that keeps `place` O(1): hot residents ≤ hot capacity and cold
/// residents ≤ LRU capacity, the two adding up to the slot count, so a hot
/// neuron, or a cold one under its quota, always finds a free slot.
#[derive(Debug)]
pub struct StaticHot {
    ranking: Vec<NeuronFreq>,
    lru_fraction: f64,
    n_ff: usize,
    /// One bit per (layer, neuron): in the hot set.
    hot: Vec<u64>,
    /// The hot set, best first (what `prefill_list` returns).
    hot_list: Vec<(u32, u32)>,
    slot_hot: Vec<bool>,
    lru: LruList,
    lru_capacity: usize,
    cold_resident: usize,
}

impl StaticHot {
    /// `ranking` in any order (it is sorted by frequency, highest first; ties
    /// keep the given order); duplicates count once.
    pub fn new(ranking: Vec<NeuronFreq>) -> Self {
        Self {
            ranking,
            lru_fraction: 0.0,
            n_ff: 0,
            hot: Vec::new(),
            hot_list: Vec::new(),
            slot_hot: Vec::new(),
            lru: LruList::default(),
            lru_capacity: 0,
            cold_resident: 0,
        }
    }

    /// Share of the slots kept for LRU caching of cold neurons, in `0..=1`.
    pub fn with_lru_fraction(mut self, fraction: f64) -> Self {
        self.lru_fraction = fraction;
        self
    }

    fn is_hot(&self, layer: u32, neuron: u32) -> bool {
        let k = layer as usize * self.n_ff + neuron as usize;
        self.hot[k / 64] >> (k % 64) & 1 == 1
    }
}

impl EvictionPolicy for StaticHot {
    fn name(&self) -> &'static str {
        "static-hot"
    }

    fn init(&mut self, n_slots: usize, n_layer: usize, n_ff: usize) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.lru_fraction) {
            return Err(format!(
                "static hot set: LRU fraction {} is not in 0..=1",
                self.lru_fraction
            ));
        }
        if let Some(bad) = self
            .ranking
            .iter()
            .find(|r| r.layer as usize >= n_layer || r.neuron as usize >= n_ff)
        {
            return Err(format!(
                "static hot set: neuron {} of layer {} is out of range ({n_layer} layers of {n_ff} neurons)",
                bad.neuron, bad.layer
            ));
        }
        if let Some(bad) = self.ranking.iter().find(|r| r.freq.is_nan()) {
            return Err(format!(
                "static hot set: neuron {} of layer {} has a NaN frequency",
                bad.neuron, bad.layer
            ));
        }
        self.n_ff = n_ff;
        let lru_slots = ((n_slots as f64) * self.lru_fraction).floor() as usize;
        let hot_slots = n_slots - lru_slots.min(n_slots);
        sort_ranking(&mut self.ranking);
        self.hot = vec![0; (n_layer * n_ff).div_ceil(64)];
        self.hot_list.clear();
        for r in &self.ranking {
            if self.hot_list.len() == hot_slots {
                break;
            }
            let k = r.layer as usize * n_ff + r.neuron as usize;
            if self.hot[k / 64] >> (k % 64) & 1 == 0 {
                self.hot[k / 64] |= 1 << (k % 64);
                self.hot_list.push((r.layer, r.neuron));
            }
        }
        self.lru_capacity = n_slots - self.hot_list.len();
        self.slot_hot = vec![false; n_slots];
        self.lru = LruList::new(n_slots);
        self.cold_resident = 0;
        Ok(())
    }

    fn place(&mut self, layer: u32, neuron: u32, free: usize) -> Choice {
        if self.is_hot(layer, neuron) || self.cold_resident < self.lru_capacity {
            debug_assert!(free > 0, "static hot set: quota invariant broken");
            Choice::Free
        } else {
            self.lru.back().map_or(Choice::Reject, Choice::Evict)
        }
    }

    fn inserted(&mut self, slot: u32, layer: u32, neuron: u32) {
        let hot = self.is_hot(layer, neuron);
        self.slot_hot[slot as usize] = hot;
        if !hot {
            self.cold_resident += 1;
            self.lru.push_front(slot);
        }
    }

    fn removed(&mut self, slot: u32) {
        if !self.slot_hot[slot as usize] {
            self.cold_resident -= 1;
            self.lru.unlink(slot);
        }
        self.slot_hot[slot as usize] = false;
    }

    fn touched(&mut self, slot: u32) {
        self.lru.move_front(slot);
    }

    fn pinned(&mut self, slot: u32) {
        self.lru.unlink(slot);
    }

    fn unpinned(&mut self, slot: u32) {
        if !self.slot_hot[slot as usize] {
            self.lru.push_front(slot);
        }
    }

    fn prefill_list(&self) -> Vec<(u32, u32)> {
        self.hot_list.clone()
    }
}
