//! The flash I/O engine: reads neuron bundles from a packed file with
//! O_DIRECT, a bounded number of reads in flight, priorities, coalescing of
//! neighbouring requests, and cancellation of requests not yet submitted.
//!
//! The shape follows io_uring: the caller `enqueue`s tagged [`Request`]s,
//! `poll`s (which submits the most urgent work and reaps completions), and
//! `pop`s each finished request as a [`Completed`] view into a pool buffer (or
//! a [`ReadFailure`]). [`ReadyFlags`] hands arrivals to compute on another
//! thread without locks.
//!
//! Two backends sit behind [`Backend`]: io_uring ([`UringBackend`]) and a
//! thread pool issuing `pread` ([`PreadBackend`]) where io_uring is refused.
//! [`FaultyBackend`] wraps either to inject errors and short reads in tests.

mod backend;
mod bench;
mod latency;
mod pool;
mod pread;
mod request;
mod uring;
mod worker;

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use backend::{Backend, Fault, FaultyBackend, ReadOp, ReadResult};
pub use bench::{read_benchmark, ReadBench, ReadBenchReport};
pub use latency::{DepthLatency, LatencyLog};
pub use pool::Completed;
pub use pread::PreadBackend;
pub use request::Request;
pub use uring::UringBackend;
pub use worker::{Delivery, IoWorker, Sink};

use pool::Pool;
use request::{align_down, CoalesceLimits, PendingQueue};

use crate::{Result, RuntimeError};

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring when it works here, else the pread pool.
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// The pread thread pool.
    Pread,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" => Ok(Self::Uring),
            "pread" => Ok(Self::Pread),
            other => Err(format!("unknown I/O backend '{other}' (expected auto, uring or pread)")),
        }
    }
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct IoConfig {
    /// Alignment of offsets, lengths and buffers (a power of two, at least the
    /// device's logical block size). 4096 by default.
    pub alignment: usize,
    /// Largest single read, and the size of each pool buffer.
    pub max_read_bytes: usize,
    /// Neighbours whose aligned ranges are at most this far apart coalesce.
    pub max_gap: u64,
    /// A neighbour joins a read only if bytes read / bytes requested stays at
    /// or under this (or does not grow).
    pub max_amplification: f64,
    /// Reads outstanding at once (changeable later, up to `pool_buffers`).
    pub max_in_flight: usize,
    /// Bytes of reads outstanding at once; 0: no limit beyond the read count.
    pub max_bytes_in_flight: u64,
    /// Buffers in the pool: in-flight reads plus completions the caller holds.
    pub pool_buffers: usize,
    /// Threads of the pread backend.
    pub pread_threads: usize,
    /// Try O_DIRECT (falls back to buffered I/O, with a warning, if refused).
    pub direct: bool,
    pub backend: BackendKind,
}

impl Default for IoConfig {
    fn default() -> Self {
        Self {
            alignment: 4096,
            max_read_bytes: 512 * 1024,
            max_gap: 16 * 1024,
            max_amplification: 1.5,
            max_in_flight: 16,
            max_bytes_in_flight: 0,
            pool_buffers: 32,
            pread_threads: 4,
            direct: true,
            backend: BackendKind::Auto,
        }
    }
}

impl IoConfig {
    /// The defaults, with a pool that holds about `layers` layers of
    /// `layer_bytes` (the stages a streamer fills at once; at most
    /// [`MAX_POOL_BYTES`]), cut as [`for_pool_bytes`](Self::for_pool_bytes)
    /// cuts it, and with at least the buffers for the default depth in
    /// flight (the depths the controller's codebook sets go up to it): the
    /// pool is all of the streamer's staging, so a small model's floor
    /// stays small.
    pub fn for_layer_bytes(layer_bytes: u64, layers: usize) -> Self {
        let depth = Self::default().max_in_flight;
        let min_pool = (depth * MIN_POOL_READ) as u64;
        let cut = Self::for_pool_bytes((layers as u64 * layer_bytes).clamp(min_pool, MAX_POOL_BYTES));
        Self {
            pool_buffers: cut.pool_buffers.max(depth),
            max_in_flight: depth,
            ..cut
        }
    }

    /// The defaults, with a pool of about `pool` bytes (at least two reads)
    /// in the largest power-of-two reads from [`MIN_POOL_READ`] up to the
    /// default's that still make [`MIN_POOL_BUFFERS`] of them: large reads
    /// are what a disk serves fastest.
    pub fn for_pool_bytes(pool: u64) -> Self {
        let d = Self::default();
        let share = (pool / MIN_POOL_BUFFERS as u64).max(1);
        let read = (1u64 << share.ilog2()).clamp(MIN_POOL_READ as u64, d.max_read_bytes as u64);
        let buffers = (pool / read).clamp(2, 1 << 16) as usize;
        Self {
            max_read_bytes: read as usize,
            pool_buffers: buffers,
            max_in_flight: d.max_in_flight.min(buffers),
            ..d
        }
    }
}

/// Most bytes [`IoConfig::for_layer_bytes`] gives the pool.
const MAX_POOL_BYTES: u64 = 16 << 20;

/// Fewest buffers [`IoConfig::for_pool_bytes`] cuts a pool into. Fewer,
/// larger reads from the same pool ran faster on this project's virtual
/// disk: SmolLM2 `dense-stream` at a 25% cache went from 30 to 38 tok/s
/// with 512 KiB reads in 12 buffers instead of 128 KiB in 50.
const MIN_POOL_BUFFERS: usize = 12;

/// Smallest read [`IoConfig::for_pool_bytes`] picks: below it request
/// overhead starts to cost bandwidth on common SSDs.
const MIN_POOL_READ: usize = 128 * 1024;

/// Counters since the engine was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Coalesced reads issued (resubmissions not counted).
    pub reads_issued: u64,
    /// Resubmissions: remainders of short reads and EINTR/EAGAIN retries.
    pub resubmits: u64,
    pub short_reads: u64,
    /// Bytes the backend returned.
    pub bytes_read: u64,
    /// Bytes of the requests issued.
    pub bytes_requested: u64,
    pub requests_completed: u64,
    pub requests_failed: u64,
    pub requests_cancelled: u64,
}

/// A request whose read failed; `error` names the file, offset and length.
#[derive(Debug)]
pub struct ReadFailure {
    pub id: u32,
    pub error: RuntimeError,
}

/// One lock-free ready flag per bundle id. `set` publishes with Release,
/// `is_ready`/`take` observe with Acquire, so everything written before `set`
/// (the bundle's bytes) is visible to the thread that sees the flag.
pub struct ReadyFlags {
    flags: Box<[AtomicU8]>,
}

impl ReadyFlags {
    pub fn new(n: usize) -> Self {
        Self {
            flags: (0..n).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.flags.len()
    }

    pub fn is_empty(&self) -> bool {
        self.flags.is_empty()
    }

    pub fn set(&self, id: u32) {
        self.flags[id as usize].store(1, Ordering::Release);
    }

    pub fn is_ready(&self, id: u32) -> bool {
        self.flags[id as usize].load(Ordering::Acquire) != 0
    }

    /// Clears the flag, returning whether it was set: each arrival is taken once.
    pub fn take(&self, id: u32) -> bool {
        self.flags[id as usize].swap(0, Ordering::AcqRel) != 0
    }

    pub fn clear_all(&self) {
        for f in self.flags.iter() {
            f.store(0, Ordering::Release);
        }
    }
}

/// An append-only log of ids in the order they arrived, written by one
/// thread (the I/O worker) and read by another (compute) without locks: the
/// writer stores the id, then publishes the new length with Release; a reader
/// that loads the length with Acquire sees every id (and everything written
/// before it, such as the bytes it names) up to that length.
pub struct ArrivalLog {
    ids: Box<[std::sync::atomic::AtomicU32]>,
    len: std::sync::atomic::AtomicUsize,
}

impl ArrivalLog {
    pub fn new(capacity: usize) -> Self {
        Self {
            ids: (0..capacity).map(|_| std::sync::atomic::AtomicU32::new(0)).collect(),
            len: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    pub fn capacity(&self) -> usize {
        self.ids.len()
    }

    /// Appends `id` (the single writer only); false when full.
    pub fn push(&self, id: u32) -> bool {
        let n = self.len.load(Ordering::Relaxed);
        if n == self.ids.len() {
            return false;
        }
        self.ids[n].store(id, Ordering::Relaxed);
        self.len.store(n + 1, Ordering::Release);
        true
    }

    /// Ids published so far.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `k`-th id; only for `k < len()` as last observed.
    pub fn get(&self, k: usize) -> u32 {
        self.ids[k].load(Ordering::Relaxed)
    }

    /// Empties the log; the writer must be quiet (nothing of this log in flight).
    pub fn clear(&self) {
        self.len.store(0, Ordering::Release);
    }
}

/// Retries of one read (EINTR/EAGAIN, no progress) before it is failed.
const MAX_RETRIES: u32 = 16;

struct InFlight {
    /// Aligned start and end of the read in the file.
    start: u64,
    end: u64,
    /// Bytes of the buffer filled so far (from `start`).
    done: u64,
    /// Where the outstanding backend op starts, relative to `start`.
    pos: u64,
    /// End of the last requested byte, relative to `start`.
    needed: u64,
    retries: u32,
    members: Vec<Request>,
    /// When the read was first submitted, and the queue depth then.
    issued: Instant,
    depth: u32,
}

impl InFlight {
    fn span(&self) -> u64 {
        self.end - self.start
    }
}

/// The I/O engine over one file.
pub struct IoEngine {
    path: PathBuf,
    file: File,
    file_len: u64,
    direct: bool,
    cfg: IoConfig,
    backend: Box<dyn Backend>,
    pool: Arc<Pool>,
    pending: PendingQueue,
    /// Indexed by pool buffer; `Some` while that buffer's read is in flight.
    slots: Vec<Option<InFlight>>,
    spare_members: Vec<Vec<Request>>,
    in_flight: usize,
    bytes_in_flight: u64,
    /// Reads in flight while the last [`poll`](Self::poll) waited.
    polled_depth: usize,
    ready: VecDeque<std::result::Result<Completed, ReadFailure>>,
    flags: Option<Arc<ReadyFlags>>,
    latencies: Option<Arc<Mutex<LatencyLog>>>,
    results: Vec<ReadResult>,
    hint: usize,
    stats: IoStats,
}

static BUFFERED_WARNING: AtomicBool = AtomicBool::new(false);

fn open_file(path: &Path, cfg: &IoConfig) -> Result<(File, bool)> {
    if cfg.direct {
        match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            Ok(f) if direct_read_works(&f, cfg.alignment) => return Ok((f, true)),
            Ok(_) => warn_buffered(path, "O_DIRECT reads refused"),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => warn_buffered(path, "O_DIRECT open refused"),
            Err(e) => return Err(RuntimeError::io(path, e)),
        }
    }
    let f = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    Ok((f, false))
}

fn warn_buffered(path: &Path, why: &str) {
    if !BUFFERED_WARNING.swap(true, Ordering::Relaxed) {
        eprintln!("warning: {}: {why}; using buffered reads", path.display());
    }
}

/// Probes one aligned O_DIRECT read (some filesystems accept the flag at open
/// and refuse the reads).
fn direct_read_works(f: &File, align: usize) -> bool {
    if !align.is_power_of_two() {
        return false;
    }
    let buf = crate::aligned::AlignedBytes::zeroed(align, align);
    // A signal or a busy device must not demote the whole run to buffered reads.
    let mut n;
    let mut tries = 0;
    loop {
        // SAFETY: buf is valid for `align` bytes and nothing else touches it.
        n = unsafe { libc::pread(f.as_raw_fd(), buf.as_mut_ptr().cast(), align, 0) };
        let transient = n < 0
            && matches!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EINTR) | Some(libc::EAGAIN)
            );
        tries += 1;
        if !transient || tries == 8 {
            break;
        }
    }
    n >= 0
}

/// Makes the backend `kind` asks for, with the in-flight depth of `cfg`.
pub fn make_backend(cfg: &IoConfig) -> io::Result<Box<dyn Backend>> {
    // The ring has room for every pool buffer, so the depth can be raised later.
    let uring =
        || UringBackend::new(cfg.pool_buffers.max(cfg.max_in_flight) as u32).map(|b| Box::new(b) as Box<dyn Backend>);
    let pread = || PreadBackend::new(cfg.pread_threads).map(|b| Box::new(b) as Box<dyn Backend>);
    match cfg.backend {
        BackendKind::Uring => uring(),
        BackendKind::Pread => pread(),
        BackendKind::Auto => uring().or_else(|_| pread()),
    }
}

impl IoEngine {
    /// Opens `path` with the backend `cfg.backend` asks for.
    pub fn open(path: impl AsRef<Path>, cfg: IoConfig) -> Result<Self> {
        let backend = make_backend(&cfg).map_err(|e| RuntimeError::Invalid(format!("I/O backend: {e}")))?;
        Self::with_backend(path, cfg, backend)
    }

    /// Opens `path` with a given backend (e.g. a [`FaultyBackend`]).
    pub fn with_backend(path: impl AsRef<Path>, cfg: IoConfig, mut backend: Box<dyn Backend>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let a = cfg.alignment;
        if !a.is_power_of_two() || cfg.max_read_bytes < a || cfg.max_in_flight == 0 {
            return Err(RuntimeError::Invalid(format!(
                "I/O config: alignment {a} must be a power of two no larger than max_read_bytes {}, and max_in_flight > 0",
                cfg.max_read_bytes
            )));
        }
        let buf_size = cfg.max_read_bytes.div_ceil(a) * a;
        let pool_buffers = cfg.pool_buffers.max(cfg.max_in_flight);
        let (file, direct) = open_file(&path, &cfg)?;
        let file_len = file.metadata().map_err(|e| RuntimeError::io(&path, e))?.len();
        let pool = Pool::new(pool_buffers, buf_size, a);
        // SAFETY: the pool's one allocation outlives the backend: the engine
        // holds an `Arc` of it and drops the backend first (field order).
        unsafe { backend.register_buffers(pool.ptr(0), pool_buffers, buf_size) };
        Ok(Self {
            path,
            file,
            file_len,
            direct,
            cfg: IoConfig {
                max_read_bytes: buf_size,
                pool_buffers,
                ..cfg
            },
            backend,
            slots: (0..pool_buffers).map(|_| None).collect(),
            spare_members: Vec::new(),
            pool,
            pending: PendingQueue::default(),
            in_flight: 0,
            bytes_in_flight: 0,
            polled_depth: 0,
            ready: VecDeque::new(),
            flags: None,
            latencies: None,
            results: Vec::new(),
            hint: 0,
            stats: IoStats::default(),
        })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    pub fn stats(&self) -> IoStats {
        self.stats
    }

    pub fn config(&self) -> &IoConfig {
        &self.cfg
    }

    /// Sets `flags` for each request as it completes (ids must be < `flags.len()`).
    /// Records each finished read's latency (submission to completion) into `log`.
    pub fn set_latency_log(&mut self, log: Arc<Mutex<LatencyLog>>) {
        self.latencies = Some(log);
    }

    pub fn set_ready_flags(&mut self, flags: Arc<ReadyFlags>) {
        self.flags = Some(flags);
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Reads that were in flight while the last [`poll`](Self::poll)
    /// waited for completions (what the device was working on).
    pub fn polled_depth(&self) -> usize {
        self.polled_depth
    }

    /// Sets the reads (1 to the pool's buffers) and bytes (0: no limit) in
    /// flight at once; takes effect at the next submission.
    pub fn set_depth(&mut self, reads: usize, bytes: u64) {
        self.cfg.max_in_flight = reads.clamp(1, self.pool.count());
        self.cfg.max_bytes_in_flight = bytes;
    }

    /// Work is pending but cannot start: nothing is in flight or ready and
    /// every pool buffer is held by completed reads (the caller must free one).
    pub fn is_stalled(&self) -> bool {
        self.in_flight == 0 && self.ready.is_empty() && !self.pending.is_empty() && self.pool.free_count() == 0
    }

    /// Calls `f` whenever a holder of a completed read frees its buffer.
    pub fn on_buffer_free(&self, f: impl Fn() + Send + Sync + 'static) {
        self.pool.set_on_free(Box::new(f));
    }

    /// Nothing pending, in flight, or waiting to be popped.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty() && self.in_flight == 0 && self.ready.is_empty()
    }

    /// Queues a request. Fails if it lies outside the file, is empty, spans more
    /// than one buffer, or its id is already pending.
    pub fn enqueue(&mut self, r: Request) -> Result<()> {
        let a = self.cfg.alignment as u64;
        let span = (r.offset + r.len as u64).div_ceil(a) * a - align_down(r.offset, a);
        if r.len == 0 || r.offset + r.len as u64 > self.file_len || span > self.cfg.max_read_bytes as u64 {
            return Err(RuntimeError::Invalid(format!(
                "{}: request {} ({} bytes at offset {}) is empty, past the end ({} bytes) or larger than a read buffer ({} bytes)",
                self.path.display(),
                r.id,
                r.len,
                r.offset,
                self.file_len,
                self.cfg.max_read_bytes
            )));
        }
        if self.pending.contains_id(r.id) {
            return Err(RuntimeError::Invalid(format!("request id {} is already pending", r.id)));
        }
        self.pending.push(r);
        Ok(())
    }

    /// Removes a request not yet submitted; returns whether it was. A request
    /// already submitted completes normally.
    pub fn cancel(&mut self, id: u32) -> bool {
        let c = self.pending.cancel(id);
        self.stats.requests_cancelled += c as u64;
        c
    }

    /// Submits the most urgent pending work (coalesced, up to the in-flight
    /// limit and while buffers are free) and reaps completions. With `wait`,
    /// blocks until at least one read completes if any is in flight and
    /// nothing is ready yet. Returns the number of results ready to `pop`.
    pub fn poll(&mut self, wait: bool) -> Result<usize> {
        self.submit()?;
        self.polled_depth = self.in_flight;
        if self.in_flight > 0 {
            let min = usize::from(wait && self.ready.is_empty());
            let mut results = std::mem::take(&mut self.results);
            results.clear();
            let r = self.backend.complete(min, &mut results);
            if let Err(e) = r {
                self.results = results;
                return Err(RuntimeError::io(&self.path, e));
            }
            for &res in &results {
                self.on_result(res)?;
            }
            self.results = results;
            // Resubmissions and freed slots: keep the queue full.
            self.submit()?;
        }
        Ok(self.ready.len())
    }

    /// The next finished request, in completion order.
    pub fn pop(&mut self) -> Option<std::result::Result<Completed, ReadFailure>> {
        self.ready.pop_front()
    }

    /// Drives the engine until a result is ready and returns it; `Ok(None)`
    /// once idle. Errs if pending work cannot start because the caller holds
    /// every pool buffer.
    pub fn wait_next(&mut self) -> Result<Option<std::result::Result<Completed, ReadFailure>>> {
        loop {
            if let Some(r) = self.pop() {
                return Ok(Some(r));
            }
            if self.is_idle() {
                return Ok(None);
            }
            self.poll(true)?;
            if self.ready.is_empty() && self.in_flight == 0 && self.pool.free_count() == 0 {
                return Err(RuntimeError::Invalid(format!(
                    "I/O buffer pool exhausted: all {} buffers are held by completed reads",
                    self.pool.count()
                )));
            }
        }
    }

    fn limits(&self) -> CoalesceLimits {
        CoalesceLimits {
            align: self.cfg.alignment as u64,
            max_read_bytes: self.cfg.max_read_bytes as u64,
            max_gap: self.cfg.max_gap,
            max_amplification: self.cfg.max_amplification,
        }
    }

    fn submit(&mut self) -> Result<()> {
        let lim = self.limits();
        let byte_cap = self.cfg.max_bytes_in_flight;
        while self.in_flight < self.cfg.max_in_flight
            && !self.pending.is_empty()
            && (byte_cap == 0 || self.in_flight == 0 || self.bytes_in_flight < byte_cap)
        {
            let Some(buf) = self.pool.claim(self.hint) else { break };
            self.hint = (buf + 1) % self.pool.count();
            let mut members = self.spare_members.pop().unwrap_or_default();
            members.clear();
            let Some(g) = self.pending.take_group(&lim, &mut members) else {
                self.pool.set_refs(buf, 0);
                self.spare_members.push(members);
                break;
            };
            let needed = members.iter().map(|r| r.offset + r.len as u64).max().unwrap_or(g.end) - g.start;
            self.stats.reads_issued += 1;
            self.stats.bytes_requested += g.requested;
            self.slots[buf] = Some(InFlight {
                start: g.start,
                end: g.end,
                done: 0,
                pos: 0,
                needed,
                retries: 0,
                members,
                issued: Instant::now(),
                depth: self.cfg.max_in_flight as u32,
            });
            self.in_flight += 1;
            self.bytes_in_flight += g.end - g.start;
            self.issue(buf)?;
        }
        Ok(())
    }

    /// Sends the slot's read from its `pos` to its end.
    fn issue(&mut self, buf: usize) -> Result<()> {
        let s = self.slots[buf].as_ref().expect("slot in flight");
        let op = ReadOp {
            tag: buf as u64,
            fd: self.file.as_raw_fd(),
            // SAFETY: pos < end - start <= buffer size.
            buf: unsafe { self.pool.ptr(buf).add(s.pos as usize) },
            len: (s.end - s.start - s.pos) as u32,
            offset: s.start + s.pos,
        };
        // SAFETY: the buffer is claimed (refs = 1) for this read and nobody
        // else touches it until its completion is reaped in `on_result`.
        unsafe { self.backend.submit(op) }.map_err(|e| self.read_error(op.offset, op.len as u64, e))
    }

    fn read_error(&self, offset: u64, len: u64, source: io::Error) -> RuntimeError {
        RuntimeError::Read {
            path: self.path.clone(),
            offset,
            len,
            source,
        }
    }

    fn on_result(&mut self, res: ReadResult) -> Result<()> {
        let buf = res.tag as usize;
        let direct = self.direct;
        let align = self.cfg.alignment as u64;
        let s = self
            .slots
            .get_mut(buf)
            .and_then(Option::as_mut)
            .ok_or_else(|| RuntimeError::Invalid(format!("I/O backend returned an unknown tag {}", res.tag)))?;
        if res.result < 0 {
            let errno = -res.result;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && s.retries < MAX_RETRIES {
                s.retries += 1;
                self.stats.resubmits += 1;
                return self.issue(buf);
            }
            self.fail(buf, io::Error::from_raw_os_error(errno));
            return Ok(());
        }
        let n = res.result as u64;
        self.stats.bytes_read += n;
        let len = s.end - s.start - s.pos;
        s.done = s.done.max(s.pos + n);
        if s.done >= s.needed {
            self.finish(buf);
            return Ok(());
        }
        if n == 0 {
            self.fail(buf, io::Error::from(io::ErrorKind::UnexpectedEof));
            return Ok(());
        }
        // Short read: ask again for the remainder (from an aligned position
        // under O_DIRECT).
        if n < len {
            self.stats.short_reads += 1;
        }
        let next = if direct { align_down(s.done, align) } else { s.done };
        if next <= s.pos {
            s.retries += 1;
            if s.retries > MAX_RETRIES {
                self.fail(buf, io::Error::from(io::ErrorKind::UnexpectedEof));
                return Ok(());
            }
        }
        s.pos = next;
        self.stats.resubmits += 1;
        self.issue(buf)
    }

    fn finish(&mut self, buf: usize) {
        let s = self.slots[buf].take().expect("slot in flight");
        if let Some(log) = &self.latencies {
            let us = s.issued.elapsed().as_secs_f64() * 1e6;
            log.lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(s.depth, us as f32, s.span() as u32);
        }
        self.in_flight -= 1;
        self.bytes_in_flight -= s.span();
        self.pool.set_refs(buf, s.members.len() as u32);
        for r in &s.members {
            self.stats.requests_completed += 1;
            self.ready.push_back(Ok(Completed {
                id: r.id,
                pool: Arc::clone(&self.pool),
                buf,
                start: (r.offset - s.start) as usize,
                len: r.len as usize,
            }));
            if let Some(f) = &self.flags {
                f.set(r.id);
            }
        }
        self.spare_members.push(s.members);
    }

    fn fail(&mut self, buf: usize, source: io::Error) {
        let s = self.slots[buf].take().expect("slot in flight");
        self.in_flight -= 1;
        self.bytes_in_flight -= s.span();
        self.pool.set_refs(buf, 0);
        for r in &s.members {
            self.stats.requests_failed += 1;
            // io::Error is not Clone: every member gets its own, same errno.
            let source = match source.raw_os_error() {
                Some(errno) => io::Error::from_raw_os_error(errno),
                None => io::Error::new(source.kind(), source.to_string()),
            };
            let error = self.read_error(r.offset, r.len as u64, source);
            self.ready.push_back(Err(ReadFailure { id: r.id, error }));
        }
        self.spare_members.push(s.members);
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        // Reads still in flight write into the pool: wait for them before the
        // pool (and the file) can go.
        let mut out = Vec::new();
        while self.in_flight > 0 {
            out.clear();
            if self.backend.complete(1, &mut out).is_err() {
                // The backend is broken; leak the pool rather than free memory
                // the kernel may still write.
                std::mem::forget(Arc::clone(&self.pool));
                return;
            }
            for r in &out {
                if let Some(slot) = self.slots.get_mut(r.tag as usize) {
                    if slot.take().is_some() {
                        self.in_flight -= 1;
                        self.pool.set_refs(r.tag as usize, 0);
                    }
                }
            }
        }
    }
}
