//! Continuous batching: several sequences decoded together, each in its own
//! KV cache of one run state ([`RunState::with_sequences`]). A step runs one
//! chunk of a newly arrived prompt, then one forward pass over a row per
//! decoding sequence, so a streamed FFN reads each bundle once for all of
//! them. Sequences join and leave between steps. Every row of a shared pass
//! gets the bits it would get alone ([`Model::forward_seqs`]), so a sequence
//! decodes the tokens it would decode by itself, whatever runs beside it;
//! a batch made [`with_batched_kernels`](Batch::with_batched_kernels) trades
//! that for the batched matrix kernels' speed.

use std::ops::ControlFlow;
use std::time::Instant;

use super::{GenerationStats, Sampler};
use crate::model::{LayerHook, Model, RunState, SeqRows};
use crate::{Result, RuntimeError};

/// One sequence in flight.
struct Sequence {
    /// The prompt, then every token passed on.
    context: Vec<u32>,
    prompt_len: usize,
    /// Tokens of `context` whose keys and values the cache holds.
    ran: usize,
    n_predict: usize,
    sampler: Sampler,
    stats: GenerationStats,
    /// When its prompt was done (decode time runs from there).
    decoding_since: Option<Instant>,
    /// Order of arrival: prompts are run first come, first served.
    arrival: u64,
}

/// A sequence that left the batch, and why.
pub struct Ended {
    pub slot: usize,
    /// Its statistics, or the error that ended it (a pass it shared failed:
    /// the others in that pass end with it).
    pub result: Result<GenerationStats>,
    /// The tokens whose keys and values its slot's cache now holds, from
    /// position 0 (empty after an error): a later prompt that begins the
    /// same way need not run them again.
    pub cached: Vec<u32>,
}

/// The sequences a run state decodes together, one slot per sequence.
pub struct Batch {
    slots: Vec<Option<Sequence>>,
    arrivals: u64,
    /// Decode passes run and the rows they held.
    passes: u64,
    rows: u64,
    /// Scratch of a decode pass: (slot, token, position) per row.
    pass_rows: Vec<(usize, [u32; 1], usize)>,
    /// Rows get the bits they would get alone.
    alone: bool,
}

impl Batch {
    /// A batch over the sequences of `st`.
    pub fn new(st: &RunState) -> Self {
        let n = st.sequences();
        Self {
            slots: (0..n).map(|_| None).collect(),
            arrivals: 0,
            passes: 0,
            rows: 0,
            pass_rows: Vec::with_capacity(n),
            alone: true,
        }
    }

    /// This batch running its decode passes through the batched matrix
    /// kernels (and its logits in as many rows at once as the state's
    /// logit rows): faster where compute binds, but a row's last bits then
    /// depend on the rows beside it, so greedy text may differ from the
    /// sequence's alone.
    pub fn with_batched_kernels(mut self) -> Self {
        self.alone = false;
        self
    }

    /// Slots with no sequence.
    pub fn free_slots(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_none())
            .map(|(i, _)| i)
    }

    /// Sequences in flight.
    pub fn active(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Sequences still running their prompt.
    pub fn prefilling(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.decoding_since.is_none())
            .count()
    }

    /// Decode passes run so far, and the rows they held in all.
    pub fn passes(&self) -> (u64, u64) {
        (self.passes, self.rows)
    }

    /// Starts a sequence in the free slot `slot`: `prompt` (its first
    /// `reused` tokens already in the slot's cache), then up to `n_predict`
    /// tokens drawn by `sampler`.
    pub fn admit(
        &mut self,
        slot: usize,
        prompt: &[u32],
        reused: usize,
        n_predict: usize,
        sampler: Sampler,
    ) -> Result<()> {
        match self.slots.get(slot) {
            Some(None) => {}
            Some(Some(_)) => return Err(RuntimeError::Invalid(format!("slot {slot} is taken"))),
            None => {
                return Err(RuntimeError::Invalid(format!(
                    "slot {slot} of a batch of {}",
                    self.slots.len()
                )))
            }
        }
        if prompt.is_empty() {
            return Err(RuntimeError::Invalid("empty prompt: nothing to continue".into()));
        }
        let reused = reused.min(prompt.len() - 1);
        self.arrivals += 1;
        self.slots[slot] = Some(Sequence {
            context: prompt.to_vec(),
            prompt_len: prompt.len(),
            ran: reused,
            n_predict,
            sampler,
            stats: GenerationStats {
                prompt_tokens: prompt.len(),
                reused_tokens: reused,
                ..Default::default()
            },
            decoding_since: None,
            arrival: self.arrivals,
        });
        Ok(())
    }

    /// Ends the sequence in `slot` now (its client went away), as if the
    /// caller had stopped it.
    pub fn cancel(&mut self, slot: usize) -> Option<Ended> {
        let mut s = self.slots.get_mut(slot)?.take()?;
        s.stats.stopped_by_caller = true;
        Some(finish(slot, s))
    }

    /// One step: a chunk of the earliest prompt still running (as many
    /// tokens as the state's batch, so a prompt is cut where a sequence run
    /// alone cuts it), then one pass over every decoding sequence that
    /// `paused` does not hold back. Each token decided goes to `on_token`
    /// with its slot; `ControlFlow::Break` ends that sequence. Returns the
    /// sequences that ended.
    pub fn step(
        &mut self,
        model: &Model,
        st: &mut RunState,
        hook: &mut dyn LayerHook,
        paused: impl Fn(usize) -> bool,
        mut on_token: impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
    ) -> Vec<Ended> {
        let mut ended = Vec::new();
        let prefill = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| s.decoding_since.is_none())
                    .map(|s| (s.arrival, i))
            })
            .min()
            .map(|(_, i)| i);
        if let Some(slot) = prefill {
            if let Err(e) = self.prefill(model, st, hook, slot, &mut on_token) {
                self.slots[slot] = None;
                ended.push(fail(slot, e));
            }
            self.end_finished(slot, st.ctx, &mut ended);
        }

        self.pass_rows.clear();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(s) = s.as_ref().filter(|s| s.decoding_since.is_some() && !paused(i)) {
                self.pass_rows.push((i, [s.context[s.ran]], s.ran));
            }
        }
        if self.pass_rows.is_empty() {
            return ended;
        }
        let seqs: Vec<SeqRows> = self
            .pass_rows
            .iter()
            .map(|(slot, tok, pos)| SeqRows {
                seq: *slot,
                tokens: tok,
                pos0: *pos,
            })
            .collect();
        let pass = model.forward_seqs(st, &seqs, self.alone, hook);
        self.passes += 1;
        self.rows += seqs.len() as u64;
        let rows = std::mem::take(&mut self.pass_rows);
        match pass {
            Ok(()) => {
                // Alone, each row's logits are projected by themselves (a
                // one-row product); batched, as many rows at once as fit.
                let (at_once, ctx) = (if self.alone { 1 } else { st.max_logit_rows }, st.ctx);
                for (first, group) in rows.chunks(at_once).enumerate().map(|(i, g)| (i * at_once, g)) {
                    let logits = model.logits(st, first, group.len());
                    for (j, &(slot, _, _)) in group.iter().enumerate() {
                        let s = self.slots[slot].as_mut().expect("a row's sequence is in flight");
                        s.ran += 1;
                        s.stats.draft.passes += 1;
                        let decided = match &logits {
                            Ok(l) => {
                                let n_vocab = l.len() / group.len();
                                Ok(s.sampler.sample(&l[j * n_vocab..(j + 1) * n_vocab]))
                            }
                            Err(e) => Err(RuntimeError::Invalid(format!("logits: {e}"))),
                        };
                        if let Err(e) = decided.and_then(|tok| pass_on(model, s, slot, tok, &mut on_token)) {
                            self.slots[slot] = None;
                            ended.push(fail(slot, e));
                        }
                        self.end_finished(slot, ctx, &mut ended);
                    }
                }
            }
            Err(e) => {
                let text = crate::error_chain(&e);
                let mut first = Some(e);
                for &(slot, _, _) in &rows {
                    let e = first.take().unwrap_or_else(|| {
                        RuntimeError::Invalid(format!("a forward pass shared with another request failed: {text}"))
                    });
                    self.slots[slot] = None;
                    ended.push(fail(slot, e));
                }
            }
        }
        self.pass_rows = rows;
        ended
    }

    /// Runs the next chunk of `slot`'s prompt; after the last, decides and
    /// passes on its first token.
    fn prefill(
        &mut self,
        model: &Model,
        st: &mut RunState,
        hook: &mut dyn LayerHook,
        slot: usize,
        on_token: &mut impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
    ) -> Result<()> {
        let s = self.slots[slot].as_mut().expect("a prefilling sequence");
        if s.prompt_len >= st.ctx {
            return Err(RuntimeError::Invalid(format!(
                "prompt of {} tokens does not fit a context of {}",
                s.prompt_len, st.ctx
            )));
        }
        let t0 = Instant::now();
        let end = s.prompt_len.min(s.ran + st.max_batch);
        let chunk = &s.context[s.ran..end];
        model.forward_seq(st, slot, chunk, s.ran, chunk.len() - 1..chunk.len(), hook)?;
        s.ran = end;
        s.stats.prompt_time += t0.elapsed();
        if s.ran < s.prompt_len {
            return Ok(());
        }
        s.decoding_since = Some(Instant::now());
        if s.n_predict == 0 {
            return Ok(());
        }
        let tok = s.sampler.sample(model.logits(st, 0, 1)?);
        // The prompt's last token is run again by nothing: the first decode
        // row is the token just decided.
        pass_on(model, s, slot, tok, on_token)
    }

    /// Ends `slot`'s sequence if it is done: its tokens all passed on, an
    /// end of generation, the caller's stop, or no room for another pass.
    fn end_finished(&mut self, slot: usize, ctx: usize, ended: &mut Vec<Ended>) {
        let done = self.slots[slot].as_ref().is_some_and(|s| {
            s.decoding_since.is_some()
                && (s.stats.stopped_on_eog
                    || s.stats.stopped_by_caller
                    || s.stats.generated_tokens >= s.n_predict
                    || s.context.len() > ctx)
        });
        if done {
            let s = self.slots[slot].take().expect("checked above");
            ended.push(finish(slot, s));
        }
    }
}

/// Passes `tok` on unless it ends the generation; the sequence then waits
/// for the pass that runs it.
fn pass_on(
    model: &Model,
    s: &mut Sequence,
    slot: usize,
    tok: u32,
    on_token: &mut impl FnMut(usize, u32) -> Result<ControlFlow<()>>,
) -> Result<()> {
    if model.tokenizer.is_end_of_generation(tok) {
        s.stats.stopped_on_eog = true;
        return Ok(());
    }
    let next = on_token(slot, tok)?;
    s.stats.generated_tokens += 1;
    s.context.push(tok);
    s.stats.stopped_by_caller = next.is_break();
    Ok(())
}

fn finish(slot: usize, mut s: Sequence) -> Ended {
    if let Some(t) = s.decoding_since {
        s.stats.decode_time = t.elapsed();
    }
    s.context.truncate(s.ran);
    Ended {
        slot,
        result: Ok(s.stats),
        cached: s.context,
    }
}

fn fail(slot: usize, e: RuntimeError) -> Ended {
    Ended {
        slot,
        result: Err(e),
        cached: Vec::new(),
    }
}
