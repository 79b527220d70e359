//! The device's products (`matvec.cu`, and the streaming FFN's gate and up
//! dots) equal the CPU engine's `matmul` bit for bit, checked without a GPU:
//! `kernels/cuda/cpu_order.cuh` is plain C++ as well as CUDA, so this
//! compiles it with the host's C++ compiler (through `harness/cpu_order.cpp`:
//! the kernels' own `row_product`, with the host forms of the lane
//! primitives) and compares every output with the kernels crate's, for
//! every weight type the device takes and every order the CPU's dispatch
//! picks (vec-dot lanes, the tiled K-quant matmul, repacked Q4_K's gemm and
//! gemv rows), on both kinds of CPU: `matmul` where this one has AVX2, and
//! `matmul_scalar`, which is what the engine runs on a CPU without it
//! (GGML's generic formulas).
//!
//! The RMS norm's mean is checked the same way (`kernels/cuda/norm_mean.cuh`
//! against `ops::mean_square`): from the tree sum a `rms_norm_rows` block
//! adds, it is the CPU's, on rows where the tree's last bits move it across
//! an f32 rounding too.
//!
//! What it cannot check is the device's forms of the lane primitives (the
//! group's shuffles) and the kernels' grids; `tests/device.rs` does, where a
//! GPU is present. A machine without a C++ compiler fails here, naming it,
//! unless LEANSTREAM_ALLOW_MISSING_MODELS=1 lets the tests skip.

use std::path::{Path, PathBuf};
use std::process::Command;

use half::f16;
use leanstream_cuda::order::CpuOrder;
use leanstream_kernels::dot::has_avx2;
use leanstream_kernels::matmul::matmul_scalar;
use leanstream_kernels::ops::mean_square;
use leanstream_kernels::quantize::{quantize_row_q4_0, quantize_row_q8_0};
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};

mod common;

use common::{weights, Rng, GPU_WEIGHT_TYPES};

type RowProduct = unsafe extern "C" fn(i32, *const u8, *const u8, i32, i32) -> f32;
type HalfToFloat = unsafe extern "C" fn(u16) -> f32;
type NormMean = unsafe extern "C" fn(*const f32, i32, f64, *mut i32) -> f32;

/// The harness built once per test process, or `None` (skipping) where no
/// compiler is found and skipping is allowed.
fn harness() -> Option<&'static libloading::Library> {
    static LIB: std::sync::OnceLock<Option<libloading::Library>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| match build() {
        Ok(path) => {
            Some(unsafe { libloading::Library::new(&path) }.unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        }
        Err(e) if std::env::var("LEANSTREAM_ALLOW_MISSING_MODELS").as_deref() == Ok("1") => {
            eprintln!("SKIPPED: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    })
    .as_ref()
}

/// Compiles the harness with `$CXX` (default `c++`): no contraction of
/// `a * b + c`, as NVRTC's `--fmad=false`, and IEEE floats (no fast math).
fn build() -> Result<PathBuf, String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = manifest.join("tests/harness/cpu_order.cpp");
    let headers = manifest.join("../kernels/cuda");
    let dir = std::env::temp_dir().join(format!("leanstream-cpu-order-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let out = dir.join("libcpu_order.so");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let status = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-fPIC",
            "-shared",
            "-Wall",
        ])
        .arg("-I")
        .arg(&headers)
        .arg(&source)
        .arg("-o")
        .arg(&out)
        .status()
        .map_err(|e| format!("no C++ compiler `{cxx}` to build the CPU-order harness (set CXX): {e}"))?;
    if !status.success() {
        return Err(format!("{cxx} failed on {} ({status})", source.display()));
    }
    Ok(out)
}

fn row_product(lib: &libloading::Library) -> libloading::Symbol<'_, RowProduct> {
    unsafe { lib.get(b"cpu_order_row_product\0") }.unwrap()
}

#[test]
fn half_conversion_is_exact_for_every_bit_pattern() {
    let Some(lib) = harness() else { return };
    let convert: libloading::Symbol<HalfToFloat> = unsafe { lib.get(b"cpu_order_half_to_float\0") }.unwrap();
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let got = unsafe { convert(bits) };
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{bits:#06x}: {got} against {want}"
        );
    }
}

/// The CPU kinds this machine can stand for: with AVX2 (`matmul`) where it
/// has it, and without (`matmul_scalar`, which the engine runs there).
fn cpu_kinds() -> Vec<bool> {
    if has_avx2() {
        vec![true, false]
    } else {
        vec![false]
    }
}

/// The CPU engine's product on a CPU with AVX2 (`simd`) or without.
fn cpu_matmul(simd: bool, w: &QMatrix, acts: &ActBuffer, out: &mut [f32]) {
    if simd {
        matmul(w, acts, out).unwrap()
    } else {
        matmul_scalar(w, acts, out).unwrap()
    }
}

/// Compares every `step`-th output row of `w` (`rows × cols` of `ty`)
/// against `n` activation rows, as the CPU computes them and as the harness
/// does in the order [`CpuOrder`] picks for that CPU.
fn compare(
    lib: &libloading::Library,
    what: &str,
    ty: GgmlType,
    w: &[u8],
    shape: (usize, usize, usize, usize),
    simd: bool,
    rng: &mut Rng,
) -> CpuOrder {
    compare_with(lib, what, ty, w, shape, simd, rng, |v| v * 3.0)
}

/// [`compare`] with the activations `act(u)`, `u` uniform in [-1, 1).
#[allow(clippy::too_many_arguments)]
fn compare_with(
    lib: &libloading::Library,
    what: &str,
    ty: GgmlType,
    w: &[u8],
    (rows, cols, n, step): (usize, usize, usize, usize),
    simd: bool,
    rng: &mut Rng,
    act: impl Fn(f32) -> f32,
) -> CpuOrder {
    let product = row_product(lib);
    let x: Vec<f32> = rng.floats(n * cols).into_iter().map(act).collect();
    let mut acts = ActBuffer::with_capacity(cols, n);
    acts.quantize(ty.vec_dot_type(), &x, n, cols).unwrap();
    let mut want = vec![0.0f32; n * rows];
    cpu_matmul(simd, &QMatrix::new(ty, rows, cols, w).unwrap(), &acts, &mut want);
    let order = CpuOrder::on(ty, rows, n, simd);
    let w_row = ty.row_bytes(cols).unwrap();
    for t in 0..n {
        // The kernel's per-token choice between the repacked gemm and gemv.
        let id = order.id_for_token(t);
        for r in (0..rows).step_by(step) {
            let got = unsafe {
                product(
                    ty.id() as i32,
                    w[r * w_row..].as_ptr(),
                    acts.row(t).as_ptr(),
                    cols as i32,
                    id,
                )
            };
            let want = want[t * rows + r];
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{what}: {ty} {rows}x{cols}, {n} tokens ({order:?}, AVX2 {simd}), token {t} row {r}: \
                 {got} against the CPU's {want}"
            );
        }
    }
    order
}

#[test]
fn every_weight_type_and_order_equals_the_cpu_matmul_bit_for_bit() {
    let Some(lib) = harness() else { return };
    let mut rng = Rng(7);
    let mut seen = Vec::new();
    for simd in cpu_kinds() {
        for ty in GPU_WEIGHT_TYPES {
            let cols = if ty.block_size() == 256 { 768 } else { 576 };
            // 16 rows: repacked where Q4_K; 12: not. 1, 5 and 9 tokens:
            // decode, the repacked gemm for four rows with the gemv for the
            // fifth, the tiled K-quant matmul.
            for rows in [16, 12] {
                for n in [1, 5, 9] {
                    let w = weights(ty, rows, cols, &mut rng);
                    seen.push((ty, compare(lib, "random", ty, &w, (rows, cols, n, 1), simd, &mut rng)));
                }
            }
        }
        // F32 and F16 rows whose length leaves every kind of tail after the
        // 64-value steps: none, runs of 16, one of 8, a fused remainder.
        for ty in [GgmlType::F32, GgmlType::F16] {
            for cols in [64, 200, 232, 93] {
                let w = weights(ty, 4, cols, &mut rng);
                compare(lib, "float tail", ty, &w, (4, cols, 1, 1), simd, &mut rng);
            }
        }
    }
    let mut orders = vec![
        CpuOrder::Generic,
        CpuOrder::Tiled,
        CpuOrder::Repacked { gemm_rows: 0 },
        CpuOrder::Repacked { gemm_rows: 4 },
        CpuOrder::Repacked { gemm_rows: 8 },
    ];
    if has_avx2() {
        orders.push(CpuOrder::Lanes);
        assert!(seen.contains(&(GgmlType::Q4K, CpuOrder::Lanes)));
    }
    for order in orders {
        assert!(seen.iter().any(|(_, o)| *o == order), "{order:?} never checked");
    }
    assert!(seen.contains(&(GgmlType::Q4K, CpuOrder::Generic)));
    assert!(seen.contains(&(GgmlType::Q5K, CpuOrder::Tiled)));
    assert!(seen.contains(&(GgmlType::Q6K, CpuOrder::Tiled)));
}

/// Blocks whose integer sums are large (weights near one extreme of their
/// range, activations near the other), so that `sumi · d` is not exact in
/// f32 and a product regrouped inside a block's float step shows: random
/// rows' sums are small enough that most such slips round alike, and in a
/// long row a block's last bit is mostly lost in the sum, hence rows of one
/// block too.
#[test]
fn large_block_sums_keep_the_cpus_rounding() {
    let Some(lib) = harness() else { return };
    let mut rng = Rng(19);
    for ((rows, cols), simd, ty) in [(64, 32), (12, 576)]
        .into_iter()
        .flat_map(|shape| cpu_kinds().into_iter().map(move |simd| (shape, simd)))
        .flat_map(|(shape, simd)| [GgmlType::Q4_0, GgmlType::Q8_0].map(|ty| (shape, simd, ty)))
    {
        let mut w = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
        for row in w.chunks_exact_mut(ty.row_bytes(cols).unwrap()) {
            let x: Vec<f32> = rng.floats(cols).iter().map(|v| -1.0 - 0.1 * v.abs()).collect();
            if ty == GgmlType::Q4_0 {
                quantize_row_q4_0(&x, row).unwrap();
            } else {
                quantize_row_q8_0(&x, row).unwrap();
            }
        }
        // Activations near +1: every byte of every block near 127.
        compare_with(lib, "large sums", ty, &w, (rows, cols, 1, 1), simd, &mut rng, |v| {
            1.0 + 0.1 * v
        });
    }
}

/// A wrong order does not go unnoticed: the same products summed in the
/// AVX2 lanes' order, or the tiled matmul's, differ from the generic
/// formulas somewhere in these rows (so the test above would catch an
/// order slip, not only a wrong value).
#[test]
fn another_summation_order_is_caught() {
    let Some(lib) = harness() else { return };
    let product = row_product(lib);
    let mut rng = Rng(11);
    for ty in [GgmlType::Q4_1, GgmlType::Q6K] {
        let (rows, cols) = (16, 768);
        let w = weights(ty, rows, cols, &mut rng);
        let x: Vec<f32> = rng.floats(cols).iter().map(|v| v * 3.0).collect();
        let mut acts = ActBuffer::with_capacity(cols, 1);
        acts.quantize(ty.vec_dot_type(), &x, 1, cols).unwrap();
        let mut want = vec![0.0f32; rows];
        matmul_scalar(&QMatrix::new(ty, rows, cols, &w).unwrap(), &acts, &mut want).unwrap();
        let w_row = ty.row_bytes(cols).unwrap();
        let mut others = vec![CpuOrder::Lanes];
        if ty == GgmlType::Q6K {
            others.push(CpuOrder::Tiled);
        }
        for other in others {
            let differ = (0..rows)
                .filter(|&r| {
                    let got = unsafe {
                        product(
                            ty.id() as i32,
                            w[r * w_row..].as_ptr(),
                            acts.row(0).as_ptr(),
                            cols as i32,
                            other.id(),
                        )
                    };
                    assert!(
                        (got - want[r]).abs() <= 1e-4 * want[r].abs().max(1.0),
                        "{ty} row {r}: {got} {}",
                        want[r]
                    );
                    got.to_bits() != want[r].to_bits()
                })
                .count();
            assert!(
                differ > 0,
                "{ty} in {other:?} gave the generic formulas' bits on all {rows} rows"
            );
        }
    }
}

/// The same on the real models' own matrices, one of each type and shape
/// (SmolLM2: Q4_1 layers and the Q8_0 output head; Gemma 3: Q5_0, Q8_0,
/// repacked Q4_K and Q6_K layers, the Q8_0 head), as decode and as a
/// 9-token prompt (the head computes one row in both engines), on both
/// kinds of CPU. Every 37th output row is compared (the head's every 4099th
/// against the slow scalar twins).
#[test]
fn the_real_models_matrices_equal_the_cpu_matmul_bit_for_bit() {
    let Some(lib) = harness() else { return };
    let mut rng = Rng(13);
    for name in ["smollm2", "gemma3"] {
        let Some(path) = leanstream_runtime::fetch::reference_model(name).unwrap() else {
            continue;
        };
        let gguf = leanstream_runtime::gguf::GgufFile::open(&path).unwrap();
        let mut shapes = Vec::new();
        for info in gguf.tensors.iter().filter(|i| i.dims.len() == 2) {
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            if shapes.contains(&(info.ty, cols, rows)) {
                continue;
            }
            shapes.push((info.ty, cols, rows));
            let head = info.name == "token_embd.weight" || info.name == "output.weight";
            // The scalar twins are slow on the 262,144-row head: sample it thinner.
            for simd in cpu_kinds() {
                for n in if head { vec![1] } else { vec![1, 9] } {
                    let step = if head && !simd { 4099 } else { 37 };
                    let what = format!("{name} {}", info.name);
                    compare(
                        lib,
                        &what,
                        info.ty,
                        gguf.tensor_bytes(info),
                        (rows, cols, n, step),
                        simd,
                        &mut rng,
                    );
                }
            }
        }
        eprintln!("{name}: {} matrix shapes checked", shapes.len());
    }
}

/// Threads of a `rms_norm_rows` block (`Gpu::rms_norm`).
const NORM_THREADS: usize = 256;

/// The f64 sum of `x`'s squares as a `rms_norm_rows` block adds it: each
/// thread a strided chain, lane 0 of each warp after the xor butterfly
/// (`warp_sum_f64`), then the warps in order.
fn device_tree_sum(x: &[f32]) -> f64 {
    let mut lanes: Vec<f64> = (0..NORM_THREADS)
        .map(|t| {
            x.iter()
                .skip(t)
                .step_by(NORM_THREADS)
                .fold(0.0, |s, &v| s + (v * v) as f64)
        })
        .collect();
    let mut total = 0.0;
    for warp in lanes.chunks_mut(32) {
        for o in [16, 8, 4, 2, 1] {
            let before = warp.to_vec();
            for (i, v) in warp.iter_mut().enumerate() {
                *v = before[i] + before[i ^ o];
            }
        }
        total += warp[0];
    }
    total
}

/// One value of a test row.
type RowValue = fn(&mut Rng) -> f32;

/// The harness's mean of `x` from tree sum `tree`, and whether the sum settled it.
fn norm_mean(lib: &libloading::Library, x: &[f32], tree: f64) -> (f32, bool) {
    let f: libloading::Symbol<NormMean> = unsafe { lib.get(b"cpu_order_norm_mean\0") }.unwrap();
    let mut settled = 0;
    let mean = unsafe { f(x.as_ptr(), x.len() as i32, tree, &mut settled) };
    (mean, settled != 0)
}

#[test]
fn the_norms_mean_from_the_devices_tree_sum_is_the_cpus() {
    let Some(lib) = harness() else { return };
    let mut rng = Rng(11);
    // Hidden-state-like rows, rows over nine decades (the f64 sums round),
    // and rows with a few massive activations.
    let shapes: [(&str, RowValue); 3] = [
        ("uniform", |r| 3.0 * r.float()),
        ("wide", |r| r.float().signum() * 10f32.powf(9.0 * r.float().abs() - 6.0)),
        ("massive", |r| {
            if r.below(200) == 0 {
                300.0 * r.float()
            } else {
                r.float()
            }
        }),
    ];
    for d in [64, 256, 576, 640, 1152, 4096] {
        for (name, value) in shapes {
            let mut settled = 0;
            let rows = 200;
            for row in 0..rows {
                let x: Vec<f32> = (0..d).map(|_| value(&mut rng)).collect();
                let want = mean_square(&x);
                let (got, by_tree) = norm_mean(lib, &x, device_tree_sum(&x));
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{name} d {d} row {row}: {got} against the CPU's {want}"
                );
                settled += by_tree as usize;
                // Any order's sum lies within (d - 1)·2^-53 of the in-order
                // one's, relative: the ends of that reach give the CPU's mean too.
                let in_order = x.iter().fold(0.0f64, |s, &v| s + (v * v) as f64);
                for side in [-1.0, 1.0] {
                    let tree = in_order * (1.0 + side * (d - 1) as f64 * f64::EPSILON / 2.0);
                    let (got, _) = norm_mean(lib, &x, tree);
                    assert_eq!(got.to_bits(), want.to_bits(), "{name} d {d} row {row}, sum {tree}");
                }
            }
            // The chain is the exception, not the rule.
            assert!(
                settled * 100 >= rows * 99,
                "{name} d {d}: only {settled} of {rows} rows settled by the tree"
            );
        }
    }
}

#[test]
fn a_tree_sum_across_an_f32_rounding_takes_the_cpus_chain() {
    let Some(lib) = harness() else { return };
    // Squares 4, s², 2^-22, s² with s² just under half of 4's f64 ulp: in
    // order each s² is lost and the mean is 1 + 2^-24 exactly, an f32 tie
    // (to 1.0); the device's tree adds the two s² first, keeps them, and
    // would round the mean up.
    let s = 1.224_744_9f32 * 2f32.powi(-26);
    let x = [2.0, s, 2f32.powi(-11), s];
    let want = mean_square(&x);
    let tree = device_tree_sum(&x);
    let naive = (tree / x.len() as f64) as f32;
    assert_ne!(
        naive.to_bits(),
        want.to_bits(),
        "the tree's sum must cross the rounding for this test to mean anything"
    );
    let (got, settled) = norm_mean(lib, &x, tree);
    assert!(
        !settled,
        "a sum on the edge of an f32 rounding must not settle the mean"
    );
    assert_eq!(got.to_bits(), want.to_bits(), "{got} against the CPU's {want}");
    // An infinite square settles nothing either; the chain gives the CPU's infinity.
    let x = [1.0, f32::MAX, 2.0];
    let (got, settled) = norm_mean(lib, &x, device_tree_sum(&x));
    assert!(!settled);
    assert_eq!(got.to_bits(), mean_square(&x).to_bits());
}
