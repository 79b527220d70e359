//! `dense-stream`: every token reads all bundles of each layer that the
//! neuron cache does not hold, through the I/O engine (O_DIRECT), one layer
//! ahead of compute.
//!
//! Two staging buffers alternate: while layer l computes from one, layer
//! l+1's reads land in the other (after the last layer, layer 0 of the next
//! token). When a layer is requested, its cached bundles are looked up (a hit
//! or a miss in the cache's counters) and pinned until the layer is done, so
//! that the inserts of arriving bundles cannot evict them; the misses are
//! enqueued as one request per run of neighbouring bundles on flash (up to a
//! read buffer), and each arriving bundle is copied into the staging buffer
//! and offered to the cache.

use std::collections::VecDeque;

use super::{EngineStats, FlashModel};
use crate::cache::{CacheShape, Lru, NeuronCache};
use crate::flash::io::{IoConfig, IoEngine, Request};
use crate::{Result, RuntimeError};

/// One layer's bundles in flight or arrived, by neuron id.
struct Stage {
    layer: usize,
    data: Vec<u8>,
    have: Vec<bool>,
    missing: usize,
    /// Requests of this stage: (first position on flash, bundles).
    runs: Vec<(usize, usize)>,
    /// Neurons served by the cache, pinned while this stage is live.
    pinned: Vec<usize>,
}

pub struct Streamer {
    io: IoEngine,
    cache: NeuronCache,
    budget: u64,
    n_layer: usize,
    bundle_bytes: Vec<usize>,
    /// Per layer: offset of its first bundle, and the neuron at each position.
    layer_offset: Vec<u64>,
    placement: Vec<Vec<u32>>,
    /// Most bundle bytes in one request.
    max_run_bytes: usize,
    stages: [Stage; 2],
    /// Stages requested and not yet finished, oldest first.
    queue: VecDeque<usize>,
    next_stage: usize,
    seq: u32,
}

/// Read access to the bundles of the layer being computed.
pub struct LayerView<'a> {
    stage: &'a Stage,
    cache: &'a NeuronCache,
    bb: usize,
}

impl LayerView<'_> {
    pub fn bundle(&self, i: usize) -> &[u8] {
        if self.stage.have[i] {
            &self.stage.data[i * self.bb..(i + 1) * self.bb]
        } else {
            self.cache
                .peek(self.stage.layer, i)
                .expect("a bundle not staged is pinned in the cache")
        }
    }
}

impl Streamer {
    pub fn new(m: &FlashModel, budget: u64) -> Result<Self> {
        let f = &m.flash;
        let shape = CacheShape::from_flash(f);
        let cache =
            NeuronCache::new(&shape, budget, Box::new(Lru::new())).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        let io = IoEngine::open(f.path(), IoConfig::default())?;
        let (n_ff, n_layer) = (f.n_ff(), f.n_layer());
        let max_bb = shape.bundle_bytes.iter().copied().max().unwrap_or(0);
        let stage = || Stage {
            layer: usize::MAX,
            data: vec![0; n_ff * max_bb],
            have: vec![false; n_ff],
            missing: 0,
            runs: Vec::new(),
            pinned: Vec::with_capacity(n_ff),
        };
        let cfg = io.config();
        let max_run_bytes = cfg.max_read_bytes - 2 * cfg.alignment;
        Ok(Self {
            io,
            cache,
            budget,
            n_layer,
            layer_offset: (0..n_layer).map(|l| f.layer_extent(l).0).collect(),
            placement: (0..n_layer)
                .map(|l| (0..n_ff).map(|p| f.neuron_at(l, p) as u32).collect())
                .collect(),
            max_run_bytes,
            bundle_bytes: shape.bundle_bytes,
            stages: [stage(), stage()],
            queue: VecDeque::with_capacity(2),
            next_stage: 0,
            seq: 0,
        })
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget
    }

    pub fn cache_bytes(&self) -> u64 {
        self.cache.capacity_bytes()
    }

    /// Staging buffers plus the I/O engine's read buffers.
    pub fn buffer_bytes(&self) -> u64 {
        let staged: usize = self.stages.iter().map(|s| s.data.len()).sum();
        let cfg = self.io.config();
        (staged + cfg.pool_buffers * cfg.max_read_bytes) as u64
    }

    pub fn stats(&self) -> EngineStats {
        let (io, c) = (self.io.stats(), self.cache.stats());
        EngineStats {
            tokens: 0,
            bytes_read: io.bytes_read,
            reads: io.reads_issued,
            cache_hits: c.hits,
            cache_misses: c.misses,
        }
    }

    /// Looks up layer `l`'s bundles in the cache (pinning hits) and enqueues the misses.
    fn request(&mut self, l: usize) -> Result<()> {
        let k = self.next_stage;
        self.next_stage ^= 1;
        self.seq = self.seq.wrapping_add(1);
        let s = &mut self.stages[k];
        s.layer = l;
        s.have.fill(false);
        s.missing = 0;
        s.pinned.clear();
        s.runs.clear();
        let bb = self.bundle_bytes[l];
        let max_run = (self.max_run_bytes / bb).max(1);
        for (p, &i) in self.placement[l].iter().enumerate() {
            let i = i as usize;
            if self.cache.lookup(l, i).is_some() {
                self.cache.pin(l, i);
                s.pinned.push(i);
                continue;
            }
            s.missing += 1;
            match s.runs.last_mut() {
                Some((p0, n)) if *p0 + *n == p && *n < max_run => *n += 1,
                _ => s.runs.push((p, 1)),
            }
        }
        for (r, &(p0, n)) in s.runs.iter().enumerate() {
            self.io.enqueue(Request {
                id: (r << 1 | k) as u32,
                offset: self.layer_offset[l] + (p0 * bb) as u64,
                len: (n * bb) as u32,
                priority: self.seq,
            })?;
        }
        self.queue.push_back(k);
        Ok(())
    }

    /// Waits for one read, stages its bundles and offers them to the cache.
    fn receive(&mut self) -> Result<()> {
        let c = match self.io.wait_next()? {
            Some(Ok(c)) => c,
            Some(Err(f)) => return Err(f.error),
            None => return Err(RuntimeError::Invalid("I/O engine idle with bundles outstanding".into())),
        };
        let (k, r) = (c.id as usize & 1, c.id as usize >> 1);
        let s = &mut self.stages[k];
        let (l, bb) = (s.layer, self.bundle_bytes[s.layer]);
        let p0 = s.runs[r].0;
        for (j, b) in c.data().chunks_exact(bb).enumerate() {
            let i = self.placement[l][p0 + j] as usize;
            s.data[i * bb..(i + 1) * bb].copy_from_slice(b);
            s.have[i] = true;
            s.missing -= 1;
            if let Some(slot) = self.cache.insert(l, i) {
                slot.copy_from_slice(b);
            }
        }
        Ok(())
    }

    /// Drops every outstanding stage (after an aborted forward pass).
    fn reset(&mut self) -> Result<()> {
        while self.stages.iter().any(|s| s.missing > 0) {
            self.receive()?;
        }
        while let Some(k) = self.queue.pop_front() {
            self.unpin(k);
        }
        Ok(())
    }

    fn unpin(&mut self, k: usize) {
        let s = &mut self.stages[k];
        for &i in &s.pinned {
            self.cache.unpin(s.layer, i);
        }
        s.pinned.clear();
        s.layer = usize::MAX;
    }

    /// Makes sure layer `l` has all its bundles (requesting the next layer
    /// first) and returns a view of them.
    pub fn load_layer(&mut self, l: usize) -> Result<LayerView<'_>> {
        if self.queue.front().is_some_and(|&k| self.stages[k].layer != l) {
            self.reset()?;
        }
        if self.queue.is_empty() {
            self.request(l)?;
        }
        if self.queue.len() < 2 {
            self.request((l + 1) % self.n_layer)?;
        }
        let k = self.queue[0];
        while self.stages[k].missing > 0 {
            self.receive()?;
        }
        Ok(LayerView {
            stage: &self.stages[k],
            cache: &self.cache,
            bb: self.bundle_bytes[l],
        })
    }

    /// Releases the layer computed last.
    pub fn finish_layer(&mut self, l: usize) {
        if let Some(k) = self.queue.pop_front() {
            debug_assert_eq!(self.stages[k].layer, l);
            self.unpin(k);
        }
        if l + 1 == self.n_layer {
            self.cache.end_token();
        }
    }
}
