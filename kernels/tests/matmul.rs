//! Matrix products: SIMD/threaded against the scalar twin, tiling against
//! single dots, and shape/type errors.

mod common;

use common::{random_weight_row, Aligned, Rng, COLS, WEIGHT_TYPES};
use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::dot::{tiled_dot, tiled_dot_scalar, vec_dot, vec_dot_scalar};
use leanstream_kernels::matmul::{matmul_scalar, uses_tiled_kquant};
use leanstream_kernels::{matmul, ActBuffer, GgmlType, KernelError, QMatrix};

/// Odd, so row chunks come out uneven; large enough for the threaded path at n = 1.
const ROWS: usize = 301;

fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Aligned {
    let mut bytes = Vec::new();
    for _ in 0..rows {
        bytes.extend_from_slice(random_weight_row(ty, cols, rng).as_ref());
    }
    Aligned::from_bytes(&bytes)
}

/// n = 1 (decode), and prompt sizes that reach every tile shape the
/// kernels use (up to 8 tokens per tile) plus ragged tails. K-quants with 8+
/// activation rows follow llama.cpp's tiled matmul, whose SIMD and scalar
/// forms agree bit for bit.
#[test]
fn matmul_agrees_with_scalar_and_with_single_dots() {
    let mut rng = Rng::new(42);
    let mut acts = ActBuffer::with_capacity(COLS, 23);
    for ty in WEIGHT_TYPES {
        let data = random_matrix(ty, ROWS, COLS, &mut rng);
        let w = QMatrix::new(ty, ROWS, COLS, data.as_ref()).unwrap();
        for n in [1usize, 3, 6, 7, 8, 13, 17, 23] {
            let x = rng.activations(n * COLS);
            acts.quantize(ty.vec_dot_type(), &x, n, COLS).unwrap();
            let mut fast = vec![f32::NAN; n * ROWS];
            let mut scalar = vec![f32::NAN; n * ROWS];
            matmul(&w, &acts, &mut fast).unwrap();
            matmul_scalar(&w, &acts, &mut scalar).unwrap();

            let mut wf = vec![0.0f32; COLS];
            let mut af = vec![0.0f32; COLS];
            for t in 0..n {
                dequantize_row(ty.vec_dot_type(), acts.row(t), &mut af).unwrap();
                for r in 0..ROWS {
                    let got = fast[t * ROWS + r];
                    // Tiles and threads must not change a single bit.
                    let single = if uses_tiled_kquant(ty, ROWS, n) {
                        let scalar_single = tiled_dot_scalar(ty, w.row(r), acts.row(t), COLS).unwrap();
                        let want = scalar[t * ROWS + r];
                        assert_eq!(want.to_bits(), scalar_single.to_bits(), "{ty} n={n} t={t} r={r}");
                        assert_eq!(got.to_bits(), want.to_bits(), "{ty} n={n} t={t} r={r} (tiled)");
                        tiled_dot(ty, w.row(r), acts.row(t), COLS).unwrap()
                    } else {
                        vec_dot(ty, w.row(r), acts.row(t), COLS).unwrap()
                    };
                    assert_eq!(got.to_bits(), single.to_bits(), "{ty} n={n} t={t} r={r}");

                    dequantize_row(ty, w.row(r), &mut wf).unwrap();
                    let mag: f64 = wf.iter().zip(&af).map(|(&p, &q)| (p as f64 * q as f64).abs()).sum();
                    let tol = (COLS / 32 + 16) as f64 * f32::EPSILON as f64 * mag;
                    let want = scalar[t * ROWS + r];
                    assert!(
                        (got as f64 - want as f64).abs() <= tol,
                        "{ty} n={n} t={t} r={r}: {got} vs scalar {want}"
                    );
                }
            }
        }
    }
}

/// Q4_K with a multiple of 8 rows takes llama.cpp's repacked arithmetic
/// (on x86_64; elsewhere the vec-dot, see `repack::q4k_is_repacked`):
/// the SIMD path equals the scalar twin bit for bit, and each output is the
/// single repacked dot for its activation row's kernel (gemm for the first
/// `n - n % 4` rows, gemv for the rest), whatever the tiling and threads.
#[test]
fn repacked_q4k_agrees_with_scalar_and_with_single_dots() {
    use leanstream_kernels::blocks::{cast_blocks, BlockQ4K, BlockQ8K};
    use leanstream_kernels::repack::{self, Mode};
    const ROWS: usize = 264;
    let mut rng = Rng::new(7);
    let mut acts = ActBuffer::with_capacity(COLS, 23);
    let data = random_matrix(GgmlType::Q4K, ROWS, COLS, &mut rng);
    let w = QMatrix::new(GgmlType::Q4K, ROWS, COLS, data.as_ref()).unwrap();
    for n in [1usize, 2, 3, 4, 5, 8, 13, 17, 23] {
        let x = rng.activations(n * COLS);
        acts.quantize(GgmlType::Q8K, &x, n, COLS).unwrap();
        let mut fast = vec![f32::NAN; n * ROWS];
        let mut scalar = vec![f32::NAN; n * ROWS];
        matmul(&w, &acts, &mut fast).unwrap();
        matmul_scalar(&w, &acts, &mut scalar).unwrap();
        for t in 0..n {
            let mode = if t < repack::gemm_rows(n) {
                Mode::Gemm
            } else {
                Mode::Gemv
            };
            let a = cast_blocks::<BlockQ8K>(acts.row(t), "a").unwrap();
            for r in 0..ROWS {
                let i = t * ROWS + r;
                if !repack::q4k_is_repacked(ROWS) {
                    let single = vec_dot(GgmlType::Q4K, w.row(r), acts.row(t), COLS).unwrap();
                    let twin = vec_dot_scalar(GgmlType::Q4K, w.row(r), acts.row(t), COLS).unwrap();
                    assert_eq!(fast[i].to_bits(), single.to_bits(), "n={n} t={t} r={r} (vec-dot)");
                    assert_eq!(scalar[i].to_bits(), twin.to_bits(), "n={n} t={t} r={r} (vec-dot)");
                    continue;
                }
                let single = repack::dot(cast_blocks::<BlockQ4K>(w.row(r), "w").unwrap(), a, mode);
                assert_eq!(fast[i].to_bits(), single.to_bits(), "n={n} t={t} r={r}");
                assert_eq!(scalar[i].to_bits(), single.to_bits(), "n={n} t={t} r={r}");
            }
        }
    }
}

/// Rows alone (a verification pass): every row of a product of many has
/// the bits of the same row multiplied alone, for every weight type and
/// the repacked Q4_K, on the SIMD path and the scalar twin; without it the
/// batched kernels (gemm, tiled K-quants) round some rows otherwise.
#[test]
fn rows_alone_give_each_row_its_single_row_bits() {
    let mut rng = Rng::new(11);
    let mut many = ActBuffer::with_capacity(COLS, 16);
    let mut one = ActBuffer::with_capacity(COLS, 1);
    let mut differs = 0;
    let types = WEIGHT_TYPES.iter().map(|&ty| (ty, ROWS)).chain([(GgmlType::Q4K, 264)]);
    for (ty, rows) in types {
        let data = random_matrix(ty, rows, COLS, &mut rng);
        let w = QMatrix::new(ty, rows, COLS, data.as_ref()).unwrap();
        for n in [2usize, 4, 5, 8, 9, 16] {
            let x = rng.activations(n * COLS);
            for alone in [true, false] {
                many.set_rows_alone(alone);
                many.quantize(ty.vec_dot_type(), &x, n, COLS).unwrap();
                let mut fast = vec![f32::NAN; n * rows];
                let mut scalar = vec![f32::NAN; n * rows];
                matmul(&w, &many, &mut fast).unwrap();
                matmul_scalar(&w, &many, &mut scalar).unwrap();
                for t in 0..n {
                    one.quantize(ty.vec_dot_type(), &x[t * COLS..(t + 1) * COLS], 1, COLS)
                        .unwrap();
                    let mut single = vec![f32::NAN; rows];
                    matmul(&w, &one, &mut single).unwrap();
                    let same = |got: &[f32]| got.iter().zip(&single).all(|(a, b)| a.to_bits() == b.to_bits());
                    let row = &fast[t * rows..(t + 1) * rows];
                    if alone {
                        assert!(
                            same(row),
                            "{ty} ({rows} rows) n={n} t={t}: rows alone differ from one row"
                        );
                        let mut scalar_one = vec![f32::NAN; rows];
                        matmul_scalar(&w, &one, &mut scalar_one).unwrap();
                        let srow = &scalar[t * rows..(t + 1) * rows];
                        assert!(
                            srow.iter().zip(&scalar_one).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{ty} scalar n={n}"
                        );
                    } else if !same(row) {
                        differs += 1;
                    }
                }
            }
        }
    }
    // The batched arithmetic is really another: the flag is what keeps the
    // bits. Where there is none (off x86_64), every row is its own anyway.
    let batched = uses_tiled_kquant(GgmlType::Q6K, ROWS, 8) || leanstream_kernels::repack::q4k_is_repacked(264);
    if batched {
        assert!(differs > 0, "no batched row differed from its single-row product");
    } else {
        assert_eq!(
            differs, 0,
            "rows differ from their single-row products without batched arithmetic"
        );
    }
}

#[test]
fn matmul_rejects_mismatched_inputs() {
    let mut rng = Rng::new(1);
    let data = random_matrix(GgmlType::Q4_0, 8, 64, &mut rng);
    let w = QMatrix::new(GgmlType::Q4_0, 8, 64, data.as_ref()).unwrap();
    let mut acts = ActBuffer::with_capacity(64, 2);
    let x = rng.activations(128);

    // Wrong dot type.
    acts.quantize(GgmlType::Q8_1, &x, 2, 64).unwrap();
    let mut out = vec![0.0f32; 16];
    assert!(matches!(
        matmul(&w, &acts, &mut out),
        Err(KernelError::TypeMismatch { .. })
    ));

    // Wrong output length.
    acts.quantize(GgmlType::Q8_0, &x, 2, 64).unwrap();
    let mut short = vec![0.0f32; 15];
    assert!(matches!(matmul(&w, &acts, &mut short), Err(KernelError::Length { .. })));
    assert!(matches!(
        matmul_scalar(&w, &acts, &mut short),
        Err(KernelError::Length { .. })
    ));

    // Wrong column count.
    acts.quantize(GgmlType::Q8_0, &x, 4, 32).unwrap();
    let mut out4 = vec![0.0f32; 32];
    assert!(matches!(matmul(&w, &acts, &mut out4), Err(KernelError::Length { .. })));

    // Matrix data of the wrong size, or a public field edited afterwards.
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_0, 9, 64, data.as_ref()),
        Err(KernelError::ByteLength { .. })
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_0, 8, 48, data.as_ref()),
        Err(KernelError::RaggedRow { .. })
    ));
    let bent = QMatrix { rows: 9, ..w };
    assert!(matmul(&bent, &acts, &mut out4).is_err());
    assert!(bent.row(100).is_empty());
}

#[test]
fn act_buffer_checks_capacity_and_shapes() {
    let mut acts = ActBuffer::with_capacity(256, 2);
    let x = vec![0.5f32; 256 * 3];
    // Room for 2 rows (more where the prompt panels of Q8_0 rows need it,
    // but never 8 rows of F32).
    let many = vec![0.5f32; 256 * 8];
    assert!(matches!(
        acts.quantize(GgmlType::F32, &many, 8, 256),
        Err(KernelError::ActBufferCapacity { .. })
    ));
    assert!(matches!(
        acts.quantize(GgmlType::Q8_0, &x[..100], 1, 256),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        acts.quantize(GgmlType::Q8K, &x[..128], 1, 128),
        Err(KernelError::RaggedRow { .. })
    ));
    assert!(acts.quantize(GgmlType::Q4_0, &x[..256], 1, 256).is_err());

    // F32 is the widest dot type: a full buffer of it fits.
    acts.quantize(GgmlType::F32, &x[..512], 2, 256).unwrap();
    assert_eq!((acts.n(), acts.cols(), acts.dot_type()), (2, 256, GgmlType::F32));
    assert_eq!(acts.row(1).len(), 1024);
    assert!(acts.row(2).is_empty());
    for ty in [
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q8K,
    ] {
        acts.quantize(ty, &x[..512], 2, 256).unwrap();
        assert_eq!(acts.row(0).len(), ty.row_bytes(256).unwrap());
    }
}

#[test]
fn empty_products_are_fine() {
    let data = Aligned::zeroed(0);
    let w = QMatrix::new(GgmlType::Q8_0, 0, 32, data.as_ref()).unwrap();
    let mut acts = ActBuffer::with_capacity(32, 1);
    acts.quantize(GgmlType::Q8_0, &[0.0; 32], 1, 32).unwrap();
    matmul(&w, &acts, &mut []).unwrap();
}
