//! Drafting: several tokens checked per pass change no greedy token, on both
//! real models, through the GGUF engine and the streaming engine; a
//! refused draft leaves the KV cache as plain decoding leaves it, bit for
//! bit; a proposer's slips (nothing, ids outside the vocabulary, more tokens
//! than asked, a context's end) cost nothing; the tokens wanted and a
//! caller's stop end the run inside an accepted draft.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::flash::DownType;
use leanstream_runtime::generate::draft::{self, DraftKind, DraftLen, Drafting, Proposer};
use leanstream_runtime::generate::{CpuDecoder, GenerationStats, Sampler, SamplerConfig};
use leanstream_runtime::model::{DenseFfn, LayerHook, Model, RunState};

/// Real prose with the repetition text has (lists, names said again), so
/// prompt lookup finds n-grams to draft from.
const PROMPTS: [&str; 5] = [
    "The river Danube flows through Germany, Austria, Slovakia, Hungary, Croatia, Serbia, Romania, Bulgaria, \
     Moldova and Ukraine. The river Danube flows through",
    "Question: What is the capital of France? Answer: Paris. Question: What is the capital of Italy? Answer:",
    "In the morning the baker bakes bread, in the afternoon the baker sells bread, and in the evening the baker",
    "Rain fell on the old town all night. By morning the streets of the old town were",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
];

const N: usize = 40;

fn greedy() -> Sampler {
    Sampler::new(
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        1,
    )
}

/// Decodes `n` greedy tokens after `prompt`; returns them, the stats and
/// the KV cache's first positions (all that the tokens run filled).
fn decode(
    model: &Model,
    hook: &mut dyn LayerHook,
    prompt: &[u32],
    n: usize,
    drafting: &mut Drafting,
) -> (Vec<u32>, GenerationStats, RunState) {
    let rows = 7;
    let mut st = model.new_state(prompt.len() + n + 1, prompt.len().max(rows), 1);
    let mut toks = Vec::new();
    let stats = {
        let mut dec = CpuDecoder {
            model,
            st: &mut st,
            hook,
        };
        draft::decode(&mut dec, &model.tokenizer, prompt, 0, n, &mut greedy(), drafting, |t| {
            toks.push(t);
            Ok(ControlFlow::Continue(()))
        })
        .unwrap()
    };
    (toks, stats, st)
}

fn drafting(kind: DraftKind, len: DraftLen, ctx: usize, n_vocab: usize) -> Drafting<'static> {
    Drafting::new(&kind, len, ctx, n_vocab).unwrap()
}

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("draft");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Greedy tokens with each drafting equal those without, and the keys and
/// values of every position the run kept equal plain decoding's.
fn check_identity(name: &str, model: &Model, hook: &mut dyn LayerHook, src: &Path) {
    let n_vocab = model.config.n_vocab;
    let (mut passes, mut drafted_tokens, mut total) = (0, 0, 0);
    for text in PROMPTS {
        let prompt = model.tokenizer.encode(text, true, false);
        let ctx = prompt.len() + N + 1;
        let (plain, plain_stats, plain_st) = decode(model, hook, &prompt, N, &mut Drafting::off());
        assert_eq!(plain_stats.draft.drafted, 0);
        let kept = prompt.len() + plain.len() - 1;
        let plain_kv = plain_st.kv.save_prefix(kept).unwrap();
        for (kind, len) in [
            (DraftKind::Lookup, DraftLen::Fixed(4)),
            (DraftKind::Lookup, DraftLen::Auto { max: 6 }),
            (DraftKind::Model(src.to_path_buf()), DraftLen::Fixed(6)),
        ] {
            let mut d = drafting(kind.clone(), len, ctx, n_vocab);
            let (toks, stats, st) = decode(model, hook, &prompt, N, &mut d);
            assert_eq!(toks, plain, "{name}: {kind} {len:?} changed greedy tokens for {text:?}");
            let kv = st.kv.save_prefix(kept).unwrap();
            assert!(
                plain_kv.same_bits(&kv),
                "{name}: {kind} {len:?} left other keys or values"
            );
            let r = stats.draft;
            if let DraftKind::Model(_) = kind {
                // The model drafting for itself, greedily: every draft token
                // is accepted exactly when a verified row has the bits of
                // the token decoded alone.
                assert_eq!(r.accepted, r.drafted, "{name}: self-draft refused tokens for {text:?}");
                assert!(r.passes * 4 < toks.len() as u64, "{name}: {r:?}");
            }
            passes += r.passes;
            drafted_tokens += r.drafted;
            total += toks.len() as u64;
        }
    }
    assert!(drafted_tokens > 0 && passes < total, "{name}: nothing drafted");
}

fn gguf_identity(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let model = Model::load(&src).unwrap();
    check_identity(name, &model, &mut DenseFfn, &src);
}

fn flash_identity(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let path = common::pack_down(&dir(), &src, &format!("{name}_source"), None, DownType::Source);
    let fm = FlashModel::open(&path).unwrap();
    let mut e = fm.engine(Policy::DenseStream, FfnBudget::Percent(25.0)).unwrap();
    check_identity(name, &fm.model, &mut e, &src);
    assert!(e.stats().bytes_read > 0, "{name}: dense-stream read nothing");
}

#[test]
fn smollm2_drafting_changes_no_greedy_token() {
    gguf_identity("smollm2");
}

#[test]
fn gemma3_drafting_changes_no_greedy_token() {
    gguf_identity("gemma3");
}

#[test]
fn smollm2_streamed_drafting_changes_no_greedy_token() {
    flash_identity("smollm2");
}

#[test]
fn gemma3_streamed_drafting_changes_no_greedy_token() {
    flash_identity("gemma3");
}

/// A proposer that slips: by turns nothing, ids past the vocabulary
/// (after one good guess), far more tokens than asked, and its last
/// context token again and again.
struct Sloppy {
    n_vocab: u32,
    calls: usize,
}

impl Proposer for Sloppy {
    fn name(&self) -> &str {
        "sloppy"
    }
    fn propose(&mut self, context: &[u32], max: usize, out: &mut Vec<u32>) -> leanstream_runtime::Result<()> {
        self.calls += 1;
        let last = *context.last().unwrap();
        match self.calls % 4 {
            0 => {}
            1 => out.extend([last, self.n_vocab, u32::MAX]),
            2 => out.extend(std::iter::repeat_n(last, max + 50)),
            _ => out.extend(std::iter::repeat_n(last, max)),
        }
        Ok(())
    }
}

#[test]
fn a_sloppy_proposer_and_a_small_context_change_nothing() {
    let Some(src) = common::model_path("smollm2") else {
        return;
    };
    let model = Model::load(&src).unwrap();
    let n_vocab = model.config.n_vocab as u32;
    for text in PROMPTS {
        let prompt = model.tokenizer.encode(text, true, false);
        let (plain, ..) = decode(&model, &mut DenseFfn, &prompt, N, &mut Drafting::off());
        let mut d = Drafting {
            proposer: Some(Box::new(Sloppy { n_vocab, calls: 0 })),
            policy: draft::DraftPolicy::new(DraftLen::Fixed(6)),
        };
        let (toks, stats, _) = decode(&model, &mut DenseFfn, &prompt, N, &mut d);
        assert_eq!(toks, plain, "{text:?}");
        assert!(stats.draft.drafted > 0);
        // A context that ends a few tokens after the prompt: drafts stop at
        // its end, and the run ends where plain decoding's does.
        let short = 5;
        let mut st = model.new_state(prompt.len() + short, prompt.len().max(7), 1);
        let mut toks = Vec::new();
        let mut dec = CpuDecoder {
            model: &model,
            st: &mut st,
            hook: &mut DenseFfn,
        };
        let mut d = drafting(
            DraftKind::Model(src.clone()),
            DraftLen::Fixed(6),
            prompt.len() + short,
            n_vocab as usize,
        );
        draft::decode(&mut dec, &model.tokenizer, &prompt, 0, N, &mut greedy(), &mut d, |t| {
            toks.push(t);
            Ok(ControlFlow::Continue(()))
        })
        .unwrap();
        assert_eq!(
            toks,
            plain[..short + 1],
            "{text:?}: a full context ends the run as without drafts"
        );
    }
}

/// The tokens wanted, and a caller's stop, land inside an accepted draft:
/// no token after them is passed on.
#[test]
fn the_run_ends_inside_an_accepted_draft() {
    let Some(src) = common::model_path("smollm2") else {
        return;
    };
    let model = Model::load(&src).unwrap();
    let n_vocab = model.config.n_vocab;
    let prompt = model.tokenizer.encode(PROMPTS[0], true, false);
    let ctx = prompt.len() + N + 1;
    let (plain, ..) = decode(&model, &mut DenseFfn, &prompt, N, &mut Drafting::off());
    for n in [1, 2, 9, 10, 11] {
        let mut d = drafting(DraftKind::Model(src.clone()), DraftLen::Fixed(6), ctx, n_vocab);
        let (toks, stats, _) = decode(&model, &mut DenseFfn, &prompt, n, &mut d);
        assert_eq!(toks, plain[..n], "n_predict {n}");
        assert!(!stats.stopped_by_caller);
    }
    for stop_after in [1, 3, 8] {
        let mut st = model.new_state(ctx, prompt.len().max(7), 1);
        let mut dec = CpuDecoder {
            model: &model,
            st: &mut st,
            hook: &mut DenseFfn,
        };
        let mut d = drafting(DraftKind::Model(src.clone()), DraftLen::Fixed(6), ctx, n_vocab);
        let mut toks = Vec::new();
        let stats = draft::decode(&mut dec, &model.tokenizer, &prompt, 0, N, &mut greedy(), &mut d, |t| {
            toks.push(t);
            Ok(if toks.len() == stop_after {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            })
        })
        .unwrap();
        assert!(stats.stopped_by_caller);
        assert_eq!(toks, plain[..stop_after], "stopped after {stop_after}");
    }
}
