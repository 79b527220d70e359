//! K-quant matrix products against llama.cpp's tiled K-quant matmul
//! (data/golden/tiled_kquant.json, recorded by
//! scripts/golden/golden_tiled_kquant.c: a real `ggml_mul_mat` with the
//! weight in a plain CPU buffer, 2 threads). With 8 or more activation rows
//! llama.cpp computes Q6_K, Q5_K and non-repacked Q4_K products with its tiled
//! matmul, whose rounding differs from vec_dot's; with fewer it falls back to
//! vec_dot. Both `matmul` (AVX2 where available) and `matmul_scalar` must give
//! llama.cpp's bits for every output of the tiled path, and `matmul` also on
//! the vec_dot side (whose scalar twins follow GGML's generic C, which agrees
//! with the AVX2 kernels only to rounding).

mod harness;

use harness::{aligned, fnv1a, output_mismatches, Lcg};
use leanstream_kernels::dot::tiled_dot_scalar;
use leanstream_kernels::matmul::{matmul_scalar, uses_tiled_kquant, TILED_KQUANT_MIN_ROWS};
use leanstream_kernels::quantize::{quantize_row_as, GgmlBuild};
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};
use serde_json::Value;

fn ggml_type(name: &str) -> GgmlType {
    match name {
        "q4_K" => GgmlType::Q4K,
        "q5_K" => GgmlType::Q5K,
        "q6_K" => GgmlType::Q6K,
        other => panic!("unexpected type {other}"),
    }
}

/// `random_blocks` of the harness: well-formed blocks with random scales and quants.
fn random_blocks(rng: &mut Lcg, ty: GgmlType, blocks: usize) -> Vec<u8> {
    let block_bytes = ty.row_bytes(256).unwrap();
    let mut out = Vec::with_capacity(blocks * block_bytes);
    for _ in 0..blocks {
        if ty == GgmlType::Q6K {
            for _ in 0..52 {
                out.extend_from_slice(&rng.next_u32().to_le_bytes());
            }
            let d = (0x1400 + rng.next_u32() % 0x400) as u16;
            out.extend_from_slice(&d.to_le_bytes());
        } else {
            let d = (0x1400 + rng.next_u32() % 0x400) as u16;
            let dmin = (0x1000 + rng.next_u32() % 0x800) as u16;
            out.extend_from_slice(&d.to_le_bytes());
            out.extend_from_slice(&dmin.to_le_bytes());
            for _ in 0..(block_bytes - 4) / 4 {
                out.extend_from_slice(&rng.next_u32().to_le_bytes());
            }
        }
    }
    out
}

struct Case {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    weights: Vec<u64>,
    acts: ActBuffer,
    /// The activations as the recording's (x86) build quantizes them, row
    /// after row: on aarch64 `acts` holds GCC's fused rounding instead
    /// (see `quantize::quantize_block_q8_k_as`).
    x86_acts: Vec<u64>,
    /// Outputs of llama.cpp's that differ from its own vec_dot's.
    vec_dot_differs: u64,
    /// Per activation row: FNV-1a of its outputs' bits, and its first values' bits.
    want: Vec<(u64, Vec<u32>)>,
}

impl Case {
    fn matrix(&self) -> QMatrix<'_> {
        let bytes = self.rows * self.ty.row_bytes(self.cols).unwrap();
        QMatrix::new(
            self.ty,
            self.rows,
            self.cols,
            &bytemuck::cast_slice(&self.weights)[..bytes],
        )
        .unwrap()
    }

    /// Differences from llama.cpp's outputs, described.
    fn mismatches(&self, out: &[f32], label: &str) -> Vec<String> {
        output_mismatches(
            out,
            self.rows,
            &self.want,
            &format!("{label} {} rows={} cols={} n={}", self.ty, self.rows, self.cols, self.n),
        )
    }
}

fn hex_u64(v: &Value) -> u64 {
    u64::from_str_radix(v.as_str().unwrap(), 16).unwrap()
}

fn load_cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/golden/tiled_kquant.json");
    let json: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json.iter()
        .map(|c| {
            let field = |k: &str| c[k].as_u64().unwrap() as usize;
            let ty = ggml_type(c["type"].as_str().unwrap());
            let (rows, cols, n) = (field("rows"), field("cols"), field("n"));
            let mut rng = Lcg(c["seed"].as_u64().unwrap());
            let weights = random_blocks(&mut rng, ty, rows * cols / 256);
            assert_eq!(
                fnv1a(weights.iter().copied()),
                hex_u64(&c["weights_fnv"]),
                "weight generator"
            );
            let x: Vec<f32> = (0..n * cols).map(|_| rng.next_value()).collect();
            assert_eq!(
                fnv1a(x.iter().flat_map(|v| v.to_le_bytes())),
                hex_u64(&c["acts_fnv"]),
                "activation generator"
            );
            let mut acts = ActBuffer::with_capacity(cols, n);
            acts.quantize(GgmlType::Q8K, &x, n, cols).unwrap();
            let mut x86_acts = vec![0u8; n * GgmlType::Q8K.row_bytes(cols).unwrap()];
            quantize_row_as(GgmlBuild::X86, GgmlType::Q8K, &x, &mut x86_acts).unwrap();
            let want = c["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    let head = t["head"].as_array().unwrap();
                    (
                        hex_u64(&t["fnv"]),
                        head.iter().map(|b| b.as_u64().unwrap() as u32).collect(),
                    )
                })
                .collect();
            Case {
                ty,
                rows,
                cols,
                n,
                weights: aligned(&weights),
                acts,
                x86_acts: aligned(&x86_acts),
                vec_dot_differs: c["vec_dot_differs"].as_u64().unwrap(),
                want,
            }
        })
        .collect()
}

#[test]
fn recording_covers_both_sides_of_the_threshold() {
    let cases = load_cases();
    assert!(cases.len() >= 20);
    for case in &cases {
        let tiled = case.n >= TILED_KQUANT_MIN_ROWS;
        // llama.cpp's tiled matmul is x86-only, and so is `matmul`'s.
        assert_eq!(
            uses_tiled_kquant(case.ty, case.rows, case.n),
            tiled && cfg!(target_arch = "x86_64"),
            "{} rows={}",
            case.ty,
            case.rows
        );
        // The recording shows the tiled path really differs from vec_dot's,
        // and the fallback really is vec_dot.
        assert_eq!(
            case.vec_dot_differs > 0,
            tiled,
            "{} n={}: {} outputs differ from vec_dot",
            case.ty,
            case.n,
            case.vec_dot_differs
        );
    }
}

#[test]
fn kquant_products_match_llama_cpp_tiled_path_bit_for_bit() {
    let cases = load_cases();
    let mut mismatches = Vec::new();
    for case in &cases {
        let w = case.matrix();
        if !cfg!(target_arch = "x86_64") {
            // The recording is x86 llama.cpp's: its vec-dot side is the AVX2
            // order (on aarch64 `matmul` follows the NEON one, see
            // tests/neon_vec_dot_golden.rs), but the tiled side is still the
            // portable `tiled_dot_scalar`'s to match, on the x86 build's Q8_K.
            if case.n >= TILED_KQUANT_MIN_ROWS {
                let row_bytes = GgmlType::Q8K.row_bytes(case.cols).unwrap();
                let mut out = vec![0.0f32; case.n * case.rows];
                let acts: &[u8] = bytemuck::cast_slice(&case.x86_acts);
                for (t, act) in acts.chunks_exact(row_bytes).take(case.n).enumerate() {
                    for r in 0..case.rows {
                        out[t * case.rows + r] = tiled_dot_scalar(case.ty, w.row(r), act, case.cols).unwrap();
                    }
                }
                mismatches.extend(case.mismatches(&out, "tiled_dot_scalar"));
            }
            continue;
        }
        let mut out = vec![0.0f32; case.n * case.rows];
        matmul(&w, &case.acts, &mut out).unwrap();
        mismatches.extend(case.mismatches(&out, "matmul"));
        if uses_tiled_kquant(case.ty, case.rows, case.n) {
            let mut scalar = vec![0.0f32; case.n * case.rows];
            matmul_scalar(&w, &case.acts, &mut scalar).unwrap();
            mismatches.extend(case.mismatches(&scalar, "matmul_scalar"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "K-quant products differ from llama.cpp's tiled path:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn tiled_results_do_not_depend_on_thread_count() {
    let cases = load_cases();
    let case = cases
        .iter()
        .filter(|c| c.ty == GgmlType::Q6K)
        .max_by_key(|c| c.n * c.rows * c.cols)
        .unwrap();
    let w = case.matrix();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let mut out = vec![0.0f32; case.n * case.rows];
        pool.install(|| matmul(&w, &case.acts, &mut out)).unwrap();
        out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(one, run(3));
    assert_eq!(one, run(5));
}
