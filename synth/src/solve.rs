//! Sample-average stochastic MPC for one state: the instance (scenario costs
//! and discretized transitions) and three exact solvers of it: backward
//! induction (the default, fastest), its MILP with `good_lp` + `microlp`, and
//! an exhaustive enumeration of action sequences to check both.

use good_lp::{microlp, variable, Expression, ProblemVariables, Solution, SolverModel, Variable};
use leanstream_runtime::control::ControlState;
use serde::{Deserialize, Serialize};

use crate::error::{Result, SynthError};
use crate::model::{layers_left, step, Env};
use leanstream_runtime::generate::sampler::Rng;

/// Solver settings (recorded in the table's provenance).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SolverSettings {
    /// Layers of the MPC horizon.
    pub horizon: usize,
    /// Scenarios of the sample average.
    pub scenarios: usize,
    pub solver: Solver,
}

impl Default for SolverSettings {
    fn default() -> Self {
        Self {
            horizon: 3,
            scenarios: 24,
            solver: Solver::Dp,
        }
    }
}

/// How one instance is solved. All three find the same optimal value; they
/// differ in speed and in which of several tied first actions they return.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Solver {
    /// Backward induction per scenario ([`solve_dp`]); ties go to the
    /// deepest queue.
    #[default]
    Dp,
    /// The MILP with `good_lp` + `microlp` ([`solve_milp`]); ties go where
    /// the simplex lands.
    Milp,
    /// Every action sequence ([`solve_enumerate`]); ties go to the lowest
    /// action index. A check, exponential in the horizon.
    Enumerate,
}

impl std::str::FromStr for Solver {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "dp" => Ok(Self::Dp),
            "milp" => Ok(Self::Milp),
            "enumerate" => Ok(Self::Enumerate),
            _ => Err(SynthError::Settings(format!(
                "solver: unknown {s:?} (expected dp, milp or enumerate)"
            ))),
        }
    }
}

/// A finite scenario instance: per scenario, the first stage's cost and next
/// Q bin for each action, then for each later stage, Q bin and action the cost
/// and next Q bin.
#[derive(Clone, Debug, PartialEq)]
pub struct Instance {
    pub n_actions: usize,
    pub n_bins: usize,
    /// `first_cost[s][a]`
    pub first_cost: Vec<Vec<f64>>,
    /// `first_next[s][a]`
    pub first_next: Vec<Vec<usize>>,
    /// `cost[s][t][q][a]` for the stages after the first.
    pub cost: Vec<Vec<Vec<Vec<f64>>>>,
    /// `next[s][t][q][a]`
    pub next: Vec<Vec<Vec<Vec<usize>>>>,
}

impl Instance {
    pub fn scenarios(&self) -> usize {
        self.first_cost.len()
    }
    pub fn later_stages(&self) -> usize {
        self.cost.first().map_or(0, Vec::len)
    }

    /// Builds the instance of state `x` with scenarios drawn from `rng`.
    pub fn build(env: &Env, x: &ControlState, settings: &SolverSettings, rng: &mut Rng) -> Self {
        Self::build_over(env, std::slice::from_ref(x), settings, rng)
    }

    /// Like [`Instance::build`], but scenario `s` starts from `xs[s % xs.len()]`
    /// (states sampled over a grid cell: the first action is then the best
    /// for the whole cell, not just its center).
    pub fn build_over(env: &Env, xs: &[ControlState], settings: &SolverSettings, rng: &mut Rng) -> Self {
        let x0 = &xs[0];
        let h = settings.horizon.min(layers_left(&env.params, x0.layer_position)).max(1);
        let na = env.codebook.len();
        let nb = env.q_levels;
        let mut inst = Instance {
            n_actions: na,
            n_bins: nb,
            first_cost: Vec::new(),
            first_next: Vec::new(),
            cost: Vec::new(),
            next: Vec::new(),
        };
        for si in 0..settings.scenarios.max(1) {
            let x = &xs[si % xs.len()];
            let levels = prefetch_levels(env, x, nb);
            let d = env.draw(rng);
            let (mut fc, mut fnx) = (Vec::with_capacity(na), Vec::with_capacity(na));
            for a in &env.codebook {
                let o = step(env, x, a, &d);
                fc.push(o.cost);
                fnx.push(nearest(&levels, o.next_queued));
            }
            inst.first_cost.push(fc);
            inst.first_next.push(fnx);
            let (mut cs, mut ns) = (Vec::new(), Vec::new());
            for t in 1..h {
                let d = env.draw(rng);
                let (mut cq, mut nq) = (Vec::new(), Vec::new());
                for q in 0..nb {
                    let y = ControlState {
                        queued_bytes: levels[q],
                        layer_position: x.layer_position + t as f64 / env.params.n_layers as f64,
                        ..*x
                    };
                    let (mut c, mut n) = (Vec::with_capacity(na), Vec::with_capacity(na));
                    for a in &env.codebook {
                        let o = step(env, &y, a, &d);
                        c.push(o.cost);
                        n.push(nearest(&levels, o.next_queued));
                    }
                    cq.push(c);
                    nq.push(n);
                }
                cs.push(cq);
                ns.push(nq);
            }
            inst.cost.push(cs);
            inst.next.push(ns);
        }
        inst
    }

    /// Sample-average cost of first action `a` with optimal recourse, by
    /// enumerating every sequence of later actions in every scenario.
    pub fn enumerate_value(&self, a: usize) -> f64 {
        fn rec(inst: &Instance, s: usize, t: usize, q: usize) -> f64 {
            if t == inst.later_stages() {
                return 0.0;
            }
            (0..inst.n_actions)
                .map(|a| inst.cost[s][t][q][a] + rec(inst, s, t + 1, inst.next[s][t][q][a]))
                .fold(f64::INFINITY, f64::min)
        }
        let s_n = self.scenarios();
        (0..s_n)
            .map(|s| self.first_cost[s][a] + rec(self, s, 0, self.first_next[s][a]))
            .sum::<f64>()
            / s_n as f64
    }
}

/// The queued-bytes levels the recourse of a scenario starting at `x` moves
/// between: `n` evenly from nothing to the most any action prefetches (the
/// widest breadth's load, at most the layer). The horizon keeps `x`'s
/// missing bytes, so "all of the next layer prefetched, no read left" is a
/// level of its own. Snapped to the table's Q axis instead (absolute bytes,
/// the same for every state), a prefetch that covered the next layer
/// mostly looked one read short, and a read is a whole wave: Gemma 3's
/// 408 KiB block is a fifth of its typical load, so prefetching was
/// undervalued and online MPC lost to a fixed action that always prefetches.
pub fn prefetch_levels(env: &Env, x: &ControlState, n: usize) -> Vec<f64> {
    let widest = env
        .codebook
        .iter()
        .map(|a| a.prefetch_breadth as f64)
        .fold(0.0, f64::max);
    let layer = env.params.n_ff as f64 * env.params.bundle_bytes;
    let top = (widest * x.missing_bytes.max(0.0)).min(layer);
    if n < 2 {
        return vec![0.0; n.max(1)];
    }
    (0..n).map(|i| top * i as f64 / (n - 1) as f64).collect()
}

/// Index of the level nearest `v` (levels ascending).
fn nearest(levels: &[f64], v: f64) -> usize {
    let i = levels.partition_point(|&l| l < v);
    if i == 0 {
        0
    } else if i == levels.len() || v - levels[i - 1] <= levels[i] - v {
        i - 1
    } else {
        i
    }
}

/// The result of one solve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Solved {
    pub action: usize,
    /// Sample-average horizon cost of `action` with optimal recourse.
    pub objective: f64,
    /// The objective value the solver reported (equals `objective` at an optimum).
    pub solver_objective: f64,
}

/// Exhaustive enumeration: every first action, every recourse sequence.
/// Ties go to the lowest action index.
pub fn solve_enumerate(inst: &Instance) -> Solved {
    let mut best = Solved {
        action: 0,
        objective: f64::INFINITY,
        solver_objective: f64::INFINITY,
    };
    for a in 0..inst.n_actions {
        let v = inst.enumerate_value(a);
        if v < best.objective - 1e-9 {
            best = Solved {
                action: a,
                objective: v,
                solver_objective: v,
            };
        }
    }
    best
}

/// The MILP: binary one-hot first action `x_a`; per scenario a unit flow over
/// (later stage, Q bin, action) arcs whose inflow at the second stage is the
/// first action's transition. Minimizes the sample-average horizon cost.
// The variables and costs share (scenario, stage, bin, action) indices.
#[allow(clippy::needless_range_loop)]
pub fn solve_milp(inst: &Instance) -> Result<Solved> {
    let (na, nb, ns, nt) = (inst.n_actions, inst.n_bins, inst.scenarios(), inst.later_stages());
    let mut vars = ProblemVariables::new();
    let x: Vec<Variable> = (0..na).map(|_| vars.add(variable().binary())).collect();
    // w[s][t][q][a]
    let w: Vec<Vec<Vec<Vec<Variable>>>> = (0..ns)
        .map(|_| {
            (0..nt)
                .map(|_| {
                    (0..nb)
                        .map(|_| (0..na).map(|_| vars.add(variable().min(0.0))).collect())
                        .collect()
                })
                .collect()
        })
        .collect();
    let inv_s = 1.0 / ns as f64;
    let mut obj = Expression::with_capacity(na * (1 + ns * nt * nb));
    for a in 0..na {
        let c: f64 = (0..ns).map(|s| inst.first_cost[s][a]).sum::<f64>() * inv_s;
        obj.add_mul(c, x[a]);
    }
    for s in 0..ns {
        for t in 0..nt {
            for q in 0..nb {
                for a in 0..na {
                    obj.add_mul(inst.cost[s][t][q][a] * inv_s, w[s][t][q][a]);
                }
            }
        }
    }
    let mut model = vars.minimise(obj).using(microlp);
    let mut one = Expression::with_capacity(na);
    for &v in &x {
        one.add_mul(1.0, v);
    }
    model = model.with(one.eq(1.0));
    for s in 0..ns {
        for t in 0..nt {
            for q in 0..nb {
                // outflow(s, t, q) = inflow(s, t, q)
                let mut e = Expression::with_capacity(2 * na);
                for a in 0..na {
                    e.add_mul(1.0, w[s][t][q][a]);
                }
                if t == 0 {
                    for a in 0..na {
                        if inst.first_next[s][a] == q {
                            e.add_mul(-1.0, x[a]);
                        }
                    }
                } else {
                    for qq in 0..nb {
                        for a in 0..na {
                            if inst.next[s][t - 1][qq][a] == q {
                                e.add_mul(-1.0, w[s][t - 1][qq][a]);
                            }
                        }
                    }
                }
                model = model.with(e.eq(0.0));
            }
        }
    }
    let sol = model.solve().map_err(|e| SynthError::Solver(e.to_string()))?;
    let (action, _) =
        x.iter()
            .enumerate()
            .map(|(i, &v)| (i, sol.value(v)))
            .fold(
                (0, f64::NEG_INFINITY),
                |b, (i, v)| if v > b.1 + 1e-6 { (i, v) } else { b },
            );
    // The objective of the chosen action, recomputed exactly.
    let objective = inst.enumerate_value(action);
    let mut solver_objective = 0.0;
    for a in 0..na {
        solver_objective += (0..ns).map(|s| inst.first_cost[s][a]).sum::<f64>() * inv_s * sol.value(x[a]);
    }
    for s in 0..ns {
        for t in 0..nt {
            for q in 0..nb {
                for a in 0..na {
                    solver_objective += inst.cost[s][t][q][a] * inv_s * sol.value(w[s][t][q][a]);
                }
            }
        }
    }
    Ok(Solved {
        action,
        objective,
        solver_objective,
    })
}

/// Exact backward induction: each scenario's recourse is a shortest path
/// over (stage, Q level), so the value of every first action is the sample
/// average of its first cost plus the scenario's cost-to-go. Among first
/// actions whose values tie (to rounding), the one earliest in `prefer`
/// wins.
pub fn solve_dp(inst: &Instance, prefer: &[usize]) -> Solved {
    let values = first_action_values(inst);
    let best = values.iter().copied().fold(f64::INFINITY, f64::min);
    let tol = 1e-9 * best.abs().max(1.0);
    let action = prefer
        .iter()
        .copied()
        .find(|&a| values[a] <= best + tol)
        .unwrap_or_else(|| values.iter().position(|&v| v <= best + tol).unwrap_or(0));
    Solved {
        action,
        objective: values[action],
        solver_objective: best,
    }
}

/// The sample-average horizon cost of each first action with optimal
/// recourse (what [`Instance::enumerate_value`] gives, in O(S·T·B·A)).
pub fn first_action_values(inst: &Instance) -> Vec<f64> {
    let (na, nb, nt) = (inst.n_actions, inst.n_bins, inst.later_stages());
    let s_n = inst.scenarios();
    let mut values = vec![0.0; na];
    let mut v_next = vec![0.0; nb];
    let mut v = vec![0.0; nb];
    for s in 0..s_n {
        v_next.iter_mut().for_each(|x| *x = 0.0);
        for t in (0..nt).rev() {
            for q in 0..nb {
                v[q] = (0..na)
                    .map(|a| inst.cost[s][t][q][a] + v_next[inst.next[s][t][q][a]])
                    .fold(f64::INFINITY, f64::min);
            }
            std::mem::swap(&mut v, &mut v_next);
        }
        for a in 0..na {
            values[a] += inst.first_cost[s][a] + v_next[inst.first_next[s][a]];
        }
    }
    values.iter_mut().for_each(|x| *x /= s_n.max(1) as f64);
    values
}
