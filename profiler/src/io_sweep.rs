//! The I/O sweep: per-request read latency and throughput with O_DIRECT,
//! through io_uring or a pool of `pread` threads, over request size, queue
//! depth, workers and access pattern.
//!
//! This does not use the runtime's `IoEngine`: that engine coalesces
//! neighbouring requests and does not time individual reads, and a profile
//! needs exactly one device read per request and a latency per request. The
//! loop here is the plain form: each worker keeps `queue_depth` reads in
//! flight, stamps each at submission and at reaping.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use leanstream_runtime::aligned::AlignedBytes;
use leanstream_runtime::flash::format::LsFlash;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::device;
use crate::plan::{Condition, ConditionKind, Engine, IoCondition, Pattern};
use crate::runner::{unix_ns, Executor, Measured, Sample};
use crate::{ProfileError, Result};

/// Alignment of offsets, lengths and buffers for O_DIRECT.
pub const ALIGN: u64 = 4096;

/// Settings of an I/O run (stored in the plan).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IoSetup {
    /// The data file the synthetic patterns read.
    pub file: PathBuf,
    pub file_size: u64,
    /// The packed model whose bundle read sets `replay` reads.
    pub lsflash: Option<PathBuf>,
    /// Fraction of a layer's neurons in one replayed read set.
    pub replay_fraction: f64,
}

/// A page-aligned, zeroed heap buffer of `len` bytes (at least a page) for O_DIRECT.
fn aligned_buf(len: usize) -> AlignedBytes {
    AlignedBytes::zeroed(len.max(ALIGN as usize), ALIGN as usize)
}

/// Opens `path` for O_DIRECT reads, or says why it cannot be.
pub fn open_direct(path: &Path) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| {
            ProfileError::io(
                path,
                std::io::Error::new(e.kind(), format!("O_DIRECT open failed ({e}); tmpfs refuses O_DIRECT")),
            )
        })?;
    // Some filesystems accept the flag and refuse the read.
    let mut b = aligned_buf(ALIGN as usize);
    f.read_at(&mut b.as_mut_slice()[..ALIGN as usize], 0).map_err(|e| {
        ProfileError::io(
            path,
            std::io::Error::new(e.kind(), format!("O_DIRECT read failed: {e}")),
        )
    })?;
    Ok(f)
}

/// Creates (or reuses, when its size matches) the data file `dir/leanstream-profile.dat`,
/// filled with incompressible bytes, synced and dropped from the page cache.
pub fn prepare_file(dir: &Path, size: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| ProfileError::io(dir, e))?;
    let path = dir.join("leanstream-profile.dat");
    let size = size / ALIGN * ALIGN;
    if std::fs::metadata(&path).map(|m| m.len() == size).unwrap_or(false) {
        return Ok(path);
    }
    let mut f = File::create(&path).map_err(|e| ProfileError::io(&path, e))?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut chunk = vec![0u8; 4 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        rng.fill(&mut chunk[..n]);
        f.write_all(&chunk[..n]).map_err(|e| ProfileError::io(&path, e))?;
        left -= n as u64;
    }
    f.sync_all().map_err(|e| ProfileError::io(&path, e))?;
    // SAFETY: plain syscall on an open fd.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(path)
}

/// One read: offset and length (both aligned).
type Req = (u64, u32);

/// A completed read: index into the request list, latency, completion time.
struct Done {
    req: usize,
    /// Bytes read (less than requested only at the end of the file).
    bytes: u32,
    latency_ns: u64,
    unix_ns: u64,
}

struct WorkerOut {
    done: Vec<Done>,
    start: Instant,
    end: Instant,
}

/// Keeps `qd` reads of `reqs` in flight through one io_uring until all are
/// done, `deadline` passes or `stop` is set (in-flight reads are drained).
#[allow(clippy::too_many_arguments)]
fn uring_worker(
    fd: RawFd,
    file_len: u64,
    reqs: &[Req],
    qd: usize,
    deadline: Instant,
    stop: &AtomicBool,
    barrier: &Barrier,
) -> Result<WorkerOut> {
    let max_len = reqs.iter().map(|r| r.1).max().unwrap_or(ALIGN as u32) as usize;
    let mut ring = IoUring::new((qd as u32).max(2).next_power_of_two())?;
    let bufs: Vec<AlignedBytes> = (0..qd).map(|_| aligned_buf(max_len)).collect();
    let mut free: Vec<usize> = (0..qd).rev().collect();
    // Per slot: (request index, submit time).
    let mut slot_req = vec![(0usize, Instant::now()); qd];
    let mut done = Vec::with_capacity(reqs.len());
    let mut next = 0;
    let mut in_flight = 0;
    barrier.wait();
    let start = Instant::now();
    loop {
        let stopping = stop.load(Ordering::Relaxed) || Instant::now() >= deadline;
        while !stopping && next < reqs.len() {
            let Some(slot) = free.pop() else { break };
            let (off, len) = reqs[next];
            let sqe = opcode::Read::new(types::Fd(fd), bufs[slot].as_mut_ptr(), len)
                .offset(off)
                .build()
                .user_data(slot as u64);
            slot_req[slot] = (next, Instant::now());
            // SAFETY: the buffer lives until its completion is reaped below.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                free.push(slot);
                break;
            }
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EAGAIN) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        let now = Instant::now();
        let wall = unix_ns();
        for cqe in ring.completion() {
            let slot = cqe.user_data() as usize;
            let (req, t0) = slot_req[slot];
            free.push(slot);
            in_flight -= 1;
            let res = cqe.result();
            if res < 0 {
                return Err(ProfileError::Read(
                    "io_uring".into(),
                    format!(
                        "offset {} len {}: {}",
                        reqs[req].0,
                        reqs[req].1,
                        std::io::Error::from_raw_os_error(-res)
                    ),
                ));
            }
            if res as u32 != reqs[req].1 && reqs[req].0 + res as u64 != file_len {
                return Err(ProfileError::Read(
                    "io_uring".into(),
                    format!("short read at offset {}: {} of {} bytes", reqs[req].0, res, reqs[req].1),
                ));
            }
            done.push(Done {
                req,
                bytes: res as u32,
                latency_ns: now.duration_since(t0).as_nanos() as u64,
                unix_ns: wall,
            });
        }
    }
    Ok(WorkerOut {
        done,
        start,
        end: Instant::now(),
    })
}

/// `qd` threads issuing blocking `pread`s of `reqs` (a shared cursor).
fn pread_worker(
    file: &File,
    file_len: u64,
    reqs: &[Req],
    qd: usize,
    deadline: Instant,
    stop: &AtomicBool,
    barrier: &Barrier,
) -> Result<WorkerOut> {
    let max_len = reqs.iter().map(|r| r.1).max().unwrap_or(ALIGN as u32) as usize;
    let cursor = AtomicUsize::new(0);
    let inner = Barrier::new(qd + 1);
    let (outs, start) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..qd)
            .map(|_| {
                let (cursor, inner) = (&cursor, &inner);
                s.spawn(move || -> Result<Vec<Done>> {
                    let mut buf = aligned_buf(max_len);
                    let mut done = Vec::new();
                    inner.wait();
                    loop {
                        if stop.load(Ordering::Relaxed) || Instant::now() >= deadline {
                            break;
                        }
                        let i = cursor.fetch_add(1, Ordering::Relaxed);
                        let Some(&(off, len)) = reqs.get(i) else { break };
                        let t0 = Instant::now();
                        let got = loop {
                            match file.read_at(&mut buf.as_mut_slice()[..len as usize], off) {
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                                r => break r,
                            }
                        }
                        .map_err(|e| ProfileError::Read("pread".into(), format!("offset {off} len {len}: {e}")))?;
                        let lat = t0.elapsed().as_nanos() as u64;
                        if got != len as usize && off + got as u64 != file_len {
                            return Err(ProfileError::Read(
                                "pread".into(),
                                format!("short read at offset {off}: {got} of {len} bytes"),
                            ));
                        }
                        done.push(Done {
                            req: i,
                            bytes: got as u32,
                            latency_ns: lat,
                            unix_ns: unix_ns(),
                        });
                    }
                    Ok(done)
                })
            })
            .collect();
        barrier.wait();
        inner.wait();
        let start = Instant::now();
        let outs: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("pread thread panicked"))
            .collect();
        (outs, start)
    });
    let mut done = Vec::new();
    for o in outs {
        done.extend(o?);
    }
    done.sort_by_key(|d| d.unix_ns);
    Ok(WorkerOut {
        done,
        start,
        end: Instant::now(),
    })
}

/// Offsets of `n` requests of one worker.
fn synthetic_requests(pattern: Pattern, bs: u64, file_size: u64, n: usize, rng: &mut StdRng) -> Vec<Req> {
    let blocks = (file_size / bs).max(1);
    match pattern {
        Pattern::Random => (0..n).map(|_| (rng.random_range(0..blocks) * bs, bs as u32)).collect(),
        Pattern::Sequential | Pattern::Strided => {
            let step = if pattern == Pattern::Strided { 4 } else { 1 };
            let start = rng.random_range(0..blocks);
            (0..n as u64)
                .map(|k| (((start + k * step) % blocks) * bs, bs as u32))
                .collect()
        }
        Pattern::Replay => unreachable!("replay requests come from the .lsflash file"),
    }
}

/// A read set of the streaming engine: a random `fraction` of a random
/// layer's neurons, as aligned bundle extents in file order; repeated with
/// fresh sets until `n` requests.
fn replay_requests(flash: &LsFlash, fraction: f64, n: usize, rng: &mut StdRng) -> Vec<Req> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let layer = rng.random_range(0..flash.n_layer());
        let mut ids: Vec<usize> = (0..flash.n_ff()).collect();
        ids.shuffle(rng);
        ids.truncate(((flash.n_ff() as f64 * fraction).ceil() as usize).max(1));
        let mut set: Vec<Req> = ids
            .iter()
            .map(|&i| {
                let (off, len) = flash.bundle_extent(layer, i);
                let start = off / ALIGN * ALIGN;
                let end = (off + len as u64).div_ceil(ALIGN) * ALIGN;
                (start, (end - start) as u32)
            })
            .collect();
        set.sort_unstable();
        out.extend(set.into_iter().take(n - out.len()));
    }
    out
}

/// The aligned read size of a replayed bundle (for the condition's `block_size`).
pub fn replay_block_size(flash: &LsFlash) -> u64 {
    (flash.layout(0).bundle_bytes() as u64).div_ceil(ALIGN) * ALIGN
}

/// Runs I/O conditions.
pub struct IoExecutor {
    setup: IoSetup,
    data: File,
    replay: Option<(File, LsFlash)>,
    dev: Option<PathBuf>,
    rng: StdRng,
}

impl IoExecutor {
    pub fn new(setup: IoSetup, seed: u64) -> Result<Self> {
        let data = open_direct(&setup.file)?;
        let replay = match &setup.lsflash {
            Some(p) => Some((open_direct(p)?, LsFlash::open(p)?)),
            None => None,
        };
        Ok(Self {
            dev: device::block_device(&setup.file),
            setup,
            data,
            replay,
            rng: StdRng::seed_from_u64(seed ^ 0x10),
        })
    }

    fn run(&mut self, c: &IoCondition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        let workers = c.workers.max(1) as usize;
        // Exactly n requests in all: the first n % workers workers take one more.
        let count = |w: usize| n / workers + usize::from(w < n % workers);
        let (file, reqs): (&File, Vec<Vec<Req>>) = if c.pattern == Pattern::Replay {
            let Some((f, flash)) = &self.replay else {
                return Err(ProfileError::Invalid("replay pattern needs --lsflash FILE".into()));
            };
            let reqs = (0..workers)
                .map(|w| replay_requests(flash, self.setup.replay_fraction, count(w), &mut self.rng))
                .collect();
            (f, reqs)
        } else {
            let reqs = (0..workers)
                .map(|w| synthetic_requests(c.pattern, c.block_size, self.setup.file_size, count(w), &mut self.rng))
                .collect();
            (&self.data, reqs)
        };
        let qd = c.queue_depth.max(1) as usize;
        let file_len = file.metadata()?.len();
        let barrier = Barrier::new(workers);
        let dev_before = self.dev.as_deref().and_then(device::device_read_bytes);
        let outs: Vec<Result<WorkerOut>> = std::thread::scope(|s| {
            let handles: Vec<_> = reqs
                .iter()
                .map(|r| {
                    let barrier = &barrier;
                    s.spawn(move || match c.engine {
                        Engine::IoUring => uring_worker(file.as_raw_fd(), file_len, r, qd, deadline, stop, barrier),
                        Engine::Pread => pread_worker(file, file_len, r, qd, deadline, stop, barrier),
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("I/O worker panicked"))
                .collect()
        });
        let dev_after = self.dev.as_deref().and_then(device::device_read_bytes);
        let mut samples = Vec::new();
        let (mut start, mut end): (Option<Instant>, Option<Instant>) = (None, None);
        for (w, o) in outs.into_iter().enumerate() {
            let o = o?;
            start = Some(start.map_or(o.start, |s| s.min(o.start)));
            end = Some(end.map_or(o.end, |e| e.max(o.end)));
            for d in o.done {
                samples.push(Sample {
                    worker: w as u32,
                    offset: reqs[w][d.req].0,
                    bytes: u64::from(d.bytes),
                    latency_ns: d.latency_ns,
                    unix_ns: d.unix_ns,
                });
            }
        }
        samples.sort_by_key(|s| s.unix_ns);
        samples.truncate(n);
        let wall = match (start, end) {
            (Some(s), Some(e)) => e.duration_since(s),
            _ => Duration::ZERO,
        };
        Ok(Measured {
            samples,
            wall_ns: wall.as_nanos() as u64,
            device_read_bytes: match (dev_before, dev_after) {
                (Some(a), Some(b)) => Some(b.saturating_sub(a)),
                _ => None,
            },
        })
    }
}

impl Executor for IoExecutor {
    fn visit(&mut self, cond: &Condition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured> {
        match &cond.kind {
            ConditionKind::Io(c) => self.run(c, n, deadline, stop),
            ConditionKind::Compute(_) => Err(ProfileError::Invalid("compute condition in an I/O run".into())),
        }
    }
}

/// Random O_DIRECT reads of `bs` bytes at queue depth `qd` on `file` until
/// `stop` is set: the background load of the compute sweep. Returns bytes read.
pub fn background_reads(file: &File, file_size: u64, bs: u64, qd: usize, stop: &AtomicBool) -> Result<u64> {
    let mut rng = StdRng::seed_from_u64(0xb6);
    let mut total = 0;
    let barrier = Barrier::new(1);
    while !stop.load(Ordering::Relaxed) {
        let reqs = synthetic_requests(Pattern::Random, bs, file_size, 64, &mut rng);
        let far = Instant::now() + Duration::from_secs(3600);
        let out = uring_worker(file.as_raw_fd(), file_size, &reqs, qd, far, stop, &barrier)?;
        total += out.done.iter().map(|d| u64::from(d.bytes)).sum::<u64>();
    }
    Ok(total)
}
