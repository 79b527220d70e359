//! Sparse FFN stages over neuron bundles: against the dense path (matmul +
//! swiglu/geglu) and a plain f32 computation, independence from arrival
//! order, SIMD/scalar agreement, and size errors.

mod common;

use common::{random_weight_row, Aligned, Rng, COLS};
use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::ops;
use leanstream_kernels::quantize::quantize_row;
use leanstream_kernels::sparse_ffn::*;
use leanstream_kernels::{matmul, ActBuffer, GgmlType, KernelError, QMatrix};

/// Not a multiple of 8, so Q4_K's dense product is one vec-dot per row too.
const N_FF: usize = 203;

/// (gate, up) weight types: same and different dot types, legacy and K quants.
const GATE_UP: [(GgmlType, GgmlType); 7] = [
    (GgmlType::Q8_0, GgmlType::Q8_0),
    (GgmlType::Q4_0, GgmlType::Q4_0),
    (GgmlType::Q4_1, GgmlType::Q5_0),
    (GgmlType::Q4K, GgmlType::Q6K),
    (GgmlType::Q5K, GgmlType::Q4_0),
    (GgmlType::F16, GgmlType::F16),
    (GgmlType::BF16, GgmlType::Q8_0),
];

struct Layer {
    format: BundleFormat,
    n_ff: usize,
    gate: Aligned,
    up: Aligned,
    /// Down matrix as the source holds it: n_embd rows of n_ff (row-major f32).
    down_f32: Vec<f32>,
    /// All bundles in neuron order.
    bundles: Aligned,
}

impl Layer {
    fn new(gate_ty: GgmlType, up_ty: GgmlType, down_ty: GgmlType, n_embd: usize, n_ff: usize, rng: &mut Rng) -> Self {
        let format = BundleFormat::new(gate_ty, up_ty, down_ty, DownLayout::Columns, n_embd).unwrap();
        let mut gate = Vec::new();
        let mut up = Vec::new();
        for _ in 0..n_ff {
            gate.extend_from_slice(random_weight_row(gate_ty, n_embd, rng).as_ref());
            up.extend_from_slice(random_weight_row(up_ty, n_embd, rng).as_ref());
        }
        let down_f32: Vec<f32> = (0..n_embd * n_ff).map(|_| rng.unit() * 0.1).collect();
        let (gb, ub) = (format.gate_bytes(), format.up_bytes());
        let mut bundles = Aligned::zeroed(n_ff * format.bundle_bytes());
        let mut column = vec![0.0f32; n_embd];
        for (i, b) in bundles.as_mut().chunks_exact_mut(format.bundle_bytes()).enumerate() {
            b[..gb].copy_from_slice(&gate[i * gb..(i + 1) * gb]);
            b[gb..gb + ub].copy_from_slice(&up[i * ub..(i + 1) * ub]);
            for (j, c) in column.iter_mut().enumerate() {
                *c = down_f32[j * n_ff + i];
            }
            quantize_row(down_ty, &column, &mut b[gb + ub..]).unwrap();
        }
        Self {
            format,
            n_ff,
            gate: Aligned::from_bytes(&gate),
            up: Aligned::from_bytes(&up),
            down_f32,
            bundles,
        }
    }

    fn bundle(&self, i: usize) -> &[u8] {
        let bb = self.format.bundle_bytes();
        &self.bundles.as_ref()[i * bb..(i + 1) * bb]
    }

    /// Down column `i` as stored, dequantized.
    fn down_col(&self, i: usize) -> Vec<f32> {
        let (_, _, down) = self.format.split(self.bundle(i)).unwrap();
        let mut out = vec![0.0; self.format.n_embd];
        dequantize_row(self.format.down_ty, down, &mut out).unwrap();
        out
    }

    /// The dense path's activations: matmul of the full gate/up matrices, then
    /// swiglu/geglu over the whole vector.
    fn dense_activations(&self, gate_acts: &ActBuffer, up_acts: &ActBuffer, act: FfnActivation) -> Vec<f32> {
        let n_embd = self.format.n_embd;
        let gate = QMatrix::new(self.format.gate_ty, self.n_ff, n_embd, self.gate.as_ref()).unwrap();
        let up = QMatrix::new(self.format.up_ty, self.n_ff, n_embd, self.up.as_ref()).unwrap();
        let mut g = vec![0.0; self.n_ff];
        let mut u = vec![0.0; self.n_ff];
        matmul(&gate, gate_acts, &mut g).unwrap();
        matmul(&up, up_acts, &mut u).unwrap();
        match act {
            FfnActivation::Silu => ops::swiglu(&mut g, &u),
            FfnActivation::GeluTanh => ops::geglu(&mut g, &u),
        }
        g
    }
}

fn acts_for(ty: GgmlType, x: &[f32]) -> ActBuffer {
    let mut buf = ActBuffer::with_capacity(x.len(), 1);
    buf.quantize(ty.vec_dot_type(), x, 1, x.len()).unwrap();
    buf
}

fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// Runs both stages over `ids`, fed in chunks in the given order.
fn run_sparse(
    layer: &Layer,
    input: &FfnInput,
    act: FfnActivation,
    ids: &[usize],
    chunk: usize,
    acts: &mut LayerActivations,
) -> Vec<f32> {
    acts.clear();
    for part in ids.chunks(chunk.max(1)) {
        let list: Vec<(usize, &[u8])> = part.iter().map(|&i| (i, layer.bundle(i))).collect();
        let mut abs = vec![0.0; list.len()];
        activations(&layer.format, input, act, &list, acts, &mut abs).unwrap();
        for (&(i, _), &m) in list.iter().zip(&abs) {
            assert_eq!(m.to_bits(), acts.get(i).unwrap().abs().to_bits());
        }
    }
    assert_eq!(acts.len(), {
        let mut u = ids.to_vec();
        u.sort_unstable();
        u.dedup();
        u.len()
    });
    let mut y = vec![0.0f32; layer.format.n_embd];
    accumulate_down(&layer.format, acts, |i| layer.bundle(i), &mut y).unwrap();
    let mut y_scalar = vec![0.0f32; layer.format.n_embd];
    accumulate_down_scalar(&layer.format, acts, |i| layer.bundle(i), &mut y_scalar).unwrap();
    assert_eq!(bits(&y), bits(&y_scalar), "SIMD and scalar stage 2 differ");
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `Σ_i a_i * down_i` in f64 over the stored (dequantized) columns, and the
/// matching `Σ |a_i * w_ij|` for tolerances.
fn reference(layer: &Layer, a: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let n_embd = layer.format.n_embd;
    let mut y = vec![0.0f64; n_embd];
    let mut mag = vec![0.0f64; n_embd];
    for (i, &ai) in a.iter().enumerate() {
        if ai == 0.0 {
            continue;
        }
        for (j, w) in layer.down_col(i).into_iter().enumerate() {
            y[j] += ai as f64 * w as f64;
            mag[j] += (ai as f64 * w as f64).abs();
        }
    }
    (y, mag)
}

fn assert_close(y: &[f32], want: &[f64], mag: &[f64], rel: f64, what: &str) {
    for (j, ((&got, &w), &m)) in y.iter().zip(want).zip(mag).enumerate() {
        let tol = rel * m + 1e-30;
        assert!(
            (got as f64 - w).abs() <= tol,
            "{what}: y[{j}] = {got}, want {w} (tol {tol})"
        );
    }
}

#[test]
fn all_neurons_match_dense_path_and_f32_and_ignore_arrival_order() {
    let mut rng = Rng::new(7);
    for (gate_ty, up_ty) in GATE_UP {
        for down_ty in [GgmlType::Q8_0, GgmlType::F16] {
            let layer = Layer::new(gate_ty, up_ty, down_ty, COLS, N_FF, &mut rng);
            let x: Vec<f32> = rng.activations(COLS);
            let (ga, ua) = (acts_for(gate_ty, &x), acts_for(up_ty, &x));
            let input = FfnInput::new(&layer.format, &ga, &ua, 0).unwrap();
            let mut acts = LayerActivations::new(N_FF);
            for act in [FfnActivation::Silu, FfnActivation::GeluTanh] {
                let what = format!("{gate_ty}/{up_ty}/{down_ty} {act:?}");
                let dense = layer.dense_activations(&ga, &ua, act);
                let ids: Vec<usize> = (0..N_FF).collect();
                let y = run_sparse(&layer, &input, act, &ids, N_FF, &mut acts);

                // Stage 1 is the dense path's per-neuron value, bit for bit.
                for (i, &d) in dense.iter().enumerate() {
                    let a = acts.get(i).unwrap();
                    assert_eq!(a.to_bits(), d.to_bits(), "{what}: a[{i}]");
                    let one = neuron_activation(&layer.format, &input, act, layer.bundle(i)).unwrap();
                    assert_eq!(one.to_bits(), d.to_bits(), "{what}: neuron_activation[{i}]");
                }

                // Stage 2 is the stored down matrix times a, to f32 summation rounding.
                let (want, mag) = reference(&layer, &dense);
                assert_close(&y, &want, &mag, 1e-5, &what);

                // Against the unconverted f32 down matrix: off by at most the
                // conversion error (Q8_0: half a step of its block, plus the
                // f16 scale's rounding; F16: half an f16 ulp).
                for j in 0..COLS {
                    let mut exact = 0.0f64;
                    let mut bound = 0.0f64;
                    for (i, &ai) in dense.iter().enumerate() {
                        let w = layer.down_f32[j * N_FF + i] as f64;
                        exact += ai as f64 * w;
                        let conv = match down_ty {
                            GgmlType::Q8_0 => {
                                let b = j / 32 * 32;
                                let amax = (b..b + 32)
                                    .map(|k| layer.down_f32[k * N_FF + i].abs())
                                    .fold(0.0f32, f32::max) as f64;
                                amax / 127.0 * 0.5 * (1.0 + 1e-3) + w.abs() * 1e-3
                            }
                            _ => w.abs() * (1.0 / 2048.0),
                        };
                        bound += (ai as f64).abs() * conv;
                    }
                    let err = (y[j] as f64 - exact).abs();
                    assert!(
                        err <= bound + 1e-5 * mag[j] + 1e-30,
                        "{what}: y[{j}] {} vs f32 {exact}: err {err} > {bound}",
                        y[j]
                    );
                }

                // Any arrival order and chunking gives the same bits.
                for round in 0..4 {
                    let mut order = ids.clone();
                    shuffle(&mut order, &mut rng);
                    if round == 3 {
                        order.reverse();
                        // Duplicates (a neuron fed twice) change nothing.
                        order.extend_from_slice(&[3, 100, 3]);
                    }
                    let chunk = 1 + (rng.next_u64() % 64) as usize;
                    let y2 = run_sparse(&layer, &input, act, &order, chunk, &mut acts);
                    assert_eq!(bits(&y), bits(&y2), "{what}: order changed the result");
                }
            }
        }
    }
}

#[test]
fn subsets_match_dense_with_other_activations_zeroed() {
    let mut rng = Rng::new(11);
    for (gate_ty, up_ty) in [GATE_UP[0], GATE_UP[2], GATE_UP[3]] {
        for down_ty in [GgmlType::Q8_0, GgmlType::F16] {
            let layer = Layer::new(gate_ty, up_ty, down_ty, COLS, N_FF, &mut rng);
            let x = rng.activations(COLS);
            let (ga, ua) = (acts_for(gate_ty, &x), acts_for(up_ty, &x));
            let input = FfnInput::new(&layer.format, &ga, &ua, 0).unwrap();
            let mut acts = LayerActivations::new(N_FF);
            let act = FfnActivation::Silu;
            let dense = layer.dense_activations(&ga, &ua, act);
            for keep_per_256 in [0u64, 20, 80, 200] {
                let ids: Vec<usize> = (0..N_FF).filter(|_| rng.next_u64() % 256 < keep_per_256).collect();
                let mut masked = vec![0.0f32; N_FF];
                for &i in &ids {
                    masked[i] = dense[i];
                }
                let mut order = ids.clone();
                shuffle(&mut order, &mut rng);
                let y = run_sparse(&layer, &input, act, &order, 7, &mut acts);
                let (want, mag) = reference(&layer, &masked);
                assert_close(&y, &want, &mag, 1e-5, &format!("{gate_ty}/{up_ty}/{down_ty} subset"));
                let y_sorted = run_sparse(&layer, &input, act, &ids, ids.len(), &mut acts);
                assert_eq!(bits(&y), bits(&y_sorted));
                if ids.is_empty() {
                    assert!(y.iter().all(|&v| v.to_bits() == 0));
                }
            }
        }
    }
}

#[test]
fn accumulate_adds_onto_existing_output() {
    let mut rng = Rng::new(3);
    let layer = Layer::new(GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0, 64, 40, &mut rng);
    let mut acts = LayerActivations::new(40);
    acts.set(5, 0.75).unwrap();
    acts.set(17, -1.5).unwrap();
    acts.set(30, 0.0).unwrap();
    let start: Vec<f32> = (0..64).map(|_| rng.unit()).collect();
    let mut y = start.clone();
    accumulate_down(&layer.format, &acts, |i| layer.bundle(i), &mut y).unwrap();
    let (c5, c17) = (layer.down_col(5), layer.down_col(17));
    for j in 0..64 {
        let want = (-1.5f32).mul_add(c17[j], 0.75f32.mul_add(c5[j], start[j]));
        assert_eq!(y[j].to_bits(), want.to_bits());
    }
    assert_eq!(acts.iter().map(|(i, _)| i).collect::<Vec<_>>(), vec![5, 17, 30]);
}

#[test]
fn axpy_simd_and_scalar_agree_bit_for_bit() {
    let mut rng = Rng::new(5);
    for (ty, n) in [
        (GgmlType::Q8_0, 32),
        (GgmlType::Q8_0, 576),
        (GgmlType::Q8_0, 4096),
        (GgmlType::F16, 1),
        (GgmlType::F16, 13),
        (GgmlType::F16, 576),
        (GgmlType::F16, 4099),
    ] {
        for _ in 0..20 {
            let col: Vec<f32> = rng.activations(n);
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
            quantize_row(ty, &col, &mut bytes).unwrap();
            let a = rng.unit() * if rng.byte() < 32 { 1e4 } else { 3.0 };
            let y0: Vec<f32> = rng.activations(n);
            let (mut y1, mut y2) = (y0.clone(), y0.clone());
            axpy_down(ty, a, &bytes, &mut y1).unwrap();
            axpy_down_scalar(ty, a, &bytes, &mut y2).unwrap();
            assert_eq!(bits(&y1), bits(&y2), "{ty} n={n}");
            let mut w = vec![0.0f32; n];
            dequantize_row(ty, &bytes, &mut w).unwrap();
            for j in 0..n {
                assert_eq!(y2[j].to_bits(), a.mul_add(w[j], y0[j]).to_bits());
            }
        }
    }
}

#[test]
fn bad_sizes_and_types_are_errors() {
    let q8 = GgmlType::Q8_0;
    assert!(matches!(
        BundleFormat::new(q8, q8, GgmlType::Q4_0, DownLayout::Columns, 64),
        Err(KernelError::UnsupportedType(_))
    ));
    assert!(matches!(
        BundleFormat::new(q8, q8, q8, DownLayout::Columns, 48),
        Err(KernelError::RaggedRow { .. })
    ));
    assert!(matches!(
        BundleFormat::new(GgmlType::Q4K, q8, q8, DownLayout::Columns, 64),
        Err(KernelError::RaggedRow { .. })
    ));
    assert!(BundleFormat::new(GgmlType::Q8K, q8, q8, DownLayout::Columns, 256).is_err());

    let mut rng = Rng::new(9);
    let layer = Layer::new(q8, GgmlType::Q4_1, GgmlType::F16, 64, 8, &mut rng);
    let f = layer.format;
    assert_eq!(f.gate_bytes(), 2 * 34);
    assert_eq!(f.up_bytes(), 2 * 20);
    assert_eq!(f.down_bytes(), 128);
    assert_eq!(f.bundle_bytes(), 68 + 40 + 128);
    let b = layer.bundle(0);
    let (g, u, d) = f.split(b).unwrap();
    assert_eq!((g.len(), u.len(), d.len()), (68, 40, 128));
    assert!(matches!(f.split(&b[1..]), Err(KernelError::ByteLength { .. })));
    let mut bad = f;
    bad.down_ty = GgmlType::Q4_0;
    assert!(bad.split(b).is_err());

    let x = rng.activations(64);
    let (ga, ua) = (acts_for(q8, &x), acts_for(GgmlType::Q4_1, &x));
    assert!(matches!(
        FfnInput::new(&f, &ua, &ua, 0),
        Err(KernelError::TypeMismatch { .. })
    ));
    assert!(FfnInput::new(&f, &ga, &ua, 1).is_err());
    let x128 = rng.activations(128);
    assert!(FfnInput::new(&f, &acts_for(q8, &x128), &ua, 0).is_err());
    let input = FfnInput::new(&f, &ga, &ua, 0).unwrap();

    let mut acts = LayerActivations::new(8);
    let act = FfnActivation::Silu;
    let mut abs = [0.0f32; 2];
    let short = &b[..b.len() - 2];
    let err = activations(&f, &input, act, &[(0, b), (1, short)], &mut acts, &mut abs);
    assert!(matches!(err, Err(KernelError::ByteLength { .. })));
    assert!(acts.is_empty(), "nothing recorded on a bad list");
    assert!(activations(&f, &input, act, &[(0, b), (8, b)], &mut acts, &mut abs).is_err());
    assert!(activations(&f, &input, act, &[(0, b)], &mut acts, &mut abs).is_err());
    assert!(neuron_activation(&f, &input, act, short).is_err());
    assert!(acts.set(8, 1.0).is_err());
    assert_eq!(acts.get(8), None);

    activations(&f, &input, act, &[(0, b), (1, layer.bundle(1))], &mut acts, &mut abs).unwrap();
    let mut y = vec![0.0f32; 64];
    assert!(accumulate_down(&f, &acts, |_| short, &mut y).is_err());
    assert!(accumulate_down(&f, &acts, |_| &[], &mut y).is_err());
    assert!(accumulate_down(&f, &acts, |i| layer.bundle(i), &mut y[..32]).is_err());
    accumulate_down(&f, &acts, |i| layer.bundle(i), &mut y).unwrap();

    let mut y = vec![0.0f32; 64];
    assert!(axpy_down(GgmlType::F16, 1.0, &d[2..], &mut y).is_err());
    assert!(axpy_down_scalar(GgmlType::F16, 1.0, &d[2..], &mut y).is_err());
    assert!(axpy_down(GgmlType::Q4_0, 1.0, d, &mut y).is_err());
    assert!(axpy_down(q8, 1.0, d, &mut y[..40]).is_err());
}

/// Throughput of both stages on Q8_0 bundles (run with `--release --ignored --nocapture`).
#[test]
#[ignore]
fn speed_q8_0_bundles() {
    use std::time::Instant;
    let mut rng = Rng::new(1);
    for n_embd in [576usize, 4096] {
        let n_ff = 1024;
        let q8 = GgmlType::Q8_0;
        let layer = Layer::new(q8, q8, q8, n_embd, n_ff, &mut rng);
        let x = rng.activations(n_embd);
        let ga = acts_for(q8, &x);
        let input = FfnInput::new(&layer.format, &ga, &ga, 0).unwrap();
        let list: Vec<(usize, &[u8])> = (0..n_ff).map(|i| (i, layer.bundle(i))).collect();
        let mut abs = vec![0.0; n_ff];
        let mut acts = LayerActivations::new(n_ff);
        let mut y = vec![0.0f32; n_embd];
        let reps = 200;
        let (mut t1, mut t2) = (0.0f64, 0.0f64);
        for _ in 0..reps {
            acts.clear();
            let t = Instant::now();
            activations(&layer.format, &input, FfnActivation::Silu, &list, &mut acts, &mut abs).unwrap();
            t1 += t.elapsed().as_secs_f64();
            let t = Instant::now();
            accumulate_down(&layer.format, &acts, |i| layer.bundle(i), &mut y).unwrap();
            t2 += t.elapsed().as_secs_f64();
        }
        let per_ms = |s: f64| (reps * n_ff) as f64 / (s * 1e3);
        println!(
            "n_embd {n_embd}: stage 1 {:.0} neurons/ms, stage 2 {:.0} neurons/ms, both {:.0} neurons/ms",
            per_ms(t1),
            per_ms(t2),
            per_ms(t1 + t2)
        );
    }
}

/// Q4_K with a multiple of 8 rows is repacked in the dense path (llama.cpp's
/// repack gemv), rounded differently from the vec-dot the bundles use: the
/// two agree to rounding, not bit for bit.
#[test]
fn repacked_q4k_dense_path_agrees_to_rounding() {
    let mut rng = Rng::new(13);
    let n_ff = 96;
    let layer = Layer::new(GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q8_0, COLS, n_ff, &mut rng);
    let x = rng.activations(COLS);
    let acts = acts_for(GgmlType::Q4K, &x);
    let input = FfnInput::new(&layer.format, &acts, &acts, 0).unwrap();
    let dense = layer.dense_activations(&acts, &acts, FfnActivation::Silu);
    let mut differ = 0;
    let mut worst = 0.0f64;
    for (i, &d) in dense.iter().enumerate() {
        let a = neuron_activation(&layer.format, &input, FfnActivation::Silu, layer.bundle(i)).unwrap();
        differ += (a.to_bits() != d.to_bits()) as usize;
        worst = worst.max(((a - d).abs() / d.abs().max(1e-3)) as f64);
    }
    println!("repacked Q4_K: {differ} of {n_ff} activations differ, worst relative {worst:e}");
    assert!(worst < 1e-3, "worst relative difference {worst}");
}

/// Converts `n` rows of `x` for `ty`'s dot type.
fn rows_for(ty: GgmlType, x: &[f32], n: usize) -> ActBuffer {
    let cols = x.len() / n;
    let mut buf = ActBuffer::with_capacity(cols, n);
    buf.quantize(ty.vec_dot_type(), x, n, cols).unwrap();
    buf
}

#[test]
fn blocked_kernels_equal_per_neuron_stages_and_their_scalar_twins() {
    let mut rng = Rng::new(41);
    for (gate_ty, up_ty) in GATE_UP {
        for down_ty in [GgmlType::Q8_0, GgmlType::F16] {
            let layer = Layer::new(gate_ty, up_ty, down_ty, COLS, N_FF, &mut rng);
            let f = layer.format;
            // Several row counts: decode, a partial tile, more than one tile.
            for n in [1usize, 3, 11] {
                let x: Vec<f32> = (0..n * COLS).map(|_| rng.unit()).collect();
                let gate_acts = rows_for(gate_ty, &x, n);
                let up_acts = rows_for(up_ty, &x, n);
                let rows = FfnRows::new(&f, &gate_acts, &up_acts).unwrap();
                for act in [FfnActivation::Silu, FfnActivation::GeluTanh] {
                    // Stage 1 over the whole layer in uneven runs.
                    let mut fast = vec![0.0f32; N_FF * n];
                    let mut slow = vec![0.0f32; N_FF * n];
                    let mut scratch = vec![0.0f32; N_FF * n];
                    let bb = f.bundle_bytes();
                    let all = layer.bundles.as_ref();
                    for (lo, hi) in [(0, 1), (1, 8), (8, 77), (77, N_FF)] {
                        let run = &all[lo * bb..hi * bb];
                        run_activations(&f, &rows, act, run, &mut fast[lo * n..hi * n], &mut scratch).unwrap();
                        run_activations_scalar(&f, &rows, act, run, &mut slow[lo * n..hi * n], &mut scratch).unwrap();
                    }
                    for t in 0..n {
                        let g1 = acts_for(gate_ty, &x[t * COLS..(t + 1) * COLS]);
                        let u1 = acts_for(up_ty, &x[t * COLS..(t + 1) * COLS]);
                        let input = FfnInput::new(&f, &g1, &u1, 0).unwrap();
                        for i in 0..N_FF {
                            let want = neuron_activation(&f, &input, act, layer.bundle(i)).unwrap();
                            assert_eq!(
                                fast[i * n + t].to_bits(),
                                want.to_bits(),
                                "{gate_ty}/{up_ty} n={n} row {t} neuron {i}"
                            );
                        }
                    }
                    // The same neurons as two matrices (gate rows, then up rows): the same bits.
                    let (gb, ub) = (f.gate_bytes(), f.up_bytes());
                    let gates: Vec<u8> = all.chunks_exact(bb).flat_map(|b| &b[..gb]).copied().collect();
                    let ups: Vec<u8> = all.chunks_exact(bb).flat_map(|b| &b[gb..gb + ub]).copied().collect();
                    let (gates, ups) = (Aligned::from_bytes(&gates), Aligned::from_bytes(&ups));
                    let mut split = vec![0.0f32; N_FF * n];
                    run_activations_split(&f, &rows, act, gates.as_ref(), ups.as_ref(), &mut split, &mut scratch)
                        .unwrap();
                    assert_eq!(bits(&split), bits(&fast), "{gate_ty}/{up_ty} n={n}: split rows");
                    // The same bundles in slots wider than a bundle (the cache's stride): the same bits.
                    let stride = (bb + 1).next_multiple_of(64);
                    let mut slots = vec![0xA5u8; (N_FF - 1) * stride + bb];
                    for (i, b) in all.chunks_exact(bb).enumerate() {
                        slots[i * stride..i * stride + bb].copy_from_slice(b);
                    }
                    let slots = Aligned::from_bytes(&slots);
                    let mut strided = vec![0.0f32; N_FF * n];
                    run_activations_strided(&f, &rows, act, slots.as_ref(), stride, N_FF, &mut strided, &mut scratch)
                        .unwrap();
                    assert_eq!(bits(&strided), bits(&fast), "{gate_ty}/{up_ty} n={n}: strided bundles");
                    let short = &slots.as_ref()[..(N_FF - 1) * stride + bb - 1];
                    assert!(
                        run_activations_strided(&f, &rows, act, short, stride, N_FF, &mut strided, &mut scratch)
                            .is_err()
                    );
                    // The scalar twin follows GGML's generic formulas: equal to rounding.
                    for (a, b) in fast.iter().zip(&slow) {
                        assert!((a - b).abs() <= 1e-3 * (1.0 + a.abs()), "{gate_ty}/{up_ty}: {a} vs {b}");
                    }
                    // Stage 2 over a sparse, per-row subset: each row equals accumulate_down.
                    let ids: Vec<u32> = (0..N_FF as u32).filter(|i| i % 3 != 1).collect();
                    let mut a = vec![0.0f32; n * N_FF];
                    for t in 0..n {
                        for &i in &ids {
                            // Row t drops some neurons of the union (a zero is skipped).
                            if !(i as usize + t).is_multiple_of(5) {
                                a[t * N_FF + i as usize] = fast[i as usize * n + t];
                            }
                        }
                    }
                    let mut ys = vec![0.25f32; n * COLS];
                    let mut ys_scalar = ys.clone();
                    run_down(&f, &ids, &a, N_FF, |i| layer.bundle(i), &mut ys).unwrap();
                    run_down_scalar(&f, &ids, &a, N_FF, |i| layer.bundle(i), &mut ys_scalar).unwrap();
                    assert_eq!(
                        bits(&ys),
                        bits(&ys_scalar),
                        "{gate_ty}/{up_ty}/{down_ty} n={n}: run_down twins"
                    );
                    // The columns kept apart from their bundles: the same bits.
                    let down_at = f.gate_bytes() + f.up_bytes();
                    let mut ys_columns = vec![0.25f32; n * COLS];
                    let column = |i: usize| &layer.bundle(i)[down_at..down_at + f.down_bytes()];
                    run_down_columns(&f, &ids, &a, N_FF, column, &mut ys_columns).unwrap();
                    assert_eq!(bits(&ys), bits(&ys_columns), "{down_ty} n={n}: run_down_columns");
                    for t in 0..n {
                        let mut la = LayerActivations::new(N_FF);
                        for &i in &ids {
                            la.set(i as usize, a[t * N_FF + i as usize]).unwrap();
                        }
                        let mut y = vec![0.25f32; COLS];
                        accumulate_down(&f, &la, |i| layer.bundle(i), &mut y).unwrap();
                        assert_eq!(bits(&ys[t * COLS..(t + 1) * COLS]), bits(&y), "{down_ty} n={n} row {t}");
                    }
                }
            }
        }
    }
}

#[test]
fn blocked_kernels_reject_bad_runs_and_ids() {
    let mut rng = Rng::new(5);
    let layer = Layer::new(GgmlType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0, COLS, 16, &mut rng);
    let f = layer.format;
    let x: Vec<f32> = (0..COLS).map(|_| rng.unit()).collect();
    let acts = rows_for(GgmlType::Q4_0, &x, 1);
    let rows = FfnRows::new(&f, &acts, &acts).unwrap();
    let (mut out, mut scratch) = (vec![0.0; 16], vec![0.0; 16]);
    let bb = f.bundle_bytes();
    let short = &layer.bundles.as_ref()[..2 * bb - 1];
    assert!(matches!(
        run_activations(&f, &rows, FfnActivation::Silu, short, &mut out, &mut scratch),
        Err(KernelError::ByteLength { .. })
    ));
    let two = &layer.bundles.as_ref()[..2 * bb];
    assert!(run_activations(&f, &rows, FfnActivation::Silu, two, &mut out[..1], &mut scratch).is_err());
    let wrong = rows_for(GgmlType::F16, &x, 1);
    assert!(matches!(
        FfnRows::new(&f, &wrong, &acts),
        Err(KernelError::TypeMismatch { .. })
    ));
    let a = vec![1.0f32; 16];
    let mut y = vec![0.0f32; COLS];
    for ids in [vec![3u32, 2], vec![4, 16]] {
        assert!(
            run_down(&f, &ids, &a, 16, |i| layer.bundle(i), &mut y).is_err(),
            "{ids:?}"
        );
    }
    assert!(
        run_down(&f, &[1], &a, 16, |_| &[][..], &mut y).is_err(),
        "a missing bundle is an error"
    );
}

/// With the matrix's row count, stage 1 computes as the dense path's matmul
/// does, repacked Q4_K (rows a multiple of 8) and the tiled K-quant products
/// (8+ activation rows) included: bit for bit its gate and up products.
#[test]
fn blocked_stage1_as_a_matrix_equals_the_dense_matmul() {
    let mut rng = Rng::new(43);
    let n_ff = 208;
    for (gate_ty, up_ty) in [(GgmlType::Q4K, GgmlType::Q4K), (GgmlType::Q6K, GgmlType::Q5K)] {
        let layer = Layer::new(gate_ty, up_ty, GgmlType::Q8_0, COLS, n_ff, &mut rng);
        let f = layer.format;
        for n in [1usize, 3, 9, 12] {
            let x: Vec<f32> = (0..n * COLS).map(|_| rng.unit()).collect();
            let (gate_acts, up_acts) = (rows_for(gate_ty, &x, n), rows_for(up_ty, &x, n));
            let rows = FfnRows::new(&f, &gate_acts, &up_acts).unwrap().as_matrix_of(n_ff);
            let mut fast = vec![0.0f32; n_ff * n];
            let mut scratch = vec![0.0f32; n_ff * n];
            let bb = f.bundle_bytes();
            // Uneven runs: the arithmetic does not depend on where a run starts.
            for (lo, hi) in [(0, 5), (5, 100), (100, n_ff)] {
                let run = &layer.bundles.as_ref()[lo * bb..hi * bb];
                run_activations(
                    &f,
                    &rows,
                    FfnActivation::Silu,
                    run,
                    &mut fast[lo * n..hi * n],
                    &mut scratch,
                )
                .unwrap();
            }
            let mut g = vec![0.0f32; n * n_ff];
            let mut u = vec![0.0f32; n * n_ff];
            let gm = QMatrix::new(gate_ty, n_ff, COLS, layer.gate.as_ref()).unwrap();
            let um = QMatrix::new(up_ty, n_ff, COLS, layer.up.as_ref()).unwrap();
            matmul(&gm, &gate_acts, &mut g).unwrap();
            matmul(&um, &up_acts, &mut u).unwrap();
            ops::swiglu(&mut g, &u);
            for t in 0..n {
                for i in 0..n_ff {
                    assert_eq!(
                        fast[i * n + t].to_bits(),
                        g[t * n_ff + i].to_bits(),
                        "{gate_ty}/{up_ty} n={n} row {t} neuron {i}"
                    );
                }
            }
        }
    }
}
