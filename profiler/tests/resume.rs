//! End-to-end mechanics of `leanstream-profile`: SIGKILL and resume, Ctrl-C,
//! and a corrupt shard, against the real binary on a tiny O_DIRECT file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use leanstream_profiler::shard::ShardStore;

#[path = "../../runtime/tests/common/mod.rs"]
mod common;

const BIN: &str = env!("CARGO_BIN_EXE_leanstream-profile");
const REPS: u64 = 1500;
const CONDITIONS: u64 = 8;

/// A scratch directory on the target's filesystem (not tmpfs: O_DIRECT).
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("profile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A deterministic plan: 2 engines × 2 sizes × 2 queue depths, fixed reps,
/// a shard per visit, small visits so the run commits many shards.
fn io_command(data: &Path, out: &Path, reps: u64) -> Command {
    let mut c = Command::new(BIN);
    c.args(["--quiet", "io", "--dir"])
        .arg(data)
        .args([
            "--file-size",
            "8m",
            "--block-sizes",
            "4k,8k",
            "--queue-depths",
            "1,4",
            "--workers",
            "1",
        ])
        .args([
            "--patterns",
            "random",
            "--engines",
            "io_uring,pread",
            "--budget",
            "1h",
            "--seed",
            "42",
        ])
        .args([
            "--reps",
            &reps.to_string(),
            "--flush-every",
            "0s",
            "--min-batch",
            "25",
            "--max-batch",
            "25",
        ])
        .arg("--out")
        .arg(out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// (condition_id, sample_idx) of every committed sample, and the row count.
fn keys(dir: &Path) -> (BTreeSet<(u32, u64)>, usize) {
    let store = ShardStore::open(dir).unwrap();
    let (df, problems, _) = store.load().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let ids = df.column("condition_id").unwrap().u32().unwrap().clone();
    let idx = df.column("sample_idx").unwrap().u64().unwrap().clone();
    let set: BTreeSet<(u32, u64)> = ids
        .iter()
        .zip(idx.iter())
        .map(|(c, i)| (c.unwrap(), i.unwrap()))
        .collect();
    (set, df.height())
}

fn committed_shards(dir: &Path) -> usize {
    std::fs::read(dir.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["shards"].as_array().map(|a| a.len()))
        .unwrap_or(0)
}

fn finished(dir: &Path) -> bool {
    std::fs::read(dir.join("manifest.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| !v["finished"].is_null())
}

/// Starts the run, waits for `shards` committed shards, sends `signal`.
fn interrupt(data: &Path, out: &Path, shards: usize, signal: i32) -> std::process::ExitStatus {
    let mut child = io_command(data, out, REPS).spawn().unwrap();
    let t0 = Instant::now();
    while committed_shards(out) < shards {
        assert!(t0.elapsed() < Duration::from_secs(120), "no shards committed");
        assert!(
            child.try_wait().unwrap().is_none(),
            "run ended before it was interrupted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(child.id() as i32, signal) };
    let status = child.wait().unwrap();
    assert!(
        !finished(out),
        "the run finished before the signal; the test proves nothing"
    );
    status
}

fn resume(out: &Path) {
    let o = Command::new(BIN)
        .args(["--quiet", "--resume"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(finished(out));
}

#[test]
fn sigkill_then_resume_equals_an_uninterrupted_run() {
    let root = scratch("kill");
    let data = root.join("data");

    let full = root.join("full");
    let o = io_command(&data, &full, REPS).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (expected, rows) = keys(&full);
    assert_eq!(expected.len() as u64, CONDITIONS * REPS);
    assert_eq!(rows, expected.len());

    let killed = root.join("killed");
    let status = interrupt(&data, &killed, 5, libc::SIGKILL);
    assert!(!status.success());
    let (partial, partial_rows) = keys(&killed);
    assert!(!partial.is_empty() && partial.len() < expected.len());
    assert_eq!(partial_rows, partial.len(), "duplicates after the kill");

    resume(&killed);
    let (got, rows) = keys(&killed);
    assert_eq!(rows, got.len(), "duplicated samples");
    assert_eq!(got, expected, "lost or extra samples");
    assert!(partial.is_subset(&got), "a committed sample was lost");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ctrl_c_flushes_and_exits_cleanly() {
    let root = scratch("int");
    let data = root.join("data");
    let out = root.join("run");
    let child = io_command(&data, &out, REPS).spawn().unwrap();
    let t0 = Instant::now();
    while committed_shards(&out) < 3 {
        assert!(t0.elapsed() < Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(2));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("--resume"), "{stderr}");
    // Everything in the directory is committed: no stray temporary shard.
    let stray: Vec<_> = std::fs::read_dir(out.join("shards"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(stray.is_empty());
    let (set, rows) = keys(&out);
    assert_eq!(set.len(), rows);
    resume(&out);
    let (set, rows) = keys(&out);
    assert_eq!(
        (set.len(), rows as u64),
        ((CONDITIONS * REPS) as usize, CONDITIONS * REPS)
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_full_disk_stops_the_run_cleanly_and_resume_elsewhere_completes_it() {
    let root = scratch("full");
    let data = root.join("data");
    let Some(disk) = common::SmallDisk::mount(&root.join("small"), 96 << 10) else {
        return;
    };
    let out = disk.dir.join("run");
    let o = io_command(&data, &out, REPS).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    eprintln!("{stderr}");
    assert!(
        !o.status.success(),
        "the run fit on the small disk; the test proves nothing"
    );
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(stderr.contains(&out.display().to_string()), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // What was committed before the disk filled is intact.
    let (partial, rows) = keys(&out);
    assert!(!partial.is_empty(), "nothing committed before the disk filled");
    assert_eq!(rows, partial.len());
    // The user moves the run to a disk with room and resumes it there.
    let moved = root.join("moved");
    let cp = Command::new("cp").arg("-a").arg(&out).arg(&moved).status().unwrap();
    assert!(cp.success());
    drop(disk);
    resume(&moved);
    let (got, rows) = keys(&moved);
    assert_eq!(rows, got.len(), "duplicated samples");
    assert_eq!(got.len() as u64, CONDITIONS * REPS, "lost or extra samples");
    assert!(partial.is_subset(&got), "a committed sample was lost");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn corrupt_shard_is_reported_and_the_rest_stays_usable() {
    let root = scratch("corrupt");
    let data = root.join("data");
    let out = root.join("run");
    // Fewer samples: this test is about the summary.
    let o = io_command(&data, &out, 100).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let store = ShardStore::open(&out).unwrap();
    let victim = store.manifest.shards[2].clone();
    let bad = out.join(&victim.file);
    let len = std::fs::metadata(&bad).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bad)
        .unwrap()
        .set_len(len - 7)
        .unwrap();

    let o = Command::new(BIN)
        .args(["summary", "--json", "--no-plots"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(&victim.file) && stderr.contains("truncated"),
        "{stderr}"
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rows.len() as u64, CONDITIONS);
    let total: u64 = rows.iter().map(|r| r["samples"].as_u64().unwrap()).sum();
    assert_eq!(total, CONDITIONS * 100 - victim.rows);
    for r in &rows {
        for k in [
            "sweep",
            "engine",
            "pattern",
            "block_size",
            "queue_depth",
            "workers",
            "samples",
            "throughput_bytes_s",
            "lat_p50_us",
            "lat_p99_us",
        ] {
            assert!(!r[k].is_null(), "{k} missing in {r}");
        }
        assert_eq!(r["sweep"], "io");
        assert!(r["throughput_bytes_s"].as_f64().unwrap() > 0.0);
        assert!(r["lat_p99_us"].as_f64().unwrap() >= r["lat_p50_us"].as_f64().unwrap());
    }

    // Resume after the damage measures exactly the lost samples again.
    resume(&out);
    let (set, rows) = keys(&out);
    assert_eq!(
        (set.len(), rows as u64),
        ((CONDITIONS * 100) as usize, CONDITIONS * 100)
    );
    assert!(out.join("quarantine").read_dir().unwrap().count() >= 1);

    // Plots are written.
    let o = Command::new(BIN).args(["summary"]).arg(&out).output().unwrap();
    assert!(o.status.success());
    assert!(out.join("plots/latency_cdf_by_size.svg").exists());
    assert!(out.join("plots/throughput_vs_qd.svg").exists());
    let _ = std::fs::remove_dir_all(&root);
}
