//! The SIMD kernels and their scalar twins must agree for every type, to
//! within the rounding of their different summation orders.

mod common;

use common::{random_weight_row, Aligned, Rng, WEIGHT_TYPES};
use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::dot::{has_avx2, vec_dot, vec_dot_scalar};
use leanstream_kernels::quantize::quantize_row;
use leanstream_kernels::{GgmlType, KernelError};

/// Activations `x` converted to the dot type of `ty`.
fn activation_row(ty: GgmlType, x: &[f32]) -> Aligned {
    let dot_ty = ty.vec_dot_type();
    let mut row = Aligned::zeroed(dot_ty.row_bytes(x.len()).unwrap());
    quantize_row(dot_ty, x, row.as_mut()).unwrap();
    row
}

/// Σ |w_i · a_i| in f64: the scale the rounding error is measured against.
fn magnitude(ty: GgmlType, w: &[u8], a: &[u8], n: usize) -> f64 {
    let mut wf = vec![0.0f32; n];
    let mut af = vec![0.0f32; n];
    dequantize_row(ty, w, &mut wf).unwrap();
    dequantize_row(ty.vec_dot_type(), a, &mut af).unwrap();
    wf.iter().zip(&af).map(|(&x, &y)| (x as f64 * y as f64).abs()).sum()
}

/// Worst-case rounding bound for the longest float summation either side
/// performs: one add per 32 values plus the final reductions.
fn tolerance(n: usize, magnitude: f64) -> f64 {
    (n / 32 + 16) as f64 * f32::EPSILON as f64 * magnitude
}

#[test]
fn simd_and_scalar_dots_agree_for_every_type() {
    if !has_avx2() {
        eprintln!("no AVX2 on this machine: both paths are the scalar kernels");
    }
    let mut rng = Rng::new(7);
    for ty in WEIGHT_TYPES {
        for n in [256usize, 512, 2048] {
            for _ in 0..12 {
                let w = random_weight_row(ty, n, &mut rng);
                let x = rng.activations(n);
                let a = activation_row(ty, &x);
                let simd = vec_dot(ty, w.as_ref(), a.as_ref(), n).unwrap();
                let scalar = vec_dot_scalar(ty, w.as_ref(), a.as_ref(), n).unwrap();
                let mag = magnitude(ty, w.as_ref(), a.as_ref(), n);
                let diff = (simd as f64 - scalar as f64).abs();
                assert!(
                    diff <= tolerance(n, mag),
                    "{ty} n={n}: simd {simd} vs scalar {scalar} (diff {diff:e}, magnitude {mag:e})"
                );
            }
        }
    }
}

#[test]
fn dots_match_dequantized_reference() {
    // Independent of both kernels: the dot of the dequantized rows in f64.
    // Loose only where GGML itself rounds (Q8_1's f16 sum `s`).
    let mut rng = Rng::new(11);
    for ty in WEIGHT_TYPES {
        let n = 1024;
        let w = random_weight_row(ty, n, &mut rng);
        let x = rng.activations(n);
        let a = activation_row(ty, &x);
        let mut wf = vec![0.0f32; n];
        let mut af = vec![0.0f32; n];
        dequantize_row(ty, w.as_ref(), &mut wf).unwrap();
        dequantize_row(ty.vec_dot_type(), a.as_ref(), &mut af).unwrap();
        let reference: f64 = wf.iter().zip(&af).map(|(&p, &q)| p as f64 * q as f64).sum();
        let mag = magnitude(ty, w.as_ref(), a.as_ref(), n);
        let got = vec_dot(ty, w.as_ref(), a.as_ref(), n).unwrap() as f64;
        let tol = if ty.vec_dot_type() == GgmlType::Q8_1 {
            2e-3 * mag
        } else {
            tolerance(n, mag)
        };
        assert!(
            (got - reference).abs() <= tol,
            "{ty}: {got} vs reference {reference} (magnitude {mag:e})"
        );
    }
}

#[test]
fn float_dots_handle_tails() {
    // Lengths that are not multiples of the 32-value SIMD step.
    let mut rng = Rng::new(3);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for n in [1usize, 7, 31, 33, 100, 257] {
            let w = random_weight_row(ty, n, &mut rng);
            let x = rng.activations(n);
            let a = activation_row(ty, &x);
            let simd = vec_dot(ty, w.as_ref(), a.as_ref(), n).unwrap();
            let scalar = vec_dot_scalar(ty, w.as_ref(), a.as_ref(), n).unwrap();
            let mag = magnitude(ty, w.as_ref(), a.as_ref(), n);
            assert!(
                (simd as f64 - scalar as f64).abs() <= tolerance(n, mag),
                "{ty} n={n}: {simd} vs {scalar}"
            );
        }
    }
}

#[test]
fn bad_rows_are_errors_not_panics() {
    let mut rng = Rng::new(5);
    let w = random_weight_row(GgmlType::Q4_0, 64, &mut rng);
    let a = activation_row(GgmlType::Q4_0, &rng.activations(64));
    assert!(matches!(
        vec_dot(GgmlType::Q4_0, &w.as_ref()[..20], a.as_ref(), 64),
        Err(KernelError::ByteLength { .. })
    ));
    assert!(matches!(
        vec_dot(GgmlType::Q4_0, w.as_ref(), &a.as_ref()[..34], 64),
        Err(KernelError::ByteLength { .. })
    ));
    assert!(matches!(
        vec_dot_scalar(GgmlType::Q4_0, w.as_ref(), a.as_ref(), 48),
        Err(KernelError::RaggedRow { .. })
    ));
    assert!(matches!(
        vec_dot(GgmlType::Q8K, &[0u8; 292], &[0u8; 292], 256),
        Err(KernelError::UnsupportedType(_))
    ));
    // Misaligned rows are reported, not read.
    let words = [0u32; 40];
    let bytes: &[u8] = bytemuck::cast_slice(&words);
    assert!(matches!(
        vec_dot(GgmlType::Q8_0, &bytes[1..35], &bytes[1..35], 32),
        Err(KernelError::Misaligned { .. })
    ));
}
