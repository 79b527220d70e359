//! Helpers of the end-to-end tests: the workspace's binaries, a small
//! synthetic model, real prose, and running `tune` and `run`.
//!
//! The tests drive the built binaries (`leanstream-synth`, `leanstream`) as
//! a user does; `cargo test --workspace` builds them beside the test
//! executables.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream_kernels::GgmlType;
use leanstream_runtime::synthetic::SyntheticSpec;
use serde_json::Value;

/// A binary of the workspace, from the same build as the running test.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .expect("target directory");
    assert!(
        p.is_file(),
        "{}: not built; run the tests with `cargo test --workspace` (or build it first)",
        p.display()
    );
    p
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A fresh directory for one test.
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("leanstream-e2e-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Real prose (license texts), training and held-out.
pub fn prose() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let t = repo().join("data/text");
    (vec![t.join("gpl-3.0.txt")], vec![t.join("apache-2.0.txt")])
}

/// A small random-weight llama model (4 layers, 1024 neurons, Q8_0): its
/// outputs mean nothing, but every step of the pipeline runs on it for real.
pub fn synthetic_model(dir: &Path) -> PathBuf {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer, spec.seed) = (256, 1024, 4, 11);
    spec.context_length = 512;
    let p = dir.join("tiny.gguf");
    std::fs::write(&p, spec.build().expect("synthetic spec").to_bytes()).expect("write model");
    p
}

/// `leanstream-synth tune` on `model` into `out` with `budget`.
pub fn tune_command(model: &Path, out: &Path, budget: &str) -> Command {
    tune_command_with(model, out, budget, &bin("leanstream"))
}

/// The same, measuring the engine binary `engine`.
pub fn tune_command_with(model: &Path, out: &Path, budget: &str, engine: &Path) -> Command {
    let (train, heldout) = prose();
    let mut c = Command::new(bin("leanstream-synth"));
    c.arg("tune")
        .arg("--model")
        .arg(model)
        .arg("--text")
        .args(&train)
        .arg("--heldout")
        .args(&heldout)
        .arg("--out")
        .arg(out)
        .args(["--budget", budget, "--quiet"])
        // A short trace keeps the tests' disk and time small.
        .args(["--max-trace-tokens", "2048"])
        .arg("--leanstream-bin")
        .arg(engine);
    c
}

/// Runs to completion; panics with its stderr when it fails.
pub fn check(mut c: Command) -> Output {
    let o = c.output().expect("spawn");
    assert!(
        o.status.success(),
        "{:?} failed ({}):\n{}",
        c,
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

pub fn json_file(p: &Path) -> Value {
    let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Greedy continuation of a fixed prompt through `leanstream run`.
pub fn greedy(model: &Path, args: &[&str]) -> String {
    let mut c = Command::new(bin("leanstream"));
    c.arg("run")
        .arg("--model")
        .arg(model)
        .args(["--prompt", "The license grants", "-n", "24", "--temp", "0"])
        .args(args);
    String::from_utf8(check(c).stdout).expect("utf-8 output")
}

pub fn sha256(p: &Path) -> String {
    leanstream_runtime::fetch::sha256_file(p).unwrap_or_else(|e| panic!("{e}"))
}

/// The files a tuned directory ships.
pub const ARTIFACTS: [&str; 6] = [
    "model.lsflash",
    "controller.lstab",
    "predictor.lspred",
    "predictor.lowrank.lspred",
    "eviction.lsevict",
    "report.md",
];

/// Checks what a finished tune left in `out` and that the engine used it:
/// the tuned verification run took its actions from the table and
/// consulted the predictor beside the model, and the file is in the
/// order tune packs: each layer's hot set first, then the learned
/// placement. `steps`: how many the run's pipeline has (11 with uniform
/// profiling, 10 with adaptive). Returns the manifest.
pub fn check_tuned(out: &Path, steps: usize) -> Value {
    for a in ARTIFACTS {
        assert!(out.join(a).is_file(), "{a} missing in {}", out.display());
    }
    let m = json_file(&out.join("tune.json"));
    assert!(m["pending"].is_null(), "a step is still pending: {}", m["pending"]);
    let recorded = m["steps"].as_object().expect("steps");
    assert_eq!(
        recorded.len(),
        steps,
        "steps: {:?}",
        recorded.keys().collect::<Vec<_>>()
    );

    // The control model's recall is the engine's where the probe audited
    // it (small budgets run its floor of held-out tokens).
    let probe = &m["steps"]["engine-probe"]["summary"];
    let solved = &m["steps"]["controller"]["summary"];
    let measured: Vec<f64> = probe["recall"]
        .as_array()
        .expect("the probe's recall")
        .iter()
        .map(|r| r["recall"].as_f64().unwrap())
        .collect();
    assert!(probe["recall_tokens"].as_u64().unwrap() > 0, "{probe}");
    assert_eq!(solved["recall_source"], "engine", "{solved}");
    let used: Vec<f64> = solved["recall_by_breadth"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    assert_eq!(used, measured);
    assert!(measured.iter().all(|r| (0.0..=1.0).contains(r)), "{measured:?}");

    let verify = json_file(&out.join("work/verify.json"));
    let runs = verify["runs"].as_array().expect("runs");
    let tuned = runs.iter().find(|r| r["config"] == "tuned").expect("a tuned run");
    let spec = &tuned["speculate"];
    let controller = spec["controller"].as_str().expect("controller name");
    assert!(
        controller.ends_with("controller.lstab") && !controller.contains("built-in"),
        "the tuned run's controller: {controller}"
    );
    let predictor = spec["predictor"].as_str().expect("predictor name");
    assert!(predictor.ends_with("predictor.lspred"), "predictor: {predictor}");
    let layers: u64 = spec["actions"]
        .as_array()
        .expect("actions")
        .iter()
        .map(|a| a["layers"].as_u64().unwrap())
        .sum();
    assert!(layers > 0, "no action was taken from the table: {spec}");

    let f = leanstream_runtime::flash::LsFlash::open(out.join("model.lsflash")).expect("packed model");
    let placement = &f.header().placement;
    assert!(
        placement
            .iter()
            .any(|l| l.iter().enumerate().any(|(i, &n)| n as usize != i)),
        "the packed file is in identity order, not the learned placement"
    );
    // Each layer: the static hot set of the pack step's budget (or the
    // least share it packs that way) hottest first, then the learned order.
    let learned = leanstream_runtime::flash::pack::load_placement(&out.join("work/placement.json")).unwrap();
    let inputs = &m["steps"]["pack"]["inputs"];
    let budget = inputs["hot_prefix_budget"].as_str().expect("the pack step's budget");
    let at_least = inputs["hot_prefix_at_least"]
        .as_f64()
        .expect("the pack step's least prefix");
    let budget = leanstream_runtime::cache::FfnBudget::parse(budget).unwrap();
    let share = leanstream_runtime::cache::CacheShape::from_flash(&f)
        .budget_share(budget)
        .max(at_least);
    let want = leanstream_runtime::flash::pack::hot_prefix(&learned, &f.header().neuron_scores, share).unwrap();
    assert!(want != learned, "a hot prefix that changes nothing tests nothing");
    assert_eq!(
        placement, &want,
        "the file is not the hot prefix then the learned order"
    );

    let report = std::fs::read_to_string(out.join("report.md")).expect("report");
    assert!(report.contains("## Tuned against default") && report.contains("plots/controller.svg"));
    m
}

/// With sparsity 0 and no deadline, speculate over the tuned file (its
/// predictor and cache) gives the dense policy's greedy text.
pub fn check_exact_at_sparsity_0(out: &Path) {
    let model = out.join("model.lsflash");
    let dense = greedy(&model, &["--policy", "dense"]);
    let spec = greedy(
        &model,
        &[
            "--policy",
            "speculate",
            "--sparsity",
            "0",
            "--ffn-budget",
            "25%",
            "--controller",
            "fixed:K=4,b=1.5,d=inf,q=16",
        ],
    );
    assert!(!dense.is_empty());
    assert_eq!(spec, dense, "speculate at sparsity 0 differs from dense");
}
