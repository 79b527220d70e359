//! `leanstream-synth eval`: the predictors and the placement judged on the
//! trace's held-out split: recall of the true active set, perplexity with
//! predicted sets against the oracle's and dense, size and latency (also at
//! Mistral-7B shape from a random predictor of the same configuration).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use leanstream_profiler::activations::read::Trace;
use leanstream_profiler::activations::Array;
use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::model::{FfnBy, LayerAt, LayerHook, Model};
use leanstream_runtime::perplexity::{perplexity_with, Perplexity};
use leanstream_runtime::predict::{top_groups, ComputePath, Predictor, PredictorConfig, PredictorKind, Scratch};
use leanstream_runtime::Result as RtResult;
use serde::Serialize;

use crate::predictor::data::{active_count, input_rows, top_k_abs, USES};
use crate::predictor::equal_size_rank;
use crate::{Result, SynthError};

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub sparsities: Vec<f32>,
    /// Held-out tokens used for recall and latency (the first N).
    pub max_tokens: Option<usize>,
    /// Perplexity over this many chunks of `ctx` of the held-out text (0: none).
    pub ppl_chunks: usize,
    pub ctx: usize,
    /// Size and latency at Mistral-7B shape (4096 wide, 14336 neurons, 32 layers).
    pub shape_7b: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Recall {
    pub predictor: String,
    pub use_: String,
    pub sparsity: f32,
    /// Mean over layers and held-out tokens of |predicted ∩ true| / |true|.
    pub recall: f64,
    /// The same for activation mass: Σ|act| over predicted ∩ true / Σ|act| over true.
    pub mass_recall: f64,
    pub per_layer: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Size {
    pub predictor: String,
    pub kind: String,
    pub config: String,
    pub weight_bytes: usize,
    pub scratch_bytes: usize,
    /// Mean time of one layer's scores, and their sum over the layers (one use).
    pub us_per_layer_scalar: f64,
    pub us_per_layer_simd: f64,
    pub us_per_token_scalar: f64,
    pub us_per_token_simd: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Ppl {
    pub set: String,
    pub sparsity: f32,
    pub ppl: f64,
    pub ratio_to_dense: f64,
    pub ratio_to_oracle: Option<f64>,
    pub top1_agreement_with_dense: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub heldout_tokens: usize,
    pub recall: Vec<Recall>,
    pub sizes: Vec<Size>,
    pub perplexity: Vec<Ppl>,
    pub shape_7b: Vec<Size>,
}

fn label(path: &Path, p: &Predictor) -> String {
    let kind = match p.config.kind {
        PredictorKind::Hashing => "hashing",
        PredictorKind::LowRank => "low-rank",
    };
    format!(
        "{kind} ({})",
        path.file_name().map(|f| f.to_string_lossy()).unwrap_or_default()
    )
}

fn describe(c: &PredictorConfig) -> String {
    match c.kind {
        PredictorKind::Hashing => format!(
            "d={} tau={} keys={} stages={} group={}",
            c.d, c.tau, c.keys, c.stages, c.group
        ),
        PredictorKind::LowRank => format!("rank={} group={}", c.rank, c.group),
    }
}

/// Recall of `groups` (expanded to neurons) against the true set (`truth`,
/// neuron flags, `k` of them), by count and by activation mass (`mass_total`
/// is Σ|act| over the true set).
fn recall_of(groups: &[u32], group: usize, truth: &[bool], k: usize, act: &[f32], mass_total: f32) -> (f64, f64) {
    let (mut hit, mut mass) = (0usize, 0.0f32);
    for &g in groups {
        let g = g as usize;
        for i in g * group..(g + 1) * group {
            if truth[i] {
                hit += 1;
                mass += act[i].abs();
            }
        }
    }
    (hit as f64 / k as f64, (mass / mass_total.max(1e-30)) as f64)
}

/// Marks the row's true active set (its `k` largest |activations|) in
/// `truth`; returns their |activation| mass.
fn true_set(a: &[f32], k: usize, idx: &mut Vec<u32>, truth: &mut [bool]) -> f32 {
    top_k_abs(a, k, idx);
    truth.fill(false);
    let mut mass = 0.0f32;
    for &i in idx.iter() {
        truth[i as usize] = true;
        mass += a[i as usize].abs();
    }
    mass
}

pub fn evaluate(trace: &Trace, predictors: &[(PathBuf, Predictor)], o: &EvalOptions) -> Result<Report> {
    let (n_layer, n_ff, dm) = (trace.n_layer(), trace.n_ff(), trace.n_embd());
    for (path, p) in predictors {
        let c = &p.config;
        if (c.d_model, c.n_ff, c.n_layer) != (dm, n_ff, n_layer) {
            return Err(SynthError::Settings(format!(
                "{}: predictor for d_model {} n_ff {} layers {}, the trace has {dm} {n_ff} {n_layer}",
                path.display(),
                c.d_model,
                c.n_ff,
                c.n_layer
            )));
        }
    }
    let static_scores = trace.scores()?;
    let mut recall: Vec<Recall> = Vec::new();
    let mut rows_used = 0;
    // [predictor][use] → (scalar ns, simd ns, calls)
    let mut timing = vec![[(0u128, 0u128, 0usize, 0usize); 2]; predictors.len()];
    let mut per_layer: Vec<Vec<Vec<f64>>> =
        vec![vec![vec![0.0; n_layer]; o.sparsities.len()]; predictors.len() * 2 + 1];
    let mut mass = per_layer.clone();
    let mut scratches: Vec<Scratch> = predictors.iter().map(|(_, p)| p.scratch()).collect();
    let mut outs: Vec<Vec<f32>> = predictors.iter().map(|(_, p)| vec![0.0; p.n_groups()]).collect();
    let mut idx = Vec::with_capacity(n_ff);
    let mut truth = vec![false; n_ff];
    for l in 0..n_layer {
        let mut act = trace.layer("heldout", Array::Act, l)?;
        if let Some(m) = o.max_tokens {
            act.rows = act.rows.min(m);
        }
        rows_used = act.rows;
        let inputs = input_rows(trace, "heldout", l)?;
        for (si, &s) in o.sparsities.iter().enumerate() {
            let k = active_count(n_ff, s);
            let mut static_top = Vec::new();
            top_k_abs(static_scores.row(l), k, &mut static_top);
            let mut sums = vec![(0.0f64, 0.0f64); predictors.len() * 2 + 1];
            let add = |s: &mut (f64, f64), r: (f64, f64)| {
                s.0 += r.0;
                s.1 += r.1;
            };
            for r in 0..act.rows {
                let a = act.row(r);
                let mass_total = true_set(a, k, &mut idx, &mut truth);
                add(
                    &mut sums[predictors.len() * 2],
                    recall_of(&static_top, 1, &truth, k, a, mass_total),
                );
                for (pi, (_, p)) in predictors.iter().enumerate() {
                    let group = p.config.group;
                    let out = &mut outs[pi];
                    for u in 0..2 {
                        let ui = p
                            .use_index(USES[u])
                            .ok_or_else(|| SynthError::Settings(format!("predictor has no use {:?}", USES[u])))?;
                        let x = inputs[u].row(r);
                        let t = Instant::now();
                        p.scores(ui, l, x, ComputePath::Simd, &mut scratches[pi], out)?;
                        let simd_ns = t.elapsed().as_nanos();
                        // Scalar timing on the first sparsity and a subset of tokens only.
                        if si == 0 && r < 256 {
                            let t = Instant::now();
                            p.scores(ui, l, x, ComputePath::Scalar, &mut scratches[pi], out)?;
                            let e = &mut timing[pi][u];
                            e.0 += t.elapsed().as_nanos();
                            e.3 += 1;
                        }
                        if si == 0 {
                            let e = &mut timing[pi][u];
                            e.1 += simd_ns;
                            e.2 += 1;
                        }
                        let top = top_groups(out, k / group, &mut idx);
                        add(&mut sums[pi * 2 + u], recall_of(top, group, &truth, k, a, mass_total));
                    }
                }
            }
            for (j, s) in sums.iter().enumerate() {
                per_layer[j][si][l] = s.0 / act.rows.max(1) as f64;
                mass[j][si][l] = s.1 / act.rows.max(1) as f64;
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (si, &s) in o.sparsities.iter().enumerate() {
        for (pi, (path, p)) in predictors.iter().enumerate() {
            for (u, name) in USES.iter().enumerate() {
                let v = per_layer[pi * 2 + u][si].clone();
                recall.push(Recall {
                    predictor: label(path, p),
                    use_: name.to_string(),
                    sparsity: s,
                    recall: mean(&v),
                    mass_recall: mean(&mass[pi * 2 + u][si]),
                    per_layer: v,
                });
            }
        }
        let v = per_layer[predictors.len() * 2][si].clone();
        recall.push(Recall {
            predictor: "static hot set (training frequency)".into(),
            use_: "-".into(),
            sparsity: s,
            recall: mean(&v),
            mass_recall: mean(&mass[predictors.len() * 2][si]),
            per_layer: v,
        });
    }
    let sizes = predictors
        .iter()
        .zip(&timing)
        .map(|((path, p), t)| {
            let us = |ns: u128, calls: usize| ns as f64 / 1e3 / calls.max(1) as f64;
            let scalar = (us(t[0].0, t[0].3) + us(t[1].0, t[1].3)) / 2.0;
            let simd = (us(t[0].1, t[0].2) + us(t[1].1, t[1].2)) / 2.0;
            Size {
                predictor: label(path, p),
                kind: format!("{:?}", p.config.kind),
                config: describe(&p.config),
                weight_bytes: p.weight_bytes(),
                scratch_bytes: p.scratch_bytes(),
                us_per_layer_scalar: scalar,
                us_per_layer_simd: simd,
                us_per_token_scalar: scalar * n_layer as f64,
                us_per_token_simd: simd * n_layer as f64,
            }
        })
        .collect();
    let perplexity = if o.ppl_chunks > 0 {
        perplexities(trace, predictors, o)?
    } else {
        Vec::new()
    };
    let shape_7b = if o.shape_7b {
        predictors
            .iter()
            .map(|(path, p)| shape_7b(path, config_7b(&p.config, predictors)))
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    Ok(Report {
        heldout_tokens: rows_used,
        recall,
        sizes,
        perplexity,
        shape_7b,
    })
}

/// Configurations at Mistral-7B shape (4096 wide, 14336 neurons, 32 layers)
/// of the same kind and settings; a low-rank one gets the rank of the same
/// stored size as the hashing predictor in `all` (when there is one).
fn config_7b(c: &PredictorConfig, all: &[(PathBuf, Predictor)]) -> PredictorConfig {
    let (dm, n_ff, layers) = (4096, 14336, 32);
    match c.kind {
        PredictorKind::Hashing => PredictorConfig::hashing(dm, n_ff, c.group, layers, c.d, c.tau, c.keys, c.stages),
        PredictorKind::LowRank => {
            let rank = all
                .iter()
                .find(|(_, p)| p.config.kind == PredictorKind::Hashing)
                .map_or(c.rank, |(_, h)| rank_7b(&h.config));
            PredictorConfig::low_rank(dm, n_ff, c.group, layers, rank)
        }
    }
}

/// Size and latency of a randomly initialised predictor of configuration
/// `cfg`, both uses (as the runtime holds them); latency of one use.
pub fn shape_7b(path: &Path, cfg: PredictorConfig) -> Result<Size> {
    let (dm, layers) = (cfg.d_model, cfg.n_layer);
    let p = Predictor::random(cfg, &USES, 7)?;
    let mut rng = Rng::new(11);
    let tokens = 64;
    let xs: Vec<f32> = (0..tokens * dm)
        .map(|i| {
            let v = (rng.uniform() as f32 - 0.5) * 2.0;
            // A few massive channels, as real residual streams have.
            if i % dm < 2 {
                v * 200.0
            } else {
                v
            }
        })
        .collect();
    let mut scratch = p.scratch();
    let mut out = vec![0.0f32; p.n_groups()];
    let mut time = |path_kind: ComputePath| -> Result<f64> {
        let t = Instant::now();
        for x in xs.chunks_exact(dm) {
            for l in 0..layers {
                p.scores(0, l, x, path_kind, &mut scratch, &mut out)?;
            }
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / tokens as f64)
    };
    time(ComputePath::Simd)?; // warm
    let simd = time(ComputePath::Simd)?;
    let scalar = time(ComputePath::Scalar)?;
    Ok(Size {
        predictor: format!("{} at {dm}x{}x{layers} (random)", label(path, &p), cfg.n_ff),
        kind: format!("{:?}", cfg.kind),
        config: describe(&cfg),
        weight_bytes: p.weight_bytes(),
        scratch_bytes: p.scratch_bytes(),
        us_per_layer_scalar: scalar / layers as f64,
        us_per_layer_simd: simd / layers as f64,
        us_per_token_scalar: scalar,
        us_per_token_simd: simd,
    })
}

/// How a probe picks each layer's active set.
enum Pick<'a> {
    Dense,
    /// The true top-k of the layer's own activations.
    Oracle,
    /// The same top-k for every token (per layer, neuron flags): the
    /// training frequency ranking.
    Static(Vec<Vec<bool>>),
    Predicted {
        p: &'a Predictor,
        use_: usize,
        refine: bool,
    },
}

/// Zeroes every neuron outside the picked set of each token (a sparse run as
/// the runtime would do it with this set).
struct MaskProbe<'a> {
    pick: Pick<'a>,
    k: usize,
    n_ff: usize,
    d: usize,
    hot: Vec<f32>,
    /// Per layer parity, per batch row: the predicted flags. Layer l+1's set is
    /// predicted during layer l (before l's own set is applied, when
    /// speculating), so the two layers need separate buffers.
    masks: [Vec<bool>; 2],
    /// Per batch row, the residual saved for refinement.
    resid: Vec<f32>,
    scratch: Option<Scratch>,
    scores: Vec<f32>,
    idx: Vec<u32>,
    error: Option<SynthError>,
}

impl MaskProbe<'_> {
    fn predict(&mut self, layer: usize, rows: Range<usize>, x: &[f32]) {
        let Pick::Predicted { p, use_, .. } = &self.pick else {
            return;
        };
        let Some(scratch) = self.scratch.as_mut() else { return };
        let group = p.config.group;
        for (i, r) in rows.enumerate() {
            let row = &x[i * self.d..(i + 1) * self.d];
            if let Err(e) = p.scores(*use_, layer, row, ComputePath::Simd, scratch, &mut self.scores) {
                self.error.get_or_insert(e.into());
                return;
            }
            let m = &mut self.masks[layer % 2][r * self.n_ff..(r + 1) * self.n_ff];
            m.fill(false);
            for &g in top_groups(&self.scores, self.k / group, &mut self.idx) {
                m[g as usize * group..(g as usize + 1) * group].fill(true);
            }
        }
    }
}

/// Per neuron, whether it is in `ids`.
fn flags(ids: &[u32], n: usize) -> Vec<bool> {
    let mut f = vec![false; n];
    for &j in ids {
        f[j as usize] = true;
    }
    f
}

/// Zeroes every activation whose flag is off.
fn keep_flagged(a: &mut [f32], keep: &[bool]) {
    for (v, &k) in a.iter_mut().zip(keep) {
        if !k {
            *v = 0.0;
        }
    }
}

impl LayerHook for MaskProbe<'_> {
    fn layer_input(&mut self, at: &LayerAt, x: &[f32]) {
        if at.layer == 0 {
            self.predict(0, at.rows.clone(), x);
        }
    }
    fn ffn(&mut self, at: &LayerAt, resid: &[f32], _xb: &[f32], _out: &mut [f32]) -> RtResult<FfnBy> {
        let (layer, rows) = (at.layer, at.rows.clone());
        if let Pick::Predicted { refine, p, .. } = &self.pick {
            if layer + 1 < p.config.n_layer {
                if *refine {
                    let start = rows.start * self.d;
                    self.resid[start..start + resid.len()].copy_from_slice(resid);
                } else {
                    self.predict(layer + 1, rows, resid);
                }
            }
        }
        Ok(FfnBy::Model)
    }
    fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
        let (layer, rows, n_ff) = (at.layer, at.rows.clone(), self.n_ff);
        for (i, r) in rows.enumerate() {
            let a = &mut acts[i * n_ff..(i + 1) * n_ff];
            match &self.pick {
                Pick::Dense => {}
                Pick::Oracle => {
                    top_k_abs(a, self.k, &mut self.idx);
                    keep_flagged(a, &flags(&self.idx, n_ff));
                }
                Pick::Static(keep) => keep_flagged(a, &keep[layer]),
                Pick::Predicted { .. } => keep_flagged(a, &self.masks[layer % 2][r * n_ff..(r + 1) * n_ff]),
            }
        }
    }
    fn partial_mask(&self, layer: usize) -> Option<&[f32]> {
        match &self.pick {
            Pick::Predicted { refine: true, p, .. } if layer + 1 < p.config.n_layer => {
                Some(&self.hot[layer * self.n_ff..(layer + 1) * self.n_ff])
            }
            _ => None,
        }
    }
    fn partial_output(&mut self, at: &LayerAt, y: &[f32]) {
        let (layer, rows) = (at.layer, at.rows.clone());
        let start = rows.start * self.d;
        let mut x = std::mem::take(&mut self.resid);
        for (a, &b) in x[start..start + y.len()].iter_mut().zip(y) {
            *a += b;
        }
        self.predict(layer + 1, rows.clone(), &x[start..start + y.len()]);
        self.resid = x;
    }
}

fn perplexities(trace: &Trace, predictors: &[(PathBuf, Predictor)], o: &EvalOptions) -> Result<Vec<Ppl>> {
    let m = &trace.manifest;
    let model = Model::load(&m.model.path)?;
    let heldout = trace.split("heldout")?;
    let mut text = String::new();
    for t in &heldout.texts {
        text.push_str(&std::fs::read_to_string(&t.path).map_err(|e| SynthError::io(&t.path, e))?);
    }
    let hot = trace.hot()?.data;
    let static_scores = trace.scores()?;
    let (n_ff, d) = (trace.n_ff(), trace.n_embd());
    let rows = o.ctx.min(512);
    let run = |pick: Pick, k: usize| -> Result<Perplexity> {
        let mut probe = MaskProbe {
            scratch: match &pick {
                Pick::Predicted { p, .. } => Some(p.scratch()),
                _ => None,
            },
            scores: match &pick {
                Pick::Predicted { p, .. } => vec![0.0; p.n_groups()],
                _ => Vec::new(),
            },
            pick,
            k,
            n_ff,
            d,
            hot: hot.clone(),
            masks: [vec![true; rows * n_ff], vec![true; rows * n_ff]],
            resid: vec![0.0; rows * d],
            idx: Vec::with_capacity(n_ff),
            error: None,
        };
        let p = perplexity_with(&model, &text, o.ctx, Some(o.ppl_chunks), false, &mut probe)?;
        match probe.error {
            Some(e) => Err(e),
            None => Ok(p),
        }
    };
    let dense = run(Pick::Dense, n_ff)?;
    let mut out = vec![Ppl {
        set: "dense".into(),
        sparsity: 0.0,
        ppl: dense.ppl,
        ratio_to_dense: 1.0,
        ratio_to_oracle: None,
        top1_agreement_with_dense: Some(1.0),
    }];
    for &s in &o.sparsities {
        let k = active_count(n_ff, s);
        let oracle = run(Pick::Oracle, k)?;
        let row = |set: String, p: &Perplexity| Ppl {
            set,
            sparsity: s,
            ppl: p.ppl,
            ratio_to_dense: p.ppl / dense.ppl,
            ratio_to_oracle: Some(p.ppl / oracle.ppl),
            top1_agreement_with_dense: p.top1_agreement(&dense),
        };
        out.push(row("oracle (true top-k)".into(), &oracle));
        let top: Vec<Vec<bool>> = (0..trace.n_layer())
            .map(|l| {
                let mut idx = Vec::new();
                top_k_abs(static_scores.row(l), k, &mut idx);
                flags(&idx, n_ff)
            })
            .collect();
        out.push(row("static hot set".into(), &run(Pick::Static(top), k)?));
        for (path, p) in predictors {
            for (u, name) in USES.iter().enumerate() {
                let ui = p.use_index(name).unwrap_or(u);
                let r = run(
                    Pick::Predicted {
                        p,
                        use_: ui,
                        refine: u == 1,
                    },
                    k,
                )?;
                out.push(row(format!("{} {name}", label(path, p)), &r));
            }
        }
    }
    Ok(out)
}

/// The low-rank rank of the same stored size as a hashing configuration at Mistral-7B shape.
pub fn rank_7b(hashing: &PredictorConfig) -> usize {
    let h = PredictorConfig::hashing(
        4096,
        14336,
        hashing.group,
        32,
        hashing.d,
        hashing.tau,
        hashing.keys,
        hashing.stages,
    );
    equal_size_rank(4096, 14336, hashing.group, h.layer_bytes())
}

/// Mass recall of the predictor's `refine` use (what `speculate` finally
/// reads a layer by: its ranking from the layer's true input) at each
/// prefetch breadth: the share of the true active set's |activation| mass
/// (top `(1 − sparsity) × n_ff` per row) that the top `b ×` that many
/// predicted neurons cover, averaged over layers and the first `max_tokens`
/// rows of `split`. This is the control model's `recall(b)`.
pub fn breadth_recall(
    trace: &Trace,
    p: &Predictor,
    split: &str,
    sparsity: f32,
    breadths: &[f64],
    max_tokens: usize,
) -> Result<Vec<(f64, f64)>> {
    let (n_layer, n_ff) = (trace.n_layer(), trace.n_ff());
    let c = &p.config;
    if (c.d_model, c.n_ff, c.n_layer) != (trace.n_embd(), n_ff, n_layer) {
        return Err(SynthError::Settings(format!(
            "breadth recall: predictor for d_model {} n_ff {} layers {}, the trace has {} {n_ff} {n_layer}",
            c.d_model,
            c.n_ff,
            c.n_layer,
            trace.n_embd()
        )));
    }
    let ui = p
        .use_index(USES[1])
        .ok_or_else(|| SynthError::Settings(format!("predictor has no use {:?}", USES[1])))?;
    let k = active_count(n_ff, sparsity);
    let group = c.group;
    let mut scratch = p.scratch();
    let mut out = vec![0.0f32; p.n_groups()];
    let (mut idx, mut top) = (Vec::with_capacity(n_ff), Vec::with_capacity(n_ff));
    let mut truth = vec![false; n_ff];
    let mut sums = vec![0.0f64; breadths.len()];
    let mut rows_seen = 0usize;
    for l in 0..n_layer {
        let mut act = trace.layer(split, Array::Act, l)?;
        act.rows = act.rows.min(max_tokens);
        let inputs = input_rows(trace, split, l)?;
        for r in 0..act.rows {
            let a = act.row(r);
            let mass_total = true_set(a, k, &mut idx, &mut truth);
            p.scores(ui, l, inputs[1].row(r), ComputePath::Simd, &mut scratch, &mut out)?;
            for (bi, &b) in breadths.iter().enumerate() {
                let groups = ((b * k as f64 / group as f64).ceil() as usize).clamp(1, out.len());
                let g = top_groups(&out, groups, &mut top);
                sums[bi] += recall_of(g, group, &truth, k, a, mass_total).1;
            }
            rows_seen += 1;
        }
    }
    if rows_seen == 0 {
        return Err(SynthError::Settings(format!(
            "breadth recall: the trace's {split:?} split has no rows"
        )));
    }
    Ok(breadths
        .iter()
        .zip(&sums)
        // A mass ratio summed in f32 can end a rounding above 1, which
        // `controller --recall-by-breadth` would refuse when copied from the
        // tune's record.
        .map(|(&b, &s)| (b, (s / rows_seen as f64).clamp(0.0, 1.0)))
        .collect())
}
