//! Flash placement learned from recorded activation traces: it is a
//! permutation per layer, training lowers the co-activation loss, and the
//! placement packs into an `.lsflash` that still runs the same tokens.

use std::path::Path;

use leanstream_profiler::activations::read::Trace;
use leanstream_runtime::cache::FfnBudget;
use leanstream_runtime::engine::{FlashModel, Policy};
use leanstream_runtime::flash::io::IoConfig;
use leanstream_runtime::flash::pack::load_placement;
use leanstream_runtime::flash::runs::{max_run_bytes, RunRule};
use leanstream_runtime::flash::{pack, DownType, LsFlash, PackOptions};
use leanstream_runtime::generate::argmax;
use leanstream_runtime::model::Model;
use leanstream_runtime::synthetic::SyntheticSpec;
use leanstream_synth::placement::{self, PlacementOptions, ReadSettings};

mod common;
use common::{record_trace, smollm2, tmp};

fn options() -> PlacementOptions {
    PlacementOptions {
        epochs: 4,
        refine_tokens: 512,
        ..PlacementOptions::default()
    }
}

fn is_permutation(order: &[u32], n: usize) -> bool {
    let mut s = order.to_vec();
    s.sort_unstable();
    s.len() == n && s.iter().enumerate().all(|(i, &v)| v as usize == i)
}

/// Learned placement on `trace`: permutations, falling loss, deterministic.
fn check_learned(trace: &Trace) -> placement::Placement {
    let o = options();
    let p = placement::learn(trace, &o).unwrap();
    let n = trace.n_ff();
    assert_eq!(p.layers.len(), trace.n_layer());
    for (l, order) in p.layers.iter().enumerate() {
        assert!(is_permutation(order, n), "layer {l} is not a permutation of 0..{n}");
    }
    let mut fell = 0;
    for (l, s) in p.stats.iter().enumerate() {
        assert_eq!(s.loss.len(), o.epochs + 1);
        let (first, last) = (s.loss[0], *s.loss.last().unwrap());
        eprintln!(
            "layer {l}: loss {first:.4} -> {last:.4}; cost freq {} chain {} final {}",
            s.frequency_cost, s.chain_cost, s.final_cost
        );
        assert!(last.is_finite());
        fell += usize::from(last < first - 1e-3);
        // 2-opt only ever shortens the chain.
        assert!(s.final_cost <= s.chain_cost);
    }
    assert!(
        fell * 10 >= p.stats.len() * 9,
        "the loss fell in only {fell} of {} layers",
        p.stats.len()
    );
    assert_eq!(
        placement::learn(trace, &o).unwrap().layers,
        p.layers,
        "not deterministic for a seed"
    );
    p
}

/// Packs `model` with the learned placement, checks the header holds it and
/// that the flash engine's dense run gives the GGUF model's greedy tokens.
fn check_pack(model: &Path, p: &placement::Placement, dir: &Path, prompt: &[u32], n: usize) {
    let json = dir.join("placement.json");
    p.save(&json).unwrap();
    let loaded = load_placement(&json).unwrap();
    assert_eq!(loaded, p.layers);
    let out = dir.join("model.lsflash");
    pack(
        model,
        &out,
        &PackOptions {
            down: DownType::Source,
            placement: Some(loaded),
            ..PackOptions::default()
        },
    )
    .unwrap();
    let f = LsFlash::open(&out).unwrap();
    assert_eq!(f.header().placement, p.layers);
    // The bytes really sit in the learned order: position k of the placed
    // file holds what position i (= its neuron) holds in an identity file.
    let plain = dir.join("identity.lsflash");
    pack(
        model,
        &plain,
        &PackOptions {
            down: DownType::Source,
            ..PackOptions::default()
        },
    )
    .unwrap();
    let g = LsFlash::open(&plain).unwrap();
    let raw = |file: &LsFlash, path: &Path, l: usize, k: usize| {
        use std::os::unix::fs::FileExt;
        let bb = file.layout(l).bundle_bytes();
        let mut b = vec![0u8; bb];
        std::fs::File::open(path)
            .unwrap()
            .read_exact_at(&mut b, file.layer_extent(l).0 + (k * bb) as u64)
            .unwrap();
        b
    };
    for (l, order) in p.layers.iter().enumerate() {
        for (k, &i) in order.iter().enumerate().step_by(7) {
            assert_eq!(
                raw(&f, &out, l, k),
                raw(&g, &plain, l, i as usize),
                "layer {l} position {k}"
            );
        }
    }

    let fm = FlashModel::open(&out).unwrap();
    let mut engine = fm.engine(Policy::DenseStream, FfnBudget::Percent(0.0)).unwrap();
    let mut st = fm.model.new_state(prompt.len() + n + 1, 8, 1);
    let mut flash = Vec::new();
    fm.forward(&mut st, &mut engine, prompt, 0, prompt.len() - 1..prompt.len())
        .unwrap();
    for pos in prompt.len()..prompt.len() + n {
        let tok = argmax(fm.model.logits(&mut st, 0, 1).unwrap());
        flash.push(tok);
        fm.forward(&mut st, &mut engine, &[tok], pos, 0..1).unwrap();
    }

    let m = Model::load(model).unwrap();
    let mut st = m.new_state(prompt.len() + n + 1, 8, 1);
    let mut gguf = Vec::new();
    m.forward_outputs(&mut st, prompt, 0, prompt.len() - 1..prompt.len())
        .unwrap();
    for pos in prompt.len()..prompt.len() + n {
        let tok = argmax(m.logits(&mut st, 0, 1).unwrap());
        gguf.push(tok);
        m.forward(&mut st, &[tok], pos).unwrap();
    }
    eprintln!("flash {flash:?}\ngguf  {gguf:?}");
    // Source down tiles keep the model's arithmetic: the same tokens exactly.
    assert_eq!(flash, gguf, "a placed file must run the model's own tokens");
}

/// `real`: a trained model, whose co-activations a placement can exploit.
fn check_evaluate(trace: &Trace, p: &placement::Placement, model: &Path, real: bool) {
    let mut orders = placement::baseline_orders(trace).unwrap();
    orders.push(("learned", p.layers.clone()));
    let s = ReadSettings {
        sparsity: 0.5,
        bundle_bytes: placement::bundle_bytes(model, DownType::Q8_0).unwrap(),
        merge_gaps: vec![0, 4096, 65536],
        max_run_bytes: max_run_bytes(&IoConfig::default()),
    };
    let rows = placement::evaluate(trace, "heldout", &orders, &s, false).unwrap();
    assert_eq!(rows.len(), 9);
    for r in &rows {
        eprintln!("{r:?}");
        // Every order needs the same bundles; merging only adds bytes and removes reads.
        assert_eq!(r.bytes_needed_per_token, rows[0].bytes_needed_per_token);
        assert!(r.read_amplification >= 1.0 && r.reads_per_token > 0.0);
    }
    for k in 0..3 {
        let g = &rows[3 * k..3 * k + 3];
        assert_eq!(g[0].read_amplification, 1.0, "gap 0 reads only needed bundles");
        assert!(g[0].reads_per_token >= g[1].reads_per_token && g[1].reads_per_token >= g[2].reads_per_token);
    }
    if real {
        // Held-out, without merging: the learned order needs fewer reads than
        // the identity order (rows: identity, frequency, learned; 3 gaps each).
        let (identity, learned) = (&rows[0], &rows[6]);
        assert!(identity.order == "identity" && learned.order == "learned");
        assert!(
            learned.reads_per_token < identity.reads_per_token,
            "learned {} reads/token against identity {}",
            learned.reads_per_token,
            identity.reads_per_token
        );
    }
    // A placement that is not a permutation is an error, not a panic.
    let mut bad = p.layers.clone();
    bad[0][0] = bad[0][1];
    assert!(placement::evaluate(trace, "heldout", &[("bad", bad)], &s, false).is_err());
}

#[test]
fn run_rule_merges_like_the_streamer() {
    // Bundles of 100 bytes, gaps up to 200 bytes (2 bundles), runs up to 5 bundles.
    let rule = RunRule::new(100, 500, 200);
    let mut runs = Vec::new();
    for p in [0, 1, 4, 5, 6, 9, 10, 20] {
        rule.push(&mut runs, p);
    }
    assert_eq!(runs, vec![(0, 5), (5, 5), (10, 1), (20, 1)]);
    let rule = RunRule::new(100, 0, 0);
    let mut runs = Vec::new();
    for p in [0, 1, 2] {
        rule.push(&mut runs, p);
    }
    assert_eq!(
        runs,
        vec![(0, 1), (1, 1), (2, 1)],
        "a run always holds at least one bundle"
    );
}

#[test]
fn synthetic_model_placement_learns_packs_and_runs() {
    let dir = tmp("synthetic");
    let mut spec = SyntheticSpec::tiny("llama");
    spec.n_ff = 256;
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, spec.build().unwrap().to_bytes()).unwrap();
    let trace = record_trace(&model, &dir);
    let p = check_learned(&trace);
    check_evaluate(&trace, &p, &model, false);
    check_pack(&model, &p, &dir, &[1, 20, 33, 47, 5], 8);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn smollm2_placement_learns_packs_and_runs() {
    let Some(model) = smollm2() else {
        return;
    };
    let dir = tmp("smollm2");
    let trace = record_trace(&model, &dir);
    let p = check_learned(&trace);
    check_evaluate(&trace, &p, &model, true);
    let fm = Model::load(&model).unwrap();
    let prompt = fm.tokenizer.encode("The capital of France is", true, false);
    check_pack(&model, &p, &dir, &prompt, 8);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_settings_are_errors() {
    let dir = tmp("bad");
    let spec = SyntheticSpec::tiny("llama");
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, spec.build().unwrap().to_bytes()).unwrap();
    let trace = record_trace(&model, &dir);
    let o = |f: fn(&mut PlacementOptions)| {
        let mut o = options();
        f(&mut o);
        o
    };
    assert!(placement::learn(&trace, &o(|o| o.sparsity = 0.6)).is_err());
    assert!(placement::learn(&trace, &o(|o| o.dim = 0)).is_err());
    assert!(placement::learn(&trace, &o(|o| o.learning_rate = f32::NAN)).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
