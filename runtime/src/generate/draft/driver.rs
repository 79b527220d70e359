//! The generation loop: the prompt, then passes of the last token and a
//! draft through the verifier until the tokens wanted, an end of
//! generation, a full context or the caller stops it. Without a proposer
//! each pass is one token, the plain decode loop.

use std::ops::ControlFlow;
use std::time::Instant;

use super::{accept, DraftKind, DraftLen, DraftPolicy, ModelDraft, PromptLookup, Proposer};
use crate::generate::{Decoder, GenerationStats, Sampler};
use crate::tokenizer::Tokenizer;
use crate::{Result, RuntimeError};

/// What drafts (`None`: nothing) and how much.
pub struct Drafting<'a> {
    pub proposer: Option<Box<dyn Proposer + 'a>>,
    pub policy: DraftPolicy,
}

impl Drafting<'_> {
    /// Plain decoding: one token a pass.
    pub fn off() -> Self {
        Self {
            proposer: None,
            policy: DraftPolicy::off(),
        }
    }

    /// The proposer `kind` under `len`, for a model of `n_vocab` tokens run
    /// with a context of `ctx` (a draft model gets the same).
    pub fn new(kind: &DraftKind, len: DraftLen, ctx: usize, n_vocab: usize) -> Result<Self> {
        let proposer: Option<Box<dyn Proposer>> = match kind {
            DraftKind::None => None,
            DraftKind::Lookup => Some(Box::new(PromptLookup::default())),
            DraftKind::Model(path) => {
                let path = crate::fetch::resolve_model(&path.to_string_lossy())?;
                Some(Box::new(ModelDraft::open(&path, ctx, n_vocab)?))
            }
        };
        let policy = match proposer {
            Some(_) => DraftPolicy::new(len),
            None => DraftPolicy::off(),
        };
        Ok(Self { proposer, policy })
    }

    /// Rows a verification pass of this drafting needs (the run state's
    /// batch; one row of logits is enough): one without a proposer.
    pub fn rows(kind: &DraftKind, len: DraftLen) -> usize {
        match (kind, len) {
            (DraftKind::None, _) => 1,
            (_, DraftLen::Fixed(k) | DraftLen::Auto { max: k }) => k + 1,
        }
    }

    /// The proposer's name (`none` without one).
    pub fn name(&self) -> &str {
        self.proposer.as_ref().map_or("none", |p| p.name())
    }
}

/// Runs the prompt from token `reused` on (the ones before are in the
/// decoder's cache), then generates up to `n_predict` tokens, each passed
/// to `on_token` as it is decided; ends on an end-of-generation token (not
/// passed on), a full context or the caller's `ControlFlow::Break`. No
/// token after the one that ends it is passed on, whatever a pass accepted.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    dec: &mut dyn Decoder,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    reused: usize,
    n_predict: usize,
    sampler: &mut Sampler,
    drafting: &mut Drafting,
    mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<GenerationStats> {
    let ctx = dec.ctx();
    if prompt.is_empty() {
        return Err(RuntimeError::Invalid("empty prompt: nothing to continue".into()));
    }
    if prompt.len() >= ctx {
        return Err(RuntimeError::Invalid(format!(
            "prompt of {} tokens does not fit a context of {ctx}",
            prompt.len(),
        )));
    }
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = Instant::now();
    stats.reused_tokens = reused.min(prompt.len() - 1);
    dec.ingest(&prompt[stats.reused_tokens..], stats.reused_tokens)?;
    stats.prompt_time = t0.elapsed();

    let t1 = Instant::now();
    let report0 = drafting.policy.report;
    if n_predict == 0 {
        return Ok(stats);
    }
    let first = dec.logits()?;
    let n_vocab = first.len();
    // Tokens decided by the last pass, not yet passed on.
    let mut decided = vec![sampler.sample(first)];
    let mut context = prompt.to_vec();
    let mut rows = Vec::new();
    'decode: loop {
        for &tok in &decided {
            if tokenizer.is_end_of_generation(tok) {
                stats.stopped_on_eog = true;
                break 'decode;
            }
            let next = on_token(tok)?;
            stats.generated_tokens += 1;
            context.push(tok);
            if next.is_break() {
                stats.stopped_by_caller = true;
                break 'decode;
            }
            // The last token needs no pass: nothing will read its logits.
            if stats.generated_tokens == n_predict {
                break 'decode;
            }
        }
        // The last token decided runs at `pos`; the draft after it.
        let pos = context.len() - 1;
        if pos >= ctx {
            break;
        }
        let still = n_predict - stats.generated_tokens;
        let limit = (dec.max_rows() - 1).min(ctx - pos - 1).min(still - 1);
        rows.clear();
        rows.push(context[pos]);
        let mut propose_seconds = 0.0;
        if let Some(p) = drafting.proposer.as_mut() {
            let k = drafting.policy.draft_len(limit);
            if k > 0 {
                let tp = Instant::now();
                p.propose(&context, k, &mut rows)?;
                propose_seconds = tp.elapsed().as_secs_f64();
                // Past the length asked for, or outside the vocabulary:
                // the draft ends there (a proposer's slip costs nothing).
                let good = rows[1..]
                    .iter()
                    .take(k)
                    .take_while(|&&t| (t as usize) < n_vocab)
                    .count();
                rows.truncate(1 + good);
            }
        }
        let tv = Instant::now();
        dec.verify(&rows, pos)?;
        decided.clear();
        let accepted = accept(sampler, dec, &rows[1..], &mut decided)?;
        drafting
            .policy
            .observe(rows.len() - 1, accepted, tv.elapsed().as_secs_f64(), propose_seconds);
    }
    stats.decode_time = t1.elapsed();
    stats.draft = drafting.policy.report.since(&report0);
    Ok(stats)
}
