//! The dense engine against llama.cpp's recorded outputs (data/golden/, made
//! by scripts/golden/make_goldens.sh): prompt token ids, logits after the
//! prompt, greedy 32-token continuations, and perplexity at ctx 256, with
//! flash attention off (the files without a suffix) and on (`-fa-on`,
//! llama.cpp's default on a CPU). The goldens come from an AMD EPYC with
//! AVX-512 (no AVX512-FP16); elsewhere the stated tolerances apply. On
//! aarch64 the `aarch64` tests compare with llama.cpp built for aarch64
//! (data/golden/aarch64/).

mod common;

use leanstream_runtime::generate::{argmax, generate, ingest, Sampler, SamplerConfig};
use leanstream_runtime::model::{FlashAttn, Model};
use leanstream_runtime::perplexity::perplexity;
use serde_json::Value;

fn golden_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/golden")
        .join(name)
}

/// The golden file `stem` + suffix + `ext` recorded with attention path `fa`.
fn golden_for(stem: &str, fa: FlashAttn, ext: &str) -> std::path::PathBuf {
    let suffix = if fa.enabled() { "-fa-on" } else { "" };
    golden_path(&format!("{stem}{suffix}{ext}"))
}

fn load(path: &std::path::Path, fa: FlashAttn) -> Model {
    let mut model = Model::load(path).unwrap();
    model.flash_attn = fa;
    model
}

fn cases(goldens: Goldens, model: &str, fa: FlashAttn) -> Vec<Value> {
    let stem = format!("{}generate-{model}", goldens.dir);
    let text = std::fs::read_to_string(golden_for(&stem, fa, ".jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A set of goldens: where they lie under data/golden/ and whether this
/// machine's kernels follow the arithmetic and order of the llama.cpp build
/// that recorded them.
#[derive(Clone, Copy)]
struct Goldens {
    dir: &'static str,
    exact: bool,
}

/// llama.cpp built for x86-64 (AVX2 kernels): exact where ours are AVX2 too.
fn x86_goldens() -> Goldens {
    Goldens {
        dir: "",
        exact: leanstream_kernels::dot::has_avx2(),
    }
}

impl Goldens {
    /// Largest logit difference we accept between us and llama.cpp. With
    /// exact kernels every operation follows llama.cpp's arithmetic and
    /// order, so logits agree to the precision the goldens were printed
    /// with; otherwise some dot products are summed in another order.
    fn logit_tol(self) -> f32 {
        if self.exact {
            1e-5
        } else {
            0.5
        }
    }
}

/// A greedy step is a near-tie when llama.cpp's best two logits are closer than this.
const NEAR_TIE: f32 = 0.25;

/// Runs `f` on 2 threads, as the goldens were recorded: a single query over
/// 512 or more cells has its cells split across threads in flash attention.
fn on_two_threads<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
        .install(f)
}

/// `set` is "" (short prompts, context 512) or "-long" (a 1235-token prompt
/// in a context of 2048, past the size of Gemma 3's sliding-window cache).
fn check_model(name: &str, set: &str, fa: FlashAttn) {
    check_model_against(x86_goldens(), name, set, fa)
}

fn check_model_against(goldens: Goldens, name: &str, set: &str, fa: FlashAttn) {
    on_two_threads(|| check_model_here(goldens, name, set, fa))
}

fn check_model_here(goldens: Goldens, name: &str, set: &str, fa: FlashAttn) {
    let Some(path) = common::model_path(name) else { return };
    let model = load(&path, fa);
    let mut diverged = Vec::new();
    let mut worst_prompt = 0.0f32;
    let mut worst_decode = 0.0f32;
    for case in cases(goldens, &format!("{name}{set}"), fa) {
        let ctx = case["ctx"].as_u64().unwrap() as usize;
        let prompt = case["prompt"].as_str().unwrap();
        let want_prompt = ids(&case["prompt_ids"]);
        let got_prompt = model.tokenizer.encode(prompt, true, true);
        assert_eq!(got_prompt, want_prompt, "{name}: prompt ids for {prompt:?}");

        // Logits after the prompt: llama.cpp's top 20 and the first 32 ids.
        let mut st = model.new_state(ctx, 512, 1);
        ingest(&model, &mut st, &got_prompt, 0).unwrap();
        let logits = model.logits(&mut st, 0, 1).unwrap().to_vec();
        let mut this_prompt = 0.0f32;
        for (id, want) in case["first_logits"].as_array().unwrap().iter().enumerate() {
            this_prompt = this_prompt.max((logits[id] - want.as_f64().unwrap() as f32).abs());
        }
        for pair in case["top_logits"].as_array().unwrap() {
            let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
            this_prompt = this_prompt.max((logits[id] - want).abs());
        }
        eprintln!(
            "{name}: {} prompt tokens, logits within {this_prompt} of llama.cpp",
            got_prompt.len()
        );
        worst_prompt = worst_prompt.max(this_prompt);

        // Greedy decoding, fed llama.cpp's own tokens so every step is compared
        // on the same history; the first step where our choice differs is a divergence.
        let want_gen = ids(&case["greedy_ids"]);
        let steps = case["step_top2"].as_array().unwrap();
        let mut first_diff = None;
        for (i, step) in steps.iter().enumerate() {
            let pos = got_prompt.len() + i;
            let logits = if i == 0 {
                model.logits(&mut st, 0, 1).unwrap()
            } else {
                model.forward(&mut st, &[want_gen[i - 1]], pos - 1).unwrap();
                model.logits(&mut st, 0, 1).unwrap()
            };
            let top = |k: usize| {
                (
                    step[k][0].as_u64().unwrap() as usize,
                    step[k][1].as_f64().unwrap() as f32,
                )
            };
            let ((id1, l1), (id2, l2)) = (top(0), top(1));
            worst_decode = worst_decode.max((logits[id1] - l1).abs()).max((logits[id2] - l2).abs());
            let ours = argmax(logits) as usize;
            if ours != id1 && first_diff.is_none() {
                first_diff = Some((i, l1 - l2, logits[ours] - logits[id1]));
            }
            if i >= want_gen.len() {
                break; // llama.cpp stopped on end-of-generation here
            }
        }
        if let Some((at, their_gap, our_gap)) = first_diff {
            eprintln!("{name}: {prompt:?} diverges at step {at}: llama.cpp margin {their_gap}, ours {our_gap}");
            diverged.push((prompt.to_string(), at, their_gap));
        }
    }
    eprintln!("{name}: worst logit difference {worst_prompt} after prompts, {worst_decode} while decoding");
    assert!(
        worst_prompt <= goldens.logit_tol(),
        "{name}: prompt logits differ by {worst_prompt}"
    );
    assert!(
        worst_decode <= goldens.logit_tol(),
        "{name}: decode logits differ by {worst_decode}"
    );
    // The issue allows one prompt to diverge after a near-tie; with exact kernels none may.
    let allowed = if goldens.exact { 0 } else { 1 };
    assert!(
        diverged.len() <= allowed,
        "{name}: {} prompts diverged from llama.cpp: {diverged:?}",
        diverged.len()
    );
    for (prompt, at, gap) in diverged {
        assert!(
            gap <= NEAR_TIE,
            "{name}: {prompt:?} diverged at step {at} where llama.cpp's margin was {gap}"
        );
    }
}

/// Free-running generation must reproduce the recorded continuation of at least one prompt exactly.
fn check_free_running(name: &str, fa: FlashAttn) {
    let Some(path) = common::model_path(name) else { return };
    let model = load(&path, fa);
    let mut exact = 0;
    let all = cases(x86_goldens(), name, fa);
    for case in &all {
        let prompt = model.tokenizer.encode(case["prompt"].as_str().unwrap(), true, true);
        let mut st = model.new_state(case["ctx"].as_u64().unwrap() as usize, 512, 1);
        let mut sampler = Sampler::new(
            SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            },
            model.config.n_vocab,
        );
        let mut got = Vec::new();
        generate(&model, &mut st, &prompt, 32, &mut sampler, |t| {
            got.push(t);
            Ok(())
        })
        .unwrap();
        exact += usize::from(got == ids(&case["greedy_ids"]));
    }
    eprintln!(
        "{name}: {exact} of {} free-running continuations identical to llama.cpp",
        all.len()
    );
    let allowed = if x86_goldens().exact { 0 } else { 1 };
    assert!(
        exact + allowed >= all.len(),
        "{name}: only {exact} of {} continuations identical",
        all.len()
    );
}

/// `set` is "" (ctx 256 on the GPL excerpt, every chunk) or "-ctx2048"
/// (the first two chunks of 2048 tokens of the whole GPL).
fn check_perplexity(name: &str, set: &str, fa: FlashAttn) {
    let Some(path) = common::model_path(name) else { return };
    let file = golden_for(&format!("perplexity-{name}{set}"), fa, ".json");
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    assert_eq!(
        golden["flash_attn"].as_str(),
        Some(if fa.enabled() { "on" } else { "off" })
    );
    let text_file = golden["file"].as_str().unwrap().trim_start_matches("data/");
    let text = std::fs::read_to_string(golden_path("..").join(text_file)).unwrap();
    let model = load(&path, fa);
    let ctx = golden["ctx"].as_u64().unwrap() as usize;
    let chunks = (set == "-ctx2048").then(|| golden["chunks"].as_u64().unwrap() as usize);
    let p = on_two_threads(|| perplexity(&model, &text, ctx, chunks, false).unwrap());
    let want = golden["ppl"].as_f64().unwrap();
    assert_eq!(
        p.chunks as u64,
        golden["chunks"].as_u64().unwrap(),
        "{name}: chunk count"
    );
    let rel = (p.ppl - want).abs() / want;
    eprintln!(
        "{name}{set} (flash attention {fa}): perplexity ours {:.6} llama.cpp {want:.4} ({:.5}% apart)",
        p.ppl,
        rel * 100.0
    );
    if x86_goldens().exact {
        // Equal to the digits llama.cpp prints.
        assert_eq!(format!("{:.4}", p.ppl), format!("{want:.4}"), "{name}{set}: perplexity");
    } else {
        assert!(rel < 0.01, "{name}{set}: perplexity {} vs llama.cpp {want}", p.ppl);
    }
}

#[test]
fn smollm2_matches_llama_cpp_ids_logits_and_greedy_text() {
    check_model("smollm2", "", FlashAttn::Off);
}

#[test]
fn smollm2_long_context_matches_llama_cpp() {
    check_model("smollm2", "-long", FlashAttn::Off);
}

#[test]
fn smollm2_free_running_greedy_matches_llama_cpp() {
    check_free_running("smollm2", FlashAttn::Off);
}

#[test]
fn smollm2_perplexity_matches_llama_cpp() {
    check_perplexity("smollm2", "", FlashAttn::Off);
}

#[test]
fn smollm2_perplexity_at_ctx_2048_matches_llama_cpp() {
    check_perplexity("smollm2", "-ctx2048", FlashAttn::Off);
}

#[test]
fn gemma3_matches_llama_cpp_ids_logits_and_greedy_text() {
    check_model("gemma3", "", FlashAttn::Off);
}

#[test]
fn gemma3_long_context_matches_llama_cpp() {
    check_model("gemma3", "-long", FlashAttn::Off);
}

#[test]
fn gemma3_free_running_greedy_matches_llama_cpp() {
    check_free_running("gemma3", FlashAttn::Off);
}

#[test]
fn gemma3_perplexity_matches_llama_cpp() {
    check_perplexity("gemma3", "", FlashAttn::Off);
}

#[test]
fn gemma3_perplexity_at_ctx_2048_matches_llama_cpp() {
    check_perplexity("gemma3", "-ctx2048", FlashAttn::Off);
}

#[test]
fn smollm2_flash_attention_matches_llama_cpp_ids_logits_and_greedy_text() {
    check_model("smollm2", "", FlashAttn::On);
}

#[test]
fn smollm2_flash_attention_long_context_matches_llama_cpp() {
    check_model("smollm2", "-long", FlashAttn::On);
}

#[test]
fn smollm2_flash_attention_free_running_greedy_matches_llama_cpp() {
    check_free_running("smollm2", FlashAttn::Auto);
}

#[test]
fn smollm2_flash_attention_perplexity_matches_llama_cpp() {
    check_perplexity("smollm2", "", FlashAttn::On);
}

#[test]
fn smollm2_flash_attention_perplexity_at_ctx_2048_matches_llama_cpp() {
    check_perplexity("smollm2", "-ctx2048", FlashAttn::On);
}

#[test]
fn gemma3_flash_attention_matches_llama_cpp_ids_logits_and_greedy_text() {
    check_model("gemma3", "", FlashAttn::On);
}

#[test]
fn gemma3_flash_attention_long_context_matches_llama_cpp() {
    check_model("gemma3", "-long", FlashAttn::On);
}

#[test]
fn gemma3_flash_attention_free_running_greedy_matches_llama_cpp() {
    check_free_running("gemma3", FlashAttn::Auto);
}

#[test]
fn gemma3_flash_attention_perplexity_matches_llama_cpp() {
    check_perplexity("gemma3", "", FlashAttn::On);
}

#[test]
fn gemma3_flash_attention_perplexity_at_ctx_2048_matches_llama_cpp() {
    check_perplexity("gemma3", "-ctx2048", FlashAttn::On);
}

/// Against llama.cpp cross-built for aarch64 (`-march=armv8-a`, NEON without
/// dotprod) and run under qemu-user as a Cortex-A72: data/golden/aarch64/,
/// recorded by `scripts/aarch64.sh goldens` (four prompts, 16 tokens each,
/// to keep the emulated run short).
#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use super::*;

    fn goldens() -> Goldens {
        Goldens {
            dir: "aarch64/",
            exact: true,
        }
    }

    #[test]
    fn smollm2_matches_llama_cpp_on_aarch64() {
        check_model_against(goldens(), "smollm2", "", FlashAttn::Off);
        check_model_against(goldens(), "smollm2", "", FlashAttn::On);
    }

    #[test]
    fn gemma3_matches_llama_cpp_on_aarch64() {
        check_model_against(goldens(), "gemma3", "", FlashAttn::Off);
        check_model_against(goldens(), "gemma3", "", FlashAttn::On);
    }
}
