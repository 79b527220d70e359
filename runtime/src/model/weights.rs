//! Where each weight lives in the mapped GGUF file. Matrices stay in the
//! mapping (quantized, never copied); small vectors (norms, biases) are
//! copied out as f32.

use leanstream_kernels::{GgmlType, QMatrix};

use super::config::{Arch, Config};
use crate::gguf::GgufFile;
use crate::Result;

/// A validated matrix location; `Weights::mat` turns it into a kernel view.
#[derive(Debug, Clone, Copy)]
pub struct MatRef {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
    pub n_bytes: usize,
}

impl MatRef {
    fn load(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Self> {
        let m = g.matrix(name, rows, cols)?;
        let info = g.tensor_info(name).expect("matrix() found it");
        Ok(Self {
            ty: m.ty,
            rows,
            cols,
            offset: info.offset,
            n_bytes: info.n_bytes,
        })
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: MatRef,
    pub wk: MatRef,
    pub wv: MatRef,
    pub wo: MatRef,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub attn_post_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// The FFN matrices; `None` when they live elsewhere (a `.lsflash` file's bundles).
    pub ffn_gate: Option<MatRef>,
    pub ffn_up: Option<MatRef>,
    pub ffn_down: Option<MatRef>,
    pub ffn_post_norm: Option<Vec<f32>>,
}

pub struct Weights {
    pub token_embd: MatRef,
    pub output_norm: Vec<f32>,
    /// The LM head; the token embedding when the model ties them.
    pub output: MatRef,
    pub layers: Vec<LayerWeights>,
}

impl Weights {
    pub fn load(g: &GgufFile, c: &Config) -> Result<Self> {
        Self::load_parts(g, c, true)
    }

    /// Everything but the FFN matrices (which may be absent from `g`).
    pub fn load_without_ffn(g: &GgufFile, c: &Config) -> Result<Self> {
        Self::load_parts(g, c, false)
    }

    fn load_parts(g: &GgufFile, c: &Config, with_ffn: bool) -> Result<Self> {
        let token_embd = MatRef::load(g, "token_embd.weight", c.n_vocab, c.n_embd)?;
        let output = if g.tensor_info("output.weight").is_some() {
            MatRef::load(g, "output.weight", c.n_vocab, c.n_embd)?
        } else {
            token_embd
        };
        let output_norm = g.vector_f32("output_norm.weight", c.n_embd)?;
        let gemma = c.arch == Arch::Gemma3;
        let bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if c.arch == Arch::Qwen2 || g.tensor_info(name).is_some() {
                g.vector_f32(name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let needed = |cond: bool, name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if cond {
                g.vector_f32(name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let ffn = |name: &str, rows: usize, cols: usize| -> Result<Option<MatRef>> {
            if with_ffn {
                MatRef::load(g, name, rows, cols).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            let t = |s: &str| format!("blk.{il}.{s}");
            layers.push(LayerWeights {
                attn_norm: g.vector_f32(&t("attn_norm.weight"), c.n_embd)?,
                wq: MatRef::load(g, &t("attn_q.weight"), c.q_dim(), c.n_embd)?,
                wk: MatRef::load(g, &t("attn_k.weight"), c.kv_dim(), c.n_embd)?,
                wv: MatRef::load(g, &t("attn_v.weight"), c.kv_dim(), c.n_embd)?,
                wo: MatRef::load(g, &t("attn_output.weight"), c.n_embd, c.q_dim())?,
                bq: bias(&t("attn_q.bias"), c.q_dim())?,
                bk: bias(&t("attn_k.bias"), c.kv_dim())?,
                bv: bias(&t("attn_v.bias"), c.kv_dim())?,
                q_norm: needed(gemma, &t("attn_q_norm.weight"), c.head_dim)?,
                k_norm: needed(gemma, &t("attn_k_norm.weight"), c.head_dim)?,
                attn_post_norm: needed(gemma, &t("post_attention_norm.weight"), c.n_embd)?,
                ffn_norm: g.vector_f32(&t("ffn_norm.weight"), c.n_embd)?,
                ffn_gate: ffn(&t("ffn_gate.weight"), c.n_ff, c.n_embd)?,
                ffn_up: ffn(&t("ffn_up.weight"), c.n_ff, c.n_embd)?,
                ffn_down: ffn(&t("ffn_down.weight"), c.n_embd, c.n_ff)?,
                ffn_post_norm: needed(gemma, &t("post_ffw_norm.weight"), c.n_embd)?,
            });
        }
        Ok(Self {
            token_embd,
            output_norm,
            output,
            layers,
        })
    }

    /// Bytes of all weight matrices (mapped, not copied).
    pub fn matrix_bytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    Some(l.wq),
                    Some(l.wk),
                    Some(l.wv),
                    Some(l.wo),
                    l.ffn_gate,
                    l.ffn_up,
                    l.ffn_down,
                ]
                .iter()
                .flatten()
                .map(|m| m.n_bytes)
                .sum::<usize>()
            })
            .sum();
        let head = if self.output.offset == self.token_embd.offset {
            0
        } else {
            self.output.n_bytes
        };
        per_layer + self.token_embd.n_bytes + head
    }
}

/// Builds a kernel view of a matrix inside the mapped file.
pub fn mat<'a>(file: &'a [u8], m: &MatRef) -> QMatrix<'a> {
    QMatrix {
        ty: m.ty,
        rows: m.rows,
        cols: m.cols,
        data: &file[m.offset..m.offset + m.n_bytes],
    }
}
