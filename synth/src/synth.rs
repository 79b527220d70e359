//! Controller synthesis: every grid state solved in parallel, compiled into a
//! [`ControlTable`].

use leanstream_runtime::control::{Action, Axis, AxisKind, ControlState, ControlTable, Provenance};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Result, SynthError};
use crate::fit::Fitted;
use crate::model::{grid, ActionSpace, Env, GridSpec, ModelParams};
use crate::solve::{solve_dp, solve_enumerate, solve_milp, Instance, Solver, SolverSettings};
use leanstream_runtime::generate::sampler::Rng;

/// Everything that determines a table besides the traces.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SynthConfig {
    pub params: ModelParams,
    pub space: ActionSpace,
    pub grid: GridSpec,
    pub solver: SolverSettings,
    pub seed: u64,
    /// SHA-256 (hex) of the GGUF the packed model was made from; recorded
    /// as `model.sha256` so the runtime refuses the table for other models.
    pub model_sha256: Option<String>,
}

pub use leanstream_runtime::control::state_at;

impl SynthConfig {
    /// The default settings for the packed model at `path`: its layers,
    /// neurons and bundle bytes, and the SHA-256 of its source GGUF, so the
    /// runtime refuses the table for other models.
    pub fn for_flash(path: &std::path::Path) -> Result<Self> {
        let f = leanstream_runtime::flash::LsFlash::open(path)?;
        let bundle = f.layout(0).bundle_bytes();
        if let Some(l) = (1..f.n_layer()).find(|&l| f.layout(l).bundle_bytes() != bundle) {
            return Err(SynthError::Settings(format!(
                "{}: layer {l}'s bundles are {} bytes, layer 0's {bundle}; the control model assumes one size",
                path.display(),
                f.layout(l).bundle_bytes()
            )));
        }
        Ok(Self {
            params: ModelParams {
                n_layers: f.n_layer(),
                n_ff: f.n_ff(),
                bundle_bytes: bundle as f64,
                ..ModelParams::default()
            },
            model_sha256: Some(leanstream_runtime::fetch::hex(&f.header().source_sha256)),
            ..Self::default()
        })
    }
}

/// A state drawn uniformly from grid cell `idx` (edge cells extend as far
/// past their center as toward their inner neighbour; layer position stays
/// at the center, since the horizon depends on it).
pub fn sample_in_cell(axes: &[Axis], idx: usize, rng: &mut Rng) -> ControlState {
    let mut s = state_at(axes, idx);
    let mut rem = idx;
    for a in axes.iter().rev() {
        let b = rem % a.bins();
        rem /= a.bins();
        if a.bins() < 2 || a.kind == AxisKind::LayerPosition {
            continue;
        }
        let c = a.centers[b];
        let lo = if b > 0 {
            a.thresholds[b - 1]
        } else {
            c - (a.thresholds[0] - c)
        };
        let hi = if b + 1 < a.bins() {
            a.thresholds[b]
        } else {
            c + (c - a.thresholds[b - 1])
        };
        let v = (lo + (hi - lo) * rng.uniform()).max(0.0);
        match a.kind {
            AxisKind::QueuedBytes => s.queued_bytes = v,
            AxisKind::MissingBytes => s.missing_bytes = v,
            AxisKind::ReadBandwidth => s.read_bw_bytes_s = v,
            AxisKind::ComputeNsPerNeuron => s.compute_ns_per_neuron = v,
            AxisKind::LayerPosition => {}
        }
    }
    s
}

/// The environment of a configuration on fitted traces (checks the needed
/// conditions first).
pub fn env_for(cfg: &SynthConfig, fitted: &Fitted) -> Result<(Env, Vec<Axis>)> {
    if cfg.space.codebook().len() > 255 {
        return Err(SynthError::Settings("more than 255 actions in the codebook".into()));
    }
    if cfg.solver.horizon == 0 || cfg.solver.scenarios == 0 {
        return Err(SynthError::Settings("horizon and scenarios must be at least 1".into()));
    }
    fitted.check(&cfg.space.needs(&cfg.params))?;
    if [
        cfg.grid.queued,
        cfg.grid.missing,
        cfg.grid.bandwidth,
        cfg.grid.compute,
        cfg.grid.position,
    ]
    .iter()
    .any(|&n| n == 0 || n > 64)
    {
        return Err(SynthError::Settings("every grid axis needs 1..=64 bins".into()));
    }
    let axes = grid(&cfg.params, &cfg.grid, &fitted.fit);
    let q_levels = axes[0].bins();
    Ok((Env::new(cfg.params.clone(), &cfg.space, &fitted.fit, q_levels), axes))
}

/// Solves one state with the configured solver.
pub fn solve_state(env: &Env, cfg: &SynthConfig, x: &ControlState, stream: u64) -> Result<usize> {
    let mut rng = Rng::with_stream(cfg.seed, stream);
    let inst = Instance::build(env, x, &cfg.solver, &mut rng);
    solve_instance(env, cfg, &inst)
}

/// Solves one instance with the configured solver and returns the action's
/// codebook index.
pub(crate) fn solve_instance(env: &Env, cfg: &SynthConfig, inst: &Instance) -> Result<usize> {
    Ok(match cfg.solver.solver {
        Solver::Dp => solve_dp(inst, &deepest_queue_first(&env.codebook)).action,
        Solver::Milp => solve_milp(inst)?.action,
        Solver::Enumerate => solve_enumerate(inst).action,
    })
}

/// Codebook indices, deepest queue first (codebook order within a depth):
/// the order in which [`solve_dp`] breaks ties. First actions tie exactly
/// where they differ only in a queue depth the model cannot tell apart (no
/// more reads than the shallower depth, or reads that all land, or all miss
/// the deadline, either way); the deeper queue costs nothing there and
/// leaves the engine room when reads do pile up. Before the model
/// interpolated between profiled depths such ties were common and this
/// rule was worth 1.4% of Gemma 3's simulated cost over the MILP's picks;
/// now the two solvers' tables cost the same to 0.03% (README, "Why the
/// profiles use their whole share").
pub fn deepest_queue_first(codebook: &[Action]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..codebook.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(codebook[i].queue_depth));
    order
}

/// Solves every grid state (in parallel, deterministic for `cfg.seed`) and
/// returns the table.
pub fn synthesize(cfg: &SynthConfig, fitted: &Fitted, progress: bool) -> Result<ControlTable> {
    let (env, axes) = env_for(cfg, fitted)?;
    let n: usize = axes.iter().map(Axis::bins).product();
    let pb = leanstream_runtime::progress::bar(n as u64, progress, "{bar:40} {pos}/{len} states  {elapsed} eta {eta}");
    let codes = (0..n)
        .into_par_iter()
        .map(|i| {
            let mut rng = Rng::with_stream(cfg.seed, i as u64);
            let xs: Vec<ControlState> = (0..cfg.solver.scenarios)
                .map(|_| sample_in_cell(&axes, i, &mut rng))
                .collect();
            let inst = Instance::build_over(&env, &xs, &cfg.solver, &mut rng);
            let r = solve_instance(&env, cfg, &inst).map(|a| a as u8);
            pb.inc(1);
            r
        })
        .collect::<Result<Vec<u8>>>()?;
    pb.finish_and_clear();
    let mut model =
        serde_json::to_value(&cfg.params).map_err(|e| SynthError::Settings(format!("model settings: {e}")))?;
    if let Some(sha) = &cfg.model_sha256 {
        model["sha256"] = sha.as_str().into();
    }
    let settings = serde_json::json!({
        "solver": cfg.solver,
        "model": model,
        "actions": cfg.space,
        "grid": cfg.grid,
    });
    Ok(ControlTable {
        provenance: Provenance {
            device_fingerprint: fitted.device_fingerprint.clone(),
            seed: cfg.seed,
            solver_settings: settings.to_string(),
            traces: fitted.traces.clone(),
        },
        axes,
        codebook: env.codebook.clone(),
        codes,
    })
}
