//! A disk that fills while `leanstream pack` writes: the command fails with
//! an error naming the file and the OS's reason, leaves neither the output
//! nor its temporary behind, and a later pack with room succeeds. Both a
//! per-file size limit (EFBIG, any user) and a real full filesystem (ENOSPC
//! on a small tmpfs, where the test may mount one).

#[path = "../../runtime/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use leanstream_kernels::GgmlType;
use leanstream_runtime::flash::LsFlash;
use leanstream_runtime::synthetic::SyntheticSpec;

const BIN: &str = env!("CARGO_BIN_EXE_leanstream");

fn dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("disk_full");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A synthetic model of about 5 MiB.
fn source() -> PathBuf {
    let mut spec = SyntheticSpec::tiny("llama");
    spec.weight_type = GgmlType::Q8_0;
    (spec.n_embd, spec.n_ff, spec.n_layer) = (256, 2048, 3);
    let src = dir().join("src.gguf");
    std::fs::write(&src, spec.build().unwrap().to_bytes()).unwrap();
    src
}

fn pack(src: &Path, out: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.args(["--threads", "2", "pack", "--model"])
        .arg(src)
        .arg("--out")
        .arg(out);
    c
}

/// Runs a pack that must fail for `reason`, then checks what it left.
fn fails_cleanly(mut cmd: Command, out: &Path, reason: &str) {
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    eprintln!("{stderr}");
    assert!(!o.status.success(), "pack succeeded on a full disk");
    assert!(stderr.contains(&out.display().to_string()), "{stderr}");
    assert!(stderr.contains(reason), "{stderr} does not say {reason}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".tmp");
    assert!(!out.exists(), "a partial {} was left", out.display());
    assert!(!Path::new(&tmp).exists(), "the temporary {tmp:?} was left");
}

#[test]
fn packing_onto_a_full_disk_fails_cleanly_and_a_later_pack_works() {
    let src = source();
    // A per-file limit of 1 MiB: the write past it fails with EFBIG.
    let out = dir().join("limited.lsflash");
    // A rerun's last pack left a whole file here.
    let _ = std::fs::remove_file(&out);
    let mut cmd = pack(&src, &out);
    common::limit_file_size(&mut cmd, 1 << 20);
    fails_cleanly(cmd, &out, "File too large");
    // A filesystem of 1 MiB: ENOSPC from the kernel.
    if let Some(disk) = common::SmallDisk::mount(&dir().join("small"), 1 << 20) {
        let out = disk.dir.join("full.lsflash");
        fails_cleanly(pack(&src, &out), &out, "No space left on device");
    }
    // With room, the same command works and the file is whole.
    let o = pack(&src, &out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    LsFlash::open(&out).unwrap().verify().unwrap();
}
