//! One owner of aligned, zeroed heap bytes: the neuron cache's slab, the I/O
//! engine's read buffers and the O_DIRECT probes all need memory whose base
//! meets the device's alignment, which `Vec<u8>` does not promise.

use std::alloc::{alloc_zeroed, dealloc, Layout};

/// `len` zeroed bytes whose base is aligned to `align` (a power of two),
/// allocated once. Zeroed, so pages never written stay unbacked. Sharing
/// across threads is the owner's business: [`as_mut_ptr`](Self::as_mut_ptr)
/// hands out the base for writers the borrow checker cannot see (the kernel
/// filling a read buffer), and the owner orders them (see the pool and the
/// slab).
pub struct AlignedBytes {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: plain bytes with a unique owner; who writes through the raw base
// pointer, and when, is governed by the owning type.
unsafe impl Send for AlignedBytes {}
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// At least one byte is allocated, so the base is always a real aligned pointer.
    ///
    /// # Panics
    /// If `align` is not a power of two or the size overflows a [`Layout`].
    pub fn zeroed(len: usize, align: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), align).expect("aligned buffer layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self { ptr, layout }
    }

    /// Bytes allocated (at least 1).
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr owns len() initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len()) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}
