//! `leanstream calibrate`, then `perplexity --thresholds`: the thresholds'
//! quality cost against the same text dense, with its standard error.

use std::path::PathBuf;
use std::process::{Command, Output};

use leanstream_runtime::synthetic::SyntheticSpec;
use serde_json::Value;

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
fn thresholds_report_their_cost_against_dense() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli_sparsity");
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
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
    let ppl = |sparsity: &str| {
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
        ]))
    };
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
}
