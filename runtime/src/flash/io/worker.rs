//! The I/O engine on a thread of its own, so reads are submitted and reaped
//! while compute runs: the caller only posts commands (read, cancel, change
//! the depth) and never has to call in for the queue to move. Each finished
//! request goes to a [`Sink`] on the worker thread with its pool buffer
//! ([`Completed`]), which the sink holds for compute and publishes (see
//! [`ArrivalLog`](super::ArrivalLog)); the buffer returns to the pool when
//! the last holder drops it, so reads stop when compute falls behind by a
//! whole pool.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::{Completed, DepthLatency, IoConfig, IoEngine, IoStats, LatencyLog, Request};
use crate::{Result, RuntimeError};

/// What happened to one request, handed to the [`Sink`] on the worker thread.
pub enum Delivery {
    /// `data` holds the request's bytes (a share of a pool buffer); `dest` is
    /// what the command carried.
    Landed {
        id: u32,
        dest: u64,
        data: Completed,
    },
    Failed {
        id: u32,
        dest: u64,
        error: RuntimeError,
    },
    /// Cancelled before it was submitted: nothing was read.
    Cancelled {
        id: u32,
        dest: u64,
    },
}

/// Receives deliveries on the worker thread. It must not block for long: the
/// worker submits nothing while it runs.
pub trait Sink: Send + 'static {
    fn deliver(&mut self, d: Delivery);
}

enum Cmd {
    Read(Request, u64),
    Cancel(u32),
    Depth { reads: usize, bytes: u64 },
}

#[derive(Default)]
struct Inbox {
    cmds: VecDeque<Cmd>,
    shutdown: bool,
}

struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    stats: Mutex<IoStats>,
    /// Nanoseconds with at least one read in flight, and the same time
    /// weighted by the reads in flight (their ratio: the mean depth the
    /// device saw while busy).
    busy_ns: AtomicU64,
    depth_ns: AtomicU64,
    latencies: Arc<Mutex<LatencyLog>>,
}

/// An [`IoEngine`] driven by a background thread.
pub struct IoWorker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    config: IoConfig,
    direct: bool,
    backend: String,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on the worker leaves plain data behind; keep going with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl IoWorker {
    /// Moves `engine` onto a new thread that feeds `sink`.
    pub fn spawn(mut engine: IoEngine, sink: impl Sink) -> Result<Self> {
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            wake: Condvar::new(),
            stats: Mutex::new(IoStats::default()),
            busy_ns: AtomicU64::new(0),
            depth_ns: AtomicU64::new(0),
            latencies: Arc::new(Mutex::new(LatencyLog::default())),
        });
        engine.set_latency_log(Arc::clone(&shared.latencies));
        let (config, direct, backend) = (engine.config().clone(), engine.is_direct(), engine.backend_name());
        // A buffer freed by compute may unblock a stalled queue.
        let woken = Arc::clone(&shared);
        engine.on_buffer_free(move || {
            let _inbox = lock(&woken.inbox);
            woken.wake.notify_one();
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("leanstream-io".into())
            .spawn(move || run(engine, sink, &s))
            .map_err(|e| RuntimeError::Invalid(format!("starting the I/O thread: {e}")))?;
        Ok(Self {
            shared,
            thread: Some(thread),
            config,
            direct,
            backend,
        })
    }

    fn post(&self, cmds: impl IntoIterator<Item = Cmd>) {
        lock(&self.shared.inbox).cmds.extend(cmds);
        self.shared.wake.notify_one();
    }

    /// Queues reads; `dest` travels with each to its delivery.
    pub fn read(&self, reads: impl IntoIterator<Item = (Request, u64)>) {
        self.post(reads.into_iter().map(|(r, d)| Cmd::Read(r, d)));
    }

    /// Cancels requests not yet submitted (each then delivers `Cancelled`;
    /// one already submitted lands or fails as usual).
    pub fn cancel(&self, ids: impl IntoIterator<Item = u32>) {
        self.post(ids.into_iter().map(Cmd::Cancel));
    }

    /// Sets the reads and bytes in flight at once (the controller's queue
    /// depth); `bytes` 0 means no byte limit.
    pub fn set_depth(&self, reads: usize, bytes: u64) {
        self.post([Cmd::Depth { reads, bytes }]);
    }

    pub fn stats(&self) -> IoStats {
        *lock(&self.shared.stats)
    }

    /// Latencies of the reads finished so far, per queue depth.
    pub fn latencies(&self) -> Vec<DepthLatency> {
        lock(&self.shared.latencies).summary()
    }

    /// Seconds with at least one read in flight, since the start.
    pub fn busy_seconds(&self) -> f64 {
        self.shared.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Reads in flight on average while busy (0 before any read).
    pub fn mean_depth(&self) -> f64 {
        let busy = self.shared.busy_ns.load(Ordering::Relaxed);
        if busy == 0 {
            return 0.0;
        }
        self.shared.depth_ns.load(Ordering::Relaxed) as f64 / busy as f64
    }

    pub fn config(&self) -> &IoConfig {
        &self.config
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn backend_name(&self) -> &str {
        &self.backend
    }
}

impl Drop for IoWorker {
    fn drop(&mut self) {
        lock(&self.shared.inbox).shutdown = true;
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut io: IoEngine, mut sink: impl Sink, shared: &Shared) {
    let mut dest: HashMap<u32, u64> = HashMap::new();
    let mut busy_since: Option<Instant> = None;
    let mut cmds = VecDeque::new();
    loop {
        {
            let mut inbox = lock(&shared.inbox);
            // Asleep when there is nothing to do, or nothing that can start
            // until compute frees a pool buffer (checked under the inbox lock,
            // which the freeing side takes before it wakes us).
            while inbox.cmds.is_empty() && !inbox.shutdown && (io.is_idle() || io.is_stalled()) {
                inbox = shared.wake.wait(inbox).unwrap_or_else(|e| e.into_inner());
            }
            if inbox.shutdown {
                return;
            }
            std::mem::swap(&mut cmds, &mut inbox.cmds);
        }
        for cmd in cmds.drain(..) {
            match cmd {
                Cmd::Read(r, d) => match io.enqueue(r) {
                    Ok(()) => {
                        dest.insert(r.id, d);
                    }
                    Err(error) => sink.deliver(Delivery::Failed {
                        id: r.id,
                        dest: d,
                        error,
                    }),
                },
                Cmd::Cancel(id) => {
                    if io.cancel(id) {
                        let d = dest.remove(&id).unwrap_or(0);
                        sink.deliver(Delivery::Cancelled { id, dest: d });
                    }
                }
                Cmd::Depth { reads, bytes } => io.set_depth(reads, bytes),
            }
        }
        if io.is_idle() || io.is_stalled() {
            continue;
        }
        if busy_since.is_none() {
            busy_since = Some(Instant::now());
        }
        let polled = io.poll(true);
        let depth = io.polled_depth() as u64;
        if let Err(e) = polled {
            // The backend itself broke: every outstanding request fails with its error.
            let msg = e.to_string();
            for (id, d) in dest.drain() {
                let error = RuntimeError::Invalid(format!("I/O engine: {msg}"));
                sink.deliver(Delivery::Failed { id, dest: d, error });
            }
            *lock(&shared.stats) = io.stats();
            let mut inbox = lock(&shared.inbox);
            while !inbox.shutdown {
                // Refuse further reads the same way until dropped.
                for cmd in inbox.cmds.drain(..) {
                    if let Cmd::Read(r, d) = cmd {
                        let error = RuntimeError::Invalid(format!("I/O engine: {msg}"));
                        sink.deliver(Delivery::Failed {
                            id: r.id,
                            dest: d,
                            error,
                        });
                    }
                }
                inbox = shared.wake.wait(inbox).unwrap_or_else(|e| e.into_inner());
            }
            return;
        }
        // Published before the deliveries, so whoever has a run in hand sees
        // its bytes counted.
        *lock(&shared.stats) = io.stats();
        while let Some(r) = io.pop() {
            match r {
                Ok(c) => {
                    let d = dest.remove(&c.id).unwrap_or(0);
                    sink.deliver(Delivery::Landed {
                        id: c.id,
                        dest: d,
                        data: c,
                    });
                }
                Err(f) => {
                    let d = dest.remove(&f.id).unwrap_or(0);
                    sink.deliver(Delivery::Failed {
                        id: f.id,
                        dest: d,
                        error: f.error,
                    });
                }
            }
        }
        // Busy time is counted as it passes, not only when the queue runs
        // dry: a streamer that keeps layers queued ahead may never let it.
        if let Some(t) = busy_since.take() {
            let now = Instant::now();
            let ns = (now - t).as_nanos() as u64;
            shared.busy_ns.fetch_add(ns, Ordering::Relaxed);
            shared.depth_ns.fetch_add(depth * ns, Ordering::Relaxed);
            if io.in_flight() > 0 {
                busy_since = Some(now);
            }
        }
        *lock(&shared.stats) = io.stats();
    }
}
