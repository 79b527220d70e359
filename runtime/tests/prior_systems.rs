//! The prior systems as policies of the engine (`dejavu`, `llm-in-a-flash`,
//! `powerinfer2`) and the learned cache policy: at sparsity 0 each computes
//! what `dense` computes, bit for bit, on synthetic models (bundles landing
//! in shuffled order) and on both real models; with sparsity each reads only
//! what its predictor picks; a retention table is used by the cache, found
//! beside the model, and refused by name when made for another model.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use leanstream_kernels::GgmlType;
use leanstream_runtime::cache::retention::N_BUCKETS;
use leanstream_runtime::cache::{FfnBudget, RetentionTable};
use leanstream_runtime::engine::{CachePolicy, Controller, EngineOptions, FlashModel, Policy, Speculation};
use leanstream_runtime::flash::io::{make_backend, Backend, FaultyBackend, IoConfig};
use leanstream_runtime::flash::{DownType, PackOptions, SparsityLevel};
use leanstream_runtime::model::Model;
use leanstream_runtime::predict::{Predictor, PredictorConfig};
use leanstream_runtime::session::StreamSettings;
use leanstream_runtime::synthetic::SyntheticSpec;

const PRIOR: [Policy; 3] = [Policy::DejaVu, Policy::LlmInAFlash, Policy::PowerInfer2];

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prior_systems");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Packs `src` with `down` and calibrated-looking neuron scores (so the hot
/// set of `powerinfer2` exists), no thresholds.
fn pack(src: &Path, name: &str, down: DownType, n_layer: usize, n_ff: usize) -> FlashModel {
    let out = dir().join(format!("{name}.lsflash"));
    let opts = PackOptions {
        down,
        placement: None,
        sparsity: Vec::new(),
        neuron_scores: (0..n_layer)
            .map(|l| (0..n_ff).map(|i| ((i * 7 + l) % 13) as f32 + 0.5).collect())
            .collect(),
        progress: false,
    };
    leanstream_runtime::flash::pack(src, &out, &opts).unwrap();
    FlashModel::open(out).unwrap()
}

fn synthetic(name: &str, down: DownType) -> FlashModel {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer) = (256, 1024, 3);
    let src = dir().join(format!("{name}.gguf"));
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    pack(&src, name, down, 3, 1024)
}

fn predictor_for(fm: &FlashModel, group: usize, low_rank: bool, seed: u64) -> Predictor {
    let c = &fm.model.config;
    let cfg = if low_rank {
        PredictorConfig::low_rank(c.n_embd, c.n_ff, group, c.n_layer, 32)
    } else {
        PredictorConfig::hashing(c.n_embd, c.n_ff, group, c.n_layer, 32, 16, 8, 2)
    };
    let mut p = Predictor::random(cfg, &["speculate", "refine"], seed).unwrap();
    p.provenance = serde_json::json!({"model": {"sha256": hex(&fm.flash.header().source_sha256)}}).to_string();
    p
}

/// A retention table of `fm`'s shape naming `sha` as its model.
fn retention(fm: &FlashModel, sha: &str) -> RetentionTable {
    let (n_layer, n_ff) = (fm.flash.n_layer(), fm.flash.n_ff());
    let p: Vec<f32> = (0..n_layer * n_ff * N_BUCKETS)
        .map(|k| ((k * 31) % 97) as f32 / 97.0)
        .collect();
    let prov = serde_json::json!({"model": {"sha256": sha}}).to_string();
    RetentionTable::from_probabilities(prov, n_layer, n_ff, &p)
}

fn options(fm: &FlashModel, policy: Policy, cache: CachePolicy, level: SparsityLevel, p: Predictor) -> EngineOptions {
    let retention =
        (cache == CachePolicy::Learned).then(|| Arc::new(retention(fm, &hex(&fm.flash.header().source_sha256))));
    EngineOptions {
        policy,
        cache_bytes: fm.ffn_bytes() / 4,
        cache_policy: cache,
        merge_gap_bytes: 0,
        staging_bytes: None,
        level,
        record: false,
        trace: None,
        speculation: Some(Speculation {
            predictor: Arc::new(p),
            predictor_name: "random.lspred".into(),
            controller: Controller::Fixed(Controller::DEFAULT_FIXED),
            prior_breadth: Speculation::PRIOR_BREADTH,
        }),
        retention,
    }
}

fn shuffled(seed: u64) -> leanstream_runtime::engine::BackendFactory {
    Box::new(move |cfg: &IoConfig| {
        let b = FaultyBackend::new(make_backend(cfg)?, []).shuffled(seed, Duration::from_micros(200));
        Ok(Box::new(b) as Box<dyn Backend>)
    })
}

#[test]
fn each_prior_system_at_sparsity_zero_is_dense_bit_for_bit() {
    for (name, down) in [("cols", DownType::Q8_0), ("tiles", DownType::Source)] {
        let fm = synthetic(name, down);
        let prompt = [1u32, 20, 33, 47, 5, 9];
        let mut dense = fm.engine(Policy::Dense, FfnBudget::Percent(100.0)).unwrap();
        let reference = common::greedy_flash(&fm, &mut dense, &prompt, 5).unwrap();
        let group = fm.formats[0].group().min(32);
        for (k, policy) in PRIOR.into_iter().enumerate() {
            for cache in [
                CachePolicy::Lru,
                CachePolicy::Hot,
                CachePolicy::Window(5),
                CachePolicy::Learned,
            ] {
                let p = predictor_for(&fm, group, k % 2 == 0, k as u64);
                let opts = options(&fm, policy, cache, SparsityLevel::dense(3), p);
                let mut e = fm.engine_on(opts, Some(shuffled(k as u64 + 1))).unwrap();
                let run = common::greedy_flash(&fm, &mut e, &prompt, 5).unwrap();
                assert!(common::same_bits(&run, &reference), "{name}: {policy} with {cache}");
                assert_eq!(e.predictor_name(), Some("random.lspred"));
                assert!(e.stats().bytes_read > 0, "{name}: {policy} streamed nothing");
            }
        }
    }
}

/// With half the neurons needed, each reads what its predictor picks: less
/// than dense-stream, which reads every bundle.
#[test]
fn with_sparsity_each_reads_only_its_prediction() {
    let fm = synthetic("sparse", DownType::Q8_0);
    let level = SparsityLevel {
        sparsity: 0.5,
        full: vec![1e-3; 3],
        gate: vec![1e-3; 3],
    };
    let prompt = [1u32, 20, 33, 47];
    let mut ds = fm
        .engine_with(EngineOptions {
            policy: Policy::DenseStream,
            speculation: None,
            ..options(
                &fm,
                Policy::DenseStream,
                CachePolicy::Lru,
                level.clone(),
                predictor_for(&fm, 1, false, 1),
            )
        })
        .unwrap();
    common::greedy_flash(&fm, &mut ds, &prompt, 4).unwrap();
    let all = ds.stats().bytes_requested;
    for policy in PRIOR {
        let opts = options(
            &fm,
            policy,
            CachePolicy::Lru,
            level.clone(),
            predictor_for(&fm, 1, false, 2),
        );
        let mut e = fm.engine_with(opts).unwrap();
        let run = common::greedy_flash(&fm, &mut e, &prompt, 4).unwrap();
        assert!(run.1.iter().flatten().all(|v| v.is_finite()));
        let s = e.stats();
        // Breadth 1 at sparsity 0.5: about half of every layer (the first
        // layer of the prompt is a union over its rows).
        assert!(
            s.bytes_requested < all * 3 / 4,
            "{policy}: {} of {all} bytes",
            s.bytes_requested
        );
        assert!(s.skipped_fraction() > 0.25, "{policy}: {s:?}");
    }
}

/// A wider predicted set reads more and skips less; one that covers the
/// layer (breadth 2 where the level keeps half) reads every bundle and
/// computes `dense-stream`'s bits at the same level.
#[test]
fn a_wider_prior_breadth_reads_more_and_at_full_width_is_dense_stream() {
    let fm = synthetic("breadth", DownType::Q8_0);
    let level = SparsityLevel {
        sparsity: 0.5,
        full: vec![1e-3; 3],
        gate: vec![1e-3; 3],
    };
    let prompt = [1u32, 20, 33, 47];
    let run_with = |policy: Policy, breadth: f32| {
        let mut opts = options(
            &fm,
            policy,
            CachePolicy::Lru,
            level.clone(),
            predictor_for(&fm, 1, false, 2),
        );
        if policy == Policy::DenseStream {
            opts.speculation = None;
        } else if let Some(sp) = opts.speculation.as_mut() {
            sp.prior_breadth = breadth;
        }
        let mut e = fm.engine_on(opts, Some(shuffled(7))).unwrap();
        let run = common::greedy_flash(&fm, &mut e, &prompt, 4).unwrap();
        (run, e.stats().bytes_requested, e.stats().skipped_fraction())
    };
    let (stream, all, stream_skipped) = run_with(Policy::DenseStream, Speculation::PRIOR_BREADTH);
    for policy in PRIOR {
        let (_, narrow, narrow_skipped) = run_with(policy, 1.0);
        let (_, wide, wide_skipped) = run_with(policy, 1.5);
        assert!(narrow < wide && wide <= all, "{policy}: {narrow} {wide} {all}");
        assert!(
            narrow_skipped > wide_skipped,
            "{policy}: {narrow_skipped} {wide_skipped}"
        );
        // (Not byte for byte dense-stream's: it reads further ahead, so its
        // LRU cache keeps other bundles.)
        let (full, full_bytes, full_skipped) = run_with(policy, 2.0);
        assert!(common::same_bits(&full, &stream), "{policy} at breadth 2");
        assert_eq!(full_skipped, stream_skipped, "{policy}");
        assert!(full_bytes >= wide, "{policy}: {full_bytes} {wide}");
    }
}

/// Real models packed with their down matrices in the source's blocks:
/// each prior system at sparsity 0 gives the GGUF engine's tokens and
/// logits, bit for bit.
fn real_model_exact(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let c = Model::load(&src).unwrap().config;
    let fm = pack(&src, &format!("{name}_source"), DownType::Source, c.n_layer, c.n_ff);
    let prompt = fm
        .model
        .tokenizer
        .encode("A printing press, in the fifteenth century,", true, false);
    let gguf = common::greedy_gguf(&src, &prompt, 6);
    let group = fm.formats[0].group().min(32);
    for (policy, cache) in [
        (Policy::DejaVu, CachePolicy::Lru),
        (Policy::LlmInAFlash, CachePolicy::Window(5)),
        (Policy::PowerInfer2, CachePolicy::Hot),
    ] {
        let p = predictor_for(&fm, group, policy != Policy::PowerInfer2, 5);
        let mut e = fm
            .engine_with(options(&fm, policy, cache, SparsityLevel::dense(c.n_layer), p))
            .unwrap();
        let run = common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
        assert!(
            common::same_bits(&run, &gguf),
            "{name}: {policy} differs from the GGUF engine"
        );
    }
}

#[test]
fn smollm2_prior_systems_are_exact_at_sparsity_zero() {
    real_model_exact("smollm2");
}

#[test]
fn gemma3_prior_systems_are_exact_at_sparsity_zero() {
    real_model_exact("gemma3");
}

/// The learned cache policy finds its retention table beside the model (or
/// named); the prior systems keep their own caches by default; a table for
/// another model, or of another shape, is refused by name.
#[test]
fn a_retention_table_is_found_beside_the_model_and_checked() {
    let fm = synthetic("evict", DownType::Q8_0);
    let sha = hex(&fm.flash.header().source_sha256);
    let settings = StreamSettings {
        cache_policy: Some(CachePolicy::Learned),
        ..StreamSettings::default()
    };
    let beside = fm.flash.path().with_extension("lsevict");
    let _ = std::fs::remove_file(&beside);
    let defaults = StreamSettings::default();
    assert_eq!(defaults.eviction(&fm, Policy::DenseStream).unwrap().0, CachePolicy::Hot);
    assert_eq!(
        defaults.eviction(&fm, Policy::LlmInAFlash).unwrap().0,
        CachePolicy::Window(5)
    );
    assert_eq!(defaults.eviction(&fm, Policy::PowerInfer2).unwrap().0, CachePolicy::Hot);
    assert_eq!(defaults.eviction(&fm, Policy::DejaVu).unwrap().0, CachePolicy::Lru);
    // Learned asked for with no table anywhere.
    let e = settings.eviction(&fm, Policy::DenseStream).unwrap_err().to_string();
    assert!(e.contains("--eviction"), "{e}");
    retention(&fm, &sha).save(&beside).unwrap();
    let (cache, table) = settings.eviction(&fm, Policy::Speculate).unwrap();
    assert_eq!(cache, CachePolicy::Learned);
    assert_eq!(table.unwrap().n_ff, 1024);
    // Another model's table.
    retention(&fm, &"cd".repeat(32)).save(&beside).unwrap();
    let e = settings.eviction(&fm, Policy::DenseStream).unwrap_err().to_string();
    assert!(e.contains("evict.lsevict") && e.contains("another model"), "{e}");
    // Named explicitly, of another shape.
    let other = synthetic("evict_other", DownType::Source);
    let path = dir().join("shape.lsevict");
    let mut t = retention(&other, &sha);
    t.n_layer = 2;
    t.prob.truncate(2 * 1024 * N_BUCKETS);
    t.save(&path).unwrap();
    let named = StreamSettings {
        eviction: Some(path.clone()),
        ..settings.clone()
    };
    let e = named.eviction(&fm, Policy::DenseStream).unwrap_err().to_string();
    assert!(e.contains("shape.lsevict") && e.contains("n_layer"), "{e}");
    // Naming a table picks the learned policy; naming it with another is an error.
    let only_table = StreamSettings {
        eviction: Some(beside.clone()),
        ..StreamSettings::default()
    };
    retention(&fm, &sha).save(&beside).unwrap();
    assert_eq!(
        only_table.eviction(&fm, Policy::DejaVu).unwrap().0,
        CachePolicy::Learned
    );
    let clash = StreamSettings {
        cache_policy: Some(CachePolicy::Lru),
        ..only_table
    };
    let e = clash.eviction(&fm, Policy::DenseStream).unwrap_err().to_string();
    assert!(e.contains("--eviction") && e.contains("lru"), "{e}");
    std::fs::remove_file(&beside).unwrap();
}

/// `prior_breadth` sizes the prior systems' sets only: another policy, or
/// a breadth that is not a positive number, is refused by the flag's name.
#[test]
fn a_prior_breadth_is_refused_where_it_means_nothing() {
    let fm = synthetic("breadth_flags", DownType::Q8_0);
    let with = |b: f32| StreamSettings {
        prior_breadth: Some(b),
        ..StreamSettings::default()
    };
    for policy in [Policy::Speculate, Policy::DenseStream] {
        let e = with(1.5).check_prior_breadth(policy).unwrap_err().to_string();
        assert!(e.contains("--prior-breadth") && e.contains(&policy.to_string()), "{e}");
        let e = with(1.5).device_engine(&fm, policy).err().unwrap().to_string();
        assert!(e.contains("--prior-breadth"), "{e}");
    }
    with(1.5).check_prior_breadth(Policy::PowerInfer2).unwrap();
    // A dense reference made beside a prior system's run ignores it.
    assert!(with(1.5).speculation(&fm, Policy::Dense).unwrap().is_none());
    for b in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = with(b).check_prior_breadth(Policy::DejaVu).unwrap_err().to_string();
        assert!(e.contains("--prior-breadth"), "{b}: {e}");
    }
}
