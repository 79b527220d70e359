//! Golden data from outside our code: dequantization by the `gguf` Python
//! package on real model blocks (`data/golden/dequant.json`, see
//! `data/golden/README.md`), and activation quantization and vec-dots by
//! llama.cpp's own CPU kernels (`kernels/tests/golden/vec_dot.json`, see
//! `kernels/tests/golden/README.md`). Neither needs a model file to run.

use leanstream_kernels::dequant::dequantize_row;
use leanstream_kernels::dot::{has_avx2, vec_dot, vec_dot_scalar};
use leanstream_kernels::quantize::quantize_row;
use leanstream_kernels::GgmlType;
use serde_json::Value;

/// A JSON list at `path`, relative to this crate.
fn load(path: &str) -> Vec<Value> {
    let path = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    match serde_json::from_str(&text).expect("golden JSON") {
        Value::Array(records) => records,
        other => panic!("{path}: expected a list, got {other}"),
    }
}

/// Hex into 8-byte-aligned storage (as mmapped tensors are), viewed as bytes.
fn hex_bytes(hex: &str) -> (Vec<u64>, usize) {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
    (words, bytes.len())
}

fn type_named(name: &str) -> GgmlType {
    (0..40)
        .filter_map(|id| GgmlType::from_id(id).ok())
        .find(|ty| ty.name() == name)
        .unwrap_or_else(|| panic!("unknown type {name}"))
}

fn ulps_apart(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    if a.is_sign_negative() != b.is_sign_negative() {
        return u32::MAX;
    }
    a.to_bits().abs_diff(b.to_bits())
}

#[test]
fn dequantization_matches_gguf_reference() {
    let records = load("../data/golden/dequant.json");
    assert!(!records.is_empty());
    let mut types_seen = std::collections::BTreeSet::new();
    for r in &records {
        let ty = type_named(r["type"].as_str().unwrap());
        types_seen.insert(ty.name());
        let (words, len) = hex_bytes(r["raw_hex"].as_str().unwrap());
        let raw = &bytemuck::cast_slice::<u64, u8>(&words)[..len];
        let want: Vec<f32> = r["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0.0f32; want.len()];
        dequantize_row(ty, raw, &mut got).unwrap();
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if std::env::var_os("GOLDEN_VERBOSE").is_some() && g.to_bits() != w.to_bits() {
                eprintln!("{} {ty} value {i}: {g} vs {w}", r["tensor"]);
            }
            assert!(
                ulps_apart(g, w) <= 1,
                "{} {} ({}): value {i}: ours {g} vs gguf {w}",
                r["model"],
                r["tensor"],
                ty
            );
        }
    }
    for needed in ["F32", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"] {
        assert!(types_seen.contains(needed), "golden data lacks {needed}");
    }
}

/// The activation formula of `tests/golden/golden_vec_dot.py`.
fn golden_activations(n: usize, case: i64) -> Vec<f32> {
    (0..n as i64)
        .map(|i| {
            let k = if i % 32 == 0 {
                508
            } else {
                (i * 7919 + case * 104729) % 1009 - 504
            };
            k as f32 / 256.0
        })
        .collect()
}

#[test]
fn quantization_and_dots_match_llama_cpp() {
    let records = load("tests/golden/vec_dot.json");
    assert!(!records.is_empty());
    for r in &records {
        let ty = type_named(r["type"].as_str().unwrap());
        let n = r["n"].as_u64().unwrap() as usize;
        let case = r["case"].as_i64().unwrap();
        let (w_words, w_len) = hex_bytes(r["weight_hex"].as_str().unwrap());
        let (a_words, a_len) = hex_bytes(r["act_hex"].as_str().unwrap());
        let w = &bytemuck::cast_slice::<u64, u8>(&w_words)[..w_len];
        let a_ggml = &bytemuck::cast_slice::<u64, u8>(&a_words)[..a_len];
        let want = f32::from_bits(u32::from_str_radix(r["dot_bits"].as_str().unwrap(), 16).unwrap());

        // Our activation conversion reproduces ggml-cpu's bytes exactly.
        let x = golden_activations(n, case);
        let dot_ty = ty.vec_dot_type();
        let (mut a_words_ours, _) = hex_bytes(&"00".repeat(a_len));
        let a_ours = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut a_words_ours)[..a_len];
        quantize_row(dot_ty, &x, a_ours).unwrap();
        assert_eq!(a_ours, a_ggml, "{ty}: {dot_ty} activations differ from ggml's");

        let got = vec_dot(ty, w, a_ggml, n).unwrap();
        let scalar = vec_dot_scalar(ty, w, a_ggml, n).unwrap();
        let is_float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if has_avx2() && !is_float {
            // Same integer lanes, same FMA order: the very same bits.
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{ty} case {case}: ours {got} vs llama.cpp {want}"
            );
        } else {
            // Float types: the reference build reduces in 16 lanes (AVX-512).
            let tol = 1e-5 * want.abs().max(1.0);
            assert!(
                (got - want).abs() <= tol,
                "{ty} case {case}: ours {got} vs llama.cpp {want}"
            );
        }
        if std::env::var_os("GOLDEN_VERBOSE").is_some() {
            eprintln!("{ty} case {case}: ours {got} scalar {scalar} llama.cpp {want}");
        }
        let tol = 1e-4 * want.abs().max(1.0);
        assert!(
            (scalar - want).abs() <= tol,
            "{ty} case {case}: scalar {scalar} vs llama.cpp {want}"
        );
    }
}
