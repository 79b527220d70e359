//! What the run was measured on: CPU, memory, the storage device and its
//! queue settings (sysfs), the filesystem, kernel, governor, temperatures,
//! the tool version and the plan. Written as `device.json` at the start of a
//! run (and `device-sessionN.json` at each resume).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};

fn read_trim(p: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// CPU model (x86 `model name`, else Arm `CPU implementer/part`), cores.
fn cpu() -> Value {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|n| n.trim() == k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let logical = info.lines().filter(|l| l.starts_with("processor")).count();
    let model = field("model name")
        .or_else(|| field("Hardware"))
        .or_else(|| {
            Some(format!(
                "arm implementer {} part {}",
                field("CPU implementer")?,
                field("CPU part")?
            ))
        })
        .unwrap_or_else(|| "unknown".into());
    let governors: std::collections::BTreeSet<String> = (0..logical.max(1))
        .filter_map(|i| read_trim(format!("/sys/devices/system/cpu/cpu{i}/cpufreq/scaling_governor")))
        .collect();
    let max_khz = read_trim("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
    json!({
        "model": model,
        "arch": std::env::consts::ARCH,
        "logical_cpus": logical,
        "available_parallelism": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "features": leanstream_kernels::Device::cpu_features(),
        "governors": governors,
        "max_freq_khz": max_khz,
    })
}

fn memory() -> Value {
    let info = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|v| v * 1024)
    };
    json!({ "total_bytes": kb("MemTotal:"), "available_bytes": kb("MemAvailable:") })
}

/// The sysfs block device directory holding `path` (the whole disk's when
/// `path` lives on a partition).
pub fn block_device(path: &Path) -> Option<PathBuf> {
    let dev = fs::metadata(path).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    if sys.join("queue").exists() {
        Some(sys)
    } else if sys.join("partition").exists() {
        sys.parent().map(Path::to_path_buf)
    } else {
        None
    }
}

/// Bytes read from the block device so far (sectors read × 512), from
/// `/sys/block/X/stat`: every read the device served, whoever issued it.
pub fn device_read_bytes(dev: &Path) -> Option<u64> {
    let stat = fs::read_to_string(dev.join("stat")).ok()?;
    let sectors: u64 = stat.split_whitespace().nth(2)?.parse().ok()?;
    Some(sectors * 512)
}

fn storage(path: &Path) -> Value {
    let Some(dev) = block_device(path) else {
        return json!({ "note": "no block device behind this path (tmpfs, overlay or network?)" });
    };
    let mut queue = BTreeMap::new();
    for k in [
        "scheduler",
        "nr_requests",
        "rotational",
        "logical_block_size",
        "physical_block_size",
        "max_sectors_kb",
        "max_hw_sectors_kb",
        "read_ahead_kb",
        "nomerges",
        "rq_affinity",
        "write_cache",
        "io_poll",
        "nr_hw_queues",
    ] {
        if let Some(v) = read_trim(dev.join("queue").join(k)) {
            queue.insert(k.to_string(), v);
        }
    }
    json!({
        "name": dev.file_name().map(|n| n.to_string_lossy().into_owned()),
        "sysfs": dev,
        "model": read_trim(dev.join("device/model")),
        "vendor": read_trim(dev.join("device/vendor")),
        "size_bytes": read_trim(dev.join("size")).and_then(|s| s.parse::<u64>().ok()).map(|s| s * 512),
        "queue": queue,
    })
}

/// Filesystem type, source and mount point of `path` from `/proc/self/mountinfo`.
fn filesystem(path: &Path) -> Value {
    let p = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut best: Option<(usize, Value)> = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let Some(sep) = f.iter().position(|&x| x == "-") else {
            continue;
        };
        let (Some(mnt), Some(fstype), Some(src)) = (f.get(4), f.get(sep + 1), f.get(sep + 2)) else {
            continue;
        };
        if p.starts_with(mnt) && best.as_ref().is_none_or(|(l, _)| mnt.len() >= *l) {
            best = Some((
                mnt.len(),
                json!({ "mount_point": mnt, "type": fstype, "source": src, "options": f.get(5) }),
            ));
        }
    }
    best.map(|b| b.1).unwrap_or(Value::Null)
}

/// Temperatures (°C) by sensor name from `/sys/class/thermal` and `/sys/class/hwmon`.
pub fn temperatures() -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if let Ok(rd) = fs::read_dir("/sys/class/thermal") {
        for e in rd.flatten() {
            let d = e.path();
            if let (Some(t), Some(kind)) = (read_trim(d.join("temp")), read_trim(d.join("type"))) {
                if let Ok(m) = t.parse::<f64>() {
                    out.insert(format!("{}:{kind}", e.file_name().to_string_lossy()), m / 1000.0);
                }
            }
        }
    }
    if let Ok(rd) = fs::read_dir("/sys/class/hwmon") {
        for e in rd.flatten() {
            let d = e.path();
            let name = read_trim(d.join("name")).unwrap_or_default();
            for i in 1..16 {
                if let Some(t) = read_trim(d.join(format!("temp{i}_input"))) {
                    if let Ok(m) = t.parse::<f64>() {
                        out.insert(
                            format!("{}:{name}:temp{i}", e.file_name().to_string_lossy()),
                            m / 1000.0,
                        );
                    }
                }
            }
        }
    }
    out
}

/// The hottest sensor, if any.
pub fn max_temperature() -> Option<f32> {
    temperatures()
        .values()
        .copied()
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))
        .map(|t| t as f32)
}

#[derive(Debug, Serialize)]
struct Tool {
    name: &'static str,
    version: &'static str,
}

/// The device record of a run measuring on `path` (the file or directory under test).
pub fn describe(path: &Path, plan: &crate::plan::Plan) -> Value {
    let uname = {
        // SAFETY: utsname is plain old data; uname fills it.
        let mut u: libc::utsname = unsafe { std::mem::zeroed() };
        let field = |f: &[libc::c_char]| {
            let bytes: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        if unsafe { libc::uname(&mut u) } == 0 {
            json!({ "sysname": field(&u.sysname), "release": field(&u.release), "version": field(&u.version), "machine": field(&u.machine), "nodename": field(&u.nodename) })
        } else {
            Value::Null
        }
    };
    json!({
        "recorded_unix_s": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "tool": Tool { name: "leanstream-profile", version: env!("CARGO_PKG_VERSION") },
        "cpu": cpu(),
        "memory": memory(),
        "kernel": uname,
        "target_path": path,
        "storage": storage(path),
        "filesystem": filesystem(path),
        "temperatures_c": temperatures(),
        "plan": plan,
    })
}
