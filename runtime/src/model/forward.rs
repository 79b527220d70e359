//! The dense forward pass, top to bottom: embed, then per layer attention and
//! feed-forward with residuals, then the final norm; logits are projected on
//! request. All buffers live in `RunState`, allocated once.
//!
//! Numerics follow llama.cpp's CPU backend so outputs match it: activations
//! are quantized to the weight's vec-dot type before each matrix product,
//! keys and values are cached in f16, and attention follows whichever of
//! llama.cpp's two paths the state was made for (`attention.rs`).

use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::ops::{self, RopeTable};
use leanstream_kernels::{matmul, ActBuffer};
use rayon::prelude::*;

use super::attention::{Attention, FlashAttn};
use super::config::{Config, FfnActivation};
use super::hook::{DenseFfn, FfnBy, LayerAt, LayerHook};
use super::kv_cache::KvCache;
use super::weights::{mat, MatRef};
use super::Model;
use crate::{Result, RuntimeError};

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
    attn: Attention,
    acts: ActBuffer,
    /// One RoPE table per thread of the pool the state was made in.
    ropes: Vec<RopeTable>,
    /// Sequence 0's keys and values (the only one, unless the state was
    /// made [`with_sequences`](Self::with_sequences)).
    pub kv: KvCache,
    /// Sequences 1.. of a state that runs several at once.
    more_kv: Vec<KvCache>,
    /// Context position of each row of the pass being run.
    row_pos: Vec<usize>,
    /// `[max_logit_rows][n_vocab]`.
    pub logits: Vec<f32>,
    /// Tokens of the last forward call (rows of `xb`).
    n_rows: usize,
    /// Every row of a pass gets the bits it would get run alone (a
    /// verification pass of drafted tokens), not the batched kernels'.
    pub rows_alone: bool,
}

impl RunState {
    /// A state with llama.cpp's default attention path (flash attention on a CPU).
    pub fn new(c: &Config, ctx: usize, max_batch: usize, max_logit_rows: usize) -> Self {
        Self::sized(c, ctx, max_batch, max_logit_rows, true, FlashAttn::Auto)
    }

    /// [`new`](Self::new) with the attention path `attn`, and without the
    /// FFN's buffers when `ffn` is false (a model whose FFN a hook computes:
    /// the flash engine keeps its own).
    pub fn sized(c: &Config, ctx: usize, max_batch: usize, max_logit_rows: usize, ffn: bool, attn: FlashAttn) -> Self {
        let b = max_batch.max(1);
        let ff = if ffn { c.n_ff } else { 0 };
        let widest = c.n_embd.max(c.q_dim()).max(ff);
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
            attn: Attention::new(c, ctx, b, attn.enabled()),
            acts: ActBuffer::with_capacity(widest, b),
            ropes: (0..rayon::current_num_threads().max(1))
                .map(|_| RopeTable::new(c.n_rot))
                .collect(),
            kv: KvCache::new(c, ctx, b, attn.enabled()),
            more_kv: Vec::new(),
            row_pos: Vec::with_capacity(b),
            logits: vec![0.0; max_logit_rows.max(1) * c.n_vocab],
            n_rows: 0,
            rows_alone: false,
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
            + self.logits.len();
        f32s * 4 + self.attn.bytes() + self.kv_bytes()
    }

    /// This state with room for `n` sequences (at least one), each with
    /// its own KV cache of the state's context, made as sequence 0's is: a
    /// sequence run here gets the cells it would get in a state of its own.
    pub fn with_sequences(mut self, c: &Config, n: usize) -> Self {
        let flash = self.attn.is_flash();
        self.more_kv = (1..n.max(1))
            .map(|_| KvCache::new(c, self.ctx, self.max_batch, flash))
            .collect();
        self
    }

    /// Sequences this state holds a KV cache for.
    pub fn sequences(&self) -> usize {
        1 + self.more_kv.len()
    }

    /// The KV cache of sequence `seq` (`None` past the last).
    pub fn seq_kv(&mut self, seq: usize) -> Option<&mut KvCache> {
        seq_kv(&mut self.kv, &mut self.more_kv, seq)
    }

    /// Bytes of every sequence's KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes() + self.more_kv.iter().map(KvCache::bytes).sum::<usize>()
    }

    /// Whether this state runs flash attention (fixed when it is made: the
    /// cache's value layout follows it).
    pub fn flash_attn(&self) -> bool {
        self.attn.is_flash()
    }
}

fn seq_kv<'a>(kv: &'a mut KvCache, more: &'a mut [KvCache], seq: usize) -> Option<&'a mut KvCache> {
    match seq {
        0 => Some(kv),
        s => more.get_mut(s - 1),
    }
}

/// One sequence's part of a multi-sequence pass: `tokens` at positions
/// `pos0..` of the state's sequence `seq`.
#[derive(Debug, Clone, Copy)]
pub struct SeqRows<'t> {
    pub seq: usize,
    pub tokens: &'t [u32],
    pub pos0: usize,
}

/// Where a sequence's rows sit in a pass.
#[derive(Debug, Clone)]
struct Segment {
    seq: usize,
    rows: std::ops::Range<usize>,
    pos0: usize,
}

/// Fewest tokens a thread takes when a batch's per-token work is split.
const PARALLEL_TOKENS: usize = 8;

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
        self.forward_seq(st, 0, tokens, pos0, outputs, hook)
    }

    /// [`forward_with`](Self::forward_with) on the state's sequence `seq`
    /// (see [`RunState::with_sequences`]).
    pub fn forward_seq(
        &self,
        st: &mut RunState,
        seq: usize,
        tokens: &[u32],
        pos0: usize,
        outputs: std::ops::Range<usize>,
        hook: &mut dyn LayerHook,
    ) -> Result<()> {
        let whole = [Segment {
            seq,
            rows: 0..tokens.len(),
            pos0,
        }];
        self.pass(st, tokens, &whole, outputs, hook)
    }

    /// One pass over several sequences' rows at once (continuous batching,
    /// or one sequence's drafted tokens), each against its own KV cache:
    /// the matrix products (and a streamed FFN's reads) are shared, and
    /// every row is an output. With `alone`, every row gets the bits it
    /// would get run alone, so a sequence decodes the same tokens whatever
    /// runs beside it; without, the batched kernels run (faster, other last
    /// bits). Row `i` of the logits is the `i`-th token in `seqs` order.
    pub fn forward_seqs(
        &self,
        st: &mut RunState,
        seqs: &[SeqRows],
        alone: bool,
        hook: &mut dyn LayerHook,
    ) -> Result<()> {
        let mut tokens = Vec::with_capacity(st.max_batch);
        let mut parts = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            if s.tokens.is_empty() || seqs[..i].iter().any(|o| o.seq == s.seq) {
                return Err(RuntimeError::Invalid(format!(
                    "sequence {} given {} in one pass (each at most once, with at least one token)",
                    s.seq,
                    if s.tokens.is_empty() { "no tokens" } else { "twice" }
                )));
            }
            parts.push(Segment {
                seq: s.seq,
                rows: tokens.len()..tokens.len() + s.tokens.len(),
                pos0: s.pos0,
            });
            tokens.extend_from_slice(s.tokens);
        }
        let before = std::mem::replace(&mut st.rows_alone, alone);
        let pass = self.pass(st, &tokens, &parts, 0..tokens.len(), hook);
        st.rows_alone = before;
        pass
    }

    /// The forward pass: `tokens` split into `parts`, one per sequence.
    fn pass(
        &self,
        st: &mut RunState,
        tokens: &[u32],
        parts: &[Segment],
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
        let sequences = st.sequences();
        for part in parts {
            if part.seq >= sequences {
                return Err(RuntimeError::Invalid(format!(
                    "sequence {} of a state that holds {sequences}",
                    part.seq
                )));
            }
            if part.pos0 + part.rows.len() > st.ctx {
                return Err(RuntimeError::Invalid(format!(
                    "context full: positions up to {} requested, context is {}",
                    part.pos0 + part.rows.len(),
                    st.ctx
                )));
            }
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(RuntimeError::Invalid(format!(
                "token id {bad} outside the vocabulary of {}",
                c.n_vocab
            )));
        }

        st.row_pos.clear();
        for part in parts {
            let kv = seq_kv(&mut st.kv, &mut st.more_kv, part.seq).expect("checked above");
            kv.place(part.pos0, part.rows.len())?;
            st.row_pos.extend(part.pos0..part.pos0 + part.rows.len());
        }
        let pos0 = parts[0].pos0;
        st.acts.set_rows_alone(st.rows_alone);
        hook.rows_alone(st.rows_alone);

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

            // Per token: q/k norms, rotary position and q scaling. Tokens are
            // independent here, so a batch splits across threads (a RoPE
            // table each); then the keys and values go into the cache in order.
            let (qd, kd) = (c.q_dim(), c.kv_dim());
            let rope_base = c.rope_base_of(il);
            let place = |q: &mut [f32], k: &mut [f32], pos: usize, rope: &mut RopeTable| {
                if let Some(w) = &l.q_norm {
                    ops::rms_norm_heads(q, w, c.rms_eps);
                }
                if let Some(w) = &l.k_norm {
                    ops::rms_norm_heads(k, w, c.rms_eps);
                }
                rope.fill(pos, rope_base, c.rope_freq_scale);
                rope.apply(q, c.head_dim, c.rope_style);
                rope.apply(k, c.head_dim, c.rope_style);
                if let Some(s) = c.q_scale {
                    ops::scale(q, s);
                }
            };
            let per = n.div_ceil(st.ropes.len()).max(PARALLEL_TOKENS);
            let row_pos = &st.row_pos;
            st.q[..n * qd]
                .par_chunks_mut(per * qd)
                .zip(st.k[..n * kd].par_chunks_mut(per * kd))
                .zip(st.ropes.par_iter_mut())
                .enumerate()
                .for_each(|(chunk, ((qs, ks), rope))| {
                    for (j, (q, k)) in qs.chunks_exact_mut(qd).zip(ks.chunks_exact_mut(kd)).enumerate() {
                        place(q, k, row_pos[chunk * per + j], rope);
                    }
                });
            // Each sequence's keys and values into its cache, then its
            // queries against it.
            for part in parts {
                let kv = seq_kv(&mut st.kv, &mut st.more_kv, part.seq).expect("checked above");
                for t in part.rows.clone() {
                    let cell = kv.cell(il, st.row_pos[t]);
                    kv.store(il, cell, &st.k[t * kd..(t + 1) * kd], &st.v[t * kd..(t + 1) * kd]);
                }
                let r = part.rows.clone();
                st.attn.run(
                    c,
                    il,
                    kv,
                    &st.q[r.start * qd..r.end * qd],
                    part.pos0,
                    &mut st.att[r.start * qd..r.end * qd],
                );
            }
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
        st.acts.set_rows_alone(st.rows_alone);
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
