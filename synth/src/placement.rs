//! Flash placement from activation traces (`leanstream-synth placement`).
//!
//! The engine reads a layer's needed bundles as runs of neighbouring flash
//! positions, so an order that keeps co-active neurons adjacent needs fewer,
//! denser reads. Per layer:
//!
//! 1. neuron embeddings are learned contrastively from co-activation on the
//!    training split: pairs of neurons active in the same token are pulled
//!    together, negatives drawn from the frequency^0.75 distribution pushed
//!    apart (word2vec's SGD on `-log σ(e_i·e_j) - Σ log σ(-e_i·e_n)`);
//! 2. a greedy nearest-neighbour chain over the embeddings (from the most
//!    frequent neuron) gives a 1-D order;
//! 3. optionally, 2-opt on that chain minimising the summed Hamming distance
//!    of adjacent neurons' activation patterns on (a sample of) the training
//!    tokens: with no merge gap, a token's read count is half the number of
//!    needed/unneeded boundaries along the layer, which is exactly that sum
//!    (layers wider than 4,096 neurons try reversals of up to 256 positions
//!    and compute distances as needed: a full table and full passes cost
//!    the 7B shape 822 MB and 10^8 moves a layer and pass).
//!
//! [`evaluate`] replays a split through the streamer's run-merging rule
//! ([`leanstream_runtime::flash::runs::RunRule`]) to count reads and bytes.

use std::path::Path;

use indicatif::ProgressBar;
use leanstream_profiler::activations::read::{Rows, Trace};
use leanstream_profiler::activations::Array;
use leanstream_runtime::flash::format::check_permutation;
use leanstream_runtime::flash::runs::RunRule;
use leanstream_runtime::flash::{BundleLayout, DownType};
use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::gguf::GgufFile;
use leanstream_runtime::model::Config;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{Result, SynthError};

/// Settings of [`learn`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PlacementOptions {
    /// Sparsity level whose manifest thresholds decide which neurons are active.
    pub sparsity: f32,
    /// Embedding dimension.
    pub dim: usize,
    /// Passes over the training tokens.
    pub epochs: usize,
    /// Negative samples per positive pair.
    pub negatives: usize,
    /// Positive pairs sampled per token and epoch.
    pub pairs_per_token: usize,
    /// Initial SGD step (decays linearly to 1e-4 of it).
    pub learning_rate: f32,
    pub seed: u64,
    /// Improve the embedding chain with 2-opt on co-activation distances.
    pub refine: bool,
    /// Training tokens (evenly spaced) whose activation patterns 2-opt uses.
    pub refine_tokens: usize,
    /// Show a progress bar on stderr.
    #[serde(skip)]
    pub progress: bool,
}

impl Default for PlacementOptions {
    fn default() -> Self {
        Self {
            sparsity: 0.5,
            dim: 16,
            epochs: 5,
            negatives: 5,
            pairs_per_token: 32,
            learning_rate: 0.05,
            seed: 1,
            refine: true,
            refine_tokens: 4096,
            progress: false,
        }
    }
}

/// What training did to one layer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LayerStats {
    /// Mean contrastive loss on a fixed sample of pairs: before training,
    /// then after each epoch.
    pub loss: Vec<f32>,
    /// Summed adjacent Hamming distance (on the refinement tokens) of the
    /// frequency order, the embedding chain, and the final order.
    pub frequency_cost: u64,
    pub chain_cost: u64,
    pub final_cost: u64,
}

/// A learned placement; serializes to the JSON `pack --placement` reads
/// (`layers`; the other fields are ignored there).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Placement {
    /// Per layer, the neuron stored at each flash position.
    pub layers: Vec<Vec<u32>>,
    pub stats: Vec<LayerStats>,
    pub options: PlacementOptions,
    /// The trace directory and model the placement was learned from.
    pub trace: String,
    pub model_sha256: String,
}

impl Placement {
    /// Checks that each layer is a permutation of `0..n_ff`.
    pub fn check(&self, n_ff: usize) -> Result<()> {
        for (l, order) in self.layers.iter().enumerate() {
            check_permutation(order, n_ff)
                .map_err(|e| SynthError::Settings(format!("placement layer {l} is not a permutation: {e}")))?;
        }
        Ok(())
    }

    /// Writes the JSON atomically (temp file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec(self).map_err(|e| SynthError::Settings(format!("placement JSON: {e}")))?;
        // A bare file name has an empty parent, which cannot be fsynced.
        let path = match path.parent() {
            Some(p) if p.as_os_str().is_empty() => Path::new(".").join(path),
            _ => path.to_path_buf(),
        };
        leanstream_profiler::shard::write_atomic(&path, &json)?;
        Ok(())
    }
}

/// The manifest's per-layer |act| thresholds at `sparsity`.
pub fn thresholds(trace: &Trace, sparsity: f32) -> Result<Vec<f32>> {
    let m = &trace.manifest;
    let level = m
        .levels
        .iter()
        .find(|lv| (lv.sparsity - sparsity).abs() < 1e-4)
        .ok_or_else(|| {
            let have: Vec<String> = m.levels.iter().map(|lv| lv.sparsity.to_string()).collect();
            SynthError::Trace {
                path: trace.dir.clone(),
                reason: format!(
                    "no thresholds at sparsity {sparsity} (the trace has {})",
                    have.join(", ")
                ),
            }
        })?;
    if level.per_layer.len() != trace.n_layer() {
        return Err(SynthError::Trace {
            path: trace.dir.clone(),
            reason: format!(
                "sparsity {sparsity}: {} thresholds for {} layers",
                level.per_layer.len(),
                trace.n_layer()
            ),
        });
    }
    Ok(level.per_layer.clone())
}

/// Active neurons of each token (|act| ≥ threshold, the runtime's rule), as CSR.
pub(crate) struct Active {
    offsets: Vec<usize>,
    ids: Vec<u16>,
}

impl Active {
    #[cfg(test)]
    pub(crate) fn from_parts(offsets: Vec<usize>, ids: Vec<u16>) -> Self {
        Self { offsets, ids }
    }

    pub(crate) fn new(rows: &Rows, threshold: f32) -> Self {
        let mut offsets = Vec::with_capacity(rows.rows + 1);
        let mut ids = Vec::new();
        offsets.push(0);
        for t in 0..rows.rows {
            ids.extend(
                rows.row(t)
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.abs() >= threshold)
                    .map(|(i, _)| i as u16),
            );
            offsets.push(ids.len());
        }
        Self { offsets, ids }
    }
    pub(crate) fn tokens(&self) -> usize {
        self.offsets.len() - 1
    }
    pub(crate) fn token(&self, t: usize) -> &[u16] {
        &self.ids[self.offsets[t]..self.offsets[t + 1]]
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x.clamp(-30.0, 30.0)).exp())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Draws from a cumulative weight table.
fn draw(cdf: &[f64], rng: &mut Rng) -> usize {
    let total = cdf.last().copied().unwrap_or(0.0);
    let u = rng.uniform() * total;
    cdf.partition_point(|&c| c <= u).min(cdf.len().saturating_sub(1))
}

/// One positive pair with its negatives.
struct Sample {
    i: usize,
    j: usize,
    negs: Vec<usize>,
}

fn sample_pair(act: &Active, cdf: &[f64], negatives: usize, rng: &mut Rng, t: usize) -> Option<Sample> {
    let a = act.token(t);
    if a.len() < 2 {
        return None;
    }
    let i = a[rng.below(a.len())] as usize;
    let j = a[rng.below(a.len())] as usize;
    if i == j {
        return None;
    }
    let negs = (0..negatives).map(|_| draw(cdf, rng)).collect();
    Some(Sample { i, j, negs })
}

fn pair_loss(emb: &[f32], dim: usize, s: &Sample) -> f32 {
    let e = |k: usize| &emb[k * dim..(k + 1) * dim];
    let mut loss = -sigmoid(dot(e(s.i), e(s.j))).max(1e-12).ln();
    for &n in &s.negs {
        loss -= sigmoid(-dot(e(s.i), e(n))).max(1e-12).ln();
    }
    loss
}

/// One SGD step on `s` (word2vec's update, with a single embedding table).
fn step(emb: &mut [f32], dim: usize, s: &Sample, lr: f32, grad: &mut [f32], ei: &mut [f32]) {
    grad.fill(0.0);
    // e_i is updated once, after its gradient over all targets is summed.
    ei.copy_from_slice(&emb[s.i * dim..(s.i + 1) * dim]);
    let targets = std::iter::once((s.j, 1.0f32)).chain(s.negs.iter().map(|&n| (n, 0.0)));
    for (k, label) in targets {
        if k == s.i {
            continue;
        }
        let ek = &mut emb[k * dim..(k + 1) * dim];
        let g = lr * (label - sigmoid(dot(ei, ek)));
        for d in 0..dim {
            grad[d] += g * ek[d];
            ek[d] += g * ei[d];
        }
    }
    for d in 0..dim {
        emb[s.i * dim + d] += grad[d];
    }
}

/// Learns one layer's embeddings; returns them and the loss history.
fn train(act: &Active, n: usize, o: &PlacementOptions, layer: usize) -> (Vec<f32>, Vec<f32>) {
    let dim = o.dim;
    let mut count = vec![0u64; n];
    for &i in &act.ids {
        count[i as usize] += 1;
    }
    let mut acc = 0.0;
    let cdf: Vec<f64> = count
        .iter()
        .map(|&c| {
            acc += (c as f64).powf(0.75);
            acc
        })
        .collect();
    let mut rng = Rng::with_stream(o.seed, 2 * layer as u64);
    // Unit-scale: with one symmetric table, a near-zero start sits on a
    // saddle where the gradients (∝ the other embedding) barely move it.
    let mut emb: Vec<f32> = (0..n * dim).map(|_| rng.next_f32() - 0.5).collect();
    // A fixed held-aside sample, so the losses of successive epochs compare.
    let mut eval_rng = Rng::with_stream(o.seed, 2 * layer as u64 + 1);
    let tokens = act.tokens();
    let eval: Vec<Sample> = (0..4096)
        .filter_map(|_| {
            let t = eval_rng.below(tokens);
            sample_pair(act, &cdf, o.negatives, &mut eval_rng, t)
        })
        .collect();
    let mean_loss = |emb: &[f32]| {
        if eval.is_empty() {
            0.0
        } else {
            eval.iter().map(|s| pair_loss(emb, dim, s)).sum::<f32>() / eval.len() as f32
        }
    };
    let mut losses = vec![mean_loss(&emb)];
    if cdf.last().copied().unwrap_or(0.0) <= 0.0 {
        return (emb, losses);
    }
    let total_steps = (o.epochs * tokens * o.pairs_per_token).max(1) as f32;
    let (mut done, mut grad, mut tmp) = (0usize, vec![0.0; dim], vec![0.0; dim]);
    for _ in 0..o.epochs {
        for t in 0..tokens {
            for _ in 0..o.pairs_per_token {
                let lr = o.learning_rate * (1.0 - done as f32 / total_steps).max(1e-4);
                done += 1;
                if let Some(s) = sample_pair(act, &cdf, o.negatives, &mut rng, t) {
                    step(&mut emb, dim, &s, lr, &mut grad, &mut tmp);
                }
            }
        }
        losses.push(mean_loss(&emb));
    }
    (emb, losses)
}

/// Greedy nearest-neighbour chain by cosine similarity, from `start`.
fn chain(emb: &[f32], n: usize, dim: usize, start: usize) -> Vec<u32> {
    let mut unit = emb.to_vec();
    for v in unit.chunks_exact_mut(dim) {
        let norm = dot(v, v).sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= norm);
    }
    let mut visited = vec![false; n];
    let mut order = Vec::with_capacity(n);
    let mut cur = start;
    for _ in 0..n {
        visited[cur] = true;
        order.push(cur as u32);
        let e = &unit[cur * dim..(cur + 1) * dim];
        let mut best: Option<(f32, usize)> = None;
        for k in (0..n).filter(|&k| !visited[k]) {
            let s = dot(e, &unit[k * dim..(k + 1) * dim]);
            if best.is_none_or(|(b, _)| s > b) {
                best = Some((s, k));
            }
        }
        match best {
            Some((_, k)) => cur = k,
            None => break,
        }
    }
    order
}

/// Layers up to this many neurons get a full distance table (64 MiB at
/// 4,096) and full 2-opt; wider ones (the 7B shape's 14,336: an 822 MB
/// table, and passes of 10^8 moves) compute distances when asked and try
/// reversals of at most [`WIDE_WINDOW`] positions.
const FULL_TABLE_MAX: usize = 4096;
const WIDE_WINDOW: usize = 256;

/// Co-activation distances between a layer's neurons: the Hamming distance
/// of their activation patterns over up to `max_tokens` evenly spaced
/// training tokens.
struct Distances {
    n: usize,
    words: usize,
    bits: Vec<u64>,
    table: Option<Vec<u32>>,
}

impl Distances {
    fn new(act: &Active, n: usize, max_tokens: usize) -> Self {
        let t_all = act.tokens();
        let picked: Vec<usize> = if t_all <= max_tokens {
            (0..t_all).collect()
        } else {
            (0..max_tokens).map(|k| k * t_all / max_tokens).collect()
        };
        let words = picked.len().div_ceil(64).max(1);
        let mut bits = vec![0u64; n * words];
        for (w, &t) in picked.iter().enumerate() {
            for &i in act.token(t) {
                bits[i as usize * words + w / 64] |= 1 << (w % 64);
            }
        }
        let mut d = Self {
            n,
            words,
            bits,
            table: None,
        };
        if n <= FULL_TABLE_MAX {
            let mut t = vec![0u32; n * n];
            for a in 0..n {
                for b in a + 1..n {
                    let h = d.compute(a, b);
                    t[a * n + b] = h;
                    t[b * n + a] = h;
                }
            }
            d.table = Some(t);
        }
        d
    }

    fn compute(&self, a: usize, b: usize) -> u32 {
        let x = &self.bits[a * self.words..(a + 1) * self.words];
        let y = &self.bits[b * self.words..(b + 1) * self.words];
        x.iter().zip(y).map(|(p, q)| (p ^ q).count_ones()).sum()
    }

    #[inline]
    fn get(&self, a: u32, b: u32) -> u32 {
        match &self.table {
            Some(t) => t[a as usize * self.n + b as usize],
            None => self.compute(a as usize, b as usize),
        }
    }

    /// Longest reversal 2-opt tries: all of a narrow layer.
    fn window(&self) -> usize {
        if self.table.is_some() {
            self.n
        } else {
            WIDE_WINDOW
        }
    }
}

fn path_cost(order: &[u32], d: &Distances) -> u64 {
    order.windows(2).map(|w| d.get(w[0], w[1]) as u64).sum()
}

/// 2-opt on an open path: reverse `order[i+1..=j]` while that shortens it
/// (`j - i` at most `d.window()`).
fn two_opt(order: &mut [u32], d: &Distances, max_passes: usize) {
    let len = order.len();
    let dist = |a: u32, b: u32| d.get(a, b) as i64;
    let window = d.window();
    for _ in 0..max_passes {
        let mut improved = false;
        for i in 0..len.saturating_sub(2) {
            for j in i + 2..len.min(i + 1 + window) {
                let (a, b, c) = (order[i], order[i + 1], order[j]);
                let old_next = if j + 1 < len { dist(c, order[j + 1]) } else { 0 };
                let new_next = if j + 1 < len { dist(b, order[j + 1]) } else { 0 };
                if dist(a, c) + new_next < dist(a, b) + old_next {
                    order[i + 1..=j].reverse();
                    improved = true;
                }
            }
        }
        if !improved {
            break;
        }
    }
}

fn bar(len: u64, show: bool, msg: &str) -> ProgressBar {
    let pb = leanstream_runtime::progress::bar(
        len,
        show,
        "{msg} {bar:40} {pos}/{len} layers [{elapsed_precise}, eta {eta}]",
    );
    pb.set_message(msg.to_string());
    pb
}

/// Neuron ids and positions are held as u16.
fn check_width(n_ff: usize) -> Result<()> {
    if n_ff > u16::MAX as usize + 1 {
        return Err(SynthError::Settings(format!(
            "n_ff {n_ff} is more than {}",
            u16::MAX as usize + 1
        )));
    }
    Ok(())
}

fn check_options(o: &PlacementOptions) -> Result<()> {
    if o.dim == 0 || o.dim > 1024 || o.pairs_per_token == 0 || !(o.learning_rate > 0.0 && o.learning_rate < 10.0) {
        return Err(SynthError::Settings(format!(
            "placement: dim {} (1..=1024), pairs per token {} (≥ 1), learning rate {} (0..10)",
            o.dim, o.pairs_per_token, o.learning_rate
        )));
    }
    Ok(())
}

/// Learns a flash placement from `trace`'s training split (see the module doc).
/// Deterministic for `opts.seed` (each layer draws from its own RNG stream).
pub fn learn(trace: &Trace, opts: &PlacementOptions) -> Result<Placement> {
    check_options(opts)?;
    let (n_layer, n) = (trace.n_layer(), trace.n_ff());
    check_width(n)?;
    let thr = thresholds(trace, opts.sparsity)?;
    let scores = trace.scores()?;
    let freq_order = leanstream_runtime::flash::pack::order_by_score(
        &(0..n_layer).map(|l| scores.row(l).to_vec()).collect::<Vec<_>>(),
    );
    let pb = bar(n_layer as u64, opts.progress, "placement");
    let per_layer: Vec<(Vec<u32>, LayerStats)> = (0..n_layer)
        .into_par_iter()
        .map(|l| {
            let act = Active::new(&trace.layer("train", Array::Act, l)?, thr[l]);
            let (emb, loss) = train(&act, n, opts, l);
            let mut count = vec![0u64; n];
            for &i in &act.ids {
                count[i as usize] += 1;
            }
            // The most frequent neuron (lowest id on ties) starts the chain.
            let start = (0..n)
                .max_by(|&a, &b| count[a].cmp(&count[b]).then(b.cmp(&a)))
                .unwrap_or(0);
            let mut order = chain(&emb, n, opts.dim, start);
            let d = Distances::new(&act, n, opts.refine_tokens.max(1));
            let chain_cost = path_cost(&order, &d);
            if opts.refine {
                two_opt(&mut order, &d, 50);
            }
            let stats = LayerStats {
                loss,
                frequency_cost: path_cost(&freq_order[l], &d),
                chain_cost,
                final_cost: path_cost(&order, &d),
            };
            pb.inc(1);
            Ok((order, stats))
        })
        .collect::<Result<_>>()?;
    pb.finish_and_clear();
    let (layers, stats) = per_layer.into_iter().unzip();
    let p = Placement {
        layers,
        stats,
        options: opts.clone(),
        trace: trace.dir.display().to_string(),
        model_sha256: trace.manifest.model.sha256.clone(),
    };
    p.check(n)?;
    Ok(p)
}

/// Per-layer bundle bytes that `pack` writes for the GGUF at `model` with
/// down columns as `down` (the same [`BundleLayout`] the packer builds).
pub fn bundle_bytes(model: &Path, down: DownType) -> Result<Vec<usize>> {
    let g = GgufFile::open(model)?;
    let c = Config::from_gguf(&g)?;
    Ok(leanstream_runtime::flash::pack::bundle_layouts(&g, &c, down)?
        .iter()
        .map(BundleLayout::bundle_bytes)
        .collect())
}

/// How reads are counted by [`evaluate`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReadSettings {
    pub sparsity: f32,
    /// Per layer (or one value for all layers).
    pub bundle_bytes: Vec<usize>,
    /// Each gap is evaluated separately.
    pub merge_gaps: Vec<usize>,
    /// Most bundle bytes in one read
    /// ([`leanstream_runtime::flash::runs::max_run_bytes`] of the default I/O config).
    pub max_run_bytes: usize,
}

/// Reads of one order at one merge gap, averaged over the split's tokens
/// (summed over layers).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReadStats {
    pub order: String,
    pub merge_gap_bytes: usize,
    pub reads_per_token: f64,
    pub bytes_read_per_token: f64,
    pub bytes_needed_per_token: f64,
    /// bytes read / bytes needed.
    pub read_amplification: f64,
}

/// Replays `split` through the streamer's run-merging rule for each order
/// (no cache: every needed bundle is read). Returns one row per (order, gap),
/// orders outermost.
pub fn evaluate(
    trace: &Trace,
    split: &str,
    orders: &[(&str, Vec<Vec<u32>>)],
    s: &ReadSettings,
    progress: bool,
) -> Result<Vec<ReadStats>> {
    let (n_layer, n) = (trace.n_layer(), trace.n_ff());
    check_width(n)?;
    let bb_of = |l: usize| match s.bundle_bytes.as_slice() {
        [one] => Ok(*one),
        v if v.len() == n_layer => Ok(v[l]),
        v => Err(SynthError::Settings(format!(
            "{} bundle sizes for {n_layer} layers",
            v.len()
        ))),
    };
    for (name, o) in orders {
        if o.len() != n_layer {
            return Err(SynthError::Settings(format!(
                "order {name}: {} layers, the trace has {n_layer}",
                o.len()
            )));
        }
        for (l, layer) in o.iter().enumerate() {
            check_permutation(layer, n)
                .map_err(|e| SynthError::Settings(format!("order {name} layer {l} is not a permutation: {e}")))?;
        }
    }
    if (0..n_layer).any(|l| bb_of(l).is_ok_and(|b| b == 0)) {
        return Err(SynthError::Settings("bundle bytes must be positive".into()));
    }
    let thr = thresholds(trace, s.sparsity)?;
    let gaps = s.merge_gaps.len();
    let pb = bar(n_layer as u64, progress, split);
    // Per layer: [order][gap] (reads, bytes read), bytes needed, tokens.
    type LayerCounts = (Vec<Vec<(u64, u64)>>, u64, usize);
    let per_layer: Vec<LayerCounts> = (0..n_layer)
        .into_par_iter()
        .map(|l| {
            let bb = bb_of(l)?;
            let act = Active::new(&trace.layer(split, Array::Act, l)?, thr[l]);
            let rules: Vec<RunRule> = s
                .merge_gaps
                .iter()
                .map(|&g| RunRule::new(bb, s.max_run_bytes, g))
                .collect();
            let mut counts = vec![vec![(0u64, 0u64); gaps]; orders.len()];
            let mut pos = Vec::with_capacity(n);
            let mut runs = Vec::with_capacity(n);
            for (k, (_, o)) in orders.iter().enumerate() {
                let mut inv = vec![0u16; n];
                for (p, &i) in o[l].iter().enumerate() {
                    inv[i as usize] = p as u16;
                }
                for t in 0..act.tokens() {
                    pos.clear();
                    pos.extend(act.token(t).iter().map(|&i| inv[i as usize] as usize));
                    pos.sort_unstable();
                    for (g, rule) in rules.iter().enumerate() {
                        runs.clear();
                        for &p in &pos {
                            rule.push(&mut runs, p);
                        }
                        counts[k][g].0 += runs.len() as u64;
                        counts[k][g].1 += runs.iter().map(|r| (r.1 * bb) as u64).sum::<u64>();
                    }
                }
            }
            pb.inc(1);
            Ok((counts, act.ids.len() as u64 * bb as u64, act.tokens()))
        })
        .collect::<Result<_>>()?;
    pb.finish_and_clear();
    let tokens = per_layer.first().map_or(0, |p| p.2).max(1) as f64;
    let needed: u64 = per_layer.iter().map(|p| p.1).sum();
    let mut out = Vec::with_capacity(orders.len() * gaps);
    for (k, (name, _)) in orders.iter().enumerate() {
        for (g, &gap) in s.merge_gaps.iter().enumerate() {
            let reads: u64 = per_layer.iter().map(|p| p.0[k][g].0).sum();
            let read: u64 = per_layer.iter().map(|p| p.0[k][g].1).sum();
            out.push(ReadStats {
                order: name.to_string(),
                merge_gap_bytes: gap,
                reads_per_token: reads as f64 / tokens,
                bytes_read_per_token: read as f64 / tokens,
                bytes_needed_per_token: needed as f64 / tokens,
                read_amplification: if needed == 0 { 1.0 } else { read as f64 / needed as f64 },
            });
        }
    }
    Ok(out)
}

/// A named placement: per layer, the neuron at each flash position.
pub type NamedOrder = (&'static str, Vec<Vec<u32>>);

/// The orders [`evaluate`] compares against: identity and by descending
/// score (what `pack --hot-first` writes).
pub fn baseline_orders(trace: &Trace) -> Result<Vec<NamedOrder>> {
    let (n_layer, n) = (trace.n_layer(), trace.n_ff());
    let scores = trace.scores()?;
    let rows: Vec<Vec<f32>> = (0..n_layer).map(|l| scores.row(l).to_vec()).collect();
    Ok(vec![
        ("identity", vec![(0..n as u32).collect(); n_layer]),
        ("frequency", leanstream_runtime::flash::pack::order_by_score(&rows)),
    ])
}

/// Held-out reads of `learned` against the identity and frequency orders at
/// merge gaps 0, 4 KiB and the runtime's default, under the I/O engine's
/// default read limit, with the bundle size the packer writes (Q8_0 down).
pub fn compare(trace: &Trace, learned: &[Vec<u32>], sparsity: f32, progress: bool) -> Result<Vec<ReadStats>> {
    let model = std::path::PathBuf::from(&trace.manifest.model.path);
    let bundle_bytes = bundle_bytes(&model, DownType::Q8_0)?;
    let mut orders = baseline_orders(trace)?;
    orders.push(("learned", learned.to_vec()));
    let settings = ReadSettings {
        sparsity,
        bundle_bytes,
        merge_gaps: vec![0, 4 << 10, leanstream_runtime::engine::DEFAULT_MERGE_GAP],
        max_run_bytes: leanstream_runtime::flash::runs::max_run_bytes(
            &leanstream_runtime::flash::io::IoConfig::default(),
        ),
    };
    evaluate(trace, "heldout", &orders, &settings, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Neuron i is active in token t when bit i of a per-token pseudo-random word is set.
    fn active(n: usize, tokens: usize) -> Active {
        let (mut offsets, mut ids) = (vec![0], Vec::new());
        let mut rng = Rng::new(7);
        for _ in 0..tokens {
            for i in 0..n {
                if rng.uniform() < 0.5 {
                    ids.push(i as u16);
                }
            }
            offsets.push(ids.len());
        }
        Active::from_parts(offsets, ids)
    }

    #[test]
    fn wide_layers_compute_the_distances_a_table_would_hold() {
        let act = active(FULL_TABLE_MAX + 8, 70);
        let wide = Distances::new(&act, FULL_TABLE_MAX + 8, 64);
        assert!(wide.table.is_none() && wide.window() == WIDE_WINDOW);
        let narrow_act = active(300, 70);
        let narrow = Distances::new(&narrow_act, 300, 64);
        assert_eq!(narrow.window(), 300);
        for (a, b) in [(0u32, 1u32), (5, 299), (120, 7)] {
            assert_eq!(narrow.get(a, b), narrow.compute(a as usize, b as usize));
            assert_eq!(narrow.get(a, b), narrow.get(b, a));
        }
        assert_eq!(wide.get(3, 4000), wide.compute(4000, 3));
    }

    #[test]
    fn windowed_two_opt_keeps_a_permutation_and_never_lengthens_the_path() {
        let n = FULL_TABLE_MAX + 500;
        let d = Distances::new(&active(n, 64), n, 64);
        let mut order: Vec<u32> = (0..n as u32).collect();
        let before = path_cost(&order, &d);
        two_opt(&mut order, &d, 2);
        let after = path_cost(&order, &d);
        assert!(after < before, "{after} >= {before}");
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert!(sorted.iter().enumerate().all(|(i, &v)| v == i as u32));
    }
}
