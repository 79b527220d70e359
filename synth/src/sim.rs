//! The simulator: replays held-out trace samples (odd rounds) through the
//! model's dynamics and compares policies on the same random draws.

use leanstream_runtime::control::{ControlState, ControlTable};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Result, SynthError};
use crate::fit::Fitted;
use crate::model::{step, Env};
use crate::solve::{solve_enumerate, Instance, SolverSettings};
use crate::synth::{env_for, solve_instance, SynthConfig};
use leanstream_runtime::generate::sampler::Rng;

/// Per-policy result.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    pub policy: String,
    pub mean_cost: f64,
    pub mean_layer_us: f64,
    pub p99_layer_us: f64,
    /// Mean fraction of the predicted-active mass skipped per layer.
    pub skipped_mass: f64,
    /// Mean wasted bytes per layer.
    pub wasted_bytes: f64,
    /// Of the bytes the layers still had to read, the fraction that missed
    /// the deadline (the engine's `late_skipped` over its requested bundles).
    pub late_fraction: f64,
    /// Mean decision time per layer, µs (lookup or solve).
    pub decide_us: f64,
}

/// How a policy picks an action.
pub enum Policy<'a> {
    Table(&'a ControlTable),
    Fixed(usize),
    /// One-layer lookahead: the action of least mean cost of this layer alone.
    Greedy,
    /// The full MPC solved from the exact state at every layer.
    OnlineMpc,
}

/// The simulated workload.
#[derive(Clone, Debug, Serialize)]
pub struct SimConfig {
    pub tokens: usize,
    pub seed: u64,
    /// Which half of the traces plays the device. `HeldOut` (the default)
    /// judges the table on samples it was not built from; `Fit` replays the
    /// samples it was built from, so a policy that loses there loses to the
    /// control model itself, not to the profile's noise.
    pub truth: Half,
}

/// A half of the fitted traces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Half {
    Fit,
    #[default]
    HeldOut,
}

impl Half {
    fn of(self, fitted: &Fitted) -> &crate::fit::Dists {
        match self {
            Half::Fit => &fitted.fit,
            Half::HeldOut => &fitted.held_out,
        }
    }
}

struct Episode {
    states: Vec<(f64, f64, f64)>, // per layer: missing bytes; token regime bw, c
}

fn episodes(cfg: &SynthConfig, fitted: &Fitted, sim: &SimConfig) -> Vec<Episode> {
    let p = &cfg.params;
    let layer = p.n_ff as f64 * p.bundle_bytes;
    let truth = sim.truth.of(fitted);
    let bw = &truth.read_bw[&(p.block, p.ref_qd)];
    let c = &truth.ns_per_neuron;
    (0..sim.tokens)
        .map(|t| {
            let mut r = Rng::with_stream(sim.seed ^ 0x5157, t as u64);
            let base = layer * (0.05 + 0.45 * r.uniform());
            let b = bw.quantile(r.uniform());
            let cc = c.quantile(r.uniform());
            Episode {
                states: (0..p.n_layers)
                    .map(|_| (base * (0.8 + 0.4 * r.uniform()), b, cc))
                    .collect(),
            }
        })
        .collect()
}

struct Layer {
    cost: f64,
    layer_us: f64,
    skipped: f64,
    wasted: f64,
    late: f64,
    wanted: f64,
    decide_us: f64,
}

fn run_episode(
    ep: &Episode,
    token: usize,
    policy: &Policy,
    truth: &Env,
    model: &Env,
    cfg: &SynthConfig,
    sim: &SimConfig,
) -> Result<Vec<Layer>> {
    let n = ep.states.len();
    let mut draws_rng = Rng::with_stream(sim.seed ^ 0xD4A3, token as u64);
    let mut q = 0.0;
    let mut out = Vec::with_capacity(n);
    for (l, &(d, bw, c)) in ep.states.iter().enumerate() {
        let x = ControlState {
            queued_bytes: q,
            missing_bytes: d,
            read_bw_bytes_s: bw,
            compute_ns_per_neuron: c,
            layer_position: l as f64 / n as f64,
        };
        let t0 = std::time::Instant::now();
        let a = match policy {
            Policy::Table(t) => *t.lookup(&x),
            Policy::Fixed(i) => model.codebook[*i],
            Policy::Greedy => {
                let s = SolverSettings {
                    horizon: 1,
                    ..cfg.solver.clone()
                };
                let mut r = Rng::with_stream(cfg.seed ^ 0x6EED, (token * n + l) as u64);
                let inst = Instance::build(model, &x, &s, &mut r);
                model.codebook[solve_enumerate(&inst).action]
            }
            Policy::OnlineMpc => {
                let mut r = Rng::with_stream(cfg.seed ^ 0x0417, (token * n + l) as u64);
                let inst = Instance::build(model, &x, &cfg.solver, &mut r);
                model.codebook[solve_instance(model, cfg, &inst)?]
            }
        };
        let decide_us = t0.elapsed().as_secs_f64() * 1e6;
        let draw = truth.draw(&mut draws_rng);
        let o = step(truth, &x, &a, &draw);
        q = o.next_queued;
        out.push(Layer {
            cost: o.cost,
            layer_us: o.layer_us,
            skipped: o.skipped_mass,
            wasted: o.wasted_bytes,
            late: o.late_bytes,
            wanted: o.read_wanted_bytes,
            decide_us,
        });
    }
    Ok(out)
}

fn report(name: String, layers: &[Layer]) -> PolicyReport {
    let n = layers.len().max(1) as f64;
    let mut t: Vec<f64> = layers.iter().map(|l| l.layer_us).collect();
    t.sort_by(f64::total_cmp);
    let p99 = t
        .get(((t.len() as f64 - 1.0) * 0.99).round() as usize)
        .copied()
        .unwrap_or(0.0);
    PolicyReport {
        policy: name,
        mean_cost: layers.iter().map(|l| l.cost).sum::<f64>() / n,
        mean_layer_us: layers.iter().map(|l| l.layer_us).sum::<f64>() / n,
        p99_layer_us: p99,
        skipped_mass: layers.iter().map(|l| l.skipped).sum::<f64>() / n,
        wasted_bytes: layers.iter().map(|l| l.wasted).sum::<f64>() / n,
        late_fraction: layers.iter().map(|l| l.late).sum::<f64>()
            / layers.iter().map(|l| l.wanted).sum::<f64>().max(1.0),
        decide_us: layers.iter().map(|l| l.decide_us).sum::<f64>() / n,
    }
}

/// Simulates one policy over all episodes.
pub fn simulate_policy(
    name: &str,
    policy: &Policy,
    cfg: &SynthConfig,
    fitted: &Fitted,
    sim: &SimConfig,
) -> Result<PolicyReport> {
    let (model, _) = env_for(cfg, fitted)?;
    let mut truth = Env::new(cfg.params.clone(), &cfg.space, sim.truth.of(fitted), model.q_levels);
    truth.bw_median = model.bw_median;
    let eps = episodes(cfg, fitted, sim);
    let per: Vec<Vec<Layer>> = eps
        .par_iter()
        .enumerate()
        .map(|(t, ep)| run_episode(ep, t, policy, &truth, &model, cfg, sim))
        .collect::<Result<_>>()?;
    let all: Vec<Layer> = per.into_iter().flatten().collect();
    Ok(report(name.to_string(), &all))
}

/// The comparison: table, best fixed action, greedy, online MPC (if `mpc`).
/// The best fixed action is picked on the truth itself, in hindsight; when
/// the truth is the held-out half, a second row gives the fixed action a
/// user could have picked from the table's own data (least cost on the fit
/// half), judged on the held-out half: where the halves disagree about
/// which action is best, only the hindsight pick profits.
pub fn compare(
    table: &ControlTable,
    cfg: &SynthConfig,
    fitted: &Fitted,
    sim: &SimConfig,
    mpc: bool,
) -> Result<Vec<PolicyReport>> {
    if table.codebook != cfg.space.codebook() {
        return Err(SynthError::Settings(
            "the table's action codebook differs from the configured action space".into(),
        ));
    }
    let mut out = vec![simulate_policy("table", &Policy::Table(table), cfg, fitted, sim)?];
    let in_sample = SimConfig {
        truth: Half::Fit,
        ..sim.clone()
    };
    let mut best: Option<PolicyReport> = None;
    let mut from_fit: Option<(f64, PolicyReport)> = None;
    for i in 0..table.codebook.len() {
        let r = simulate_policy("fixed", &Policy::Fixed(i), cfg, fitted, sim)?;
        if sim.truth == Half::HeldOut {
            let on_fit = simulate_policy("fixed", &Policy::Fixed(i), cfg, fitted, &in_sample)?.mean_cost;
            if from_fit.as_ref().is_none_or(|(c, _)| on_fit < *c) {
                let row = PolicyReport {
                    policy: format!("fit_fixed ({})", table.codebook[i]),
                    ..r.clone()
                };
                from_fit = Some((on_fit, row));
            }
        }
        if best.as_ref().is_none_or(|b| r.mean_cost < b.mean_cost) {
            best = Some(PolicyReport {
                policy: format!("best_fixed ({})", table.codebook[i]),
                ..r
            });
        }
    }
    out.extend(best);
    out.extend(from_fit.map(|(_, r)| r));
    out.push(simulate_policy("greedy", &Policy::Greedy, cfg, fitted, sim)?);
    if mpc {
        out.push(simulate_policy("online_mpc", &Policy::OnlineMpc, cfg, fitted, sim)?);
    }
    Ok(out)
}
