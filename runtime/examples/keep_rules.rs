//! Benchmark: the quality cost of a sparsity level under other keep rules
//! than the engine's, with every neuron's true activation (the oracle, as
//! [`Sparsifier`](leanstream_runtime::sparsity::Sparsifier) measures the
//! engine's rule). Rules: `activation` skips `|a| < t` (the engine's);
//! `down-weighted` skips `|a|·‖d_i‖ < t`, `d_i` the neuron's down column, so
//! a neuron is judged by the size of what it adds to the output. Allocations:
//! `uniform` gives every layer the target sparsity; `energy` spreads the same
//! mean over layers so that the dropped share of `Σ (|a|·‖d_i‖)²` grows
//! equally everywhere (greedy in 5% steps). Thresholds come from the
//! calibration text, quality from the held-out text.
//!
//! `cargo run --release -p leanstream-runtime --example keep_rules -- MODEL
//! TRAIN.txt HELDOUT.txt [SPARSITY]` prints one JSON line per rule and
//! allocation: perplexity over every 256-token chunk as a ratio to dense,
//! skipped share and top-1 agreement with dense, each at five scalings of
//! the thresholds (±1%) and their mean.

use std::error::Error;

use leanstream_kernels::dequant::dequantize_row;
use leanstream_runtime::generate::ingest_every_row_with;
use leanstream_runtime::model::{DenseFfn, LayerAt, LayerHook, Model};
use leanstream_runtime::perplexity::perplexity_with;

const CALIB_TOKENS: usize = 16384;
const CTX: usize = 256;
const CHUNKS: Option<usize> = None;
const STEP: f32 = 0.05;
/// Each rule runs with its thresholds scaled by these: the ratio moves by
/// about a point between neighbours (the held-out text is 2,921 scored
/// tokens), more than the rules differ, so one run ranks nothing.
const JITTERS: [f32; 5] = [0.99, 0.995, 1.0, 1.005, 1.01];

/// |value| histogram over log2 in [-40, 24), 1/64 octave a bin, with the
/// squared values summed per bin (the energy below a threshold).
struct Histogram {
    count: Vec<f64>,
    energy: Vec<f64>,
}

impl Histogram {
    const LOG2_MIN: f32 = -40.0;
    const PER_OCTAVE: f32 = 64.0;
    const BINS: usize = 64 * 64;

    fn new() -> Self {
        Self {
            count: vec![0.0; Self::BINS],
            energy: vec![0.0; Self::BINS],
        }
    }

    fn add(&mut self, v: f32) {
        let b = if v > 0.0 {
            ((v.log2() - Self::LOG2_MIN) * Self::PER_OCTAVE).clamp(0.0, (Self::BINS - 1) as f32) as usize
        } else {
            0
        };
        self.count[b] += 1.0;
        self.energy[b] += f64::from(v) * f64::from(v);
    }

    /// The threshold below which `share` of the values lie, and the share of
    /// the energy below it.
    fn quantile(&self, share: f32) -> (f32, f64) {
        let total: f64 = self.count.iter().sum();
        let total_energy: f64 = self.energy.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let want = f64::from(share) * total;
        let (mut below, mut below_energy) = (0.0, 0.0);
        for (b, (&c, &e)) in self.count.iter().zip(&self.energy).enumerate() {
            if c > 0.0 && below + c > want {
                let f = (want - below) / c;
                let log2 = Self::LOG2_MIN + (b as f32 + f as f32) / Self::PER_OCTAVE;
                return (log2.exp2(), (below_energy + f * e) / total_energy);
            }
            below += c;
            below_energy += e;
        }
        (f32::INFINITY, 1.0)
    }
}

/// Records, per layer, `|a|` and `|a|·‖d_i‖`.
struct Recorder<'a> {
    norms: &'a [Vec<f32>],
    activation: Vec<Histogram>,
    weighted: Vec<Histogram>,
}

impl LayerHook for Recorder<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let norms = &self.norms[at.layer];
        for row in acts.chunks_exact(norms.len()) {
            for (&a, &n) in row.iter().zip(norms) {
                self.activation[at.layer].add(a.abs());
                self.weighted[at.layer].add(a.abs() * n);
            }
        }
    }
}

/// Zeroes `a` where `|a|·w_i` is below the layer's threshold.
struct Skip<'a> {
    weights: Option<&'a [Vec<f32>]>,
    thresholds: Vec<f32>,
    skipped: u64,
    total: u64,
}

impl LayerHook for Skip<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let t = self.thresholds[at.layer];
        let n_ff = self.weights.map_or(acts.len(), |w| w[at.layer].len());
        for row in acts.chunks_exact_mut(n_ff) {
            for (i, a) in row.iter_mut().enumerate() {
                let w = self.weights.map_or(1.0, |w| w[at.layer][i]);
                if (*a * w).abs() < t {
                    *a = 0.0;
                    self.skipped += 1;
                }
            }
        }
        self.total += acts.len() as u64;
    }
}

/// ‖d_i‖ for every neuron of every layer.
fn down_column_norms(model: &Model) -> Result<Vec<Vec<f32>>, Box<dyn Error>> {
    let (n_embd, n_ff) = (model.config.n_embd, model.config.n_ff);
    let data = model.gguf.data();
    model
        .weights
        .layers
        .iter()
        .map(|l| {
            let down = l.ffn_down.as_ref().ok_or("the model has no FFN down matrix")?;
            let row_bytes = down.ty.row_bytes(n_ff)?;
            let mut squares = vec![0f64; n_ff];
            let mut row = vec![0f32; n_ff];
            for r in 0..n_embd {
                let at = down.offset + r * row_bytes;
                dequantize_row(down.ty, &data[at..at + row_bytes], &mut row)?;
                for (s, &v) in squares.iter_mut().zip(&row) {
                    *s += f64::from(v) * f64::from(v);
                }
            }
            Ok(squares.into_iter().map(|s| s.sqrt() as f32).collect())
        })
        .collect()
}

/// Per-layer sparsities with mean `target`: each 5% step goes to the layer
/// whose dropped energy share it raises least.
fn energy_allocation(weighted: &[Histogram], target: f32) -> Vec<f32> {
    let n_layer = weighted.len();
    let steps_per_layer = (1.0 / STEP).round() as usize;
    let curves: Vec<Vec<f64>> = weighted
        .iter()
        .map(|h| (0..=steps_per_layer).map(|k| h.quantile(k as f32 * STEP).1).collect())
        .collect();
    let mut at = vec![0usize; n_layer];
    for _ in 0..(target / STEP).round() as usize * n_layer {
        let cost = |l: usize| curves[l][at[l] + 1] - curves[l][at[l]];
        let Some(l) = (0..n_layer)
            .filter(|&l| at[l] < steps_per_layer - 1)
            .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        else {
            break;
        };
        at[l] += 1;
    }
    at.into_iter().map(|k| k as f32 * STEP).collect()
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model_path, train, heldout, rest @ ..] = args.as_slice() else {
        return Err("usage: keep_rules MODEL TRAIN.txt HELDOUT.txt [SPARSITY]".into());
    };
    let sparsity: f32 = rest.first().map_or(Ok(0.5), |s| s.parse())?;
    let model = Model::load(model_path)?;
    let train = std::fs::read_to_string(train)?;
    let heldout = std::fs::read_to_string(heldout)?;
    let n_layer = model.config.n_layer;
    let norms = down_column_norms(&model)?;

    let mut tokens = model.tokenizer.encode(&train, true, false);
    tokens.truncate(CALIB_TOKENS);
    let mut recorder = Recorder {
        norms: &norms,
        activation: (0..n_layer).map(|_| Histogram::new()).collect(),
        weighted: (0..n_layer).map(|_| Histogram::new()).collect(),
    };
    let mut state = model.new_state(CTX, CTX, 1);
    for window in tokens.chunks(CTX) {
        ingest_every_row_with(&model, &mut state, window, 0, &mut recorder)?;
    }

    let dense = perplexity_with(&model, &heldout, CTX, CHUNKS, false, &mut DenseFfn)?;
    let uniform = vec![sparsity; n_layer];
    let energy = energy_allocation(&recorder.weighted, sparsity);
    for (rule, histograms, weights) in [
        ("activation", &recorder.activation, None),
        ("down-weighted", &recorder.weighted, Some(norms.as_slice())),
    ] {
        for (allocation, levels) in [("uniform", &uniform), ("energy", &energy)] {
            let thresholds: Vec<f32> = histograms
                .iter()
                .zip(levels.iter())
                .map(|(h, &s)| h.quantile(s).0)
                .collect();
            let mut runs = Vec::new();
            for jitter in JITTERS {
                let mut skip = Skip {
                    weights,
                    thresholds: thresholds.iter().map(|t| t * jitter).collect(),
                    skipped: 0,
                    total: 0,
                };
                let p = perplexity_with(&model, &heldout, CTX, CHUNKS, false, &mut skip)?;
                runs.push(serde_json::json!({
                    "threshold_scale": jitter,
                    "ppl_ratio": p.ppl / dense.ppl,
                    "skipped": skip.skipped as f64 / skip.total.max(1) as f64,
                    "top1_agreement": p.top1_agreement(&dense),
                }));
            }
            let mean = |key: &str| runs.iter().filter_map(|r| r[key].as_f64()).sum::<f64>() / runs.len() as f64;
            let line = serde_json::json!({
                "rule": rule,
                "allocation": allocation,
                "layer_sparsity": levels,
                "dense_ppl": dense.ppl,
                "ppl_ratio_mean": mean("ppl_ratio"),
                "skipped_mean": mean("skipped"),
                "top1_agreement_mean": mean("top1_agreement"),
                "runs": runs,
            });
            println!("{line}");
        }
    }
    Ok(())
}
