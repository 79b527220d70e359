//! Sparse policies over `.lsflash` files: thresholds stored at pack time,
//! `oracle` replaying a recorded run bit for bit while reading less than
//! `dense-stream`, `gate-first` deciding from resident gate rows, and the
//! file left out of the page cache.

mod common;

use std::path::{Path, PathBuf};

use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{ActiveTrace, CachePolicy, EngineOptions, FlashEngine, FlashModel, Policy};
use leanstream_runtime::flash::{pack, pagecache, DownType, PackOptions};
use leanstream_runtime::model::Model;
use leanstream_runtime::sparsity::calibrate;
use leanstream_runtime::synthetic::SyntheticSpec;

use common::{greedy_flash, same_bits, Run};

const CALIBRATION_TEXT: &str = include_str!("../../data/text/apache-2.0.txt");

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sparse_policies");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Packs `src` with thresholds calibrated on real text at 0.5 and 0.8.
fn pack_calibrated(src: &Path, name: &str) -> PathBuf {
    pack_calibrated_down(src, name, DownType::Q8_0)
}

fn pack_calibrated_down(src: &Path, name: &str, down: DownType) -> PathBuf {
    let model = Model::load(src).unwrap();
    let c = calibrate(&model, CALIBRATION_TEXT, 128, &[0.5, 0.8]).unwrap();
    let n_layer = model.config.n_layer;
    let out = dir().join(format!("{name}.lsflash"));
    let opts = PackOptions {
        down,
        placement: None,
        sparsity: c.levels.iter().map(|t| t.for_layers(n_layer).unwrap()).collect(),
        neuron_scores: c.neuron_scores,
        progress: false,
    };
    pack(src, &out, &opts).unwrap();
    out
}

fn engine(fm: &FlashModel, policy: Policy, budget_pct: f64, sparsity: f32, trace: Option<ActiveTrace>) -> FlashEngine {
    engine_cached(fm, policy, budget_pct, sparsity, trace, CachePolicy::Lru)
}

fn engine_cached(
    fm: &FlashModel,
    policy: Policy,
    budget_pct: f64,
    sparsity: f32,
    trace: Option<ActiveTrace>,
    cache_policy: CachePolicy,
) -> FlashEngine {
    let cache_bytes = (fm.ffn_bytes() as f64 * budget_pct / 100.0) as u64;
    engine_sized(fm, policy, cache_bytes, sparsity, trace, cache_policy)
}

fn engine_sized(
    fm: &FlashModel,
    policy: Policy,
    cache_bytes: u64,
    sparsity: f32,
    trace: Option<ActiveTrace>,
    cache_policy: CachePolicy,
) -> FlashEngine {
    fm.engine_with(EngineOptions {
        policy,
        cache_bytes,
        cache_policy,
        merge_gap_bytes: leanstream_runtime::engine::DEFAULT_MERGE_GAP,
        staging_bytes: None,
        level: fm.sparsity_level(sparsity).unwrap(),
        record: trace.is_none() && matches!(policy, Policy::Dense | Policy::DenseStream),
        trace,
        speculation: None,
        retention: None,
    })
    .unwrap()
}

fn run(fm: &FlashModel, e: &mut FlashEngine, prompt: &[u32], n: usize) -> Run {
    greedy_flash(fm, e, prompt, n).unwrap()
}

/// The checks of the issue on one packed model at `sparsity`.
/// `real`: a trained model, whose activations are skewed enough for a hot set.
fn check_sparse_policies(fm: &FlashModel, prompt: &[u32], n: usize, sparsity: f32, real: bool) {
    let mut dense = engine(fm, Policy::Dense, 100.0, sparsity, None);
    let reference = run(fm, &mut dense, prompt, n);
    let trace = dense.take_trace().unwrap();
    let skipped = dense.stats().skipped_fraction();
    eprintln!(
        "sparsity {sparsity}: dense skipped {skipped:.3} of neurons, tokens {:?}",
        reference.0
    );
    // The thresholds come from other text (the Apache license): on these
    // prompts the skipped share lands within 0.06 of the target (measured).
    assert!(
        (skipped - sparsity as f64).abs() < 0.1,
        "skipped {skipped} at sparsity {sparsity}"
    );

    let mut stream = engine(fm, Policy::DenseStream, 25.0, sparsity, None);
    assert!(
        same_bits(&run(fm, &mut stream, prompt, n), &reference),
        "dense-stream differs from dense"
    );
    let stream_stats = stream.stats();

    let n_calls = trace.n_calls();
    let oracle_trace = trace.clone();
    check_held_whole_replay(fm, prompt, n, sparsity, trace.clone(), &reference);
    let mut oracle = engine(fm, Policy::Oracle, 25.0, sparsity, Some(trace));
    let replay = run(fm, &mut oracle, prompt, n);
    assert!(
        same_bits(&replay, &reference),
        "the oracle's replay differs from the recorded run"
    );
    assert_eq!(oracle.replayed_calls(), Some(n_calls));
    let oracle_stats = oracle.stats();
    eprintln!(
        "bytes requested (read) per token: dense-stream {} ({}), oracle {} ({})",
        stream_stats.bytes_requested / stream_stats.tokens,
        stream_stats.bytes_read / stream_stats.tokens,
        oracle_stats.bytes_requested / oracle_stats.tokens,
        oracle_stats.bytes_read / oracle_stats.tokens
    );
    // Requested, not read: bundles smaller than the 4 KiB O_DIRECT unit make
    // scattered reads pay for their neighbours (placement is the cure).
    assert!(
        oracle_stats.bytes_requested < stream_stats.bytes_requested,
        "the oracle must ask for less: {oracle_stats:?} vs {stream_stats:?}"
    );
    if real {
        check_hot_cache(fm, prompt, n, sparsity, oracle_trace, &reference, &oracle_stats);
    }
    // A different run is not the recorded one: a clear error, not garbage.
    let mut oracle = engine(
        fm,
        Policy::Oracle,
        25.0,
        sparsity,
        Some(ActiveTrace::new(fm.flash.n_ff())),
    );
    let e = greedy_flash(fm, &mut oracle, &prompt[..2], 2).unwrap_err().to_string();
    assert!(e.contains("oracle trace"), "{e}");

    let mut gate = engine(fm, Policy::GateFirst, 25.0, sparsity, None);
    let gated = run(fm, &mut gate, prompt, n);
    let gs = gate.stats();
    eprintln!(
        "gate-first: skipped {:.3}, {} bytes/token, tokens {:?}",
        gs.skipped_fraction(),
        gs.bytes_read / gs.tokens,
        gated.0
    );
    assert!(
        (gs.skipped_fraction() - sparsity as f64).abs() < 0.1,
        "gate-first skipped {} at sparsity {sparsity}",
        gs.skipped_fraction()
    );
    assert!(gs.bytes_requested < stream_stats.bytes_requested);
}

/// With room for every neuron the oracle's layers are held whole, and its
/// scattered kept sets are computed in runs that step over the neurons
/// between them: still the recorded run, bit for bit, with nothing read.
fn check_held_whole_replay(
    fm: &FlashModel,
    prompt: &[u32],
    n: usize,
    sparsity: f32,
    trace: ActiveTrace,
    reference: &Run,
) {
    let all = fm.cache_budget_bytes(FfnBudget::Percent(100.0));
    let mut held = engine_sized(fm, Policy::Oracle, all, sparsity, Some(trace), CachePolicy::Lru);
    assert!(held.whole_layers());
    assert!(
        same_bits(&run(fm, &mut held, prompt, n), reference),
        "the oracle's replay over layers held whole differs from the recorded run"
    );
    let s = held.stats();
    assert_eq!(s.bytes_read, 0, "{s:?}");
    // Computed: the kept neurons and the short gaps between them, not every neuron.
    assert!(s.rows_computed < s.considered, "{s:?}");
}

/// The hot set (calibrated scores, loaded at start) serves part of every
/// token's active set; LRU under a cyclic scan serves less.
fn check_hot_cache(
    fm: &FlashModel,
    prompt: &[u32],
    n: usize,
    sparsity: f32,
    trace: ActiveTrace,
    reference: &Run,
    lru: &leanstream_runtime::engine::EngineStats,
) {
    let mut hot = engine_cached(fm, Policy::Oracle, 25.0, sparsity, Some(trace), CachePolicy::Hot);
    assert!(
        same_bits(&run(fm, &mut hot, prompt, n), reference),
        "oracle with a hot cache"
    );
    let hs = hot.stats();
    eprintln!(
        "oracle cache hit rate: lru {:.3}, hot {:.3}",
        1.0 - lru.cache_miss_ratio(),
        1.0 - hs.cache_miss_ratio()
    );
    assert!(hs.cache_miss_ratio() < lru.cache_miss_ratio());
    assert!(hs.bytes_requested < lru.bytes_requested);
}

/// At sparsity 0 every policy keeps every neuron: all bit-identical to dense.
fn check_dense_equivalence(fm: &FlashModel, prompt: &[u32], n: usize) {
    let mut dense = engine(fm, Policy::Dense, 100.0, 0.0, None);
    let reference = run(fm, &mut dense, prompt, n);
    let trace = dense.take_trace().unwrap();
    for (policy, trace) in [(Policy::GateFirst, None), (Policy::Oracle, Some(trace))] {
        let mut e = engine(fm, policy, 10.0, 0.0, trace);
        assert!(
            same_bits(&run(fm, &mut e, prompt, n), &reference),
            "{policy} at sparsity 0"
        );
        assert_eq!(e.stats().skipped_fraction(), 0.0);
        let first = fm.flash.layout(0);
        if policy == Policy::GateFirst && (0..fm.flash.n_layer()).all(|l| fm.flash.layout(l) == first) {
            // Reads skip the gate rows gate-first holds.
            let st = e.stats();
            assert!(st.cache_misses > 0, "{st:?}");
            let part = (first.bundle_bytes() - first.gate_bytes) as u64;
            assert_eq!(st.bytes_requested, st.cache_misses * part, "{st:?}");
        }
    }
}

fn assert_not_in_page_cache(path: &Path) {
    let (cached, len) = pagecache::cached_bytes(path).unwrap();
    eprintln!("{}: {cached} of {len} bytes in the page cache", path.display());
    assert!(
        cached * 100 <= len,
        "{cached} of {len} bytes of the .lsflash file are in the page cache"
    );
}

#[test]
fn synthetic_sparse_policies() {
    let spec = SyntheticSpec::tiny("llama");
    let src = dir().join("tiny.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let path = pack_calibrated(&src, "tiny");
    let fm = FlashModel::open(&path).unwrap();
    assert_eq!(fm.flash.header().sparsity.len(), 2);
    let prompt = [1u32, 20, 33, 47, 5];
    check_dense_equivalence(&fm, &prompt, 6);
    check_sparse_policies(&fm, &prompt, 6, 0.5, false);
    let e = fm.sparsity_level(0.6).unwrap_err().to_string();
    assert!(e.contains("0.5, 0.8") && e.contains("--calibrate"), "{e}");
    assert_not_in_page_cache(&path);
}

/// Down tiles under sparsity: a neuron brings its group, the oracle still
/// replays the recorded run bit for bit, and gate-first runs and asks for
/// no more than dense streaming.
#[test]
fn synthetic_sparse_policies_over_down_tiles() {
    let spec = SyntheticSpec::tiny("llama");
    let src = dir().join("tiny_tiles.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let fm = FlashModel::open(pack_calibrated_down(&src, "tiny_tiles", DownType::Source)).unwrap();
    let prompt = [1u32, 20, 33, 47, 5];
    check_dense_equivalence(&fm, &prompt, 6);
    let mut dense = engine(&fm, Policy::Dense, 100.0, 0.5, None);
    let reference = run(&fm, &mut dense, &prompt, 6);
    let trace = dense.take_trace().unwrap();
    let mut stream = engine(&fm, Policy::DenseStream, 25.0, 0.5, None);
    assert!(same_bits(&run(&fm, &mut stream, &prompt, 6), &reference));
    let mut oracle = engine(&fm, Policy::Oracle, 25.0, 0.5, Some(trace.clone()));
    assert!(
        same_bits(&run(&fm, &mut oracle, &prompt, 6), &reference),
        "the oracle's replay over tiles differs from the recorded run"
    );
    check_held_whole_replay(&fm, &prompt, 6, 0.5, trace, &reference);
    let mut gate = engine(&fm, Policy::GateFirst, 25.0, 0.5, None);
    run(&fm, &mut gate, &prompt, 6);
    let (gs, ss) = (gate.stats(), stream.stats());
    assert!((gs.skipped_fraction() - 0.5).abs() < 0.1, "{gs:?}");
    assert!(gs.bytes_requested <= ss.bytes_requested, "{gs:?} vs {ss:?}");
}

fn real_model(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let path = pack_calibrated(&src, name);
    let fm = FlashModel::open(&path).unwrap();
    let prompt = fm.model.tokenizer.encode("The capital of France is", true, false);
    check_dense_equivalence(&fm, &prompt, 6);
    for s in [0.5, 0.8] {
        check_sparse_policies(&fm, &prompt, 12, s, true);
    }
    assert_not_in_page_cache(&path);
}

#[test]
fn smollm2_sparse_policies() {
    real_model("smollm2");
}

#[test]
fn gemma3_sparse_policies() {
    real_model("gemma3");
}
