//! What the tail computes for a call (which neurons each row keeps, which
//! are wanted, by when, with which refinement between stages) and what the
//! call cost.

use std::time::Instant;

use super::stream::Streamer;
use crate::Result;

/// Which neurons a row keeps.
#[derive(Clone, Copy)]
pub enum Select<'a> {
    /// Those with |a| at or above the threshold (all are computed).
    Threshold(f32),
    /// The given per-row bitmaps (`words` each).
    Rows(&'a [u64]),
}

/// Refinement between the stages of a streamed layer: the tail splits the
/// layer's expected bundles into `stages()` parts in arrival order and calls
/// [`refine`](Self::refine) after each part but the last.
pub(crate) trait StageHook {
    /// Stages K of this call (1: no refinement).
    fn stages(&self) -> usize;

    /// Whether [`refine`](Self::refine) wants the partial output (a down
    /// product over the neurons computed so far).
    fn wants_partial(&self) -> bool;

    /// After stage `stage` of layer `layer`: `partial` is the FFN output of
    /// the neurons computed so far, `[n][n_embd]` before any post-norm, where
    /// asked for and the layout gives it per neuron (down columns).
    fn refine(&mut self, layer: usize, stage: usize, partial: Option<&[f32]>, streamer: &mut Streamer) -> Result<()>;
}

/// What the tail computes for a call (a policy's [`plan`](super::policy::FfnPolicy::plan)).
pub(crate) struct Plan<'p> {
    pub select: Select<'p>,
    /// The union of what any row may keep (`None`: every neuron); the reads
    /// for it have been asked for. A streamed layer computes what its stage
    /// wanted and has.
    pub want: Option<&'p [u64]>,
    /// Streamed reads not landed by then are skipped (`None`: wait for all).
    pub deadline: Option<Instant>,
    pub stages: Option<&'p mut dyn StageHook>,
}

/// Time and work of the last call.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallCost {
    /// Wall time of the call, and of it the time blocked on arrivals.
    pub seconds: f64,
    pub wait_seconds: f64,
    /// Neurons whose stage 1 ran (bundles × rows).
    pub computed: u64,
}

impl CallCost {
    /// Compute time per neuron row, ns (0 without work).
    pub fn ns_per_neuron(&self) -> f64 {
        if self.computed == 0 {
            0.0
        } else {
            (self.seconds - self.wait_seconds).max(0.0) * 1e9 / self.computed as f64
        }
    }
}

/// Whether a row keeps neuron `i` with activation `a`, as the CPU's tail
/// decides: by the row's bitmap over neuron ids where there is one, else
/// where `|a|` is not below `threshold` (what a device's kernel mirrors).
#[inline]
pub fn keeps(threshold: f32, row: Option<&[u64]>, i: usize, a: f32) -> bool {
    match row {
        Some(bits) => bits.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 == 1),
        None => a.abs().partial_cmp(&threshold) != Some(std::cmp::Ordering::Less),
    }
}
