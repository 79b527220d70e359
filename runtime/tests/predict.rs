//! Activation predictors (`runtime::predict`): file round trips, scalar/SIMD
//! agreement, a hand-computed stacked-hashing case, hostile files and sizes.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use leanstream_runtime::generate::sampler::Rng;
use leanstream_runtime::predict::{
    top_groups, ComputePath, HashStage, HashingLayer, PredictError, Predictor, PredictorConfig, PredictorLayer,
    QuantMatrix,
};
use sha2::{Digest, Sha256};

/// Counts allocations per thread, so tests running in parallel do not
/// disturb each other's counts.
struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(|c| c.get())
}

fn tmp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("leanstream-predict-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn hashing_config() -> PredictorConfig {
    // 37 keys: four full AVX-512 chunks plus a partial one; 20 groups: one
    // 16-lane i16 add plus a tail.
    PredictorConfig::hashing(96, 40, 2, 3, 8, 12, 37, 3)
}

fn low_rank_config() -> PredictorConfig {
    PredictorConfig::low_rank(64, 48, 1, 2, 16)
}

fn random_input(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * 3.0).collect()
}

fn all_scores(p: &Predictor, x: &[f32], path: ComputePath) -> Vec<Vec<f32>> {
    let mut s = p.scratch();
    let mut out = vec![0.0; p.n_groups()];
    let mut all = Vec::new();
    for u in 0..p.uses.len() {
        for l in 0..p.config.n_layer {
            p.scores(u, l, x, path, &mut s, &mut out).unwrap();
            all.push(out.clone());
        }
    }
    all
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|r| r.iter().map(|f| f.to_bits()).collect()).collect()
}

/// Re-seals a body (everything before the checksum) with a fresh SHA-256, so
/// that the checks after the checksum are exercised.
fn reseal(body: &[u8]) -> Vec<u8> {
    let mut b = body.to_vec();
    let sum = Sha256::digest(&b);
    b.extend_from_slice(&sum);
    b
}

#[test]
fn save_load_round_trip_both_kinds() {
    for (name, cfg) in [("h.lspred", hashing_config()), ("l.lspred", low_rank_config())] {
        let mut p = Predictor::random(cfg, &["speculate", "refine"], 7).unwrap();
        p.provenance = r#"{"model":"test","recall":0.9}"#.into();
        let path = tmp_path(name);
        p.save(&path).unwrap();
        let q = Predictor::load(&path).unwrap();
        assert_eq!(p, q, "{name}");
        assert_eq!(q.use_index("refine"), Some(1));
        assert_eq!(q.use_index("nope"), None);
        let mut rng = Rng::new(3);
        for _ in 0..5 {
            let x = random_input(&mut rng, cfg.d_model);
            assert_eq!(
                bits(&all_scores(&p, &x, ComputePath::Scalar)),
                bits(&all_scores(&q, &x, ComputePath::Scalar))
            );
            assert_eq!(
                bits(&all_scores(&p, &x, ComputePath::best())),
                bits(&all_scores(&q, &x, ComputePath::best()))
            );
        }
        assert_eq!(q.to_bytes(), std::fs::read(&path).unwrap());
        assert_eq!(p.weight_bytes() as u64, cfg.layer_bytes() * cfg.n_layer as u64 * 2);
    }
}

#[test]
fn scalar_and_simd_are_bit_identical() {
    if ComputePath::best() != ComputePath::Simd {
        println!("skipping the SIMD comparison: this CPU lacks AVX2");
        return;
    }
    // The low-rank scores are continuous in the projection, so a many-block
    // d_model catches any change of the float summation order.
    let configs = [
        hashing_config(),
        low_rank_config(),
        PredictorConfig::hashing(128, 64, 1, 1, 16, 64, 9, 5),
        PredictorConfig::low_rank(512, 40, 2, 1, 24),
    ];
    for cfg in configs {
        for seed in 0..3 {
            let p = Predictor::random(cfg, &["speculate"], seed).unwrap();
            let mut rng = Rng::new(100 + seed);
            let mut inputs: Vec<Vec<f32>> = (0..200).map(|_| random_input(&mut rng, cfg.d_model)).collect();
            let mut outlier = random_input(&mut rng, cfg.d_model);
            outlier[5] = 1e30;
            outlier[cfg.d_model - 1] = -3e29;
            inputs.push(outlier);
            inputs.push(vec![0.0; cfg.d_model]);
            let mut tiny = random_input(&mut rng, cfg.d_model);
            tiny.iter_mut().for_each(|v| *v *= 1e-30);
            inputs.push(tiny);
            let mut distinct = std::collections::HashSet::new();
            for x in &inputs {
                let a = all_scores(&p, x, ComputePath::Scalar);
                let b = all_scores(&p, x, ComputePath::Simd);
                assert_eq!(bits(&a), bits(&b), "config {cfg:?} seed {seed}");
                assert!(a.iter().flatten().all(|v| v.is_finite()));
                distinct.insert(bits(&a));
            }
            // The inputs must actually exercise different outcomes.
            assert!(distinct.len() > 10, "only {} distinct score vectors", distinct.len());
        }
    }
}

/// d_model 32, d 2, tau 2, two keys, two stages, three groups of one neuron.
fn tiny(shift0: [f32; 2]) -> Predictor {
    let cfg = PredictorConfig::hashing(32, 3, 1, 1, 2, 2, 2, 2);
    let mut q = vec![0i8; 64];
    q[0] = 1; // z0 = +x0 (after normalisation)
    q[32] = -1; // z1 = -x0
    let identity = vec![1.0, 0.0, 0.0, 1.0];
    let stage = |shift: Vec<f32>, lut: Vec<i8>| HashStage {
        planes: identity.clone(),
        offsets: vec![0.0, 0.0],
        keys: vec![0b01, 0b10],
        shift,
        lut,
    };
    let layer = HashingLayer {
        proj: QuantMatrix {
            rows: 2,
            cols: 32,
            q,
            scales: vec![1.0, 1.0],
        },
        stages: vec![
            // Key 0 moves z far into the quadrant of key 1.
            stage(vec![shift0[0], shift0[1], 0.0, 0.0], vec![1, 2, 3, 10, 20, 30]),
            stage(vec![0.0; 4], vec![-1, -1, -1, 5, 6, 7]),
        ],
        bias: vec![0.0, 0.5, -1.0],
        lut_scale: 0.5,
    };
    let p = Predictor {
        config: cfg,
        provenance: "{}".into(),
        uses: vec!["refine".into()],
        layers: vec![vec![PredictorLayer::Hashing(layer)]],
    };
    p.validate(Path::new("<tiny>")).unwrap();
    p
}

fn score_one(p: &Predictor, x: &[f32], path: ComputePath) -> Vec<f32> {
    let mut s = p.scratch();
    let mut out = vec![0.0; p.n_groups()];
    p.scores(0, 0, x, path, &mut s, &mut out).unwrap();
    out
}

#[test]
fn hand_computed_stacked_hashing() {
    let stacked = tiny([-100.0, 100.0]);
    let plain = tiny([0.0, 0.0]);
    let mut x = vec![0.0f32; 32];
    x[0] = 1.0;
    for path in [ComputePath::Scalar, ComputePath::best()] {
        // z = (+a, -a): code 0b01 -> key 0 (lut 1,2,3; shift to (-, +)),
        // stage 2 code 0b10 -> key 1 (5,6,7): (6,8,10) · 0.5 + bias (0,0.5,-1).
        assert_eq!(score_one(&stacked, &x, path), vec![3.0, 4.5, 4.0]);
        // Without the shift stage 2 sees code 0b01 again -> key 0 (-1,-1,-1):
        // (0,1,2) · 0.5 + bias.
        assert_eq!(score_one(&plain, &x, path), vec![0.0, 1.0, 0.0]);
        // x0 < 0: code 0b10 -> key 1 (10,20,30), no shift, key 1 again (5,6,7):
        // (15,26,37) · 0.5 + bias.
        let neg: Vec<f32> = x.iter().map(|v| -v).collect();
        assert_eq!(score_one(&stacked, &neg, path), vec![7.5, 13.5, 17.5]);
        // All zero: z = 0, code 0b00 ties both keys -> the first (key 0),
        // whose shift then selects key 1: same as the first case.
        assert_eq!(score_one(&stacked, &[0.0; 32], path), vec![3.0, 4.5, 4.0]);
        assert_eq!(score_one(&plain, &[0.0; 32], path), vec![0.0, 1.0, 0.0]);
    }
}

fn expect_invalid(r: Result<Predictor, PredictError>, want_field: &str, path: &Path) {
    match r {
        Err(e @ PredictError::Invalid { .. }) => {
            let PredictError::Invalid { field, .. } = &e else {
                unreachable!()
            };
            assert_eq!(*field, want_field, "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains(&path.display().to_string()) && msg.contains(want_field),
                "{msg}"
            );
        }
        other => panic!("expected an invalid `{want_field}`, got {other:?}"),
    }
}

#[test]
fn corrupt_files_are_errors() {
    let path = Path::new("/models/test.lspred");
    let p = Predictor::random(hashing_config(), &["speculate"], 1).unwrap();
    let good = p.to_bytes();
    assert!(Predictor::from_bytes(&good, path).is_ok());
    let body = &good[..good.len() - 32];

    // Truncated anywhere: the checksum no longer matches.
    for cut in [1, 10, 1000, good.len() - 45] {
        let r = Predictor::from_bytes(&good[..good.len() - cut], path);
        assert!(matches!(r, Err(PredictError::Checksum { .. })), "cut {cut}: {r:?}");
    }
    // Too short to hold a checksum, and truncated headers with a valid checksum.
    let r = Predictor::from_bytes(&good[..20], path);
    assert!(
        matches!(r, Err(PredictError::Truncated { field: "checksum", .. })),
        "{r:?}"
    );
    let r = Predictor::from_bytes(&reseal(&body[..14]), path);
    match r {
        Err(
            e @ PredictError::Truncated {
                field: "provenance", ..
            },
        ) => {
            assert!(e.to_string().contains("/models/test.lspred"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let prov_end = 16 + p.provenance.len();
    let r = Predictor::from_bytes(&reseal(&body[..prov_end + 3]), path);
    assert!(
        matches!(r, Err(PredictError::Truncated { field: "d_model", .. })),
        "{r:?}"
    );
    // Parameters cut short with a valid checksum: the size check names the layers.
    expect_invalid(
        Predictor::from_bytes(&reseal(&body[..body.len() - 100]), path),
        "layers",
        path,
    );

    // A flipped byte.
    for at in [13, prov_end + 2, good.len() / 2, good.len() - 1] {
        let mut b = good.clone();
        b[at] ^= 0x10;
        let r = Predictor::from_bytes(&b, path);
        assert!(matches!(r, Err(PredictError::Checksum { .. })), "byte {at}: {r:?}");
    }
    // Bad magic, bad version.
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(
        Predictor::from_bytes(&b, path),
        Err(PredictError::Magic { .. })
    ));
    let mut b = body.to_vec();
    b[8] = 2;
    assert!(matches!(
        Predictor::from_bytes(&reseal(&b), path),
        Err(PredictError::Version { found: 2, .. })
    ));

    // A key with a bit at tau.
    let mut bad = p.clone();
    let PredictorLayer::Hashing(l) = &mut bad.layers[0][1] else {
        unreachable!()
    };
    l.stages[2].keys[5] |= 1 << hashing_config().tau;
    expect_invalid(Predictor::from_bytes(&bad.to_bytes(), path), "keys", path);
    assert!(bad.save(&tmp_path("bad.lspred")).is_err());
    // A -128 projection weight (the AVX2 sign trick cannot take it).
    let mut bad = p.clone();
    let PredictorLayer::Hashing(l) = &mut bad.layers[0][0] else {
        unreachable!()
    };
    l.proj.q[3] = -128;
    expect_invalid(Predictor::from_bytes(&bad.to_bytes(), path), "proj", path);
    // A NaN plane.
    let mut bad = p.clone();
    let PredictorLayer::Hashing(l) = &mut bad.layers[0][2] else {
        unreachable!()
    };
    l.stages[0].planes[0] = f32::NAN;
    expect_invalid(Predictor::from_bytes(&bad.to_bytes(), path), "planes", path);

    // Header fields patched (and re-sealed): d_model not a multiple of 32,
    // group not dividing n_ff, huge counts, an unknown kind.
    let patch = |at: usize, v: u32| {
        let mut b = body.to_vec();
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        reseal(&b)
    };
    let kind_at = prov_end;
    expect_invalid(Predictor::from_bytes(&patch(kind_at + 1, 48), path), "d_model", path);
    expect_invalid(Predictor::from_bytes(&patch(kind_at + 9, 3), path), "group", path);
    expect_invalid(
        Predictor::from_bytes(&patch(kind_at + 13, u32::MAX), path),
        "n_layer",
        path,
    );
    expect_invalid(Predictor::from_bytes(&patch(kind_at + 13, 1000), path), "layers", path);
    expect_invalid(Predictor::from_bytes(&patch(kind_at + 21, 65), path), "tau", path);
    expect_invalid(
        Predictor::from_bytes(&patch(kind_at + 25, u32::MAX), path),
        "keys",
        path,
    );
    expect_invalid(Predictor::from_bytes(&patch(kind_at + 33, 0), path), "uses", path);
    expect_invalid(Predictor::from_bytes(&patch(12, u32::MAX), path), "provenance", path);
    let mut b = body.to_vec();
    b[kind_at] = 9;
    expect_invalid(Predictor::from_bytes(&reseal(&b), path), "kind", path);

    // A missing file names the path.
    let e = Predictor::load(Path::new("/nonexistent/x.lspred")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/x.lspred"), "{e}");
}

#[test]
fn bad_call_arguments_are_errors() {
    let p = Predictor::random(low_rank_config(), &["refine"], 2).unwrap();
    let mut s = p.scratch();
    let mut out = vec![0.0; p.n_groups()];
    let x = vec![0.5; 64];
    let arg = |r: Result<(), PredictError>, f: &str| match r {
        Err(PredictError::Argument { field, .. }) => assert_eq!(field, f),
        other => panic!("expected a bad `{f}`, got {other:?}"),
    };
    arg(p.scores(1, 0, &x, ComputePath::Scalar, &mut s, &mut out), "use");
    arg(p.scores(0, 2, &x, ComputePath::Scalar, &mut s, &mut out), "layer");
    arg(p.scores(0, 0, &x[..32], ComputePath::Simd, &mut s, &mut out), "x");
    arg(p.scores(0, 0, &x, ComputePath::Simd, &mut s, &mut out[..3]), "out");
    let mut inf = x.clone();
    inf[7] = f32::INFINITY;
    arg(p.scores(0, 0, &inf, ComputePath::Simd, &mut s, &mut out), "x");
    let other = Predictor::random(hashing_config(), &["refine"], 2).unwrap();
    arg(
        p.scores(0, 0, &x, ComputePath::Simd, &mut other.scratch(), &mut out),
        "scratch",
    );
    // A hand-built predictor with a short vector is refused, not indexed out of bounds.
    let mut broken = p.clone();
    let PredictorLayer::LowRank(l) = &mut broken.layers[0][1] else {
        unreachable!()
    };
    l.w1.q.truncate(100);
    arg(
        broken.scores(0, 1, &x, ComputePath::Simd, &mut s, &mut out),
        "predictor",
    );
    assert!(p.scores(0, 1, &x, ComputePath::Simd, &mut s, &mut out).is_ok());
}

#[test]
fn mistral_7b_shape_sizes() {
    let cfg = PredictorConfig::hashing(4096, 14336, 4, 32, 32, 16, 8, 4);
    let p = Predictor::random(cfg, &["speculate", "refine"], 42).unwrap();
    let (dm, g, d, tau, k, s, layers, uses) = (4096, 14336 / 4, 32, 16, 8, 4, 32, 2);
    // proj i8 + row scales, per stage planes/offsets (f32), keys (u64), shift (f32), lut (i8),
    // then bias (f32) and lut_scale (f32).
    let per_layer = d * dm + 4 * d + s * (4 * tau * d + 4 * tau + 8 * k + 4 * k * d + k * g) + 4 * g + 4;
    assert_eq!(per_layer, 273_028);
    assert_eq!(p.weight_bytes(), per_layer * layers * uses);
    assert_eq!(p.scratch_bytes(), dm + 4 * d + 2 * g);
    // And the low-rank baseline at the same shape, rank 128.
    let lr = PredictorConfig::low_rank(4096, 14336, 4, 32, 128);
    let q = Predictor::random(lr, &["speculate"], 42).unwrap();
    let r = 128;
    assert_eq!(q.weight_bytes(), (r * dm + 8 * r + g * r + 8 * g) * layers);
    // Scores run at this shape on both paths and agree.
    let mut rng = Rng::new(9);
    let x = random_input(&mut rng, dm);
    let mut sc = p.scratch();
    let (mut a, mut b) = (vec![0.0; g], vec![0.0; g]);
    p.scores(1, 31, &x, ComputePath::Scalar, &mut sc, &mut a).unwrap();
    p.scores(1, 31, &x, ComputePath::best(), &mut sc, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn top_groups_picks_the_best_without_reallocating() {
    let scores = [0.1, 3.0, -2.0, 3.0, 0.5, 2.0];
    let mut idx = Vec::with_capacity(scores.len());
    let cap = idx.capacity();
    assert_eq!(top_groups(&scores, 3, &mut idx), &[1, 3, 5]);
    assert_eq!(top_groups(&scores, 0, &mut idx), &[] as &[u32]);
    assert_eq!(top_groups(&scores, 99, &mut idx), &[1, 3, 5, 4, 0, 2]);
    assert_eq!(top_groups(&scores, 1, &mut idx), &[1]);
    assert_eq!(idx.capacity(), cap);
}

#[test]
fn scores_and_top_groups_do_not_allocate() {
    for cfg in [hashing_config(), low_rank_config()] {
        let p = Predictor::random(cfg, &["speculate", "refine"], 5).unwrap();
        let mut rng = Rng::new(11);
        let inputs: Vec<Vec<f32>> = (0..20).map(|_| random_input(&mut rng, cfg.d_model)).collect();
        let mut s = p.scratch();
        let mut out = vec![0.0; p.n_groups()];
        let mut idx = Vec::with_capacity(p.n_groups());
        let before = allocs();
        for x in &inputs {
            for path in [ComputePath::Scalar, ComputePath::Simd] {
                for l in 0..cfg.n_layer {
                    p.scores(1, l, x, path, &mut s, &mut out).unwrap();
                    assert!(!top_groups(&out, 4, &mut idx).is_empty());
                }
            }
        }
        assert_eq!(allocs() - before, 0, "{cfg:?}");
        // The counter works: an error message allocates.
        assert!(p
            .scores(0, 0, &inputs[0][..32], ComputePath::Simd, &mut s, &mut out)
            .is_err());
        assert!(allocs() > before);
    }
}
