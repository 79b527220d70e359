//! The dense engine on a CUDA device: the CPU engine's forward pass
//! (`runtime/src/model/forward.rs`) read top to bottom, each step a kernel
//! of `kernels/cuda/`, with the weights and an f16 KV cache in device
//! memory and every buffer allocated once. Activations are quantized to
//! each weight's vec-dot type before its product, as on the CPU, so logits
//! agree with the CPU engine's to rounding. The FFN is a GGUF's three
//! matrices ([`GpuModel::new`]), a packed model's bundles all resident
//! ([`GpuModel::from_flash`]), or its bundles streamed from flash each
//! token ([`GpuModel::from_flash_streamed`]).

use cudarc::driver::CudaSlice;
use leanstream_kernels::ops::RopeStyle;
use leanstream_kernels::GgmlType;
use leanstream_runtime::engine::FlashModel;
use leanstream_runtime::generate::Decoder;
use leanstream_runtime::model::{Config, MatRef, Model};
use leanstream_runtime::RuntimeError;

use crate::device::{activation_id, AttentionAt, AttentionHeads, DevPtr, Gpu, StreamInput};
use crate::ffn::{FfnScratch, ResidentBundles, RowFfn};
use crate::streamed::StreamedFfn;
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
    ffn: LayerFfn,
    ffn_post_norm: Option<CudaSlice<f32>>,
    k_cache: CudaSlice<u16>,
    v_cache: CudaSlice<u16>,
}

/// A layer's FFN weights on the device.
enum LayerFfn {
    /// A GGUF's gate, up and down matrices.
    Matrices { gate: Mat, up: Mat, down: Mat },
    /// A packed model's bundles, every neuron resident.
    Bundles(ResidentBundles),
    /// A packed model's bundles, streamed ([`GpuModel::streamed`]).
    Streamed,
}

/// Where the FFN of a model being uploaded comes from.
#[derive(Clone, Copy)]
enum FfnSource<'a> {
    Matrices,
    Resident(&'a FlashModel),
    Streamed,
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
    /// The split attention route's per-chunk partials (one query).
    att_partials: CudaSlice<f32>,
    /// The bundles' FFN: the up rows' input when its dot type is not the
    /// gate rows', the kernels' scratch.
    acts_up: CudaSlice<u8>,
    start_ns: CudaSlice<u64>,
    skipped: CudaSlice<u8>,
}

/// One point of [`GpuModel::trace`]: the last token's row of a buffer, at a
/// place the CPU engine's [`LayerHook`](leanstream_runtime::model::LayerHook)
/// sees too, so the two engines can be compared layer by layer.
#[derive(Debug, Clone)]
pub struct Probe {
    pub layer: usize,
    /// `input` (the residual entering the layer), `attn_resid` (after
    /// attention's residual add), `ffn_in` (the FFN's normed input), `gate`
    /// (its pre-activations), `act` (the gated activations), `ffn_out` (the
    /// down product, before any post-norm).
    pub point: &'static str,
    pub row: Vec<f32>,
}

pub struct GpuModel {
    pub gpu: Gpu,
    /// The model's configuration (everything else lives on the device).
    config: Config,
    embd: Mat,
    output: Mat,
    output_norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    /// GGML's GELU of every f16 value, the CPU's own table (what the GeGLU
    /// kernel looks up below ±10, including the inputs that round to ±10).
    gelu: CudaSlice<f32>,
    buf: Buffers,
    /// The streamed FFN's host side (its layers are `LayerFfn::Streamed`).
    streamed: Option<StreamedFfn>,
    /// The last logits on the host, for the generation loop ([`Decoder`]).
    host_logits: Vec<f32>,
    pub ctx: usize,
    pub max_batch: usize,
    /// The CPU thread count whose split of long attention rows is
    /// reproduced (the CPU engine's, rayon's pool size, by default).
    pub threads: usize,
}

impl GpuModel {
    /// Uploads `model` (a GGUF's, with its FFN matrices) to `gpu` for
    /// contexts of `ctx` tokens run in batches of up to `max_batch`.
    pub fn new(gpu: Gpu, model: &Model, ctx: usize, max_batch: usize) -> Result<Self> {
        Self::build(gpu, model, FfnSource::Matrices, ctx, max_batch)
    }

    /// Uploads a packed model: its resident tensors and every layer's
    /// bundles (the down parts must be Q8_0 or F16 columns).
    pub fn from_flash(gpu: Gpu, fm: &FlashModel, ctx: usize, max_batch: usize) -> Result<Self> {
        Self::build(gpu, &fm.model, FfnSource::Resident(fm), ctx, max_batch)
    }

    /// Uploads a packed model's resident tensors; its FFN bundles stream
    /// from the file each token through `streamer` (see [`StreamedFfn`]).
    pub fn from_flash_streamed(
        gpu: Gpu,
        fm: &FlashModel,
        engine: leanstream_runtime::engine::FlashEngine,
        ctx: usize,
        max_batch: usize,
    ) -> Result<Self> {
        let streamed = StreamedFfn::new(&gpu, fm, engine, max_batch)?;
        let mut m = Self::build(gpu, &fm.model, FfnSource::Streamed, ctx, max_batch)?;
        m.streamed = Some(streamed);
        Ok(m)
    }

    /// The streamed FFN's host side (what it read, landed and skipped).
    pub fn streamed(&self) -> Option<&StreamedFfn> {
        self.streamed.as_ref()
    }

    /// Bundles not landed this long after a layer's first launch are
    /// skipped (`None`, the default: every one is waited for).
    pub fn set_deadline(&mut self, deadline: Option<std::time::Duration>) {
        if let Some(s) = &mut self.streamed {
            s.deadline = deadline;
        }
    }

    fn build(gpu: Gpu, model: &Model, source: FfnSource, ctx: usize, max_batch: usize) -> Result<Self> {
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
            let matrix = |m: &Option<MatRef>, what: &str| {
                m.as_ref()
                    .ok_or_else(|| CudaError::Invalid(format!("layer {il} has no {what} matrix")))
                    .and_then(&mat)
            };
            let ffn = match source {
                FfnSource::Resident(fm) => LayerFfn::Bundles(ResidentBundles::upload(&gpu, fm, il)?),
                FfnSource::Streamed => LayerFfn::Streamed,
                FfnSource::Matrices => LayerFfn::Matrices {
                    gate: matrix(&l.ffn_gate, "ffn_gate")?,
                    up: matrix(&l.ffn_up, "ffn_up")?,
                    down: matrix(&l.ffn_down, "ffn_down")?,
                },
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
                ffn,
                ffn_post_norm: opt(&l.ffn_post_norm)?,
                k_cache: gpu.zeros(ctx * c.kv_dim())?,
                v_cache: gpu.zeros(ctx * c.kv_dim())?,
            });
        }
        let b = max_batch.max(1);
        let threads = rayon::current_num_threads().max(1);
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
            att_partials: gpu.zeros(Gpu::partials_len(
                AttentionHeads {
                    n_head: c.n_head,
                    n_head_kv: c.n_head_kv,
                    head_dim: c.head_dim,
                },
                threads,
            ))?,
            acts_up: gpu.zeros(widest * 4)?,
            start_ns: gpu.zeros(1)?,
            skipped: gpu.zeros(c.n_ff)?,
        };
        Ok(Self {
            embd: mat(&w.token_embd)?,
            output: mat(&w.output)?,
            output_norm: vec(&w.output_norm)?,
            gelu: gpu.upload(leanstream_kernels::ops::gelu_table())?,
            layers,
            buf,
            streamed: None,
            host_logits: Vec::new(),
            gpu,
            config: model.config.clone(),
            ctx,
            max_batch: b,
            threads,
        })
    }

    fn ffn_scratch(&self) -> FfnScratch {
        FfnScratch {
            start_ns: self.gpu.ptr(&self.buf.start_ns),
            skipped: self.gpu.ptr(&self.buf.skipped),
        }
    }

    /// A bundle FFN over the `n` rows of `xb`, token by token (the
    /// streaming kernels take one row): `proj` zeroed, then for each row
    /// its input quantized to the gate and up rows' dot types and `row(t,
    /// input, acts_t, proj_t)` launched.
    fn bundle_rows(
        &self,
        format: &leanstream_kernels::sparse_ffn::BundleFormat,
        n: usize,
        mut row: impl FnMut(usize, StreamInput, DevPtr, DevPtr) -> Result<()>,
    ) -> Result<()> {
        let (g, c) = (&self.gpu, &self.config);
        let (d, ff) = (c.n_embd, c.n_ff);
        let (xb, gate, proj) = (g.ptr(&self.buf.xb), g.ptr(&self.buf.gate), g.ptr(&self.buf.proj));
        g.zero_at(proj, n * d * 4)?;
        let (gate_dot, up_dot) = (format.gate_ty.vec_dot_type(), format.up_ty.vec_dot_type());
        let (x_gate, x_up) = (g.ptr(&self.buf.acts), g.ptr(&self.buf.acts_up));
        let x_up = if up_dot == gate_dot { x_gate } else { x_up };
        for t in 0..n {
            let x = xb.offset(t * d * 4);
            g.quantize_at(gate_dot, x, d, x_gate)?;
            if up_dot != gate_dot {
                g.quantize_at(up_dot, x, d, x_up)?;
            }
            let input = StreamInput::new(x_gate, x_up, format, ff, t, n);
            row(t, input, gate.offset(t * ff * 4), proj.offset(t * d * 4))?;
        }
        Ok(())
    }

    fn config(&self) -> &Config {
        &self.config
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
        let c = &self.config;
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
        self.run(tokens, pos0, None)
    }

    /// [`forward`](Self::forward), also returning the last token's row at
    /// each [`Probe`] point of every layer (each one a copy to the host: for
    /// finding where the device and the CPU engine part, not for speed).
    pub fn trace(&mut self, tokens: &[u32], pos0: usize) -> Result<Vec<Probe>> {
        let mut probes = Vec::new();
        self.run(tokens, pos0, Some(&mut probes))?;
        Ok(probes)
    }

    /// Appends the last of `n` rows of `width` in `buf` to `trace`, if tracing.
    fn probe(
        &self,
        trace: &mut Option<&mut Vec<Probe>>,
        layer: usize,
        point: &'static str,
        buf: &CudaSlice<f32>,
        n: usize,
        width: usize,
    ) -> Result<()> {
        if let Some(probes) = trace {
            let all = self.gpu.download(buf)?;
            probes.push(Probe {
                layer,
                point,
                row: all[(n - 1) * width..n * width].to_vec(),
            });
        }
        Ok(())
    }

    fn run(&mut self, tokens: &[u32], pos0: usize, trace: Option<&mut Vec<Probe>>) -> Result<()> {
        // Out of `self` while the layers run, so the layers can land bundles
        // through it while reading the model's buffers.
        let mut streamed = self.streamed.take();
        let r = self.run_layers(tokens, pos0, trace, streamed.as_mut());
        self.streamed = streamed;
        r
    }

    fn run_layers(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        mut trace: Option<&mut Vec<Probe>>,
        mut streamed: Option<&mut StreamedFfn>,
    ) -> Result<()> {
        let c = self.config.clone();
        let mut n = tokens.len();
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
            self.probe(&mut trace, il, "input", &self.buf.x, n, d)?;
            let g = &self.gpu;
            let l = &self.layers[il];
            if let (Some(sf), LayerFfn::Streamed) = (streamed.as_deref_mut(), &l.ffn) {
                // A policy that predicts from the layer's input starts its reads now.
                if sf.reads_rows() {
                    sf.layer_input(il, &g.download_prefix(&self.buf.x, n * d)?, n)?;
                }
            }
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
            // The CPU engine's cache view (what its split route cuts by
            // thread count): the context padded to 256, or the cells used so.
            let pad = |x: usize| x.div_ceil(256) * 256;
            let cells = pad(self.ctx).min(pad(pos0 + n).max(256));
            let heads = AttentionHeads {
                n_head: c.n_head,
                n_head_kv: c.n_head_kv,
                head_dim: c.head_dim,
            };
            let at = AttentionAt {
                pos0,
                window,
                kq_scale: c.kq_scale,
                cells,
                threads: self.threads,
            };
            g.attention(q, kc, vc, att, n, heads, at, &self.buf.att_partials)?;
            self.product(&l.wo, att, n, proj)?;
            self.residual(x, proj, l.attn_post_norm.as_ref(), xb, n)?;

            self.probe(&mut trace, il, "attn_resid", &self.buf.x, n, d)?;
            if il + 1 == c.n_layer && n > 1 {
                // Only the last token's logits are wanted: as the CPU engine
                // (`forward_outputs`), the last FFN runs on that row alone,
                // which also gives its products the CPU's order for one row.
                g.copy_at(x, x.offset((n - 1) * d * 4), d * 4)?;
                n = 1;
            }

            // Feed-forward.
            g.rms_norm(x, g.ptr(&l.ffn_norm), xb, n, d, c.rms_eps)?;
            self.probe(&mut trace, il, "ffn_in", &self.buf.xb, n, d)?;
            let act = activation_id(c.ffn_activation);
            match &l.ffn {
                LayerFfn::Matrices {
                    gate: w_gate,
                    up: w_up,
                    down: w_down,
                } => {
                    self.product(w_gate, xb, n, gate)?;
                    self.product(w_up, xb, n, up)?;
                    self.probe(&mut trace, il, "gate", &self.buf.gate, n, ff)?;
                    g.gated(gate, up, g.ptr(&self.gelu), n * ff, act)?;
                    self.probe(&mut trace, il, "act", &self.buf.gate, n, ff)?;
                    self.product(w_down, gate, n, proj)?;
                }
                LayerFfn::Bundles(rb) => {
                    let (gelu, scratch) = (g.ptr(&self.gelu), self.ffn_scratch());
                    self.bundle_rows(&rb.format, n, |_, input, acts, y| {
                        rb.forward_row(
                            g,
                            RowFfn {
                                input,
                                act_kind: act,
                                gelu_table: gelu,
                                scratch,
                                act: acts,
                                y,
                            },
                        )
                    })?;
                    self.probe(&mut trace, il, "act", &self.buf.gate, n, ff)?;
                }
                LayerFfn::Streamed => {
                    let sf = streamed
                        .as_deref_mut()
                        .ok_or_else(|| CudaError::Invalid(format!("layer {il} streams without a streamer")))?;
                    let format = *sf.format(il)?;
                    let (gelu, scratch) = (g.ptr(&self.gelu), self.ffn_scratch());
                    // A policy that predicts reads the layer's rows on the host.
                    let rows = if sf.reads_rows() {
                        let resid = g.download_prefix(&self.buf.x, n * d)?;
                        let xb = g.download_prefix(&self.buf.xb, n * d)?;
                        Some((resid, xb))
                    } else {
                        None
                    };
                    sf.begin(il, n, rows.as_ref().map(|(r, x)| (&r[..], &x[..])))?;
                    let rows = self.bundle_rows(&format, n, |t, input, acts, y| {
                        let row = RowFfn {
                            input,
                            act_kind: act,
                            gelu_table: gelu,
                            scratch,
                            act: acts,
                            y,
                        };
                        sf.stage(g, t, row)?;
                        // The first row's kernels poll while its bundles land;
                        // the later rows find them all.
                        if t == 0 {
                            sf.feed()?;
                        }
                        Ok(())
                    });
                    if let Err(e) = rows {
                        sf.abandon();
                        return Err(e);
                    }
                    sf.end(g)?;
                    self.probe(&mut trace, il, "act", &self.buf.gate, n, ff)?;
                }
            }
            self.probe(&mut trace, il, "ffn_out", &self.buf.proj, n, d)?;
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
impl Decoder for GpuModel {
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
