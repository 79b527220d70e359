//! A packed model's FFN held whole in memory: every layer's bundles (or the
//! source's gate and up rows) and, where the file has down tiles, each
//! layer's down matrix gathered once.

use leanstream_kernels::sparse_ffn::BundleFormat;

/// Every bundle in memory.
pub struct Resident {
    /// Per layer, all bundles in neuron order; where the down matrix is
    /// held whole, the gate rows and then the up rows instead (the source's
    /// two matrices: each stage-1 pass streams one of them).
    pub bundles: Vec<Vec<u8>>,
    /// Per layer with down tiles in the file, its down matrix gathered once
    /// (the source's row-major bytes, u64-backed for block alignment; its
    /// format is [`DownLayout::Matrix`](leanstream_kernels::sparse_ffn::DownLayout::Matrix)); empty for down columns.
    pub down: Vec<Vec<u64>>,
    /// Bytes of each `down` matrix.
    pub down_len: Vec<usize>,
    /// Per layer, the format these bytes are in ([`BundleFormat::resident`]
    /// of the file's).
    pub formats: Vec<BundleFormat>,
}

impl Resident {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bundles
            .iter()
            .map(|b| b.len())
            .chain(self.down_len.iter().copied())
            .sum::<usize>() as u64
    }

    pub(super) fn down(&self, l: usize) -> Option<&[u8]> {
        let m = self.down.get(l).filter(|m| !m.is_empty())?;
        Some(&bytemuck::cast_slice::<u64, u8>(m)[..self.down_len[l]])
    }
}
