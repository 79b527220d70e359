//! The run loop shared by every sweep: asks the [`Scheduler`] for the next
//! visit, lets an [`Executor`] measure it, buffers the samples and commits
//! them as a shard every `flush_interval_s`, shows progress, and on Ctrl-C
//! (SIGINT/SIGTERM) or when the plan is done flushes and returns.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use polars::prelude::*;

use crate::plan::{Clock, Condition, ConditionKind, Finish, Plan, Scheduler, WallClock};
use crate::shard::{SampleRow, ShardStore};
use crate::{device, ProfileError, Result};

/// One measured sample before it gets its index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub worker: u32,
    pub offset: u64,
    pub bytes: u64,
    pub latency_ns: u64,
    pub unix_ns: u64,
}

impl Sample {
    /// A sample of one call that touched `bytes`, taken now (worker 0, no offset).
    pub fn now(bytes: u64, latency_ns: u64) -> Self {
        Self {
            worker: 0,
            offset: 0,
            bytes,
            latency_ns,
            unix_ns: unix_ns(),
        }
    }
}

/// Nanoseconds since the Unix epoch now (0 if the clock is before it): a
/// sample's wall-clock stamp.
pub(crate) fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What one visit measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub samples: Vec<Sample>,
    /// Wall time of the visit's measured part (for throughput).
    pub wall_ns: u64,
    /// Bytes the block device served during the visit, when sysfs tells.
    pub device_read_bytes: Option<u64>,
}

/// Samples waiting for the next commit, column by column: the labels of a
/// visit are stored once, not once per row.
#[derive(Default)]
pub struct RowBuffer {
    visits: Vec<SampleRow>,
    visit: Vec<u32>,
    sample_idx: Vec<u64>,
    samples: Vec<Sample>,
}

impl RowBuffer {
    /// Appends a visit: `template` carries its labels and per-visit values.
    pub fn push_visit(&mut self, template: SampleRow, samples: &[Sample], indices: &[u64]) {
        let v = self.visits.len() as u32;
        self.visits.push(template);
        for (s, &idx) in samples.iter().zip(indices) {
            self.visit.push(v);
            self.sample_idx.push(idx);
            self.samples.push(*s);
        }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// The buffered rows with the trace schema ([`crate::shard::to_frame`]'s).
    pub fn to_frame(&self) -> Result<DataFrame> {
        let vis = |i: usize| &self.visits[self.visit[i] as usize];
        let n = self.len();
        macro_rules! per_visit {
            ($name:literal, $f:ident) => {
                Column::new(
                    $name.into(),
                    (0..n).map(|i| vis(i).$f.clone()).collect::<Vec<_>>(),
                )
            };
        }
        macro_rules! per_sample {
            ($name:literal, $f:ident) => {
                Column::new(
                    $name.into(),
                    self.samples.iter().map(|s| s.$f).collect::<Vec<_>>(),
                )
            };
        }
        let cols = vec![
            per_visit!("run_id", run_id),
            per_visit!("sweep", sweep),
            per_visit!("condition_id", condition_id),
            per_visit!("condition", condition),
            per_visit!("round", round),
            Column::new("sample_idx".into(), self.sample_idx.clone()),
            per_visit!("engine", engine),
            per_visit!("pattern", pattern),
            per_visit!("block_size", block_size),
            per_visit!("queue_depth", queue_depth),
            per_visit!("workers", workers),
            per_visit!("kernel", kernel),
            per_visit!("neurons", neurons),
            per_visit!("stages", stages),
            per_visit!("ctx_len", ctx_len),
            per_visit!("threads", threads),
            per_visit!("background_io", background_io),
            per_sample!("worker", worker),
            per_sample!("offset", offset),
            per_sample!("bytes", bytes),
            per_sample!("latency_ns", latency_ns),
            per_sample!("unix_ns", unix_ns),
            per_visit!("batch_wall_ns", batch_wall_ns),
            per_visit!("batch_bytes", batch_bytes),
            per_visit!("batch_samples", batch_samples),
            per_visit!("device_read_bytes", device_read_bytes),
            per_visit!("temp_c", temp_c),
        ];
        Ok(DataFrame::new(n, cols)?)
    }
}

/// Commit before the buffer grows past this many rows, whatever the interval.
pub const MAX_BUFFER_ROWS: usize = 1 << 20;

/// Measures visits of one sweep's conditions.
pub trait Executor {
    /// Up to `n` samples of `cond`; stops early (returning what it has) at
    /// `deadline` or when `stop` is set.
    fn visit(&mut self, cond: &Condition, n: usize, deadline: Instant, stop: &AtomicBool) -> Result<Measured>;
}

/// Set by SIGINT/SIGTERM.
pub static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if STOP.swap(true, Ordering::SeqCst) {
        // Second signal: leave now. Committed shards are safe; the buffer is
        // measured again on resume.
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

/// Installs the SIGINT/SIGTERM handler: the first signal sets [`STOP`] (the
/// run flushes and returns), a second one exits at once.
pub fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        // Restart interrupted syscalls: a pread in flight finishes normally.
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

/// Gives SIGINT and SIGTERM back their default action (after a sweep run
/// inside a longer job, whose other steps should stop on Ctrl-C at once).
pub fn reset_signal_handlers() {
    // SAFETY: plain sigaction calls restoring the default disposition.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
    }
}

/// How a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Finished(Finish),
    Interrupted,
}

/// Labels of a condition in its rows.
pub fn label(row: &mut SampleRow, c: &Condition) {
    row.condition_id = c.id;
    row.condition = c.key();
    match &c.kind {
        ConditionKind::Io(io) => {
            row.sweep = "io".into();
            row.engine = io.engine.name().into();
            row.pattern = io.pattern.name().into();
            row.block_size = io.block_size;
            row.queue_depth = io.queue_depth;
            row.workers = io.workers;
        }
        ConditionKind::Compute(k) => {
            row.sweep = "compute".into();
            row.engine = format!("cpu-{}", leanstream_kernels::Device::cpu_features());
            row.kernel = k.kernel.name().into();
            row.neurons = k.neurons;
            row.stages = k.stages;
            row.ctx_len = k.ctx_len;
            row.threads = k.threads;
            row.background_io = k.background_io;
        }
    }
}

/// Runs (or continues) the plan in `store`'s directory until it is done,
/// the budget is spent or [`STOP`] is set. `progress` draws a bar on stderr.
pub fn run(plan: &Plan, store: &mut ShardStore, exec: &mut dyn Executor, progress: bool) -> Result<Outcome> {
    let clock = WallClock::new();
    let mut sched = Scheduler::new(
        plan.clone(),
        if store.manifest.shards.is_empty() {
            0
        } else {
            store.manifest.last_round + 1
        },
        store.manifest.spent_s,
        clock.now_s(),
    );
    let (committed, _, _) = store.load_columns(Some(&["condition_id", "sample_idx", "latency_ns"]))?;
    restore(&mut sched, &committed)?;
    let run_id = store.manifest.run_id.clone();

    let bar = if progress {
        ProgressBar::with_draw_target(Some(1000), ProgressDrawTarget::stderr_with_hz(4))
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% ETA {eta_precise}  {msg}")
            .expect("static template"),
    );
    let mut buffer = RowBuffer::default();
    let mut last_flush = Instant::now();
    let flush_every = Duration::from_secs_f64(plan.flush_interval_s.max(0.0));
    let outcome = loop {
        if STOP.load(Ordering::SeqCst) {
            break Outcome::Interrupted;
        }
        let now = clock.now_s();
        let visit = match sched.next(now) {
            Ok(v) => v,
            Err(f) => break Outcome::Finished(f),
        };
        let cond = &plan.conditions[visit.cond];
        bar.set_message(format!("round {} · {}", visit.round, cond.key()));
        let deadline = Instant::now() + Duration::from_secs_f64((visit.deadline_s - now).max(0.0));
        let m = exec.visit(cond, visit.indices.len(), deadline, &STOP)?;
        let taken = m.samples.len().min(visit.indices.len());
        let temp = device::max_temperature();
        let bytes: u64 = m.samples[..taken].iter().map(|s| s.bytes).sum();
        let mut template = SampleRow {
            run_id: run_id.clone(),
            round: visit.round,
            batch_wall_ns: m.wall_ns,
            batch_bytes: bytes,
            batch_samples: taken as u32,
            device_read_bytes: m.device_read_bytes,
            temp_c: temp,
            ..Default::default()
        };
        label(&mut template, cond);
        buffer.push_visit(template, &m.samples[..taken], &visit.indices[..taken]);
        let recorded: Vec<(u64, f64)> = m.samples[..taken]
            .iter()
            .zip(&visit.indices)
            .map(|(s, &idx)| (idx, s.latency_ns as f64))
            .collect();
        sched.record(visit.cond, &recorded, m.wall_ns as f64 * 1e-9);
        update_bar(&bar, &sched, clock.now_s());
        if last_flush.elapsed() >= flush_every || buffer.len() >= MAX_BUFFER_ROWS {
            store.commit_frame(buffer.to_frame()?, sched.spent_s(clock.now_s()))?;
            buffer.clear();
            last_flush = Instant::now();
        }
    };
    store.commit_frame(buffer.to_frame()?, sched.spent_s(clock.now_s()))?;
    if let Outcome::Finished(f) = outcome {
        store.manifest.finished = Some(
            match f {
                Finish::Complete => "complete",
                Finish::Budget => "budget",
            }
            .into(),
        );
        store.write_manifest()?;
    }
    bar.finish_and_clear();
    Ok(outcome)
}

/// Progress as the larger of budget used and samples done (fixed plans).
fn update_bar(bar: &ProgressBar, sched: &Scheduler, now_s: f64) {
    let plan = sched.plan();
    let by_time = sched.spent_s(now_s) / plan.budget_s.max(1e-9);
    let n = plan.conditions.len().max(1) as f64;
    let by_done = (0..plan.conditions.len()).filter(|&i| sched.is_done(i)).count() as f64 / n;
    let by_samples = match plan.repetition {
        crate::plan::Repetition::Fixed { reps } => {
            sched.counts().iter().map(|&c| c.min(reps) as f64).sum::<f64>() / (n * reps.max(1) as f64)
        }
        crate::plan::Repetition::Adaptive { .. } => by_done,
    };
    bar.set_position((by_time.max(by_samples).min(1.0) * 1000.0) as u64);
}

/// Feeds committed samples back into the scheduler.
fn restore(sched: &mut Scheduler, df: &DataFrame) -> Result<()> {
    let ids = df.column("condition_id")?.u32()?;
    let idx = df.column("sample_idx")?.u64()?;
    let lat = df.column("latency_ns")?.u64()?;
    let n = sched.plan().conditions.len();
    for ((c, i), l) in ids.iter().zip(idx.iter()).zip(lat.iter()) {
        let (Some(c), Some(i), Some(l)) = (c, i, l) else {
            continue;
        };
        let pos = sched.plan().conditions.iter().position(|x| x.id == c);
        match pos {
            Some(p) if p < n => sched.restore(p, i, l as f64),
            _ => {
                return Err(ProfileError::Invalid(format!(
                    "committed sample of unknown condition {c}"
                )))
            }
        }
    }
    sched.refresh();
    Ok(())
}

/// Writes `plan.json` and the device record into a new run directory.
pub fn write_run_files(dir: &Path, plan: &Plan, target: &Path, session: u32) -> Result<()> {
    let plan_path = dir.join("plan.json");
    if session == 1 {
        let bytes = serde_json::to_vec_pretty(plan).map_err(|source| ProfileError::Json {
            path: plan_path.clone(),
            source,
        })?;
        crate::shard::write_atomic(&plan_path, &bytes)?;
    }
    let name = if session == 1 {
        "device.json".to_string()
    } else {
        format!("device-session{session}.json")
    };
    let dev_path = dir.join(name);
    let bytes = serde_json::to_vec_pretty(&device::describe(target, plan)).map_err(|source| ProfileError::Json {
        path: dev_path.clone(),
        source,
    })?;
    crate::shard::write_atomic(&dev_path, &bytes)
}

/// Reads `plan.json` of a run directory.
pub fn read_plan(dir: &Path) -> Result<Plan> {
    let path = dir.join("plan.json");
    let text = std::fs::read(&path).map_err(|e| ProfileError::io(&path, e))?;
    serde_json::from_slice(&text).map_err(|source| ProfileError::Json { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_buffer_has_the_trace_schema() {
        let mut b = RowBuffer::default();
        let t = SampleRow {
            condition_id: 3,
            round: 7,
            sweep: "io".into(),
            device_read_bytes: Some(5),
            ..Default::default()
        };
        let s = Sample {
            worker: 1,
            offset: 4096,
            bytes: 4096,
            latency_ns: 77,
            unix_ns: 9,
        };
        b.push_visit(t.clone(), &[s, s], &[10, 11]);
        let df = b.to_frame().unwrap();
        let expected = crate::shard::to_frame(&[
            SampleRow {
                sample_idx: 10,
                worker: 1,
                offset: 4096,
                bytes: 4096,
                latency_ns: 77,
                unix_ns: 9,
                ..t.clone()
            },
            SampleRow {
                sample_idx: 11,
                worker: 1,
                offset: 4096,
                bytes: 4096,
                latency_ns: 77,
                unix_ns: 9,
                ..t
            },
        ])
        .unwrap();
        assert!(df.equals_missing(&expected), "{df}\n{expected}");
    }
}
