//! Activation traces: what a real model computes, layer by layer, on real
//! text; the training and evaluation data of the predictors and of the flash
//! placement (`leanstream-synth predictor | placement | eval`).
//!
//! A trace directory:
//!
//! ```text
//! manifest.json           settings, model and text SHA-256s, splits, committed shards
//! scores.npy   f4 [L, F]  per neuron mean |act(g)·u| over the training split
//! hot.npy      u1 [L, F]  1 for the hot set whose output `partial` holds
//! train/shard-NNNNNN/     one shard: T tokens (whole context windows)
//!   tokens.npy   u4 [T]
//!   layer_in.npy f2 [L, T, D]   residual entering the layer (before attention)
//!   resid.npy    f2 [L, T, D]   residual after attention (the FFN's un-normed input)
//!   ffn_in.npy   f2 [L, T, D]   the FFN input (normed)
//!   partial.npy  f2 [L, T, D]   FFN output of the hot neurons alone, as added to
//!                               the residual: resid + partial estimates the next
//!                               layer's input before the layer's FFN is done
//!   act.npy      f2 [L, T, F]   act(g)·u of every neuron (its magnitude is the truth)
//! heldout/shard-NNNNNN/   the same for the held-out texts
//! ```
//!
//! L layers, D model width, F FFN neurons. Arrays are little-endian `.npy`
//! (`numpy.load(p, mmap_mode="r")[layer]` is one layer's `[T, D]`), layer-major
//! so a trainer reads one layer contiguously. Training and held-out texts are
//! different files, tokenized separately, and never share a shard. Values
//! beyond f16's range are clamped to ±65504.
//!
//! A shard is written into `*.tmp`, fsynced, renamed, then recorded in the
//! manifest (written atomically), so a killed run loses at most the shard in
//! progress; running the same command again continues after the last
//! committed shard.

pub mod npy;
pub mod read;
pub mod record;

use serde::{Deserialize, Serialize};

/// Manifest format name and version.
pub const FORMAT: &str = "leanstream-activations";
pub const VERSION: u32 = 1;

/// The `[L, T, D]` and `[L, T, F]` arrays of a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Array {
    LayerIn,
    Resid,
    FfnIn,
    Partial,
    Act,
}

impl Array {
    pub const ALL: [Array; 5] = [Self::LayerIn, Self::Resid, Self::FfnIn, Self::Partial, Self::Act];

    pub fn file_name(self) -> &'static str {
        match self {
            Self::LayerIn => "layer_in.npy",
            Self::Resid => "resid.npy",
            Self::FfnIn => "ffn_in.npy",
            Self::Partial => "partial.npy",
            Self::Act => "act.npy",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelInfo {
    pub path: String,
    pub sha256: String,
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TextInfo {
    pub path: String,
    pub sha256: String,
    /// Tokens of this text that the split records (after `max_tokens`).
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShardInfo {
    /// Directory relative to the trace directory.
    pub dir: String,
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Split {
    pub name: String,
    pub texts: Vec<TextInfo>,
    /// Tokens the finished split holds.
    pub planned_tokens: usize,
    /// Committed shards, in order.
    pub shards: Vec<ShardInfo>,
}

impl Split {
    pub fn recorded_tokens(&self) -> usize {
        // Saturating: a damaged manifest's counts must not overflow.
        self.shards.iter().fold(0usize, |a, s| a.saturating_add(s.tokens))
    }
}

/// Per-layer |act(g)·u| thresholds at a target sparsity, from the training split.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Level {
    pub sparsity: f32,
    pub per_layer: Vec<f32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub model: ModelInfo,
    /// Context window: the text is cut into windows of this many tokens, each run from position 0.
    pub ctx: usize,
    pub shard_tokens: usize,
    /// Fraction of each layer's neurons (by `scores`) in the hot set.
    pub hot_fraction: f32,
    pub levels: Vec<Level>,
    pub splits: Vec<Split>,
}
