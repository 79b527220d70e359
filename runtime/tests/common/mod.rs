//! Helpers shared by the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

/// Path of a reference model ("smollm2" or "gemma3"): `$LEANSTREAM_SMOLLM2` /
/// `$LEANSTREAM_GEMMA3` when set, else the `leanstream fetch` cache. A
/// missing model fails the test unless `LEANSTREAM_ALLOW_MISSING_MODELS=1`
/// (then a SKIPPED line and `None`).
pub fn model_path(name: &str) -> Option<PathBuf> {
    leanstream_runtime::fetch::reference_model(name).unwrap_or_else(|e| panic!("{e}"))
}

/// Greedy tokens and the logits before each.
pub type Run = (Vec<u32>, Vec<Vec<f32>>);

/// Greedy decoding of `n` tokens after `prompt` with a `.lsflash` model's engine.
pub fn greedy_flash(
    fm: &leanstream_runtime::engine::FlashModel,
    engine: &mut leanstream_runtime::engine::FlashEngine,
    prompt: &[u32],
    n: usize,
) -> leanstream_runtime::Result<Run> {
    let mut st = fm.model.new_state(prompt.len() + n + 1, prompt.len().max(8), 1);
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    fm.forward(&mut st, engine, prompt, 0, prompt.len() - 1..prompt.len())?;
    for pos in prompt.len()..prompt.len() + n {
        let l = fm.model.logits(&mut st, 0, 1)?.to_vec();
        let tok = leanstream_runtime::generate::argmax(&l);
        toks.push(tok);
        logits.push(l);
        fm.forward(&mut st, engine, &[tok], pos, 0..1)?;
    }
    Ok((toks, logits))
}

/// Greedy decoding of `n` tokens after `prompt` with the GGUF engine on `src`.
pub fn greedy_gguf(src: &std::path::Path, prompt: &[u32], n: usize) -> Run {
    let m = leanstream_runtime::model::Model::load(src).unwrap();
    let mut st = m.new_state(prompt.len() + n + 1, prompt.len(), 1);
    let (mut toks, mut logits) = (Vec::new(), Vec::new());
    m.forward_outputs(&mut st, prompt, 0, prompt.len() - 1..prompt.len())
        .unwrap();
    for pos in prompt.len()..prompt.len() + n {
        let l = m.logits(&mut st, 0, 1).unwrap().to_vec();
        let tok = leanstream_runtime::generate::argmax(&l);
        toks.push(tok);
        logits.push(l);
        m.forward(&mut st, &[tok], pos).unwrap();
    }
    (toks, logits)
}

/// Whether two runs have the same tokens and bit-identical logits.
pub fn same_bits(a: &Run, b: &Run) -> bool {
    a.0 == b.0
        && a.1.len() == b.1.len()
        && a.1
            .iter()
            .zip(&b.1)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// Packs `src` into `dir/NAME.lsflash` with `down` columns or tiles and an
/// optional placement, without thresholds.
pub fn pack_down(
    dir: &std::path::Path,
    src: &std::path::Path,
    name: &str,
    placement: Option<Vec<Vec<u32>>>,
    down: leanstream_runtime::flash::DownType,
) -> PathBuf {
    let out = dir.join(format!("{name}.lsflash"));
    let opts = leanstream_runtime::flash::PackOptions {
        down,
        placement,
        sparsity: Vec::new(),
        neuron_scores: Vec::new(),
        progress: false,
    };
    leanstream_runtime::flash::pack(src, &out, &opts).unwrap();
    out
}

/// A tmpfs of a few bytes mounted over a directory: a disk that really
/// fills (ENOSPC from the kernel). Unmounted on drop.
pub struct SmallDisk {
    pub dir: PathBuf,
}

impl SmallDisk {
    /// Mounts a `size`-byte tmpfs on `dir`; `None` (with the reason on
    /// stderr) where this process may not mount, e.g. without root.
    pub fn mount(dir: &std::path::Path, size: u64) -> Option<SmallDisk> {
        std::fs::create_dir_all(dir).unwrap();
        let _ = std::process::Command::new("umount").arg(dir).output();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(SmallDisk { dir: dir.to_path_buf() }),
            Ok(o) => {
                eprintln!(
                    "SKIPPED the real full disk: mount: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                None
            }
            Err(e) => {
                eprintln!("SKIPPED the real full disk: mount: {e}");
                None
            }
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
    }
}

/// Makes writes of `cmd`'s process fail past `bytes` per file (EFBIG, the
/// way a quota or a full disk fails a write), without root.
pub fn limit_file_size(cmd: &mut std::process::Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Ignored, SIGXFSZ would kill the process instead of failing the write.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `policy` over `fm` with `cache_bytes` of LRU cache, no merged gaps,
/// sparsity 0 and no artifacts: the plain engine tests vary from.
pub fn plain_options(
    fm: &leanstream_runtime::engine::FlashModel,
    policy: leanstream_runtime::engine::Policy,
    cache_bytes: u64,
) -> leanstream_runtime::engine::EngineOptions {
    leanstream_runtime::engine::EngineOptions {
        policy,
        cache_bytes,
        cache_policy: leanstream_runtime::engine::CachePolicy::Lru,
        merge_gap_bytes: 0,
        staging_bytes: None,
        level: leanstream_runtime::flash::SparsityLevel::dense(fm.flash.n_layer()),
        record: false,
        trace: None,
        speculation: None,
        retention: None,
    }
}
