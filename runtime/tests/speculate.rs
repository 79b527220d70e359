//! The `speculate` policy: at sparsity 0 without a deadline it computes what
//! `dense` computes, bit for bit, whatever the predictor, the stages, the
//! breadth, the cache or the arrival order; a controller table whose action
//! depends on the state makes the engine act differently per layer
//! (counted); refinement adds and cancels reads and the reads go out in
//! predicted order (the fault-injection backend's request log); a missed
//! deadline skips bundles instead of waiting; layers held or read whole are
//! taken unranked; artifacts for another model are refused by name.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leanstream_kernels::GgmlType;
use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::control::{Action, Axis, AxisKind, ControlTable, Provenance};
use leanstream_runtime::engine::{
    BackendFactory, CachePolicy, Controller, EngineOptions, FlashModel, Policy, Speculation,
};
use leanstream_runtime::flash::io::{make_backend, Backend, FaultyBackend, IoConfig};
use leanstream_runtime::flash::{DownType, SparsityLevel};
use leanstream_runtime::predict::{Predictor, PredictorConfig};
use leanstream_runtime::synthetic::SyntheticSpec;

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("speculate");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pack_down(src: &Path, name: &str, placement: Option<Vec<Vec<u32>>>, down: DownType) -> PathBuf {
    common::pack_down(&dir(), src, name, placement, down)
}

/// A synthetic llama model of `n_layer` layers with `n_ff` neurons, packed
/// with `down`; with `reversed`, every layer's neurons stored in reverse.
fn synthetic(name: &str, n_ff: usize, down: DownType, reversed: bool) -> (PathBuf, FlashModel) {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer) = (256, n_ff, 3);
    let src = dir().join(format!("{name}.gguf"));
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    let placement = reversed.then(|| vec![(0..n_ff as u32).rev().collect(); 3]);
    let fm = FlashModel::open(pack_down(&src, name, placement, down)).unwrap();
    (src, fm)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A random predictor of `fm`'s shape whose provenance names `fm`'s source model.
fn predictor_for(fm: &FlashModel, group: usize, seed: u64) -> Predictor {
    let c = &fm.model.config;
    let cfg = PredictorConfig::hashing(c.n_embd, c.n_ff, group, c.n_layer, 32, 16, 8, 2);
    let mut p = Predictor::random(cfg, &["speculate", "refine"], seed).unwrap();
    p.provenance = serde_json::json!({"model": {"sha256": hex(&fm.flash.header().source_sha256)}}).to_string();
    p
}

fn speculation(fm: &FlashModel, controller: Controller, seed: u64) -> Speculation {
    Speculation {
        predictor: Arc::new(predictor_for(fm, 1, seed)),
        predictor_name: "random.lspred".into(),
        controller,
        prior_breadth: Speculation::PRIOR_BREADTH,
    }
}

fn fixed(spec: &str) -> Controller {
    Controller::parse_fixed(spec).unwrap()
}

fn options(fm: &FlashModel, share: f64, level: SparsityLevel, sp: Option<Speculation>) -> EngineOptions {
    EngineOptions {
        policy: if sp.is_some() {
            Policy::Speculate
        } else {
            Policy::DenseStream
        },
        cache_bytes: (fm.ffn_bytes() as f64 * share) as u64,
        cache_policy: CachePolicy::Lru,
        merge_gap_bytes: 0,
        staging_bytes: None,
        level,
        record: false,
        trace: None,
        speculation: sp,
        retention: None,
    }
}

fn shuffled(seed: u64, max_delay: Duration, log: Option<Arc<Mutex<Vec<u64>>>>) -> BackendFactory {
    Box::new(move |cfg: &IoConfig| {
        let inner = make_backend(cfg)?;
        let mut b = FaultyBackend::new(inner, []).shuffled(seed, max_delay);
        if let Some(log) = log {
            b = b.logging(log);
        }
        Ok(Box::new(b) as Box<dyn Backend>)
    })
}

#[test]
fn speculate_at_sparsity_zero_without_deadline_is_dense_bit_for_bit() {
    for (name, down, reversed) in [("cols_rev", DownType::Q8_0, true), ("tiles", DownType::Source, false)] {
        let (_, fm) = synthetic(name, 2048, down, reversed);
        let prompt = [1u32, 20, 33, 47, 5, 9];
        let mut dense = fm.engine(Policy::Dense, FfnBudget::Percent(100.0)).unwrap();
        let reference = common::greedy_flash(&fm, &mut dense, &prompt, 6).unwrap();
        let dense_level = || SparsityLevel::dense(fm.flash.n_layer());
        let cases = [
            ("fixed:K=1,b=1,d=inf,q=4", 0.0, 1u64),
            ("fixed:K=4,b=1,d=inf,q=16", 0.3, 2),
            ("fixed:K=2,b=2.5,d=inf,q=8", 0.6, 3),
        ];
        for (spec, share, seed) in cases {
            let opts = options(&fm, share, dense_level(), Some(speculation(&fm, fixed(spec), seed)));
            let mut e = fm
                .engine_on(opts, Some(shuffled(seed, Duration::from_micros(200), None)))
                .unwrap();
            let run = common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
            let d = e.decisions().unwrap();
            assert!(
                common::same_bits(&run, &reference),
                "{name}: {spec} at cache share {share}"
            );
            assert_eq!(e.stats().late_skipped, 0);
            assert!(d.refinements > 0, "{name} {spec}: {d:?}");
            assert_eq!(d.actions.len(), 1);
            // Every layer of every forward call decided once.
            assert_eq!(d.actions[0].layers, 7 * fm.flash.n_layer() as u64);
        }
    }
}

/// Where a ranking decides nothing, `speculate` skips it: with the cache
/// holding every layer whole it computes each layer whole, and with no
/// cache an action whose breadth selects every neuron reads them all in
/// file order. Either way it computes what `dense-stream` computes at the
/// same sparsity, bit for bit.
#[test]
fn layers_held_or_read_whole_are_taken_unranked() {
    let (_, fm) = synthetic("held", 2048, DownType::Q8_0, false);
    let prompt = [1u32, 20, 33, 47, 5, 9];
    for cache_bytes in [fm.cache_budget_bytes(FfnBudget::Percent(100.0)), 0] {
        let opts = |sp: Option<Speculation>| EngineOptions {
            cache_bytes,
            ..options(&fm, 0.0, half_level(&fm), sp)
        };
        let mut plain = fm.engine_with(opts(None)).unwrap();
        let reference = common::greedy_flash(&fm, &mut plain, &prompt, 6).unwrap();
        // Breadth 2.5 of a half-sparse need selects every neuron.
        let sp = speculation(&fm, fixed("fixed:K=4,b=2.5,d=inf,q=16"), 11);
        let mut e = fm.engine_with(opts(Some(sp))).unwrap();
        let run = common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
        let d = e.decisions().unwrap();
        assert!(common::same_bits(&run, &reference), "cache {cache_bytes}: {d:?}");
        assert!(e.stats().skipped_fraction() > 0.0, "sparsity 0.5 skips some neurons");
        let n_layer = fm.flash.n_layer() as u64;
        if cache_bytes > 0 {
            // 7 forward calls × 3 layers, all held from the start: only the
            // first layer is ranked, which measures what a ranking costs.
            assert!(e.whole_layers(), "a cache with room for every neuron holds them whole");
            assert_eq!(d.unranked, 7 * n_layer - 1, "{d:?}");
            assert_eq!(d.refinements, 0, "{d:?}");
            assert_eq!(e.stats().bytes_read, 0, "nothing is read after open");
        } else {
            // The first call ranks all three (it measures the state the
            // later calls estimate).
            assert_eq!(d.unranked, 6 * n_layer, "{d:?}");
            // Layers 1 and 2 are re-ranked from their true input in the first
            // call only; the next layer is read whole, so no stage re-ranks it.
            assert_eq!(d.refinements, 2, "{d:?}");
            // Reading whole needs no prediction, so the reads run as far
            // ahead as dense-stream's: into the next token's layers.
            let queued = |e: &leanstream_runtime::engine::FlashEngine| {
                let s = e.streamer().unwrap();
                (0..n_layer as usize).map(|l| s.is_queued(l)).collect::<Vec<_>>()
            };
            assert_eq!(queued(&e), queued(&plain));
            assert!(queued(&e)[0], "the next token's first layer is requested");
        }
    }
}

/// Real models packed with their down matrices in the source's blocks:
/// speculate at sparsity 0 without a deadline gives the GGUF engine's tokens
/// and logits, bit for bit.
fn real_model_exact(name: &str) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let fm = FlashModel::open(pack_down(&src, &format!("{name}_source"), None, DownType::Source)).unwrap();
    let prompt = fm.model.tokenizer.encode(
        "The history of the printing press begins in the fifteenth century, when",
        true,
        false,
    );
    let gguf = common::greedy_gguf(&src, &prompt, 8);
    let group = fm.formats[0].group();
    let sp = Speculation {
        predictor: Arc::new(predictor_for(&fm, group.min(32), 9)),
        predictor_name: "random.lspred".into(),
        controller: fixed("fixed:K=4,b=1,d=inf,q=16"),
        prior_breadth: Speculation::PRIOR_BREADTH,
    };
    let opts = options(&fm, 0.25, SparsityLevel::dense(fm.flash.n_layer()), Some(sp));
    let mut e = fm.engine_with(opts).unwrap();
    let run = common::greedy_flash(&fm, &mut e, &prompt, 8).unwrap();
    assert!(
        common::same_bits(&run, &gguf),
        "{name}: speculate differs from the GGUF engine"
    );
}

#[test]
fn smollm2_speculate_is_exact_at_sparsity_zero() {
    real_model_exact("smollm2");
}

#[test]
fn gemma3_speculate_is_exact_at_sparsity_zero() {
    real_model_exact("gemma3");
}

/// A table over the layer position: the first half of the stack takes
/// action 0, the rest action 1.
fn position_table(a: Action, b: Action) -> ControlTable {
    ControlTable {
        provenance: Provenance {
            device_fingerprint: "test".into(),
            ..Provenance::default()
        },
        axes: vec![Axis {
            kind: AxisKind::LayerPosition,
            thresholds: vec![0.5],
            centers: vec![0.25, 0.75],
        }],
        codebook: vec![a, b],
        codes: vec![0, 1],
    }
}

/// Thresholds that keep about half of a synthetic layer's neurons.
fn half_level(fm: &FlashModel) -> SparsityLevel {
    let n = fm.flash.n_layer();
    SparsityLevel {
        sparsity: 0.5,
        full: vec![1e-3; n],
        gate: vec![1e-3; n],
    }
}

#[test]
fn the_tables_actions_follow_the_measured_state() {
    let (_, fm) = synthetic("table", 2048, DownType::Q8_0, false);
    let prompt = [1u32, 20, 33, 47, 5, 9];
    let narrow = Action {
        stages: 1,
        queue_depth: 4,
        prefetch_breadth: 1.0,
        deadline_factor: f32::INFINITY,
    };
    let wide = Action {
        stages: 2,
        queue_depth: 16,
        prefetch_breadth: 2.0,
        ..narrow
    };
    let run = |table: ControlTable| {
        let c = Controller::Table {
            table: Arc::new(table),
            origin: "test table".into(),
        };
        let mut e = fm
            .engine_with(options(&fm, 0.0, half_level(&fm), Some(speculation(&fm, c, 4))))
            .unwrap();
        common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
        (e.decisions().unwrap(), e.stats())
    };
    let (by_position, s_mixed) = run(position_table(narrow, wide));
    let (all_narrow, s_narrow) = run(position_table(narrow, narrow));
    let (all_wide, s_wide) = run(position_table(wide, wide));
    // Layers 0 and 1 (positions 0, 1/3) take the narrow action, layer 2 the wide one.
    let calls = 7u64;
    let counts: Vec<(usize, u64)> = by_position.actions.iter().map(|a| (a.code, a.layers)).collect();
    assert_eq!(counts, vec![(0, 2 * calls), (1, calls)], "{by_position:?}");
    assert!(all_narrow.actions.iter().all(|a| a.action == narrow));
    assert!(all_wide.actions.iter().all(|a| a.action == wide));
    // Breadth 2 reads more than breadth 1; mixing the two lies between.
    eprintln!(
        "bytes requested: narrow {}, mixed {}, wide {}",
        s_narrow.bytes_requested, s_mixed.bytes_requested, s_wide.bytes_requested
    );
    assert!(s_narrow.bytes_requested < s_mixed.bytes_requested);
    assert!(s_mixed.bytes_requested < s_wide.bytes_requested);
}

#[test]
fn refinement_adds_and_cancels_reads_issued_in_predicted_order() {
    let (_, fm) = synthetic("refine", 2048, DownType::Q8_0, false);
    let prompt = [1u32, 20, 33, 47, 5, 9];
    let issue_order = |sp: Option<Speculation>| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut e = fm
            .engine_on(
                options(&fm, 0.0, half_level(&fm), sp),
                Some(shuffled(5, Duration::from_micros(100), Some(Arc::clone(&log)))),
            )
            .unwrap();
        common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
        let offsets = log.lock().unwrap().clone();
        // Steps back in the file: one per layer when reads go out in file order.
        let descents = offsets.windows(2).filter(|w| w[1] < w[0]).count();
        (descents, offsets.len(), e.decisions())
    };
    let (file_order, n_plain, _) = issue_order(None);
    let (ranked, n_ranked, d) = issue_order(Some(speculation(&fm, fixed("fixed:K=4,b=1,d=inf,q=4"), 6)));
    let d = d.unwrap();
    eprintln!("dense-stream: {file_order} descents in {n_plain} reads; speculate: {ranked} in {n_ranked}; {d:?}");
    assert!(d.refine_added > 0, "refinement added no reads: {d:?}");
    assert!(d.refine_cancelled > 0, "refinement cancelled no reads: {d:?}");
    // Reads leave in the predictor's order, not the file's.
    assert!(ranked > 4 * file_order.max(1), "{ranked} vs {file_order}");
}

#[test]
fn a_missed_deadline_skips_bundles_instead_of_waiting() {
    let (_, fm) = synthetic("deadline", 2048, DownType::Q8_0, false);
    let prompt = [1u32, 20, 33, 47, 5, 9];
    // Reads held up to 3 ms against a deadline of a hundredth of the compute time.
    let sp = speculation(&fm, fixed("fixed:K=2,b=1,d=0.01,q=4"), 7);
    let mut e = fm
        .engine_on(
            options(&fm, 0.0, SparsityLevel::dense(fm.flash.n_layer()), Some(sp)),
            Some(shuffled(8, Duration::from_millis(3), None)),
        )
        .unwrap();
    let run = common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
    let s = e.stats();
    assert_eq!(run.0.len(), 6);
    assert!(run.1.iter().flatten().all(|v| v.is_finite()));
    assert!(s.late_skipped > 0, "{s:?}");
    assert!(s.skipped_fraction() > 0.0, "{s:?}");
}

/// The audit (`FlashModel::audit`) counts the share of the true active mass
/// (what `dense` keeps at the policy's own state) a policy skipped: none for
/// `dense-stream`, which keeps by the same thresholds, and for `speculate`
/// at sparsity 0 without a deadline; some when a deadline skips late
/// bundles, and when a random predictor picks half the neurons without a
/// cache. Auditing changes nothing the policy computes.
#[test]
fn the_audit_counts_the_active_mass_a_policy_skipped() {
    let prompt = [1u32, 20, 33, 47, 5, 9];
    // The audit's whole layers are the source's matrices where the file
    // has down tiles: still the streamed bits.
    let (_, fm) = synthetic("audit_tiles", 2048, DownType::Source, false);
    let mut e = fm.engine_with(options(&fm, 0.25, half_level(&fm), None)).unwrap();
    fm.audit(&mut e).unwrap();
    common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
    assert_eq!(e.stats().skipped_mass(), Some(0.0), "{:?}", e.stats());

    let (_, fm) = synthetic("audit", 2048, DownType::Q8_0, false);
    let dense_level = || SparsityLevel::dense(fm.flash.n_layer());
    let run = |opts: EngineOptions, backend: Option<BackendFactory>, audit: bool| {
        let mut e = fm.engine_on(opts, backend).unwrap();
        if audit {
            fm.audit(&mut e).unwrap();
        }
        let out = common::greedy_flash(&fm, &mut e, &prompt, 6).unwrap();
        (out, e.stats())
    };
    let (plain, s) = run(options(&fm, 0.25, half_level(&fm), None), None, false);
    assert_eq!(s.skipped_mass(), None, "no audit, no measure");
    let (audited, s) = run(options(&fm, 0.25, half_level(&fm), None), None, true);
    assert!(common::same_bits(&plain, &audited), "the audit changes nothing");
    assert_eq!(s.skipped_mass(), Some(0.0), "{s:?}");
    assert!(s.active_mass > 0.0);

    let sp = speculation(&fm, fixed("fixed:K=2,b=1,d=inf,q=4"), 3);
    let (_, s) = run(options(&fm, 0.0, dense_level(), Some(sp)), None, true);
    assert_eq!(s.skipped_mass(), Some(0.0), "{s:?}");

    let sp = speculation(&fm, fixed("fixed:K=2,b=1,d=0.01,q=4"), 7);
    let late = Some(shuffled(8, Duration::from_millis(3), None));
    let (_, s) = run(options(&fm, 0.0, dense_level(), Some(sp)), late, true);
    assert!(s.late_skipped > 0, "{s:?}");
    let m = s.skipped_mass().unwrap();
    assert!(m > 0.0 && m < 1.0, "{s:?}");

    let sp = speculation(&fm, fixed("fixed:K=1,b=1,d=inf,q=4"), 5);
    let (_, s) = run(options(&fm, 0.0, half_level(&fm), Some(sp)), None, true);
    let m = s.skipped_mass().unwrap();
    assert!(
        m > 0.1 && m < 0.9,
        "a random pick of half the neurons misses part of the mass: {s:?}"
    );
}

#[test]
fn a_predictor_for_another_model_is_refused_by_name() {
    let (_, fm) = synthetic("refuse", 512, DownType::Q8_0, false);
    let path = dir().join("other.lspred");
    let mut p = predictor_for(&fm, 1, 1);
    p.provenance = serde_json::json!({"model": {"sha256": "ab".repeat(32)}}).to_string();
    p.save(&path).unwrap();
    let e = leanstream_runtime::artifacts::load_predictor(&path, &fm)
        .unwrap_err()
        .to_string();
    assert!(e.contains("other.lspred") && e.contains("another model"), "{e}");
    // No model named at all.
    p.provenance = "{}".into();
    p.save(&path).unwrap();
    let e = leanstream_runtime::artifacts::load_predictor(&path, &fm)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.sha256"), "{e}");
    // The right model but another shape.
    let (_, wide) = synthetic("refuse_wide", 1024, DownType::Q8_0, false);
    let mut q = predictor_for(&wide, 1, 1);
    q.provenance = serde_json::json!({"model": {"sha256": hex(&fm.flash.header().source_sha256)}}).to_string();
    q.save(&path).unwrap();
    let e = leanstream_runtime::artifacts::load_predictor(&path, &fm)
        .unwrap_err()
        .to_string();
    assert!(e.contains("n_ff") && e.contains("other.lspred"), "{e}");
    // The right one loads, and is found beside the model without a flag.
    let beside = fm.flash.path().with_extension("lspred");
    predictor_for(&fm, 1, 1).save(&beside).unwrap();
    let sp = leanstream_runtime::artifacts::speculation(&fm, fm.flash.path(), Policy::Speculate, None, None).unwrap();
    assert_eq!(sp.predictor_name, beside.display().to_string());
    assert!(matches!(sp.controller, Controller::Table { .. }));
    std::fs::remove_file(&beside).unwrap();
    let e = leanstream_runtime::artifacts::speculation(&fm, fm.flash.path(), Policy::Speculate, None, None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--predictor"), "{e}");
}

/// A table whose solver settings name `model` (JSON) as what it was solved for.
fn table_for(model: serde_json::Value) -> ControlTable {
    let mut t = position_table(Controller::DEFAULT_FIXED, Controller::DEFAULT_FIXED);
    t.provenance.solver_settings = serde_json::json!({ "model": model }).to_string();
    t
}

#[test]
fn a_controller_table_for_another_model_is_refused_by_name() {
    let (_, fm) = synthetic("refuse_table", 512, DownType::Q8_0, false);
    let pred = dir().join("refuse_table_pred.lspred");
    predictor_for(&fm, 1, 1).save(&pred).unwrap();
    let bundle = fm.flash.layout(0).bundle_bytes();
    let sha = hex(&fm.flash.header().source_sha256);
    let path = dir().join("other.lstab");
    let load = |t: ControlTable| {
        t.save(&path).unwrap();
        leanstream_runtime::artifacts::speculation(
            &fm,
            fm.flash.path(),
            Policy::Speculate,
            Some(pred.as_path()),
            Some(path.to_str().unwrap()),
        )
    };
    // Another model's hash.
    let other =
        table_for(serde_json::json!({"sha256": "ab".repeat(32), "n_layers": 3, "n_ff": 512, "bundle_bytes": bundle}));
    let e = load(other).unwrap_err().to_string();
    assert!(e.contains("other.lstab") && e.contains("another model"), "{e}");
    // This model's hash on another shape: the file is not what it says.
    let edited = table_for(serde_json::json!({"sha256": sha, "n_layers": 3, "n_ff": 1024, "bundle_bytes": bundle}));
    let e = load(edited).unwrap_err().to_string();
    assert!(e.contains("other.lstab") && e.contains("model.n_ff"), "{e}");
    // This model: loads, no warning.
    let own = table_for(serde_json::json!({"sha256": sha, "n_layers": 3, "n_ff": 512, "bundle_bytes": bundle}));
    let sp = load(own).unwrap();
    assert_eq!(
        leanstream_runtime::artifacts::check_controller(&sp.controller, &fm).unwrap(),
        None
    );
    // A table that names only a shape loads; a shape that is not this model's is warned about.
    let c = |t: ControlTable| Controller::Table {
        table: Arc::new(t),
        origin: "shape.lstab".into(),
    };
    let same = table_for(serde_json::json!({"n_layers": 3, "n_ff": 512, "bundle_bytes": bundle}));
    assert_eq!(
        leanstream_runtime::artifacts::check_controller(&c(same), &fm).unwrap(),
        None
    );
    let wider = table_for(serde_json::json!({"n_layers": 3, "n_ff": 1536, "bundle_bytes": bundle}));
    let w = leanstream_runtime::artifacts::check_controller(&c(wider), &fm)
        .unwrap()
        .unwrap();
    assert!(w.contains("shape.lstab") && w.contains("1536"), "{w}");
    // The built-in table was solved for SmolLM2's shape, not this one's.
    let built_in = leanstream_runtime::artifacts::built_in_controller().unwrap();
    assert!(leanstream_runtime::artifacts::check_controller(&built_in, &fm)
        .unwrap()
        .is_some());
    // A fixed action names no model.
    assert_eq!(
        leanstream_runtime::artifacts::check_controller(&fixed("fixed"), &fm).unwrap(),
        None
    );
}
