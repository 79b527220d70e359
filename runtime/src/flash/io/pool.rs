//! A fixed pool of aligned read buffers, allocated once.

use crate::aligned::AlignedBytes;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

/// `count` buffers of `size` bytes, each aligned to `align`, in one allocation.
///
/// `refs[i]` is 0 when buffer i is free; the engine holds 1 while a read is in
/// flight, and every `Completed` view holds 1 until dropped.
pub(crate) struct Pool {
    bytes: AlignedBytes,
    pub(crate) size: usize,
    refs: Box<[AtomicU32]>,
    /// Called when a holder outside the engine frees a buffer (the I/O
    /// thread sleeps while every buffer is held and wakes on it).
    on_free: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl Pool {
    pub(crate) fn new(count: usize, size: usize, align: usize) -> Arc<Self> {
        assert!(count > 0 && size > 0 && align.is_power_of_two() && size.is_multiple_of(align));
        // Who may touch which buffer is governed by `refs` (written by one
        // read while in flight, shared read-only afterwards).
        Arc::new(Self {
            bytes: AlignedBytes::zeroed(count * size, align),
            size,
            refs: (0..count).map(|_| AtomicU32::new(0)).collect(),
            on_free: OnceLock::new(),
        })
    }

    pub(crate) fn count(&self) -> usize {
        self.refs.len()
    }

    /// Claims a free buffer, searching from `hint`.
    pub(crate) fn claim(&self, hint: usize) -> Option<usize> {
        let n = self.refs.len();
        (0..n).map(|k| (hint + k) % n).find(|&i| {
            self.refs[i]
                .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Sets the holders of a buffer the engine has claimed (0 frees it).
    pub(crate) fn set_refs(&self, buf: usize, refs: u32) {
        self.refs[buf].store(refs, Ordering::Release);
    }

    pub(crate) fn release(&self, buf: usize) {
        if self.refs[buf].fetch_sub(1, Ordering::Release) == 1 {
            if let Some(f) = self.on_free.get() {
                f();
            }
        }
    }

    /// Sets the callback for buffers freed by their holders (once).
    pub(crate) fn set_on_free(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_free.set(f);
    }

    pub(crate) fn free_count(&self) -> usize {
        self.refs.iter().filter(|r| r.load(Ordering::Relaxed) == 0).count()
    }

    pub(crate) fn ptr(&self, buf: usize) -> *mut u8 {
        assert!(buf < self.count(), "pool buffer {buf} of {}", self.count());
        // SAFETY: buf < count, so the offset stays inside the allocation.
        unsafe { self.bytes.as_mut_ptr().add(buf * self.size) }
    }
}

/// A completed request: a read-only view of its bytes inside a pool buffer.
/// Dropping it (or passing it to `release`) returns its share of the buffer.
/// It is `Send`, so compute on another thread can hold it.
pub struct Completed {
    /// The caller's tag from `Request::id`.
    pub id: u32,
    pub(crate) pool: Arc<Pool>,
    pub(crate) buf: usize,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

impl Completed {
    /// The requested bytes.
    pub fn data(&self) -> &[u8] {
        // SAFETY: the read into this buffer completed before this view was made
        // (the engine synchronised with the backend), nobody writes the buffer
        // while refs > 0, and start + len <= size.
        unsafe { std::slice::from_raw_parts(self.pool.ptr(self.buf).add(self.start), self.len) }
    }

    /// Returns the buffer share to the pool (same as dropping).
    pub fn release(self) {}
}

impl std::fmt::Debug for Completed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completed")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for Completed {
    fn drop(&mut self) {
        self.pool.release(self.buf);
    }
}
