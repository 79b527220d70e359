//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// File name of each reference model inside `$LEANSTREAM_HOME/models/<name>/`.
fn file_name(name: &str) -> &'static str {
    match name {
        "smollm2" => "SmolLM2-135M-Instruct.Q4_1.gguf",
        "gemma3" => "gemma-3-270m-q4_k_m.gguf",
        other => panic!("unknown reference model '{other}' (expected smollm2 or gemma3)"),
    }
}

/// Path of a reference model ("smollm2" or "gemma3"): `$LEANSTREAM_SMOLLM2` /
/// `$LEANSTREAM_GEMMA3` when set, else the `leanstream fetch` cache under
/// `$LEANSTREAM_HOME` (default `~/.cache/leanstream`). When the file is not
/// there, prints a visible SKIPPED line and returns `None`.
pub fn model_path(name: &str) -> Option<PathBuf> {
    let file = file_name(name);
    let var = format!("LEANSTREAM_{}", name.to_uppercase());
    let path = match std::env::var_os(&var).filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("LEANSTREAM_HOME")
                .filter(|h| !h.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/leanstream")))
                .unwrap_or_else(|| PathBuf::from(".cache/leanstream"));
            home.join("models").join(name).join(file)
        }
    };
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "SKIPPED: {name} model not found at {} (set {var} or run `leanstream fetch {name}`)",
            path.display()
        );
        None
    }
}
