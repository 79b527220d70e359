//! Every CUDA kernel source compiles with NVRTC for the architectures the
//! backend targets, and its PTX exports every kernel the host will look up.
//! No GPU is needed: NVRTC runs on the CPU (`scripts/test.sh` installs its
//! Python wheel). Without the library the tests fail, naming what to install,
//! unless LEANSTREAM_ALLOW_MISSING_MODELS=1 (offline machines) lets them skip.

use leanstream_cuda::nvrtc::{compile, compile_text, version};
use leanstream_cuda::sources::{expand, kernel_names, HEADERS, KERNELS};
use leanstream_cuda::{library, CudaError};
use leanstream_kernels::GgmlType;

/// Jetson Orin's, H200's, and the oldest the kernels support.
const ARCHS: &[&str] = &["compute_75", "compute_87", "compute_90"];

fn nvrtc_or_skip() -> bool {
    match library::nvrtc() {
        Ok(()) => true,
        Err(e) if std::env::var("LEANSTREAM_ALLOW_MISSING_MODELS").as_deref() == Ok("1") => {
            eprintln!("SKIPPED: {e}");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn every_kernel_source_compiles_and_exports_its_kernels() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    for source in KERNELS {
        let names = kernel_names(&expand(source.name).unwrap());
        assert!(!names.is_empty(), "{} defines no kernel", source.name);
        for &arch in ARCHS {
            let ptx = compile(source.name, arch).unwrap_or_else(|e| panic!("{e}")).to_src();
            for name in &names {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{} for {arch}: no kernel {name} in the PTX",
                    source.name
                );
            }
        }
    }
}

#[test]
fn a_compile_error_names_the_source_and_carries_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let text = expand("ops.cu").unwrap() + "\nextern \"C\" __global__ void broken() { undefined_thing(); }\n";
    match compile_text("ops-broken.cu", &text, "compute_87") {
        Err(CudaError::Compile { source_name, arch, log }) => {
            assert_eq!((source_name.as_str(), arch.as_str()), ("ops-broken.cu", "compute_87"));
            assert!(log.contains("undefined_thing"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// The type ids the kernels switch on are GGML's, as the host passes them.
#[test]
fn kernel_type_ids_are_ggmls() {
    let blocks = HEADERS.iter().find(|h| h.name == "blocks.cuh").unwrap().text;
    let types = [
        ("GGML_F32", GgmlType::F32),
        ("GGML_F16", GgmlType::F16),
        ("GGML_Q4_0", GgmlType::Q4_0),
        ("GGML_Q4_1", GgmlType::Q4_1),
        ("GGML_Q5_0", GgmlType::Q5_0),
        ("GGML_Q5_1", GgmlType::Q5_1),
        ("GGML_Q8_0", GgmlType::Q8_0),
        ("GGML_Q8_1", GgmlType::Q8_1),
        ("GGML_Q4_K", GgmlType::Q4K),
        ("GGML_Q5_K", GgmlType::Q5K),
        ("GGML_Q6_K", GgmlType::Q6K),
        ("GGML_Q8_K", GgmlType::Q8K),
    ];
    for (name, ty) in types {
        let line = blocks
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} not defined in blocks.cuh"));
        let id: u32 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert_eq!(id, ty.id(), "{name}");
    }
}

/// The matvec kernels' order ids are the host's (`leanstream_cuda::order`).
#[test]
fn cpu_order_ids_are_the_hosts() {
    use leanstream_cuda::order::{ORDER_GENERIC, ORDER_LANES, ORDER_REPACK_GEMM, ORDER_REPACK_GEMV, ORDER_TILED};
    let header = HEADERS.iter().find(|h| h.name == "cpu_order.cuh").unwrap().text;
    for (name, id) in [
        ("ORDER_LANES", ORDER_LANES),
        ("ORDER_TILED", ORDER_TILED),
        ("ORDER_REPACK_GEMM", ORDER_REPACK_GEMM),
        ("ORDER_REPACK_GEMV", ORDER_REPACK_GEMV),
        ("ORDER_GENERIC", ORDER_GENERIC),
    ] {
        let line = header
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} not defined in cpu_order.cuh"));
        assert_eq!(line.rsplit(' ').next().unwrap().parse::<i32>().unwrap(), id, "{name}");
    }
}
