//! The dense engine on a CUDA device: the CPU engine's forward pass
//! (`runtime/src/model/forward.rs`) read top to bottom, each step a kernel
//! of `kernels/cuda/`, with the weights and an f16 KV cache in device
//! memory and every buffer allocated once. Activations are quantized to
//! each weight's vec-dot type before its product, as on the CPU, so logits
//! agree with the CPU engine's to rounding.

use cudarc::driver::CudaSlice;
use leanstream_kernels::ops::RopeStyle;
use leanstream_kernels::GgmlType;
use leanstream_runtime::generate::Decoder;
use leanstream_runtime::model::{Config, FfnActivation, MatRef, Model};
use leanstream_runtime::RuntimeError;

use crate::device::{DevPtr, Gpu};
use crate::{CudaError, Result};

/// A weight matrix in device memory.
struct Mat {
    data: CudaSlice<u8>,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

struct Layer {
    attn_norm: CudaSlice<f32>,
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    bq: Option<CudaSlice<f32>>,
    bk: Option<CudaSlice<f32>>,
    bv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    attn_post_norm: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    gate: Mat,
    up: Mat,
    down: Mat,
    ffn_post_norm: Option<CudaSlice<f32>>,
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
}

/// Activation buffers, `[max_batch][width]`.
struct Buffers {
    x: CudaSlice<f32>,
    xb: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    /// Activations in a dot type (the widest row of any, for the batch).
    acts: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    /// Per token, `n_rot / 2` cosines then as many sines.
    rope: CudaSlice<f32>,
}

pub struct GpuModel<'m> {
    pub gpu: Gpu,
    model: &'m Model,
    embd: Mat,
    output: Mat,
    output_norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    /// GGML's GELU of every f16 value (what the GeGLU kernel looks up).
    gelu: CudaSlice<f32>,
    buf: Buffers,
    /// The last logits on the host, for the generation loop ([`Decoder`]).
    host_logits: Vec<f32>,
    pub ctx: usize,
    pub max_batch: usize,
}

impl<'m> GpuModel<'m> {
    /// Uploads `model` to `gpu` for contexts of `ctx` tokens run in batches
    /// of up to `max_batch`.
    pub fn new(gpu: Gpu, model: &'m Model, ctx: usize, max_batch: usize) -> Result<Self> {
        let c = &model.config;
        let file = model.gguf.data();
        let mat = |m: &MatRef| -> Result<Mat> {
            let bytes = file.get(m.offset..m.offset + m.n_bytes).ok_or_else(|| {
                CudaError::Invalid(format!("a {}x{} {} matrix outside the file", m.rows, m.cols, m.ty))
            })?;
            Ok(Mat {
                data: gpu.upload(bytes)?,
                ty: m.ty,
                rows: m.rows,
                cols: m.cols,
            })
        };
        let vec = |v: &[f32]| gpu.upload(v);
        let opt = |v: &Option<Vec<f32>>| v.as_deref().map(|v| gpu.upload(v)).transpose();
        let w = &model.weights;
        let mut layers = Vec::with_capacity(c.n_layer);
        for (il, l) in w.layers.iter().enumerate() {
            let ffn = |m: &Option<MatRef>, what: &str| {
                m.as_ref()
                    .ok_or_else(|| CudaError::Invalid(format!("layer {il} has no {what} matrix")))
                    .and_then(&mat)
            };
            layers.push(Layer {
                attn_norm: vec(&l.attn_norm)?,
                wq: mat(&l.wq)?,
                wk: mat(&l.wk)?,
                wv: mat(&l.wv)?,
                wo: mat(&l.wo)?,
                bq: opt(&l.bq)?,
                bk: opt(&l.bk)?,
                bv: opt(&l.bv)?,
                q_norm: opt(&l.q_norm)?,
                k_norm: opt(&l.k_norm)?,
                attn_post_norm: opt(&l.attn_post_norm)?,
                ffn_norm: vec(&l.ffn_norm)?,
                gate: ffn(&l.ffn_gate, "ffn_gate")?,
                up: ffn(&l.ffn_up, "ffn_up")?,
                down: ffn(&l.ffn_down, "ffn_down")?,
                ffn_post_norm: opt(&l.ffn_post_norm)?,
                k_cache: gpu.zeros(ctx * c.kv_dim())?,
                v_cache: gpu.zeros(ctx * c.kv_dim())?,
            });
        }
        let gelu: Vec<f32> = (0..=u16::MAX)
            .map(|h| {
                let v = half::f16::from_bits(h).to_f32();
                if v.abs() < 10.0 {
                    leanstream_kernels::ops::gelu(v)
                } else {
                    0.0
                }
            })
            .collect();
        let b = max_batch.max(1);
        let widest = c.n_embd.max(c.q_dim()).max(c.n_ff);
        // F32 is the widest dot type (4 bytes a value).
        let buf = Buffers {
            x: gpu.zeros(b * c.n_embd)?,
            xb: gpu.zeros(b * c.n_embd)?,
            q: gpu.zeros(b * c.q_dim())?,
            k: gpu.zeros(b * c.kv_dim())?,
            v: gpu.zeros(b * c.kv_dim())?,
            att: gpu.zeros(b * c.q_dim())?,
            proj: gpu.zeros(b * c.n_embd)?,
            gate: gpu.zeros(b * c.n_ff)?,
            up: gpu.zeros(b * c.n_ff)?,
            acts: gpu.zeros(b * widest * 4)?,
            logits: gpu.zeros(c.n_vocab)?,
            tokens: gpu.zeros(b)?,
            rope: gpu.zeros(b * c.n_rot)?,
        };
        Ok(Self {
            embd: mat(&w.token_embd)?,
            output: mat(&w.output)?,
            output_norm: vec(&w.output_norm)?,
            gelu: gpu.upload(&gelu)?,
            layers,
            buf,
            host_logits: Vec::new(),
            gpu,
            model,
            ctx,
            max_batch: b,
        })
    }

    fn config(&self) -> &Config {
        &self.model.config
    }

    /// Quantizes `n` rows of `m.cols` values at `x` for `m` and multiplies:
    /// `y[t] = m · x[t]`.
    fn product(&self, m: &Mat, x: DevPtr, n: usize, y: DevPtr) -> Result<()> {
        let g = &self.gpu;
        let dot = m.ty.vec_dot_type();
        let input = if dot == GgmlType::F32 {
            x
        } else {
            let acts = g.ptr(&self.buf.acts);
            g.quantize_at(dot, x, n * m.cols, acts)?;
            acts
        };
        g.matvec_at(m.ty, g.ptr(&m.data), m.rows, m.cols, input, n, y)
    }

    /// `x += post_norm(y)` (or `x += y`); `tmp` is scratch.
    fn residual(&self, x: DevPtr, y: DevPtr, post_norm: Option<&CudaSlice<f32>>, tmp: DevPtr, n: usize) -> Result<()> {
        let (g, d, eps) = (&self.gpu, self.config().n_embd, self.config().rms_eps);
        match post_norm {
            Some(w) => {
                g.rms_norm(y, g.ptr(w), tmp, n, d, eps)?;
                g.add_assign(x, tmp, n * d)
            }
            None => g.add_assign(x, y, n * d),
        }
    }

    /// The cos/sin table of positions `pos0..pos0 + n` for `base`, as the
    /// CPU's `RopeTable::fill` computes it (so the angles' bits agree).
    fn upload_rope(&mut self, pos0: usize, n: usize, base: f32) -> Result<()> {
        let c = &self.model.config;
        let half = c.n_rot / 2;
        let theta_scale = base.powf(-2.0 / c.n_rot as f32);
        let mut table = Vec::with_capacity(n * c.n_rot);
        for t in 0..n {
            let mut theta = (pos0 + t) as f32;
            let start = table.len();
            table.resize(start + c.n_rot, 0.0);
            for i in 0..half {
                let a = theta * c.rope_freq_scale;
                table[start + i] = a.cos();
                table[start + half + i] = a.sin();
                theta *= theta_scale;
            }
        }
        self.gpu
            .stream
            .memcpy_htod(&table, &mut self.buf.rope)
            .map_err(|e| CudaError::Driver(format!("RoPE table: {e}")))
    }

    /// Runs `tokens` at positions `pos0..`, filling the KV cache; leaves the
    /// last token's logits in [`logits`](Self::logits).
    pub fn forward(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        let c = self.model.config.clone();
        let n = tokens.len();
        if n == 0 || n > self.max_batch {
            return Err(CudaError::Invalid(format!(
                "batch of {n} tokens (1..={} allowed)",
                self.max_batch
            )));
        }
        if pos0 + n > self.ctx {
            return Err(CudaError::Invalid(format!(
                "context full: positions up to {} requested, context is {}",
                pos0 + n,
                self.ctx
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(CudaError::Invalid(format!(
                "token id {bad} outside the vocabulary of {}",
                c.n_vocab
            )));
        }
        let (d, qd, kd, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        self.gpu
            .stream
            .memcpy_htod(tokens, &mut self.buf.tokens)
            .map_err(|e| CudaError::Driver(format!("tokens: {e}")))?;
        let g = &self.gpu;
        let b = &self.buf;
        let (x, xb, q, k, v) = (g.ptr(&b.x), g.ptr(&b.xb), g.ptr(&b.q), g.ptr(&b.k), g.ptr(&b.v));
        let (att, proj, gate, up) = (g.ptr(&b.att), g.ptr(&b.proj), g.ptr(&b.gate), g.ptr(&b.up));
        let (rope, toks) = (g.ptr(&b.rope), g.ptr(&b.tokens));

        // Token embeddings.
        let e = &self.embd;
        g.embed(
            g.ptr(&e.data),
            e.ty.row_bytes(e.cols)?,
            e.ty,
            toks,
            n,
            x,
            d,
            c.embd_scale.unwrap_or(0.0),
        )?;

        let mut rope_base = None;
        for il in 0..c.n_layer {
            // The table changes with the layer's base (Gemma's local and global layers).
            let base = c.rope_base_of(il);
            if rope_base != Some(base) {
                self.upload_rope(pos0, n, base)?;
                rope_base = Some(base);
            }
            let g = &self.gpu;
            let l = &self.layers[il];
            // Attention: norm, projections, biases.
            g.rms_norm(x, g.ptr(&l.attn_norm), xb, n, d, c.rms_eps)?;
            self.product(&l.wq, xb, n, q)?;
            self.product(&l.wk, xb, n, k)?;
            self.product(&l.wv, xb, n, v)?;
            for (bias, out, width) in [(&l.bq, q, qd), (&l.bk, k, kd), (&l.bv, v, kd)] {
                if let Some(bias) = bias {
                    g.add_bias(out, g.ptr(bias), width, n * width)?;
                }
            }
            // Per-head norms, rotation, query scaling.
            if let Some(w) = &l.q_norm {
                g.rms_norm(q, g.ptr(w), q, n * c.n_head, c.head_dim, c.rms_eps)?;
            }
            if let Some(w) = &l.k_norm {
                g.rms_norm(k, g.ptr(w), k, n * c.n_head_kv, c.head_dim, c.rms_eps)?;
            }
            let neox = c.rope_style == RopeStyle::Neox;
            g.rope(q, rope, n, c.n_head, c.head_dim, c.n_rot, neox)?;
            g.rope(k, rope, n, c.n_head_kv, c.head_dim, c.n_rot, neox)?;
            if let Some(s) = c.q_scale {
                g.scale(q, s, n * qd)?;
            }
            let (kc, vc) = (g.ptr(&l.k_cache), g.ptr(&l.v_cache));
            g.kv_store(k, v, kc, vc, kd, pos0, n)?;
            let window = match c.sliding_window {
                Some(w) if c.swa_layers[il] => w,
                _ => 0,
            };
            g.attention(
                q,
                kc,
                vc,
                att,
                n,
                c.n_head,
                c.n_head_kv,
                c.head_dim,
                pos0,
                window,
                c.kq_scale,
            )?;
            self.product(&l.wo, att, n, proj)?;
            self.residual(x, proj, l.attn_post_norm.as_ref(), xb, n)?;

            // Feed-forward.
            g.rms_norm(x, g.ptr(&l.ffn_norm), xb, n, d, c.rms_eps)?;
            self.product(&l.gate, xb, n, gate)?;
            self.product(&l.up, xb, n, up)?;
            let act = match c.ffn_activation {
                FfnActivation::Silu => 0,
                FfnActivation::GeluTanh => 1,
            };
            g.gated(gate, up, g.ptr(&self.gelu), n * ff, act)?;
            self.product(&l.down, gate, n, proj)?;
            self.residual(x, proj, l.ffn_post_norm.as_ref(), xb, n)?;
        }

        // The last token's final norm and logits.
        let g = &self.gpu;
        let last = x.offset((n - 1) * d * 4);
        g.rms_norm(last, g.ptr(&self.output_norm), xb, 1, d, c.rms_eps)?;
        let logits = g.ptr(&self.buf.logits);
        self.product(&self.output, xb, 1, logits)?;
        if let Some(cap) = c.final_logit_softcap {
            g.softcap(logits, cap, c.n_vocab)?;
        }
        Ok(())
    }

    /// The logits of the last token of the last [`forward`](Self::forward).
    pub fn logits(&self) -> Result<Vec<f32>> {
        self.gpu.download(&self.buf.logits)
    }

    /// Runs `tokens` at positions `pos0..` in batches of `max_batch`.
    pub fn ingest(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        let mut pos = pos0;
        for chunk in tokens.chunks(self.max_batch) {
            self.forward(chunk, pos)?;
            pos += chunk.len();
        }
        Ok(())
    }

    /// Greedy continuation of `prompt` by `n` tokens (the prompt in batches
    /// of `max_batch`, then one token at a time).
    pub fn greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(CudaError::Invalid("empty prompt".into()));
        }
        self.ingest(prompt, 0)?;
        let mut out = Vec::with_capacity(n);
        for pos in (prompt.len()..).take(n) {
            let next = leanstream_runtime::generate::sampler::argmax(&GpuModel::logits(self)?);
            out.push(next);
            if out.len() == n {
                break;
            }
            self.forward(&[next], pos)?;
        }
        Ok(out)
    }
}

/// The device engine in the runtime's generation loop (`run`, `serve` and
/// `chat` with `--device cuda`): its errors keep their wording.
impl Decoder for GpuModel<'_> {
    fn ctx(&self) -> usize {
        self.ctx
    }
    fn ingest(&mut self, tokens: &[u32], pos0: usize) -> std::result::Result<(), RuntimeError> {
        GpuModel::ingest(self, tokens, pos0).map_err(|e| RuntimeError::Device(e.to_string()))
    }
    fn logits(&mut self) -> std::result::Result<&[f32], RuntimeError> {
        self.host_logits = GpuModel::logits(self).map_err(|e| RuntimeError::Device(e.to_string()))?;
        Ok(&self.host_logits)
    }
}
