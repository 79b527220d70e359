//! Pending requests: a priority queue with cancellation and an offset index
//! for coalescing neighbours into one aligned read.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

/// A read request. `id` is the caller's tag (e.g. a bundle index) and must be
/// unique among requests not yet completed; lower `priority` is more urgent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub id: u32,
    pub offset: u64,
    pub len: u32,
    pub priority: u32,
}

/// Limits on coalescing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CoalesceLimits {
    pub align: u64,
    pub max_read_bytes: u64,
    pub max_gap: u64,
    pub max_amplification: f64,
}

/// One aligned read covering one or more requests.
#[derive(Debug, Default)]
pub(crate) struct Group {
    pub start: u64,
    pub end: u64,
    pub requested: u64,
}

pub(crate) fn align_down(x: u64, align: u64) -> u64 {
    x & !(align - 1)
}

pub(crate) fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

#[derive(Default)]
pub(crate) struct PendingQueue {
    seq: u64,
    heap: BinaryHeap<Reverse<(u32, u64)>>,
    live: HashMap<u64, Request>,
    by_id: HashMap<u32, u64>,
    by_offset: BTreeSet<(u64, u64)>,
    scratch: Vec<u64>,
}

impl PendingQueue {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub(crate) fn contains_id(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    pub(crate) fn push(&mut self, r: Request) {
        let seq = self.seq;
        self.seq += 1;
        self.heap.push(Reverse((r.priority, seq)));
        self.live.insert(seq, r);
        self.by_id.insert(r.id, seq);
        self.by_offset.insert((r.offset, seq));
    }

    fn remove_seq(&mut self, seq: u64) -> Option<Request> {
        let r = self.live.remove(&seq)?;
        self.by_id.remove(&r.id);
        self.by_offset.remove(&(r.offset, seq));
        Some(r)
    }

    pub(crate) fn cancel(&mut self, id: u32) -> bool {
        match self.by_id.get(&id).copied() {
            Some(seq) => self.remove_seq(seq).is_some(),
            None => false,
        }
    }

    /// Takes the most urgent request and the neighbours that coalesce with it
    /// within `lim`, appending them to `members`. Returns the aligned read.
    pub(crate) fn take_group(&mut self, lim: &CoalesceLimits, members: &mut Vec<Request>) -> Option<Group> {
        let head_seq = loop {
            let Reverse((_, seq)) = self.heap.pop()?;
            if self.live.contains_key(&seq) {
                break seq;
            }
            // A cancelled or already-coalesced request: skip its stale entry.
        };
        let head = self.remove_seq(head_seq).expect("live request");
        let a = lim.align;
        let mut g = Group {
            start: align_down(head.offset, a),
            end: align_up(head.offset + head.len as u64, a),
            requested: head.len as u64,
        };
        members.push(head);
        let fits = |g: &Group, start: u64, end: u64, len: u64| {
            let (ns, ne) = (g.start.min(start), g.end.max(end));
            let span = ne - ns;
            if span > lim.max_read_bytes {
                return None;
            }
            let req = g.requested + len;
            let old_ratio = (g.end - g.start) as f64 / g.requested as f64;
            let ratio = span as f64 / req as f64;
            (ratio <= lim.max_amplification || ratio <= old_ratio).then_some((ns, ne, req))
        };
        // Forward: requests starting at or after the head, in offset order.
        self.scratch.clear();
        for &(off, seq) in self.by_offset.range((head.offset, 0)..) {
            let r = &self.live[&seq];
            let (s, e) = (align_down(off, a), align_up(off + r.len as u64, a));
            if s > g.end + lim.max_gap {
                break;
            }
            let Some((ns, ne, req)) = fits(&g, s, e, r.len as u64) else {
                break;
            };
            (g.start, g.end, g.requested) = (ns, ne, req);
            self.scratch.push(seq);
        }
        // Backward: requests starting before the head.
        for &(off, seq) in self.by_offset.range(..(head.offset, 0)).rev() {
            let r = &self.live[&seq];
            let (s, e) = (align_down(off, a), align_up(off + r.len as u64, a));
            if e + lim.max_gap < g.start {
                break;
            }
            let Some((ns, ne, req)) = fits(&g, s, e, r.len as u64) else {
                break;
            };
            (g.start, g.end, g.requested) = (ns, ne, req);
            self.scratch.push(seq);
        }
        let scratch = std::mem::take(&mut self.scratch);
        for &seq in &scratch {
            members.push(self.remove_seq(seq).expect("live request"));
        }
        self.scratch = scratch;
        Some(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: u32, offset: u64, len: u32, priority: u32) -> Request {
        Request {
            id,
            offset,
            len,
            priority,
        }
    }

    const LIM: CoalesceLimits = CoalesceLimits {
        align: 4096,
        max_read_bytes: 64 * 1024,
        max_gap: 4096,
        max_amplification: 2.0,
    };

    #[test]
    fn most_urgent_first_and_neighbours_join() {
        let mut q = PendingQueue::default();
        q.push(req(1, 100_000_000, 4096, 5));
        q.push(req(2, 8192, 4096, 1));
        q.push(req(3, 12288, 4096, 9));
        q.push(req(4, 4096, 4096, 9));
        let mut m = Vec::new();
        let g = q.take_group(&LIM, &mut m).unwrap();
        assert_eq!((g.start, g.end, g.requested), (4096, 16384, 3 * 4096));
        let mut ids: Vec<u32> = m.iter().map(|r| r.id).collect();
        ids.sort();
        assert_eq!(ids, [2, 3, 4]);
        m.clear();
        let g = q.take_group(&LIM, &mut m).unwrap();
        assert_eq!((g.start, m[0].id), (100_000_000 / 4096 * 4096, 1));
        m.clear();
        assert!(q.take_group(&LIM, &mut m).is_none());
    }

    #[test]
    fn limits_stop_coalescing() {
        let mut q = PendingQueue::default();
        // Gap of two blocks: beyond max_gap.
        q.push(req(1, 0, 4096, 0));
        q.push(req(2, 3 * 4096, 4096, 1));
        let mut m = Vec::new();
        q.take_group(&LIM, &mut m).unwrap();
        assert_eq!(m.len(), 1);
        // Size limit: 16 blocks fit, the 17th does not.
        let mut q = PendingQueue::default();
        for i in 0..17u32 {
            q.push(req(i, i as u64 * 4096, 4096, i));
        }
        m.clear();
        let g = q.take_group(&LIM, &mut m).unwrap();
        assert_eq!((m.len(), g.end - g.start), (16, 64 * 1024));
        // Amplification: a one-block gap between small requests is too costly.
        let lim = CoalesceLimits {
            max_amplification: 1.2,
            ..LIM
        };
        let mut q = PendingQueue::default();
        q.push(req(1, 0, 4096, 0));
        q.push(req(2, 2 * 4096, 4096, 1));
        m.clear();
        q.take_group(&lim, &mut m).unwrap();
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn cancel_removes_pending() {
        let mut q = PendingQueue::default();
        q.push(req(1, 0, 10, 0));
        q.push(req(2, 4096, 10, 1));
        assert!(q.cancel(1));
        assert!(!q.cancel(1));
        assert_eq!(q.len(), 1);
        let mut m = Vec::new();
        q.take_group(&LIM, &mut m).unwrap();
        assert_eq!(m[0].id, 2);
        assert!(q.is_empty() && !q.contains_id(2));
    }
}
