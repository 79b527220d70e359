//! Generation: prompt processing in batches, then decoding with a sampler,
//! a token a pass or several with drafting ([`draft`]), streaming each
//! token to a callback.

pub mod batch;
pub mod chat;
pub mod draft;
pub mod sampler;

use std::ops::ControlFlow;
use std::time::Duration;

pub use chat::{ChatMessage, ChatTemplate};
pub use sampler::{argmax, Sampler, SamplerConfig};

use crate::model::{DenseFfn, LayerHook, Model, RunState};
use crate::tokenizer::Tokenizer;
use crate::{Result, RuntimeError};

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_time: Duration,
    pub decode_time: Duration,
    /// True when generation ended on an end-of-generation token.
    pub stopped_on_eog: bool,
    /// True when the caller's callback ended it (see [`generate_until`]).
    pub stopped_by_caller: bool,
    /// Prompt tokens not run again: their keys and values were in the state.
    pub reused_tokens: usize,
    /// The decode's passes and drafts (one token a pass without drafting).
    pub draft: draft::DraftReport,
}

impl GenerationStats {
    pub fn prompt_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Feeds `tokens` starting at `pos0` in batches of the state's capacity and
/// leaves the hidden state of the last one ready for `Model::logits` (row 0).
pub fn ingest(model: &Model, st: &mut RunState, tokens: &[u32], pos0: usize) -> Result<()> {
    ingest_with(model, st, tokens, pos0, &mut DenseFfn)
}

/// `ingest` told to `hook` (see `Model::forward_with`).
pub fn ingest_with(
    model: &Model,
    st: &mut RunState,
    tokens: &[u32],
    pos0: usize,
    hook: &mut dyn LayerHook,
) -> Result<()> {
    ingest_batches(model, st, tokens, pos0, hook, false)
}

/// `ingest_with`, but every row is an output, so the last layer's FFN
/// (which runs on the output rows alone) sees every token too: what
/// calibration needs, not generation.
pub fn ingest_every_row_with(
    model: &Model,
    st: &mut RunState,
    tokens: &[u32],
    pos0: usize,
    hook: &mut dyn LayerHook,
) -> Result<()> {
    ingest_batches(model, st, tokens, pos0, hook, true)
}

fn ingest_batches(
    model: &Model,
    st: &mut RunState,
    tokens: &[u32],
    pos0: usize,
    hook: &mut dyn LayerHook,
    every_row: bool,
) -> Result<()> {
    let mut pos = pos0;
    for chunk in tokens.chunks(st.max_batch) {
        let first_output = if every_row { 0 } else { chunk.len() - 1 };
        model.forward_with(st, chunk, pos, first_output..chunk.len(), hook)?;
        pos += chunk.len();
    }
    Ok(())
}

/// Generates up to `n_predict` tokens after `prompt`, calling `on_token` with
/// each new token as it is sampled. Stops early on an end-of-generation token
/// (which is not passed on) or when the context is full.
pub fn generate(
    model: &Model,
    st: &mut RunState,
    prompt: &[u32],
    n_predict: usize,
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<GenerationStats> {
    generate_with(model, st, prompt, n_predict, sampler, &mut DenseFfn, on_token)
}

/// `generate` told to `hook` (see `Model::forward_with`).
pub fn generate_with(
    model: &Model,
    st: &mut RunState,
    prompt: &[u32],
    n_predict: usize,
    sampler: &mut Sampler,
    hook: &mut dyn LayerHook,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<GenerationStats> {
    generate_until(model, st, prompt, 0, n_predict, sampler, hook, |tok| {
        on_token(tok).map(|()| ControlFlow::Continue(()))
    })
}

/// What the generation loop needs of an engine: the CPU model with its run
/// state and FFN hook ([`CpuDecoder`]), or a device's (`leanstream-cuda`).
pub trait Decoder {
    /// Tokens the context holds.
    fn ctx(&self) -> usize;
    /// Runs `tokens` (any number: the decoder batches them) at positions
    /// `pos0..`, leaving the last one's logits.
    fn ingest(&mut self, tokens: &[u32], pos0: usize) -> Result<()>;
    /// The logits of the last token run.
    fn logits(&mut self) -> Result<&[f32]>;
    /// Most tokens one [`verify`](Self::verify) pass takes (1: it cannot
    /// check a draft).
    fn max_rows(&self) -> usize {
        1
    }
    /// Runs `tokens` (1 to [`max_rows`](Self::max_rows)) at positions
    /// `pos0..` as one pass, every row an output: a verification pass. Each
    /// row has the bits it would have run alone. Positions after them that
    /// the cache held before are dropped (a refused draft's keys and values).
    fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        if tokens.len() != 1 {
            return Err(RuntimeError::Invalid(format!(
                "this engine verifies one token a pass, not {}",
                tokens.len()
            )));
        }
        self.ingest(tokens, pos0)
    }
    /// The logits of row `row` of the last [`verify`](Self::verify) pass,
    /// projected when asked for: rows after a refused draft token never are.
    fn row_logits(&mut self, row: usize) -> Result<&[f32]> {
        if row != 0 {
            return Err(RuntimeError::Invalid(format!("row {row} of a one-token pass")));
        }
        self.logits()
    }
}

impl<D: Decoder + ?Sized> Decoder for &mut D {
    fn ctx(&self) -> usize {
        (**self).ctx()
    }
    fn ingest(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        (**self).ingest(tokens, pos0)
    }
    fn logits(&mut self) -> Result<&[f32]> {
        (**self).logits()
    }
    fn max_rows(&self) -> usize {
        (**self).max_rows()
    }
    fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        (**self).verify(tokens, pos0)
    }
    fn row_logits(&mut self, row: usize) -> Result<&[f32]> {
        (**self).row_logits(row)
    }
}

/// The CPU engine as a [`Decoder`].
pub struct CpuDecoder<'a> {
    pub model: &'a Model,
    pub st: &'a mut RunState,
    pub hook: &'a mut dyn LayerHook,
}

impl Decoder for CpuDecoder<'_> {
    fn ctx(&self) -> usize {
        self.st.ctx
    }
    fn ingest(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        ingest_with(self.model, self.st, tokens, pos0, self.hook)
    }
    fn logits(&mut self) -> Result<&[f32]> {
        self.model.logits(self.st, 0, 1)
    }
    fn max_rows(&self) -> usize {
        self.st.max_batch
    }
    fn verify(&mut self, tokens: &[u32], pos0: usize) -> Result<()> {
        let n = tokens.len();
        if n == 0 || n > self.max_rows() {
            return Err(RuntimeError::Invalid(format!(
                "a verification pass of {n} tokens (1..={} allowed)",
                self.max_rows()
            )));
        }
        // Each row with the bits of the token decoded alone: drafting
        // changes no greedy token.
        self.st.rows_alone = true;
        let pass = self.model.forward_with(self.st, tokens, pos0, 0..n, self.hook);
        self.st.rows_alone = false;
        pass
    }
    fn row_logits(&mut self, row: usize) -> Result<&[f32]> {
        // One row: the arithmetic of a token decoded alone.
        self.model.logits(self.st, row, 1)
    }
}

/// `generate_with` whose caller may end the generation after any token
/// (a stop string seen, a client gone) by answering `ControlFlow::Break`;
/// no forward pass runs after it. The first `reused` prompt tokens are
/// already in the state's KV cache (an earlier generation began the same
/// way) and are not run again; at least the last prompt token is.
#[allow(clippy::too_many_arguments)]
pub fn generate_until(
    model: &Model,
    st: &mut RunState,
    prompt: &[u32],
    reused: usize,
    n_predict: usize,
    sampler: &mut Sampler,
    hook: &mut dyn LayerHook,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<GenerationStats> {
    let mut dec = CpuDecoder { model, st, hook };
    decode_until(&mut dec, &model.tokenizer, prompt, reused, n_predict, sampler, on_token)
}

/// [`generate_until`] on any [`Decoder`]: the prompt from token `reused`
/// on, then up to `n_predict` tokens, each passed to `on_token`, ending
/// early on an end-of-generation token (not passed on), a full context or
/// the caller's `ControlFlow::Break`.
pub fn decode_until(
    dec: &mut dyn Decoder,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    reused: usize,
    n_predict: usize,
    sampler: &mut Sampler,
    on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<GenerationStats> {
    let mut off = draft::Drafting::off();
    draft::decode(dec, tokenizer, prompt, reused, n_predict, sampler, &mut off, on_token)
}
