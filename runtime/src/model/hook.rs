//! The one way into a forward pass from outside: a [`LayerHook`] is told,
//! layer by layer, the residual and the FFN's normed input, and may supply the
//! FFN itself (a streamed model's engine) or watch and mask the model's own
//! (calibration, sparsity, activation traces, predictor evaluation).
//! [`DenseFfn`], which does nothing, is the dense path.

use std::ops::Range;

use super::config::FfnActivation;
use crate::Result;

/// Where a hook is called: batch rows `rows` of a call whose first token sits
/// at position `pos0` (the last layer runs only the output rows). A pass
/// over several sequences' rows gives its first sequence's `pos0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerAt {
    pub layer: usize,
    pub rows: Range<usize>,
    pub pos0: usize,
}

impl LayerAt {
    /// Context positions of the rows.
    pub fn positions(&self) -> Range<usize> {
        self.pos0 + self.rows.start..self.pos0 + self.rows.end
    }

    /// Rows in the call's slices.
    pub fn n(&self) -> usize {
        self.rows.len()
    }
}

/// Who computed a layer's FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnBy {
    /// The model's own matrices (the hooks below see it run).
    Model,
    /// The hook, into `out`.
    Hook,
}

/// Watches (and may replace) each layer of a forward pass. Slices hold one
/// row per token of `at.rows`, row-major.
pub trait LayerHook {
    /// Before a pass: whether each of its rows must get the bits it would
    /// get run alone (a verification pass; see
    /// `leanstream_kernels::ActBuffer::set_rows_alone`). A hook that
    /// computes the FFN computes it so.
    fn rows_alone(&mut self, _on: bool) {}

    /// The residual stream entering the layer, before attention.
    fn layer_input(&mut self, _at: &LayerAt, _x: &[f32]) {}

    /// After attention: the residual `resid` and the FFN's normed input `xb`.
    /// A hook that computes the FFN writes its output (before any post-norm
    /// and residual) to `out` and answers [`FfnBy::Hook`]; the default leaves
    /// it to the model.
    fn ffn(&mut self, _at: &LayerAt, _resid: &[f32], _xb: &[f32], _out: &mut [f32]) -> Result<FfnBy> {
        Ok(FfnBy::Model)
    }

    /// The model's FFN: the gate pre-activations `g`, `[rows][n_ff]`.
    fn gate(&mut self, _at: &LayerAt, _g: &[f32], _act: FfnActivation) {}

    /// The model's FFN: the gated activations `act(g)·u`, `[rows][n_ff]`;
    /// zeroing one skips its neuron.
    fn activations(&mut self, _at: &LayerAt, _acts: &mut [f32]) {}

    /// The model's FFN: per neuron 1 or 0, the neurons whose output
    /// [`partial_output`](Self::partial_output) should receive (those a
    /// runtime computes first, e.g. its hot set).
    fn partial_mask(&self, _layer: usize) -> Option<&[f32]> {
        None
    }

    /// The masked neurons' FFN output after any post-norm, `[rows][n_embd]`.
    fn partial_output(&mut self, _at: &LayerAt, _y: &[f32]) {}

    /// The layer's FFN output (before any post-norm and residual), whoever computed it.
    fn ffn_output(&mut self, _at: &LayerAt, _y: &[f32]) {}
}

/// The dense path: the model's own FFN, unwatched.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseFfn;

impl LayerHook for DenseFfn {}
