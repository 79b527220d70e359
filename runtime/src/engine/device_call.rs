//! An FFN call whose arithmetic runs on another device (the GPU engine of
//! `leanstream-cuda`): the policy decides here, as for the CPU's tail, and
//! asks the streamer for the bundles; the device then computes the neurons
//! the streamer was asked for and lands, keeping what [`DeviceCall`] says.
//! So every policy, its predictor, controller and cache are the CPU
//! engine's own, and a device that keeps the same neurons sums the same
//! ones in the same (ascending id) order.
//!
//! What the device does not get: the bundles a merged read spans beyond
//! those asked for (`speculate` computes them on the CPU at no I/O cost;
//! the device's slot table is written when the layer begins, before the
//! reads that span them are formed), refinement between stages (the partial
//! output would have to come back over the bus each stage; `speculate` runs
//! its table's actions in one stage there) and the compute time per neuron
//! that `speculate`'s deadline is set from (so it sets none on the device).

use std::time::Instant;

use super::plan::{keeps, CallCost, Select};
use super::source::Source;
use super::{FlashEngine, Policy, Streamer};
use crate::{Result, RuntimeError};

/// What one layer keeps when a device computes it; the reads are asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceCall {
    /// Neurons with `|act(g)·u|` below this are dropped (0: keep all that
    /// were computed); ignored where `rows` is given.
    pub threshold: f32,
    /// Per row, a bitmap over neuron ids (`words` u64 each) of what the row
    /// keeps (`gate-first`, `oracle`).
    pub rows: Option<Vec<u64>>,
    /// Words per row of `rows`.
    pub words: usize,
    /// Reads not landed by then are skipped (`None`: wait for every one).
    pub deadline: Option<Instant>,
}

impl DeviceCall {
    /// Row `t`'s bitmap of what it keeps, if the plan gives bitmaps (empty,
    /// keeping nothing, for a row the call does not have).
    pub fn row(&self, t: usize) -> Option<&[u64]> {
        let w = self.words;
        self.rows
            .as_deref()
            .map(|r| r.get(t * w..(t + 1) * w).unwrap_or_default())
    }

    /// Whether row `t` keeps neuron `i` with activation `a`.
    pub fn keeps(&self, t: usize, i: usize, a: f32) -> bool {
        keeps(self.threshold, self.row(t), i, a)
    }
}

impl FlashEngine {
    /// Whether the policy's decisions read the layer's rows (its residual
    /// and normed FFN input): a device must copy them back before
    /// [`plan_device_call`](Self::plan_device_call).
    pub fn reads_rows(&self) -> bool {
        let p = self.plan.kind();
        p.predicts() || p == Policy::GateFirst
    }

    /// The streamer a streaming policy reads through.
    pub fn streamer(&self) -> Option<&Streamer> {
        match &self.source {
            Source::Stream(s) => Some(s),
            Source::Resident(_) => None,
        }
    }

    pub fn streamer_mut(&mut self) -> Option<&mut Streamer> {
        match &mut self.source {
            Source::Stream(s) => Some(s),
            Source::Resident(_) => None,
        }
    }

    /// Before layer `layer`'s attention, on a device: its input rows `x`,
    /// `[n][n_embd]`, where [`reads_rows`](Self::reads_rows) (the policies
    /// that predict from a layer's input start its reads here, and
    /// `speculate` takes its controller's action for the layer).
    pub fn device_layer_input(&mut self, layer: usize, x: &[f32], n: usize) -> Result<()> {
        let rows = n * self.tail.n_embd();
        if layer >= self.n_layer || x.len() != rows {
            return Err(RuntimeError::Invalid(format!(
                "layer {layer}'s input: {} values given, {rows} needed ({} layers)",
                x.len(),
                self.n_layer
            )));
        }
        if let Source::Stream(s) = &mut self.source {
            s.ignore_spans();
        }
        self.plan.layer_input(layer, x, n, &mut self.source)
    }

    /// Layer `layer`'s FFN call of `n` rows, decided by the policy for a
    /// device that computes it: `resid` and `xb` are the rows as the CPU's
    /// hook gets them, `[n][n_embd]` (empty where
    /// [`reads_rows`](Self::reads_rows) is false). The streamer has been
    /// asked for the layer's bundles (and the reads ahead queued); the
    /// device lands them (`Streamer::hits`, `next_run_until`) and calls
    /// [`finish_device_call`](Self::finish_device_call).
    pub fn plan_device_call(&mut self, layer: usize, n: usize, resid: &[f32], xb: &[f32]) -> Result<DeviceCall> {
        if !self.plan.kind().streams() {
            return Err(RuntimeError::Invalid(
                "the dense policy holds its bundles in memory: a device uploads them instead".into(),
            ));
        }
        if self.recorder.is_some() {
            return Err(RuntimeError::Invalid(
                "an engine that records its kept sets computes them itself, not on a device".into(),
            ));
        }
        if layer >= self.n_layer || n == 0 {
            return Err(RuntimeError::Invalid(format!(
                "device call of layer {layer} with {n} rows ({} layers)",
                self.n_layer
            )));
        }
        let rows = n * self.tail.n_embd();
        if self.reads_rows() && (resid.len() != rows || xb.len() != rows) {
            return Err(RuntimeError::Invalid(format!(
                "the {} policy reads layer {layer}'s rows: {} residual and {} input values given, {rows} needed",
                self.plan.kind(),
                resid.len(),
                xb.len()
            )));
        }
        if let Source::Stream(s) = &mut self.source {
            s.ignore_spans();
        }
        let call = self.layer_call(layer, n, resid, xb);
        let words = self.tail.words();
        let plan = self.plan.plan(&call, &mut self.source, &self.tail)?;
        let (threshold, rows) = match plan.select {
            Select::Threshold(t) => (t, None),
            Select::Rows(bits) => (0.0, Some(bits[..n * words].to_vec())),
        };
        Ok(DeviceCall {
            threshold,
            rows,
            words,
            deadline: plan.deadline,
        })
    }

    /// After the device's kernels for `layer` are launched and its bundles
    /// landed: the policy's bookkeeping, then the streamer goes on.
    pub fn finish_device_call(&mut self, layer: usize) {
        // The device's compute time is not measured: a zero cost is one
        // the policies' meters ignore.
        self.tail.last = CallCost::default();
        self.finish_call(layer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_keeps_what_the_cpu_tail_keeps() {
        // By threshold: not below it (NaN is not below anything, as the
        // tail's partial_cmp has it).
        assert!(keeps(0.5, None, 3, 0.5) && keeps(0.5, None, 3, -0.7) && keeps(0.5, None, 3, f32::NAN));
        assert!(!keeps(0.5, None, 3, 0.49) && !keeps(0.5, None, 3, -0.2));
        assert!(keeps(0.0, None, 3, 0.0));
        // By a row's bitmap, whatever the activation.
        let call = DeviceCall {
            threshold: 0.0,
            rows: Some(vec![0b1010, 1 << 63, 0, 1]),
            words: 2,
            deadline: None,
        };
        assert!(call.keeps(0, 1, 0.0) && call.keeps(0, 3, -9.0) && call.keeps(0, 127, 1.0));
        assert!(!call.keeps(0, 0, 9.0) && !call.keeps(0, 2, 9.0) && !call.keeps(0, 64, 9.0));
        assert!(call.keeps(1, 64, 0.1) && !call.keeps(1, 0, 0.1));
        // A row the call does not have keeps nothing rather than panicking.
        assert_eq!(call.row(2), Some(&[][..]));
        assert!(!call.keeps(2, 1, 1.0));
    }
}
