//! Files replaced whole or not at all. A file is written beside its target
//! as `NAME.tmp`, synced, renamed over the target, and the folder synced, so
//! a crash leaves the old file or the new one, never a torn one. The target's
//! folder is made when missing (a fresh machine has no cache folders yet).
//!
//! Errors are the plain `io::Error`; callers name the file in their own error
//! type.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Where `path` is written before it replaces the target: `.tmp` appended to
/// the whole name, so `model.lsflash` and `model.lstab` never share one.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Makes `path`'s folder and its parents where they are missing.
pub fn create_parent(path: &Path) -> io::Result<()> {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir),
        None => Ok(()),
    }
}

/// Renames the written and synced `tmp` over `path`, then syncs the folder so
/// that the rename itself survives a crash (best effort: not every filesystem
/// lets a folder be synced).
pub fn commit(tmp: &Path, path: &Path) -> io::Result<()> {
    std::fs::rename(tmp, path)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Replaces `path` with `bytes`: folder made, temp file written and synced,
/// renamed over the target. On failure the temp file is removed.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    create_parent(path)?;
    let tmp = tmp_path(path);
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    commit(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder of this test's own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("leanstream-durable-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_write_makes_the_folder_and_replaces_the_file_whole() {
        let dir = scratch("replace");
        let path = dir.join("new/sub/table.lstab");
        write(&path, b"first").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        write(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        assert!(!tmp_path(&path).exists(), "the temp file is renamed away");
        assert_eq!(tmp_path(Path::new("a/m.lsflash")), Path::new("a/m.lsflash.tmp"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_whole() {
        let dir = scratch("fail");
        let path = dir.join("table.lstab");
        write(&path, b"old").unwrap();
        // A folder where the temp file must go makes its creation fail.
        std::fs::create_dir(tmp_path(&path)).unwrap();
        assert!(write(&path, b"new").is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        // A file where a folder must be made fails too, as an error.
        assert!(write(&dir.join("table.lstab/inner.lspred"), b"x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
