//! Forward-pass behaviour on small synthetic models of each supported
//! llama-family variant: batch and incremental decoding agree, a sliding
//! window really hides old positions, q/k/v biases load, quantized weights
//! track their f32 originals.

use std::path::PathBuf;

use leanstream_kernels::GgmlType;
use leanstream_runtime::generate::ingest;
use leanstream_runtime::model::{Arch, Model};
use leanstream_runtime::synthetic::{SyntheticSpec, VOCAB};

fn write(name: &str, spec: &SyntheticSpec) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synthetic");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, spec.build().unwrap().to_bytes()).unwrap();
    path
}

/// Logits after feeding `tokens`, either as one batch or one token at a time.
fn last_logits(model: &Model, tokens: &[u32], batch: bool) -> Vec<f32> {
    let mut st = model.new_state(64, 64, 1);
    if batch {
        ingest(model, &mut st, tokens, 0).unwrap();
        model.logits(&mut st, 0, 1).unwrap().to_vec()
    } else {
        for (pos, &t) in tokens.iter().enumerate() {
            model.forward(&mut st, &[t], pos).unwrap();
        }
        model.logits(&mut st, 0, 1).unwrap().to_vec()
    }
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

const TOKENS: [u32; 12] = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108];

#[test]
fn every_variant_loads_tokenizes_and_agrees_batch_vs_incremental() {
    for arch in ["llama", "qwen2", "mistral"] {
        let mut spec = SyntheticSpec::tiny(arch);
        if arch == "mistral" {
            spec.sliding_window = Some(5);
        }
        let model = Model::load(write(&format!("{arch}.gguf"), &spec)).unwrap();
        assert_eq!(model.config.n_vocab, VOCAB);
        // BOS, then one byte token per byte (ids offset by the three specials).
        assert_eq!(
            model.tokenizer.encode("Hi", true, false),
            vec![1, 3 + b'H' as u32, 3 + b'i' as u32]
        );
        let batch = last_logits(&model, &TOKENS, true);
        let single = last_logits(&model, &TOKENS, false);
        assert!(batch.iter().all(|v| v.is_finite()), "{arch}: non-finite logits");
        // The two routes round attention sums in different orders, nothing more.
        let diff = max_rel_diff(&batch, &single);
        assert!(diff < 1e-3, "{arch}: batch and incremental logits differ by {diff}");
    }
}

#[test]
fn sliding_window_hides_positions_outside_it() {
    let mut spec = SyntheticSpec::tiny("mistral");
    spec.sliding_window = Some(3);
    let windowed = Model::load(write("window3.gguf", &spec)).unwrap();
    let full = Model::load(write("window-none.gguf", &SyntheticSpec::tiny("llama"))).unwrap();
    let mut changed = TOKENS;
    changed[1] = 200;
    // With two layers of window 3, position 1 reaches at most position 1 + 2 * 2 = 5.
    for (model, hidden) in [(&windowed, true), (&full, false)] {
        let a = last_logits(model, &TOKENS, false);
        let b = last_logits(model, &changed, false);
        if hidden {
            assert_eq!(a, b, "a token outside the window changed the output");
        } else {
            assert!(max_rel_diff(&a, &b) > 1e-4, "without a window every token must matter");
        }
    }
}

#[test]
fn qwen2_biases_are_loaded_and_rope_is_neox() {
    let model = Model::load(write("qwen2-bias.gguf", &SyntheticSpec::tiny("qwen2"))).unwrap();
    assert_eq!(model.config.arch, Arch::Qwen2);
    assert_eq!(model.config.rope_style, leanstream_kernels::ops::RopeStyle::Neox);
    let l = &model.weights.layers[0];
    assert!(l.bq.is_some() && l.bk.is_some() && l.bv.is_some());
    let llama = Model::load(write("llama-nobias.gguf", &SyntheticSpec::tiny("llama"))).unwrap();
    assert!(llama.weights.layers[0].bq.is_none());
}

#[test]
fn q8_0_weights_track_their_f32_originals() {
    let f32_model = Model::load(write("f32.gguf", &SyntheticSpec::tiny("llama"))).unwrap();
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    let q8_model = Model::load(write("q8.gguf", &spec)).unwrap();
    let a = last_logits(&f32_model, &TOKENS, true);
    let b = last_logits(&q8_model, &TOKENS, true);
    let diff = max_rel_diff(&a, &b);
    assert!(diff > 0.0 && diff < 0.05, "Q8_0 vs F32 logits differ by {diff}");
}
