//! `dejavu`: DejaVu's look-ahead (Liu et al., 2023) as a policy of this
//! engine. When layer l's FFN starts, a predictor reads the residual after
//! l's attention and picks layer l+1's neurons (the top `need`); their reads
//! go out while l computes, and l+1 waits for all of them: no refinement, no
//! deadline. The first layer of a token has no layer before it and is
//! predicted from its input.
//!
//! Taken from the original: the asynchronous look-ahead (residuals change
//! slowly, so layer l's input predicts layer l+1's active set) and reading
//! only the predicted set. Left out: DejaVu's attention-head sparsity, and
//! its GPU kernels; the predictor is whatever `.lspred` it is given (run it
//! with the low-rank baseline of `leanstream-synth predictor --baseline`
//! for DejaVu's own kind).

use super::ranking::{Ranking, When};
use super::{streamer, FfnPolicy, LayerCall, Plan, Policy};
use crate::engine::plan::Select;
use crate::engine::source::Source;
use crate::engine::tail::Tail;
use crate::Result;

pub(crate) struct DejaVu {
    ranking: Ranking,
    /// Use indices: one layer ahead, and from a layer's own input (layer 0).
    speculate: usize,
    own_input: usize,
    n_layer: usize,
    /// Each row's top `breadth × need` neurons are read.
    breadth: f32,
}

impl DejaVu {
    pub(crate) fn new(ranking: Ranking, n_layer: usize, breadth: f32) -> Result<Self> {
        let speculate = ranking.use_index("speculate")?;
        let own_input = ranking.own_input_use()?;
        Ok(Self {
            ranking,
            speculate,
            own_input,
            n_layer,
            breadth,
        })
    }
}

impl FfnPolicy for DejaVu {
    fn kind(&self) -> Policy {
        Policy::DejaVu
    }

    fn layer_input(&mut self, layer: usize, x: &[f32], n: usize, source: &mut Source) -> Result<()> {
        if layer == 0 {
            let s = streamer(source)?;
            self.ranking
                .request(When::Now, self.own_input, 0, x, n, self.breadth, s)?;
        }
        Ok(())
    }

    fn plan<'p>(&'p mut self, call: &LayerCall<'_>, source: &mut Source, _tail: &Tail) -> Result<Plan<'p>> {
        let (l, n) = (call.layer, call.n);
        // Nothing predicted for this layer yet (a caller without the input
        // hook): predict it now from what there is.
        let b = self.breadth;
        self.ranking
            .request(When::Now, self.own_input, l, call.resid, n, b, streamer(source)?)?;
        if l + 1 < self.n_layer {
            self.ranking
                .request(When::Ahead, self.speculate, l + 1, call.resid, n, b, streamer(source)?)?;
        }
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
