//! The I/O engine's own read throughput at one request size and queue
//! depth, random or sequential over a file: what `scripts/bench_io.sh` sets
//! against fio at the same settings, so the engine's overhead per request
//! shows as a ratio measured in one run.
//!
//! Coalescing is off (no gap, no amplification): one device read per
//! request, as fio issues them.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BackendKind, IoConfig, IoEngine, Request};
use crate::generate::sampler::Rng;
use crate::{Result, RuntimeError};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ReadBench {
    /// Bytes per request (a multiple of 4096).
    pub request_bytes: usize,
    /// Requests outstanding at once.
    pub depth: usize,
    pub duration: Duration,
    /// Front to back (wrapping) instead of uniformly random aligned offsets.
    pub sequential: bool,
    pub backend: BackendKind,
    pub seed: u64,
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
pub struct ReadBenchReport {
    pub request_bytes: usize,
    pub depth: usize,
    pub sequential: bool,
    pub backend: String,
    pub direct: bool,
    pub reads: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub bytes_per_s: f64,
    pub iops: f64,
}

/// Reads `path` for `b.duration` keeping `b.depth` requests outstanding.
pub fn read_benchmark(path: &Path, b: &ReadBench) -> Result<ReadBenchReport> {
    const ALIGN: usize = 4096;
    if b.request_bytes == 0 || !b.request_bytes.is_multiple_of(ALIGN) || b.depth == 0 {
        return Err(RuntimeError::Invalid(format!(
            "read benchmark: request size {} must be a positive multiple of {ALIGN} and depth {} positive",
            b.request_bytes, b.depth
        )));
    }
    let cfg = IoConfig {
        alignment: ALIGN,
        max_read_bytes: b.request_bytes,
        max_gap: 0,
        max_amplification: 1.0,
        max_in_flight: b.depth,
        max_bytes_in_flight: 0,
        // Completions are dropped as soon as they are popped.
        pool_buffers: b.depth + 1,
        pread_threads: b.depth.min(64),
        direct: true,
        backend: b.backend,
    };
    let mut io = IoEngine::open(path, cfg)?;
    let slots = io.file_len() / b.request_bytes as u64;
    if slots == 0 {
        return Err(RuntimeError::Invalid(format!(
            "{}: smaller than one {}-byte request",
            path.display(),
            b.request_bytes
        )));
    }
    // A fixed sequence of offsets for a seed.
    let mut rng = Rng::new(b.seed);
    let mut next_slot = 0u64;
    let mut offset = move || {
        let slot = if b.sequential {
            let s = next_slot;
            next_slot = (next_slot + 1) % slots;
            s
        } else {
            rng.next_u64() % slots
        };
        slot * b.request_bytes as u64
    };
    let mut id = 0u32;
    let mut enqueue = |io: &mut IoEngine| -> Result<()> {
        let r = Request {
            id,
            offset: offset(),
            len: b.request_bytes as u32,
            priority: 0,
        };
        id = id.wrapping_add(1);
        io.enqueue(r)
    };
    for _ in 0..b.depth {
        enqueue(&mut io)?;
    }
    let start = Instant::now();
    let (mut reads, mut bytes) = (0u64, 0u64);
    while start.elapsed() < b.duration {
        io.poll(true)?;
        while let Some(done) = io.pop() {
            let done = done.map_err(|f| f.error)?;
            reads += 1;
            bytes += done.data().len() as u64;
            drop(done);
            enqueue(&mut io)?;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    // Drain what is still outstanding (not counted).
    while io.wait_next()?.is_some() {}
    Ok(ReadBenchReport {
        request_bytes: b.request_bytes,
        depth: b.depth,
        sequential: b.sequential,
        backend: io.backend_name(),
        direct: io.is_direct(),
        reads,
        bytes,
        seconds,
        bytes_per_s: bytes as f64 / seconds,
        iops: reads as f64 / seconds,
    })
}
