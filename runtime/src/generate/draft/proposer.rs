//! Proposers: what guesses the tokens a verification pass checks. None of
//! them reads the target model's flash.

use std::path::Path;

use crate::generate::{argmax, CpuDecoder, Decoder};
use crate::model::RunState;
use crate::session::{Session, StreamSettings};
use crate::{Result, RuntimeError};

/// Guesses the tokens that follow a context.
pub trait Proposer {
    /// What it is, for reports.
    fn name(&self) -> &str;

    /// Appends to `out` up to `max` tokens guessed to follow `context` (the
    /// prompt and every token generated so far). Fewer, or none, is fine;
    /// the driver drops what is past `max` or outside the vocabulary.
    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) -> Result<()>;
}

/// Which proposer a user asks for (`--draft`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftKind {
    None,
    /// n-grams of the context ([`PromptLookup`]).
    Lookup,
    /// A separate model with the same vocabulary, greedy ([`ModelDraft`]):
    /// a path or a known model's name.
    Model(std::path::PathBuf),
}

impl std::str::FromStr for DraftKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "lookup" => Ok(Self::Lookup),
            _ => match s.strip_prefix("model:") {
                Some(p) if !p.is_empty() => Ok(Self::Model(p.into())),
                _ => Err(format!(
                    "unknown draft '{s}' (expected none, lookup, or model:PATH of a model with the same vocabulary)"
                )),
            },
        }
    }
}

impl std::fmt::Display for DraftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Lookup => f.write_str("lookup"),
            Self::Model(p) => write!(f, "model:{}", p.display()),
        }
    }
}

/// Prompt lookup: the longest suffix of the context (of `max_ngram` down to
/// `min_ngram` tokens) that occurred before is looked up, latest occurrence
/// first, and what followed it there is the guess. Nearly free; it pays
/// where text repeats its context (quoting, summaries, code, lists).
#[derive(Debug, Clone)]
pub struct PromptLookup {
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self {
            min_ngram: 2,
            max_ngram: 4,
        }
    }
}

impl Proposer for PromptLookup {
    fn name(&self) -> &str {
        "lookup"
    }

    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) -> Result<()> {
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest earlier occurrence whose continuation is in the context.
            if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                let follow = &context[start + n..];
                out.extend(follow.iter().take(max));
                return Ok(());
            }
        }
        Ok(())
    }
}

/// A separate draft model with the target's vocabulary (a small GGUF
/// model, or a `.lsflash` one with its own engine), drafting greedily. It
/// keeps its own KV cache in step with the context: tokens it has run that
/// the context still holds are not run again.
pub struct ModelDraft {
    name: String,
    session: Session,
    st: RunState,
    /// Tokens whose keys and values the draft's cache holds, in order.
    seen: Vec<u32>,
}

impl ModelDraft {
    /// Opens the draft model at `path` with a context of `ctx` tokens;
    /// `n_vocab` is the target's, which the draft's must equal.
    pub fn open(path: &Path, ctx: usize, n_vocab: usize) -> Result<Self> {
        let (session, st) = Session::open(path, &StreamSettings::default(), |m| {
            Ok(m.new_state(ctx.min(m.config.context_length), 512.min(ctx).max(1), 1))
        })?;
        let draft_vocab = session.model().config.n_vocab;
        if draft_vocab != n_vocab {
            return Err(RuntimeError::Invalid(format!(
                "draft model {}: its vocabulary has {draft_vocab} tokens, the model's {n_vocab}; a draft must share it",
                path.display()
            )));
        }
        Ok(Self {
            name: format!("model:{}", path.display()),
            session,
            st,
            seen: Vec::new(),
        })
    }
}

impl Proposer for ModelDraft {
    fn name(&self) -> &str {
        &self.name
    }

    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) -> Result<()> {
        let (model, hook) = self.session.parts()?;
        let mut dec = CpuDecoder {
            model,
            st: &mut self.st,
            hook,
        };
        greedy_draft(&mut dec, &mut self.seen, context, max, out)
    }
}

/// Drafts up to `max` tokens after `context` greedily with `dec`, a draft
/// model whose cache holds the tokens `seen` (updated): what the context
/// shares with them is not run again.
pub fn greedy_draft(
    dec: &mut dyn Decoder,
    seen: &mut Vec<u32>,
    context: &[u32],
    max: usize,
    out: &mut Vec<u32>,
) -> Result<()> {
    let ctx = dec.ctx();
    if context.is_empty() || max == 0 || context.len() > ctx {
        return Ok(()); // Nothing to go on, or the draft's context is full.
    }
    // The last context token runs again when the cache holds it: its
    // logits are what the first guess needs.
    let common = seen.iter().zip(context).take_while(|(a, b)| a == b).count();
    let from = common.min(context.len() - 1);
    seen.truncate(from);
    dec.ingest(&context[from..], from)?;
    seen.extend_from_slice(&context[from..]);
    for i in 0..max {
        let tok = argmax(dec.logits()?);
        out.push(tok);
        let pos = seen.len();
        if i + 1 == max || pos >= ctx {
            break;
        }
        dec.ingest(&[tok], pos)?;
        seen.push(tok);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(context: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        PromptLookup::default().propose(context, max, &mut out).unwrap();
        out
    }

    #[test]
    fn lookup_continues_the_latest_longest_match() {
        // "5 6" occurred twice; the later one (followed by 9) wins.
        assert_eq!(lookup(&[5, 6, 7, 8, 5, 6, 9, 1, 5, 6], 3), vec![9, 1, 5]);
        // A longer match beats a later shorter one: "1 2 3" then 4.
        assert_eq!(lookup(&[1, 2, 3, 4, 0, 2, 3, 7, 1, 2, 3], 2), vec![4, 0]);
        // What follows is cut at max, and at the context's end.
        assert_eq!(lookup(&[1, 2, 3, 1, 2], 8), vec![3, 1, 2]);
        // No repeated bigram: nothing.
        assert!(lookup(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup(&[7], 4).is_empty());
    }

    #[test]
    fn draft_kinds_parse_and_print() {
        for s in ["none", "lookup", "model:/tmp/d.gguf"] {
            assert_eq!(s.parse::<DraftKind>().unwrap().to_string(), s);
        }
        assert!("model:".parse::<DraftKind>().is_err());
        assert!("hot"
            .parse::<DraftKind>()
            .unwrap_err()
            .contains("expected none, lookup"));
    }
}
