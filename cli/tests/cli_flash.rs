//! The `leanstream` binary on `.lsflash` models: `--mem-budget` accounting
//! and refusal, peak RSS within the budget plus a stated slack, the file not
//! left in the page cache, and `bench --sweep` output; and the sparsity
//! thresholds those models are packed with (`calibrate`, `perplexity`).

#[path = "../../runtime/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream_runtime::flash::{pack, DownType, PackOptions};
use leanstream_runtime::synthetic::SyntheticSpec;
use serde_json::Value;

/// What the process holds beyond the accounted categories: the binary and
/// its libraries, the tokenizer, thread stacks, allocator slack.
const RSS_SLACK: u64 = 16 << 20;

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli_flash");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pack_plain(src: &Path, name: &str) -> PathBuf {
    let out = dir().join(format!("{name}.lsflash"));
    let opts = PackOptions {
        down: DownType::Q8_0,
        ..PackOptions::default()
    };
    pack(src, &out, &opts).unwrap();
    out
}

fn tiny() -> PathBuf {
    let src = dir().join("tiny.gguf");
    std::fs::write(&src, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    pack_plain(&src, "tiny")
}

fn leanstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["--threads", "2"])
        .args(args)
        .output()
        .unwrap()
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn bad_flash_settings_are_refused_with_the_reason() {
    let m = tiny();
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", m, "--prompt", "hello", "-n", "2", "--temp", "0"];
        args.extend_from_slice(extra);
        let o = leanstream(&args);
        assert!(!o.status.success(), "{extra:?} should fail");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&["--policy", "dense-stream", "--mem-budget", "64KiB"]);
    assert!(
        e.contains("--mem-budget") && e.contains("resident parts alone need"),
        "{e}"
    );
    // The remedy is named too: the context sizes the run state.
    assert!(e.contains("lower --ctx"), "{e}");
    let e = run(&["--policy", "oracle", "--sparsity", "0.5"]);
    assert!(e.contains("no thresholds for sparsity 0.5"), "{e}");
    let e = run(&["--mem-budget", "25%"]);
    assert!(e.contains("takes bytes"), "{e}");
    let e = run(&["--policy", "gate-only"]);
    assert!(e.contains("gate-first"), "{e}");
}

/// `--quality-reference`: scored against the source GGUF's dense engine,
/// which an exactly packed file (source down blocks) equals at sparsity 0;
/// a GGUF the file was not packed from is refused by name.
#[test]
fn quality_is_scored_against_the_source_gguf() {
    let src = dir().join("exact.gguf");
    std::fs::write(&src, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    let m = dir().join("exact.lsflash");
    let opts = PackOptions {
        down: DownType::Source,
        ..PackOptions::default()
    };
    pack(&src, &m, &opts).unwrap();
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/text/apache-2.0.txt");
    let bench = |reference: &Path| {
        leanstream(&[
            "bench",
            "--model",
            m.to_str().unwrap(),
            "--policy",
            "dense-stream",
            "--prompt-tokens",
            "4",
            "--gen-tokens",
            "2",
            "--reps",
            "1",
            "--quality-file",
            text,
            "--quality-ctx",
            "32",
            "--quality-chunks",
            "2",
            "--quality-reference",
            reference.to_str().unwrap(),
        ])
    };
    let q = json_of(&bench(&src))["quality"].clone();
    let r = &q["reference"];
    assert_eq!(r["ppl"].as_f64(), q["ppl_dense"].as_f64(), "{q}");
    assert_eq!(r["ppl_ratio"].as_f64(), Some(1.0), "{q}");
    // The same run twice: every chunk's difference is 0, and so its error.
    assert_eq!(r["ppl_ratio_stderr"].as_f64(), Some(0.0), "{q}");
    assert_eq!(r["ppl_dense_ratio"].as_f64(), Some(1.0), "{q}");
    assert_eq!(r["top1_agreement"].as_f64(), Some(1.0), "{q}");

    let other = dir().join("other.gguf");
    // The same shape with other weights: the same length, another SHA-256.
    let spec = SyntheticSpec {
        seed: 8,
        ..SyntheticSpec::tiny("llama")
    };
    std::fs::write(&other, spec.build().unwrap().to_bytes()).unwrap();
    let o = bench(&other);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("other.gguf") && e.contains("not the GGUF") && e.contains("exact.lsflash") && e.contains("SHA-256"),
        "{e}"
    );
}

#[test]
fn sweep_writes_json_and_plot() {
    let m = tiny();
    let out = dir().join("sweep");
    let o = leanstream(&[
        "bench",
        "--model",
        m.to_str().unwrap(),
        "--sweep",
        "--out",
        out.to_str().unwrap(),
        "--sweep-budgets",
        "25%,100%",
        "--sweep-policies",
        "dense,dense-stream,oracle,gate-first",
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "4",
        "--reps",
        "1",
    ]);
    json_of(&o);
    let runs: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
    let policies: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(
        policies,
        [
            "dense",
            "dense-stream",
            "dense-stream",
            "oracle",
            "oracle",
            "gate-first",
            "gate-first"
        ]
    );
    for r in &runs {
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["memory"]["total"].as_u64().unwrap() > 0, "{r}");
        // Streaming reads at 25%; 100% caches every neuron, so nothing is read.
        let read = r["bytes_read_per_token"].as_f64().unwrap();
        match (r["policy"].as_str().unwrap(), r["ffn_budget"].as_str().unwrap()) {
            ("dense", _) | (_, "100%") => assert_eq!(read, 0.0, "{r}"),
            _ => assert!(read > 0.0, "{r}"),
        }
    }
    // A larger cache holds more. (The total need not grow on a model this
    // small: layers held whole need none of the streaming scratch, which
    // here outweighs the cache's growth.)
    let cache = |i: usize| runs[i]["memory"]["ffn_cache"].as_u64().unwrap();
    assert!(
        cache(1) < cache(2),
        "25% vs 100% budget: {} {}",
        runs[1]["memory"],
        runs[2]["memory"]
    );
    let svg = std::fs::read_to_string(out.join("sweep.svg")).unwrap();
    // Series lines and legend samples are the 2-pixel polylines (axes and
    // ticks are 1 pixel): a line per policy with two budgets (3), a legend
    // sample per policy (4), and dense's single point drawn or not.
    let thick = svg
        .lines()
        .filter(|l| l.starts_with("<polyline") && l.contains("stroke-width=\"2\""))
        .count();
    assert!((7..=8).contains(&thick), "{thick} series polylines");
    let texts: Vec<&str> = svg
        .split("<text")
        .skip(1)
        .filter_map(|t| t.split_once('>').and_then(|(_, rest)| rest.split_once("</text>")))
        .map(|(text, _)| text.trim())
        .collect();
    for p in ["dense", "dense-stream", "oracle", "gate-first", "decode (tokens/s)"] {
        assert!(texts.contains(&p), "the chart lacks {p}: {texts:?}");
    }
}

/// Every streaming policy under `--mem-budget`: the accounted total within
/// the budget, peak RSS within it plus [`RSS_SLACK`], the file out of the page cache.
fn stays_within_mem_budget(name: &str, budget_mib: u64) {
    let Some(src) = common::model_path(name) else {
        return;
    };
    let m = pack_plain(&src, name);
    let budget = budget_mib << 20;
    let budget_arg = format!("{budget_mib}MiB");
    for policy in ["dense-stream", "oracle", "gate-first"] {
        let r = json_of(&leanstream(&[
            "bench",
            "--model",
            m.to_str().unwrap(),
            "--policy",
            policy,
            "--mem-budget",
            &budget_arg,
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "8",
            "--reps",
            "1",
        ]));
        let (total, rss) = (
            r["memory"]["total"].as_u64().unwrap(),
            r["peak_rss_bytes"].as_u64().unwrap(),
        );
        let cached = r["page_cache_bytes"].as_u64().unwrap();
        eprintln!(
            "{name} {policy}: accounted {:.1} MiB, peak RSS {:.1} MiB, cache {:.1} MiB, page cache {cached} B",
            total as f64 / 1048576.0,
            rss as f64 / 1048576.0,
            r["memory"]["ffn_cache"].as_f64().unwrap() / 1048576.0
        );
        // The test files live on a disk filesystem, where O_DIRECT works.
        assert_eq!(r["io_direct"], true, "{policy}: reads fell back to buffered I/O");
        assert!(total <= budget, "{policy}: accounted {total} > budget {budget}");
        assert!(
            rss <= budget + RSS_SLACK,
            "{policy}: peak RSS {rss} > budget {budget} + slack"
        );
        assert!(
            cached * 100 <= r["file_bytes"].as_u64().unwrap(),
            "{policy}: {cached} B in the page cache"
        );
        assert!(r["memory"]["ffn_cache"].as_u64().unwrap() > 0);
    }
}

#[test]
fn smollm2_stays_within_mem_budget() {
    stays_within_mem_budget("smollm2", 130);
}

#[test]
fn gemma3_stays_within_mem_budget() {
    stays_within_mem_budget("gemma3", 310);
}

/// `pack` with scores stores each layer hottest first unless told to keep
/// the order; with a placement, the hot set of half the FFN goes first and
/// the rest keeps the placement's order.
#[test]
fn a_calibrated_pack_keeps_the_hot_set_in_one_piece_per_layer() {
    let src = dir().join("order.gguf");
    std::fs::write(&src, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/text/apache-2.0.txt");
    let packed = |name: &str, extra: &[&str]| {
        let out = dir().join(format!("{name}.lsflash"));
        let mut args = vec!["pack", "--model", src.to_str().unwrap(), "-o", out.to_str().unwrap()];
        args.extend_from_slice(&["--calibrate", text, "--calib-tokens", "256"]);
        args.extend_from_slice(extra);
        let o = leanstream(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        leanstream_runtime::flash::LsFlash::open(&out).unwrap()
    };
    let by_score = packed("order_default", &[]);
    let h = by_score.header();
    let n_ff = h.placement[0].len();
    assert_eq!(
        h.placement,
        leanstream_runtime::flash::pack::order_by_score(&h.neuron_scores)
    );
    assert!(h
        .placement
        .iter()
        .any(|l| l.iter().enumerate().any(|(i, &n)| n as usize != i)));

    let kept = packed("order_kept", &["--keep-order"]);
    let identity: Vec<u32> = (0..n_ff as u32).collect();
    assert!(kept.header().placement.iter().all(|l| *l == identity));

    // A placement: each layer reversed.
    let reversed: Vec<Vec<u32>> = h
        .placement
        .iter()
        .map(|_| identity.iter().rev().copied().collect())
        .collect();
    let p = dir().join("reversed.json");
    std::fs::write(&p, serde_json::json!({ "layers": reversed }).to_string()).unwrap();
    let placed = packed("order_placed", &["--placement", p.to_str().unwrap()]);
    let ph = placed.header();
    let want = leanstream_runtime::flash::pack::hot_prefix(&reversed, &ph.neuron_scores, 0.5).unwrap();
    assert_eq!(ph.placement, want);
    assert_ne!(want, reversed);
    let kept = packed(
        "order_placed_kept",
        &["--placement", p.to_str().unwrap(), "--keep-order"],
    );
    assert_eq!(kept.header().placement, reversed);

    // The engine's own hot set at a quarter of the FFN: one piece per layer
    // in the files packed hot first, scattered in the one kept as given.
    let scattered = |name: &str| {
        let f = dir().join(format!("{name}.lsflash"));
        let o = leanstream(&[
            "bench",
            "--model",
            f.to_str().unwrap(),
            "--policy",
            "dense-stream",
            "--ffn-budget",
            "25%",
            "--prompt-tokens",
            "2",
            "--gen-tokens",
            "1",
            "--reps",
            "1",
        ]);
        json_of(&o)["hot_set_scattered"].as_f64().expect("a static hot set")
    };
    assert_eq!(scattered("order_default"), 0.0);
    assert_eq!(scattered("order_placed"), 0.0);
    assert!(scattered("order_kept") > 0.1);
}

/// `leanstream calibrate`, then `perplexity --thresholds`: the thresholds'
/// quality cost against the same text dense, with its standard error.
#[test]
fn thresholds_report_their_cost_against_dense() {
    let dir = dir();
    let model = dir.join("calibrated.gguf");
    std::fs::write(&model, SyntheticSpec::tiny("llama").build().unwrap().to_bytes()).unwrap();
    let (model, cal) = (model.to_str().unwrap(), dir.join("cal.json"));
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/text/apache-2.0.txt");
    let o = leanstream(&[
        "calibrate",
        "--model",
        model,
        "--file",
        text,
        "--sparsity",
        "0,0.5",
        "--ctx",
        "64",
        "--max-tokens",
        "512",
        "-o",
        cal.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ppl_in_batches = |sparsity: &str, batch: &str| {
        json_of(&leanstream(&[
            "perplexity",
            "--model",
            model,
            "--file",
            text,
            "--ctx",
            "64",
            "--chunks",
            "6",
            "--thresholds",
            cal.to_str().unwrap(),
            "--sparsity",
            sparsity,
            "--batch",
            batch,
        ]))
    };
    let ppl = |sparsity: &str| ppl_in_batches(sparsity, "512");
    // Sparsity 0 keeps everything: the dense run, chunk for chunk.
    let zero = ppl("0");
    assert_eq!(zero["ppl"], zero["ppl_dense"], "{zero}");
    assert_eq!(zero["ppl_ratio"].as_f64(), Some(1.0), "{zero}");
    assert_eq!(zero["ppl_ratio_stderr"].as_f64(), Some(0.0), "{zero}");
    assert_eq!(zero["top1_agreement"].as_f64(), Some(1.0), "{zero}");
    let half = ppl("0.5");
    let (p, dense) = (half["ppl"].as_f64().unwrap(), half["ppl_dense"].as_f64().unwrap());
    assert_eq!(dense, zero["ppl_dense"].as_f64().unwrap());
    assert_eq!(half["ppl_ratio"].as_f64(), Some(p / dense), "{half}");
    let e = half["ppl_ratio_stderr"].as_f64().unwrap();
    assert!(e > 0.0 && e.is_finite(), "{half}");
    assert!(half["skipped_fraction"].as_f64().unwrap() > 0.3, "{half}");
    // Decoded, a token a pass: the same positions scored through other
    // kernels, so close to the batched numbers but its own dense reference.
    let decoded = ppl_in_batches("0.5", "1");
    assert_eq!(decoded["batch"].as_u64(), Some(1), "{decoded}");
    let d_dense = decoded["ppl_dense"].as_f64().unwrap();
    assert!(
        (d_dense / dense - 1.0).abs() < 0.02,
        "decoded {d_dense} batched {dense}"
    );
    assert_eq!(decoded["tokens_scored"], half["tokens_scored"], "{decoded}");
    let o = leanstream(&["perplexity", "--model", model, "--file", text, "--batch", "0"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--batch"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
