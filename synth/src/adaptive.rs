//! Adaptive profiling: samples go where the controller's decisions are
//! sensitive, not uniformly over a grid.
//!
//! The table reads only a few profiled distributions (the control model's
//! [`Needs`](crate::fit::Needs)): read latency and bandwidth at the engine's
//! request size for each codebook queue depth, compute time per neuron of a
//! full FFN stage, and the K-stage split ratios. A uniform profile spends
//! most of its time elsewhere (other request sizes, neuron counts, decode).
//! Here a short pilot samples each needed condition; then, round by round,
//! each condition's distribution is resampled (bootstrap) with the others
//! held, the controller is solved again at probe states drawn over the grid
//! (common random numbers), and the share of probe states whose action
//! changes is that condition's *sensitivity*. The round's time is split
//! between the read sweep and the compute sweep by their most sensitive
//! condition (see [`split_round`] for why a sweep's conditions are never
//! sampled apart). Each round's runs are ordinary profiler runs under one
//! directory, which [`fit_traces`] reads as one profile.

use std::path::{Path, PathBuf};

use std::time::Instant;

use leanstream_profiler::plan::{Engine, Pattern, Repetition};
use leanstream_profiler::runner::Outcome;
use leanstream_profiler::sweeps::{self, ComputeGrid, IoGrid, RunSettings};
use leanstream_runtime::control::ControlState;
use leanstream_runtime::generate::sampler::Rng;
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Result, SynthError};
use crate::fit::{fit_traces, Dists, Empirical, Fitted};
use crate::model::Env;
use crate::synth::{env_for, sample_in_cell, solve_state, SynthConfig};

/// One distribution the table reads, and the profiler condition that measures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Key {
    /// Reads of the engine's request size at this queue depth.
    Read(u32),
    /// A full FFN stage (compute time per neuron).
    Stage,
    /// The layer split into K stages.
    Split(u32),
}

impl Key {
    pub fn name(self) -> String {
        match self {
            Key::Read(q) => format!("read qd{q}"),
            Key::Stage => "ffn stage".into(),
            Key::Split(k) => format!("ffn split K={k}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AdaptiveOptions {
    /// Seconds for the whole profile, the sensitivity analysis included.
    pub budget_s: f64,
    /// Where the I/O data file lives (the device under test) and its size.
    pub io_dir: PathBuf,
    pub io_file_size: u64,
    /// The packed model whose kernels are profiled.
    pub model: PathBuf,
    pub threads: u32,
    /// The configuration the table will be synthesized with.
    pub cfg: SynthConfig,
    /// Share of the budget for the pilot.
    pub pilot_share: f64,
    pub rounds: usize,
    pub probe_states: usize,
    pub replicates: usize,
    pub seed: u64,
}

/// What one round did.
#[derive(Debug, Clone, Serialize)]
pub struct RoundLog {
    pub round: usize,
    /// Per condition: its sensitivity before the round (none for the pilot).
    pub conditions: Vec<(String, Option<f64>)>,
    /// Seconds the round gave the read sweep and the compute sweep.
    pub io_s: f64,
    pub compute_s: f64,
    /// Wall time of the sensitivity analysis, seconds.
    pub analysis_s: f64,
    pub seconds: f64,
}

fn keys(cfg: &SynthConfig) -> Vec<Key> {
    let needs = cfg.space.needs(&cfg.params);
    let mut k: Vec<Key> = needs.queue_depths.iter().map(|&q| Key::Read(q)).collect();
    k.push(Key::Stage);
    k.extend(needs.stages.iter().map(|&s| Key::Split(s)));
    k
}

/// Is `k` measured by the read sweep (else by the compute sweep)?
fn is_read(k: &Key) -> bool {
    matches!(k, Key::Read(_))
}

/// A round's seconds for the read and the compute sweep, by the most
/// sensitive condition of each; a sweep gets at least a quarter of the
/// other's weight, and both get even shares when no decision moves.
///
/// A sweep's conditions are always sampled together, interleaved: the
/// device drifts between a fast and a slow read regime within tens of
/// seconds here (64 KiB reads at depth 4: 168 against 228 µs). When later
/// rounds sampled only the sensitive depth, the depths were measured in
/// different regimes and the table compared them wrongly (a table 5% worse
/// than the long profile's, and 9% on another run's traces). Interleaved,
/// every condition of a sweep sees the same mixture of regimes, and the
/// table's bandwidth state scales out the level.
fn split_round(keys: &[Key], sensitivity: &[f64], round_s: f64) -> (f64, f64) {
    let weight = |read: bool| {
        keys.iter()
            .zip(sensitivity)
            .filter(|(k, _)| is_read(k) == read)
            .map(|(_, &x)| x)
            .fold(0.0, f64::max)
    };
    let (r, c) = (weight(true), weight(false));
    let max = r.max(c);
    let (r, c) = if max > 0.0 {
        (r.max(0.25 * max), c.max(0.25 * max))
    } else {
        (1.0, 1.0)
    };
    (round_s * r / (r + c), round_s * c / (r + c))
}

/// Profiler runs measuring every one of `keys` of the read sweep for `io_s`
/// in `dir`/`name`-io and of the compute sweep for `compute_s` in
/// `name`-compute (a sweep under 0.2 s is skipped).
fn measure(
    o: &AdaptiveOptions,
    keys: &[Key],
    io_s: f64,
    compute_s: f64,
    dir: &Path,
    name: &str,
    seed: u64,
) -> Result<()> {
    let settings = RunSettings {
        budget_s: io_s + compute_s,
        // Sampling stops at the budget, not at a count.
        repetition: Repetition::Fixed { reps: 1 << 40 },
        seed,
        flush_every_s: (io_s + compute_s).clamp(1.0, 30.0),
        visit_s: 0.5,
        min_batch: 8,
        max_batch: 8192,
    };
    let reads: Vec<u32> = keys
        .iter()
        .filter_map(|k| if let Key::Read(q) = k { Some(*q) } else { None })
        .collect();
    let splits: Vec<u32> = keys
        .iter()
        .filter_map(|k| if let Key::Split(s) = k { Some(*s) } else { None })
        .collect();
    let stage = keys.contains(&Key::Stage);
    let mut plans = Vec::new();
    if !reads.is_empty() && io_s >= 0.2 {
        let grid = IoGrid {
            dir: o.io_dir.clone(),
            file_size: o.io_file_size,
            block_sizes: vec![o.cfg.params.block],
            queue_depths: reads,
            workers: vec![1],
            patterns: vec![Pattern::Random],
            engines: vec![Engine::IoUring],
            lsflash: None,
            replay_fraction: 0.1,
        };
        plans.push(("io", io_s, sweeps::io_plan(&grid, &settings)?));
    }
    if (stage || !splits.is_empty()) && compute_s >= 0.2 {
        let grid = ComputeGrid {
            model: o.model.clone(),
            neurons: Some(if stage {
                vec![o.cfg.params.n_ff as u32]
            } else {
                Vec::new()
            }),
            stages: splits,
            split_neurons: None,
            ctx: Vec::new(),
            threads: Some(vec![o.threads]),
            background_io: vec![false],
            io_file: None,
            layer: 0,
            device: None,
        };
        plans.push(("compute", compute_s, sweeps::compute_plan(&grid, &settings)?));
    }
    // Each sweep runs on its own share of the budget.
    for (sweep, budget_s, mut plan) in plans {
        plan.budget_s = budget_s;
        plan.visit_target_s = visit_target_s(plan.budget_s, plan.conditions.len(), plan.visit_target_s);
        if let Outcome::Interrupted = sweeps::start(&plan, &dir.join(format!("{name}-{sweep}")), false)? {
            return Err(SynthError::Interrupted(format!("{}: interrupted", dir.display())));
        }
    }
    Ok(())
}

/// Visits short enough that each of `conditions` gets about eight in
/// `budget_s` (at most `longest`): rounds alternate between the fitted and
/// the held-out half, and the fit needs samples from both. At a tenth of
/// a 6-second pilot per visit, a compute condition had under 20 samples in
/// the fitted half and synthesis refused the profile.
fn visit_target_s(budget_s: f64, conditions: usize, longest: f64) -> f64 {
    (budget_s / (8.0 * conditions.max(1) as f64)).clamp(0.02, longest.max(0.02))
}

fn bootstrap(e: &Empirical, rng: &mut Rng) -> Empirical {
    let n = e.len();
    Empirical::new((0..n).map(|_| e.sorted[rng.below(n)]).collect())
}

/// `d` with `key`'s distributions resampled.
fn resample(d: &Dists, key: Key, block: u64, rng: &mut Rng) -> Dists {
    let mut d = d.clone();
    match key {
        Key::Read(q) => {
            if let Some(e) = d.read_lat_us.get_mut(&(block, q)) {
                *e = bootstrap(e, rng);
            }
            if let Some(e) = d.read_bw.get_mut(&(block, q)) {
                *e = bootstrap(e, rng);
            }
        }
        Key::Stage => d.ns_per_neuron = bootstrap(&d.ns_per_neuron, rng),
        Key::Split(k) => {
            if let Some(e) = d.split_ratio.get_mut(&k) {
                *e = bootstrap(e, rng);
            }
        }
    }
    d
}

/// Per key, the share of probe states whose action changes when its
/// distributions are resampled (mean over `replicates`).
pub fn sensitivity(
    cfg: &SynthConfig,
    fitted: &Fitted,
    keys: &[Key],
    probes: usize,
    replicates: usize,
) -> Result<Vec<f64>> {
    let (env0, axes) = env_for(cfg, fitted)?;
    let n_states: usize = axes.iter().map(|a| a.bins()).product();
    let states: Vec<ControlState> = (0..probes)
        .map(|i| {
            let mut rng = Rng::with_stream(cfg.seed ^ 0xada9, i as u64);
            let cell = rng.below(n_states);
            sample_in_cell(&axes, cell, &mut rng)
        })
        .collect();
    let solve = |env: &Env| -> Result<Vec<usize>> {
        states
            .par_iter()
            .enumerate()
            .map(|(i, x)| solve_state(env, cfg, x, i as u64))
            .collect()
    };
    let base = solve(&env0)?;
    let mut out = Vec::with_capacity(keys.len());
    for (ki, &key) in keys.iter().enumerate() {
        let mut changed = 0usize;
        for r in 0..replicates {
            let mut rng = Rng::with_stream(cfg.seed ^ 0xb007, (ki * 1000 + r) as u64);
            let d = resample(&fitted.fit, key, cfg.params.block, &mut rng);
            let env = Env::new(cfg.params.clone(), &cfg.space, &d, axes[0].bins());
            let acts = solve(&env)?;
            changed += acts.iter().zip(&base).filter(|(a, b)| a != b).count();
        }
        out.push(changed as f64 / (probes * replicates.max(1)).max(1) as f64);
    }
    Ok(out)
}

/// Profiles into `dir` (a new directory) under `o.budget_s`; returns the log.
pub fn profile(dir: &Path, o: &AdaptiveOptions) -> Result<Vec<RoundLog>> {
    let t0 = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| SynthError::io(dir, e))?;
    let keys = keys(&o.cfg);
    // The analysis solves each probe state 1 + 2·keys·replicates times per
    // round; fewer scenarios keep it a small part of a short budget, and
    // common random numbers keep its comparisons fair.
    let mut analysis = o.cfg.clone();
    analysis.solver.scenarios = analysis.solver.scenarios.min(8);
    let mut log = Vec::new();
    let pilot_s = o.budget_s * o.pilot_share;
    let t = Instant::now();
    // The pilot splits its time by the sweeps' numbers of conditions.
    let pilot_io_s = pilot_s * keys.iter().filter(|k| is_read(k)).count() as f64 / keys.len().max(1) as f64;
    measure(o, &keys, pilot_io_s, pilot_s - pilot_io_s, dir, "round-00", o.seed)?;
    log.push(RoundLog {
        round: 0,
        conditions: keys.iter().map(|k| (k.name(), None)).collect(),
        io_s: pilot_io_s,
        compute_s: pilot_s - pilot_io_s,
        analysis_s: 0.0,
        seconds: t.elapsed().as_secs_f64(),
    });
    for round in 1..=o.rounds {
        let left = o.budget_s - t0.elapsed().as_secs_f64();
        let rounds_left = (o.rounds + 1 - round) as f64;
        if left <= 0.5 {
            break;
        }
        let t = Instant::now();
        let fitted = fit_traces(dir)?;
        let s = sensitivity(&analysis, &fitted, &keys, o.probe_states, o.replicates)?;
        let analysis_s = t.elapsed().as_secs_f64();
        let round_s = (o.budget_s - t0.elapsed().as_secs_f64()) / rounds_left;
        let (io_s, compute_s) = split_round(&keys, &s, round_s);
        measure(
            o,
            &keys,
            io_s,
            compute_s,
            dir,
            &format!("round-{round:02}"),
            o.seed + round as u64,
        )?;
        let conditions = keys.iter().zip(&s).map(|(k, &x)| (k.name(), Some(x))).collect();
        log.push(RoundLog {
            round,
            conditions,
            io_s,
            compute_s,
            analysis_s,
            seconds: t.elapsed().as_secs_f64(),
        });
    }
    Ok(log)
}

#[cfg(test)]
mod tests {
    use super::{split_round, visit_target_s, Key};

    #[test]
    fn a_round_splits_its_time_between_whole_sweeps() {
        let keys = [Key::Read(1), Key::Read(16), Key::Stage, Key::Split(2)];
        // No decision moves: even shares.
        assert_eq!(split_round(&keys, &[0.0; 4], 10.0), (5.0, 5.0));
        // Only reads matter: compute keeps a quarter of their weight.
        let (io, compute) = split_round(&keys, &[0.0, 0.08, 0.0, 0.0], 10.0);
        assert!(
            (io - 8.0).abs() < 1e-12 && (compute - 2.0).abs() < 1e-12,
            "{io} {compute}"
        );
        // By each sweep's most sensitive condition, not their sum.
        let (io, compute) = split_round(&keys, &[0.04, 0.04, 0.06, 0.0], 10.0);
        assert!(
            (io - 4.0).abs() < 1e-12 && (compute - 6.0).abs() < 1e-12,
            "{io} {compute}"
        );
    }

    #[test]
    fn short_budgets_still_visit_every_condition_in_both_halves() {
        // The 20 s profile's pilot: 3.4 s for 4 compute conditions.
        let v = visit_target_s(3.4, 4, 0.5);
        assert!(3.4 / (4.0 * v) >= 8.0 - 1e-9, "{v}");
        // Long budgets keep the configured visit length; tiny ones a floor.
        assert_eq!(visit_target_s(600.0, 4, 0.5), 0.5);
        assert_eq!(visit_target_s(0.1, 7, 0.5), 0.02);
        assert_eq!(visit_target_s(1.0, 0, 0.5), 0.125);
    }
}
