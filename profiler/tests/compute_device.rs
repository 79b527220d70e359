//! `leanstream-profile compute --device`: a bad device name is an error
//! naming it; `cuda` measures the GPU backend's kernels where a device is
//! present (every condition sampled into the run directory) and is an
//! ordinary "no CUDA device" error, never a panic, where there is none.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use leanstream_kernels::GgmlType;
use leanstream_profiler::shard::ShardStore;
use leanstream_runtime::flash::pack::{pack, PackOptions};
use leanstream_runtime::flash::DownType;
use leanstream_runtime::synthetic::SyntheticSpec;

const BIN: &str = env!("CARGO_BIN_EXE_leanstream-profile");

/// A tiny model packed with Q8_0 down columns (what the device's FFN reads).
fn packed(dir: &Path) -> PathBuf {
    let gguf = dir.join("tiny.gguf");
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    std::fs::write(&gguf, spec.build().unwrap().to_bytes()).unwrap();
    let out = dir.join("tiny.lsflash");
    let opts = PackOptions {
        down: DownType::Q8_0,
        ..PackOptions::default()
    };
    pack(&gguf, &out, &opts).unwrap();
    out
}

fn compute(model: &Path, out: &Path, device: &str) -> Output {
    Command::new(BIN)
        .args(["--quiet", "compute", "--model"])
        .arg(model)
        .args(["--device", device, "--budget", "3s", "--ctx", "8", "--stages", "1,2"])
        .args(["--background-io", "off", "--out"])
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn compute_on_cuda_measures_or_says_there_is_no_device() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("compute-device-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = packed(&dir);

    let o = compute(&model, &dir.join("tpu"), "tpu");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--device \"tpu\": expected cpu, cuda or cuda:N"),
        "{err}"
    );

    let out = dir.join("cuda");
    let o = compute(&model, &out, "cuda");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    if o.status.success() {
        let (samples, problems, _) = ShardStore::open(&out).unwrap().load().unwrap();
        assert!(
            problems.is_empty() && samples.height() > 0,
            "no samples in {}: {err}",
            out.display()
        );
    } else {
        assert!(err.contains("no CUDA device"), "{err}");
    }
}
