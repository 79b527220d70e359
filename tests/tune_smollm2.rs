//! `tune` end to end on SmolLM2 with a small budget: every artifact made,
//! the engine driven by them, and exact against the dense policy at sparsity 0.

use leanstream_e2e::*;

#[test]
fn tune_on_smollm2_drives_the_engine() {
    let Some(model) = leanstream_runtime::fetch::reference_model("smollm2").unwrap_or_else(|e| panic!("{e}")) else {
        return;
    };
    let dir = tmp("tune-smollm2");
    let out = dir.join("tuned");
    check(tune_command(&model, &out, "60s"));
    check_tuned(&out, 12);
    check_exact_at_sparsity_0(&out);
    // The report's numbers come from the run it describes.
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    let verify = json_file(&out.join("work/verify.json"));
    let tuned = &verify["runs"][0];
    assert_eq!(tuned["config"], "tuned");
    assert!(report.contains(&format!("{:.1}", tuned["decode_tok_s"].as_f64().unwrap())));
    // Quality runs are audited: dense-stream keeps what dense keeps at the
    // same thresholds, so it skips none of the true active mass; speculate
    // reports a share.
    for run in verify["runs"].as_array().unwrap() {
        let Some(mass) = run["quality"]["skipped_mass"].as_f64() else {
            assert!(
                run["quality"].is_null(),
                "a quality run without its skipped mass: {run}"
            );
            continue;
        };
        assert!((0.0..=1.0).contains(&mass), "{run}");
        if run["config"] == "default" {
            assert_eq!(mass, 0.0, "{run}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
