//! Perplexity the way `llama-perplexity` computes it: the text is cut into
//! chunks of `ctx` tokens (the first replaced by BOS when the model adds
//! one), each chunk is evaluated from an empty cache, and only the second
//! half of each chunk is scored.

use serde::Serialize;

use crate::generate::Decoder;
use crate::model::{DenseFfn, LayerHook, Model};
use crate::tokenizer::Tokenizer;
use crate::{Result, RuntimeError};

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the estimate, as llama-perplexity reports it.
    pub ppl_stderr: f64,
    pub chunks: usize,
    pub ctx: usize,
    pub tokens_scored: usize,
    pub text_tokens: usize,
    /// The top-1 token at each scored position, in order (for agreement
    /// between two runs over the same text).
    #[serde(skip)]
    pub predictions: Vec<u32>,
    /// Each chunk's mean negative log-likelihood, in order (for the
    /// uncertainty of a ratio between two runs over the same text).
    #[serde(skip)]
    pub chunk_nll: Vec<f64>,
}

/// One run's perplexity over another's on the same text, with the standard
/// error of that ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PplRatio {
    pub ratio: f64,
    /// From the chunks' paired differences in mean log-likelihood (chunks
    /// are scored from empty caches, so they, unlike the tokens inside one,
    /// are independent); 0 with fewer than two chunks.
    pub stderr: f64,
}

impl Perplexity {
    /// Fraction of scored positions where `self` and `other` predict the
    /// same top-1 token (both must score the same text the same way).
    pub fn top1_agreement(&self, other: &Perplexity) -> Option<f64> {
        (self.predictions.len() == other.predictions.len() && !self.predictions.is_empty()).then(|| {
            let same = self
                .predictions
                .iter()
                .zip(&other.predictions)
                .filter(|(a, b)| a == b)
                .count();
            same as f64 / self.predictions.len() as f64
        })
    }

    /// `self.ppl / base.ppl` and its standard error. Two runs over the
    /// same text differ token by token far more than on average: near a
    /// sparsity level's 3% line, thresholds moved by half a percent move
    /// the ratio by a point, which this error shows and a bare ratio hides.
    pub fn ratio_to(&self, base: &Perplexity) -> PplRatio {
        let ratio = self.ppl / base.ppl;
        let n = self.chunk_nll.len();
        if n < 2 || base.chunk_nll.len() != n {
            return PplRatio { ratio, stderr: 0.0 };
        }
        let d: Vec<f64> = self.chunk_nll.iter().zip(&base.chunk_nll).map(|(a, b)| a - b).collect();
        let mean = d.iter().sum::<f64>() / n as f64;
        let var = d.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64;
        // The delta method: d ratio = ratio · d(mean difference).
        PplRatio {
            ratio,
            stderr: ratio * (var / n as f64).sqrt(),
        }
    }
}

/// Rows of logits projected at once: bounds memory at 32 × vocabulary floats.
pub const LOGIT_ROWS: usize = 32;

/// `max_chunks` caps the chunk count like llama-perplexity's `--chunks`.
pub fn perplexity(
    model: &Model,
    text: &str,
    ctx: usize,
    max_chunks: Option<usize>,
    progress: bool,
) -> Result<Perplexity> {
    perplexity_with(model, text, ctx, max_chunks, progress, &mut DenseFfn)
}

/// `perplexity` told to `hook` layer by layer (sparsity thresholds, a
/// `.lsflash` model's engine, a probe; see `Model::forward_with`), which
/// keeps whatever it counted.
pub fn perplexity_with(
    model: &Model,
    text: &str,
    ctx: usize,
    max_chunks: Option<usize>,
    progress: bool,
    hook: &mut dyn LayerHook,
) -> Result<Perplexity> {
    perplexity_in_batches(model, text, ctx, max_chunks, progress, hook, 512)
}

/// [`perplexity_with`] with forward passes of at most `batch` tokens. With
/// 1 it runs as decoding does: a hook whose choices depend on the batch (a
/// predictor's union over the rows) is then measured as a generation sees
/// it; hooks that decide row by row give the same numbers at any batch.
#[allow(clippy::too_many_arguments)]
pub fn perplexity_in_batches(
    model: &Model,
    text: &str,
    ctx: usize,
    max_chunks: Option<usize>,
    progress: bool,
    hook: &mut dyn LayerHook,
    batch: usize,
) -> Result<Perplexity> {
    let (tokens, n_chunks) = chunked(model, text, ctx, max_chunks)?;
    let tok = &model.tokenizer;
    let first = ctx / 2;
    let mut st = model.new_state(ctx, ctx.min(batch.max(1)), LOGIT_ROWS);
    let bar = chunks_bar(n_chunks, progress);
    let mut scores = Scores::default();
    let mut chunk_tokens = vec![0u32; ctx];
    for i in 0..n_chunks {
        chunk(tok, &tokens, i, &mut chunk_tokens);
        // Batches of at most max_batch tokens. Like llama-perplexity, only the
        // scored half of the chunk produces outputs.
        let mut pos = 0;
        for batch in chunk_tokens.chunks(st.max_batch) {
            let batch_end = pos + batch.len();
            let out_start = first.max(pos);
            // A batch before the scored half still needs one output row.
            let outputs = if out_start >= batch_end {
                batch.len() - 1..batch.len()
            } else {
                out_start - pos..batch.len()
            };
            model.forward_with(&mut st, batch, pos, outputs, hook)?;
            // Position ctx-1 predicts nothing inside the chunk.
            let score_end = batch_end.min(ctx - 1);
            let mut row = out_start;
            while row < score_end {
                let count = LOGIT_ROWS.min(score_end - row);
                let logits = model.logits(&mut st, row - out_start, count)?;
                for (r, l) in logits.chunks_exact(model.config.n_vocab).enumerate() {
                    scores.add(l, chunk_tokens[row + r + 1]);
                }
                row += count;
            }
            pos = batch_end;
        }
        scores.end_chunk();
        bar.inc(1);
        bar.set_message(format!("ppl {:.4}", scores.ppl()));
    }
    bar.finish_and_clear();
    Ok(scores.finish(n_chunks, ctx, tokens.len()))
}

/// The same perplexity through any [`Decoder`] (a device engine, which
/// gives the last position's logits only): each chunk's first half in one
/// call, then the scored half a token at a time, as generation runs it.
/// The same positions are scored as by [`perplexity`].
pub fn perplexity_decoding(
    model: &Model,
    text: &str,
    ctx: usize,
    max_chunks: Option<usize>,
    progress: bool,
    decoder: &mut dyn Decoder,
) -> Result<Perplexity> {
    let (tokens, n_chunks) = chunked(model, text, ctx, max_chunks)?;
    if decoder.ctx() < ctx {
        return Err(RuntimeError::Invalid(format!(
            "perplexity at a context of {ctx} on a decoder of {}",
            decoder.ctx()
        )));
    }
    let first = ctx / 2;
    let bar = chunks_bar(n_chunks, progress);
    let mut scores = Scores::default();
    let mut chunk_tokens = vec![0u32; ctx];
    for i in 0..n_chunks {
        chunk(&model.tokenizer, &tokens, i, &mut chunk_tokens);
        decoder.ingest(&chunk_tokens[..=first], 0)?;
        for row in first..ctx - 1 {
            if row > first {
                decoder.ingest(&chunk_tokens[row..=row], row)?;
            }
            scores.add(decoder.logits()?, chunk_tokens[row + 1]);
        }
        scores.end_chunk();
        bar.inc(1);
        bar.set_message(format!("ppl {:.4}", scores.ppl()));
    }
    bar.finish_and_clear();
    Ok(scores.finish(n_chunks, ctx, tokens.len()))
}

/// `text`'s tokens and how many chunks of `ctx` to score (at most `max_chunks`).
fn chunked(model: &Model, text: &str, ctx: usize, max_chunks: Option<usize>) -> Result<(Vec<u32>, usize)> {
    if ctx < 4 {
        return Err(RuntimeError::Invalid(format!("context {ctx} too small for perplexity")));
    }
    let tokens = model.tokenizer.encode(text, true, false);
    if tokens.len() < 2 * ctx {
        return Err(RuntimeError::Invalid(format!(
            "need at least {} tokens for a context of {ctx}; the text has {}",
            2 * ctx,
            tokens.len()
        )));
    }
    let n_chunks = (tokens.len() / ctx).min(max_chunks.unwrap_or(usize::MAX));
    Ok((tokens, n_chunks))
}

fn chunks_bar(n_chunks: usize, progress: bool) -> indicatif::ProgressBar {
    crate::progress::bar(
        n_chunks as u64,
        progress,
        "perplexity {bar:30} {pos}/{len} chunks, ETA {eta} {msg}",
    )
}

/// Chunk `i` of `tokens` into `out`, its first token BOS where the model adds one.
fn chunk(tok: &Tokenizer, tokens: &[u32], i: usize, out: &mut [u32]) {
    let ctx = out.len();
    out.copy_from_slice(&tokens[i * ctx..(i + 1) * ctx]);
    if tok.add_bos() {
        if let Some(bos) = tok.bos() {
            out[0] = bos;
        }
    }
}

/// The scored positions' negative log-likelihoods and top-1 tokens.
#[derive(Default)]
struct Scores {
    nll: f64,
    nll2: f64,
    count: usize,
    predictions: Vec<u32>,
    chunk_nll: Vec<f64>,
    /// NLL and count where the current chunk began.
    chunk_start: (f64, usize),
}

impl Scores {
    /// One position: its logits and the token that follows.
    fn add(&mut self, logits: &[f32], target: u32) {
        let lp = log_softmax_at(logits, target as usize);
        self.predictions.push(crate::generate::argmax(logits));
        self.nll -= lp;
        self.nll2 += lp * lp;
        self.count += 1;
    }

    /// Closes the current chunk.
    fn end_chunk(&mut self) {
        let (nll, count) = self.chunk_start;
        self.chunk_nll
            .push((self.nll - nll) / (self.count - count).max(1) as f64);
        self.chunk_start = (self.nll, self.count);
    }

    fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    fn finish(self, chunks: usize, ctx: usize, text_tokens: usize) -> Perplexity {
        let count = self.count;
        let mean = self.nll / count as f64;
        let ppl = mean.exp();
        let var = self.nll2 / count as f64 - mean * mean;
        let ppl_stderr = if var > 0.0 && count > 1 {
            (var / (count - 1) as f64).sqrt() * ppl
        } else {
            0.0
        };
        Perplexity {
            ppl,
            ppl_stderr,
            chunks,
            ctx,
            tokens_scored: count,
            text_tokens,
            predictions: self.predictions,
            chunk_nll: self.chunk_nll,
        }
    }
}

/// log p(target) under softmax(logits), normaliser summed in f64.
fn log_softmax_at(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max).exp()) as f64).sum();
    (logits[target] - max) as f64 - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunk_nll: Vec<f64>) -> Perplexity {
        let mean = chunk_nll.iter().sum::<f64>() / chunk_nll.len() as f64;
        Perplexity {
            ppl: mean.exp(),
            ppl_stderr: 0.0,
            chunks: chunk_nll.len(),
            ctx: 8,
            tokens_scored: 3 * chunk_nll.len(),
            text_tokens: 8 * chunk_nll.len(),
            predictions: Vec::new(),
            chunk_nll,
        }
    }

    #[test]
    fn a_ratio_is_as_uncertain_as_its_chunks_differ() {
        let base = run(vec![1.0, 2.0, 3.0]);
        // The same shift in every chunk: certain.
        let shifted = run(vec![1.1, 2.1, 3.1]);
        let r = shifted.ratio_to(&base);
        assert!(
            (r.ratio - 0.1f64.exp()).abs() < 1e-12 && r.stderr.abs() < 1e-12,
            "{r:?}"
        );
        // Differences 0 and 0.2: mean 0.1, sample variance 0.02 over 2 chunks.
        let base = run(vec![1.0, 2.0]);
        let r = run(vec![1.0, 2.2]).ratio_to(&base);
        assert!((r.stderr - r.ratio * 0.1).abs() < 1e-12, "{r:?}");
        // Runs over other chunkings have no paired error.
        assert_eq!(run(vec![1.0, 2.0, 3.0]).ratio_to(&base).stderr, 0.0);
    }
}
