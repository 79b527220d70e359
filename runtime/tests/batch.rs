//! Continuous batching: sequences decoded together, joining and leaving at
//! different steps, each decode the greedy tokens and leave the keys and
//! values they would alone, on both real models, through the GGUF engine and
//! the streaming engine; a sequence stopped by its caller ends at once and
//! its slot serves the next; a bad slot or prompt is refused.

mod common;

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::PathBuf;

use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::flash::DownType;
use leanstream_runtime::generate::batch::Batch;
use leanstream_runtime::generate::draft::{self, Drafting};
use leanstream_runtime::generate::{CpuDecoder, Sampler, SamplerConfig};
use leanstream_runtime::model::{DenseFfn, KvPrefix, LayerHook, Model};

/// Real prose of different lengths; the longest is cut into several prompt
/// chunks by the state's batch.
const PROMPTS: [&str; 5] = [
    "The river Danube flows through Germany, Austria, Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria, \
     Moldova and Ukraine before it reaches the Black Sea, and for centuries it carried grain, salt and timber \
     between the cities on its banks. Traders",
    "Question: What is the capital of France? Answer:",
    "In the morning the baker bakes bread, in the afternoon the baker sells bread, and in the evening the baker",
    "Rain fell on the old town all night. By morning the streets were",
    "The library opened at nine, and the first visitor was",
];
/// Tokens each request asks for: they leave the batch at different steps.
const WANTED: [usize; 5] = [30, 22, 14, 26, 18];
const CTX: usize = 160;
/// The state's batch: the first prompt takes two chunks.
const CHUNK: usize = 24;
const SLOTS: usize = 3;

fn greedy() -> Sampler {
    Sampler::new(
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        1,
    )
}

/// The request decoded by itself, as `run` decodes it: its tokens and the
/// keys and values of every position it ran.
fn alone(model: &Model, hook: &mut dyn LayerHook, prompt: &[u32], n: usize) -> (Vec<u32>, KvPrefix) {
    let mut st = model.new_state(CTX, CHUNK, 1);
    let mut toks = Vec::new();
    let mut dec = CpuDecoder {
        model,
        st: &mut st,
        hook,
    };
    let mut off = Drafting::off();
    let stats = draft::decode(&mut dec, &model.tokenizer, prompt, 0, n, &mut greedy(), &mut off, |t| {
        toks.push(t);
        Ok(ControlFlow::Continue(()))
    })
    .unwrap();
    // Every token passed on ran, but the last of a run that reached `n`.
    let kept = prompt.len() + toks.len() - usize::from(!stats.stopped_on_eog);
    (toks, st.kv.save_prefix(kept).unwrap())
}

/// Requests 0 and 1 arrive first, 2 and 3 three steps later, 4 when a slot
/// frees; request 3 is stopped by its caller after `STOP_AFTER` tokens.
const STOP_AFTER: usize = 5;

fn check_batched(name: &str, model: &Model, hook: &mut dyn LayerHook) {
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|t| model.tokenizer.encode(t, true, false)).collect();
    assert!(
        prompts[0].len() > CHUNK,
        "{name}: the first prompt should take several chunks"
    );
    let want: Vec<(Vec<u32>, KvPrefix)> = prompts
        .iter()
        .zip(WANTED)
        .map(|(p, n)| alone(model, hook, p, n))
        .collect();

    let mut st = model.new_state(CTX, CHUNK, 1).with_sequences(&model.config, SLOTS);
    let mut batch = Batch::new(&st);
    let mut waiting: Vec<usize> = vec![0, 1];
    let mut in_slot: HashMap<usize, usize> = HashMap::new();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); PROMPTS.len()];
    let mut done = vec![false; PROMPTS.len()];
    let mut most_rows = 0;
    for step in 0.. {
        if step == 3 {
            waiting.extend([2, 3]);
        }
        if step > 3 && !waiting.contains(&4) && !in_slot.values().any(|&r| r == 4) && !done[4] {
            waiting.push(4);
        }
        loop {
            let Some(slot) = batch.free_slots().next() else {
                break;
            };
            let Some(r) = (!waiting.is_empty()).then(|| waiting.remove(0)) else {
                break;
            };
            batch.admit(slot, &prompts[r], 0, WANTED[r], greedy()).unwrap();
            in_slot.insert(slot, r);
        }
        if batch.active() == 0 {
            break;
        }
        assert!(step < 400, "{name}: the batch never drained");
        let before = batch.passes();
        let ended = batch.step(
            model,
            &mut st,
            hook,
            |_| false,
            |slot, tok| {
                let r = in_slot[&slot];
                got[r].push(tok);
                Ok(if r == 3 && got[r].len() == STOP_AFTER {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                })
            },
        );
        let after = batch.passes();
        most_rows = most_rows.max(after.1 - before.1);
        for e in ended {
            let r = in_slot.remove(&e.slot).unwrap();
            let stats = e.result.unwrap_or_else(|err| panic!("{name}: request {r}: {err}"));
            done[r] = true;
            let (toks, kv) = &want[r];
            if r == 3 {
                assert!(stats.stopped_by_caller);
                assert_eq!(got[r], toks[..STOP_AFTER], "{name}: the stopped request");
                continue;
            }
            assert_eq!(&got[r], toks, "{name}: request {r} decoded other tokens beside others");
            assert_eq!(stats.generated_tokens, toks.len());
            assert_eq!(e.cached.len(), kv.len(), "{name}: request {r}'s cached tokens");
            assert_eq!(e.cached[..prompts[r].len()], prompts[r][..]);
            let held = st.seq_kv(e.slot).unwrap().save_prefix(kv.len()).unwrap();
            assert!(kv.same_bits(&held), "{name}: request {r} left other keys or values");
        }
    }
    assert!(done.iter().all(|&d| d), "{name}: {done:?}");
    assert_eq!(most_rows, SLOTS as u64, "{name}: no pass held a row per slot");
}

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("batch");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gguf(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let model = Model::load(&src).unwrap();
    check_batched(name, &model, &mut DenseFfn);
}

fn streamed(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let path = common::pack_down(&dir(), &src, &format!("{name}_source"), None, DownType::Source);
    let fm = FlashModel::open(&path).unwrap();
    let mut e = fm.engine(Policy::DenseStream, FfnBudget::Percent(25.0)).unwrap();
    check_batched(name, &fm.model, &mut e);
    assert!(e.stats().bytes_read > 0, "{name}: dense-stream read nothing");
}

#[test]
fn smollm2_batched_sequences_decode_as_alone() {
    gguf("smollm2");
}

#[test]
fn gemma3_batched_sequences_decode_as_alone() {
    gguf("gemma3");
}

#[test]
fn smollm2_streamed_batched_sequences_decode_as_alone() {
    streamed("smollm2");
}

#[test]
fn gemma3_streamed_batched_sequences_decode_as_alone() {
    streamed("gemma3");
}

#[test]
fn a_taken_or_missing_slot_and_an_empty_prompt_are_refused() {
    let Some(src) = common::model_path("smollm2") else {
        return;
    };
    let model = Model::load(&src).unwrap();
    let st = model.new_state(CTX, CHUNK, 1).with_sequences(&model.config, 2);
    let mut batch = Batch::new(&st);
    let prompt = model.tokenizer.encode(PROMPTS[1], true, false);
    assert!(batch.admit(2, &prompt, 0, 4, greedy()).is_err());
    assert!(batch.admit(0, &[], 0, 4, greedy()).is_err());
    batch.admit(0, &prompt, 0, 4, greedy()).unwrap();
    let e = batch.admit(0, &prompt, 0, 4, greedy()).unwrap_err();
    assert!(e.to_string().contains("slot 0 is taken"), "{e}");
    assert_eq!(batch.free_slots().collect::<Vec<_>>(), [1]);
    let ended = batch.cancel(0).unwrap();
    assert!(ended.result.unwrap().stopped_by_caller);
    assert_eq!(batch.active(), 0);
}

/// With the batched kernels every request still runs to its end, its first
/// token (decided by its prompt's own pass) that of the request alone, and
/// the passes hold a row per request.
#[test]
fn batched_kernels_run_every_request_to_its_end() {
    let Some(src) = common::model_path("gemma3") else {
        return;
    };
    let model = Model::load(&src).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS[1..4]
        .iter()
        .map(|t| model.tokenizer.encode(t, true, false))
        .collect();
    let mut st = model.new_state(CTX, CHUNK, SLOTS).with_sequences(&model.config, SLOTS);
    let mut batch = Batch::new(&st).with_batched_kernels();
    for (slot, p) in prompts.iter().enumerate() {
        batch.admit(slot, p, 0, 12, greedy()).unwrap();
    }
    let mut got = vec![Vec::new(); SLOTS];
    let mut ended = 0;
    while batch.active() > 0 {
        for e in batch.step(
            &model,
            &mut st,
            &mut DenseFfn,
            |_| false,
            |slot, tok| {
                got[slot].push(tok);
                Ok(ControlFlow::Continue(()))
            },
        ) {
            let stats = e.result.unwrap();
            assert!(stats.generated_tokens == 12 || stats.stopped_on_eog, "{stats:?}");
            ended += 1;
        }
    }
    assert_eq!(ended, SLOTS);
    for (p, g) in prompts.iter().zip(&got) {
        let (alone_toks, _) = alone(&model, &mut DenseFfn, p, 1);
        assert_eq!(g[0], alone_toks[0]);
    }
    let (passes, rows) = batch.passes();
    assert!(rows >= 2 * passes, "{rows} rows in {passes} passes");
}
