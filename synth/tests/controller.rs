//! Solver against enumeration, determinism, condition checks, table round trip.

mod common;

use std::path::PathBuf;

use common::{fitted, small_cfg};
use leanstream_runtime::control::ControlTable;
use leanstream_runtime::generate::sampler::Rng;
use leanstream_synth::sim::{compare, Half, SimConfig};
use leanstream_synth::solve::{solve_enumerate, solve_milp, Instance};
use leanstream_synth::synth::{env_for, state_at, synthesize};
use leanstream_synth::SynthError;

fn random_instance(r: &mut Rng, na: usize, nb: usize, ns: usize, nt: usize) -> Instance {
    let c = |r: &mut Rng| 100.0 * r.uniform();
    Instance {
        n_actions: na,
        n_bins: nb,
        first_cost: (0..ns).map(|_| (0..na).map(|_| c(r)).collect()).collect(),
        first_next: (0..ns).map(|_| (0..na).map(|_| r.below(nb)).collect()).collect(),
        cost: (0..ns)
            .map(|_| {
                (0..nt)
                    .map(|_| (0..nb).map(|_| (0..na).map(|_| c(r)).collect()).collect())
                    .collect()
            })
            .collect(),
        next: (0..ns)
            .map(|_| {
                (0..nt)
                    .map(|_| (0..nb).map(|_| (0..na).map(|_| r.below(nb)).collect()).collect())
                    .collect()
            })
            .collect(),
    }
}

#[test]
fn milp_matches_enumeration_on_random_instances() {
    let mut r = Rng::with_stream(42, 0);
    for case in 0..40 {
        let (na, nb, ns, nt) = (2 + case % 5, 1 + case % 3, 1 + case % 4, case % 3);
        let inst = random_instance(&mut r, na, nb, ns, nt);
        let e = solve_enumerate(&inst);
        let m = solve_milp(&inst).unwrap();
        assert!(
            (m.solver_objective - e.objective).abs() < 1e-6,
            "case {case}: {m:?} vs {e:?}"
        );
        assert!((m.objective - e.objective).abs() < 1e-6, "case {case}: {m:?} vs {e:?}");
    }
}

#[test]
fn milp_matches_enumeration_on_model_instances() {
    let cfg = small_cfg();
    let f = fitted();
    let (env, axes) = env_for(&cfg, &f).unwrap();
    let n: usize = axes.iter().map(|a| a.bins()).product();
    for i in (0..n).step_by(7) {
        let mut rng = Rng::with_stream(9, i as u64);
        let inst = Instance::build(&env, &state_at(&axes, i), &cfg.solver, &mut rng);
        let e = solve_enumerate(&inst);
        let m = solve_milp(&inst).unwrap();
        assert!(
            (m.objective - e.objective).abs() <= 1e-6 * e.objective.abs().max(1.0),
            "state {i}: {m:?} vs {e:?}"
        );
        assert!((m.solver_objective - e.objective).abs() <= 1e-6 * e.objective.abs().max(1.0));
    }
}

#[test]
fn synthesis_is_deterministic_for_a_seed_whatever_the_threads() {
    let cfg = small_cfg();
    let f = fitted();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let a = one.install(|| synthesize(&cfg, &f, false).unwrap());
    let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let b = two.install(|| synthesize(&cfg, &f, false).unwrap());
    assert_eq!(a, b);
    assert_eq!(a.to_bytes(), b.to_bytes());
    let mut cfg2 = cfg.clone();
    cfg2.seed = 4;
    let c = synthesize(&cfg2, &f, false).unwrap();
    assert_eq!(c.provenance.seed, 4);
    assert_ne!(a.to_bytes(), c.to_bytes());
}

#[test]
fn synthesized_table_round_trips_and_uses_several_actions() {
    let cfg = small_cfg();
    let t = synthesize(&cfg, &fitted(), false).unwrap();
    let p = PathBuf::from("t.lstab");
    assert_eq!(ControlTable::from_bytes(&t.to_bytes(), &p).unwrap(), t);
    let mut used: Vec<u8> = t.codes.clone();
    used.sort_unstable();
    used.dedup();
    assert!(
        used.len() > 1,
        "one action everywhere: the state does not matter? {used:?}"
    );
}

#[test]
fn the_table_names_the_model_it_was_solved_for() {
    let mut cfg = small_cfg();
    let t = synthesize(&cfg, &fitted(), false).unwrap();
    let m = t.provenance.model();
    assert_eq!(m.sha256, None);
    assert_eq!((m.n_layers, m.n_ff), (Some(6), Some(cfg.params.n_ff)));
    assert_eq!(m.bundle_bytes, Some(cfg.params.bundle_bytes));
    cfg.model_sha256 = Some("0f".repeat(32));
    let t = synthesize(&cfg, &fitted(), false).unwrap();
    let back = ControlTable::from_bytes(&t.to_bytes(), &PathBuf::from("t.lstab")).unwrap();
    assert_eq!(back.provenance.model().sha256, cfg.model_sha256);
}

#[test]
fn missing_conditions_are_named() {
    let mut f = fitted();
    f.fit.read_lat_us.remove(&(65536, 16));
    f.held_out.split_ratio.remove(&4);
    let e = env_for(&small_cfg(), &f).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, SynthError::MissingConditions { .. }));
    assert!(
        s.contains("/synthetic") && s.contains("qd16") && s.contains("ffn_split k4"),
        "{s}"
    );
}

#[test]
fn simulator_reports_every_policy() {
    let cfg = small_cfg();
    let f = fitted();
    let t = synthesize(&cfg, &f, false).unwrap();
    let sim = SimConfig {
        tokens: 6,
        seed: 1,
        truth: Default::default(),
    };
    let rows = compare(&t, &cfg, &f, &sim, true).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    assert_eq!(names[0], "table");
    assert!(names[1].starts_with("best_fixed"));
    assert!(names[2].starts_with("fit_fixed"));
    assert_eq!(&names[3..], ["greedy", "online_mpc"]);
    for r in &rows {
        assert!(r.mean_cost.is_finite() && r.mean_cost > 0.0 && r.p99_layer_us > 0.0);
        assert!((0.0..=1.0).contains(&r.skipped_mass), "{r:?}");
    }
    // A table that always answers action k is the fixed policy k: the best
    // of those is exactly the reported best fixed action, and the actions
    // differ in cost (else the comparison could not tell policies apart).
    let fixed: Vec<f64> = (0..t.codebook.len())
        .map(|k| {
            let mut c = t.clone();
            c.codes.fill(k as u8);
            compare(&c, &cfg, &f, &sim, false).unwrap()[0].mean_cost
        })
        .collect();
    let best = fixed.iter().copied().fold(f64::INFINITY, f64::min);
    assert_eq!(rows[1].mean_cost, best, "{fixed:?}");
    assert!(fixed.iter().any(|&c| c > best), "{fixed:?}");
    // The fit-half pick is the best fixed action replayed on the fit half,
    // costed on the held-out half; in-sample there is no such row.
    let in_sample = SimConfig {
        truth: Half::Fit,
        ..sim.clone()
    };
    let on_fit = compare(&t, &cfg, &f, &in_sample, false).unwrap();
    assert!(on_fit.iter().all(|r| !r.policy.starts_with("fit_fixed")), "{on_fit:?}");
    let pick = on_fit[1].policy.trim_start_matches("best_fixed ");
    assert_eq!(rows[2].policy.trim_start_matches("fit_fixed "), pick);
    let k = t.codebook.iter().position(|a| format!("({a})") == pick).unwrap();
    assert_eq!(rows[2].mean_cost, fixed[k]);
    assert!(rows[2].mean_cost >= rows[1].mean_cost);
    // The same seed gives the same report.
    let again = compare(&t, &cfg, &f, &sim, true).unwrap();
    assert_eq!(
        again.iter().map(|r| r.mean_cost).collect::<Vec<_>>(),
        rows.iter().map(|r| r.mean_cost).collect::<Vec<_>>()
    );
}

/// Share of the table's states whose action satisfies `f`.
fn share(t: &ControlTable, f: impl Fn(&leanstream_runtime::control::Action) -> bool) -> f64 {
    t.codes.iter().filter(|&&c| f(&t.codebook[c as usize])).count() as f64 / t.codes.len() as f64
}

#[test]
fn measured_recall_and_engine_latencies_change_what_the_table_chooses() {
    let cfg = small_cfg();
    let base = synthesize(&cfg, &fitted(), false).unwrap();

    // A predictor that covers nearly all the mass at breadth 1: reading
    // 2.5x the need buys little, so fewer states do it.
    let mut sharp = cfg.clone();
    sharp.params.recall_by_breadth = vec![(1.0, 0.995), (2.5, 1.0)];
    let t = synthesize(&sharp, &fitted(), false).unwrap();
    let wide = |a: &leanstream_runtime::control::Action| a.prefetch_breadth > 2.0;
    assert!(
        share(&t, wide) < share(&base, wide),
        "breadth 2.5 in {} of states with the measured recall, {} without",
        share(&t, wide),
        share(&base, wide)
    );

    // Two engines: one where sixteen reads in flight take barely longer
    // than one, one where they take sixteen times as long (a deep queue
    // buys nothing). Fitted to the first, the table keeps more reads in
    // flight.
    let engine = |per_read: f64| leanstream_synth::engine_fit::EngineFit {
        block: 20480,
        latency_us: [1u32, 4, 16]
            .iter()
            .map(|&q| (q, vec![900.0 + per_read * (q - 1) as f64; 101]))
            .collect(),
        ns_per_neuron: None,
        resident_rows: None,
        runs: vec![],
    };
    let table_for = |per_read: f64| {
        let mut f = fitted();
        let mut c = cfg.clone();
        engine(per_read).apply_to(&mut f, &mut c.params);
        synthesize(&c, &f, false).unwrap()
    };
    let deep = |a: &leanstream_runtime::control::Action| a.queue_depth == 16;
    let (free, costly) = (table_for(10.0), table_for(900.0));
    assert!(
        share(&free, deep) > share(&costly, deep),
        "q=16 in {} of states where a deep queue is nearly free, {} where it costs its depth",
        share(&free, deep),
        share(&costly, deep)
    );
}
