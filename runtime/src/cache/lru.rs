//! Plain LRU, and the intrusive list over slot indices the other policies
//! reuse.

use super::{Choice, EvictionPolicy};

const NIL: u32 = u32::MAX;

/// A doubly linked list threaded through per-slot `prev`/`next` arrays:
/// every operation is O(1) and none allocates after `new`. The head is the
/// most recently used slot, the tail the least.
#[derive(Debug, Clone, Default)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    pub(crate) fn new(n_slots: usize) -> Self {
        Self {
            prev: vec![NIL; n_slots],
            next: vec![NIL; n_slots],
            linked: vec![false; n_slots],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    #[cfg(test)]
    pub(crate) fn is_linked(&self, s: u32) -> bool {
        self.linked[s as usize]
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Links `s` as the most recent; a no-op when already linked.
    pub(crate) fn push_front(&mut self, s: u32) {
        let i = s as usize;
        if self.linked[i] {
            return;
        }
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = s;
        } else {
            self.tail = s;
        }
        self.head = s;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Unlinks `s`; a no-op when not linked.
    pub(crate) fn unlink(&mut self, s: u32) {
        let i = s as usize;
        if !self.linked[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    /// Makes a linked `s` the most recent; a no-op when not linked.
    pub(crate) fn move_front(&mut self, s: u32) {
        if self.linked[s as usize] && self.head != s {
            self.unlink(s);
            self.push_front(s);
        }
    }

    /// The least recently used linked slot.
    pub(crate) fn back(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }
}

/// Least recently used eviction. Pinned slots are unlinked while pinned, so
/// the victim is always the list's tail: O(1).
#[derive(Debug, Default)]
pub struct Lru {
    list: LruList,
}

impl Lru {
    pub fn new() -> Self {
        Self::default()
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn init(&mut self, n_slots: usize, _n_layer: usize, _n_ff: usize) -> Result<(), String> {
        self.list = LruList::new(n_slots);
        Ok(())
    }
    fn place(&mut self, _layer: u32, _neuron: u32, free: usize) -> Choice {
        if free > 0 {
            Choice::Free
        } else {
            self.list.back().map_or(Choice::Reject, Choice::Evict)
        }
    }
    fn inserted(&mut self, slot: u32, _layer: u32, _neuron: u32) {
        self.list.push_front(slot);
    }
    fn removed(&mut self, slot: u32) {
        self.list.unlink(slot);
    }
    fn touched(&mut self, slot: u32) {
        self.list.move_front(slot);
    }
    fn pinned(&mut self, slot: u32) {
        self.list.unlink(slot);
    }
    fn unpinned(&mut self, slot: u32) {
        self.list.push_front(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_orders_by_recency() {
        let mut l = LruList::new(4);
        for s in 0..4 {
            l.push_front(s);
        }
        assert_eq!(l.back(), Some(0));
        l.move_front(0);
        assert_eq!(l.back(), Some(1));
        l.unlink(1);
        assert_eq!(l.back(), Some(2));
        l.unlink(2);
        l.unlink(3);
        assert_eq!(l.back(), Some(0));
        assert_eq!(l.len(), 1);
        l.unlink(0);
        assert_eq!(l.back(), None);
        assert!(!l.is_linked(0));
        l.push_front(3);
        assert_eq!(l.back(), Some(3));
    }
}
