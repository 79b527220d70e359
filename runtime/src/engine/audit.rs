//! What a policy skipped, measured: after each FFN call the layer is
//! computed again from an in-memory copy of every bundle, keeping what
//! `dense` keeps at the same thresholds (the true active set at the
//! policy's own state), and the |act(g)·u| mass of the true set that the
//! policy did not keep is counted. A predicting policy skips by missed
//! prediction and by deadline; this is the engine's own measure of both,
//! where the control model has only the predictor's offline recall.
//!
//! An audited engine computes every layer twice and holds the whole FFN,
//! so its timings and memory are not the policy's: audit measurement runs
//! (quality), not timed ones.

use leanstream_kernels::sparse_ffn::BundleFormat;

use super::plan::{Plan, Select};
use super::source::Source;
use super::tail::Tail;
use crate::Result;

pub(crate) struct Audit {
    source: Source,
    formats: Vec<BundleFormat>,
    tail: Tail,
    out: Vec<f32>,
    /// Σ|a| of the true active sets, and of their neurons the policy did not keep.
    pub active_mass: f64,
    pub missed_mass: f64,
}

impl Audit {
    pub fn new(source: Source, formats: Vec<BundleFormat>, tail: Tail) -> Self {
        Self {
            source,
            formats,
            tail,
            out: Vec::new(),
            active_mass: 0.0,
            missed_mass: 0.0,
        }
    }

    /// Layer `layer`'s call of `n` rows on `xb`, whose kept activations
    /// (`[n][n_ff]`, 0 where not kept) the policy left in `kept`.
    pub fn check(&mut self, layer: usize, xb: &[f32], n: usize, threshold: f32, kept: &[f32]) -> Result<()> {
        let n_embd = xb.len() / n.max(1);
        if self.out.len() < n * n_embd {
            self.out.resize(n * n_embd, 0.0);
        }
        let plan = Plan {
            select: Select::Threshold(threshold),
            want: None,
            deadline: None,
            stages: None,
        };
        let f = self.formats[layer];
        self.tail
            .run(&f, layer, xb, n, &mut self.out, &mut self.source, plan, None)?;
        let (active, missed) = missed_mass(self.tail.kept_acts(n), kept);
        self.active_mass += active;
        self.missed_mass += missed;
        Ok(())
    }
}

/// Σ|t| over the true set `truth` (nonzero entries), and over those of its
/// entries that `ours` leaves at zero.
fn missed_mass(truth: &[f32], ours: &[f32]) -> (f64, f64) {
    truth
        .iter()
        .zip(ours)
        .filter(|(t, _)| **t != 0.0)
        .fold((0.0, 0.0), |(active, missed), (t, o)| {
            let m = t.abs() as f64;
            (active + m, if *o == 0.0 { missed + m } else { missed })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missed_mass_counts_the_true_set_the_policy_left_out() {
        let truth = [0.0, -2.0, 1.0, 0.5];
        let ours = [3.0, -2.0, 0.0, 0.0];
        assert_eq!(missed_mass(&truth, &ours), (3.5, 1.5));
        assert_eq!(missed_mass(&truth, &truth), (3.5, 0.0));
    }
}
