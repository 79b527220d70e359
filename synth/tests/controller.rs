//! Solver against enumeration, determinism, condition checks, table round trip.

mod common;

use std::path::PathBuf;

use common::{fitted, small_cfg};
use leanstream_runtime::control::{ControlState, ControlTable};
use leanstream_runtime::generate::sampler::Rng;
use leanstream_synth::model::{step, Draw};
use leanstream_synth::sim::{compare, Half, SimConfig};
use leanstream_synth::solve::{
    first_action_values, prefetch_levels, solve_dp, solve_enumerate, solve_milp, Instance, Solver,
};
use leanstream_synth::synth::{deepest_queue_first, env_for, state_at, synthesize};
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
fn backward_induction_matches_enumeration_and_breaks_ties_as_asked() {
    let mut r = Rng::with_stream(43, 0);
    for case in 0..60 {
        let (na, nb, ns, nt) = (2 + case % 5, 1 + case % 3, 1 + case % 4, case % 4);
        let inst = random_instance(&mut r, na, nb, ns, nt);
        let values = first_action_values(&inst);
        for (a, v) in values.iter().enumerate() {
            let e = inst.enumerate_value(a);
            assert!((v - e).abs() < 1e-9 * e.max(1.0), "case {case} action {a}: {v} vs {e}");
        }
        let e = solve_enumerate(&inst);
        let order: Vec<usize> = (0..na).rev().collect();
        let d = solve_dp(&inst, &order);
        assert!(
            (d.objective - e.objective).abs() < 1e-9 * e.objective.max(1.0),
            "case {case}"
        );
        assert_eq!(d.objective, d.solver_objective);
    }
    // Actions 0 and 2 have identical rows and are cheaper than 1 by more
    // than any recourse can make up: they tie, and the preference decides.
    let mut inst = random_instance(&mut r, 3, 2, 3, 2);
    for s in 0..3 {
        inst.first_cost[s][0] = 0.0;
        inst.first_cost[s][2] = 0.0;
        inst.first_next[s][2] = inst.first_next[s][0];
        inst.first_cost[s][1] = 1000.0;
    }
    assert_eq!(solve_dp(&inst, &[2, 0, 1]).action, 2);
    assert_eq!(solve_dp(&inst, &[0, 2, 1]).action, 0);
    assert_eq!(
        solve_dp(&inst, &[1, 0, 2]).action,
        0,
        "a dearer action is never preferred"
    );
}

#[test]
fn the_dp_tie_rule_puts_deep_queues_first_and_solvers_are_named() {
    let cfg = small_cfg();
    let (env, _) = env_for(&cfg, &fitted()).unwrap();
    let order = deepest_queue_first(&env.codebook);
    assert_eq!(order.len(), env.codebook.len());
    for w in order.windows(2) {
        let (a, b) = (&env.codebook[w[0]], &env.codebook[w[1]]);
        assert!(a.queue_depth > b.queue_depth || (a.queue_depth == b.queue_depth && w[0] < w[1]));
    }
    assert_eq!("milp".parse::<Solver>().unwrap(), Solver::Milp);
    let e = "simplex".parse::<Solver>().unwrap_err().to_string();
    assert!(e.contains("solver") && e.contains("simplex"), "{e}");
}

#[test]
fn every_solver_reaches_the_same_optimum_on_model_instances() {
    let cfg = small_cfg();
    let f = fitted();
    let (env, axes) = env_for(&cfg, &f).unwrap();
    let n: usize = axes.iter().map(|a| a.bins()).product();
    let order = deepest_queue_first(&env.codebook);
    for i in (0..n).step_by(5) {
        let mut rng = Rng::with_stream(11, i as u64);
        let inst = Instance::build(&env, &state_at(&axes, i), &cfg.solver, &mut rng);
        let e = solve_enumerate(&inst);
        let d = solve_dp(&inst, &order);
        assert!(
            (d.objective - e.objective).abs() <= 1e-9 * e.objective.abs().max(1.0),
            "state {i}: {d:?} vs {e:?}"
        );
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
    // than one, one where they take longer than sixteen reads one after
    // another (a deep queue costs). Fitted to the first, the table keeps
    // more reads in flight. A read takes 50 µs alone, so reads can meet the
    // deadlines: where none can, every depth costs the same and the
    // solver's tie rule alone picks one.
    let engine = |per_read: f64| leanstream_synth::engine_fit::EngineFit {
        block: 20480,
        latency_us: [1u32, 4, 16]
            .iter()
            .map(|&q| (q, vec![50.0 + per_read * (q - 1) as f64; 101]))
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
    let (free, costly) = (table_for(1.0), table_for(75.0));
    assert!(
        share(&free, deep) > share(&costly, deep),
        "q=16 in {} of states where a deep queue is nearly free, {} where it costs its depth",
        share(&free, deep),
        share(&costly, deep)
    );
}

#[test]
fn reads_between_profiled_depths_take_an_interpolated_wave_and_queued_bytes_count() {
    let mut cfg = small_cfg();
    cfg.space.queue_depths = vec![1, 4, 16];
    let (env, _) = env_for(&cfg, &fitted()).unwrap();
    // Wave latencies 190, 310 and 790 µs at depths 1, 4, 16; no compute noise.
    let draw = Draw {
        lat_us: vec![190.0, 310.0, 790.0],
        split: vec![1.0; env.ks.len()],
        compute_noise: 1.0,
    };
    let action = *env
        .codebook
        .iter()
        .find(|a| a.stages == 1 && a.queue_depth == 16 && a.prefetch_breadth == 1.0 && a.deadline_factor == 16.0)
        .unwrap();
    let block = env.params.block as f64;
    let layer_us = |reads: f64, queued_blocks: f64| {
        let x = ControlState {
            queued_bytes: queued_blocks * block,
            missing_bytes: (reads + queued_blocks) * block,
            read_bw_bytes_s: env.bw_median,
            compute_ns_per_neuron: 1000.0,
            layer_position: 0.0,
        };
        let o = step(&env, &x, &action, &draw);
        // One stage: the read, then the compute of everything that landed.
        let tc = (reads + queued_blocks) * block / env.params.bundle_bytes;
        assert!(o.late_bytes < 1e-6 * block, "the deadline is far");
        o.layer_us - tc
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b;
    // 8 reads at depth 16: a third of the way from depth 4's wave to 16's,
    // not depth 4's wave (the old rounding made 4..15 reads cost the same).
    assert!(close(layer_us(8.0, 0.0), 470.0), "{}", layer_us(8.0, 0.0));
    assert!(close(layer_us(5.0, 3.0), 350.0), "{}", layer_us(5.0, 3.0));
    assert!(close(layer_us(16.0, 0.0), 790.0));
    assert!(close(layer_us(4.0, 0.0), 310.0));
    assert!(close(layer_us(32.0, 0.0), 2.0 * 790.0), "two full waves");
}

#[test]
fn a_prefetch_that_covers_the_next_layer_is_a_level_of_its_own() {
    let cfg = small_cfg();
    let (env, _) = env_for(&cfg, &fitted()).unwrap();
    let layer = env.params.n_ff as f64 * env.params.bundle_bytes;
    let x = ControlState {
        queued_bytes: 0.0,
        missing_bytes: 0.1 * layer,
        read_bw_bytes_s: env.bw_median,
        // Compute slow enough that the idle I/O time prefetches the whole load.
        compute_ns_per_neuron: 50_000.0,
        layer_position: 0.0,
    };
    let levels = prefetch_levels(&env, &x, 4);
    let top = 2.5 * 0.1 * layer;
    assert_eq!(levels.len(), 4);
    for (i, l) in levels.iter().enumerate() {
        assert!((l - top * i as f64 / 3.0).abs() < 1e-6 * top, "{levels:?}");
    }
    // The widest breadth's load is capped at the layer.
    let big = ControlState {
        missing_bytes: 0.9 * layer,
        ..x
    };
    assert!((prefetch_levels(&env, &big, 4)[3] - layer).abs() < 1e-6 * layer);

    let wide = env
        .codebook
        .iter()
        .position(|a| a.stages == 1 && a.prefetch_breadth == 2.5 && a.queue_depth == 16)
        .unwrap();
    let mut rng = Rng::with_stream(5, 0);
    let inst = Instance::build(&env, &x, &cfg.solver, &mut rng);
    for s in 0..inst.scenarios() {
        assert_eq!(
            inst.first_next[s][wide],
            inst.n_bins - 1,
            "scenario {s}: the next layer is all prefetched"
        );
    }
}
