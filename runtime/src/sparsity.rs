//! Training-free activation sparsity for gated FFNs (SwiGLU, GeGLU): a neuron
//! is skipped when the magnitude of its gated activation `act(g·x)·(u·x)` is
//! below its layer's threshold. Thresholds are calibrated on real text so that
//! a target fraction of neurons falls below them, layer by layer.
//!
//! Calibration records a log-scale histogram of |activation| per layer while
//! the dense model runs ([`Calibrator`], a layer hook); a threshold is the
//! histogram's quantile at the target sparsity. Applying thresholds in the
//! dense forward pass ([`Sparsifier`]) measures the quality cost of a
//! sparsity level without any streaming: the oracle upper bound for every
//! predictor.

use serde::{Deserialize, Serialize};

use crate::generate::ingest_every_row_with;
use crate::model::{LayerAt, LayerHook, Model};
use crate::{Result, RuntimeError};
use leanstream_kernels::sparse_ffn::FfnActivation;

/// Histogram bins over log2 |a| in [LOG2_MIN, LOG2_MAX): 1/64 octave each (~1.1%).
const BINS_PER_OCTAVE: usize = 64;
const LOG2_MIN: i32 = -40;
const LOG2_MAX: i32 = 24;
const N_BINS: usize = (LOG2_MAX - LOG2_MIN) as usize * BINS_PER_OCTAVE;

/// Per-layer histograms of |activation|, exact zeros counted apart.
#[derive(Debug, Clone)]
pub struct ActivationHistogram {
    n_layer: usize,
    bins: Vec<u64>,
    zeros: Vec<u64>,
}

impl ActivationHistogram {
    pub fn new(n_layer: usize) -> Self {
        Self {
            n_layer,
            bins: vec![0; n_layer * N_BINS],
            zeros: vec![0; n_layer],
        }
    }

    fn bin(v: f32) -> usize {
        let l = v.abs().log2();
        (((l - LOG2_MIN as f32) * BINS_PER_OCTAVE as f32) as isize).clamp(0, N_BINS as isize - 1) as usize
    }

    /// Lower edge of a bin, as a magnitude.
    fn edge(bin: usize) -> f32 {
        (LOG2_MIN as f32 + bin as f32 / BINS_PER_OCTAVE as f32).exp2()
    }

    pub fn record(&mut self, layer: usize, activations: &[f32]) {
        let mut bins = self.layer_bins(layer);
        for &a in activations {
            bins.add(a);
        }
    }

    fn layer_bins(&mut self, layer: usize) -> LayerBins<'_> {
        LayerBins {
            bins: &mut self.bins[layer * N_BINS..(layer + 1) * N_BINS],
            zeros: &mut self.zeros[layer],
        }
    }

    pub fn count(&self, layer: usize) -> u64 {
        self.zeros[layer] + self.bins[layer * N_BINS..(layer + 1) * N_BINS].iter().sum::<u64>()
    }

    /// The magnitude below which a fraction `sparsity` of this layer's
    /// recorded activations lie (0 for sparsity 0).
    pub fn threshold(&self, layer: usize, sparsity: f32) -> f32 {
        let total = self.count(layer);
        let target = (sparsity.clamp(0.0, 1.0) as f64 * total as f64).round() as u64;
        if target == 0 {
            return 0.0;
        }
        let mut below = self.zeros[layer];
        for (b, &c) in self.bins[layer * N_BINS..(layer + 1) * N_BINS].iter().enumerate() {
            if below + c > target {
                // The threshold is the upper edge of the last bin wholly below the target.
                return Self::edge(b);
            }
            below += c;
        }
        f32::INFINITY
    }

    pub fn n_layer(&self) -> usize {
        self.n_layer
    }
}

/// One layer's bins, borrowed for recording.
struct LayerBins<'a> {
    bins: &'a mut [u64],
    zeros: &'a mut u64,
}

impl LayerBins<'_> {
    #[inline]
    fn add(&mut self, a: f32) {
        if a == 0.0 {
            *self.zeros += 1;
        } else {
            self.bins[ActivationHistogram::bin(a)] += 1;
        }
    }
}

/// Calibration's hook: records magnitudes of the gated activation
/// `act(g)·u` and of the gate alone `act(g)` (what a policy holding only
/// gate rows can threshold), and each neuron's summed |act(g)·u|.
#[derive(Debug, Clone)]
pub struct Calibrator {
    full: ActivationHistogram,
    gate: ActivationHistogram,
    /// Per (layer, neuron): sum of |act(g)·u| over the rows seen, and the
    /// rows per layer (the mean ranks neurons for a hot set).
    sum_abs: Vec<f64>,
    rows: Vec<u64>,
    n_ff: usize,
}

impl Calibrator {
    pub fn new(n_layer: usize, n_ff: usize) -> Self {
        Self {
            full: ActivationHistogram::new(n_layer),
            gate: ActivationHistogram::new(n_layer),
            sum_abs: vec![0.0; n_layer * n_ff],
            rows: vec![0; n_layer],
            n_ff,
        }
    }
}

impl LayerHook for Calibrator {
    fn gate(&mut self, at: &LayerAt, g: &[f32], act: FfnActivation) {
        let mut bins = self.gate.layer_bins(at.layer);
        for &v in g {
            bins.add(act.apply(v, 1.0));
        }
    }

    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let (layer, n_ff) = (at.layer, self.n_ff);
        self.full.record(layer, acts);
        let sums = &mut self.sum_abs[layer * n_ff..(layer + 1) * n_ff];
        for row in acts.chunks_exact(n_ff) {
            for (s, &a) in sums.iter_mut().zip(row) {
                *s += a.abs() as f64;
            }
            self.rows[layer] += 1;
        }
    }
}

/// Zeroes activations below the layer's threshold in the dense pass,
/// counting what was skipped: the quality cost of a sparsity level without
/// any streaming.
#[derive(Debug, Clone)]
pub struct Sparsifier {
    thresholds: Vec<f32>,
    skipped: u64,
    total: u64,
}

impl Sparsifier {
    pub fn new(thresholds: Vec<f32>) -> Self {
        Self {
            thresholds,
            skipped: 0,
            total: 0,
        }
    }

    /// Fraction of neurons skipped so far.
    pub fn skipped_fraction(&self) -> Option<f64> {
        (self.total > 0).then(|| self.skipped as f64 / self.total as f64)
    }
}

impl LayerHook for Sparsifier {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let t = self.thresholds[at.layer];
        for a in acts.iter_mut() {
            if a.abs() < t {
                *a = 0.0;
                self.skipped += 1;
            }
        }
        self.total += acts.len() as u64;
    }
}

/// Per-layer thresholds for one target sparsity: what calibration measures,
/// what a calibration file (JSON) and a `.lsflash` header store.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SparsityLevel {
    /// Target fraction of neurons skipped, in [0, 1).
    pub sparsity: f32,
    /// Per layer, on |act(g)·u|: the exact criterion.
    #[serde(rename = "per_layer")]
    pub full: Vec<f32>,
    /// Per layer, on |act(g)|, calibrated to the same sparsity: the criterion
    /// of a policy that decides from gate rows alone (`gate-first`).
    #[serde(rename = "gate_per_layer", default)]
    pub gate: Vec<f32>,
}

impl SparsityLevel {
    /// How far a requested sparsity may be from a stored level's and still
    /// name it (levels are written as decimal flags, read back as f32).
    pub const MATCH: f32 = 1e-4;

    /// No neuron skipped.
    pub fn dense(n_layer: usize) -> Self {
        Self {
            sparsity: 0.0,
            full: vec![0.0; n_layer],
            gate: vec![0.0; n_layer],
        }
    }

    /// Whether this level is the one asked for as `sparsity`.
    pub fn is(&self, sparsity: f32) -> bool {
        (self.sparsity - sparsity).abs() < Self::MATCH
    }

    /// This level, checked to cover a model of `n_layer` layers with both criteria.
    pub fn for_layers(&self, n_layer: usize) -> Result<Self> {
        if self.full.len() != n_layer || self.gate.len() != n_layer {
            return Err(RuntimeError::Invalid(format!(
                "thresholds for sparsity {} cover {} (full) and {} (gate) layers; the model has {n_layer} \
                 (re-run calibrate with this build to get gate thresholds)",
                self.sparsity,
                self.full.len(),
                self.gate.len()
            )));
        }
        Ok(self.clone())
    }
}

/// The calibration file: thresholds for several sparsities and what they were made from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    pub model: String,
    pub text: String,
    pub tokens: usize,
    pub levels: Vec<SparsityLevel>,
    /// Per layer, each neuron's mean |act(g)·u| (ranks a static hot set).
    #[serde(default)]
    pub neuron_scores: Vec<Vec<f32>>,
}

/// What [`calibrate`] measured.
#[derive(Debug, Clone)]
pub struct Calibrated {
    pub levels: Vec<SparsityLevel>,
    /// Per layer, each neuron's mean |act(g)·u|.
    pub neuron_scores: Vec<Vec<f32>>,
    pub tokens: usize,
}

impl Calibration {
    pub fn level(&self, sparsity: f32) -> Option<&SparsityLevel> {
        self.levels.iter().find(|l| l.is(sparsity))
    }

    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| RuntimeError::io(path, e))?;
        let cal: Self = serde_json::from_str(&text).map_err(|e| RuntimeError::Corrupt {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        if cal
            .levels
            .iter()
            .any(|l| l.full.iter().chain(&l.gate).any(|t| t.is_nan() || *t < 0.0))
        {
            return Err(RuntimeError::Corrupt {
                path: path.to_path_buf(),
                problem: "negative or NaN threshold".into(),
            });
        }
        Ok(cal)
    }
}

/// How much of a calibration text to run, and whether to show progress.
#[derive(Debug, Clone, Copy)]
pub struct CalibrationRun {
    /// Context of each window (each runs from position 0).
    pub ctx: usize,
    /// Stop after this many tokens of the text (the cost is a dense prefill
    /// of the tokens run, so this bounds it at 7B scale).
    pub max_tokens: Option<usize>,
    pub progress: bool,
}

impl CalibrationRun {
    /// All of the text in windows of `ctx`, no progress bar.
    pub fn windows_of(ctx: usize) -> Self {
        Self {
            ctx,
            max_tokens: None,
            progress: false,
        }
    }
}

/// Runs `text` through the dense model in windows of `ctx` tokens and returns
/// thresholds for each of `sparsities` and each neuron's mean |activation|.
pub fn calibrate(model: &Model, text: &str, ctx: usize, sparsities: &[f32]) -> Result<Calibrated> {
    calibrate_run(model, text, CalibrationRun::windows_of(ctx), sparsities)
}

/// `calibrate` with a token limit and progress.
pub fn calibrate_run(model: &Model, text: &str, run: CalibrationRun, sparsities: &[f32]) -> Result<Calibrated> {
    let mut tokens = model.tokenizer.encode(text, true, false);
    if tokens.len() < 2 {
        return Err(RuntimeError::Invalid("calibration text is too short".into()));
    }
    if run.ctx == 0 {
        return Err(RuntimeError::Invalid("calibration context 0".into()));
    }
    tokens.truncate(run.max_tokens.unwrap_or(usize::MAX).max(2));
    let windows: Vec<&[u32]> = tokens.chunks(run.ctx).collect();
    calibrate_windows(model, &windows, sparsities, run.progress)
}

/// `calibrate` over token windows already cut (each runs from position 0).
pub fn calibrate_windows(model: &Model, windows: &[&[u32]], sparsities: &[f32], progress: bool) -> Result<Calibrated> {
    if let Some(bad) = sparsities.iter().find(|s| !(0.0..1.0).contains(*s)) {
        return Err(RuntimeError::Invalid(format!("sparsity {bad} outside [0, 1)")));
    }
    let ctx = windows.iter().map(|w| w.len()).max().unwrap_or(0);
    if ctx == 0 {
        return Err(RuntimeError::Invalid("no calibration tokens".into()));
    }
    let n_layer = model.config.n_layer;
    let mut st = model.new_state(ctx, ctx.min(512), 1);
    let mut cal = Calibrator::new(n_layer, model.config.n_ff);
    let total: usize = windows.iter().map(|w| w.len()).sum();
    let bar = crate::progress::bar(
        total as u64,
        progress,
        "calibrate {bar:30} {pos}/{len} tokens, {per_sec}, ETA {eta}",
    );
    for window in windows {
        // Not the last row of each window alone at the last layer.
        ingest_every_row_with(model, &mut st, window, 0, &mut cal)?;
        bar.inc(window.len() as u64);
    }
    bar.finish_and_clear();
    let Calibrator {
        full,
        gate,
        sum_abs,
        rows,
        ..
    } = &cal;
    let levels = sparsities
        .iter()
        .map(|&s| SparsityLevel {
            sparsity: s,
            full: (0..n_layer).map(|l| full.threshold(l, s)).collect(),
            gate: (0..n_layer).map(|l| gate.threshold(l, s)).collect(),
        })
        .collect();
    let n_ff = model.config.n_ff;
    let neuron_scores = (0..n_layer)
        .map(|l| {
            let n = rows[l].max(1) as f64;
            sum_abs[l * n_ff..(l + 1) * n_ff]
                .iter()
                .map(|&s| (s / n) as f32)
                .collect()
        })
        .collect();
    Ok(Calibrated {
        levels,
        neuron_scores,
        tokens: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_split_recorded_values_at_the_target_fraction() {
        let mut h = ActivationHistogram::new(1);
        let values: Vec<f32> = (1..=10_000)
            .map(|i| i as f32 * 0.001 * if i % 2 == 0 { -1.0 } else { 1.0 })
            .collect();
        h.record(0, &values);
        for s in [0.25f32, 0.5, 0.8] {
            let t = h.threshold(0, s);
            let below = values.iter().filter(|v| v.abs() < t).count() as f32 / values.len() as f32;
            assert!(
                (below - s).abs() < 0.02,
                "sparsity {s}: threshold {t} puts {below} below"
            );
        }
        assert_eq!(h.threshold(0, 0.0), 0.0);
    }

    #[test]
    fn sparsify_zeroes_below_threshold_and_counts() {
        let mut hook = Sparsifier::new(vec![0.5]);
        let mut a = [0.1, -0.6, 0.49, 2.0];
        let at = LayerAt {
            layer: 0,
            rows: 0..1,
            pos0: 0,
        };
        hook.activations(&at, &mut a);
        assert_eq!(a, [0.0, -0.6, 0.0, 2.0]);
        assert_eq!(hook.skipped_fraction(), Some(0.5));
    }
}
