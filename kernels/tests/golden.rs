//! Golden data from outside our code: dequantization by the `gguf` Python
//! package on real model blocks (`data/golden/dequant.json`, see
//! `data/golden/README.md`). It needs no model file to run.

use leanstream_kernels::dequant::dequantize_row;
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
