//! Synthetic models: GGUF files of a chosen architecture and shape with
//! seeded random weights and a byte-level vocabulary. They exercise loading
//! and the forward pass (and, at 7B shapes, the I/O path) without a
//! download; their outputs mean nothing and are never reported as quality.

use leanstream_kernels::quantize::quantize_row;
use leanstream_kernels::GgmlType;

use crate::generate::sampler::Rng;
use crate::gguf::{GgufWriter, MetaArray, MetaValue};
use crate::{Result, RuntimeError};

#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    /// `llama`, `mistral` (llama with a sliding window) or `qwen2` (q/k/v biases).
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub context_length: usize,
    pub sliding_window: Option<usize>,
    /// Type of the 2-D weight matrices (F32, F16 or Q8_0).
    pub weight_type: GgmlType,
    pub seed: u64,
}

/// Byte tokens `<0x00>`..`<0xFF>` after `<unk>`, `<s>`, `</s>`: every text encodes.
const N_SPECIAL: usize = 3;
pub const VOCAB: usize = N_SPECIAL + 256;

impl SyntheticSpec {
    /// A small model for tests.
    pub fn tiny(arch: &str) -> Self {
        Self {
            arch: arch.to_string(),
            n_layer: 2,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            context_length: 256,
            sliding_window: None,
            weight_type: GgmlType::F32,
            seed: 7,
        }
    }

    /// The GGUF file, ready to write.
    pub fn build(&self) -> Result<GgufWriter> {
        let arch = self.arch.as_str();
        if !matches!(arch, "llama" | "mistral" | "qwen2") {
            return Err(RuntimeError::Unsupported(format!("synthetic architecture '{arch}'")));
        }
        let head_dim = self.n_embd / self.n_head;
        let (q_dim, kv_dim) = (self.n_head * head_dim, self.n_head_kv * head_dim);
        let mut rng = Rng::new(self.seed);
        let mut w = GgufWriter::new();
        let key = |k: &str| format!("{arch}.{k}");
        let u32v = |v: usize| MetaValue::U32(v as u32);
        w.meta("general.architecture", MetaValue::String(arch.into()))
            .meta("general.name", MetaValue::String(format!("synthetic {arch}")))
            .meta(&key("block_count"), u32v(self.n_layer))
            .meta(&key("context_length"), u32v(self.context_length))
            .meta(&key("embedding_length"), u32v(self.n_embd))
            .meta(&key("feed_forward_length"), u32v(self.n_ff))
            .meta(&key("attention.head_count"), u32v(self.n_head))
            .meta(&key("attention.head_count_kv"), u32v(self.n_head_kv))
            .meta(&key("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5))
            .meta(&key("rope.freq_base"), MetaValue::F32(10000.0));
        if let Some(window) = self.sliding_window {
            w.meta(&key("attention.sliding_window"), u32v(window));
        }
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        let mut types = vec![2i32, 3, 3];
        types.extend(std::iter::repeat_n(6, 256));
        w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
            .meta("tokenizer.ggml.tokens", MetaValue::Array(MetaArray::String(tokens)))
            .meta(
                "tokenizer.ggml.scores",
                MetaValue::Array(MetaArray::F32(vec![0.0; VOCAB])),
            )
            .meta("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(types)))
            .meta("tokenizer.ggml.unknown_token_id", MetaValue::U32(0))
            .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
            .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
            .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
            .meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false));

        let ones = |n: usize| f32_bytes(&vec![1.0; n]);
        let mut matrix = |rows: usize, cols: usize| -> Result<(GgmlType, Vec<u8>)> {
            let scale = 1.0 / (cols as f32).sqrt();
            let values: Vec<f32> = (0..rows * cols).map(|_| (rng.next_f32() * 2.0 - 1.0) * scale).collect();
            encode(&values, cols, self.weight_type)
        };
        let (ty, data) = matrix(VOCAB, self.n_embd)?;
        w.tensor("token_embd.weight", &[self.n_embd as u64, VOCAB as u64], ty, data);
        w.tensor(
            "output_norm.weight",
            &[self.n_embd as u64],
            GgmlType::F32,
            ones(self.n_embd),
        );
        for il in 0..self.n_layer {
            let t = |s: &str| format!("blk.{il}.{s}");
            let shapes = [
                ("attn_q.weight", q_dim, self.n_embd),
                ("attn_k.weight", kv_dim, self.n_embd),
                ("attn_v.weight", kv_dim, self.n_embd),
                ("attn_output.weight", self.n_embd, q_dim),
                ("ffn_gate.weight", self.n_ff, self.n_embd),
                ("ffn_up.weight", self.n_ff, self.n_embd),
                ("ffn_down.weight", self.n_embd, self.n_ff),
            ];
            for (name, rows, cols) in shapes {
                let (ty, data) = matrix(rows, cols)?;
                w.tensor(&t(name), &[cols as u64, rows as u64], ty, data);
            }
            w.tensor(
                &t("attn_norm.weight"),
                &[self.n_embd as u64],
                GgmlType::F32,
                ones(self.n_embd),
            );
            w.tensor(
                &t("ffn_norm.weight"),
                &[self.n_embd as u64],
                GgmlType::F32,
                ones(self.n_embd),
            );
            if arch == "qwen2" {
                for (name, n) in [("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)] {
                    let (_, data) = matrix(1, n)?;
                    let bias: Vec<f32> = bytemuck::cast_slice::<u8, f32>(&data).iter().map(|v| v * 4.0).collect();
                    w.tensor(&t(name), &[n as u64], GgmlType::F32, f32_bytes(&bias));
                }
            }
        }
        Ok(w)
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Rows of `cols` values in `ty`.
fn encode(values: &[f32], cols: usize, ty: GgmlType) -> Result<(GgmlType, Vec<u8>)> {
    if ty == GgmlType::F32 {
        return Ok((ty, f32_bytes(values)));
    }
    let row_bytes = ty.row_bytes(cols)?;
    let mut out = vec![0u8; values.len() / cols * row_bytes];
    for (row, dst) in values.chunks_exact(cols).zip(out.chunks_exact_mut(row_bytes)) {
        quantize_row(ty, row, dst)?;
    }
    Ok((ty, out))
}
