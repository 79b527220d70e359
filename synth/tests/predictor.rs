//! The activation predictors trained on a small real trace (SmolLM2 on
//! license text): training lowers the loss, the saved files score exactly
//! like the trained predictors, and on held-out text they beat chance and a
//! probe that masks nothing leaves perplexity untouched.

use leanstream_runtime::model::Model;
use leanstream_runtime::perplexity::perplexity;
use leanstream_runtime::predict::{ComputePath, Predictor};
use leanstream_synth::eval::{evaluate, EvalOptions};
use leanstream_synth::predictor::data::input_rows;
use leanstream_synth::predictor::{train, TrainOptions};

mod common;
use common::{record_trace, smollm2, tmp};

#[test]
fn smollm2_predictors_train_save_and_evaluate() {
    let Some(model) = smollm2() else {
        return;
    };
    let dir = tmp("predictor");
    let trace = record_trace(&model, &dir);
    let o = TrainOptions {
        epochs: 3,
        d: 16,
        stages: 2,
        ..TrainOptions::default()
    };
    let t = train(&trace, &o).unwrap();
    let n = t.losses.len() as f32;
    let before: f32 = t.losses.iter().map(|l| l.hashing_before).sum::<f32>() / n;
    let after: f32 = t.losses.iter().map(|l| l.hashing_after).sum::<f32>() / n;
    assert!(after < before - 0.002, "hashing loss {before} -> {after}");
    let first: f32 = t.losses.iter().map(|l| l.low_rank_epochs[0]).sum::<f32>() / n;
    let last: f32 = t.losses.iter().map(|l| *l.low_rank_epochs.last().unwrap()).sum::<f32>() / n;
    assert!(last < first - 0.002, "low-rank loss {first} -> {last}");
    // Same stored size, give or take one rank.
    let (hb, lb) = (t.hashing.weight_bytes() as f64, t.low_rank.weight_bytes() as f64);
    assert!(lb <= hb && lb > 0.9 * hb, "hashing {hb} B, low-rank {lb} B");

    // Saved and reloaded: the same scores, bit for bit, on held-out inputs.
    let mut files = Vec::new();
    for (name, p) in [("hashing", &t.hashing), ("low-rank", &t.low_rank)] {
        let path = dir.join(format!("{name}.lspred"));
        p.save(&path).unwrap();
        let back = Predictor::load(&path).unwrap();
        assert_eq!(&back, p, "{name} differs after reload");
        let (mut s1, mut s2) = (p.scratch(), back.scratch());
        let (mut o1, mut o2) = (vec![0.0; p.n_groups()], vec![0.0; p.n_groups()]);
        for layer in [0, 7, trace.n_layer() - 1] {
            for (u, x) in input_rows(&trace, "heldout", layer).unwrap().iter().enumerate() {
                for r in (0..x.rows).step_by(37) {
                    p.scores(u, layer, x.row(r), ComputePath::Simd, &mut s1, &mut o1)
                        .unwrap();
                    back.scores(u, layer, x.row(r), ComputePath::Scalar, &mut s2, &mut o2)
                        .unwrap();
                    assert_eq!(o1, o2, "{name} layer {layer} use {u} row {r}");
                }
            }
        }
        files.push((path, back));
    }

    let report = evaluate(
        &trace,
        &files,
        &EvalOptions {
            sparsities: vec![0.5],
            max_tokens: Some(256),
            ppl_chunks: 1,
            ctx: 128,
            shape_7b: false,
        },
    )
    .unwrap();
    // Chance recall of the top half is 0.5.
    for r in &report.recall {
        assert!(
            r.recall > 0.5 && r.recall <= 1.0,
            "{}: recall {}",
            r.predictor,
            r.recall
        );
        assert!(r.mass_recall >= r.recall, "{}: mass below count", r.predictor);
    }
    // The dense row runs through a probe that masks nothing: it must equal
    // the plain perplexity of the same text.
    let m = Model::load(&model).unwrap();
    let text = std::fs::read_to_string(&trace.split("heldout").unwrap().texts[0].path).unwrap();
    let plain = perplexity(&m, &text, 128, Some(1), false).unwrap();
    let dense = &report.perplexity[0];
    assert_eq!(dense.set, "dense");
    assert_eq!(dense.ppl, plain.ppl);
    // Keeping each token's largest half costs little; one static half for
    // every token costs much more.
    let set = |name: &str| report.perplexity.iter().find(|p| p.set.starts_with(name)).unwrap();
    let (oracle, fixed) = (set("oracle"), set("static"));
    assert!(oracle.ratio_to_dense < 1.5, "oracle ratio {}", oracle.ratio_to_dense);
    assert!(oracle.ppl < fixed.ppl, "oracle {} vs static {}", oracle.ppl, fixed.ppl);
    let _ = std::fs::remove_dir_all(&dir);
}
