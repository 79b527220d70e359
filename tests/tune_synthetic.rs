//! `tune` end to end on a small synthetic model: every artifact made, the
//! engine driven by them, exact at sparsity 0, a second run of the same
//! command skips every step, and another engine binary redoes the steps
//! that time it.

use leanstream_e2e::*;

#[test]
fn tune_makes_artifacts_the_engine_uses_and_a_rerun_skips_every_step() {
    let dir = tmp("tune-synthetic");
    let model = synthetic_model(&dir);
    let out = dir.join("tuned");
    check(tune_command(&model, &out, "60s"));
    let m = check_tuned(&out, 12);
    check_exact_at_sparsity_0(&out);

    // The table names the model it was made for and the device.
    let table = leanstream_runtime::control::ControlTable::load(&out.join("controller.lstab")).unwrap();
    assert_eq!(
        table.provenance.model().sha256.as_deref(),
        Some(sha256(&model).as_str())
    );
    assert!(!table.provenance.device_fingerprint.is_empty());

    // The same command again: nothing to do, nothing rewritten.
    let before: Vec<String> = ARTIFACTS.iter().map(|a| sha256(&out.join(a))).collect();
    let o = check(tune_command(&model, &out, "60s"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("0 steps ran, 12 were already done"), "{err}");
    let after: Vec<String> = ARTIFACTS.iter().map(|a| sha256(&out.join(a))).collect();
    assert_eq!(before, after);
    let m2 = json_file(&out.join("tune.json"));
    assert_eq!(m2["steps"], m["steps"]);
    assert_eq!(m2["sessions"], 2);

    // Another engine build (the same binary with a byte appended: another
    // SHA-256, and it still runs): the steps that time the engine run
    // again, the ones that compute are kept.
    let engine = dir.join("leanstream-rebuilt");
    std::fs::copy(bin("leanstream"), &engine).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&engine)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"\0"))
        .unwrap();
    check(tune_command_with(&model, &out, "60s", &engine));
    let m3 = json_file(&out.join("tune.json"));
    for step in ["engine-probe", "verify"] {
        assert_ne!(
            m3["steps"][step]["inputs_key"], m2["steps"][step]["inputs_key"],
            "{step}"
        );
        assert_eq!(m3["steps"][step]["sessions"], 1, "{step}");
    }
    for step in [
        "text",
        "activations",
        "placement",
        "pack",
        "profile-io",
        "profile-compute",
        "predictor",
        "eviction",
    ] {
        assert_eq!(m3["steps"][step], m2["steps"][step], "{step} ran again");
    }

    // Another model in the same directory is refused, naming the manifest.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let mut spec = leanstream_runtime::synthetic::SyntheticSpec::tiny("llama");
    spec.seed = 99;
    let other_model = other.join("other.gguf");
    std::fs::write(&other_model, spec.build().unwrap().to_bytes()).unwrap();
    let o = tune_command(&other_model, &out, "60s").output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tune.json") && err.contains("another model"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
