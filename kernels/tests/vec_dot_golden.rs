//! Our activation quantization plus dot product against llama.cpp's CPU
//! backend on the same inputs (data/golden/vec_dot.json, recorded by
//! scripts/golden/golden_vec_dot.c). The dispatched kernel must give the very
//! same float: any difference in summation order would make greedy decoding
//! drift from llama.cpp's on near-ties. The recording is x86 llama.cpp's, so
//! off x86_64 the kernels are held to rounding only (aarch64's bits are
//! checked against llama.cpp built for aarch64 in neon_vec_dot_golden.rs).

mod harness;

use harness::{hex, Lcg};
use leanstream_kernels::dot::{vec_dot, vec_dot_scalar};
use leanstream_kernels::{ActBuffer, GgmlType};
use serde_json::Value;

fn ty(name: &str) -> GgmlType {
    match name {
        "f16" => GgmlType::F16,
        "bf16" => GgmlType::BF16,
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q5_0" => GgmlType::Q5_0,
        "q5_1" => GgmlType::Q5_1,
        "q8_0" => GgmlType::Q8_0,
        "q4_K" => GgmlType::Q4K,
        "q5_K" => GgmlType::Q5K,
        "q6_K" => GgmlType::Q6K,
        other => panic!("unexpected type {other}"),
    }
}

#[test]
fn dot_products_match_llama_cpp_bit_for_bit() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/golden/vec_dot.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(cases.len() >= 30);
    let mut mismatches = Vec::new();
    for case in &cases {
        let t = ty(case["type"].as_str().unwrap());
        let n = case["n"].as_u64().unwrap() as usize;
        let mut rng = Lcg(case["seed"].as_u64().unwrap());
        let _weights_source: Vec<f32> = (0..n).map(|_| rng.next_value()).collect();
        let acts: Vec<f32> = (0..n).map(|_| rng.next_value()).collect();
        let w = hex(case["weights_hex"].as_str().unwrap());
        let want = f32::from_bits(case["result_bits"].as_u64().unwrap() as u32);

        let mut buf = ActBuffer::with_capacity(n, 1);
        buf.quantize(t.vec_dot_type(), &acts, 1, n).unwrap();
        let got = vec_dot(t, &w, buf.row(0), n).unwrap();
        let scalar = vec_dot_scalar(t, &w, buf.row(0), n).unwrap();
        // The recording is x86 llama.cpp's (AVX2 order); aarch64's kernels
        // follow its NEON order instead (tests/neon_vec_dot_golden.rs).
        if cfg!(target_arch = "x86_64") && got.to_bits() != want.to_bits() {
            mismatches.push(format!("{t} n={n}: ours {got:e}, llama.cpp {want:e}"));
        }
        // The portable twin may sum in another order, but not by more than
        // rounding; so may the NEON kernels off x86_64.
        assert!(
            (scalar - want).abs() <= 1e-4 * want.abs().max(1.0),
            "{t} n={n}: scalar {scalar} vs {want}"
        );
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "{t} n={n}: vec_dot {got} vs {want}"
        );
    }
    assert!(
        mismatches.is_empty(),
        "dot products differ from llama.cpp:\n{}",
        mismatches.join("\n")
    );
}
