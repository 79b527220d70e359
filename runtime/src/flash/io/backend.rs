//! The backend contract: explicit submit and complete of tagged reads, in the
//! style of io_uring. The engine owns the buffers and the file; a backend only
//! moves bytes.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::RawFd;

/// One positional read handed to a backend.
///
/// `buf` points into the engine's buffer pool and stays valid and untouched by
/// anyone else until the backend has reported the completion with this `tag`.
#[derive(Debug, Clone, Copy)]
pub struct ReadOp {
    /// The engine's tag, returned unchanged in the completion.
    pub tag: u64,
    pub fd: RawFd,
    pub buf: *mut u8,
    pub len: u32,
    pub offset: u64,
}

// SAFETY: a `ReadOp` is a description of a read into memory the engine has lent
// exclusively to the backend until completion; moving it to a worker thread is
// what the pread backend is for.
unsafe impl Send for ReadOp {}

/// The outcome of one `ReadOp`: bytes read (>= 0) or a negated errno, as a CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadResult {
    pub tag: u64,
    pub result: i32,
}

/// A read backend. One engine drives one backend from one thread.
pub trait Backend: Send {
    /// A short name for reports ("io_uring", "pread×4", ...).
    fn name(&self) -> String;

    /// Queues a read. It may reach the kernel only at the next `complete`.
    ///
    /// # Safety
    /// `op.buf` must be valid for writes of `op.len` bytes, and must not be read
    /// or written by anyone else, until the completion tagged `op.tag` has been
    /// returned by `complete`.
    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()>;

    /// Offers the engine's read buffers, `count` of `size` bytes from `base`,
    /// to be registered with the kernel once, so that reads into them need
    /// not pin their pages one read at a time. Returns whether it did; the
    /// engine then promises that every `ReadOp` lies inside buffer `tag`.
    ///
    /// # Safety
    /// The memory must stay valid, and not move, for as long as the backend lives.
    unsafe fn register_buffers(&mut self, base: *mut u8, count: usize, size: usize) -> bool {
        let _ = (base, count, size);
        false
    }

    /// Sends queued reads on, waits until at least `min` completions are
    /// available (`min` never exceeds the reads outstanding), and appends every
    /// available completion to `out`.
    fn complete(&mut self, min: usize, out: &mut Vec<ReadResult>) -> io::Result<()>;
}

/// A fault to inject into one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with this errno without touching the file.
    Errno(i32),
    /// The read succeeds but reports at most this many bytes.
    Short(u32),
    /// The read succeeds, but its completion is held back until this long
    /// after it was submitted (a device that stalls).
    Stall(std::time::Duration),
}

/// A test hook: wraps a backend and injects faults into chosen reads.
///
/// Reads are counted from 0 in submission order, resubmissions included, so
/// `(0, Fault::Errno(libc::EIO))` fails the very first read the engine issues.
pub struct FaultyBackend {
    inner: Box<dyn Backend>,
    faults: HashMap<u64, Fault>,
    submitted: u64,
    injected: VecDeque<ReadResult>,
    shorten: HashMap<u64, u32>,
    shuffle: Option<Shuffle>,
    /// Tags of stalled reads and when their completions may be handed out.
    stall_until: HashMap<u64, std::time::Instant>,
    /// Completions of stalled reads, held until then.
    stalled: Vec<(std::time::Instant, ReadResult)>,
    /// Where each submitted read's file offset is appended, in submission order.
    log: Option<std::sync::Arc<std::sync::Mutex<Vec<u64>>>>,
}

/// Completions held back and handed out in a seeded random order, each
/// hand-out after a random delay: arrivals out of order and late.
struct Shuffle {
    state: u64,
    max_delay: std::time::Duration,
    held: Vec<ReadResult>,
}

impl Shuffle {
    fn next(&mut self) -> u64 {
        // SplitMix64: enough to scramble an order.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl FaultyBackend {
    pub fn new(inner: Box<dyn Backend>, faults: impl IntoIterator<Item = (u64, Fault)>) -> Self {
        Self {
            inner,
            faults: faults.into_iter().collect(),
            submitted: 0,
            injected: VecDeque::new(),
            shorten: HashMap::new(),
            shuffle: None,
            stall_until: HashMap::new(),
            stalled: Vec::new(),
            log: None,
        }
    }

    /// Also holds completions back and hands them out in an order drawn
    /// from `seed`, sleeping up to `max_delay` before each hand-out.
    pub fn shuffled(mut self, seed: u64, max_delay: std::time::Duration) -> Self {
        self.shuffle = Some(Shuffle {
            state: seed,
            max_delay,
            held: Vec::new(),
        });
        self
    }

    /// Also appends each submitted read's file offset to `log` (the order
    /// the engine issued its reads in).
    pub fn logging(mut self, log: std::sync::Arc<std::sync::Mutex<Vec<u64>>>) -> Self {
        self.log = Some(log);
        self
    }

    /// Reads submitted through this wrapper so far.
    pub fn submitted(&self) -> u64 {
        self.submitted
    }

    /// Hands out the held completions of stalled reads that are due.
    fn release_due(&mut self, out: &mut Vec<ReadResult>) {
        let now = std::time::Instant::now();
        let mut k = 0;
        while k < self.stalled.len() {
            if self.stalled[k].0 <= now {
                out.push(self.stalled.swap_remove(k).1);
            } else {
                k += 1;
            }
        }
    }

    /// Shortens the completions in `out[from..]` that a fault shortens, and
    /// moves those of stalled reads not yet due into `self.stalled`.
    fn apply_faults(&mut self, from: usize, out: &mut Vec<ReadResult>) {
        let now = std::time::Instant::now();
        let mut k = from;
        while k < out.len() {
            let r = &mut out[k];
            if let Some(cap) = self.shorten.remove(&r.tag) {
                if r.result > cap as i32 {
                    r.result = cap as i32;
                }
            }
            match self.stall_until.remove(&r.tag) {
                Some(t) if t > now => self.stalled.push((t, out.swap_remove(k))),
                _ => k += 1,
            }
        }
    }
}

impl Backend for FaultyBackend {
    fn name(&self) -> String {
        format!("faulty({})", self.inner.name())
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        let n = self.submitted;
        self.submitted += 1;
        if let Some(log) = &self.log {
            log.lock().unwrap_or_else(|e| e.into_inner()).push(op.offset);
        }
        match self.faults.get(&n) {
            Some(Fault::Errno(errno)) => {
                self.injected.push_back(ReadResult {
                    tag: op.tag,
                    result: -errno,
                });
                Ok(())
            }
            Some(Fault::Short(cap)) => {
                self.shorten.insert(op.tag, *cap);
                // SAFETY: forwarded unchanged under the caller's guarantee.
                unsafe { self.inner.submit(op) }
            }
            Some(Fault::Stall(d)) => {
                self.stall_until.insert(op.tag, std::time::Instant::now() + *d);
                // SAFETY: forwarded unchanged under the caller's guarantee.
                unsafe { self.inner.submit(op) }
            }
            None => {
                // SAFETY: forwarded unchanged under the caller's guarantee.
                unsafe { self.inner.submit(op) }
            }
        }
    }

    fn complete(&mut self, min: usize, out: &mut Vec<ReadResult>) -> io::Result<()> {
        let injected = self.injected.len();
        out.extend(self.injected.drain(..));
        let start = out.len();
        let need = min.saturating_sub(injected);
        let held = self.shuffle.as_ref().map_or(0, |s| s.held.len());
        self.inner
            .complete(need.saturating_sub(held + self.stalled.len()), out)?;
        self.apply_faults(start, out);
        self.release_due(out);
        // Stalled completions count towards `min` only once released: wait
        // for the earliest, or for the inner backend, until enough are out.
        while out.len() - start + held < need {
            match self.stalled.iter().map(|(t, _)| *t).min() {
                Some(t) => {
                    // Other reads land while one stalls, as on a device.
                    let from = out.len();
                    self.inner.complete(0, out)?;
                    self.apply_faults(from, out);
                    if out.len() - start + held < need {
                        let left = t.saturating_duration_since(std::time::Instant::now());
                        std::thread::sleep(left.min(std::time::Duration::from_micros(200)));
                    }
                    self.release_due(out);
                }
                None => {
                    let from = out.len();
                    self.inner.complete(1, out)?;
                    self.apply_faults(from, out);
                }
            }
        }
        if let Some(sh) = &mut self.shuffle {
            sh.held.extend(out.drain(start..));
            // Hand out at least what was asked for, and a random share more.
            let extra = (sh.next() % (sh.held.len() as u64 + 1)) as usize;
            let give = need.max(extra).min(sh.held.len());
            if give > 0 && !sh.max_delay.is_zero() {
                let nanos = sh.next() % sh.max_delay.as_nanos().max(1) as u64;
                std::thread::sleep(std::time::Duration::from_nanos(nanos));
            }
            for _ in 0..give {
                let k = (sh.next() % sh.held.len() as u64) as usize;
                out.push(sh.held.swap_remove(k));
            }
        }
        Ok(())
    }
}
