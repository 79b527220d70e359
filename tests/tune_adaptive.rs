//! `tune --profiling adaptive` on the small synthetic model: one adaptive
//! profile takes the two uniform profiles' place, the controller table is
//! fitted on its runs (their hashes are the table's inputs), and the engine
//! uses what the run made, exactly at sparsity 0.

use leanstream_e2e::*;

#[test]
fn adaptive_profiling_replaces_the_uniform_profiles_and_feeds_the_table() {
    let dir = tmp("tune-adaptive");
    let model = synthetic_model(&dir);
    let out = dir.join("tuned");
    let mut c = tune_command(&model, &out, "60s");
    c.args(["--profiling", "adaptive"]);
    check(c);
    let m = check_tuned(&out, 11);
    check_exact_at_sparsity_0(&out);

    let steps = m["steps"].as_object().expect("steps");
    assert!(!steps.contains_key("profile-io") && !steps.contains_key("profile-compute"));
    let profile = &steps["profile-adaptive"];
    // The pilot, then rounds whose every condition has a sensitivity.
    let rounds = profile["summary"]["rounds"].as_array().expect("rounds");
    assert!(rounds.len() >= 2, "{profile}");
    for round in &rounds[1..] {
        let conditions = round["conditions"].as_array().expect("conditions");
        assert!(
            !conditions.is_empty() && conditions.iter().all(|c| c[1].is_number()),
            "{round}"
        );
    }
    // Every read run samples all the read conditions together, so they
    // see the same drift of the device (none is left to the pilot's moment).
    let plan_conditions = |run: &std::path::Path| {
        let text = std::fs::read(run.join("plan.json")).expect("plan.json");
        let plan: serde_json::Value = serde_json::from_slice(&text).expect("plan JSON");
        plan["conditions"].as_array().expect("conditions").len()
    };
    let traces = out.join("work/adaptive-traces");
    let pilot_reads = plan_conditions(&traces.join("round-00-io"));
    let mut read_runs = 0;
    for e in std::fs::read_dir(&traces).expect("adaptive traces") {
        let run = e.expect("entry").path();
        if run.to_string_lossy().ends_with("-io") {
            assert_eq!(plan_conditions(&run), pilot_reads, "{}", run.display());
            read_runs += 1;
        }
    }
    assert!(read_runs >= 2, "only the pilot read");
    let outputs = profile["outputs"].as_array().expect("outputs");
    for kind in ["io", "compute"] {
        let pilot = format!("work/adaptive-traces/round-00-{kind}/manifest.json");
        assert!(
            outputs.iter().any(|o| o["path"] == pilot.as_str()),
            "no {pilot}: {outputs:?}"
        );
    }
    let hashes: Vec<&serde_json::Value> = outputs.iter().map(|o| &o["sha256"]).collect();
    let inputs: Vec<&serde_json::Value> = steps["controller"]["inputs"]["adaptive"]
        .as_array()
        .expect("the controller's inputs name the adaptive runs")
        .iter()
        .collect();
    assert_eq!(inputs, hashes);
    assert!(!out.join("work/traces").exists(), "a uniform profile ran too");
    assert!(
        !out.join("work/io-scratch").exists(),
        "the I/O data file was left behind"
    );

    let report = std::fs::read_to_string(out.join("report.md")).expect("report");
    assert!(
        report.contains("Adaptive:") && report.contains("- round 1:"),
        "{report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
