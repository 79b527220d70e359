//! The cache's one allocation: `n_slots` slots of `stride` bytes, the base
//! aligned to 4096 bytes.

use crate::aligned::AlignedBytes;

/// Alignment of the slab base: a page, so O_DIRECT reads may target slots
/// (when the stride is a multiple of the device's logical block size too).
pub const SLAB_ALIGN: usize = 4096;

pub(crate) struct Slab {
    bytes: AlignedBytes,
    stride: usize,
    n_slots: usize,
}

impl Slab {
    /// Allocates once, zeroed (so untouched pages stay unbacked until the
    /// cache fills them). An empty slab still holds one page, so the base is
    /// always a real aligned pointer.
    pub(crate) fn new(n_slots: usize, stride: usize) -> Self {
        let bytes = n_slots.checked_mul(stride).expect("slab size overflows usize");
        Self {
            bytes: AlignedBytes::zeroed(bytes.max(SLAB_ALIGN), SLAB_ALIGN),
            stride,
            n_slots,
        }
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.bytes.as_mut_ptr()
    }

    /// First `len` bytes of slot `slot`.
    pub(crate) fn slot(&self, slot: usize, len: usize) -> &[u8] {
        assert!(slot < self.n_slots && len <= self.stride);
        let at = slot * self.stride;
        &self.bytes.as_slice()[at..at + len]
    }

    /// Slots `first..first + count`, from the first's start to the end of
    /// the last's first `len` bytes.
    pub(crate) fn span(&self, first: usize, count: usize, len: usize) -> &[u8] {
        assert!(count > 0 && first + count <= self.n_slots && len <= self.stride);
        let at = first * self.stride;
        &self.bytes.as_slice()[at..at + (count - 1) * self.stride + len]
    }

    pub(crate) fn slot_mut(&mut self, slot: usize, len: usize) -> &mut [u8] {
        assert!(slot < self.n_slots && len <= self.stride);
        let at = slot * self.stride;
        &mut self.bytes.as_mut_slice()[at..at + len]
    }
}
