//! Forward-pass behaviour on small synthetic models of each supported
//! llama-family variant: batch and incremental decoding agree, a sliding
//! window really hides old positions, q/k/v biases load, quantized weights
//! track their f32 originals.

use std::path::PathBuf;

use indicatif::ProgressBar;
use leanstream_kernels::GgmlType;
use leanstream_runtime::generate::ingest;
use leanstream_runtime::gguf::GgufFile;
use leanstream_runtime::model::{Arch, FlashAttn, Model};
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

#[test]
fn q4_0_weights_track_their_f32_originals() {
    let f32_model = Model::load(write("f32-for-q4.gguf", &SyntheticSpec::tiny("llama"))).unwrap();
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q4_0;
    let q4_model = Model::load(write("q4.gguf", &spec)).unwrap();
    let a = last_logits(&f32_model, &TOKENS, true);
    let b = last_logits(&q4_model, &TOKENS, true);
    let diff = max_rel_diff(&a, &b);
    assert!(diff > 0.0 && diff < 0.5, "Q4_0 vs F32 logits differ by {diff}");
}

#[test]
fn named_shapes_have_the_published_parameter_counts() {
    // Parameter counts of the published checkpoints (embeddings, output,
    // norms and biases included).
    for (name, params, tensors) in [
        ("mistral-7b", 7_241_732_096u64, 3 + 32 * 9),
        ("llama2-7b", 6_738_415_616, 3 + 32 * 9),
        ("qwen2.5-7b", 7_615_616_512, 3 + 28 * 12),
    ] {
        let descs = SyntheticSpec::shape(name).unwrap().tensor_descs().unwrap();
        let n: u64 = descs.iter().map(|d| d.dims.iter().product::<u64>()).sum();
        assert_eq!((n, descs.len()), (params, tensors), "{name}");
    }
    assert!(SyntheticSpec::shape("gpt-5").is_err());
}

#[test]
fn streamed_and_in_memory_writers_give_the_same_bytes() {
    for arch in ["llama", "qwen2", "mistral"] {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
            let mut spec = SyntheticSpec::tiny(arch);
            spec.weight_type = ty;
            spec.sliding_window = (arch == "mistral").then_some(4);
            let streamed = spec.write_to(Vec::new(), &ProgressBar::hidden()).unwrap();
            assert_eq!(streamed, spec.build().unwrap().to_bytes(), "{arch} {ty}");
        }
    }
}

/// A named shape, shrunk, written to disk by the streaming writer.
fn small_shape(name: &str) -> SyntheticSpec {
    let mut spec = SyntheticSpec::shape(name).unwrap();
    spec.n_layer = 1;
    spec.n_embd = 128;
    spec.n_ff = 256;
    spec.n_head = 4;
    spec.n_head_kv = 2;
    spec.n_vocab = 1000;
    spec
}

#[test]
fn streamed_shapes_load_and_run() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synthetic");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, arch) in [("mistral-7b", Arch::Llama), ("qwen2.5-7b", Arch::Qwen2)] {
        let spec = small_shape(name);
        let path = dir.join(format!("{name}-small.gguf"));
        let report = spec.write_file(&path, false).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(report.bytes, bytes.len() as u64);
        assert!(!dir.join(format!("{name}-small.gguf.tmp")).exists());
        assert_eq!(bytes, spec.build().unwrap().to_bytes(), "{name}");

        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), Some(spec.arch.as_str()));
        let model = Model::load(&path).unwrap();
        assert_eq!(model.config.arch, arch);
        assert_eq!(model.config.n_vocab, 1000);
        assert_eq!(model.config.rope_base, spec.rope_base);
        assert_eq!(model.config.sliding_window, None);
        // Filler pieces never match: text still encodes byte by byte.
        assert_eq!(
            model.tokenizer.encode("Hi", true, false),
            vec![1, 3 + b'H' as u32, 3 + b'i' as u32]
        );
        let logits = last_logits(&model, &TOKENS, true);
        assert_eq!(logits.len(), 1000);
        assert!(logits.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
    }
}

/// Both attention paths (llama.cpp's standard one and flash attention, by
/// its vector route for one token and its tiled route for 64+) agree to
/// rounding on every variant, the sliding window included.
#[test]
fn flash_and_standard_attention_agree_to_rounding() {
    let tokens: Vec<u32> = (0..100u32).map(|i| 3 + (i * 37 + 11) % 250).collect();
    for arch in ["llama", "qwen2", "mistral"] {
        let mut spec = SyntheticSpec::tiny(arch);
        if arch == "mistral" {
            spec.sliding_window = Some(40);
        }
        let mut model = Model::load(write(&format!("{arch}-fa.gguf"), &spec)).unwrap();
        let mut runs = Vec::new();
        for fa in [FlashAttn::Off, FlashAttn::On] {
            model.flash_attn = fa;
            let mut st = model.new_state(128, 128, 1);
            assert_eq!(st.flash_attn(), fa.enabled());
            ingest(&model, &mut st, &tokens, 0).unwrap();
            let prompt = model.logits(&mut st, 0, 1).unwrap().to_vec();
            model.forward(&mut st, &[7], tokens.len()).unwrap();
            let next = model.logits(&mut st, 0, 1).unwrap().to_vec();
            runs.push((prompt, next));
        }
        let (off, on) = (&runs[0], &runs[1]);
        assert!(off.0 != on.0, "{arch}: the two paths should round differently");
        for (what, a, b) in [("prompt", &off.0, &on.0), ("decode", &off.1, &on.1)] {
            let d = max_rel_diff(a, b);
            assert!(d < 1e-2, "{arch} {what}: flash and standard attention {d} apart");
        }
    }
}

/// A saved KV prefix resumes a sequence with the same bits in either cache
/// layout (value rows for flash attention, transposed values otherwise), and
/// a prefix saved in one layout is refused by a state of the other.
#[test]
fn saved_prefixes_resume_exactly_in_both_cache_layouts() {
    let mut model = Model::load(write("llama-prefix.gguf", &SyntheticSpec::tiny("llama"))).unwrap();
    let mut saved = Vec::new();
    for fa in [FlashAttn::Off, FlashAttn::On] {
        model.flash_attn = fa;
        let whole = last_logits(&model, &TOKENS, true);
        let mut first = model.new_state(64, 64, 1);
        ingest(&model, &mut first, &TOKENS[..7], 0).unwrap();
        let prefix = first.kv.save_prefix(7).unwrap();
        let mut resumed = model.new_state(64, 64, 1);
        resumed.kv.restore_prefix(&prefix).unwrap();
        ingest(&model, &mut resumed, &TOKENS[7..], 7).unwrap();
        let logits = model.logits(&mut resumed, 0, 1).unwrap();
        assert_eq!(logits, &whole[..], "{fa}: resumed from a saved prefix");
        saved.push(prefix);
    }
    model.flash_attn = FlashAttn::On;
    let mut st = model.new_state(64, 64, 1);
    let err = st.kv.restore_prefix(&saved[0]).unwrap_err().to_string();
    assert!(err.contains("transposed values"), "{err}");
}
