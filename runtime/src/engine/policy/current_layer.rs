//! `llm-in-a-flash` and `powerinfer2`: each layer's neurons predicted from
//! that layer's own input, read, and computed as they land, with no look-ahead
//! to the next layer, no refinement and no deadline. The two systems share
//! this mechanism in this engine and differ in what the neuron cache keeps
//! (the engine's default cache policy for each):
//!
//! - **LLM in a Flash** (Alizadeh et al., 2024): a low-rank predictor on the
//!   layer's input, row-column bundles (this format's gate|up|down bundle per
//!   neuron) and a sliding-window cache of the neurons used in the last k
//!   tokens (`window:5`). Left out: the eager release of expired neurons
//!   (the cache's slab is allocated once at the budget, so releasing early
//!   frees nothing and only costs hits) and the bundle-size-dependent
//!   memory preallocation tricks of the original.
//! - **PowerInfer-2** (Xue et al., 2024): a static hot set by offline
//!   frequency held in memory (`hot`, loaded at start from the calibrated
//!   scores), the predictor for the cold neurons (hot ones are cache hits),
//!   and compute overlapped with I/O at cluster granularity (hits first, then
//!   runs in arrival order). Left out: reading gate rows first and up/down
//!   only for activated neurons: a bundle here is gate, up and down of one
//!   neuron contiguous, and at these sizes (1-7 KB) a gate-only read costs
//!   the same 4 KiB O_DIRECT pages as the whole bundle.
//!
//! The prediction runs before attention, on the layer input (what the
//! predictor's `refine` use is trained on), so the reads overlap the layer's
//! attention; both originals predict from the attention output, later.

use super::ranking::{Ranking, When};
use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::tail::Tail;
use crate::Result;

pub(crate) struct CurrentLayer {
    kind: Policy,
    ranking: Ranking,
    own_input: usize,
    /// Each row's top `breadth × need` neurons are read.
    breadth: f32,
}

impl CurrentLayer {
    pub(crate) fn new(kind: Policy, ranking: Ranking, breadth: f32) -> Result<Self> {
        let own_input = ranking.own_input_use()?;
        Ok(Self {
            kind,
            ranking,
            own_input,
            breadth,
        })
    }
}

impl FfnPolicy for CurrentLayer {
    fn kind(&self) -> Policy {
        self.kind
    }

    fn layer_input(&mut self, layer: usize, x: &[f32], n: usize, source: &mut Source) -> Result<()> {
        let s = streamer(source)?;
        self.ranking
            .request(When::Now, self.own_input, layer, x, n, self.breadth, s)
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        // Without the input hook the prediction comes from the residual.
        let s = streamer(source)?;
        self.ranking.request(
            When::Now,
            self.own_input,
            call.layer,
            call.resid,
            call.n,
            self.breadth,
            s,
        )?;
        Ok(Plan::new(Select::Threshold(call.threshold), None))
    }

    fn held_bytes(&self) -> u64 {
        self.ranking.predictor.weight_bytes() as u64
    }

    fn scratch_bytes(&self) -> u64 {
        self.ranking.scratch_bytes()
    }

    fn predictor_name(&self) -> Option<&str> {
        Some(&self.ranking.predictor_name)
    }
}
