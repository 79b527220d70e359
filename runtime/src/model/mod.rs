//! A loaded model: the mapped GGUF file, its architecture config, where its
//! weights are, and its tokenizer. `forward` holds the dense forward pass.

pub mod attention;
pub mod config;
pub mod forward;
pub mod hook;
pub mod kv_cache;
pub mod weights;

use std::path::Path;

pub use attention::FlashAttn;
pub use config::{Arch, Config, FfnActivation};
pub use forward::{RunState, SeqRows};
pub use hook::{DenseFfn, FfnBy, LayerAt, LayerHook};
pub use kv_cache::{KvCache, KvPrefix};
pub use weights::{LayerWeights, MatRef, Weights};

use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use crate::Result;

pub struct Model {
    pub gguf: GgufFile,
    pub config: Config,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    /// The attention path of the states [`new_state`](Self::new_state)
    /// makes (llama.cpp's `--flash-attn`; default `auto`, on for a CPU).
    pub flash_attn: FlashAttn,
}

impl Model {
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        let config = Config::from_gguf(&gguf)?;
        let weights = Weights::load(&gguf, &config)?;
        Self::assemble(gguf, config, weights)
    }

    /// Whether the FFN output passes a norm before the residual (Gemma 3).
    pub fn has_ffn_post_norm(&self) -> bool {
        self.weights.layers.iter().any(|l| l.ffn_post_norm.is_some())
    }

    /// A model without FFN matrices (e.g. the resident part of a `.lsflash`
    /// file): its forward pass needs a [`LayerHook`] that computes the feed-forward.
    pub fn from_gguf_without_ffn(gguf: GgufFile) -> Result<Self> {
        let config = Config::from_gguf(&gguf)?;
        let weights = Weights::load_without_ffn(&gguf, &config)?;
        Self::assemble(gguf, config, weights)
    }

    fn assemble(mut gguf: GgufFile, config: Config, weights: Weights) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        // The tokenizer holds its own copy; a 262k-token vocabulary parsed
        // twice is tens of MiB that no memory budget should pay for.
        for key in [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
        ] {
            gguf.metadata.remove(key);
        }
        if tokenizer.vocab_size() != config.n_vocab {
            return Err(gguf.bad_metadata(
                "tokenizer.ggml.tokens",
                format!(
                    "{} tokens, but the embedding has {} rows",
                    tokenizer.vocab_size(),
                    config.n_vocab
                ),
            ));
        }
        Ok(Self {
            gguf,
            config,
            weights,
            tokenizer,
            flash_attn: FlashAttn::default(),
        })
    }

    /// Run state for up to `ctx` positions, `max_batch` tokens per forward
    /// call and `max_logit_rows` rows of logits per projection.
    /// Without FFN matrices (a `.lsflash` model's resident part), the state
    /// has no FFN buffers.
    pub fn new_state(&self, ctx: usize, max_batch: usize, max_logit_rows: usize) -> RunState {
        let has_ffn = self.weights.layers.iter().any(|l| l.ffn_gate.is_some());
        RunState::sized(&self.config, ctx, max_batch, max_logit_rows, has_ffn, self.flash_attn)
    }
}
