//! Where the `speculate` policy's per-layer actions come from: a controller
//! table looked up on the engine's measured state, or one pinned action.
//! The measurement ([`Meter`]) keeps running averages of what the table's
//! axes describe, so a lookup costs a few comparisons per layer.

use std::sync::Arc;

use crate::control::{Action, AxisKind, ControlState, ControlTable};
use crate::{Result, RuntimeError};

/// The source of a `speculate` engine's actions.
#[derive(Debug, Clone)]
pub enum Controller {
    /// A synthesized table (`.lstab`), with where it came from.
    Table { table: Arc<ControlTable>, origin: String },
    /// One action for every layer (`fixed:K=4,b=1.5,d=8,q=16`).
    Fixed(Action),
}

impl Controller {
    /// The action of every layer when nothing is said: 2 stages, 16 reads in
    /// flight, breadth 1.5, deadline 8 (the middle of the default codebook).
    pub const DEFAULT_FIXED: Action = Action {
        stages: 2,
        queue_depth: 16,
        prefetch_breadth: 1.5,
        deadline_factor: 8.0,
    };

    /// Parses `fixed:K=..,b=..,d=..,q=..` (each key optional, defaults from
    /// [`DEFAULT_FIXED`](Self::DEFAULT_FIXED); `d=inf` never skips).
    pub fn parse_fixed(spec: &str) -> Result<Self> {
        let body = spec
            .strip_prefix("fixed:")
            .or_else(|| (spec == "fixed").then_some(""))
            .ok_or_else(|| RuntimeError::Invalid(format!("controller '{spec}': expected fixed:K=..,b=..,d=..,q=..")))?;
        let mut a = Self::DEFAULT_FIXED;
        for kv in body.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| RuntimeError::Invalid(format!("controller '{spec}': '{kv}' is not KEY=VALUE")))?;
            let bad = |what: &str| RuntimeError::Invalid(format!("controller '{spec}': {k}={v}: {what}"));
            match k {
                "K" => {
                    a.stages = v
                        .parse()
                        .ok()
                        .filter(|&k: &u8| (1..=64).contains(&k))
                        .ok_or_else(|| bad("stages 1..=64"))?
                }
                "q" => {
                    a.queue_depth = v
                        .parse()
                        .ok()
                        .filter(|&q: &u16| q >= 1)
                        .ok_or_else(|| bad("queue depth 1..=65535"))?
                }
                "b" => {
                    a.prefetch_breadth = v
                        .parse()
                        .ok()
                        .filter(|b: &f32| b.is_finite() && *b > 0.0)
                        .ok_or_else(|| bad("breadth > 0"))?
                }
                "d" => {
                    a.deadline_factor = v
                        .parse()
                        .ok()
                        .filter(|d: &f32| *d > 0.0 && !d.is_nan())
                        .ok_or_else(|| bad("deadline factor > 0 (inf: none)"))?
                }
                _ => return Err(bad("unknown key (K, b, d or q)")),
            }
        }
        Ok(Self::Fixed(a))
    }

    /// The actions it can take, in code order.
    pub fn codebook(&self) -> &[Action] {
        match self {
            Self::Table { table, .. } => &table.codebook,
            Self::Fixed(a) => std::slice::from_ref(a),
        }
    }

    /// The code and action for state `s`.
    #[inline]
    pub fn decide(&self, s: &ControlState) -> (usize, Action) {
        match self {
            Self::Table { table, .. } => {
                let code = table.codes[table.state_index(s)] as usize;
                (code, table.codebook[code])
            }
            Self::Fixed(a) => (0, *a),
        }
    }

    /// What a report calls it: the table's origin, or the fixed action.
    pub fn describe(&self) -> String {
        match self {
            Self::Table { origin, .. } => origin.clone(),
            Self::Fixed(a) => format!(
                "fixed:K={},b={},d={},q={}",
                a.stages, a.prefetch_breadth, a.deadline_factor, a.queue_depth
            ),
        }
    }

    /// Whether the table reads axis `kind` (a fixed action reads none).
    pub fn reads(&self, kind: AxisKind) -> bool {
        match self {
            Self::Table { table, .. } => table.axes.iter().any(|a| a.kind == kind),
            Self::Fixed(_) => false,
        }
    }
}

/// Weight of the newest sample in the running averages.
const ALPHA: f64 = 0.25;

/// Running averages of the engine's read bandwidth and compute speed.
#[derive(Debug, Clone, Default)]
pub struct Meter {
    read_bw: Option<f64>,
    ns_per_neuron: Option<f64>,
    last_bytes: u64,
    last_busy: f64,
}

impl Meter {
    /// Takes the I/O counters since the last call (bytes read, seconds busy).
    pub fn observe_io(&mut self, bytes_read: u64, busy_seconds: f64) {
        let (db, dt) = (
            bytes_read - self.last_bytes.min(bytes_read),
            busy_seconds - self.last_busy,
        );
        self.last_bytes = bytes_read;
        self.last_busy = busy_seconds;
        if db > 0 && dt > 1e-7 {
            ewma(&mut self.read_bw, db as f64 / dt, ALPHA);
        }
    }

    /// Takes the compute time per neuron row of the last FFN call.
    pub fn observe_compute(&mut self, ns_per_neuron: f64) {
        if ns_per_neuron > 0.0 && ns_per_neuron.is_finite() {
            ewma(&mut self.ns_per_neuron, ns_per_neuron, ALPHA);
        }
    }

    /// Bytes/s (NaN before the first read: the table's lowest bin).
    pub fn read_bw(&self) -> f64 {
        self.read_bw.unwrap_or(f64::NAN)
    }

    /// ns per neuron row (`None` before the first call).
    pub fn ns_per_neuron(&self) -> Option<f64> {
        self.ns_per_neuron
    }
}

/// Folds sample `x` into running average `avg` with weight `alpha` (the
/// first sample starts it).
pub(crate) fn ewma(avg: &mut Option<f64>, x: f64, alpha: f64) {
    *avg = Some(match *avg {
        None => x,
        Some(a) => a + alpha * (x - a),
    });
}

/// How often each action was taken.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionCount {
    pub action: Action,
    pub code: usize,
    pub layers: u64,
}

/// The decisions of a `speculate` engine so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decisions {
    /// The controller that decided (a table's path, or the fixed action).
    pub controller: String,
    /// The predictor file.
    pub predictor: String,
    /// Per action taken at least once.
    pub actions: Vec<ActionCount>,
    /// Refinements run (re-rankings of a layer's reads after it was speculated).
    pub refinements: u64,
    /// Neurons refinement added to a layer's reads, and reads it cancelled.
    pub refine_added: u64,
    pub refine_cancelled: u64,
    /// Layer calls that took every neuron without ranking: held whole in
    /// the cache where the predictor would cost more than it saves, or read
    /// whole because the action's breadth selects every neuron anyway.
    pub unranked: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_specs_parse_and_reject() {
        let Controller::Fixed(a) = Controller::parse_fixed("fixed:K=4,b=1.5,d=inf,q=8").unwrap() else {
            panic!("not fixed")
        };
        assert_eq!((a.stages, a.queue_depth, a.prefetch_breadth), (4, 8, 1.5));
        assert!(a.deadline_factor.is_infinite());
        let Controller::Fixed(d) = Controller::parse_fixed("fixed").unwrap() else {
            panic!()
        };
        assert_eq!(d, Controller::DEFAULT_FIXED);
        for bad in [
            "fixed:K=0",
            "fixed:b=-1",
            "fixed:d=nan",
            "fixed:x=1",
            "fixed:K",
            "table",
        ] {
            let e = Controller::parse_fixed(bad).unwrap_err().to_string();
            assert!(
                e.contains(bad.trim_start_matches("fixed:")) || e.contains("expected"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn meter_averages_and_waits_for_data() {
        let mut m = Meter::default();
        assert!(m.read_bw().is_nan());
        m.observe_io(1000, 0.001);
        assert!((m.read_bw() - 1e6).abs() < 1e-3);
        m.observe_io(1000, 0.002); // no new bytes: no sample
        assert!((m.read_bw() - 1e6).abs() < 1e-3);
        m.observe_io(5000, 0.003);
        assert!((m.read_bw() - (1e6 + ALPHA * (4e6 - 1e6))).abs() < 1e-3);
        m.observe_compute(0.0);
        assert_eq!(m.ns_per_neuron(), None);
        m.observe_compute(10.0);
        assert_eq!(m.ns_per_neuron(), Some(10.0));
    }
}
