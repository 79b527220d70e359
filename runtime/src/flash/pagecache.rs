//! The page cache and a packed file: LeanStream's memory budget is only real
//! if the kernel does not keep the file's pages on our behalf, so every
//! buffered read of a `.lsflash` file is followed by [`drop_cached`], and
//! [`cached_bytes`] checks (with `mincore`) what is left.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::{Result, RuntimeError};

/// Opens `path` for buffered reads that pull in nothing beyond what they ask
/// for: `POSIX_FADV_RANDOM` turns readahead off (with an 8 MiB readahead
/// window, a read of 8 header bytes would otherwise cache 8 MiB, and pages
/// still in flight escape a later [`drop_cached`]).
pub fn open_uncached(path: &Path) -> std::io::Result<File> {
    let file = File::open(path)?;
    // SAFETY: plain syscall on an open descriptor; advice only.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
    }
    Ok(file)
}

/// Asks the kernel to drop all of `file`'s clean cached pages: the whole
/// file, not just the range read, because readahead pulls in neighbours.
/// Advice only: failure changes nothing but memory use.
pub fn drop_cached(file: &File) {
    // SAFETY: plain syscall on an open descriptor.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Bytes of the file at `path` resident in the page cache now, and the file's
/// length, from `mincore` over a fresh read-only mapping (mapping faults
/// nothing in, so the check does not disturb what it measures).
pub fn cached_bytes(path: &Path) -> Result<(u64, u64)> {
    let file = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
    let len = file.metadata().map_err(|e| RuntimeError::io(path, e))?.len();
    if len == 0 {
        return Ok((0, 0));
    }
    // SAFETY: the map is read-only and never dereferenced; only mincore sees it.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| RuntimeError::io(path, e))?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let pages = len.div_ceil(page) as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: the range is the mapping we own; `vec` has one byte per page.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(RuntimeError::io(path, std::io::Error::last_os_error()));
    }
    let resident = vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
    Ok(((resident * page).min(len), len))
}
