//! Sliding window (LLM-in-a-Flash): keep the neurons used in the last `k`
//! tokens.

use super::lru::LruList;
use super::{Choice, EvictionPolicy};

/// After the [`end_token`](crate::cache::NeuronCache::end_token) of token
/// `t`, the window is tokens `t-k+1..=t`: a neuron last used before them is
/// *expired*. (With `k` = 1 the cache keeps the previous token's neurons.) Victims are expired neurons first, least recently used
/// first; when none is expired, the least recently used of the in-window ones.
///
/// Slots sit in one recency list whose order is also the order of their last
/// token, so both rules reduce to taking the list's tail: under a fixed slab,
/// the victim order equals LRU's. What the window adds is
/// [`with_eager_release`](Self::with_eager_release): `end_token` then frees
/// expired neurons at once (as LLM-in-a-Flash deletes them), so the cache
/// holds exactly the window, never more, whatever the budget. Each neuron is
/// released at most once per insertion, so that is O(1) amortised.
#[derive(Debug)]
pub struct SlidingWindow {
    k: u64,
    eager: bool,
    token: u64,
    last_used: Vec<u64>,
    list: LruList,
}

impl SlidingWindow {
    /// A window of `k` tokens (`k` ≥ 1).
    pub fn new(k: usize) -> Self {
        Self {
            k: k as u64,
            eager: false,
            token: 0,
            last_used: Vec::new(),
            list: LruList::default(),
        }
    }

    /// Free expired neurons at each `end_token` instead of waiting for the
    /// slots to be needed.
    pub fn with_eager_release(mut self, eager: bool) -> Self {
        self.eager = eager;
        self
    }

    fn expired_slot(&self, slot: u32) -> bool {
        self.last_used[slot as usize] + self.k < self.token
    }
}

impl EvictionPolicy for SlidingWindow {
    fn name(&self) -> &'static str {
        "sliding-window"
    }

    fn init(&mut self, n_slots: usize, _n_layer: usize, _n_ff: usize) -> Result<(), String> {
        if self.k == 0 {
            return Err("sliding window: the window must span at least 1 token".into());
        }
        self.last_used = vec![0; n_slots];
        self.list = LruList::new(n_slots);
        self.token = 0;
        Ok(())
    }

    fn place(&mut self, _layer: u32, _neuron: u32, free: usize) -> Choice {
        if free > 0 {
            return Choice::Free;
        }
        // The tail is the oldest: expired if any slot is, else the LRU one.
        self.list.back().map_or(Choice::Reject, Choice::Evict)
    }

    fn inserted(&mut self, slot: u32, _layer: u32, _neuron: u32) {
        self.last_used[slot as usize] = self.token;
        self.list.push_front(slot);
    }

    fn removed(&mut self, slot: u32) {
        self.list.unlink(slot);
    }

    fn touched(&mut self, slot: u32) {
        self.last_used[slot as usize] = self.token;
        self.list.move_front(slot);
    }

    fn pinned(&mut self, slot: u32) {
        self.last_used[slot as usize] = self.token;
        self.list.unlink(slot);
    }

    fn unpinned(&mut self, slot: u32) {
        // It was in use until now.
        self.last_used[slot as usize] = self.token;
        self.list.push_front(slot);
    }

    fn end_token(&mut self) {
        self.token += 1;
    }

    fn expired(&mut self) -> Option<u32> {
        if !self.eager {
            return None;
        }
        self.list.back().filter(|&s| self.expired_slot(s))
    }
}
