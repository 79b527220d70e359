//! Continuous batching on the CPU engine (`--parallel N`): up to N requests
//! generate together, each in its own KV cache of the one run state; a step
//! runs a chunk of the earliest new prompt, then one forward pass over a
//! row per decoding request, so the streaming FFN reads what they need once
//! for all. Requests join as slots free and leave as they end; a request
//! whose client reads slowly waits without holding back the others. Each
//! request's greedy text is what it would get served alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Duration;

use leanstream_runtime::generate::batch::{Batch, Ended};
use leanstream_runtime::generate::Sampler;
use leanstream_runtime::model::RunState;
use leanstream_runtime::session::Session;

use crate::metrics::{BatchSnapshot, EngineSnapshot, Metrics};
use crate::prompt_cache::{reuse_prefix, shared, PromptCache};
use crate::reply::Reply;
use crate::request::{check_request, Event, Job};
use crate::ServerError;

/// How long the engine sleeps when every request in flight waits for its
/// client (or only finished answers are still being read).
const IDLE: Duration = Duration::from_millis(1);

/// One sequence slot of the run state.
#[derive(Default)]
struct Slot {
    /// Tokens whose keys and values the slot's cache holds.
    cached: Vec<u32>,
    /// The request generating here.
    reply: Option<Reply>,
}

/// Serves jobs from `rx` until the queue closes and every request has ended.
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve(
    session: &mut Session,
    st: &mut RunState,
    mut batch: Batch,
    rx: Receiver<Job>,
    queued: &AtomicUsize,
    metrics: &Metrics,
    prompt_cache: bool,
    cache: &mut PromptCache,
) {
    let mut slots: Vec<Slot> = (0..st.sequences()).map(|_| Slot::default()).collect();
    // Answers whose generation ended, still being read by their clients.
    let mut draining: Vec<Reply> = Vec::new();
    let mut open = true;
    loop {
        metrics.set_busy(batch.active() > 0 || !draining.is_empty());
        // Admit what the free slots take: wait for work only when none is in flight.
        while open {
            let Some(free) = batch.free_slots().next() else { break };
            let job = if batch.active() > 0 {
                rx.try_recv().map_err(|e| e == TryRecvError::Disconnected)
            } else if !draining.is_empty() {
                rx.recv_timeout(IDLE).map_err(|e| e == RecvTimeoutError::Disconnected)
            } else {
                rx.recv().map_err(|_| true)
            };
            let job = match job {
                Ok(job) => job,
                Err(closed) => {
                    open = !closed;
                    break;
                }
            };
            metrics.set_busy(true);
            queued.fetch_sub(1, Ordering::Relaxed);
            admit(session, st, &mut batch, &mut slots, free, job, metrics, cache);
        }

        draining.retain_mut(|r| r.flush() && r.held());
        for i in 0..slots.len() {
            let gone = slots[i].reply.as_mut().is_some_and(|r| !r.flush());
            if gone {
                if let Some(e) = batch.cancel(i) {
                    end(session, st, &mut slots, &mut draining, e, metrics, prompt_cache, cache);
                }
            }
        }
        if batch.active() == 0 {
            if !open {
                if draining.is_empty() {
                    return;
                }
                // Closing: only answers still being read are left.
                std::thread::sleep(IDLE);
            }
            continue;
        }

        let held: Vec<bool> = slots
            .iter()
            .map(|s| s.reply.as_ref().is_some_and(Reply::held))
            .collect();
        if batch.prefilling() == 0 && (0..slots.len()).all(|i| held[i] || slots[i].reply.is_none()) {
            std::thread::sleep(IDLE);
            continue;
        }
        let ended = match session.parts() {
            Ok((model, hook)) => batch.step(
                model,
                st,
                hook,
                |i| held[i],
                |i, tok| {
                    let reply = slots[i].reply.as_mut().expect("a generating slot has a reply");
                    Ok(reply.token(&model.tokenizer, tok))
                },
            ),
            Err(e) => {
                let text = e.to_string();
                (0..slots.len())
                    .filter_map(|i| batch.cancel(i))
                    .map(|mut e| {
                        e.result = Err(leanstream_runtime::RuntimeError::Invalid(text.clone()));
                        e
                    })
                    .collect()
            }
        };
        for e in ended {
            end(session, st, &mut slots, &mut draining, e, metrics, prompt_cache, cache);
        }
        let (passes, rows) = batch.passes();
        metrics.set_batch(BatchSnapshot {
            active: batch.active(),
            prefilling: batch.prefilling(),
            max: slots.len(),
            passes,
            rows,
        });
    }
}

/// Starts `job` in the free slot `free`, or in the free slot whose cache
/// shares the longest prefix with its prompt; a request that cannot run
/// fails alone.
#[allow(clippy::too_many_arguments)]
fn admit(
    session: &Session,
    st: &mut RunState,
    batch: &mut Batch,
    slots: &mut [Slot],
    free: usize,
    job: Job,
    metrics: &Metrics,
    cache: &mut PromptCache,
) {
    let Job { request, events } = job;
    if events.is_closed() {
        metrics.count_cancelled();
        return;
    }
    let model = session.model();
    let (ids, max_tokens) = match check_request(model, st.ctx, &request) {
        Ok(r) => r,
        Err(e) => {
            metrics.count_failed(&e);
            let _ = events.try_send(Event::Failed(e));
            return;
        }
    };
    let slot = batch
        .free_slots()
        .max_by_key(|&i| (shared(&slots[i].cached, &ids), i == free))
        .unwrap_or(free);
    let kv = st.seq_kv(slot).expect("a slot of the batch has a cache");
    let reused = reuse_prefix(kv, &mut slots[slot].cached, &ids, cache);
    let sampler = Sampler::new(request.sampling, model.config.n_vocab);
    let mut reply = Reply::new(events, request.stop);
    reply.push(Event::Started {
        prompt_tokens: ids.len(),
    });
    if let Err(e) = batch.admit(slot, &ids, reused, max_tokens, sampler) {
        let e = ServerError::from(e);
        metrics.count_failed(&e);
        reply.push(Event::Failed(e));
        reply.flush();
        return;
    }
    slots[slot].reply = Some(reply);
}

/// A request's generation ended: its slot keeps what its cache holds, and
/// its answer ends (or fails) and drains to its client.
#[allow(clippy::too_many_arguments)]
fn end(
    session: &Session,
    st: &mut RunState,
    slots: &mut [Slot],
    draining: &mut Vec<Reply>,
    e: Ended,
    metrics: &Metrics,
    prompt_cache: bool,
    cache: &mut PromptCache,
) {
    let slot = &mut slots[e.slot];
    let Some(mut reply) = slot.reply.take() else { return };
    slot.cached = if prompt_cache { e.cached } else { Vec::new() };
    match e.result {
        Ok(stats) => {
            if let Some(kv) = st.seq_kv(e.slot) {
                cache.insert(&slot.cached, kv);
            }
            metrics.set_prompt_cache_bytes(cache.bytes());
            metrics.count_tokens(&stats);
            if reply.gone() || stats.stopped_by_caller && !reply.flush() {
                metrics.count_cancelled();
                return;
            }
            reply.finish(&stats);
            metrics.count_completed();
        }
        Err(err) => {
            let err = ServerError::from(err);
            metrics.count_failed(&err);
            reply.push(Event::Failed(err));
        }
    }
    if let Some((fm, engine)) = session.flash() {
        metrics.set_engine(EngineSnapshot {
            policy: engine.policy().to_string(),
            stats: engine.stats(),
            memory: fm.memory(st, engine),
        });
    }
    if reply.flush() && reply.held() {
        draining.push(reply);
    }
}
