//! The cache's one allocation: `n_slots` slots of `stride` bytes, the base
//! aligned to 4096 bytes.

use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Alignment of the slab base: a page, so O_DIRECT reads may target slots
/// (when the stride is a multiple of the device's logical block size too).
pub const SLAB_ALIGN: usize = 4096;

pub(crate) struct Slab {
    base: *mut u8,
    layout: Layout,
    stride: usize,
    n_slots: usize,
}

// SAFETY: the slab is plain bytes owned by one `NeuronCache`; access goes
// through `&self`/`&mut self` of the cache, so the borrow checker governs it.
unsafe impl Send for Slab {}
unsafe impl Sync for Slab {}

impl Slab {
    /// Allocates once, zeroed (so untouched pages stay unbacked until the
    /// cache fills them). An empty slab still holds one page, so the base is
    /// always a real aligned pointer.
    pub(crate) fn new(n_slots: usize, stride: usize) -> Self {
        let bytes = n_slots.checked_mul(stride).expect("slab size overflows usize");
        let layout = Layout::from_size_align(bytes.max(SLAB_ALIGN), SLAB_ALIGN).expect("slab layout");
        // SAFETY: the layout has a non-zero size.
        let base = unsafe { alloc_zeroed(layout) };
        if base.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Self {
            base,
            layout,
            stride,
            n_slots,
        }
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    /// First `len` bytes of slot `slot`.
    pub(crate) fn slot(&self, slot: usize, len: usize) -> &[u8] {
        assert!(slot < self.n_slots && len <= self.stride);
        // SAFETY: in bounds of the allocation (checked above); shared borrow of self.
        unsafe { std::slice::from_raw_parts(self.base.add(slot * self.stride), len) }
    }

    pub(crate) fn slot_mut(&mut self, slot: usize, len: usize) -> &mut [u8] {
        assert!(slot < self.n_slots && len <= self.stride);
        // SAFETY: in bounds (checked above); unique borrow of self.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(slot * self.stride), len) }
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.base, self.layout) }
    }
}
