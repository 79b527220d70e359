//! Architecture hyperparameters read from GGUF metadata, validated once so the
//! forward pass can index without checks.

use leanstream_kernels::ops::RopeStyle;

use crate::gguf::GgufFile;
use crate::{Result, RuntimeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama-2/3, Mistral, SmolLM: pre-norm, SwiGLU, interleaved RoPE.
    Llama,
    /// Qwen2: Llama with q/k/v biases and NeoX RoPE.
    Qwen2,
    /// Gemma 3: GeGLU, q/k norms, post-norms, scaled embeddings,
    /// interleaved sliding-window and global layers with their own RoPE bases.
    Gemma3,
}

impl Arch {
    fn from_name(name: &str) -> Result<Self> {
        match name {
            "llama" | "mistral" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "gemma3" => Ok(Self::Gemma3),
            other => Err(RuntimeError::Unsupported(format!(
                "architecture '{other}' (supported: llama, mistral, qwen2, gemma3)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// The gated FFN's activation: the kernels' enum, so the dense and the
/// bundle paths name the same thing.
pub use leanstream_kernels::sparse_ffn::FfnActivation;

#[derive(Debug, Clone)]
pub struct Config {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub n_rot: usize,
    pub rope_style: RopeStyle,
    pub rope_base: f32,
    pub rope_base_swa: f32,
    pub rope_freq_scale: f32,
    /// Keys older than this many positions are invisible on sliding-window layers.
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window?
    pub swa_layers: Vec<bool>,
    /// Multiplier applied to scores q·k (1/sqrt(head_dim) unless the arch scales q itself).
    pub kq_scale: f32,
    /// Multiplier applied to q before it meets the keys (Gemma's query_pre_attn_scalar).
    pub q_scale: Option<f32>,
    /// Multiplier applied to token embeddings (Gemma: sqrt(n_embd)).
    pub embd_scale: Option<f32>,
    pub ffn_activation: FfnActivation,
    pub final_logit_softcap: Option<f32>,
}

impl Config {
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.req_str("general.architecture")?;
        let arch = Arch::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");

        let n_layer = g.req_usize(&key("block_count"))?;
        let n_embd = g.req_usize(&key("embedding_length"))?;
        let n_ff = g.req_usize(&key("feed_forward_length"))?;
        let n_head = g.req_usize(&key("attention.head_count"))?;
        let n_head_kv = match g.get_u64(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_head,
        };
        let head_dim = match g.get_u64(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_head > 0 => n_embd / n_head,
            None => 0,
        };
        if let Some(v) = g.get_u64(&key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(g.bad_metadata(&key("attention.value_length"), "differs from key_length, unsupported"));
            }
        }
        let positive = [
            ("block_count", n_layer),
            ("embedding_length", n_embd),
            ("feed_forward_length", n_ff),
            ("attention.head_count", n_head),
            ("attention.head_count_kv", n_head_kv),
            ("attention.key_length", head_dim),
        ];
        for (k, v) in positive {
            if v == 0 || v > 1 << 20 {
                return Err(g.bad_metadata(&key(k), format!("value {v} out of range")));
            }
        }
        if !n_head.is_multiple_of(n_head_kv) {
            return Err(g.bad_metadata(&key("attention.head_count_kv"), "does not divide head_count"));
        }
        if !head_dim.is_multiple_of(2) {
            return Err(g.bad_metadata(&key("attention.key_length"), "must be even for RoPE"));
        }

        let n_vocab = match g.get_u64(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => g
                .get_array("tokenizer.ggml.tokens")?
                .map(|a| a.len())
                .ok_or_else(|| g.bad_metadata("tokenizer.ggml.tokens", "missing"))?,
        };
        let context_length = g.get_u64(&key("context_length"))?.unwrap_or(2048) as usize;
        let rms_eps = g.get_f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5);
        let n_rot = g
            .get_u64(&key("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        if n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(g.bad_metadata(
                &key("rope.dimension_count"),
                format!("{n_rot} invalid for head size {head_dim}"),
            ));
        }
        let rope_base = g.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
        let rope_freq_scale = match g.get_f32(&key("rope.scaling.factor"))? {
            Some(f) if f > 0.0 => 1.0 / f,
            _ => 1.0,
        };
        if let Some(kind) = g.get_str(&key("rope.scaling.type"))? {
            if kind != "none" && kind != "linear" {
                return Err(RuntimeError::Unsupported(format!("RoPE scaling '{kind}'")));
            }
        }
        let sliding_window = g
            .get_u64(&key("attention.sliding_window"))?
            .map(|v| v as usize)
            .filter(|&w| w > 0);

        let mut cfg = Config {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            context_length,
            rms_eps,
            n_rot,
            rope_style: RopeStyle::Interleaved,
            rope_base,
            rope_base_swa: rope_base,
            rope_freq_scale,
            sliding_window,
            swa_layers: vec![sliding_window.is_some(); n_layer],
            kq_scale: 1.0 / (head_dim as f32).sqrt(),
            q_scale: None,
            embd_scale: None,
            ffn_activation: FfnActivation::Silu,
            final_logit_softcap: None,
        };
        match arch {
            Arch::Llama => {}
            Arch::Qwen2 => cfg.rope_style = RopeStyle::Neox,
            Arch::Gemma3 => {
                cfg.rope_style = RopeStyle::Neox;
                cfg.ffn_activation = FfnActivation::GeluTanh;
                cfg.embd_scale = Some((n_embd as f32).sqrt());
                // Gemma scales q by 1/sqrt(query_pre_attn_scalar) and leaves scores unscaled;
                // the 27B model's scalar is n_embd/n_head, the others' is the head size.
                let scalar = if n_layer == 62 { n_embd / n_head } else { head_dim };
                cfg.q_scale = Some(1.0 / (scalar as f32).sqrt());
                cfg.kq_scale = 1.0;
                cfg.final_logit_softcap = g.get_f32(&key("final_logit_softcapping"))?.filter(|&c| c > 0.0);
                if sliding_window.is_some() {
                    // Every sixth layer is global, the rest slide.
                    cfg.swa_layers = (0..n_layer).map(|il| il % 6 < 5).collect();
                    cfg.rope_base_swa = g.get_f32(&key("rope.freq_base_swa"))?.unwrap_or(10000.0);
                }
            }
        }
        Ok(cfg)
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// RoPE base of a layer (sliding-window layers may have their own).
    pub fn rope_base_of(&self, layer: usize) -> f32 {
        if self.swa_layers[layer] {
            self.rope_base_swa
        } else {
            self.rope_base
        }
    }

    /// First visible key position for a query at `pos` on `layer`.
    pub fn first_visible(&self, layer: usize, pos: usize) -> usize {
        match self.sliding_window {
            Some(w) if self.swa_layers[layer] => (pos + 1).saturating_sub(w),
            _ => 0,
        }
    }
}
