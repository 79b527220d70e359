//! Q4_K matrix products against llama.cpp's repacked CPU path
//! (data/golden/q4k_repack.json, recorded by scripts/golden/golden_q4k_repack.c:
//! a real `ggml_mul_mat` with the weight in the CPU_REPACK buffer type, 2
//! threads). Both `matmul` (AVX2 where available) and `matmul_scalar` must
//! give llama.cpp's bits for every output, for one activation row (gemv) and
//! several (gemm on whole groups of four, gemv for the rest). Off x86_64,
//! where `matmul` does not repack (see [`repack::q4k_is_repacked`]), the
//! portable `repack::dot` must.

mod harness;

use harness::{aligned, fnv1a, output_mismatches, Lcg};
use leanstream_kernels::blocks::{cast_blocks, BlockQ8K};
use leanstream_kernels::matmul::matmul_scalar;
use leanstream_kernels::repack::{self, Mode};
use leanstream_kernels::{matmul, ActBuffer, GgmlType, QMatrix};
use serde_json::Value;

const Q4K_BLOCK: usize = 144;

/// `random_q4k` of the harness: well-formed blocks with random scales and quants.
fn random_q4k(rng: &mut Lcg, blocks: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks * Q4K_BLOCK);
    for _ in 0..blocks {
        let d = (0x1400 + rng.next_u32() % 0x400) as u16;
        let dmin = (0x1000 + rng.next_u32() % 0x800) as u16;
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        for _ in 0..35 {
            out.extend_from_slice(&rng.next_u32().to_le_bytes());
        }
    }
    out
}

struct Case {
    rows: usize,
    cols: usize,
    n: usize,
    weights: Vec<u64>,
    acts: ActBuffer,
    /// Per activation row: FNV-1a of its outputs' bits, and its first values' bits.
    want: Vec<(u64, Vec<u32>)>,
}

impl Case {
    fn matrix(&self) -> QMatrix<'_> {
        let bytes = self.rows * GgmlType::Q4K.row_bytes(self.cols).unwrap();
        QMatrix::new(
            GgmlType::Q4K,
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
            &format!("{label} rows={} cols={} n={}", self.rows, self.cols, self.n),
        )
    }
}

fn hex_u64(v: &Value) -> u64 {
    u64::from_str_radix(v.as_str().unwrap(), 16).unwrap()
}

fn load_cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/golden/q4k_repack.json");
    let json: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json.iter()
        .map(|c| {
            let field = |k: &str| c[k].as_u64().unwrap() as usize;
            let (rows, cols, n) = (field("rows"), field("cols"), field("n"));
            let mut rng = Lcg(c["seed"].as_u64().unwrap());
            let weights = random_q4k(&mut rng, rows * cols / 256);
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
            // The recording shows the repacked path really differs from vec_dot's.
            assert!(c["plain_path_differs"].as_u64().unwrap() > 0);
            let mut acts = ActBuffer::with_capacity(cols, n);
            acts.quantize(GgmlType::Q8K, &x, n, cols).unwrap();
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
                rows,
                cols,
                n,
                weights: aligned(&weights),
                acts,
                want,
            }
        })
        .collect()
}

#[test]
fn q4k_products_match_llama_cpp_repacked_path_bit_for_bit() {
    let cases = load_cases();
    assert!(cases.len() >= 15);
    let mut mismatches = Vec::new();
    for case in &cases {
        let w = case.matrix();
        if !repack::q4k_is_repacked(case.rows) {
            // Off x86_64 `matmul` takes the vec-dot, as llama.cpp does there
            // (its aarch64 repacking is another arithmetic): the recording
            // still checks the portable repacked arithmetic itself.
            let mut out = vec![0.0f32; case.n * case.rows];
            for t in 0..case.n {
                let a = cast_blocks::<BlockQ8K>(case.acts.row(t), "a").unwrap();
                let mode = if t < repack::gemm_rows(case.n) {
                    Mode::Gemm
                } else {
                    Mode::Gemv
                };
                for r in 0..case.rows {
                    out[t * case.rows + r] = repack::dot(cast_blocks(w.row(r), "w").unwrap(), a, mode);
                }
            }
            mismatches.extend(case.mismatches(&out, "repack::dot"));
            continue;
        }
        let mut out = vec![0.0f32; case.n * case.rows];
        matmul(&w, &case.acts, &mut out).unwrap();
        mismatches.extend(case.mismatches(&out, "matmul"));
        let mut scalar = vec![0.0f32; case.n * case.rows];
        matmul_scalar(&w, &case.acts, &mut scalar).unwrap();
        mismatches.extend(case.mismatches(&scalar, "matmul_scalar"));
    }
    assert!(
        mismatches.is_empty(),
        "Q4_K products differ from llama.cpp's repacked path:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn q4k_repacked_results_do_not_depend_on_thread_count() {
    let cases = load_cases();
    let case = cases.iter().max_by_key(|c| c.n * c.rows * c.cols).unwrap();
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
