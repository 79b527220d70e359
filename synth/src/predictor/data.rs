//! Training examples from an activation trace: per target layer and use, the
//! predictor's input exactly as the runtime quantises it, and the true active
//! set at the operating sparsity.

use leanstream_profiler::activations::read::{Rows, Trace};
use leanstream_profiler::activations::Array;
use leanstream_runtime::predict::{quantize_input, INPUT_SCALE};

use crate::Result;

/// What a predictor for layer `l` sees, by use:
/// - `speculate`: the residual after layer `l-1`'s attention (known when layer
///   `l-1`'s FFN starts, so layer `l` can be fetched while it runs);
/// - `refine`: that residual plus layer `l-1`'s partial FFN output (its hot
///   neurons, computed first), a closer estimate of layer `l`'s input.
///
/// Layer 0 has no previous layer: both uses see the token embedding.
pub const USES: [&str; 2] = ["speculate", "refine"];

/// Raw input rows of each use (in [`USES`] order) for target layer `layer`;
/// the residual is read once for both.
pub fn input_rows(trace: &Trace, split: &str, layer: usize) -> Result<[Rows; 2]> {
    if layer == 0 {
        let x = trace.layer(split, Array::LayerIn, 0)?;
        return Ok([x.clone(), x]);
    }
    let speculate = trace.layer(split, Array::Resid, layer - 1)?;
    let mut refine = speculate.clone();
    let partial = trace.layer(split, Array::Partial, layer - 1)?;
    for (a, b) in refine.data.iter_mut().zip(&partial.data) {
        *a += b;
    }
    Ok([speculate, refine])
}

/// Rows as the runtime's predictor sees them: RMS-normalised, quantised at
/// the fixed input scale, back in f32 (`q / INPUT_SCALE`).
pub fn quantized(x: &Rows) -> Result<Vec<f32>> {
    let mut q = vec![0i8; x.cols];
    let mut out = Vec::with_capacity(x.data.len());
    for r in 0..x.rows {
        quantize_input(x.row(r), &mut q)?;
        out.extend(q.iter().map(|&v| v as f32 / INPUT_SCALE));
    }
    Ok(out)
}

/// Neurons active per token at `sparsity`: the top `(1 - sparsity)` by |act|.
pub fn active_count(n_ff: usize, sparsity: f32) -> usize {
    (((1.0 - sparsity) * n_ff as f32).round() as usize).clamp(1, n_ff)
}

/// Indices of the `k` largest |values| (ties by index), into `idx` (reused).
pub fn top_k_abs(values: &[f32], k: usize, idx: &mut Vec<u32>) {
    idx.clear();
    idx.extend(0..values.len() as u32);
    let key = |i: &u32| values[*i as usize].abs();
    idx.select_nth_unstable_by(k - 1, |a, b| key(b).total_cmp(&key(a)).then(a.cmp(b)));
    idx.truncate(k);
}

/// Per token, per group (`[rows][n_ff / group]`): the target, the fraction of
/// the group's neurons in the true active set (1/0 for single neurons), and
/// the loss weight, `0.5 + |act| / mean |act|` of the group: missing a large
/// activation costs the model more than missing a small one, so it costs
/// the predictor more too.
pub fn labels(act: &Rows, sparsity: f32, group: usize) -> (Vec<f32>, Vec<f32>) {
    let k = active_count(act.cols, sparsity);
    let g = act.cols / group;
    let mut y = vec![0.0; act.rows * g];
    let mut w = vec![0.0; act.rows * g];
    let mut idx = Vec::with_capacity(act.cols);
    for r in 0..act.rows {
        let a = act.row(r);
        top_k_abs(a, k, &mut idx);
        let yr = &mut y[r * g..(r + 1) * g];
        for &i in &idx {
            yr[i as usize / group] += 1.0 / group as f32;
        }
        let mean = a.iter().map(|v| v.abs()).sum::<f32>() / a.len() as f32;
        let inv = if mean > 0.0 { 1.0 / mean } else { 0.0 };
        for (wg, chunk) in w[r * g..(r + 1) * g].iter_mut().zip(a.chunks_exact(group)) {
            *wg = 0.5 + chunk.iter().map(|v| v.abs()).sum::<f32>() * inv / group as f32;
        }
    }
    (y, w)
}
