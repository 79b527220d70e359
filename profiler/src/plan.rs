//! The plan of a run and the scheduler that executes it.
//!
//! A [`Plan`] is a list of [`Condition`]s, a time budget, a seed and a
//! [`Repetition`] rule. The [`Scheduler`] visits conditions in *randomized
//! rounds* (every round shuffles the still-active conditions with a
//! seed-derived RNG) so that drift, heat and background noise spread evenly
//! over all conditions instead of biasing whichever ran last. Each visit takes
//! a batch of samples of one condition.
//!
//! Repetition is either fixed (exactly `reps` samples per condition) or
//! adaptive: a condition stops being visited once the distribution-free
//! (order-statistic) 95 % confidence intervals of its p50 **and** p99 are both
//! within ±`precision` of the estimate; the remaining time goes to the
//! conditions that have not converged, i.e. where the variance is.
//!
//! The budget is respected by never starting a visit whose estimated length
//! would overrun it, and by handing each visit a deadline that the executors
//! check between samples.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::units::format_size;

/// Read engines of the I/O sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    IoUring,
    Pread,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::IoUring => "io_uring",
            Engine::Pread => "pread",
        }
    }
}

/// Access patterns of the I/O sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// Each worker reads consecutive blocks from a random start.
    Sequential,
    /// Uniformly random aligned offsets.
    Random,
    /// Blocks `stride` apart (4 × block size): sequential order, skipped data.
    Strided,
    /// The bundle extents of a random sparse neuron set of a random layer of a
    /// `.lsflash` file, in file order (what the streaming engine reads).
    Replay,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Sequential => "sequential",
            Pattern::Random => "random",
            Pattern::Strided => "strided",
            Pattern::Replay => "replay",
        }
    }
}

/// One I/O condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoCondition {
    pub engine: Engine,
    pub pattern: Pattern,
    /// Bytes per request (for `replay`, the aligned bundle size of the file).
    pub block_size: u64,
    /// Requests in flight per worker.
    pub queue_depth: u32,
    pub workers: u32,
}

/// Kernels of the compute sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// One sparse FFN stage over `neurons` resident bundles: activations
    /// (gate/up dots, in parallel) then the down accumulation.
    FfnStage,
    /// `neurons` neurons of one layer split into `stages` stages of equal
    /// size, each a full stage (parallel activations + partial down sum).
    FfnSplit,
    /// One decode step of the runtime's forward pass at context `ctx_len`
    /// (attention over the cache + projections + resident FFN).
    Decode,
}

impl Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Kernel::FfnStage => "ffn_stage",
            Kernel::FfnSplit => "ffn_split",
            Kernel::Decode => "decode",
        }
    }
}

/// One compute condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeCondition {
    pub kernel: Kernel,
    pub neurons: u32,
    pub stages: u32,
    pub ctx_len: u32,
    pub threads: u32,
    /// Whether O_DIRECT reads (128 KiB, QD 8) run concurrently.
    pub background_io: bool,
}

/// What a condition measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConditionKind {
    Io(IoCondition),
    Compute(ComputeCondition),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    pub id: u32,
    pub kind: ConditionKind,
}

impl Condition {
    /// A stable, human-readable key, e.g. `io_uring/random/4KiB/qd32/w1`.
    pub fn key(&self) -> String {
        match &self.kind {
            ConditionKind::Io(c) => format!(
                "{}/{}/{}/qd{}/w{}",
                c.engine.name(),
                c.pattern.name(),
                format_size(c.block_size),
                c.queue_depth,
                c.workers
            ),
            ConditionKind::Compute(c) => format!(
                "{}/n{}/k{}/ctx{}/t{}/{}",
                c.kernel.name(),
                c.neurons,
                c.stages,
                c.ctx_len,
                c.threads,
                if c.background_io { "bgio" } else { "quiet" }
            ),
        }
    }
}

impl Condition {
    /// Fewest samples worth a visit: an I/O visit of a few requests per slot
    /// would measure the pipeline filling and draining, not the device.
    pub fn min_visit(&self) -> u64 {
        match &self.kind {
            ConditionKind::Io(c) => 4 * u64::from(c.queue_depth.max(1)) * u64::from(c.workers.max(1)),
            ConditionKind::Compute(_) => 1,
        }
    }
}

/// How many samples a condition gets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Repetition {
    /// Exactly `reps` samples per condition (budget permitting).
    Fixed { reps: u64 },
    /// Until the 95 % order-statistic CIs of p50 and p99 are within
    /// ±`precision` (relative), with at least `min_samples` and at most
    /// `max_samples` samples.
    Adaptive {
        precision: f64,
        min_samples: u64,
        max_samples: u64,
    },
}

/// The whole plan of a run; stored as `plan.json` in the run directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// `io` or `compute`.
    pub sweep: String,
    pub seed: u64,
    pub budget_s: f64,
    pub repetition: Repetition,
    /// Largest number of samples in one visit.
    pub max_batch: u64,
    /// Samples in a condition's first visit (later visits aim at `visit_target_s`).
    pub min_batch: u64,
    /// Target length of one visit, seconds.
    pub visit_target_s: f64,
    /// Interval at which buffered samples are committed as a shard, seconds.
    pub flush_interval_s: f64,
    pub conditions: Vec<Condition>,
    /// Sweep-specific settings (file paths, sizes), as JSON.
    pub setup: serde_json::Value,
}

/// A time source; the real one wraps `Instant`, tests use a simulated one.
pub trait Clock {
    /// Seconds since an arbitrary origin.
    fn now_s(&self) -> f64;
}

/// Wall-clock time since construction.
pub struct WallClock(std::time::Instant);

impl WallClock {
    pub fn new() -> Self {
        Self(std::time::Instant::now())
    }
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for WallClock {
    fn now_s(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// One visit: take `indices.len()` samples of condition `cond` (index into
/// `plan.conditions`) in round `round`, stopping early at `deadline_s`
/// (clock seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Visit {
    pub cond: usize,
    pub round: u32,
    /// The sample indices this visit fills, in order; a visit cut short fills a prefix.
    pub indices: Vec<u64>,
    pub deadline_s: f64,
}

/// Why the scheduler stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Every condition has its samples (fixed) or its precision (adaptive).
    Complete,
    /// The budget does not allow another visit.
    Budget,
}

#[derive(Debug, Clone, Default)]
struct CondState {
    /// Sample indices committed or measured in this session.
    have: BTreeSet<u64>,
    /// Every index below this is in `have`.
    first_free: u64,
    /// Latencies (ns) of those samples, for the adaptive rule.
    latencies: Vec<f64>,
    /// Measured seconds per sample (visit wall time / samples), EWMA.
    secs_per_sample: Option<f64>,
    done: bool,
}

impl CondState {
    fn advance(&mut self) {
        while self.have.contains(&self.first_free) {
            self.first_free += 1;
        }
    }
}

/// Relative half-width of the distribution-free 95 % CI of quantile `q` of
/// the sorted sample `x`: `(x[hi] - x[lo]) / (2 x[q])` with the ranks
/// `n q ∓ 1.96 sqrt(n q (1 - q))`. `None` when `n` is too small for the
/// interval to be bounded by observed samples.
pub fn quantile_ci_rel(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len() as f64;
    if sorted.is_empty() {
        return None;
    }
    let z = 1.96;
    let sd = (n * q * (1.0 - q)).sqrt();
    let lo = (n * q - z * sd).floor();
    let hi = (n * q + z * sd).ceil();
    if lo < 0.0 || hi > n - 1.0 {
        return None;
    }
    let mid = sorted[((n * q).floor() as usize).min(sorted.len() - 1)];
    if mid <= 0.0 {
        return None;
    }
    Some((sorted[hi as usize] - sorted[lo as usize]) / (2.0 * mid))
}

/// Whether the p50 and p99 of `latencies` are known to ±`precision`.
pub fn converged(latencies: &[f64], precision: f64) -> bool {
    let mut s = latencies.to_vec();
    s.sort_by(f64::total_cmp);
    [0.5, 0.99]
        .iter()
        .all(|&q| quantile_ci_rel(&s, q).is_some_and(|w| w <= precision))
}

/// Executes a [`Plan`]: which condition next, how many samples, when to stop.
pub struct Scheduler {
    plan: Plan,
    states: Vec<CondState>,
    round: u32,
    order: Vec<usize>,
    pos: usize,
    /// Budget seconds already spent by earlier sessions (resume).
    spent_before_s: f64,
    /// Clock reading at the start of this session.
    start_s: f64,
}

impl Scheduler {
    /// `first_round` continues the round numbering of an earlier session.
    pub fn new(plan: Plan, first_round: u32, spent_before_s: f64, start_s: f64) -> Self {
        let states = vec![CondState::default(); plan.conditions.len()];
        Self {
            plan,
            states,
            round: first_round,
            order: Vec::new(),
            pos: 0,
            spent_before_s,
            start_s,
        }
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Seconds of budget spent so far (all sessions) at clock time `now_s`.
    pub fn spent_s(&self, now_s: f64) -> f64 {
        self.spent_before_s + (now_s - self.start_s)
    }

    /// Registers committed samples of an earlier session (index, latency ns).
    pub fn restore(&mut self, cond: usize, idx: u64, latency_ns: f64) {
        let st = &mut self.states[cond];
        if st.have.insert(idx) {
            st.latencies.push(latency_ns);
        }
        st.advance();
    }

    /// Re-evaluates which conditions are done (after `restore`).
    pub fn refresh(&mut self) {
        for i in 0..self.states.len() {
            self.update_done(i);
        }
    }

    fn target(&self) -> u64 {
        match self.plan.repetition {
            Repetition::Fixed { reps } => reps,
            Repetition::Adaptive { max_samples, .. } => max_samples,
        }
    }

    fn update_done(&mut self, i: usize) {
        let target = self.target();
        let st = &mut self.states[i];
        let n = st.have.len() as u64;
        st.done = match self.plan.repetition {
            Repetition::Fixed { reps } => n >= reps,
            Repetition::Adaptive {
                precision, min_samples, ..
            } => n >= target || (n >= min_samples && converged(&st.latencies, precision)),
        };
    }

    /// Samples per condition so far.
    pub fn counts(&self) -> Vec<u64> {
        self.states.iter().map(|s| s.have.len() as u64).collect()
    }

    /// Whether condition `i` needs no more samples.
    pub fn is_done(&self, i: usize) -> bool {
        self.states[i].done
    }

    /// The current round number.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Lowest `n` indices not yet taken, below the target.
    fn free_indices(&self, i: usize, n: u64) -> Vec<u64> {
        let have = &self.states[i].have;
        let mut out = Vec::with_capacity(n as usize);
        let mut k = self.states[i].first_free;
        while (out.len() as u64) < n && k < self.target() {
            if !have.contains(&k) {
                out.push(k);
            }
            k += 1;
        }
        out
    }

    fn visit_size(&self, i: usize) -> u64 {
        let st = &self.states[i];
        let remaining = self.target().saturating_sub(st.have.len() as u64);
        let want = match st.secs_per_sample {
            None => self.plan.min_batch,
            Some(sps) if sps > 0.0 => (self.plan.visit_target_s / sps) as u64,
            Some(_) => self.plan.max_batch,
        };
        // Adaptive: a visit at most doubles the samples, so a condition stops
        // within 2x of the count its precision needed, however fast it is.
        let want = match self.plan.repetition {
            Repetition::Adaptive { .. } => want.min((st.have.len() as u64).max(self.plan.min_batch)),
            Repetition::Fixed { .. } => want,
        };
        let lo = self.plan.min_batch.max(self.plan.conditions[i].min_visit()).max(1);
        want.clamp(lo, self.plan.max_batch.max(lo)).min(remaining)
    }

    /// Estimated seconds of a visit of `n` samples of condition `i`.
    fn estimate_s(&self, i: usize, n: u64) -> f64 {
        match self.states[i].secs_per_sample {
            Some(s) => s * n as f64,
            // Unknown: the slowest rate seen so far, else nothing (the deadline still bounds it).
            None => self.states.iter().filter_map(|s| s.secs_per_sample).fold(0.0, f64::max) * n as f64,
        }
    }

    /// The next visit at clock time `now_s`, or why the run is over.
    pub fn next(&mut self, now_s: f64) -> Result<Visit, Finish> {
        let budget_end = self.start_s + (self.plan.budget_s - self.spent_before_s);
        loop {
            if self.states.iter().all(|s| s.done) {
                return Err(Finish::Complete);
            }
            if now_s >= budget_end {
                return Err(Finish::Budget);
            }
            if self.pos >= self.order.len() {
                if !self.order.is_empty() {
                    self.round += 1;
                }
                self.start_round();
                // A round where nothing fits in the remaining budget ends the run.
                let fits = self.order.iter().any(|&i| {
                    let n = self.visit_size(i);
                    now_s + self.estimate_s(i, n) <= budget_end
                });
                if !fits {
                    return Err(Finish::Budget);
                }
            }
            let i = self.order[self.pos];
            self.pos += 1;
            if self.states[i].done {
                continue;
            }
            let n = self.visit_size(i);
            if n == 0 || now_s + self.estimate_s(i, n) > budget_end {
                continue;
            }
            return Ok(Visit {
                cond: i,
                round: self.round,
                indices: self.free_indices(i, n),
                deadline_s: budget_end,
            });
        }
    }

    fn start_round(&mut self) {
        let mut rng =
            StdRng::seed_from_u64(self.plan.seed ^ (u64::from(self.round) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.order = (0..self.states.len()).filter(|&i| !self.states[i].done).collect();
        self.order.shuffle(&mut rng);
        self.pos = 0;
    }

    /// Records the outcome of a visit: the `(index, latency ns)` samples
    /// taken (a prefix of the visit's indices) and its wall time.
    pub fn record(&mut self, cond: usize, samples: &[(u64, f64)], wall_s: f64) {
        let st = &mut self.states[cond];
        for &(idx, lat) in samples {
            if st.have.insert(idx) {
                st.latencies.push(lat);
            }
        }
        st.advance();
        if !samples.is_empty() && wall_s > 0.0 {
            let sps = wall_s / samples.len() as f64;
            st.secs_per_sample = Some(match st.secs_per_sample {
                Some(old) => 0.5 * old + 0.5 * sps,
                None => sps,
            });
        }
        self.update_done(cond);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    struct SimClock(Cell<f64>);
    impl Clock for SimClock {
        fn now_s(&self) -> f64 {
            self.0.get()
        }
    }

    fn compute_conditions(n: u32) -> Vec<Condition> {
        (0..n)
            .map(|i| Condition {
                id: i,
                kind: ConditionKind::Compute(ComputeCondition {
                    kernel: Kernel::FfnStage,
                    neurons: 64 << i,
                    stages: 1,
                    ctx_len: 0,
                    threads: 1,
                    background_io: false,
                }),
            })
            .collect()
    }

    fn plan(repetition: Repetition, budget_s: f64, n: u32) -> Plan {
        Plan {
            sweep: "compute".into(),
            seed: 7,
            budget_s,
            repetition,
            max_batch: 200,
            min_batch: 20,
            visit_target_s: 0.5,
            flush_interval_s: 1.0,
            conditions: compute_conditions(n),
            setup: serde_json::Value::Null,
        }
    }

    /// A deterministic pseudo-random latency: condition `c` is `1 + c` ms
    /// plus an exponential tail whose scale grows steeply with `c`.
    fn latency(c: usize, k: u64) -> f64 {
        let h = (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (c as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9)) >> 11;
        let u = h as f64 / (1u64 << 53) as f64;
        (1.0 + c as f64) * 1e6 * (1.0 + [0.02, 0.5, 3.0][c % 3] * -(1.0 - u).ln())
    }

    /// Runs the scheduler against a simulated clock; each sample advances the
    /// clock by its latency and the executor stops at the visit's deadline.
    fn simulate(s: &mut Scheduler, clock: &SimClock) -> (Finish, u64) {
        let mut taken = 0;
        loop {
            let v = match s.next(clock.now_s()) {
                Ok(v) => v,
                Err(f) => return (f, taken),
            };
            let t0 = clock.now_s();
            let mut samples = Vec::new();
            for &idx in &v.indices {
                if clock.now_s() >= v.deadline_s {
                    break;
                }
                let lat = latency(v.cond, idx);
                clock.0.set(clock.now_s() + lat * 1e-9);
                samples.push((idx, lat));
            }
            taken += samples.len() as u64;
            s.record(v.cond, &samples, clock.now_s() - t0);
        }
    }

    #[test]
    fn budget_is_respected_with_a_simulated_clock() {
        // Far more work than the budget allows.
        for budget in [0.5, 3.0, 20.0] {
            let clock = SimClock(Cell::new(100.0));
            let mut s = Scheduler::new(plan(Repetition::Fixed { reps: 1_000_000 }, budget, 4), 0, 0.0, 100.0);
            let (finish, taken) = simulate(&mut s, &clock);
            assert_eq!(finish, Finish::Budget);
            assert!(taken > 0);
            // Over by at most one sample (the longest is < 10 ms here).
            let spent = s.spent_s(clock.now_s());
            assert!(spent <= budget + 0.01, "budget {budget}: spent {spent}");
            // Given room for a round, every condition was visited: rounds interleave them.
            if budget >= 3.0 {
                assert!(s.counts().iter().all(|&c| c > 0), "{:?}", s.counts());
            }
        }
    }

    #[test]
    fn budget_carries_over_a_resume() {
        let clock = SimClock(Cell::new(0.0));
        // 4 of 5 seconds were spent by an earlier session.
        let mut s = Scheduler::new(plan(Repetition::Fixed { reps: 1_000_000 }, 5.0, 3), 9, 4.0, 0.0);
        let (finish, _) = simulate(&mut s, &clock);
        assert_eq!(finish, Finish::Budget);
        assert!(clock.now_s() <= 1.0 + 0.01, "{}", clock.now_s());
        assert!(s.round() >= 9);
    }

    #[test]
    fn fixed_plan_completes_with_exact_indices() {
        let clock = SimClock(Cell::new(0.0));
        let mut s = Scheduler::new(plan(Repetition::Fixed { reps: 150 }, 1e9, 3), 0, 0.0, 0.0);
        // Pretend indices 3 and 7 of condition 1 were committed before.
        s.restore(1, 3, 1e6);
        s.restore(1, 7, 1e6);
        s.refresh();
        let (finish, taken) = simulate(&mut s, &clock);
        assert_eq!(finish, Finish::Complete);
        assert_eq!(taken, 3 * 150 - 2);
        assert_eq!(s.counts(), vec![150, 150, 150]);
    }

    #[test]
    fn adaptive_spends_samples_where_variance_is() {
        let clock = SimClock(Cell::new(0.0));
        let rep = Repetition::Adaptive {
            precision: 0.05,
            min_samples: 100,
            max_samples: 1_000_000,
        };
        let mut s = Scheduler::new(plan(rep, 1e9, 3), 0, 0.0, 0.0);
        let (finish, _) = simulate(&mut s, &clock);
        assert_eq!(finish, Finish::Complete);
        let c = s.counts();
        // Wider spread needs more samples for the same relative precision.
        assert!(c[0] < c[1] && c[1] < c[2], "{c:?}");
        for (i, st) in s.states.iter().enumerate() {
            assert!(converged(&st.latencies, 0.05), "condition {i}");
        }
    }

    #[test]
    fn order_statistic_ci() {
        let x: Vec<f64> = (1..=1000).map(f64::from).collect();
        let w = quantile_ci_rel(&x, 0.5).unwrap();
        // ranks 469..531 of 1..=1000 around 501: (531-469)/(2*501)
        assert!((w - 62.0 / 1002.0).abs() < 1e-9, "{w}");
        assert!(quantile_ci_rel(&x[..100], 0.99).is_none());
    }
}
