//! The CUDA kernel sources, embedded at build time from `kernels/cuda/`.
//!
//! NVRTC takes one translation unit; [`expand`] splices the `#include "…"`
//! headers in (each once: they are `#pragma once`), so what is compiled is
//! exactly these files, whatever the machine's include paths.

use crate::{CudaError, Result};

/// A source file by name.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

macro_rules! source {
    ($name:literal) => {
        Source {
            name: $name,
            text: include_str!(concat!("../../kernels/cuda/", $name)),
        }
    };
}

/// Headers the kernels include.
pub const HEADERS: &[Source] = &[
    source!("blocks.cuh"),
    source!("common.cuh"),
    source!("cpu_order.cuh"),
    source!("norm_mean.cuh"),
];

/// One translation unit each.
pub const KERNELS: &[Source] = &[
    source!("quantize.cu"),
    source!("matvec.cu"),
    source!("ops.cu"),
    source!("attention.cu"),
    source!("ffn_stream.cu"),
];

fn find(name: &str) -> Option<&'static Source> {
    KERNELS.iter().chain(HEADERS).find(|s| s.name == name)
}

/// The text of kernel source `name` with its headers spliced in.
pub fn expand(name: &str) -> Result<String> {
    let source = find(name).ok_or_else(|| CudaError::UnknownSource(name.into()))?;
    expand_text(source.name, source.text)
}

/// [`expand`] for text that is not one of the embedded files (it may still
/// include the embedded headers).
pub fn expand_text(name: &str, text: &str) -> Result<String> {
    let mut out = String::with_capacity(text.len() * 2);
    let mut included = Vec::new();
    splice(name, text, &mut included, &mut out)?;
    Ok(out)
}

fn splice(name: &str, text: &str, included: &mut Vec<&'static str>, out: &mut String) -> Result<()> {
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed == "#pragma once" {
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("#include") {
            let header = rest.trim().trim_matches('"');
            let h = HEADERS
                .iter()
                .find(|h| h.name == header)
                .ok_or_else(|| CudaError::UnknownSource(format!("{header} (included by {name})")))?;
            if !included.contains(&h.name) {
                included.push(h.name);
                splice(h.name, h.text, included, out)?;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(())
}

/// Names of the `extern "C" __global__` kernels a source defines: those
/// written out, and those a macro stamps out (a `#define M(name, ...)` whose
/// body defines `__global__ void name(`), named at each `M(...)` use.
pub fn kernel_names(text: &str) -> Vec<String> {
    const GLOBAL: &str = "__global__ void ";
    let lines: Vec<&str> = text.lines().collect();
    let mut names = Vec::new();
    let mut macros = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some(def) = line.trim_start().strip_prefix("#define ") {
            // The macro and its continuation lines.
            let mut body = String::from(line);
            while lines[i].trim_end().ends_with('\\') && i + 1 < lines.len() {
                i += 1;
                body.push_str(lines[i]);
            }
            if let Some((name, params)) = def.split_once('(') {
                let first = params.split([',', ')']).next().unwrap_or("").trim();
                if !first.is_empty() && body.contains(&format!("{GLOBAL}{first}(")) {
                    macros.push(name.trim().to_string());
                }
            }
        } else if let Some(at) = line.find(GLOBAL) {
            let after = &line[at + GLOBAL.len()..];
            if let Some(end) = after.find('(') {
                names.push(after[..end].trim().to_string());
            }
        }
        i += 1;
    }
    for line in &lines {
        for m in &macros {
            if let Some(args) = line.trim_start().strip_prefix(&format!("{m}(")) {
                if let Some(name) = args.split([',', ')']).next() {
                    names.push(name.trim().to_string());
                }
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_kernels_cuda_is_embedded() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../kernels/cuda");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu") || n.ends_with(".cuh"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNELS.iter().chain(HEADERS).map(|s| s.name.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
    }

    #[test]
    fn headers_are_spliced_once_and_unknown_ones_are_errors() {
        let text = expand("matvec.cu").unwrap();
        // cpu_order.cuh includes blocks.cuh as common.cuh does; it must appear once.
        assert_eq!(text.matches("struct BlockQ4_0 {").count(), 1);
        assert!(!text.contains("#include"));
        assert!(!text.contains("#pragma once"));
        let err = expand_text("bad.cu", "#include \"missing.cuh\"\n").unwrap_err();
        assert!(err.to_string().contains("missing.cuh (included by bad.cu)"), "{err}");
        assert!(matches!(expand("nope.cu"), Err(CudaError::UnknownSource(_))));
    }

    #[test]
    fn kernel_names_are_found_written_out_and_stamped_by_macros() {
        let names = kernel_names(&expand("quantize.cu").unwrap());
        assert_eq!(
            names,
            ["quantize_q8_0", "quantize_q8_1", "quantize_q8_k", "convert_f16"]
        );
        let names = kernel_names(&expand("matvec.cu").unwrap());
        assert_eq!(names.len(), 10, "{names:?}");
        assert!(names.iter().all(|n| n.starts_with("matvec_")), "{names:?}");
        assert!(names.contains(&"matvec_q6_k".to_string()));
    }
}
