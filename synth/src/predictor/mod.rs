//! `leanstream-synth predictor`: trains, per layer and use (speculate,
//! refine; see [`data::USES`]), the stacked learnable hashing predictor and,
//! on the same data at the same stored size, the low-rank MLP baseline; both
//! are written as `.lspred` files for `leanstream_runtime::predict`.
//!
//! Target: the true active set at the operating sparsity (the top
//! `1 - sparsity` of neurons by |act(g)·u| per token), as binary
//! cross-entropy per neuron group, weighted by activation magnitude. Layers train in parallel (rayon), each
//! deterministic for the seed.

pub mod data;
pub mod hashing;
pub mod lowrank;
mod numeric;

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::Array;
use leanstream_runtime::predict::{Predictor, PredictorConfig, PredictorLayer};
use rayon::prelude::*;
use serde::Serialize;

use crate::{Result, SynthError};
use data::{input_rows, labels, quantized, USES};

#[derive(Debug, Clone, Serialize)]
pub struct TrainOptions {
    /// Operating sparsity the target set is defined at.
    pub sparsity: f32,
    /// Neurons per predicted group.
    pub group: usize,
    /// Hashing: projection width, bits per hash, keys per stage, stages.
    pub d: usize,
    pub tau: usize,
    pub keys: usize,
    pub stages: usize,
    pub epochs: usize,
    /// Hashing: leading epochs trained on the soft key mixture.
    pub soft_epochs: usize,
    pub batch: usize,
    pub lr: f32,
    pub seed: u64,
    /// Training tokens used (the first N of the split).
    pub max_tokens: Option<usize>,
    #[serde(skip)]
    pub progress: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            sparsity: 0.5,
            group: 1,
            d: 32,
            tau: 16,
            keys: 8,
            stages: 4,
            epochs: 4,
            soft_epochs: 0,
            batch: 32,
            lr: 1e-2,
            seed: 1,
            max_tokens: None,
            progress: false,
        }
    }
}

/// Training loss of one layer and use: before training (noiseless forward),
/// per epoch, and after (noiseless).
#[derive(Debug, Clone, Serialize)]
pub struct LayerLoss {
    pub layer: usize,
    pub use_: &'static str,
    pub hashing_before: f32,
    pub hashing_epochs: Vec<f32>,
    pub hashing_after: f32,
    pub low_rank_epochs: Vec<f32>,
}

pub struct Trained {
    pub hashing: Predictor,
    pub low_rank: Predictor,
    pub losses: Vec<LayerLoss>,
}

/// The low-rank rank whose stored size is closest to, and not above, `bytes` per layer.
pub fn equal_size_rank(d_model: usize, n_ff: usize, group: usize, bytes: u64) -> usize {
    let g = (n_ff / group) as u64;
    let per_rank = d_model as u64 + 8 + g;
    (bytes.saturating_sub(8 * g) / per_rank).max(1) as usize
}

struct LayerOut {
    hashing: [PredictorLayer; 2],
    low_rank: [PredictorLayer; 2],
    losses: Vec<LayerLoss>,
}

fn train_layer(trace: &Trace, o: &TrainOptions, hcfg: &PredictorConfig, rank: usize, layer: usize) -> Result<LayerOut> {
    let cap = |mut r: leanstream_profiler::activations::read::Rows| {
        if let Some(m) = o.max_tokens {
            r.rows = r.rows.min(m);
            r.data.truncate(r.rows * r.cols);
        }
        r
    };
    let act = cap(trace.layer("train", Array::Act, layer)?);
    let (y, yw) = labels(&act, o.sparsity, o.group);
    let g = hcfg.n_groups();
    let n = act.rows;
    drop(act);
    let mut freq = vec![0.0f32; g];
    for row in y.chunks_exact(g) {
        for (f, &v) in freq.iter_mut().zip(row) {
            *f += v / n as f32;
        }
    }
    let shape = hashing::Shape {
        d_model: hcfg.d_model,
        d: o.d,
        tau: o.tau,
        keys: o.keys,
        stages: o.stages,
        g,
    };
    let mut hashing_layers = Vec::new();
    let mut low_rank_layers = Vec::new();
    let mut losses = Vec::new();
    let inputs = input_rows(trace, "train", layer)?;
    for (u, (name, raw)) in USES.iter().zip(inputs).enumerate() {
        let x = quantized(&cap(raw))?;
        let seed = o.seed ^ ((layer as u64) << 8) ^ (u as u64) << 32;
        let mut h = hashing::HashNet::new(shape, &freq, seed);
        let before = hashing::loss(&h, &x, &y, &yw);
        let h_epochs = hashing::train(&mut h, &x, &y, &yw, o.epochs, o.soft_epochs, o.batch, o.lr, seed);
        let after = hashing::loss(&h, &x, &y, &yw);
        let mut lr = lowrank::LowRankNet::new(hcfg.d_model, rank, g, &freq, seed);
        let lr_epochs = lowrank::train(&mut lr, &x, &y, &yw, o.epochs, o.batch, o.lr, seed);
        hashing_layers.push(PredictorLayer::Hashing(h.export()));
        low_rank_layers.push(PredictorLayer::LowRank(lr.export()));
        losses.push(LayerLoss {
            layer,
            use_: name,
            hashing_before: before,
            hashing_epochs: h_epochs,
            hashing_after: after,
            low_rank_epochs: lr_epochs,
        });
    }
    let two =
        |v: Vec<PredictorLayer>| -> [PredictorLayer; 2] { v.try_into().unwrap_or_else(|_| unreachable!("two uses")) };
    Ok(LayerOut {
        hashing: two(hashing_layers),
        low_rank: two(low_rank_layers),
        losses,
    })
}

/// Trains both predictors on the trace's training split.
pub fn train(trace: &Trace, o: &TrainOptions) -> Result<Trained> {
    let (dm, n_ff, n_layer) = (trace.n_embd(), trace.n_ff(), trace.n_layer());
    if o.group == 0 || n_ff % o.group != 0 || !(0.0..1.0).contains(&o.sparsity) || o.epochs == 0 || o.batch == 0 {
        return Err(SynthError::Settings(format!(
            "group {} must divide n_ff {n_ff}; sparsity {} in [0, 1); epochs and batch ≥ 1",
            o.group, o.sparsity
        )));
    }
    let hcfg = PredictorConfig::hashing(dm, n_ff, o.group, n_layer, o.d, o.tau, o.keys, o.stages);
    hcfg.validate(std::path::Path::new("<training settings>"))?;
    let rank = equal_size_rank(dm, n_ff, o.group, hcfg.layer_bytes());
    let lcfg = PredictorConfig::low_rank(dm, n_ff, o.group, n_layer, rank);
    let bar = leanstream_runtime::progress::bar(
        n_layer as u64,
        o.progress,
        "predictor {bar:30} {pos}/{len} layers, ETA {eta}",
    );
    let outs: Vec<LayerOut> = (0..n_layer)
        .into_par_iter()
        .map(|l| {
            let r = train_layer(trace, o, &hcfg, rank, l);
            bar.inc(1);
            r
        })
        .collect::<Result<_>>()?;
    bar.finish_and_clear();
    let mut hl: [Vec<PredictorLayer>; 2] = [Vec::new(), Vec::new()];
    let mut ll: [Vec<PredictorLayer>; 2] = [Vec::new(), Vec::new()];
    let mut losses = Vec::new();
    for out in outs {
        let [h0, h1] = out.hashing;
        let [l0, l1] = out.low_rank;
        hl[0].push(h0);
        hl[1].push(h1);
        ll[0].push(l0);
        ll[1].push(l1);
        losses.extend(out.losses);
    }
    let provenance = |kind: &str| {
        serde_json::json!({
            "kind": kind,
            "model": trace.manifest.model,
            "trace": trace.dir.display().to_string(),
            "train_texts": trace.split("train").map(|s| s.texts.clone()).unwrap_or_default(),
            "settings": o,
            "low_rank_rank": rank,
        })
        .to_string()
    };
    let uses: Vec<String> = USES.iter().map(|s| s.to_string()).collect();
    let [h0, h1] = hl;
    let [l0, l1] = ll;
    Ok(Trained {
        hashing: Predictor {
            config: hcfg,
            provenance: provenance("hashing"),
            uses: uses.clone(),
            layers: vec![h0, h1],
        },
        low_rank: Predictor {
            config: lcfg,
            provenance: provenance("low-rank"),
            uses,
            layers: vec![l0, l1],
        },
        losses,
    })
}
