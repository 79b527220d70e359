//! The dense forward pass, top to bottom: embed, then per layer attention and
//! feed-forward with residuals, then the final norm; logits are projected on
//! request. All buffers live in `RunState`, allocated once.
//!
//! Numerics follow llama.cpp's CPU backend so outputs match it: activations
//! are quantized to the weight's vec-dot type before each matrix product,
//! keys and values are cached in f16, and q and the attention probabilities
//! are rounded to f16 before they meet the cache.

use half::f16;
use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::f16dot::{dot_f16_gemm, dot_f16_gemm_x4, dot_f16_vec};
use leanstream_kernels::ops::{self, RopeTable};
use leanstream_kernels::{matmul, ActBuffer};
use rayon::prelude::*;

use super::config::{Config, FfnActivation};
use super::hook::{DenseFfn, FfnBy, LayerAt, LayerHook};
use super::weights::{mat, MatRef};
use super::Model;
use crate::{Result, RuntimeError};

/// Keys as `[layer][pos][kv_head * head_dim]`; values transposed as
/// `[layer][kv_head][dim][pos]` so both attention products are contiguous dots.
pub struct KvCache {
    k: Vec<f16>,
    v: Vec<f16>,
    ctx: usize,
    kv_dim: usize,
    head_dim: usize,
}

impl KvCache {
    fn new(c: &Config, ctx: usize) -> Self {
        // Room for a whole group of LANES past the last position, which reads as zeros.
        let ctx = ctx.div_ceil(LANES) * LANES;
        let n = c.n_layer * ctx * c.kv_dim();
        Self {
            k: zeroed_f16(n),
            v: zeroed_f16(n),
            ctx,
            kv_dim: c.kv_dim(),
            head_dim: c.head_dim,
        }
    }

    fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let base = (layer * self.ctx + pos) * self.kv_dim;
        for (dst, &src) in self.k[base..base + self.kv_dim].iter_mut().zip(k) {
            *dst = f16::from_f32(src);
        }
        let layer_base = layer * self.kv_dim * self.ctx;
        for (i, &src) in v.iter().enumerate() {
            // i = kv_head * head_dim + dim, which is also the row index in the transposed layout.
            self.v[layer_base + i * self.ctx + pos] = f16::from_f32(src);
        }
    }

    fn key(&self, layer: usize, pos: usize, kv_head: usize) -> &[f16] {
        let base = (layer * self.ctx + pos) * self.kv_dim + kv_head * self.head_dim;
        &self.k[base..base + self.head_dim]
    }

    /// Values of one dimension of one kv head over positions `lo..hi`.
    fn value_row(&self, layer: usize, kv_head: usize, dim: usize, lo: usize, hi: usize) -> &[f16] {
        let row = layer * self.kv_dim * self.ctx + (kv_head * self.head_dim + dim) * self.ctx;
        &self.v[row + lo..row + hi]
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }

    fn layers(&self) -> usize {
        self.k.len() / (self.ctx * self.kv_dim).max(1)
    }

    /// A copy of the keys and values of positions `0..n` of every layer.
    pub fn save_prefix(&self, n: usize) -> KvPrefix {
        let (n, d, ctx) = (n.min(self.ctx), self.kv_dim, self.ctx);
        let mut k = Vec::with_capacity(self.layers() * n * d);
        for l in 0..self.layers() {
            k.extend_from_slice(&self.k[l * ctx * d..(l * ctx + n) * d]);
        }
        let mut v = Vec::with_capacity(self.layers() * n * d);
        for row in 0..self.layers() * d {
            v.extend_from_slice(&self.v[row * ctx..row * ctx + n]);
        }
        KvPrefix { n, k, v }
    }

    /// Puts back what [`save_prefix`](Self::save_prefix) copied: positions
    /// `0..p.len()` then hold what they held then.
    pub fn restore_prefix(&mut self, p: &KvPrefix) -> Result<()> {
        let (n, d, ctx) = (p.n, self.kv_dim, self.ctx);
        if n > ctx || p.k.len() != self.layers() * n * d || p.v.len() != p.k.len() {
            return Err(RuntimeError::Invalid(format!(
                "a saved KV prefix of {n} positions does not fit this cache ({ctx} positions, {d} wide)"
            )));
        }
        for l in 0..self.layers() {
            self.k[l * ctx * d..(l * ctx + n) * d].copy_from_slice(&p.k[l * n * d..(l + 1) * n * d]);
        }
        for row in 0..self.layers() * d {
            self.v[row * ctx..row * ctx + n].copy_from_slice(&p.v[row * n..(row + 1) * n]);
        }
        Ok(())
    }
}

/// Keys and values of a prompt's first positions, kept to start a later
/// prompt with the same beginning without running it again.
pub struct KvPrefix {
    n: usize,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl KvPrefix {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }
}

/// Attention sums run in groups of this many positions (see `attention`).
const LANES: usize = 64;

/// Attention score scratch is processed in waves of (token, head) pairs so
/// its size is bounded whatever the batch and context.
const SCORE_SCRATCH: usize = 1 << 20;

/// `n` zeros in one zeroed allocation, whose pages the OS maps only when
/// first written: a cache sized for a long context holds memory only for the
/// positions used, and a process refused by its memory budget (or killed by
/// a cgroup) is not charged for it up front. (`vec![f16::ZERO; n]` writes
/// every element.)
fn zeroed_f16(n: usize) -> Vec<f16> {
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    // SAFETY: `f16` is `repr(transparent)` over `u16` (same size, alignment
    // and bit pattern for 0), and the allocation is handed over whole.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<f16>(), v.len(), v.capacity()) }
}

pub struct RunState {
    pub ctx: usize,
    pub max_batch: usize,
    pub max_logit_rows: usize,
    /// Residual stream, `[batch][n_embd]`.
    x: Vec<f32>,
    /// Normed input of the current block; after `forward`, the final normed hidden states.
    xb: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    q16: Vec<f16>,
    scores: Vec<f32>,
    probs: Vec<f16>,
    acts: ActBuffer,
    rope: RopeTable,
    pub kv: KvCache,
    /// `[max_logit_rows][n_vocab]`.
    pub logits: Vec<f32>,
    /// Tokens of the last forward call (rows of `xb`).
    n_rows: usize,
}

impl RunState {
    pub fn new(c: &Config, ctx: usize, max_batch: usize, max_logit_rows: usize) -> Self {
        Self::sized(c, ctx, max_batch, max_logit_rows, true)
    }

    /// [`new`](Self::new), without the FFN's buffers when `ffn` is false (a
    /// model whose FFN a hook computes: the flash engine keeps its own).
    pub fn sized(c: &Config, ctx: usize, max_batch: usize, max_logit_rows: usize, ffn: bool) -> Self {
        let b = max_batch.max(1);
        let ff = if ffn { c.n_ff } else { 0 };
        let widest = c.n_embd.max(c.q_dim()).max(ff);
        // One wave holds every (token, head) pair of a batch when that is
        // smaller than the bound: a short context needs little scratch.
        let ctx_padded = ctx.div_ceil(LANES) * LANES;
        let score_len = SCORE_SCRATCH.min(b * c.n_head * ctx_padded).max(ctx_padded);
        Self {
            ctx,
            max_batch: b,
            max_logit_rows: max_logit_rows.max(1),
            x: vec![0.0; b * c.n_embd],
            xb: vec![0.0; b * c.n_embd],
            q: vec![0.0; b * c.q_dim()],
            k: vec![0.0; b * c.kv_dim()],
            v: vec![0.0; b * c.kv_dim()],
            att: vec![0.0; b * c.q_dim()],
            proj: vec![0.0; b * c.n_embd],
            gate: vec![0.0; b * ff],
            up: vec![0.0; b * ff],
            q16: vec![f16::ZERO; b * c.q_dim()],
            scores: vec![0.0; score_len],
            probs: vec![f16::ZERO; score_len],
            acts: ActBuffer::with_capacity(widest, b),
            rope: RopeTable::new(c.n_rot),
            kv: KvCache::new(c, ctx),
            logits: vec![0.0; max_logit_rows.max(1) * c.n_vocab],
            n_rows: 0,
        }
    }

    /// Bytes held by this state (KV cache plus activation buffers).
    pub fn bytes(&self) -> usize {
        let f32s = self.x.len()
            + self.xb.len()
            + self.q.len()
            + self.k.len()
            + self.v.len()
            + self.att.len()
            + self.proj.len()
            + self.gate.len()
            + self.up.len()
            + self.scores.len()
            + self.logits.len();
        f32s * 4 + (self.q16.len() + self.probs.len()) * 2 + self.kv.bytes()
    }
}

/// Quantizes `x` for `w` unless the buffer already holds it in the right type.
fn prepare(acts: &mut ActBuffer, w: &MatRef, x: &[f32], n: usize, fresh: &mut bool) -> Result<()> {
    let ty = w.ty.vec_dot_type();
    if !*fresh || acts.dot_type() != ty {
        acts.quantize(ty, &x[..n * w.cols], n, w.cols)?;
        *fresh = true;
    }
    Ok(())
}

fn add_bias(out: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(b.len()) {
            ops::add_assign(row, b);
        }
    }
}

impl Model {
    /// Runs `tokens` at positions `pos0..pos0 + tokens.len()`, filling the KV
    /// cache and leaving every token's final normed hidden state for `logits`.
    pub fn forward(&self, st: &mut RunState, tokens: &[u32], pos0: usize) -> Result<()> {
        self.forward_outputs(st, tokens, pos0, 0..tokens.len())
    }

    /// Like `forward`, but only the tokens at batch rows `outputs` get final
    /// hidden states (row `outputs.start` becomes logits row 0). As in
    /// llama.cpp, the last layer's feed-forward runs on those rows alone:
    /// cheaper, and the same row count means the same kernel choices.
    pub fn forward_outputs(
        &self,
        st: &mut RunState,
        tokens: &[u32],
        pos0: usize,
        outputs: std::ops::Range<usize>,
    ) -> Result<()> {
        self.forward_with(st, tokens, pos0, outputs, &mut DenseFfn)
    }

    /// `forward_outputs` told to `hook` layer by layer, which may supply
    /// each layer's FFN (norms, post-norm and residual stay here).
    pub fn forward_with(
        &self,
        st: &mut RunState,
        tokens: &[u32],
        pos0: usize,
        outputs: std::ops::Range<usize>,
        hook: &mut dyn LayerHook,
    ) -> Result<()> {
        let c = &self.config;
        let file = self.gguf.data();
        let mut n = tokens.len();
        if outputs.is_empty() || outputs.end > n {
            return Err(RuntimeError::Invalid(format!(
                "output rows {outputs:?} of a batch of {n}"
            )));
        }
        let d = c.n_embd;
        if n == 0 || n > st.max_batch {
            return Err(RuntimeError::Invalid(format!(
                "batch of {n} tokens (1..={} allowed)",
                st.max_batch
            )));
        }
        if pos0 + n > st.ctx {
            return Err(RuntimeError::Invalid(format!(
                "context full: positions up to {} requested, context is {}",
                pos0 + n,
                st.ctx
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(RuntimeError::Invalid(format!(
                "token id {bad} outside the vocabulary of {}",
                c.n_vocab
            )));
        }

        // Token embeddings.
        let embd = mat(file, &self.weights.token_embd);
        for (t, &tok) in tokens.iter().enumerate() {
            let x = &mut st.x[t * d..(t + 1) * d];
            dequantize_row(embd.ty, embd.row(tok as usize), x)?;
            if let Some(s) = c.embd_scale {
                ops::scale(x, s);
            }
        }

        // Batch rows the buffers hold; the last layer narrows them to `outputs`.
        let mut rows = 0..n;
        for (il, l) in self.weights.layers.iter().enumerate() {
            let mut at = LayerAt {
                layer: il,
                rows: rows.clone(),
                pos0,
            };
            hook.layer_input(&at, &st.x[..n * d]);
            // Attention: norm, q/k/v projections.
            ops::rms_norm_rows(&st.x[..n * d], &l.attn_norm, c.rms_eps, &mut st.xb[..n * d]);
            let mut fresh = false;
            prepare(&mut st.acts, &l.wq, &st.xb, n, &mut fresh)?;
            matmul(&mat(file, &l.wq), &st.acts, &mut st.q[..n * c.q_dim()])?;
            prepare(&mut st.acts, &l.wk, &st.xb, n, &mut fresh)?;
            matmul(&mat(file, &l.wk), &st.acts, &mut st.k[..n * c.kv_dim()])?;
            prepare(&mut st.acts, &l.wv, &st.xb, n, &mut fresh)?;
            matmul(&mat(file, &l.wv), &st.acts, &mut st.v[..n * c.kv_dim()])?;
            add_bias(&mut st.q[..n * c.q_dim()], &l.bq);
            add_bias(&mut st.k[..n * c.kv_dim()], &l.bk);
            add_bias(&mut st.v[..n * c.kv_dim()], &l.bv);

            // Per token: q/k norms, rotary position, q scaling, cache the keys and values.
            for t in 0..n {
                let pos = pos0 + t;
                let q = &mut st.q[t * c.q_dim()..(t + 1) * c.q_dim()];
                let k = &mut st.k[t * c.kv_dim()..(t + 1) * c.kv_dim()];
                if let Some(w) = &l.q_norm {
                    ops::rms_norm_heads(q, w, c.rms_eps);
                }
                if let Some(w) = &l.k_norm {
                    ops::rms_norm_heads(k, w, c.rms_eps);
                }
                st.rope.fill(pos, c.rope_base_of(il), c.rope_freq_scale);
                st.rope.apply(q, c.head_dim, c.rope_style);
                st.rope.apply(k, c.head_dim, c.rope_style);
                if let Some(s) = c.q_scale {
                    ops::scale(q, s);
                }
                st.kv.store(il, pos, k, &st.v[t * c.kv_dim()..(t + 1) * c.kv_dim()]);
            }
            for (dst, &src) in st.q16[..n * c.q_dim()].iter_mut().zip(&st.q[..n * c.q_dim()]) {
                *dst = f16::from_f32(src);
            }
            attention(
                c,
                il,
                &st.kv,
                &st.q16[..n * c.q_dim()],
                pos0,
                &mut st.scores,
                &mut st.probs,
                &mut st.att[..n * c.q_dim()],
            );
            let mut fresh = false;
            prepare(&mut st.acts, &l.wo, &st.att, n, &mut fresh)?;
            matmul(&mat(file, &l.wo), &st.acts, &mut st.proj[..n * d])?;
            residual(
                &mut st.x[..n * d],
                &st.proj[..n * d],
                l.attn_post_norm.as_deref(),
                c.rms_eps,
                &mut st.xb[..n * d],
            );
            if il + 1 == c.n_layer {
                st.x.copy_within(outputs.start * d..outputs.end * d, 0);
                n = outputs.len();
                rows = outputs.clone();
                at.rows = rows.clone();
            }

            // Feed-forward: norm, gate and up, gated activation, down, optional post-norm, residual.
            ops::rms_norm_rows(&st.x[..n * d], &l.ffn_norm, c.rms_eps, &mut st.xb[..n * d]);
            let by = hook.ffn(&at, &st.x[..n * d], &st.xb[..n * d], &mut st.proj[..n * d])?;
            if by == FfnBy::Model {
                let (Some(gate), Some(up), Some(down)) = (&l.ffn_gate, &l.ffn_up, &l.ffn_down) else {
                    return Err(RuntimeError::Invalid(format!(
                        "layer {il} has no FFN matrices (a streamed model needs a hook that computes its FFN)"
                    )));
                };
                let ff = c.n_ff;
                let mut fresh = false;
                prepare(&mut st.acts, gate, &st.xb, n, &mut fresh)?;
                matmul(&mat(file, gate), &st.acts, &mut st.gate[..n * ff])?;
                prepare(&mut st.acts, up, &st.xb, n, &mut fresh)?;
                matmul(&mat(file, up), &st.acts, &mut st.up[..n * ff])?;
                hook.gate(&at, &st.gate[..n * ff], c.ffn_activation);
                match c.ffn_activation {
                    FfnActivation::Silu => ops::swiglu(&mut st.gate[..n * ff], &st.up[..n * ff]),
                    FfnActivation::GeluTanh => ops::geglu(&mut st.gate[..n * ff], &st.up[..n * ff]),
                }
                hook.activations(&at, &mut st.gate[..n * ff]);
                if let Some(mask) = hook.partial_mask(il) {
                    // The output of the masked neurons alone, as the residual would receive it.
                    for (u, g) in st.up[..n * ff].chunks_exact_mut(ff).zip(st.gate.chunks_exact(ff)) {
                        for ((u, &g), &m) in u.iter_mut().zip(g).zip(mask) {
                            *u = g * m;
                        }
                    }
                    let mut fresh = false;
                    prepare(&mut st.acts, down, &st.up, n, &mut fresh)?;
                    matmul(&mat(file, down), &st.acts, &mut st.proj[..n * d])?;
                    let partial = match l.ffn_post_norm.as_deref() {
                        Some(w) => {
                            ops::rms_norm_rows(&st.proj[..n * d], w, c.rms_eps, &mut st.xb[..n * d]);
                            &st.xb[..n * d]
                        }
                        None => &st.proj[..n * d],
                    };
                    hook.partial_output(&at, partial);
                }
                let mut fresh = false;
                prepare(&mut st.acts, down, &st.gate, n, &mut fresh)?;
                matmul(&mat(file, down), &st.acts, &mut st.proj[..n * d])?;
            }
            hook.ffn_output(&at, &st.proj[..n * d]);
            residual(
                &mut st.x[..n * d],
                &st.proj[..n * d],
                l.ffn_post_norm.as_deref(),
                c.rms_eps,
                &mut st.xb[..n * d],
            );
        }

        ops::rms_norm_rows(
            &st.x[..n * d],
            &self.weights.output_norm,
            c.rms_eps,
            &mut st.xb[..n * d],
        );
        st.n_rows = n;
        Ok(())
    }

    /// Projects rows `first..first + count` of the last forward call to
    /// logits, returned as `[count][n_vocab]`.
    pub fn logits<'s>(&self, st: &'s mut RunState, first: usize, count: usize) -> Result<&'s [f32]> {
        let c = &self.config;
        if count == 0 || count > st.max_logit_rows || first + count > st.n_rows {
            return Err(RuntimeError::Invalid(format!(
                "logit rows {first}..{} requested; {} rows computed, {} at a time",
                first + count,
                st.n_rows,
                st.max_logit_rows
            )));
        }
        let head = &self.weights.output;
        let hidden = &st.xb[first * c.n_embd..(first + count) * c.n_embd];
        st.acts.quantize(head.ty.vec_dot_type(), hidden, count, c.n_embd)?;
        let out = &mut st.logits[..count * c.n_vocab];
        matmul(&mat(self.gguf.data(), head), &st.acts, out)?;
        if let Some(cap) = c.final_logit_softcap {
            for v in out.iter_mut() {
                *v = (*v / cap).tanh() * cap;
            }
        }
        Ok(&st.logits[..count * c.n_vocab])
    }
}

/// `x += post_norm(y)` (or `x += y` without a post-norm); `tmp` is scratch.
fn residual(x: &mut [f32], y: &[f32], post_norm: Option<&[f32]>, eps: f32, tmp: &mut [f32]) {
    match post_norm {
        Some(w) => {
            ops::rms_norm_rows(y, w, eps, tmp);
            ops::add_assign(x, tmp);
        }
        None => ops::add_assign(x, y),
    }
}

/// Causal (and, on sliding layers, windowed) attention of every query row in
/// `q16` against the cache, written to `out` as `[token][head * head_dim]`.
///
/// Scores and probabilities are laid out in groups of `LANES` aligned to
/// cache position 0, masked entries holding -inf (then 0), so the sums run in
/// the same groups as llama.cpp's over its padded cache.
#[allow(clippy::too_many_arguments)]
fn attention(
    c: &Config,
    layer: usize,
    kv: &KvCache,
    q16: &[f16],
    pos0: usize,
    scores: &mut [f32],
    probs: &mut [f16],
    out: &mut [f32],
) {
    let hd = c.head_dim;
    let group = c.n_head / c.n_head_kv;
    let pairs = out.len() / hd;
    let ctx = kv.ctx;
    // llama.cpp takes its GEMM route for batches and its vector route for one query.
    let gemm = pairs > c.n_head;
    let dot = if gemm { dot_f16_gemm } else { dot_f16_vec };
    let wave = (scores.len() / ctx).clamp(1, pairs);
    for start in (0..pairs).step_by(wave) {
        let end = (start + wave).min(pairs);
        out[start * hd..end * hd]
            .par_chunks_mut(hd)
            .zip(scores.par_chunks_mut(ctx))
            .zip(probs.par_chunks_mut(ctx))
            .enumerate()
            .for_each(|(i, ((o, s), p))| {
                let pair = start + i;
                let (t, h) = (pair / c.n_head, pair % c.n_head);
                let kv_head = h / group;
                let pos = pos0 + t;
                let lo = c.first_visible(layer, pos);
                let (lo_a, hi_a) = (lo / LANES * LANES, (pos + 1).div_ceil(LANES) * LANES);
                let q = &q16[pair * hd..(pair + 1) * hd];
                let s = &mut s[..hi_a - lo_a];
                s.fill(f32::NEG_INFINITY);
                let key = |at: usize| kv.key(layer, at, kv_head);
                let mut at = lo;
                if gemm {
                    // Four keys per call share the conversion of q; each sum keeps its order.
                    while at + 4 <= pos + 1 {
                        let d = dot_f16_gemm_x4(q, [key(at), key(at + 1), key(at + 2), key(at + 3)]);
                        for (k, dk) in d.iter().enumerate() {
                            s[at + k - lo_a] = dk * c.kq_scale;
                        }
                        at += 4;
                    }
                }
                for at in at..=pos {
                    s[at - lo_a] = dot(key(at), q) * c.kq_scale;
                }
                ops::softmax(s);
                let p = &mut p[..hi_a - lo_a];
                for (pj, &sj) in p.iter_mut().zip(s.iter()) {
                    *pj = f16::from_f32(sj);
                }
                let value = |dim: usize| kv.value_row(layer, kv_head, dim, lo_a, hi_a);
                let mut dim = 0;
                if gemm {
                    while dim + 4 <= hd {
                        let d = dot_f16_gemm_x4(p, [value(dim), value(dim + 1), value(dim + 2), value(dim + 3)]);
                        o[dim..dim + 4].copy_from_slice(&d);
                        dim += 4;
                    }
                }
                for (dim, od) in o.iter_mut().enumerate().skip(dim) {
                    *od = dot(value(dim), p);
                }
            });
    }
}
