//! `run`, `bench`, `serve` and `chat --device`: a bad device name and
//! options the device engine lacks are errors naming them; `cuda` on a
//! machine without CUDA is an ordinary error ("no CUDA device"), never a
//! panic, and where a device is present it generates, from a GGUF or from
//! a packed model whose bundles it holds (and, where a device is present,
//! refuses one whose down parts it cannot read, naming the fix).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use leanstream_kernels::GgmlType;
use leanstream_runtime::synthetic::SyntheticSpec;

/// The tiny model, written once per test process (tests run in parallel, and
/// one rewriting the file while another's command reads it made that read fail).
fn model() -> PathBuf {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("device");
            std::fs::create_dir_all(&dir).unwrap();
            let p = dir.join(format!("tiny-{}.gguf", std::process::id()));
            let mut spec = SyntheticSpec::tiny("llama");
            spec.weight_type = GgmlType::Q8_0;
            std::fs::write(&p, spec.build().unwrap().to_bytes()).unwrap();
            p
        })
        .clone()
}

/// `leanstream SUBCOMMAND --model <tiny> PLAN... ARGS...`.
fn leanstream(subcommand: &str, plan: &[&str], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg(subcommand)
        .arg("--model")
        .arg(model())
        .args(plan)
        .args(args)
        .output()
        .unwrap()
}

fn run(args: &[&str]) -> Output {
    leanstream("run", &["--prompt", "a b", "-n", "4", "--temp", "0"], args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The command failed, and its error says `why`.
fn assert_refused(o: &Output, why: &str) {
    assert!(!o.status.success(), "succeeded: {}", stderr(o));
    assert!(stderr(o).contains(why), "{}", stderr(o));
}

#[test]
fn an_unknown_device_is_an_error_naming_it() {
    let o = run(&["--device", "tpu"]);
    assert_refused(&o, "--device \"tpu\": expected cpu, cuda or cuda:N");
}

#[test]
fn streaming_options_are_refused_on_the_device_engine() {
    let o = run(&["--device", "cuda", "--policy", "dense"]);
    assert_refused(&o, "--policy is an option of a packed .lsflash model");
}

#[test]
fn cuda_generates_or_says_there_is_no_device() {
    let o = run(&["--device", "cuda"]);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    if o.status.success() {
        assert!(err.contains("decode 4 tokens"), "{err}");
    } else {
        assert!(err.contains("no CUDA device"), "{err}");
    }
}

/// The tiny model packed with its down parts as `down`, once per process.
fn packed(down: &str) -> PathBuf {
    let p = model().with_extension(format!("{down}.lsflash"));
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = LOCK.lock().unwrap();
    if !p.exists() {
        let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
            .args(["pack", "--model"])
            .arg(model())
            .arg("-o")
            .arg(&p)
            .args(["--down", down])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    p
}

#[test]
fn cuda_runs_a_packed_model_or_says_why_not() {
    // Resident, and streamed from flash through a quarter-size cache.
    let streamed = ["--policy", "dense-stream", "--ffn-budget", "25%"];
    for how in [&[][..], &streamed[..]] {
        for (down, refusal) in [("q8_0", None), ("source", Some("pack with --down q8_0"))] {
            let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
                .args(["run", "--model"])
                .arg(packed(down))
                .args(["--prompt", "a b", "-n", "4", "--temp", "0", "--device", "cuda"])
                .args(how)
                .output()
                .unwrap();
            let err = stderr(&o);
            assert!(!err.contains("panicked"), "{err}");
            match (o.status.success(), refusal) {
                (true, None) => {
                    assert!(err.contains("decode 4 tokens"), "{err}");
                    assert_eq!(err.contains("streamed FFN"), !how.is_empty(), "{err}");
                }
                (false, _) if err.contains("no CUDA device") => {}
                (false, Some(why)) => assert!(err.contains(why), "{down} {how:?}: {err}"),
                _ => panic!("{down} {how:?}: {err}"),
            }
        }
    }
    // The CPU engine's policies, with what each needs said before the
    // device is looked for; what the device cannot run is refused.
    let cases: [(&[&str], &str); 4] = [
        (&["--policy", "speculate"], "needs a predictor"),
        (
            &["--policy", "gate-first", "--sparsity", "0.5"],
            "no thresholds for sparsity 0.5",
        ),
        (&["--policy", "oracle"], "replays the CPU engine's recorded run"),
        (
            &["--policy", "dense-stream", "--mem-budget", "300MiB"],
            "--mem-budget counts the CPU engine's memory",
        ),
    ];
    for (args, why) in cases {
        let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
            .args(["run", "--model"])
            .arg(packed("q8_0"))
            .args(["--prompt", "a b", "-n", "4", "--device", "cuda"])
            .args(args)
            .output()
            .unwrap();
        assert_refused(&o, why);
    }
}

fn bench(args: &[&str]) -> Output {
    leanstream(
        "bench",
        &["--prompt-tokens", "8", "--gen-tokens", "4", "--reps", "1"],
        args,
    )
}

#[test]
fn bench_on_cuda_measures_or_says_there_is_no_device() {
    let o = bench(&["--device", "cuda"]);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    if o.status.success() {
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(r["device"].as_str().is_some_and(|d| d.contains("compute")), "{r}");
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["prompt_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    } else {
        assert!(err.contains("no CUDA device"), "{err}");
    }
}

#[test]
fn bench_refuses_what_the_device_engine_does_not_run() {
    let o = bench(&["--device", "cuda:0", "--ffn-budget", "25%"]);
    assert_refused(&o, "--ffn-budget is an option of a packed .lsflash model");
    let o = bench(&["--device", "gpu"]);
    assert_refused(&o, "expected cpu, cuda or cuda:N");
}

/// `chat` opens the same engine as `serve` (`leanstream-server`).
#[test]
fn chat_on_cuda_answers_or_says_there_is_no_device() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["chat", "--model"])
        .arg(model())
        .args(["--device", "cuda", "-n", "4", "--temp", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A machine without CUDA may have refused before reading anything.
    let _ = child.stdin.take().unwrap().write_all(b"a b\n");
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    if o.status.success() {
        assert!(!o.stdout.is_empty(), "no reply: {err}");
    } else {
        assert!(err.contains("no CUDA device"), "{err}");
    }
}

#[test]
fn serve_refuses_what_the_device_engine_does_not_run() {
    let serve = |args: &[&str]| leanstream("serve", &["--port", "0"], args);
    let o = serve(&["--device", "cuda", "--policy", "dense"]);
    assert_refused(&o, "--policy is an option of a packed .lsflash model");
    let o = serve(&["--device", "npu"]);
    assert_refused(&o, "--device \"npu\": expected cpu, cuda or cuda:N");
    // A packed model is served under the CPU engine's policies: what a
    // policy lacks is said before any device is looked for.
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["serve", "--port", "0", "--model"])
        .arg(packed("q8_0"))
        .args(["--device", "cuda", "--policy", "dejavu", "--sparsity", "0"])
        .output()
        .unwrap();
    assert_refused(&o, "the dejavu policy needs a predictor");
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["serve", "--port", "0", "--model"])
        .arg(packed("q8_0"))
        .args(["--device", "cuda", "--mem-budget", "300MiB"])
        .output()
        .unwrap();
    assert_refused(&o, "--mem-budget counts the CPU engine's memory");
}
