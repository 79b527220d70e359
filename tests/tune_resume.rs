//! `tune` killed with SIGKILL mid-step, twice (while tracing activations and
//! while profiling compute), then started again with the same command,
//! resumes where it stopped and ends with the same artifacts as an
//! uninterrupted run: nothing committed is lost or redone.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use leanstream_e2e::*;
use serde_json::Value;

const BUDGET: &str = "90s";

fn manifest(out: &Path) -> Option<Value> {
    let bytes = std::fs::read(out.join("tune.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Starts tune and SIGKILLs it once `ready` holds while `step` is pending;
/// returns the manifest as the kill left it.
fn kill_during(model: &Path, out: &Path, step: &str, ready: impl Fn(&Path) -> bool) -> Value {
    let mut child = tune_command(model, out, BUDGET)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn tune");
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("tune ended ({status}) before it could be killed during {step}");
        }
        let pending = manifest(out).and_then(|m| m["pending"]["step"].as_str().map(String::from));
        if pending.as_deref() == Some(step) && ready(out) {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            child.wait().unwrap();
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(600), "{step} never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let m = manifest(out).expect("manifest after the kill");
    assert_eq!(m["pending"]["step"], step, "killed after {step} had finished");
    m
}

fn shard_files(run: &Path) -> Vec<String> {
    let m = json_file(&run.join("manifest.json"));
    m["shards"]
        .as_array()
        .map(|a| a.iter().map(|s| s["file"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

#[test]
fn a_tune_killed_twice_resumes_to_the_same_artifacts() {
    let dir = tmp("tune-resume");
    let model = synthetic_model(&dir);
    // The uninterrupted run, moved aside so the resumed one writes the
    // same paths into its artifacts.
    let out = dir.join("tuned");
    check(tune_command(&model, &out, BUDGET));
    let reference = dir.join("reference");
    std::fs::rename(&out, &reference).unwrap();

    // Killed once the trace has a committed shard.
    let acts_shard = |o: &Path| manifest_shards(&o.join("work/acts/manifest.json")) > 0;
    let m1 = kill_during(&model, &out, "activations", acts_shard);
    assert!(m1["steps"]["text"].is_object());
    // Killed again once the compute profile has a committed shard.
    let compute = out.join("work/traces/compute");
    let m2 = kill_during(&model, &out, "profile-compute", |_| {
        compute.join("manifest.json").is_file() && !shard_files(&compute).is_empty()
    });
    let before_kill = shard_files(&compute);
    // Steps finished before a kill are not redone.
    for s in ["text", "activations", "placement", "pack", "predictor", "profile-io"] {
        assert!(m2["steps"][s].is_object(), "{s} not finished before the second kill");
    }
    let o = check(tune_command(&model, &out, BUDGET));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("6 steps ran, 6 were already done"), "{err}");

    let m = check_tuned(&out, 12);
    for s in ["text", "activations", "placement", "pack", "predictor", "profile-io"] {
        assert_eq!(m["steps"][s], m2["steps"][s], "{s} was redone after the second kill");
    }
    assert_eq!(m["steps"]["activations"]["sessions"], 2);
    assert_eq!(m["steps"]["profile-compute"]["sessions"], 2);
    assert_eq!(m["sessions"], 3);
    // The profile kept every shard committed before the kill and went on.
    let after = shard_files(&compute);
    assert!(
        before_kill.iter().all(|f| after.contains(f)) && after.len() > before_kill.len(),
        "before the kill {before_kill:?}, after {after:?}"
    );
    assert_eq!(json_file(&compute.join("manifest.json"))["sessions"], 2);

    // Everything that does not measure time is the uninterrupted run's, byte for byte.
    for f in [
        "work/acts/manifest.json",
        "work/placement.json",
        "model.lsflash",
        "predictor.lspred",
        "predictor.lowrank.lspred",
        "eviction.lsevict",
    ] {
        assert_eq!(
            sha256(&out.join(f)),
            sha256(&reference.join(f)),
            "{f} differs from the uninterrupted run's"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn manifest_shards(p: &Path) -> usize {
    std::fs::read(p)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .map(|m| {
            m["splits"]
                .as_array()
                .map(|a| a.iter().map(|s| s["shards"].as_array().map_or(0, |x| x.len())).sum())
                .unwrap_or(0)
        })
        .unwrap_or(0)
}
