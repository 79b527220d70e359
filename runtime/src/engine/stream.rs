//! Streaming FFN bundles from flash (O_DIRECT) one layer ahead of compute,
//! with the reads driven by the I/O thread ([`IoWorker`]).
//!
//! Two stages alternate: while layer l computes from one, the next layer's
//! reads land for the other. A policy asks for a layer with a set of neurons
//! ([`Want`]): all of them (`dense-stream`), a set known in advance
//! (`oracle`), or a set decided after attention (`gate-first`). Each wanted
//! bundle is looked up in the neuron cache (a hit or a miss in its counters);
//! hits are pinned until the layer is done, so that inserts cannot evict them;
//! misses become one request per run of neighbouring positions on flash (the
//! I/O engine then coalesces nearby runs within its gap and amplification
//! limits).
//!
//! Staging is the I/O engine's read buffers and nothing else: a landed run
//! stays in its pool buffer, is published in the stage's [`ArrivalLog`], and
//! compute takes runs from the log as they come ([`Streamer::next_run`]), so
//! a layer's FFN starts on the first bundles that land. Compute keeps what
//! stage 2 needs of a run (its down parts), the run is offered to the cache,
//! and its buffer goes back to the pool when compute takes the next one. So
//! the bytes staged are the bytes in flight plus those landed and not yet
//! computed, bounded by the pool ([`staging_bytes`](super::EngineOptions::staging_bytes)), whatever
//! the layer size. The exception is a layer's first runs, up to a quarter
//! of the pool, while compute is what holds the token back (the layer
//! before never waited for a read): with down columns, those are kept until
//! the layer is done, and stage 2 reads their columns where they landed
//! rather than a copy (see [`LandedRun::kept`]). The stage behind the front
//! may hold at most half the pool's buffers until it is the front (or the
//! front has every read back), so the layer being computed always gets
//! buffers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::resident::Resident;
use super::trace::{bit_is_set, set_bit, widen_to_groups};
use super::{EngineStats, FlashModel};
use crate::cache::{
    relative_ranking, CacheShape, EvictionPolicy, Learned, Lru, NeuronCache, NeuronFreq, RetentionTable, SlidingWindow,
    StaticHot,
};
use crate::flash::io::{ArrivalLog, Completed, Delivery, IoConfig, IoEngine, IoWorker, Request, Sink};
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
    /// (PowerInfer's hot set), from the scores `pack --calibrate` stores. A
    /// file without scores gets each layer's leading bundles on flash: a
    /// static set, which is what saves reads under a dense scan (where LRU
    /// keeps nothing), and it leaves each layer's reads one contiguous tail.
    Hot,
    /// Neurons used in the last k tokens (LLM in a Flash).
    Window(usize),
    /// The bundles most likely to be used in the next token, by a retention
    /// table trained on activation traces (`.lsevict`).
    Learned,
}

impl std::str::FromStr for CachePolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "lru" => Ok(Self::Lru),
            "hot" => Ok(Self::Hot),
            "learned" => Ok(Self::Learned),
            "window" => Ok(Self::Window(4)),
            _ => match s.strip_prefix("window:").map(str::parse::<usize>) {
                Some(Ok(k)) if k > 0 => Ok(Self::Window(k)),
                _ => Err(format!(
                    "unknown cache policy '{s}' (expected lru, hot, learned, window or window:K)"
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
            Self::Learned => f.write_str("learned"),
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

/// Landed runs of one stage that compute has not taken yet, by run index:
/// each holds its share of an I/O pool buffer. Closed (and emptied) when the
/// stage is finished or dropped, so a read that lands late is let go at once.
struct Held {
    runs: Vec<Option<Completed>>,
    open: bool,
}

/// What the I/O thread and compute share of one stage.
struct Landing {
    held: Mutex<Held>,
    /// Runs (indices into the stage's run list) in arrival order.
    log: ArrivalLog,
    /// Runs landed, failed or cancelled (or cancelled before they were posted).
    settled: AtomicUsize,
    failed: Mutex<Option<RuntimeError>>,
}

impl Landing {
    fn new(n_ff: usize) -> Self {
        Self {
            held: Mutex::new(Held {
                runs: (0..n_ff).map(|_| None).collect(),
                open: false,
            }),
            log: ArrivalLog::new(n_ff),
            settled: AtomicUsize::new(0),
            failed: Mutex::new(None),
        }
    }

    /// Lets go of every run held and, with `open`, takes new arrivals.
    fn reset(&self, open: bool) {
        let mut h = lock(&self.held);
        h.open = open;
        h.runs.iter_mut().for_each(|r| *r = None);
    }

    /// Takes landed run `r` (published in the log) from its holder.
    fn take(&self, r: usize) -> Option<Completed> {
        lock(&self.held).runs.get_mut(r).and_then(Option::take)
    }
}

/// Stages a streamer keeps at once: the layer computing and up to three
/// requested ahead of it (what they read together is bounded by the pool).
pub const STAGES: usize = 4;
const STAGE_BITS: u32 = STAGES.trailing_zeros();

/// A read's id: its run in the stage's list, and the stage.
fn request_id(stage: usize, run: usize) -> u32 {
    (run << STAGE_BITS | stage) as u32
}

/// The stage and run of a read's id.
fn split_id(id: u32) -> (usize, usize) {
    (id as usize & (STAGES - 1), (id >> STAGE_BITS) as usize)
}

struct Landings {
    stages: [Landing; STAGES],
    /// Counts deliveries; compute sleeps on it when nothing new has landed.
    signal: Mutex<u64>,
    arrived: Condvar,
}

impl Landings {
    /// Counts `runs` more runs of stage `k` settled and wakes compute.
    fn settle(&self, k: usize, runs: usize) {
        self.stages[k].settled.fetch_add(runs, Ordering::Release);
        *lock(&self.signal) += 1;
        self.arrived.notify_all();
    }
}

/// Holds each finished read for compute (request id: [`request_id`]).
struct LandingSink(Arc<Landings>);

impl Sink for LandingSink {
    fn deliver(&mut self, d: Delivery) {
        let k = match d {
            Delivery::Landed { id, data, .. } => {
                let (k, run) = split_id(id);
                let st = &self.0.stages[k];
                let mut h = lock(&st.held);
                if h.open && run < h.runs.len() {
                    h.runs[run] = Some(data);
                    drop(h);
                    // Published after it is held: compute that sees the run
                    // in the log finds its bytes.
                    st.log.push(run as u32);
                }
                k
            }
            Delivery::Failed { id, error, .. } => {
                let (k, _) = split_id(id);
                lock(&self.0.stages[k].failed).get_or_insert(error);
                k
            }
            Delivery::Cancelled { id, .. } => split_id(id).0,
        };
        self.0.settle(k, 1);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Compute's side of one stage.
struct Stage {
    layer: usize,
    /// By neuron: a miss of this stage whose read is requested.
    requested: Vec<bool>,
    /// By neuron: requested, landed and taken by compute.
    staged: Vec<bool>,
    /// Neurons wanted (bitmap).
    want: Vec<u64>,
    /// Requests: (first position on flash, bundles). A run may span bundles
    /// that are not needed (see `Streamer::request`).
    runs: Vec<(usize, usize)>,
    /// Neurons served by the cache, pinned while this stage is live.
    pinned: Vec<usize>,
    /// The stage sequence number its reads' priorities start from.
    seq: u32,
    /// Arrivals taken from the log so far.
    taken: usize,
    /// By flash position: 1 + the run whose read covers it, or 0.
    covered: Vec<u32>,
    /// By run: [`RUN_QUEUED`], [`RUN_TAKEN`] or [`RUN_CANCELLED`].
    run_state: Vec<u8>,
    /// Neurons marked requested (the stage's expected arrivals).
    requested_count: usize,
    /// The deadline passed: reads still out were cancelled, and what lands
    /// later is not taken.
    expired: bool,
    /// Runs handed to the I/O thread, or cancelled before they were: the
    /// runs that will settle.
    posted: usize,
    /// Runs held back while this stage is not the front (priority, run),
    /// most urgent first.
    deferred: Vec<(u32, usize)>,
}

const RUN_QUEUED: u8 = 0;
const RUN_TAKEN: u8 = 1;
const RUN_CANCELLED: u8 = 2;

impl Stage {
    /// Bundles of the layer this stage will have: cache hits and requests.
    fn expected(&self) -> usize {
        self.pinned.len() + self.requested_count
    }
}

/// Each layer's leading bundle part that a policy holds in memory (the
/// gate rows of `gate-first`), so reads start after it and compute fills
/// it in from here.
struct HeldPrefix {
    /// Per layer, the parts of every neuron in id order.
    rows: Arc<Vec<Vec<u8>>>,
    /// Per layer, the bytes of one neuron's part (`rows[l].len() / n_ff`).
    bytes: Vec<usize>,
}

pub struct Streamer {
    io: IoWorker,
    held: Option<HeldPrefix>,
    landings: Arc<Landings>,
    cache: NeuronCache,
    /// Share of the static hot set outside its layers' leading bundles.
    hot_scattered: Option<f64>,
    /// Every layer in memory as `dense` holds it, where the budget has a
    /// slot for every neuron (the cache is then empty): see
    /// [`holds_everything`].
    whole: Option<Resident>,
    /// Bundles served from `whole` (cache hits by another name).
    whole_hits: u64,
    budget: u64,
    n_ff: usize,
    bundle_bytes: Vec<usize>,
    /// Per layer, neurons read together (down tiles: a quantization block's
    /// group; 1 for down columns), and the expanded want of a request.
    group: Vec<usize>,
    grouped: Vec<u64>,
    /// Per layer: offset of its first bundle and the neuron at each position.
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
    /// Runs of an extension being built (reused).
    extension: Vec<(usize, usize)>,
    /// Every bundle a read brings is computed, not only those asked for
    /// (see [`use_spans`](Self::use_spans)).
    use_spans: bool,
    /// Requested bundles that had not landed by their layer's deadline.
    late_skipped: u64,
    stages: [Stage; STAGES],
    /// Stages requested and not yet finished, oldest first.
    queue: VecDeque<usize>,
    seq: u32,
    /// Time compute spent blocked on arrivals.
    wait_ns: u64,
    /// The run compute took last: offered to the cache and let go (its pool
    /// buffer back to the I/O engine) when compute takes the next, unless
    /// it is kept.
    current: Option<Taken>,
    /// The front layer's runs kept whole until it is finished, so that stage
    /// 2 reads their down columns in place (at most `keep_runs`: a quarter
    /// of the pool, which leaves the front buffers to read into).
    kept: Vec<TakenRun>,
    keep_runs: usize,
    /// Whether the layer computing keeps runs: the one before it never
    /// waited for a read. Where the disk is the bottleneck it wants every
    /// buffer back at once, to keep its queue deep; where compute is, the
    /// copy a kept run saves is what the token waits for.
    keeping: bool,
    /// `wait_ns` when the layer computing started.
    wait_ns_at_layer: u64,
    /// By neuron: where a kept run holds its bundle (run in `kept`,
    /// position in the run); `NOT_KEPT` otherwise.
    kept_at: Vec<(u32, u32)>,
    /// The run with its held prefix filled in (`gate-first`; empty otherwise).
    assembled: Vec<u8>,
    /// Runs the stages behind the front may have posted together (half the
    /// pool's buffers: the front always finds buffers for its reads).
    ahead_runs: usize,
    /// Runs to post (priority, run), reused.
    to_post: Vec<(u32, usize)>,
}

const NOT_KEPT: (u32, u32) = (u32::MAX, u32::MAX);

/// The run compute took last: its own (let go when compute takes the
/// next), or one of the layer's kept runs.
enum Taken {
    Own(TakenRun),
    Kept(usize),
}

/// A landed run compute is working on.
struct TakenRun {
    stage: usize,
    run: usize,
    data: Completed,
}

impl TakenRun {
    /// Its bundles back to back (`len` bytes): the read itself, or the run
    /// put back together behind a held prefix (`assembled`, empty without one).
    fn bytes<'a>(&'a self, assembled: &'a [u8], len: usize) -> &'a [u8] {
        if assembled.is_empty() {
            self.data.data()
        } else {
            &assembled[..len]
        }
    }
}

/// A run that has landed: its bundles back to back, the neuron at each, and
/// which neurons were asked for (a merged run also carries unneeded ones).
pub struct LandedRun<'a> {
    pub bytes: &'a [u8],
    pub neurons: &'a [u32],
    /// By neuron id: whether it was asked for.
    pub requested: &'a [bool],
    /// The run stays in its buffer until the layer is finished: its
    /// requested bundles are found with [`Streamer::kept_bundle`], and
    /// stage 2 needs no copy of their down parts.
    pub kept: bool,
}

impl Streamer {
    pub fn new(
        m: &FlashModel,
        budget: u64,
        policy: CachePolicy,
        retention: Option<Arc<RetentionTable>>,
        merge_gap_bytes: usize,
        staging_bytes: Option<u64>,
        backend: Option<super::BackendFactory>,
    ) -> Result<Self> {
        let f = &m.flash;
        let shape = CacheShape::from_flash(f);
        let eviction: Box<dyn EvictionPolicy> = match policy {
            CachePolicy::Lru => Box::new(Lru::new()),
            CachePolicy::Window(k) => Box::new(SlidingWindow::new(k)),
            CachePolicy::Learned => Box::new(Learned::new(retention.ok_or_else(|| {
                RuntimeError::Invalid(format!(
                    "{}: the learned cache policy needs a retention table (--eviction FILE, or a .lsevict beside \
                     the model; leanstream-synth eviction makes one)",
                    f.path().display()
                ))
            })?)),
            CachePolicy::Hot if f.header().neuron_scores.is_empty() => {
                // Position p of every layer before position p + 1 of any.
                let n_ff = f.n_ff();
                let ranking = (0..f.n_layer())
                    .flat_map(|l| {
                        (0..n_ff).map(move |p| NeuronFreq {
                            layer: l as u32,
                            neuron: f.neuron_at(l, p) as u32,
                            freq: (n_ff - p) as f32,
                        })
                    })
                    .collect();
                Box::new(StaticHot::new(ranking))
            }
            CachePolicy::Hot => {
                let ranking = relative_ranking(&f.header().neuron_scores);
                Box::new(StaticHot::new(ranking))
            }
        };
        let whole = holds_everything(&shape, budget);
        // The empty cache still names the policy (reports show which it was).
        let cache_budget = if whole { 0 } else { budget };
        let mut cache =
            NeuronCache::new(&shape, cache_budget, eviction).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        let whole = if whole {
            Some(m.read_all()?)
        } else {
            prefill(m, &mut cache)?;
            None
        };
        let (n_ff, n_layer) = (f.n_ff(), f.n_layer());
        let landings = Arc::new(Landings {
            stages: std::array::from_fn(|_| Landing::new(n_ff)),
            signal: Mutex::new(0),
            arrived: Condvar::new(),
        });
        // Layers held whole read nothing: the least pool the engine takes.
        let cfg = Self::io_config(m, if whole.is_some() { Some(0) } else { staging_bytes });
        let engine = match backend {
            None => IoEngine::open(f.path(), cfg)?,
            Some(make) => {
                let b = make(&cfg).map_err(|e| RuntimeError::Invalid(format!("I/O backend: {e}")))?;
                IoEngine::with_backend(f.path(), cfg, b)?
            }
        };
        let max_run_bytes = max_run_bytes(engine.config());
        let ahead_runs = (engine.config().pool_buffers / 2).max(1);
        let keep_runs = engine.config().pool_buffers / 4;
        let io = IoWorker::spawn(engine, LandingSink(Arc::clone(&landings)))?;
        let stage = || Stage {
            layer: usize::MAX,
            requested: vec![false; n_ff],
            staged: vec![false; n_ff],
            want: vec![0; n_ff.div_ceil(64)],
            runs: Vec::with_capacity(n_ff),
            pinned: Vec::with_capacity(n_ff),
            seq: 0,
            taken: 0,
            covered: vec![0; n_ff],
            run_state: Vec::with_capacity(n_ff),
            requested_count: 0,
            expired: false,
            posted: 0,
            deferred: Vec::with_capacity(n_ff),
        };
        let placement: Vec<Vec<u32>> = (0..n_layer)
            .map(|l| (0..n_ff).map(|p| f.neuron_at(l, p) as u32).collect())
            .collect();
        let hot_scattered = scattered_share(&cache.prefill_list(), &placement);
        Ok(Self {
            hot_scattered,
            merge_gap_bytes,
            bytes_needed: 0,
            io,
            held: None,
            landings,
            cache,
            whole,
            whole_hits: 0,
            budget,
            n_ff,
            layer_offset: (0..n_layer).map(|l| f.layer_extent(l).0).collect(),
            placement,
            max_run_bytes,
            bundle_bytes: shape.bundle_bytes,
            group: m.formats.iter().map(|f| f.group()).collect(),
            grouped: vec![0; n_ff.div_ceil(64)],
            extension: Vec::with_capacity(n_ff),
            use_spans: false,
            late_skipped: 0,
            stages: std::array::from_fn(|_| stage()),
            queue: VecDeque::with_capacity(STAGES),
            seq: 0,
            wait_ns: 0,
            current: None,
            kept: Vec::with_capacity(keep_runs),
            keep_runs,
            keeping: false,
            wait_ns_at_layer: 0,
            kept_at: vec![NOT_KEPT; n_ff],
            assembled: Vec::new(),
            ahead_runs,
            to_post: Vec::with_capacity(n_ff),
        })
    }

    /// From now on reads skip the leading part of each bundle that `rows`
    /// holds (per layer, every neuron's part in id order). A run's first
    /// bundle is then completed from it when it lands; the bundles inside a
    /// run are read whole, which is cheaper than a request per bundle.
    pub fn hold_prefix(&mut self, rows: Arc<Vec<Vec<u8>>>) -> Result<()> {
        let n = self.bundle_bytes.len();
        let fits = rows.len() == n
            && (0..n).all(|l| {
                let len = rows[l].len();
                len.is_multiple_of(self.n_ff) && len / self.n_ff < self.bundle_bytes[l]
            });
        if !fits {
            return Err(RuntimeError::Invalid(
                "held bundle prefixes do not match the file's layers".into(),
            ));
        }
        let bytes = rows.iter().map(|r| r.len() / self.n_ff).collect();
        self.held = Some(HeldPrefix { rows, bytes });
        self.assembled = vec![0; self.max_run_bytes];
        Ok(())
    }

    /// From now on the unneeded bundles a merged read spans count as asked
    /// for: they land anyway, so a policy that keeps neurons by threshold
    /// computes them at no I/O cost (a wider net than its prediction).
    pub fn use_spans(&mut self) {
        self.use_spans = true;
    }

    /// From now on only the bundles asked for count (the default; see
    /// [`use_spans`](Self::use_spans)).
    pub fn ignore_spans(&mut self) {
        self.use_spans = false;
    }

    /// Marks the bundles that runs `first..` of stage `k` span but nobody
    /// asked for as asked for (with [`use_spans`](Self::use_spans)).
    fn claim_spans(&mut self, k: usize, first: usize) {
        if !self.use_spans {
            return;
        }
        let s = &mut self.stages[k];
        let l = s.layer;
        let bb = self.bundle_bytes[l] as u64;
        for &(p0, n) in &s.runs[first..] {
            for &i in &self.placement[l][p0..p0 + n] {
                let i = i as usize;
                // A cache hit inside the span is served by the cache.
                if !s.requested[i] && !bit_is_set(&s.want, i) {
                    s.requested[i] = true;
                    set_bit(&mut s.want, i);
                    s.requested_count += 1;
                    self.bytes_needed += bb;
                }
            }
        }
    }

    /// The engine's read latencies per queue depth so far.
    pub fn read_latencies(&self) -> Vec<crate::flash::io::DepthLatency> {
        self.io.latencies()
    }

    /// Whether reads bypass the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.io.is_direct()
    }

    pub fn cache_policy_name(&self) -> &'static str {
        self.cache.policy_name()
    }

    /// Bytes the streamer holds besides the cache: the I/O engine's read
    /// buffers (all of its staging) and the run scratch of a held prefix.
    /// Known before construction, for `--mem-budget`.
    pub fn overhead_bytes(m: &FlashModel, staging_bytes: Option<u64>) -> u64 {
        let cfg = Self::io_config(m, staging_bytes);
        let pool = cfg.pool_buffers.max(cfg.max_in_flight) * cfg.max_read_bytes;
        (pool + max_run_bytes(&cfg)) as u64
    }

    /// The I/O settings for `m`'s layer size, or for a pool of about
    /// `staging_bytes` where given (at least two reads).
    fn io_config(m: &FlashModel, staging_bytes: Option<u64>) -> IoConfig {
        if let Some(bytes) = staging_bytes {
            return IoConfig::for_pool_bytes(bytes);
        }
        let layer = (0..m.flash.n_layer())
            .map(|l| m.flash.layer_extent(l).1)
            .max()
            .unwrap_or(0);
        IoConfig::for_layer_bytes(layer, STAGES)
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget
    }

    pub fn cache_bytes(&self) -> u64 {
        self.cache.capacity_bytes() + self.whole.as_ref().map_or(0, |r| r.bytes())
    }

    /// Every layer, held whole in the source's matrices (`None`: the cache
    /// and the reads serve them).
    pub(crate) fn whole(&self) -> Option<&Resident> {
        self.whole.as_ref()
    }

    /// Whether every layer is held whole (the budget has a slot for every
    /// neuron): nothing is read, and hits have no cache slot to copy from.
    pub fn holds_whole(&self) -> bool {
        self.whole.is_some()
    }

    /// The I/O engine's read buffers (the staging) and the run scratch.
    pub fn buffer_bytes(&self) -> u64 {
        self.staging_bytes() + self.assembled.len() as u64
    }

    /// Bytes of landed runs and reads in flight the pool can hold at once.
    pub fn staging_bytes(&self) -> u64 {
        let cfg = self.io.config();
        (cfg.pool_buffers * cfg.max_read_bytes) as u64
    }

    pub fn stats(&self) -> EngineStats {
        let (io, c) = (self.io.stats(), self.cache.stats());
        EngineStats {
            bytes_read: io.bytes_read,
            bytes_requested: self.bytes_needed,
            reads: io.reads_issued,
            cache_hits: c.hits + self.whole_hits,
            cache_misses: c.misses,
            io_wait_seconds: self.wait_ns as f64 * 1e-9,
            io_busy_seconds: self.io.busy_seconds(),
            io_mean_depth: self.io.mean_depth(),
            late_skipped: self.late_skipped,
            ..EngineStats::default()
        }
    }

    /// Time compute has spent blocked on arrivals.
    pub fn wait_seconds(&self) -> f64 {
        self.wait_ns as f64 * 1e-9
    }

    /// Sets the reads and bytes in flight at once (0 bytes: no byte limit).
    pub fn set_depth(&self, reads: usize, bytes: u64) {
        self.io.set_depth(reads, bytes);
    }

    /// Blocks until stage `k` has settled every read it posted.
    fn quiesce(&mut self, k: usize) {
        let want = self.stages[k].posted;
        let landing = &self.landings.stages[k];
        let mut g = lock(&self.landings.signal);
        while landing.settled.load(Ordering::Acquire) < want {
            g = self.landings.arrived.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Looks up layer `l`'s wanted bundles in the cache (pinning hits) and
    /// requests the misses. Needed bundles close on flash share one request:
    /// a gap of unneeded bundles of at most `merge_gap_bytes` is read along.
    /// This keeps the request count of scattered sparse sets low (the I/O
    /// engine then coalesces neighbouring requests within its own limits).
    /// Where neurons share down tiles, a wanted neuron brings its group.
    fn request(&mut self, l: usize, want: Want, urgency: Option<&[u16]>) -> Result<()> {
        self.with_groups(l, want, |s, want| s.request_exact(l, want, urgency))
    }

    /// Runs `f` with `want` widened to whole groups where neurons share down tiles.
    fn with_groups(&mut self, l: usize, want: Want, f: impl FnOnce(&mut Self, Want) -> Result<()>) -> Result<()> {
        let g = self.group[l];
        if let (Want::Set(bits), true) = (want, g > 1) {
            let mut grouped = std::mem::take(&mut self.grouped);
            widen_to_groups(bits, self.n_ff, g, &mut grouped);
            let r = f(self, Want::Set(&grouped));
            self.grouped = grouped;
            return r;
        }
        f(self, want)
    }

    /// The I/O priority of a run of stage sequence `seq` whose most urgent
    /// neuron has `urgency` (0 first): a later stage never overtakes an
    /// earlier one (except once per 65,536 stages, when the sequence wraps).
    fn priority(seq: u32, urgency: u16) -> u32 {
        (seq & 0xFFFF) << 16 | urgency as u32
    }

    fn request_exact(&mut self, l: usize, want: Want, urgency: Option<&[u16]>) -> Result<()> {
        // A free stage: callers request only when the queue has room (or after a reset).
        let k = (0..STAGES)
            .find(|k| !self.queue.contains(k))
            .ok_or_else(|| RuntimeError::Invalid(format!("layer {l}: every streaming stage is in use")))?;
        self.seq = self.seq.wrapping_add(1);
        // The stage is not queued, so nothing of it is outstanding; make sure.
        self.quiesce(k);
        let landing = &self.landings.stages[k];
        landing.reset(true);
        landing.log.clear();
        landing.settled.store(0, Ordering::Release);
        *lock(&landing.failed) = None;
        let s = &mut self.stages[k];
        s.layer = l;
        s.requested.fill(false);
        s.staged.fill(false);
        s.want.fill(0);
        s.taken = 0;
        s.pinned.clear();
        s.runs.clear();
        s.run_state.clear();
        s.covered.fill(0);
        s.requested_count = 0;
        s.expired = false;
        s.posted = 0;
        s.deferred.clear();
        s.seq = self.seq;
        self.queue.push_back(k);
        // An empty stage extended by `want`: nothing is covered yet.
        self.extend_exact(k, want, urgency);
        Ok(())
    }

    /// Marks runs `first..` of stage `k` as covering their positions and
    /// hands them to the I/O thread, each at the priority of its most urgent
    /// requested neuron; behind the front, only as many as its share of the
    /// pool allows (the rest wait in `deferred`, most urgent first).
    fn submit_runs(&mut self, k: usize, first: usize, urgency: Option<&[u16]>) {
        let s = &mut self.stages[k];
        let l = s.layer;
        let order = &self.placement[l];
        for (r, &(p0, n)) in s.runs.iter().enumerate().skip(first) {
            s.covered[p0..p0 + n].fill(r as u32 + 1);
        }
        s.run_state.resize(s.runs.len(), RUN_QUEUED);
        let (seq, requested) = (s.seq, &s.requested);
        let urgent = |p0: usize, n: usize| {
            urgency.map_or(0, |u| {
                order[p0..p0 + n]
                    .iter()
                    .filter(|&&i| requested[i as usize])
                    .map(|&i| u[i as usize])
                    .min()
                    .unwrap_or(u16::MAX)
            })
        };
        let new = s.runs.iter().enumerate().skip(first);
        s.deferred
            .extend(new.map(|(r, &(p0, n))| (Self::priority(seq, urgent(p0, n)), r)));
        s.deferred.sort_unstable();
        self.post_deferred(k);
    }

    /// Posts stage `k`'s deferred runs that its share of the pool allows:
    /// all of them at the front, or right behind it once the front has every
    /// read back; further back, what the stages behind the front have
    /// posted together leaves of half the pool.
    fn post_deferred(&mut self, k: usize) {
        let front = self.queue.front().copied();
        let unlimited = front == Some(k)
            || (self.queue.get(1) == Some(&k)
                && front.is_some_and(|f| {
                    let st = &self.stages[f];
                    st.deferred.is_empty() && self.landings.stages[f].settled.load(Ordering::Acquire) >= st.runs.len()
                }));
        let behind: usize = self.queue.iter().skip(1).map(|&j| self.stages[j].posted).sum();
        let s = &mut self.stages[k];
        let room = if unlimited {
            s.deferred.len()
        } else {
            self.ahead_runs.saturating_sub(behind).min(s.deferred.len())
        };
        if room == 0 {
            return;
        }
        let mut batch = std::mem::take(&mut self.to_post);
        batch.clear();
        batch.extend(s.deferred.drain(..room));
        s.posted += batch.len();
        let l = s.layer;
        let (bb, skip) = (self.bundle_bytes[l], self.held.as_ref().map_or(0, |h| h.bytes[l]));
        let (base, runs) = (self.layer_offset[l], &s.runs);
        self.io.read(batch.iter().map(|&(priority, r)| {
            let (p0, n) = runs[r];
            let req = Request {
                id: request_id(k, r),
                offset: base + (p0 * bb + skip) as u64,
                len: (n * bb - skip) as u32,
                priority,
            };
            (req, 0)
        }));
        self.to_post = batch;
    }

    /// Posts what the stages behind the front held back, as far as their
    /// share of the pool allows, nearest first.
    fn post_behind(&mut self) {
        for j in 1..self.queue.len() {
            let k = self.queue[j];
            if !self.stages[k].deferred.is_empty() {
                self.post_deferred(k);
            }
        }
    }

    /// The queued stage of layer `l`, if any.
    fn stage_of(&self, l: usize) -> Option<usize> {
        self.queue.iter().copied().find(|&k| self.stages[k].layer == l)
    }

    /// Adds `want` to the queued stage of layer `l` (nothing if none is
    /// queued): new cache hits are pinned, new misses requested at their
    /// `urgency`. A neuron whose position an earlier read of the stage
    /// covers rides on that read if it has not landed yet, and is left out
    /// if it has (or if that read was cancelled): two reads never write the
    /// same staging bytes.
    pub fn extend(&mut self, l: usize, want: Want, urgency: Option<&[u16]>) -> Result<()> {
        let Some(k) = self.stage_of(l) else { return Ok(()) };
        self.with_groups(l, want, |st, want| {
            st.extend_exact(k, want, urgency);
            Ok(())
        })
    }

    fn extend_exact(&mut self, k: usize, want: Want, urgency: Option<&[u16]>) {
        let s = &mut self.stages[k];
        let l = s.layer;
        let (bb, skip) = (self.bundle_bytes[l], self.held.as_ref().map_or(0, |h| h.bytes[l]));
        let rule = RunRule::new(bb, self.max_run_bytes, self.merge_gap_bytes);
        let mut runs = std::mem::take(&mut self.extension);
        runs.clear();
        for (p, &i) in self.placement[l].iter().enumerate() {
            let i = i as usize;
            if !want.contains(i) || bit_is_set(&s.want, i) || s.expired {
                continue;
            }
            if s.covered[p] != 0 {
                let r = s.covered[p] as usize - 1;
                if s.run_state[r] == RUN_QUEUED && !s.requested[i] {
                    set_bit(&mut s.want, i);
                    s.requested[i] = true;
                    s.requested_count += 1;
                    self.bytes_needed += (bb - skip) as u64;
                }
                continue;
            }
            set_bit(&mut s.want, i);
            if self.whole.is_some() {
                self.whole_hits += 1;
                s.pinned.push(i);
                continue;
            }
            if self.cache.lookup(l, i).is_some() {
                self.cache.pin(l, i);
                s.pinned.push(i);
                continue;
            }
            s.requested[i] = true;
            s.requested_count += 1;
            self.bytes_needed += (bb - skip) as u64;
            // Merge only across positions no earlier read covers.
            let joins = runs
                .last()
                .is_some_and(|&(p0, n): &(usize, usize)| s.covered[p0 + n..p].iter().all(|&c| c == 0));
            if !joins {
                runs.push((p, 1));
            } else {
                rule.push(&mut runs, p);
            }
        }
        let first = s.runs.len();
        s.runs.extend_from_slice(&runs);
        self.extension = runs;
        if self.stages[k].runs.len() > first {
            self.claim_spans(k, first);
            self.submit_runs(k, first, urgency);
        }
    }

    /// Cancels the reads of layer `l`'s queued stage not yet submitted whose
    /// requested neurons all lie outside `keep` (a refined prediction).
    /// Returns the reads asked to cancel (one already submitted still lands).
    pub fn cancel_outside(&mut self, l: usize, keep: &[u64]) -> usize {
        let Some(k) = self.stage_of(l) else { return 0 };
        let s = &mut self.stages[k];
        let order = &self.placement[l];
        let (requested, runs) = (&s.requested, &s.runs);
        let needed = |r: usize| {
            let (p0, n) = runs[r];
            order[p0..p0 + n]
                .iter()
                .any(|&i| requested[i as usize] && bit_is_set(keep, i as usize))
        };
        // Runs never posted are dropped here and settle at once.
        let before = s.deferred.len();
        let state = &mut s.run_state;
        s.deferred.retain(|&(_, r)| {
            let drop = !needed(r);
            if drop {
                state[r] = RUN_CANCELLED;
            }
            !drop
        });
        let unposted = before - s.deferred.len();
        s.posted += unposted;
        // The posted ones settle when the I/O thread confirms (or land
        // anyway, already submitted).
        let mut ids = Vec::new();
        for (r, st) in state.iter_mut().enumerate() {
            // (What stays deferred is needed.)
            if *st == RUN_QUEUED && !needed(r) {
                *st = RUN_CANCELLED;
                ids.push(request_id(k, r));
            }
        }
        if unposted > 0 {
            self.landings.settle(k, unposted);
        }
        let n = ids.len() + unposted;
        self.io.cancel(ids);
        n
    }

    /// Bundle bytes of layer `l`'s queued stage that have landed (taken by
    /// compute or not): what a layer starts with, as the control model's
    /// `queued_bytes` state means it (reads still in flight are missing).
    pub fn landed_bytes(&self, l: usize) -> u64 {
        let Some(k) = self.stage_of(l) else { return 0 };
        let s = &self.stages[k];
        let log = &self.landings.stages[k].log;
        let bb = self.bundle_bytes[l] as u64;
        (0..log.len()).map(|i| s.runs[log.get(i) as usize].1 as u64 * bb).sum()
    }

    /// Whether neuron `i` of layer `l` is wanted by its queued stage.
    pub fn is_wanted(&self, l: usize, i: usize) -> bool {
        self.stage_of(l).is_some_and(|k| bit_is_set(&self.stages[k].want, i))
    }

    /// Layer `l`'s bundles available so far (cache hits and taken arrivals)
    /// and those it expects in all.
    pub fn progress(&self, l: usize) -> Result<(usize, usize)> {
        let s = &self.stages[self.front(l)?];
        let taken = s.staged.iter().filter(|&&b| b).count();
        Ok((s.pinned.len() + taken, s.expected()))
    }

    /// Whether every bundle layer `l`'s stage wanted is available (no read
    /// failed, was cancelled or missed the deadline).
    pub fn complete(&self, l: usize) -> Result<bool> {
        let s = &self.stages[self.front(l)?];
        Ok(!s.expired && s.run_state.iter().all(|&st| st == RUN_TAKEN))
    }

    /// Writes into `have` (cleared first) the wanted neurons of layer `l`
    /// that are available: cache hits and landed requests.
    pub fn available(&self, l: usize, have: &mut [u64]) -> Result<()> {
        let s = &self.stages[self.front(l)?];
        have.fill(0);
        for &i in &s.pinned {
            set_bit(have, i);
        }
        for (i, &b) in s.staged.iter().enumerate() {
            if b {
                set_bit(have, i);
            }
        }
        Ok(())
    }

    /// Drops every outstanding stage: requests not yet submitted are
    /// cancelled, reads in flight are drained.
    fn reset(&mut self) -> Result<()> {
        self.retire();
        self.release_kept();
        for &k in &self.queue {
            let n = self.stages[k].runs.len();
            self.stages[k].deferred.clear();
            self.io.cancel((0..n).map(|r| request_id(k, r)));
        }
        while let Some(k) = self.queue.pop_front() {
            self.quiesce(k);
            self.landings.stages[k].reset(false);
            self.unpin(k);
        }
        Ok(())
    }

    fn unpin(&mut self, k: usize) {
        let s = &mut self.stages[k];
        // Neurons served by `whole` hold no slot.
        if self.whole.is_none() {
            for &i in &s.pinned {
                self.cache.unpin(s.layer, i);
            }
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
            self.request(l, want, None)?;
        }
        Ok(())
    }

    /// Requests layer `l` behind the stages queued, if a stage is free and
    /// `l` has none yet.
    pub fn prefetch(&mut self, l: usize, want: Want) -> Result<()> {
        self.prefetch_ranked(l, want, None)
    }

    /// [`prefetch`](Self::prefetch) with each neuron's `urgency` (0 most
    /// urgent) ordering the reads.
    pub fn prefetch_ranked(&mut self, l: usize, want: Want, urgency: Option<&[u16]>) -> Result<()> {
        if self.queue.len() < STAGES && !self.is_queued(l) {
            self.request(l, want, urgency)?;
        }
        Ok(())
    }

    /// [`ensure`](Self::ensure) with each neuron's `urgency` ordering the reads.
    pub fn ensure_ranked(&mut self, l: usize, want: Want, urgency: Option<&[u16]>) -> Result<()> {
        if !self.is_queued(l) || self.queue.front().is_some_and(|&k| self.stages[k].layer != l) {
            self.reset()?;
            self.request(l, want, urgency)?;
            return Ok(());
        }
        self.extend(l, want, urgency)
    }

    /// Neurons the queued stage of layer `l` wants (0 if none is queued).
    pub fn wanted_count(&self, l: usize) -> usize {
        self.stage_of(l)
            .map_or(0, |k| self.stages[k].want.iter().map(|w| w.count_ones() as usize).sum())
    }

    /// Whether the cache holds all of layer `l` (its FFN needs no reads).
    pub fn holds_layer(&self, l: usize) -> bool {
        self.whole.is_some() || self.cache.holds_layer(l)
    }

    /// Neurons of layer `l` the cache does not hold.
    pub fn uncached_in(&self, l: usize) -> usize {
        if self.whole.is_some() {
            return 0;
        }
        self.n_ff - self.cache.resident_in(l)
    }

    /// Neurons of `bits` that layer `l`'s cache does not hold.
    pub fn uncached_count(&self, l: usize, bits: &[u64]) -> usize {
        if self.whole.is_some() {
            return 0;
        }
        super::trace::set_bits(bits)
            .filter(|&i| !self.cache.contains(l, i))
            .count()
    }

    /// Whether a stage for layer `l` is queued (requested, not finished).
    pub fn is_queued(&self, l: usize) -> bool {
        self.stage_of(l).is_some()
    }

    /// The oldest stage, which must be layer `l` (see [`ensure`](Self::ensure)).
    fn front(&self, l: usize) -> Result<usize> {
        self.queue
            .front()
            .copied()
            .filter(|&k| self.stages[k].layer == l)
            .ok_or_else(|| RuntimeError::Invalid(format!("layer {l} was not requested before waiting on it")))
    }

    /// The wanted neurons of layer `l` the cache holds (available at once).
    pub fn hits(&self, l: usize) -> Result<&[usize]> {
        Ok(&self.stages[self.front(l)?].pinned)
    }

    /// The longest prefix of `ids` (hits of layer `l`) that sits in
    /// consecutive cache slots (a static hot set is loaded in file order):
    /// the slots as one slice, bundle k at `k × stride`, with the stride and
    /// the count; `None` when fewer than two line up.
    pub fn cached_span(&self, l: usize, ids: &[usize]) -> Option<(&[u8], usize, usize)> {
        let first = self.cache.slot_of(l, *ids.first()?)?;
        let count = ids
            .iter()
            .zip(first..)
            .take_while(|&(&i, slot)| self.cache.slot_of(l, i) == Some(slot))
            .count();
        if count < 2 {
            return None;
        }
        Some((self.cache.slot_span(l, first, count)?, self.cache.slot_stride(), count))
    }

    /// Neuron `i`'s bundle from the cache (for [`hits`](Self::hits)).
    pub fn cached(&self, l: usize, i: usize) -> &[u8] {
        self.cache.peek(l, i).unwrap_or(&[])
    }

    /// The cache slot that holds neuron `i` of layer `l`, if it is cached:
    /// a device that mirrors the cache keeps its copy under the same slot.
    pub fn cache_slot(&self, l: usize, i: usize) -> Option<u32> {
        self.cache.slot_of(l, i)
    }

    /// Of a static hot set loaded up front, the share that lies outside
    /// its layers' leading bundles (`None` without one). Reads merge over
    /// those and read them again, so a file whose hot set is not one piece
    /// per layer streams more than the cache leaves out.
    pub fn hot_set_scattered(&self) -> Option<f64> {
        self.hot_scattered
    }

    /// Slots in the neuron cache (0 without a cache).
    pub fn cache_slots(&self) -> usize {
        self.cache.n_slots()
    }

    /// The next run of layer `l` to land, in arrival order, blocking until
    /// one has; `None` once every requested run has been taken. A failed
    /// read is its error (naming the file, offset and length).
    pub fn next_run(&mut self, l: usize) -> Result<Option<LandedRun<'_>>> {
        self.next_run_until(l, None)
    }

    /// [`next_run`](Self::next_run) that gives up at `deadline`: the reads
    /// still out are cancelled (those submitted land unused), their bundles
    /// count as skipped late, and the layer goes on with what it has.
    pub fn next_run_until(&mut self, l: usize, deadline: Option<std::time::Instant>) -> Result<Option<LandedRun<'_>>> {
        self.retire();
        let k = self.front(l)?;
        // The stages behind may post what they held back once this one has every read back.
        self.post_behind();
        if self.stages[k].expired {
            return Ok(None);
        }
        let landing = &self.landings.stages[k];
        let total = self.stages[k].runs.len();
        let mut waited: Option<std::time::Instant> = None;
        let mut late = false;
        let r = loop {
            let taken = self.stages[k].taken;
            // Settled first: the I/O thread logs a run before counting it
            // settled, so once every run is settled the log is complete. (In
            // the other order a run landing between the two loads is lost.)
            let settled = landing.settled.load(Ordering::Acquire);
            if taken < landing.log.len() {
                break Some(landing.log.get(taken) as usize);
            }
            let mut failed = lock(&landing.failed);
            if let Some(e) = failed.take() {
                // Later calls on this layer keep failing: nothing of it is garbage-filled.
                *failed = Some(RuntimeError::Invalid(e.to_string()));
                return Err(e);
            }
            drop(failed);
            if taken == total || settled == total {
                break None;
            }
            let now = std::time::Instant::now();
            waited.get_or_insert(now);
            let mut timeout = std::time::Duration::from_millis(20);
            if let Some(d) = deadline {
                if now >= d {
                    late = true;
                    break None;
                }
                timeout = timeout.min(d - now);
            }
            let g = lock(&self.landings.signal);
            if self.stages[k].taken == landing.log.len() && landing.settled.load(Ordering::Acquire) < total {
                let _ = self
                    .landings
                    .arrived
                    .wait_timeout(g, timeout)
                    .unwrap_or_else(|e| e.into_inner());
            }
        };
        if let Some(t) = waited {
            self.wait_ns += t.elapsed().as_nanos() as u64;
        }
        let Some(r) = r else {
            let s = &mut self.stages[k];
            if late {
                // Missed the deadline: the rest is skipped, not waited for.
                s.expired = true;
                let late = s.requested.iter().zip(&s.staged).filter(|(&r, &st)| r && !st).count();
                self.late_skipped += late as u64;
                let ids: Vec<u32> = (0..total)
                    .filter(|&r| s.run_state[r] == RUN_QUEUED)
                    .map(|r| request_id(k, r))
                    .collect();
                self.io.cancel(ids);
            }
            return Ok(None);
        };
        let data = landing
            .take(r)
            .ok_or_else(|| RuntimeError::Invalid(format!("layer {l}: read {r} was published without its bytes")))?;
        let s = &mut self.stages[k];
        s.taken += 1;
        // A run asked to cancel after it was submitted lands anyway, and is used.
        s.run_state[r] = RUN_TAKEN;
        let (p0, n) = s.runs[r];
        let bb = self.bundle_bytes[l];
        if let Some(h) = &self.held {
            // The read started after the first bundle's held prefix: put the
            // run back together behind it.
            let (hb, i) = (h.bytes[l], self.placement[l][p0] as usize);
            let run = &mut self.assembled[..n * bb];
            run[..hb].copy_from_slice(&h.rows[l][i * hb..(i + 1) * hb]);
            run[hb..].copy_from_slice(data.data());
        }
        let neurons = &self.placement[l][p0..p0 + n];
        for &i in neurons {
            if s.requested[i as usize] {
                s.staged[i as usize] = true;
            }
        }
        // Kept whole where stage 2 takes down columns from it (a held
        // prefix puts runs back together in one buffer, which is reused).
        let keep = self.keeping && self.held.is_none() && self.group[l] == 1 && self.kept.len() < self.keep_runs;
        let run = TakenRun { stage: k, run: r, data };
        let bytes = if keep {
            let at = self.kept.len();
            for (j, &i) in neurons.iter().enumerate() {
                if s.requested[i as usize] {
                    self.kept_at[i as usize] = (at as u32, j as u32);
                }
            }
            self.kept.push(run);
            self.current = Some(Taken::Kept(at));
            self.kept[at].data.data()
        } else {
            let Taken::Own(t) = self.current.insert(Taken::Own(run)) else {
                unreachable!("just set")
            };
            t.bytes(&self.assembled, n * bb)
        };
        Ok(Some(LandedRun {
            bytes,
            neurons,
            requested: &self.stages[k].requested,
            kept: keep,
        }))
    }

    /// Neuron `i`'s bundle in a kept run of layer `l` (the front), if one
    /// holds it ([`LandedRun::kept`]).
    pub fn kept_bundle(&self, l: usize, i: usize) -> Option<&[u8]> {
        let (r, j) = *self.kept_at.get(i)?;
        let run = self.kept.get(r as usize)?;
        if self.stages[run.stage].layer != l {
            return None;
        }
        let bb = self.bundle_bytes[l];
        run.data.data().get(j as usize * bb..(j as usize + 1) * bb)
    }

    /// Offers the run compute took last to the cache (its requested
    /// bundles, in arrival order) and lets go of its pool buffer, unless
    /// the layer keeps it.
    fn retire(&mut self) {
        let Some(taken) = self.current.take() else { return };
        let t = match &taken {
            Taken::Own(t) => t,
            Taken::Kept(at) => &self.kept[*at],
        };
        let s = &self.stages[t.stage];
        let (l, (p0, n)) = (s.layer, s.runs[t.run]);
        let bb = self.bundle_bytes[l];
        let bytes = t.bytes(&self.assembled, n * bb);
        debug_assert_eq!(bytes.len(), n * bb);
        for (j, &i) in self.placement[l][p0..p0 + n].iter().enumerate() {
            let i = i as usize;
            if s.staged[i] {
                if let Some(slot) = self.cache.insert(l, i) {
                    slot.copy_from_slice(&bytes[j * bb..(j + 1) * bb]);
                }
            }
        }
        // Dropping an own run gives its pool buffer back.
    }

    /// Lets go of the kept runs (their buffers back to the pool).
    fn release_kept(&mut self) {
        for t in self.kept.drain(..) {
            let s = &self.stages[t.stage];
            let (p0, n) = s.runs[t.run];
            for &i in &self.placement[s.layer][p0..p0 + n] {
                self.kept_at[i as usize] = NOT_KEPT;
            }
        }
    }

    /// Releases the layer computed last (the run taken last goes to the
    /// cache); `end_of_token` after the last layer. The next stage, now the
    /// front, posts the reads it held back.
    pub fn finish(&mut self, l: usize, end_of_token: bool) {
        self.retire();
        self.release_kept();
        self.keeping = self.wait_ns == self.wait_ns_at_layer;
        self.wait_ns_at_layer = self.wait_ns;
        if let Some(k) = self.queue.pop_front() {
            debug_assert_eq!(self.stages[k].layer, l);
            self.landings.stages[k].reset(false);
            self.unpin(k);
        }
        if let Some(&k) = self.queue.front() {
            self.post_deferred(k);
        }
        self.post_behind();
        if end_of_token {
            self.cache.end_token();
        }
    }
}
/// Of `hot` (the (layer, neuron) set a cache loads up front), the share not
/// among its layers' leading positions in `placement` (per layer, the
/// neuron at each position); `None` for an empty set.
fn scattered_share(hot: &[(u32, u32)], placement: &[Vec<u32>]) -> Option<f64> {
    if hot.is_empty() {
        return None;
    }
    let mut per_layer = vec![0usize; placement.len()];
    for &(l, _) in hot {
        if let Some(c) = per_layer.get_mut(l as usize) {
            *c += 1;
        }
    }
    let leading: Vec<Vec<bool>> = placement
        .iter()
        .zip(&per_layer)
        .map(|(order, &k)| {
            let mut lead = vec![false; order.len()];
            for &i in order.iter().take(k) {
                lead[i as usize] = true;
            }
            lead
        })
        .collect();
    let outside = hot
        .iter()
        .filter(|&&(l, i)| {
            !leading
                .get(l as usize)
                .and_then(|v| v.get(i as usize))
                .copied()
                .unwrap_or(false)
        })
        .count();
    Some(outside as f64 / hot.len() as f64)
}

/// Whether a cache of `budget` bytes would come to hold every neuron and
/// then never change: it has a slot for each, and every eviction policy
/// here evicts only for room (the sliding window too: it does not release
/// early, see `engine/policy/current_layer.rs`). Such a cache is better
/// held as `dense` holds the FFN: the source's gate, up and down matrices,
/// which stage 1 streams without the down parts in between and stage 2
/// takes as they are, where slots would have every down tile gathered anew
/// each token; the bytes are no more than the slots'.
fn holds_everything(shape: &CacheShape, budget: u64) -> bool {
    let all = shape.total_slot_bytes();
    all > 0 && budget >= all
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
