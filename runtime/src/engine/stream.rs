//! Streaming FFN bundles through the I/O engine (O_DIRECT), one layer ahead
//! of compute.
//!
//! Two staging buffers alternate: while layer l computes from one, the next
//! layer's reads land in the other. A policy asks for a layer with a set of
//! neurons ([`Want`]): all of them (`dense-stream`), a set known in advance
//! (`oracle`), or a set decided after attention (`gate-first`). When a layer
//! is requested, each wanted bundle is looked up in the neuron cache (a hit or
//! a miss in its counters); hits are pinned until the layer is done, so that
//! the inserts of arriving bundles cannot evict them; misses are enqueued as
//! one request per run of neighbouring positions on flash (the I/O engine then
//! coalesces nearby runs within its gap and read-amplification limits), and
//! each arriving bundle is copied into the staging buffer and offered to the
//! cache.

use std::collections::VecDeque;

use super::trace::{bit_is_set, set_bit};
use super::{EngineStats, FlashModel};
use crate::cache::{CacheShape, EvictionPolicy, Lru, NeuronCache, NeuronFreq, SlidingWindow, StaticHot};
use crate::flash::io::{IoConfig, IoEngine, Request};
use crate::flash::runs::{max_run_bytes, RunRule};
use crate::{Result, RuntimeError};

/// How the neuron cache chooses what to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Least recently used. Under dense streaming every layer is a cyclic
    /// scan larger than the cache, where LRU keeps nothing useful.
    Lru,
    /// The neurons with the highest calibrated mean |activation| (relative
    /// to their layer's mean), loaded at start and never evicted
    /// (PowerInfer's hot set); needs the scores `pack --calibrate` stores.
    Hot,
    /// Neurons used in the last k tokens (LLM in a Flash).
    Window(usize),
}

impl std::str::FromStr for CachePolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "lru" => Ok(Self::Lru),
            "hot" => Ok(Self::Hot),
            "window" => Ok(Self::Window(4)),
            _ => match s.strip_prefix("window:").map(str::parse::<usize>) {
                Some(Ok(k)) if k > 0 => Ok(Self::Window(k)),
                _ => Err(format!(
                    "unknown cache policy '{s}' (expected lru, hot, window or window:K)"
                )),
            },
        }
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lru => f.write_str("lru"),
            Self::Hot => f.write_str("hot"),
            Self::Window(k) => write!(f, "window:{k}"),
        }
    }
}

/// Which neurons of a layer to load.
#[derive(Debug, Clone, Copy)]
pub enum Want<'a> {
    All,
    /// A bitmap over neuron ids.
    Set(&'a [u64]),
}

impl Want<'_> {
    fn contains(&self, i: usize) -> bool {
        match self {
            Self::All => true,
            Self::Set(bits) => bit_is_set(bits, i),
        }
    }
}

/// One layer's bundles in flight or arrived, by neuron id.
struct Stage {
    layer: usize,
    data: Vec<u8>,
    /// Bundles of this stage in `data`.
    have: Vec<bool>,
    /// Wanted bundles not in the cache, not yet arrived.
    need: Vec<bool>,
    /// Neurons requested (bitmap).
    want: Vec<u64>,
    missing: usize,
    /// Requests of this stage: (first position on flash, bundles). A run may
    /// span bundles that are not needed (see `Streamer::request`).
    runs: Vec<(usize, usize)>,
    /// Neurons served by the cache, pinned while this stage is live.
    pinned: Vec<usize>,
}

pub struct Streamer {
    io: IoEngine,
    cache: NeuronCache,
    budget: u64,
    n_ff: usize,
    bundle_bytes: Vec<usize>,
    /// Per layer: offset of its first bundle, and the neuron at each position.
    layer_offset: Vec<u64>,
    placement: Vec<Vec<u32>>,
    /// Most bundle bytes in one request.
    max_run_bytes: usize,
    /// A gap of unneeded bundles at most this long joins two runs into one
    /// read: cheaper than a second request when the device's per-request
    /// cost exceeds the gap's transfer time.
    merge_gap_bytes: usize,
    /// Bytes of needed bundles (what `bytes_requested` would be without merging).
    bytes_needed: u64,
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
    /// Neuron `i`'s bundle; empty when `i` was not requested.
    pub fn bundle(&self, i: usize) -> &[u8] {
        if self.stage.have[i] {
            &self.stage.data[i * self.bb..(i + 1) * self.bb]
        } else {
            self.cache.peek(self.stage.layer, i).unwrap_or(&[])
        }
    }
}

impl Streamer {
    pub fn new(m: &FlashModel, budget: u64, policy: CachePolicy, merge_gap_bytes: usize) -> Result<Self> {
        let f = &m.flash;
        let shape = CacheShape::from_flash(f);
        let eviction: Box<dyn EvictionPolicy> = match policy {
            CachePolicy::Lru => Box::new(Lru::new()),
            CachePolicy::Window(k) => Box::new(SlidingWindow::new(k)),
            CachePolicy::Hot => {
                let scores = &f.header().neuron_scores;
                if scores.is_empty() {
                    return Err(RuntimeError::Invalid(format!(
                        "{}: the hot cache policy needs calibrated neuron scores; re-pack with --calibrate TEXT",
                        f.path().display()
                    )));
                }
                let ranking = scores
                    .iter()
                    .enumerate()
                    .flat_map(|(l, row)| {
                        // Relative to the layer's mean, so that layers with
                        // larger activations do not take every slot.
                        let mean = (row.iter().map(|&v| v as f64).sum::<f64>() / row.len().max(1) as f64).max(1e-30);
                        row.iter().enumerate().map(move |(i, &v)| NeuronFreq {
                            layer: l as u32,
                            neuron: i as u32,
                            freq: (v as f64 / mean) as f32,
                        })
                    })
                    .collect();
                Box::new(StaticHot::new(ranking))
            }
        };
        let mut cache = NeuronCache::new(&shape, budget, eviction).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        prefill(m, &mut cache)?;
        let io = IoEngine::open(f.path(), IoConfig::default())?;
        let (n_ff, n_layer) = (f.n_ff(), f.n_layer());
        let max_bb = shape.bundle_bytes.iter().copied().max().unwrap_or(0);
        let stage = || Stage {
            layer: usize::MAX,
            data: vec![0; n_ff * max_bb],
            have: vec![false; n_ff],
            need: vec![false; n_ff],
            want: vec![0; n_ff.div_ceil(64)],
            missing: 0,
            runs: Vec::with_capacity(n_ff),
            pinned: Vec::with_capacity(n_ff),
        };
        let cfg = io.config();
        let max_run_bytes = max_run_bytes(cfg);
        Ok(Self {
            merge_gap_bytes,
            bytes_needed: 0,
            io,
            cache,
            budget,
            n_ff,
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

    /// Whether reads bypass the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.io.is_direct()
    }

    pub fn cache_policy_name(&self) -> &'static str {
        self.cache.policy_name()
    }

    /// Bytes the streamer holds besides the cache: staging and read buffers.
    /// Known before construction, for `--mem-budget`.
    pub fn overhead_bytes(m: &FlashModel) -> u64 {
        let shape = CacheShape::from_flash(&m.flash);
        let max_bb = shape.bundle_bytes.iter().copied().max().unwrap_or(0);
        let cfg = IoConfig::default();
        (2 * m.flash.n_ff() * max_bb + cfg.pool_buffers * cfg.max_read_bytes) as u64
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
            bytes_read: io.bytes_read,
            bytes_requested: self.bytes_needed,
            reads: io.reads_issued,
            cache_hits: c.hits,
            cache_misses: c.misses,
            ..EngineStats::default()
        }
    }

    /// Looks up layer `l`'s wanted bundles in the cache (pinning hits) and
    /// enqueues the misses. Needed bundles close on flash share one request:
    /// a gap of unneeded bundles of at most `merge_gap_bytes` is read along.
    /// This keeps the request count of scattered sparse sets low (the I/O
    /// engine then coalesces neighbouring requests within its own limits).
    fn request(&mut self, l: usize, want: Want) -> Result<()> {
        let k = self.next_stage;
        self.next_stage ^= 1;
        self.seq = self.seq.wrapping_add(1);
        let s = &mut self.stages[k];
        s.layer = l;
        s.have.fill(false);
        s.need.fill(false);
        s.want.fill(0);
        s.missing = 0;
        s.pinned.clear();
        s.runs.clear();
        let bb = self.bundle_bytes[l];
        let rule = RunRule::new(bb, self.max_run_bytes, self.merge_gap_bytes);
        for (p, &i) in self.placement[l].iter().enumerate() {
            let i = i as usize;
            if !want.contains(i) {
                continue;
            }
            set_bit(&mut s.want, i);
            if self.cache.lookup(l, i).is_some() {
                self.cache.pin(l, i);
                s.pinned.push(i);
                continue;
            }
            s.need[i] = true;
            s.missing += 1;
            self.bytes_needed += bb as u64;
            rule.push(&mut s.runs, p);
        }
        for (r, &(p0, n)) in s.runs.iter().enumerate() {
            self.io.enqueue(Request {
                id: Self::request_id(k, r),
                offset: self.layer_offset[l] + (p0 * bb) as u64,
                len: (n * bb) as u32,
                priority: self.seq,
            })?;
        }
        self.queue.push_back(k);
        Ok(())
    }

    fn request_id(stage: usize, run: usize) -> u32 {
        (run << 1 | stage) as u32
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
            if !s.need[i] {
                continue;
            }
            s.need[i] = false;
            s.data[i * bb..(i + 1) * bb].copy_from_slice(b);
            s.have[i] = true;
            s.missing -= 1;
            if let Some(slot) = self.cache.insert(l, i) {
                slot.copy_from_slice(b);
            }
        }
        Ok(())
    }

    /// Drops every outstanding stage: requests not yet submitted are
    /// cancelled, reads in flight are drained.
    fn reset(&mut self) -> Result<()> {
        for &k in &self.queue {
            let s = &mut self.stages[k];
            for (r, &(p0, n)) in s.runs.iter().enumerate() {
                if self.io.cancel(Self::request_id(k, r)) {
                    for &i in &self.placement[s.layer][p0..p0 + n] {
                        if std::mem::take(&mut s.need[i as usize]) {
                            s.missing -= 1;
                        }
                    }
                }
            }
        }
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

    /// Makes sure the oldest stage is layer `l` with (at least) `want`
    /// requested; anything else outstanding is dropped first.
    pub fn ensure(&mut self, l: usize, want: Want) -> Result<()> {
        let covered = self.queue.front().is_some_and(|&k| {
            let s = &self.stages[k];
            s.layer == l && (0..self.n_ff).all(|i| !want.contains(i) || bit_is_set(&s.want, i))
        });
        if !covered {
            self.reset()?;
            self.request(l, want)?;
        }
        Ok(())
    }

    /// Requests layer `l` behind the current one, if a staging buffer is free.
    pub fn prefetch(&mut self, l: usize, want: Want) -> Result<()> {
        if self.queue.len() < 2 {
            self.request(l, want)?;
        }
        Ok(())
    }

    /// Waits until the oldest stage (layer `l`, see [`ensure`](Self::ensure))
    /// has every bundle it asked for and returns a view of them.
    pub fn wait(&mut self, l: usize) -> Result<LayerView<'_>> {
        let k = *self
            .queue
            .front()
            .filter(|&&k| self.stages[k].layer == l)
            .ok_or_else(|| RuntimeError::Invalid(format!("layer {l} was not requested before waiting on it")))?;
        while self.stages[k].missing > 0 {
            self.receive()?;
        }
        Ok(LayerView {
            stage: &self.stages[k],
            cache: &self.cache,
            bb: self.bundle_bytes[l],
        })
    }

    /// Releases the layer computed last; `end_of_token` after the last layer.
    pub fn finish(&mut self, l: usize, end_of_token: bool) {
        if let Some(k) = self.queue.pop_front() {
            debug_assert_eq!(self.stages[k].layer, l);
            self.unpin(k);
        }
        if end_of_token {
            self.cache.end_token();
        }
    }
}

/// Loads the bundles the cache's policy wants up front (a static hot set),
/// a layer at a time in 1 MiB reads, leaving nothing in the page cache.
fn prefill(m: &FlashModel, cache: &mut NeuronCache) -> Result<()> {
    let list = cache.prefill_list();
    if list.is_empty() {
        return Ok(());
    }
    let f = &m.flash;
    let n_ff = f.n_ff();
    let mut wanted = vec![vec![false; n_ff]; f.n_layer()];
    for &(l, i) in &list {
        wanted[l as usize][i as usize] = true;
    }
    for (l, want) in wanted.iter().enumerate() {
        // Read only the span of positions that holds wanted bundles.
        let Some(first) = (0..n_ff).find(|&p| want[f.neuron_at(l, p)]) else {
            continue;
        };
        let last = (0..n_ff).rev().find(|&p| want[f.neuron_at(l, p)]).unwrap_or(first);
        f.for_each_bundle(l, first..last + 1, |i, b| {
            if want[i] {
                if let Some(slot) = cache.insert(l, i) {
                    slot.copy_from_slice(b);
                }
            }
        })?;
    }
    // Loading is not use: the run's hit and miss counts start at zero.
    cache.reset_stats();
    Ok(())
}
