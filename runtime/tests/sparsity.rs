//! Activation-sparsity calibration and thresholding on a synthetic model:
//! calibrated thresholds skip close to the target fraction on the text they
//! came from, a zero sparsity changes nothing, and skipping changes outputs.

use std::path::PathBuf;

use leanstream_runtime::model::Model;
use leanstream_runtime::perplexity::{perplexity, perplexity_with};
use leanstream_runtime::sparsity::{calibrate, calibrate_run, CalibrationRun, Sparsifier};
use leanstream_runtime::synthetic::SyntheticSpec;

/// Each test writes its own file: tests run in parallel.
fn model(name: &str) -> Model {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sparsity");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    Model::load(&path).unwrap()
}

fn text() -> String {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/text/apache-2.0.txt");
    std::fs::read_to_string(p).unwrap()[..3000].to_string()
}

/// A token limit runs the first tokens of the text only: the same windows
/// as calibrating on those tokens alone.
#[test]
fn calibration_stops_at_its_token_limit() {
    let model = model("calibrate_limit.gguf");
    let text = text();
    let run = CalibrationRun {
        ctx: 64,
        max_tokens: Some(200),
        progress: false,
    };
    let limited = calibrate_run(&model, &text, run, &[0.5]).unwrap();
    assert_eq!(limited.tokens, 200);
    let tokens = model.tokenizer.encode(&text, true, false);
    let windows: Vec<&[u32]> = tokens[..200].chunks(64).collect();
    let same = leanstream_runtime::sparsity::calibrate_windows(&model, &windows, &[0.5], false).unwrap();
    assert_eq!(limited.levels, same.levels);
    assert_eq!(limited.neuron_scores, same.neuron_scores);
    let all = calibrate(&model, &text, 64, &[0.5]).unwrap();
    assert!(all.tokens > 1000);
    assert_ne!(all.neuron_scores, limited.neuron_scores);
}

#[test]
fn calibrated_thresholds_hit_their_target_on_the_calibration_text() {
    let model = model("calibrate.gguf");
    let text = text();
    let c = calibrate(&model, &text, 64, &[0.0, 0.5, 0.8]).unwrap();
    let (levels, tokens) = (c.levels, c.tokens);
    assert!(tokens > 1000);
    // One mean |activation| per neuron, positive where the layer is used.
    assert_eq!(c.neuron_scores.len(), model.config.n_layer);
    assert!(c
        .neuron_scores
        .iter()
        .all(|r| r.len() == model.config.n_ff && r.iter().all(|v| v.is_finite() && *v >= 0.0)));
    assert!(c.neuron_scores.iter().all(|r| r.iter().any(|&v| v > 0.0)));
    assert!(levels[0].full.iter().all(|&t| t == 0.0));
    for level in &levels[1..] {
        // Thresholds rise with the target, layer by layer.
        assert!(level.full.iter().all(|&t| t > 0.0));
        let mut hook = Sparsifier::new(level.full.clone());
        perplexity_with(&model, &text, 64, None, false, &mut hook).unwrap();
        let skipped = hook.skipped_fraction().unwrap();
        // Histogram bins are ~1% wide and perplexity scores its own windows of the text.
        assert!(
            (skipped - level.sparsity as f64).abs() < 0.05,
            "target {} skipped {skipped}",
            level.sparsity
        );
    }
    assert!(levels[1].full.iter().zip(&levels[2].full).all(|(a, b)| a <= b));
}

#[test]
fn zero_thresholds_change_nothing_and_real_ones_do() {
    let model = model("zero.gguf");
    let text = text();
    let dense = perplexity(&model, &text, 64, None, false).unwrap();
    let zero = perplexity_with(&model, &text, 64, None, false, &mut Sparsifier::new(vec![0.0; 2])).unwrap();
    assert_eq!(dense.ppl.to_bits(), zero.ppl.to_bits());
    let levels = calibrate(&model, &text, 64, &[0.8]).unwrap().levels;
    let sparse = perplexity_with(
        &model,
        &text,
        64,
        None,
        false,
        &mut Sparsifier::new(levels[0].full.clone()),
    )
    .unwrap();
    assert_ne!(dense.ppl.to_bits(), sparse.ppl.to_bits());
    // The ratio's standard error comes from the chunks: one mean NLL each,
    // whose mean is the log perplexity (every chunk scores as many tokens).
    assert_eq!(sparse.chunk_nll.len(), sparse.chunks);
    let mean = sparse.chunk_nll.iter().sum::<f64>() / sparse.chunks as f64;
    assert!(
        (mean.exp() / sparse.ppl - 1.0).abs() < 1e-9,
        "{mean} against {}",
        sparse.ppl
    );
    let r = sparse.ratio_to(&dense);
    assert_eq!(r.ratio, sparse.ppl / dense.ppl);
    assert!(r.stderr > 0.0 && r.stderr.is_finite(), "{r:?}");
    assert_eq!(zero.ratio_to(&dense).stderr, 0.0);
}

/// Perplexity through a decoder (how a device engine is measured): the
/// chunk's first half at once, then a token at a time. It scores the same
/// positions as the batched pass, and the same model gives the same numbers.
#[test]
fn perplexity_through_a_decoder_scores_what_the_batched_pass_scores() {
    use leanstream_runtime::generate::CpuDecoder;
    use leanstream_runtime::model::DenseFfn;
    use leanstream_runtime::perplexity::perplexity_decoding;
    let model = model("decoding.gguf");
    let text = text();
    let batched = perplexity(&model, &text, 64, Some(4), false).unwrap();
    let mut st = model.new_state(64, 64, 1);
    let mut decoder = CpuDecoder {
        model: &model,
        st: &mut st,
        hook: &mut DenseFfn,
    };
    let decoded = perplexity_decoding(&model, &text, 64, Some(4), false, &mut decoder).unwrap();
    assert_eq!(
        (decoded.chunks, decoded.tokens_scored),
        (batched.chunks, batched.tokens_scored)
    );
    assert_eq!(decoded.tokens_scored, 4 * 31);
    assert!(
        (decoded.ppl / batched.ppl - 1.0).abs() < 1e-4,
        "{} against {}",
        decoded.ppl,
        batched.ppl
    );
    assert!(decoded.top1_agreement(&batched).unwrap() > 0.95);
    // A decoder with less context than the chunks is refused.
    let mut small = model.new_state(32, 32, 1);
    let mut decoder = CpuDecoder {
        model: &model,
        st: &mut small,
        hook: &mut DenseFfn,
    };
    let err = perplexity_decoding(&model, &text, 64, Some(1), false, &mut decoder).unwrap_err();
    assert!(err.to_string().contains("decoder of 32"), "{err}");
}

/// Calibration sees every token at every layer: the last layer, whose FFN
/// a forward pass runs on its output rows alone, too. Each neuron's score
/// is its mean |act(g)·u| over all of them.
#[test]
fn calibration_scores_every_token_at_the_last_layer() {
    use leanstream_runtime::model::{LayerAt, LayerHook};
    struct MeanAbs {
        layer: usize,
        sums: Vec<f64>,
        rows: usize,
    }
    impl LayerHook for MeanAbs {
        fn activations(&mut self, at: &LayerAt, acts: &mut [f32]) {
            if at.layer == self.layer {
                for row in acts.chunks_exact(self.sums.len()) {
                    for (s, &a) in self.sums.iter_mut().zip(row) {
                        *s += f64::from(a.abs());
                    }
                    self.rows += 1;
                }
            }
        }
    }
    let model = model("calibrate_last_layer.gguf");
    let text = text();
    let tokens = model.tokenizer.encode(&text, true, false);
    let windows: Vec<&[u32]> = tokens[..256].chunks(64).collect();
    let cal = leanstream_runtime::sparsity::calibrate_windows(&model, &windows, &[0.5], false).unwrap();
    let last = model.config.n_layer - 1;
    let mut hook = MeanAbs {
        layer: last,
        sums: vec![0.0; model.config.n_ff],
        rows: 0,
    };
    let mut st = model.new_state(64, 64, 1);
    for w in &windows {
        model.forward_with(&mut st, w, 0, 0..w.len(), &mut hook).unwrap();
    }
    assert_eq!(hook.rows, 256);
    for (i, (&score, &sum)) in cal.neuron_scores[last].iter().zip(&hook.sums).enumerate() {
        let want = (sum / 256.0) as f32;
        assert!(
            (score - want).abs() <= 1e-6 * want.abs().max(1e-3),
            "neuron {i}: {score} against {want}"
        );
    }
}
