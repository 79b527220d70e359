//! The adaptive profile's decision sensitivity: zero where a distribution
//! has no uncertainty, positive where resampling a thin distribution moves
//! the table's actions, and deterministic.

mod common;

use common::{fitted, small_cfg};
use leanstream_synth::adaptive::{sensitivity, Key};
use leanstream_synth::fit::Empirical;

fn keys() -> Vec<Key> {
    vec![
        Key::Read(1),
        Key::Read(4),
        Key::Read(16),
        Key::Stage,
        Key::Split(1),
        Key::Split(4),
    ]
}

#[test]
fn distributions_without_uncertainty_move_no_decision() {
    let cfg = small_cfg();
    let mut f = fitted();
    // Every sample of every distribution the same value: a bootstrap
    // resample is the distribution itself.
    let flat = |e: &Empirical| Empirical::new(vec![e.median(); e.len()]);
    for e in f.fit.read_lat_us.values_mut().chain(f.fit.read_bw.values_mut()) {
        *e = flat(e);
    }
    f.fit.ns_per_neuron = flat(&f.fit.ns_per_neuron);
    for e in f.fit.split_ratio.values_mut() {
        *e = flat(e);
    }
    let s = sensitivity(&cfg, &f, &keys(), 64, 2).unwrap();
    assert!(s.iter().all(|&x| x == 0.0), "{s:?}");
}

#[test]
fn a_thinly_sampled_distribution_that_decisions_depend_on_is_sensitive() {
    let cfg = small_cfg();
    let mut f = fitted();
    // Read latency at depth 16 from 24 samples spread over 10x: its
    // bootstrap swings the expected read time, and with it the choice of
    // queue depth and deadline.
    let e = &f.fit.read_lat_us[&(65536, 16)];
    let wide: Vec<f64> = (0..24).map(|i| e.median() * (0.2 + 0.4 * (i % 6) as f64)).collect();
    f.fit.read_lat_us.insert((65536, 16), Empirical::new(wide));
    let s = sensitivity(&cfg, &f, &keys(), 96, 3).unwrap();
    assert!(s[2] > 0.0, "read qd16: {s:?}");
    assert_eq!(s, sensitivity(&cfg, &f, &keys(), 96, 3).unwrap(), "not deterministic");
    // Its uncertainty moves more decisions than the well-sampled split ratios'.
    assert!(s[2] > s[4] && s[2] > s[5], "{s:?}");
}
