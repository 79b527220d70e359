//! Benchmark: the quality cost of a sparsity level under other keep rules
//! than the engine's, with every neuron's true activation (the oracle, as
//! [`Sparsifier`](leanstream_runtime::sparsity::Sparsifier) measures the
//! engine's rule). Rules: `activation` skips `|a| < t` (the engine's);
//! `down-weighted` skips `|a|·‖d_i‖ < t`, `d_i` the neuron's down column, so
//! a neuron is judged by the size of what it adds to the output;
//! `post-norm-weighted` (models with a norm after the FFN, Gemma 3) skips
//! `|a|·‖w ⊙ d_i‖ < t`, `w` that norm's weight, which scales each output
//! dimension before the residual sees it. Allocations:
//! `uniform` gives every layer the target sparsity; `energy` spreads the same
//! mean over layers so that the dropped share of `Σ (|a|·‖d_i‖)²` grows
//! equally everywhere (greedy in 5% steps); `sensitivity` picks the levels
//! that minimize the summed end-to-end costs of the layers, each measured
//! alone (KL divergence from dense at each level, on more of the
//! calibration text; `KEEP_RULES_COSTS=FILE` keeps them for a re-run).
//! Thresholds come from the calibration text, quality from the held-out
//! text.
//!
//! `cargo run --release -p leanstream-runtime --example keep_rules -- MODEL
//! TRAIN.txt HELDOUT.txt [SPARSITY]` prints one JSON line per rule and
//! allocation: perplexity over every 256-token chunk as a ratio to dense,
//! skipped share and top-1 agreement with dense, each at five scalings of
//! the thresholds (±1%) and their mean. A skipped neuron is zeroed, or
//! (`fill` `mean`) set to its mean below the threshold on the calibration
//! text. `KEEP_RULES=rule,...`, `KEEP_RULES_ALLOCATIONS=...` and
//! `KEEP_RULES_FILL=zero,mean` choose what runs (default: every rule and
//! allocation, zero fill).

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
/// Sensitivity: chunks of the calibration text each layer's levels are scored on.
const SENSITIVITY_CHUNKS: usize = 4;
const SENSITIVITY_LEVELS: [f32; 8] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8];
const MIN_LEVEL: f32 = 0.2;

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

/// A keep rule: `|a|`, or `|a|` times a per-neuron weight.
struct Rule {
    name: &'static str,
    weights: Option<Vec<Vec<f32>>>,
}

/// Records, per rule and layer, the rule's values.
struct Recorder<'a> {
    rules: &'a [Rule],
    histograms: Vec<Vec<Histogram>>,
}

impl LayerHook for Recorder<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        for (rule, h) in self.rules.iter().zip(&mut self.histograms) {
            let h = &mut h[at.layer];
            match &rule.weights {
                None => acts.iter().for_each(|a| h.add(a.abs())),
                Some(w) => {
                    let w = &w[at.layer];
                    for row in acts.chunks_exact(w.len()) {
                        row.iter().zip(w).for_each(|(a, n)| h.add(a.abs() * n));
                    }
                }
            }
        }
    }
}

/// Zeroes `a` where `|a|·w_i` is below the layer's threshold.
/// Or, with `fill`, replaces it by the neuron's mean below the threshold.
struct Skip<'a> {
    n_ff: usize,
    weights: Option<&'a [Vec<f32>]>,
    thresholds: Vec<f32>,
    fill: Option<&'a [Vec<f32>]>,
    skipped: u64,
    total: u64,
}

impl<'a> Skip<'a> {
    fn new(n_ff: usize, weights: Option<&'a [Vec<f32>]>, thresholds: Vec<f32>) -> Self {
        Self {
            n_ff,
            weights,
            thresholds,
            fill: None,
            skipped: 0,
            total: 0,
        }
    }
}

impl LayerHook for Skip<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let t = self.thresholds[at.layer];
        for row in acts.chunks_exact_mut(self.n_ff) {
            for (i, a) in row.iter_mut().enumerate() {
                let w = self.weights.map_or(1.0, |w| w[at.layer][i]);
                if (*a * w).abs() < t {
                    *a = self.fill.map_or(0.0, |f| f[at.layer][i]);
                    self.skipped += 1;
                }
            }
        }
        self.total += acts.len() as u64;
    }
}

/// Each neuron's mean activation over the calibration rows where a rule
/// skips it: what a skipped neuron adds on average. The engine could add
/// it at no read cost: `Σ_skipped m_i d_i` is a per-layer constant
/// `Σ_i m_i d_i` less the kept neurons' `m_i d_i`, whose columns it reads
/// anyway.
struct SkippedMean<'a> {
    skip: Skip<'a>,
    sum: Vec<Vec<f64>>,
    count: Vec<Vec<u32>>,
}

impl LayerHook for SkippedMean<'_> {
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let (sum, count) = (&mut self.sum[at.layer], &mut self.count[at.layer]);
        let mut kept = acts.to_vec();
        self.skip.activations(at, &mut kept);
        for (row, kept) in acts.chunks_exact(self.skip.n_ff).zip(kept.chunks_exact(self.skip.n_ff)) {
            for (i, (&a, &k)) in row.iter().zip(kept).enumerate() {
                if k == 0.0 && a != 0.0 {
                    sum[i] += f64::from(a);
                    count[i] += 1;
                }
            }
        }
    }
}

impl SkippedMean<'_> {
    fn means(&self) -> Vec<Vec<f32>> {
        self.sum
            .iter()
            .zip(&self.count)
            .map(|(s, c)| {
                s.iter()
                    .zip(c)
                    .map(|(&s, &c)| (s / f64::from(c.max(1))) as f32)
                    .collect()
            })
            .collect()
    }
}

/// ‖d_i‖ for every neuron of every layer, or with `post_norm` ‖w ⊙ d_i‖,
/// `w` the layer's post-FFN norm weight (`None` if the model has none).
fn down_column_norms(model: &Model, post_norm: bool) -> Result<Option<Vec<Vec<f32>>>, Box<dyn Error>> {
    if post_norm && !model.has_ffn_post_norm() {
        return Ok(None);
    }
    let (n_embd, n_ff) = (model.config.n_embd, model.config.n_ff);
    let data = model.gguf.data();
    model
        .weights
        .layers
        .iter()
        .map(|l| {
            let down = l.ffn_down.as_ref().ok_or("the model has no FFN down matrix")?;
            let scale = |r: usize| match (post_norm, &l.ffn_post_norm) {
                (true, Some(w)) => f64::from(w[r]),
                _ => 1.0,
            };
            let row_bytes = down.ty.row_bytes(n_ff)?;
            let mut squares = vec![0f64; n_ff];
            let mut row = vec![0f32; n_ff];
            for r in 0..n_embd {
                let at = down.offset + r * row_bytes;
                dequantize_row(down.ty, &data[at..at + row_bytes], &mut row)?;
                let k = scale(r);
                for (s, &v) in squares.iter_mut().zip(&row) {
                    *s += (k * f64::from(v)).powi(2);
                }
            }
            Ok(squares.into_iter().map(|s| s.sqrt() as f32).collect())
        })
        .collect::<Result<_, Box<dyn Error>>>()
        .map(Some)
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

/// The dense model's `TOP` most likely tokens and their log-probabilities
/// at every scored row: what a sparsified run's KL divergence is taken against.
const TOP: usize = 64;

/// Runs the chunks (each from position 0; the second half scored, as
/// perplexity scores) through `model` with `hook` and hands each scored
/// row's logits to `f`.
fn scored_rows(
    model: &Model,
    chunks: &[Vec<u32>],
    hook: &mut dyn LayerHook,
    mut f: impl FnMut(&[f32]),
) -> Result<(), Box<dyn Error>> {
    let mut st = model.new_state(CTX, CTX, CTX / 2);
    for c in chunks {
        model.forward_with(&mut st, c, 0, CTX / 2..CTX, hook)?;
        let logits = model.logits(&mut st, 0, CTX / 2)?;
        for row in logits.chunks_exact(model.config.n_vocab) {
            f(row);
        }
    }
    Ok(())
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// Each layer's cost of its own sparsity: the mean KL divergence (over the
/// dense model's top tokens) from dense to a run with only that layer
/// sparsified, on `SENSITIVITY_CHUNKS` chunks of the calibration text, at
/// each level of `SENSITIVITY_LEVELS` (0 costs nothing). KL needs no target
/// token, so it is far less noisy than the perplexity on the same tokens.
fn layer_sensitivity(model: &Model, tokens: &[u32], activation: &[Histogram]) -> Result<Vec<Vec<f64>>, Box<dyn Error>> {
    let n_layer = activation.len();
    let bos = model.tokenizer.bos().filter(|_| model.tokenizer.add_bos());
    let chunks: Vec<Vec<u32>> = tokens
        .chunks_exact(CTX)
        .take(SENSITIVITY_CHUNKS)
        .map(|c| {
            let mut c = c.to_vec();
            if let Some(b) = bos {
                c[0] = b;
            }
            c
        })
        .collect();
    let mut reference: Vec<Vec<(usize, f64)>> = Vec::new();
    scored_rows(model, &chunks, &mut DenseFfn, |row| {
        let lp = log_softmax(row);
        let mut idx: Vec<usize> = (0..lp.len()).collect();
        idx.select_nth_unstable_by(TOP, |&a, &b| lp[b].total_cmp(&lp[a]));
        reference.push(idx[..TOP].iter().map(|&i| (i, lp[i])).collect());
    })?;
    let mut costs = vec![vec![0.0; SENSITIVITY_LEVELS.len() + 1]; n_layer];
    for (l, h) in activation.iter().enumerate() {
        for (k, &s) in SENSITIVITY_LEVELS.iter().enumerate() {
            let mut thresholds = vec![0.0; n_layer];
            thresholds[l] = h.quantile(s).0;
            let mut skip = Skip::new(model.config.n_ff, None, thresholds);
            let (mut kl, mut r) = (0.0, 0);
            scored_rows(model, &chunks, &mut skip, |row| {
                let lq = log_softmax(row);
                kl += reference[r].iter().map(|&(i, lp)| lp.exp() * (lp - lq[i])).sum::<f64>();
                r += 1;
            })?;
            costs[l][k + 1] = kl / r.max(1) as f64;
        }
        eprintln!("sensitivity of layer {l}: {:?}", costs[l]);
    }
    Ok(costs)
}

/// Per-layer sparsities from `SENSITIVITY_LEVELS` with mean `target` (to
/// the grid's step) that minimize the summed costs: the layers' costs taken
/// as additive, solved exactly by dynamic programming over the summed steps.
/// Levels below `MIN_LEVEL` are not offered: any change at all costs these
/// small models a KL floor (rounding differences grow through the layers,
/// about 0.005 here whatever the layer), which does not add up over layers,
/// so a layer left dense would look like a saving it is not.
fn sensitivity_allocation(costs: &[Vec<f64>], target: f32) -> Vec<f32> {
    let step = SENSITIVITY_LEVELS[0];
    let first = (MIN_LEVEL / step).round() as usize;
    let total = (target / step * costs.len() as f32).round() as usize;
    // best[l][u]: least cost of layers 0..l using u steps; from[l][u] the level of layer l-1.
    let mut best = vec![vec![f64::INFINITY; total + 1]; costs.len() + 1];
    let mut from = vec![vec![0usize; total + 1]; costs.len() + 1];
    best[0][0] = 0.0;
    for (l, c) in costs.iter().enumerate() {
        for u in 0..=total {
            if !best[l][u].is_finite() {
                continue;
            }
            for (k, &ck) in c.iter().enumerate().skip(first) {
                if u + k <= total && best[l][u] + ck < best[l + 1][u + k] {
                    best[l + 1][u + k] = best[l][u] + ck;
                    from[l + 1][u + k] = k;
                }
            }
        }
    }
    let mut out = vec![0.0; costs.len()];
    let mut u = total;
    for l in (0..costs.len()).rev() {
        let k = from[l + 1][u];
        out[l] = k as f32 * step;
        u -= k;
    }
    out
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
    let (n_layer, n_ff) = (model.config.n_layer, model.config.n_ff);
    let mut rules = vec![
        Rule {
            name: "activation",
            weights: None,
        },
        Rule {
            name: "down-weighted",
            weights: down_column_norms(&model, false)?,
        },
    ];
    if let Some(w) = down_column_norms(&model, true)? {
        rules.push(Rule {
            name: "post-norm-weighted",
            weights: Some(w),
        });
    }
    // KEEP_RULES, KEEP_RULES_ALLOCATIONS, KEEP_RULES_FILL: comma lists of what to run.
    let chosen =
        |var: &str, name: &str, default: bool| std::env::var(var).map_or(default, |o| o.split(',').any(|r| r == name));

    let mut tokens = model.tokenizer.encode(&train, true, false);
    tokens.truncate(CALIB_TOKENS);
    let mut recorder = Recorder {
        rules: &rules,
        histograms: rules
            .iter()
            .map(|_| (0..n_layer).map(|_| Histogram::new()).collect())
            .collect(),
    };
    let mut state = model.new_state(CTX, CTX, 1);
    for window in tokens.chunks(CTX) {
        ingest_every_row_with(&model, &mut state, window, 0, &mut recorder)?;
    }

    let dense = perplexity_with(&model, &heldout, CTX, CHUNKS, false, &mut DenseFfn)?;
    let uniform = vec![sparsity; n_layer];
    // (The first two rules: `|a|`, then `|a|·‖d_i‖`.)
    let (activation, weighted) = (&recorder.histograms[0], &recorder.histograms[1]);
    let energy = energy_allocation(weighted, sparsity);
    // The sensitivity runs on the calibration text past the tokens the thresholds came from.
    let all_train = model.tokenizer.encode(&train, true, false);
    // KEEP_RULES_COSTS=FILE keeps them (made once, read back after).
    let costs_file = std::env::var_os("KEEP_RULES_COSTS").map(std::path::PathBuf::from);
    let costs: Vec<Vec<f64>> = match &costs_file {
        _ if !chosen("KEEP_RULES_ALLOCATIONS", "sensitivity", true) => {
            vec![vec![0.0; SENSITIVITY_LEVELS.len() + 1]; n_layer]
        }
        Some(f) if f.exists() => serde_json::from_str(&std::fs::read_to_string(f)?)?,
        _ => {
            let c = layer_sensitivity(&model, &all_train[tokens.len()..], activation)?;
            if let Some(f) = &costs_file {
                std::fs::write(f, serde_json::to_string(&c)?)?;
            }
            c
        }
    };
    let sensitivity = sensitivity_allocation(&costs, sparsity);
    eprintln!("sensitivity allocation: {sensitivity:?}");
    for (rule, histograms) in rules.iter().zip(&recorder.histograms) {
        if !chosen("KEEP_RULES", rule.name, true) {
            continue;
        }
        let weights = rule.weights.as_deref();
        let allocations = [
            ("uniform", &uniform),
            ("energy", &energy),
            ("sensitivity", &sensitivity),
        ];
        let fills = [("zero", true), ("mean", false)];
        for ((allocation, levels), (fill, fill_default)) in allocations.into_iter().flat_map(|a| fills.map(|f| (a, f)))
        {
            if !chosen("KEEP_RULES_ALLOCATIONS", allocation, true) || !chosen("KEEP_RULES_FILL", fill, fill_default) {
                continue;
            }
            let thresholds: Vec<f32> = histograms
                .iter()
                .zip(levels.iter())
                .map(|(h, &s)| h.quantile(s).0)
                .collect();
            let means = if fill == "mean" {
                let mut recorder = SkippedMean {
                    skip: Skip::new(n_ff, weights, thresholds.clone()),
                    sum: vec![vec![0.0; n_ff]; n_layer],
                    count: vec![vec![0; n_ff]; n_layer],
                };
                let mut state = model.new_state(CTX, CTX, 1);
                for window in tokens.chunks(CTX) {
                    ingest_every_row_with(&model, &mut state, window, 0, &mut recorder)?;
                }
                Some(recorder.means())
            } else {
                None
            };
            let mut runs = Vec::new();
            for jitter in JITTERS {
                let mut skip = Skip::new(n_ff, weights, thresholds.iter().map(|t| t * jitter).collect());
                skip.fill = means.as_deref();
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
                "rule": rule.name,
                "allocation": allocation,
                "fill": fill,
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
