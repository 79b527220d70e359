//! Learned eviction: keep the bundles most likely to be used in the next
//! token, by the [`RetentionTable`] trained on activation traces.
//!
//! A slot's priority is its neuron's probability of use given the tokens
//! since its last use, so it changes as the slot ages; instead of keeping a
//! heap current, eviction draws [`SAMPLES`] evictable slots, adds them to a
//! pool of the lowest seen before and takes the pool's lowest (Redis's
//! approximate LRU, with a learned key). A neuron that scores
//! below that victim is not admitted at all: a rare neuron read once does not
//! push out a hot one.

use std::sync::Arc;

use super::retention::RetentionTable;
use super::{Choice, EvictionPolicy};

/// Evictable slots drawn per eviction.
pub const SAMPLES: usize = 16;
/// The lowest-priority slots seen by earlier draws, kept to be compared
/// again (Redis's eviction pool): a few draws then act like many.
pub const POOL: usize = 32;

const NONE: u32 = u32::MAX;

#[derive(Debug)]
pub struct Learned {
    table: Arc<RetentionTable>,
    token: u64,
    rng: u64,
    /// By slot: its (layer, neuron) and the token of its last use.
    key: Vec<(u32, u32)>,
    last_used: Vec<u64>,
    /// Evictable slots (resident, unpinned), and each slot's index in it.
    candidates: Vec<u32>,
    index: Vec<u32>,
    /// Low-priority slots from earlier draws, with their priorities (scratch).
    pool: Vec<(u16, u32)>,
}

impl Learned {
    pub fn new(table: Arc<RetentionTable>) -> Self {
        Self {
            table,
            token: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
            key: Vec::new(),
            last_used: Vec::new(),
            candidates: Vec::new(),
            index: Vec::new(),
            pool: Vec::with_capacity(POOL + SAMPLES),
        }
    }

    /// Slot `slot`'s priority while layer `current` is being inserted into.
    /// Ages count the chances of use missed since the last use: a layer
    /// after `current` still gets its chance in this token, so it has
    /// missed one fewer than the layers up to `current`.
    fn priority(&self, slot: u32, current: u32) -> u16 {
        let (l, i) = self.key[slot as usize];
        let age = self.token - self.last_used[slot as usize].min(self.token);
        let age = if l > current { age.saturating_sub(1) } else { age };
        self.table.priority(l as usize, i as usize, age)
    }

    fn add(&mut self, slot: u32) {
        if self.index[slot as usize] == NONE {
            self.index[slot as usize] = self.candidates.len() as u32;
            self.candidates.push(slot);
        }
    }

    fn drop_candidate(&mut self, slot: u32) {
        let at = self.index[slot as usize];
        if at == NONE {
            return;
        }
        let last = self.candidates.pop().expect("a candidate is listed");
        if last != slot {
            self.candidates[at as usize] = last;
            self.index[last as usize] = at;
        }
        self.index[slot as usize] = NONE;
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: cheap, and a fixed seed keeps runs repeatable.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

impl EvictionPolicy for Learned {
    fn name(&self) -> &'static str {
        "learned"
    }

    fn init(&mut self, n_slots: usize, n_layer: usize, n_ff: usize) -> Result<(), String> {
        let t = &self.table;
        if (t.n_layer, t.n_ff) != (n_layer, n_ff) {
            return Err(format!(
                "learned eviction: the retention table is for {} layers × {} neurons, the model has {n_layer} × {n_ff}",
                t.n_layer, t.n_ff
            ));
        }
        self.key = vec![(0, 0); n_slots];
        self.last_used = vec![0; n_slots];
        self.candidates = Vec::with_capacity(n_slots);
        self.index = vec![NONE; n_slots];
        self.pool.clear();
        self.token = 0;
        Ok(())
    }

    fn place(&mut self, layer: u32, neuron: u32, free: usize) -> Choice {
        if free > 0 {
            return Choice::Free;
        }
        if self.candidates.is_empty() {
            return Choice::Reject;
        }
        // Refresh the pool: drop slots no longer evictable (or now holding
        // another neuron, which is fine to judge afresh), add new draws,
        // keep the lowest.
        let mut pool = std::mem::take(&mut self.pool);
        pool.retain(|&(_, s)| self.index[s as usize] != NONE);
        for _ in 0..SAMPLES.min(self.candidates.len()) {
            let at = (self.next_random() % self.candidates.len() as u64) as usize;
            pool.push((0, self.candidates[at]));
        }
        for e in pool.iter_mut() {
            e.0 = self.priority(e.1, layer);
        }
        pool.sort_unstable();
        pool.dedup_by_key(|e| e.1);
        pool.truncate(POOL);
        let victim = pool[0];
        self.pool = pool;
        // The newcomer was just used: age 0.
        if self.table.priority(layer as usize, neuron as usize, 0) < victim.0 {
            Choice::Reject
        } else {
            Choice::Evict(victim.1)
        }
    }

    fn inserted(&mut self, slot: u32, layer: u32, neuron: u32) {
        self.key[slot as usize] = (layer, neuron);
        self.last_used[slot as usize] = self.token;
        self.add(slot);
    }

    fn removed(&mut self, slot: u32) {
        self.drop_candidate(slot);
    }

    fn touched(&mut self, slot: u32) {
        self.last_used[slot as usize] = self.token;
    }

    fn pinned(&mut self, slot: u32) {
        self.last_used[slot as usize] = self.token;
        self.drop_candidate(slot);
    }

    fn unpinned(&mut self, slot: u32) {
        self.last_used[slot as usize] = self.token;
        self.add(slot);
    }

    fn end_token(&mut self) {
        self.token += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::super::retention::N_BUCKETS;
    use super::super::{CacheShape, NeuronCache};
    use super::*;

    /// Neuron 0 of each layer is always used (p = 1); the others only just
    /// after use (p high at age 0, low after).
    fn table(n_layer: usize, n_ff: usize) -> Arc<RetentionTable> {
        let mut p = vec![0.0f32; n_layer * n_ff * N_BUCKETS];
        for l in 0..n_layer {
            for i in 0..n_ff {
                for b in 0..N_BUCKETS {
                    p[(l * n_ff + i) * N_BUCKETS + b] = if i == 0 {
                        1.0
                    } else if b == 0 {
                        0.5
                    } else {
                        0.01 * i as f32
                    };
                }
            }
        }
        Arc::new(RetentionTable::from_probabilities("{}".into(), n_layer, n_ff, &p))
    }

    #[test]
    fn keeps_the_likely_and_refuses_the_unlikely() {
        let shape = CacheShape::uniform(1, 8, 64);
        let mut c = NeuronCache::new(&shape, 2 * 64, Box::new(Learned::new(table(1, 8)))).unwrap();
        assert!(c.insert(0, 0).is_some());
        assert!(c.insert(0, 3).is_some());
        c.end_token();
        c.end_token();
        // Neuron 3 is now old (p 0.03); neuron 5 just used (p 0.5) replaces it, not neuron 0.
        assert!(c.insert(0, 5).is_some());
        assert!(c.contains(0, 0) && c.contains(0, 5) && !c.contains(0, 3));
        // A newcomer scoring what the lowest resident scores (0.5) replaces
        // it; the always-used neuron stays.
        assert!(c.insert(0, 6).is_some());
        assert!(c.contains(0, 0));
    }

    #[test]
    fn refuses_a_newcomer_below_every_resident() {
        let shape = CacheShape::uniform(2, 8, 64);
        let mut c = NeuronCache::new(&shape, 2 * 64, Box::new(Learned::new(table(2, 8)))).unwrap();
        assert!(c.insert(0, 0).is_some());
        assert!(c.insert(1, 0).is_some());
        // Both residents score 1 at any age; neuron 3 scores 0.5 just after use.
        assert!(c.insert(0, 3).is_none());
        assert!(c.contains(0, 0) && c.contains(1, 0) && !c.contains(0, 3));
        assert_eq!(c.stats().rejections, 1);
    }

    #[test]
    fn refuses_a_table_of_another_shape() {
        let shape = CacheShape::uniform(2, 8, 64);
        let e = NeuronCache::new(&shape, 1 << 10, Box::new(Learned::new(table(1, 8)))).unwrap_err();
        assert!(e.to_string().contains("1 layers × 8 neurons"), "{e}");
    }

    #[test]
    fn never_evicts_a_pinned_slot() {
        let shape = CacheShape::uniform(1, 8, 64);
        let mut c = NeuronCache::new(&shape, 64, Box::new(Learned::new(table(1, 8)))).unwrap();
        assert!(c.insert(0, 3).is_some());
        c.pin(0, 3);
        assert!(c.insert(0, 0).is_none());
        c.unpin(0, 3);
        assert!(c.insert(0, 0).is_some());
        assert!(!c.contains(0, 3));
    }
}
